#!/bin/sh
# The device measurements of docs/devices.md, in one lab boot:
#   flock /tmp/nvmeof-lab.lock .venv/bin/nvmeof-roce lab run --timeout 3000 -- sh tools/lab-runs/devices/run-lab.sh
cd /mnt/project || exit 1
OUT=results/devices
python3 -m pytest -p no:cacheprovider -q -s tests/lab/test_devices.py 2>&1 | tail -5 > $OUT/lab-test.txt
for dev in null_blk:2ms null_blk:20us null_blk:100us file; do
    name=$(echo $dev | tr ':' '-')
    rm -rf $OUT/$name
    python3 -m nvmeof_roce bench --device $dev --qd-sweep --no-perftest --runtime 8 --ramp 2 \
        --ns-size 128M --size 64M --out $OUT/$name > $OUT/$name.txt 2>&1
    echo "$dev: exit $?" >> $OUT/lab-test.txt
done
