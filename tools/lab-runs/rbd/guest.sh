set -x
cd /mnt/project
echo "CEPH_CONF=$CEPH_CONF"; nproc; uname -r
python3 -m pytest -p no:cacheprovider -m "lab and extended" tests/lab/test_rbd_bench.py -x -q -rA 2>&1 | tail -40 | tee /mnt/share/smoke.txt
python3 -m nvmeof_roce bench --rbd --repeats 3 --runtime 10 --ramp 2 --no-perftest --no-plots --out /mnt/share/run > /mnt/share/bench.txt 2> /mnt/share/bench.err
echo "bench exit $?"
tail -50 /mnt/share/bench.txt
python3 /mnt/share/profile_rbd.py python 2>&1 | tail -30
python3 /mnt/share/profile_rbd.py native 2>&1 | tail -30
