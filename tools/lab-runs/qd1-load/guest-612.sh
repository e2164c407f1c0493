#!/bin/sh
# 6.12, idle machine, with the spin's yield: a pipe round trip between two processes and between two threads on
# one vCPU; QD1 nothing pinned; then the host's load on vCPU 0 and our target on vCPU 1.
uname -r
python3 /mnt/share/pingpong.py 20000
J=randread-4k-qd1,uinit-randread-4k-qd1
B="--targets kernel,native-adaptive --jobs $J --repeats 5 --runtime 6 --ramp 1 --no-perftest --no-plots"
python3 -m nvmeof_roce bench $B --out /mnt/share/idle612/bench; echo idle612 rc $?
python3 -m nvmeof_roce bench $B --host-cpus 0 --userspace-cpus 1 --out /mnt/share/split612/bench; echo split612 rc $?
