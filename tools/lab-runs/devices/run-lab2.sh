#!/bin/sh
# Second lab boot, the final code: the lab test, then the QD sweeps again (2 ms and 20 us first: the goals).
#   flock /tmp/nvmeof-lab.lock .venv/bin/nvmeof-roce lab run --timeout 1800 -- sh tools/lab-runs/devices/run-lab2.sh
cd /mnt/project || exit 1
OUT=results/devices
python3 -m pytest -p no:cacheprovider -q -s tests/lab/test_devices.py > $OUT/lab-test2.txt 2>&1
for dev in null_blk:2ms null_blk:20us null_blk:100us file; do
    name=$(echo $dev | tr ':' '-')
    rm -rf $OUT/$name
    python3 -m nvmeof_roce bench --device $dev --qd-sweep --no-perftest --runtime 8 --ramp 2 \
        --ns-size 128M --size 64M --out $OUT/$name > $OUT/$name.txt 2>&1
    echo "$dev: exit $?" >> $OUT/lab-test2.txt
done
