#!/bin/bash
# In the lab guest (`nvmeof-roce lab blktests`, docs/conformance.md): blktests' nvme group against kernel nvmet
# and/or against the userspace target through its NVME_TARGET_CONTROL script, in one boot.
#   blktests-guest.sh SHARE "kernel ours" TESTS...
# SHARE/input holds blktests (built), the extra .debs and the kernel's config; each mode leaves
# SHARE/MODE.log (./check's console) and SHARE/MODE-results (its result files).
set -u
SHARE=$1
MODES=$2
shift 2
TESTS=("$@")
IN=$SHARE/input
IMG_SIZE=${NVME_IMG_SIZE:-512M}
CONTROL=/mnt/project/nvmeof_roce/lab/nvme_target_control.sh

say() { echo "[blktests-guest] $*"; }

# What blktests needs that the lab image does not have:
# bash's process substitution in ./check opens /dev/fd/N, which the lab's devtmpfs lacks
[ -e /dev/fd ] || ln -s /proc/self/fd /dev/fd
# xfsprogs (mkfs.xfs: nvme/012, 047) and bsdextrautils (column: ./check's summary)
# the libraries first: gawk pre-depends on libmpfr6
tools=$(ls "$IN"/debs/*.deb | grep -v '/lib')
{ dpkg -i "$IN"/debs/lib*.deb && dpkg -i $tools; } >/dev/null || { say "dpkg -i of the extra packages failed"; exit 1; }
# uuidgen (nvme/058): the kernel's random UUID, rather than uuid-runtime and its daemon
command -v uuidgen >/dev/null || printf '#!/bin/sh\ncat /proc/sys/kernel/random/uuid\n' > /usr/local/bin/uuidgen
chmod +x /usr/local/bin/uuidgen 2>/dev/null
# _have_kernel_option reads the kernel's config
mkdir -p /boot && cp "$IN/config-$(uname -r)" /boot/ || { say "no config-$(uname -r) in $IN"; exit 1; }
# nvmet's file backend opens with O_DIRECT, which tmpfs refuses before 6.6: blktests and its images go on ext4,
# on the scratch disk the host attached (so the images cost no guest memory)
mkfs.ext4 -q -F /dev/vdb && mkdir -p /mnt/scratch && mount /dev/vdb /mnt/scratch || { say "no scratch disk"; exit 1; }
cp -a "$IN/blktests" /mnt/scratch/blktests
modprobe -a nvme-fabrics nvme-rdma

rxe_on_lab_netdev() {
    # blktests' kernel path removes every rdma link and rdma_rxe after each test (stop_soft_rdma)
    rdma link show | grep -q 'netdev rxenet0' && return 0
    modprobe rdma_rxe && rdma link add rxe0 type rxe netdev rxenet0
    for _ in $(seq 100); do grep -q ACTIVE /sys/class/infiniband/*/ports/1/state 2>/dev/null && return 0; sleep 0.1; done
    return 1
}

run_check() {  # MODE: ./check with the config blktests was given, console to SHARE/MODE.log
    local mode=$1 start end
    start=$(date +%s)
    (cd /mnt/scratch/blktests && ./check -o "/mnt/scratch/results-$mode" "${TESTS[@]}") > "$SHARE/$mode.log" 2>&1
    end=$(date +%s)
    echo "$((end - start))" > "$SHARE/$mode.seconds"
    cp -a "/mnt/scratch/results-$mode" "$SHARE/$mode-results" 2>/dev/null
    say "$mode: ./check took $((end - start)) s"
}

for mode in $MODES; do
    case $mode in
    kernel)
        # bd=file only, the type ours answers (--show-blkdev-type): a bd=device run has no counterpart on ours and
        # would double nvmet's time
        printf 'NVMET_TRTYPES=rdma\nNVMET_BLKDEV_TYPES=file\nUSE_RXE=1\nNVME_IMG_SIZE=%s\n' "$IMG_SIZE" \
            > /mnt/scratch/blktests/config
        run_check kernel
        ;;
    ours)
        rxe_on_lab_netdev || { say "no rxe link on rxenet0"; exit 1; }
        export NVMEOF_BLKTESTS_STATE=/run/nvmeof-roce/blktests.state
        mkdir -p /run/nvmeof-roce
        # nvme/029 writes 1025 blocks in one passthrough command: nvmet-rdma's MDTS (1 MiB), 128 such buffers
        "$CONTROL" start --dir /mnt/scratch/ours --size "$IMG_SIZE" -- --mdts 8 --data-buffers 128 ||
            { say "the target did not start"; exit 1; }
        # USE_RXE=1: blktests' _nvme_requires asks for siw over RDMA otherwise, even with an external target
        printf 'NVME_TARGET_CONTROL=%s\nUSE_RXE=1\nNVME_IMG_SIZE=%s\n' "$CONTROL" "$IMG_SIZE" \
            > /mnt/scratch/blktests/config
        # nvme/031 makes a port in nvmet's configfs itself even through the hook (`_create_nvmet_port`): with the
        # module loaded that mkdir works; the port is never enabled (no subsystem is linked to it), so nothing
        # of nvmet listens: every connect reaches our target
        modprobe nvmet
        run_check ours
        modprobe -r nvmet
        "$CONTROL" stop
        cp /mnt/scratch/ours/target.log "$SHARE/ours-target.log"
        cp /mnt/scratch/ours/control.log "$SHARE/ours-control.log"
        ;;
    *)
        say "unknown mode $mode"; exit 1 ;;
    esac
done
exit 0
