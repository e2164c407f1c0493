#!/bin/sh
# On the host, holding the lab lock and the CPU lock exclusively: a busy loop, the boot; the loop stops when the
# guest asks for an idle machine.
out=/tmp/qd1i
cd /work/wt-yield
date -u +%s > $out/begin
/work/main/.venv/bin/python $out/hostsample.py $out/host.jsonl & samp=$!
sh -c "while :; do :; done" & hog=$!
( while [ ! -e $out/want-idle ]; do sleep 1; done
  kill $hog; date -u +%s > $out/hog-stop; sleep 2; touch $out/idle-on ) & watcher=$!
env PYTHONPATH=$PWD /work/main/.venv/bin/python -m nvmeof_roce lab run --kernel 6.1 --timeout 3300 --share $out -- \
  sh /mnt/share/guest.sh > $out/lab.log 2>&1
echo $? > $out/rc
kill $samp $watcher $hog 2>/dev/null
date -u +%s > $out/end
