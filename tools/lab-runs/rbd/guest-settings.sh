# The guest's command of results/rbd/native-2/ and threads-*.txt after a Write's bounce chunk goes back once its
# backend has it (docs/rbd.md "Figures"), from the checkout's root:
#   nvmeof-roce lab run --ceph --share DIR --timeout 3000 -- sh tools/lab-runs/rbd/guest-settings.sh
# Our target alone on the native RBD path with librbd's settings and our polling changed one at a time
# (threads_rbd.py), then bench --rbd on the native RBD path (3 repeats), then the lab's smoke test of bench --rbd.
set -x
cd /mnt/project
t=tools/lab-runs/rbd/threads_rbd.py
python3 $t native --tag native-chunkfix 2>&1 | tail -3
python3 $t native --client rbd_non_blocking_aio=false 2>&1 | tail -3
python3 $t native --client ms_async_op_threads=1 2>&1 | tail -3
python3 $t native --poll adaptive 2>&1 | tail -3
python3 -m nvmeof_roce bench --rbd --rbd-path native --repeats 3 --runtime 10 --ramp 2 --no-perftest --no-plots \
  --out /mnt/share/native-2 > /mnt/share/bench-native-2.txt 2> /mnt/share/bench-native-2.err
echo "bench exit $?"
python3 -m pytest -p no:cacheprovider -m "lab and extended" tests/lab/test_rbd_bench.py -x -q -rA 2>&1 | tail -30 \
  | tee /mnt/share/smoke-2.txt
