#!/bin/sh
# Second lab boot: the lab test, then the GIL switch interval A/B on the 2 ms device
# (userspace: 0.5 ms, baseline = results/devices/alt: the interpreter's 5 ms).
cd /mnt/project || exit 1
OUT=results/devices
python3 -m pytest -p no:cacheprovider -q -s tests/lab/test_devices.py > $OUT/lab-test2.txt 2>&1
rm -rf $OUT/ab-2ms
python3 -m nvmeof_roce bench --device null_blk:2ms --targets kernel,userspace,baseline \
    --baseline-checkout $OUT/alt --jobs randread-4k-qd1,randread-4k-qd32 --repeats 2 --no-perftest \
    --runtime 8 --ramp 2 --ns-size 128M --size 64M --out $OUT/ab-2ms > $OUT/ab-2ms.txt 2>&1
echo "ab: exit $?" >> $OUT/lab-test2.txt
