#!/bin/sh
# In the guest, with the spin's yield: QD1 with fio, our initiator and our target on vCPU 0 beside the machine's busy
# loop (started before the boot), then on an idle machine the same, the target on vCPU 1 instead, and a pipe
# round trip between two processes and between two threads on one vCPU.
J=randread-4k-qd1,uinit-randread-4k-qd1
B="--jobs $J --repeats 5 --runtime 6 --ramp 1 --no-perftest --no-plots"
python3 -m nvmeof_roce bench --targets kernel,native-adaptive $B --host-cpus 0 --userspace-cpus 0 --out /mnt/share/hog/bench
echo hog rc $?
touch /mnt/share/want-idle
while [ ! -e /mnt/share/idle-on ]; do sleep 1; done
python3 /mnt/share/pingpong.py 20000
python3 -m nvmeof_roce bench --targets kernel,native-adaptive $B --host-cpus 0 --userspace-cpus 0 --out /mnt/share/idle/bench
echo idle rc $?
python3 -m nvmeof_roce bench --targets kernel,native-adaptive $B --host-cpus 0 --userspace-cpus 1 --out /mnt/share/split/bench
echo split rc $?
