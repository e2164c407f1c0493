#!/bin/sh
# blktests' NVME_TARGET_CONTROL for the nvmeof-roce userspace target (docs/conformance.md):
#   NVME_TARGET_CONTROL=/path/to/nvme_target_control.sh ./check nvme
# after `nvme_target_control.sh start` (one target for the run) and before `nvme_target_control.sh stop`.
# `config --show-KEY` is answered here from the state file `start` wrote: blktests asks it several times per test.
STATE=${NVMEOF_BLKTESTS_STATE:-/run/nvmeof-roce/blktests.state}
if [ "$1" = config ]; then
    if [ ! -r "$STATE" ]; then
        echo "nvme_target_control: no state file $STATE: run '$0 start' first" >&2
        exit 1
    fi
    shift
    for opt in "$@"; do
        key=${opt#--show-}
        grep -m1 "^$key=" "$STATE" | cut -d= -f2-
    done
    exit 0
fi
exec "${NVMEOF_PYTHON:-python3}" -m nvmeof_roce.lab.blktests_control --state "$STATE" "$@"
