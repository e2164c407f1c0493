"""CPU µs per 4 KiB random read of a file namespace on each I/O engine (engine/ioengine.py), over the loopback
fabric, in one process and one run. A benchmark, not a test: it prints figures and asserts nothing about them.

    python3 -m nvmeof_roce.bench.cost.engine [--reads N] [--depths 1,32] [--rounds R] [--dir DIR]

It runs from a checkout: the target and the loopback fabric are set up by the unit tier's loopback_env
(tests/unit).

The host (the project's initiator) and the target share the process, so the CPU figure is both of theirs
(the same host work for each engine: compare the two lines, not the absolute value). The file is in the page
cache (buffered: a file namespace's default), so the device costs next to nothing and what differs is the
engine: a thread hand-over and two GIL switches per command (threads) against a ring submission and an
eventfd wake-up (io_uring).
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time

from nvmeof_roce.bench.cost import use_test_doubles
from nvmeof_roce.engine.ioengine import uring_unavailable

use_test_doubles()
from loopback_env import ADDR1, HOST_A, Env, file_ns, port  # noqa: E402

SUB = "nqn.2024-01.io.nvmeof-roce:engine-cost"


def measure(engine: str, depth: int, reads: int, directory: str) -> tuple:
    ns = file_ns(1, f"{directory}/engine-cost-{engine}.img", "64M")
    ns["nvmeof_roce"]["io_engine"] = engine
    env = Env({"hosts": [{"nqn": HOST_A}], "ports": [port(1, ADDR1, [SUB])],
               "subsystems": [{"nqn": SUB, "namespaces": [ns]}]})
    try:
        ctrl = env.connect(SUB, num_io_queues=1, queue_size=max(64, depth + 1))
        ctrl.write(1, 0, b"\1" * 4096)
        state = {"in_flight": 0, "done": 0}

        def done(_c):
            state["in_flight"] -= 1
            state["done"] += 1
        issued = 0
        cpu, wall = time.process_time(), time.monotonic()
        while state["done"] < reads:
            while state["in_flight"] < depth and issued < reads:
                state["in_flight"] += 1
                issued += 1
                ctrl.submit_read(1, random.randrange(0, 16000) * 8, 8, done)
            ctrl.poll_completions(0.01)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        ctrl.close()
        return cpu / reads * 1e6, reads / wall
    finally:
        env.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reads", type=int, default=5000, help="reads per measurement (default 5000)")
    p.add_argument("--depths", default="1,32", help="queue depths (default 1,32)")
    p.add_argument("--rounds", type=int, default=2, help="measurements per engine and depth, interleaved (default 2)")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the namespace files go")
    args = p.parse_args(argv)
    engines = ["threads"] + ([] if uring_unavailable() else ["io_uring"])
    if len(engines) == 1:
        print(f"io_uring: {uring_unavailable()}: the thread engine only")
    for depth in (int(d) for d in args.depths.split(",")):
        for _ in range(args.rounds):
            for engine in engines:
                us, rate = measure(engine, depth, args.reads, args.dir)
                print(f"{engine:9s} QD{depth:<3d} {us:7.1f} us CPU per read (host + target)  {rate:8.0f} reads/s",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
