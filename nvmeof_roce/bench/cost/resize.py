"""The event loop's stall per live resize of a RAM namespace: the install step (the backend's commit, run on the loop
between the pause's drain and the resume), in one process.  A benchmark, not a test: it prints figures and
asserts nothing about them.

    python3 -m nvmeof_roce.bench.cost.resize [--size-mib 100] [--rounds 5]

The namespace's pages are written first and it is pinned, as under RDMA; each round resizes it to 110, 100, 120,
100, 110 and 90 % of its size, writing its first MiB after each.  The registration of the new size with a device
(at the view refresh that follows) is not part of it.
"""
from __future__ import annotations

import argparse
import resource
import time

from nvmeof_roce.engine.backends import RamBackend

MIB = 1 << 20
STEPS = (110, 100, 120, 100, 110, 90)  # percent of the starting size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    size = args.size_mib * MIB
    ram = RamBackend(size)
    ram.pin()
    for offset in range(0, size, MIB):
        ram.write(offset, b"\x5a" * min(MIB, size - offset))
    stalls = []
    for _ in range(args.rounds):
        for percent in STEPS:
            commit = ram.prepare_resize(size * percent // 100 // 4096 * 4096)
            began = time.perf_counter()
            commit()
            stalls.append(time.perf_counter() - began)
            ram.write(0, b"\x11" * MIB)
    stalls.sort()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
    print(f"RAM namespace of {args.size_mib} MiB, {len(stalls)} resizes: install step max "
          f"{stalls[-1] * 1000:.2f} ms, median {stalls[len(stalls) // 2] * 1000:.2f} ms; peak RSS {peak} MiB")
    ram.close()


if __name__ == "__main__":
    main()
