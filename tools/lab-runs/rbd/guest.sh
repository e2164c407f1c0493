# The guest's command of results/rbd/native, python and threads/ (docs/rbd.md "Figures"), from the checkout's root:
#   nvmeof-roce lab run --ceph --share DIR --timeout 3600 -- sh tools/lab-runs/rbd/guest.sh
# Our target alone on the native RBD path with its threads' CPU (threads_rbd.py), bench --rbd on the native RBD
# path (3 repeats), the lab's smoke test of bench --rbd, then bench --rbd on the python (reference) path and its
# threads.
set -x
cd /mnt/project
echo "CEPH_CONF=$CEPH_CONF"; nproc; uname -r
python3 tools/lab-runs/rbd/threads_rbd.py native --qd1 2>&1 | tail -30
python3 -m nvmeof_roce bench --rbd --rbd-path native --repeats 3 --runtime 10 --ramp 2 --no-perftest --no-plots \
  --out /mnt/share/native > /mnt/share/bench-native.txt 2> /mnt/share/bench-native.err
echo "bench native exit $?"
python3 -m pytest -p no:cacheprovider -m "lab and extended" tests/lab/test_rbd_bench.py -x -q -rA 2>&1 | tail -30 \
  | tee /mnt/share/smoke.txt
python3 -m nvmeof_roce bench --rbd --rbd-path python --repeats 3 --runtime 10 --ramp 2 --no-perftest --no-plots \
  --out /mnt/share/python > /mnt/share/bench-python.txt 2> /mnt/share/bench-python.err
echo "bench python exit $?"
python3 tools/lab-runs/rbd/threads_rbd.py python --qd1 2>&1 | tail -30
