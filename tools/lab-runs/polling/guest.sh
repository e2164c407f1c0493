#!/bin/sh
# The bench's polling record on real rxe: interrupt, adaptive and busy at QD1 and QD32.
python3 -m nvmeof_roce bench --targets native,native-adaptive,native-busy --jobs randread-4k-qd1,randread-4k-qd32 \
  --repeats 1 --runtime 4 --ramp 1 --no-perftest --no-plots --out /mnt/share/poll/bench; echo rc $?
python3 -c "
import json
d = json.load(open('/mnt/share/poll/bench/bench.json'))
for job, jd in d['jobs'].items():
    for t, r in jd['results'].items():
        rec = r['repeats'][0]
        print(job, t, rec.get('polling'), 'ios', rec['cpu'].get('ios'))
"
