#!/bin/sh
# The io_uring engine in the lab, one boot: the devices lab test, then the 2 ms and 20 us device models,
# userspace (io_uring) against the kernel target in the same run. With no argument, the QD sweep into
# results/devices/uring; with "quick", 4 KiB random read QD1 and QD32 only, into results/devices/uring2; with
# "native", the same jobs with the native data path's target too (and its lab test), into results/devices/native:
#   flock /tmp/nvmeof-lab.lock .venv/bin/nvmeof-roce lab run --timeout 2400 -- sh tools/lab-runs/devices/run-lab-uring.sh
#   flock /tmp/nvmeof-lab.lock .venv/bin/nvmeof-roce lab run --timeout 1500 -- sh tools/lab-runs/devices/run-lab-uring.sh quick
#   flock /tmp/nvmeof-lab.lock .venv/bin/nvmeof-roce lab run --timeout 1800 -- sh tools/lab-runs/devices/run-lab-uring.sh native
cd /mnt/project || exit 1
TARGETS=kernel,userspace
LABTEST=tests/lab/test_devices.py
if [ "$1" = quick ]; then
    OUT=results/devices/uring2
    JOBS="--jobs randread-4k-qd1,randread-4k-qd32"
elif [ "$1" = native ]; then
    OUT=results/devices/native
    JOBS="--jobs randread-4k-qd1,randread-4k-qd32"
    TARGETS=kernel,userspace,userspace-py  # userspace: the default, native
    LABTEST="tests/lab/test_devices.py tests/lab/test_native_data_path.py"
else
    OUT=results/devices/uring
    JOBS=--qd-sweep
fi
mkdir -p $OUT
python3 -m pytest -p no:cacheprovider -q -s $LABTEST > $OUT/lab-test.txt 2>&1
echo "lab test: exit $?" >> $OUT/lab-test.txt
for dev in null_blk:2ms null_blk:20us; do
    name=$(echo $dev | tr ':' '-')
    rm -rf $OUT/$name
    python3 -m nvmeof_roce bench --device $dev $JOBS --targets $TARGETS --no-perftest --runtime 8 --ramp 2 \
        --ns-size 128M --size 64M --out $OUT/$name > $OUT/$name.txt 2>&1
    echo "$dev: exit $?" >> $OUT/lab-test.txt
done
