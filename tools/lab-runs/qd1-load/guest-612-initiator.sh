#!/bin/sh
# 6.12, idle machine: QD1 of the kernel host's fio and of our initiator (which now polls once more after arming its
# CQ before it sleeps), against nvmet and our target, nothing pinned.
uname -r
J=randread-4k-qd1,uinit-randread-4k-qd1
python3 -m nvmeof_roce bench --targets kernel,native,native-adaptive --jobs $J --repeats 5 --runtime 6 --ramp 1 \
  --no-perftest --no-plots --out /mnt/share/idle612/bench; echo idle612 rc $?
