cd /mnt/project
for dp in python native; do for sw in 0.005 0.0005; do python3 /mnt/share/gil_rbd.py $dp $sw 2>&1 | tail -12; done; done
