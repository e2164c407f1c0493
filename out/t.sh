modprobe siw && echo MODPROBE_OK
ip link add siwnet0 type dummy && ip addr add 10.98.0.1/24 dev siwnet0 && ip link set siwnet0 up
nvmeof-roce rdma add-siw siwnet0 && nvmeof-roce rdma status | head -3
modprobe nvme_rdma
ulimit -l unlimited
nvmeof-roce target serve --ready-file /tmp/ready /mnt/share/siw.json > /tmp/tgt.log 2>&1 &
for i in $(seq 120); do [ -e /tmp/ready ] && break; sleep 1; done; echo "ready after $i s"
nvme connect -t rdma -a 10.98.0.1 -s 4421 -n nqn.2024-01.io.nvmeof-roce:demo; sleep 2; nvme list
dev=$(ls /dev/nvme*n1 | head -1)
[ -n "$dev" ] && fio --name=v --filename=$dev --rw=randwrite --bs=4k --size=16M --verify=crc32c --direct=1 --ioengine=libaio --iodepth=16 --verify_state_save=0 2>&1 | grep -E "err|IOPS"
[ -n "$dev" ] && fio --name=r --filename=$dev --rw=randread --bs=128k --size=16M --direct=1 --ioengine=libaio --iodepth=8 2>&1 | grep -E "err|IOPS"
nvme disconnect-all
kill %1; sleep 1
tail -30 /tmp/tgt.log
dmesg | grep -i "siw\|nvme" | grep -v "speed is unknown" | tail -20
