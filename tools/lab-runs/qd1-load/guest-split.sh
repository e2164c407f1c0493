#!/bin/sh
# In the guest, beside the host's busy loop (started before the boot), three benches of QD1 random reads.
J=randread-4k-qd1,uinit-randread-4k-qd1
B="--jobs $J --repeats 5 --runtime 6 --ramp 1 --no-perftest --no-plots"
nproc
# 1: the host's load (fio, our initiator) on vCPU 0, our target on vCPU 1: interrupt and adaptive
python3 -m nvmeof_roce bench --targets kernel,native,native-adaptive,native-adaptive-1000us $B \
  --host-cpus 0 --userspace-cpus 1 --out /mnt/share/split/bench
echo split rc $?
# 2: the same split, our target busy-polling vCPU 1 (it spins through the kernel target's turns too)
python3 -m nvmeof_roce bench --targets kernel,native-busy $B --host-cpus 0 --userspace-cpus 1 \
  --out /mnt/share/split-busy/bench
echo split-busy rc $?
# 3: nothing pinned: busy polling and two poll groups
python3 -m nvmeof_roce bench --targets kernel,native-busy,native-busy-2c $B --out /mnt/share/busy/bench
echo busy rc $?
