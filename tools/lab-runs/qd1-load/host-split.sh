#!/bin/sh
# On the host, holding the lab lock and the CPU lock exclusively: a busy loop through the whole boot.
out=/tmp/qd1b
cd /work/wt-pin
date -u +%s > $out/begin
/work/main/.venv/bin/python $out/hostsample.py $out/host.jsonl & samp=$!
sh -c "while :; do :; done" & hog=$!
env PYTHONPATH=$PWD /work/main/.venv/bin/python -m nvmeof_roce lab run --kernel 6.1 --timeout 3300 --share $out -- \
  sh /mnt/share/guest.sh > $out/lab.log 2>&1
echo $? > $out/rc
kill $samp $hog
date -u +%s > $out/end
