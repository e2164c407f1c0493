#!/bin/sh
# RoCE v2 (rxe), iWARP (siw) and NVMe/TCP side by side in one lab boot (docs/fabric.md "Choosing a fabric"):
#   flock /tmp/nvmeof-lab.lock .venv/bin/nvmeof-roce lab run --timeout 2400 -- sh tools/lab-runs/fabrics/run-lab.sh
cd /mnt/project || exit 1
ip link add siwnet0 type dummy && ip addr add 10.98.0.1/24 dev siwnet0 && ip link set siwnet0 up || exit 1
python3 -m nvmeof_roce rdma add-siw siwnet0 || exit 1
ulimit -l unlimited  # siw counts registered pages against the locked-memory limit, even for root
python3 -m nvmeof_roce bench --targets kernel,userspace,kernel@iwarp,userspace@iwarp,kernel@tcp \
    --jobs randread-4k-qd32,randwrite-4k-qd32,randread-4k-qd1 --no-perftest --runtime 8 --ramp 2 \
    --ns-size 256M --size 128M --out results/fabrics/run > results/fabrics/table.txt 2>&1
echo "bench: exit $?" >> results/fabrics/table.txt
