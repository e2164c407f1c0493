#!/bin/sh
# (the run before the adaptive spin yielded: colo-*-no-yield.bench.json)
# In the guest: QD1 random reads with the host's load (fio, our initiator) and our target on the same vCPU 0,
# beside the machine's busy loop (started before the boot), then on an idle machine.
J=randread-4k-qd1,uinit-randread-4k-qd1
B="--targets kernel,native,native-adaptive --jobs $J --repeats 5 --runtime 6 --ramp 1 --no-perftest --no-plots"
B="$B --host-cpus 0 --userspace-cpus 0"
nproc
python3 -m nvmeof_roce bench $B --out /mnt/share/hog/bench
echo hog rc $?
touch /mnt/share/want-idle
while [ ! -e /mnt/share/idle-on ]; do sleep 1; done
python3 -m nvmeof_roce bench $B --out /mnt/share/idle/bench
echo idle rc $?
