#!/bin/sh
# In the guest: the bench beside the host's hog (started before the boot), then, once the host has stopped it,
# the same bench on an idle host.
T=kernel,userspace,native-adaptive,native-adaptive-1000us
J=randread-4k-qd1,uinit-randread-4k-qd1
which perf trace-cmd; nproc; cat /proc/schedstat > /mnt/share/guest-schedstat.txt
cat /proc/self/schedstat > /mnt/share/guest-task-schedstat.txt
python3 -m nvmeof_roce bench --targets $T --jobs $J --repeats 5 --runtime 6 --ramp 1 --no-perftest --no-plots \
  --out /mnt/share/hog/bench
echo hog rc $?
touch /mnt/share/want-idle
while [ ! -e /mnt/share/idle-on ]; do sleep 1; done
python3 -m nvmeof_roce bench --targets $T --jobs $J --repeats 5 --runtime 6 --ramp 1 --no-perftest --no-plots \
  --out /mnt/share/idle/bench
echo idle rc $?
# Third: beside the hog again, every process of the bench (fio, the targets, our initiator) on vCPU 0.
touch /mnt/share/want-hog2
while [ ! -e /mnt/share/hog2-on ]; do sleep 1; done
taskset -c 0 python3 -m nvmeof_roce bench --targets kernel,userspace,native-adaptive --jobs $J --repeats 5 \
  --runtime 6 --ramp 1 --no-perftest --no-plots --out /mnt/share/hog-pinned/bench
echo hog-pinned rc $?
