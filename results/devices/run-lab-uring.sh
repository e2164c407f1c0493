#!/bin/sh
# The io_uring engine in the lab, one boot: the devices lab test, then the 2 ms and 20 us device models,
# userspace (io_uring) against the kernel target in the same run. With no argument, the QD sweep into
# results/devices/uring; with "quick", 4 KiB random read QD1 and QD32 only, into results/devices/uring2:
#   flock /tmp/nvmeof-lab.lock .venv/bin/nvmeof-roce lab run --timeout 2400 -- sh results/devices/run-lab-uring.sh
#   flock /tmp/nvmeof-lab.lock .venv/bin/nvmeof-roce lab run --timeout 1500 -- sh results/devices/run-lab-uring.sh quick
cd /mnt/project || exit 1
if [ "$1" = quick ]; then
    OUT=results/devices/uring2
    JOBS="--jobs randread-4k-qd1,randread-4k-qd32"
else
    OUT=results/devices/uring
    JOBS=--qd-sweep
fi
mkdir -p $OUT
python3 -m pytest -p no:cacheprovider -q -s tests/lab/test_devices.py > $OUT/lab-test.txt 2>&1
echo "lab test: exit $?" >> $OUT/lab-test.txt
for dev in null_blk:2ms null_blk:20us; do
    name=$(echo $dev | tr ':' '-')
    rm -rf $OUT/$name
    python3 -m nvmeof_roce bench --device $dev $JOBS --no-perftest --runtime 8 --ramp 2 \
        --ns-size 128M --size 64M --out $OUT/$name > $OUT/$name.txt 2>&1
    echo "$dev: exit $?" >> $OUT/lab-test.txt
done
