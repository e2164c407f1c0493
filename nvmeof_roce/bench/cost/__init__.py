"""Maintainer benchmarks of our own code's cost, run from a checkout (`python -m nvmeof_roce.bench.cost.NAME`):

- `engine`: CPU per 4 KiB read of a file namespace on each I/O engine, over the loopback fabric;
- `initiator`: our initiator's Python cost per 4 KiB read, without a target;
- `native`: instructions and allocations per I/O of the native data path beside the Python one (callgrind);
- `transport`: Python µs per 4 KiB read through the RDMA transport on a fake device, and the core alone.

They drive the real code on the unit tier's test doubles (tests/unit, tests/native), so they need the checkout
around the package and are left out of the wheel.  What they print is measured, not asserted; the `bench`
command is the benchmark of the targets themselves.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
UNIT_TESTS = REPO / "tests" / "unit"
NATIVE_TESTS = REPO / "tests" / "native"


def use_test_doubles() -> None:
    """Put the unit tier's test doubles (fakeverbs, loopback_env, native_diff, ...) first on sys.path."""
    if not UNIT_TESTS.is_dir():
        raise SystemExit(f"{UNIT_TESTS} is missing: the cost benchmarks run from a checkout of nvmeof-roce")
    if str(UNIT_TESTS) not in sys.path:
        sys.path.insert(0, str(UNIT_TESTS))
