"""Instructions and heap allocations per 4 KiB I/O of the native data path, beside the Python data path, through
the fake verbs provider (tests/native/fakeprov.c).  A benchmark, not a test: it prints figures, asserts nothing.

    python3 -m nvmeof_roce.bench.cost.native [--ios N] [--json] [--trace | --reservations | --adaptive | --rbd]
    (make bench-native)

Each case drives one I/O queue of a real Target (admin queue over loopback, the I/O queue through the C queue on
the fake provider): QD capsules are delivered into the queue's receives, then the queue is polled until idle.
native: the C queue serves the reads and writes itself.  python: the same queue with an empty native view, so
every capsule goes to the Python core, which answers through the same C queue: the Python data path's cost in
the same harness (its RequestBook and the core; the pyverbs transport's own cost is measured by
nvmeof_roce.bench.cost.transport).  traced (`--trace`, in place of python): native with the per-command trace on
(csrc/trace.c; its records taken after each poll, outside what is counted, and not printed).  adaptive
(`--adaptive`, in place of python): native polled as `--poll adaptive` does (csrc/nq_owner.c nq_poll_adaptive: the
polls, the arm, the poll after the arm), with a spin bound of 0, so what is counted is the mode's fixed cost per
wake-up; the spin itself costs what its bound says, in time (one empty poll per pass).  rbd (`--rbd`, in place of
python): an RBD namespace on the native path (csrc/be_rbd.c) over the fake librbd (tests/unit/fakerbd/), which
completes each call inside it and calls our callback there: librbd's own cost is left out (the fake's entry points
are toggled off, our callback `rbd_cb` inside them toggled on again), what is counted is our side: the entry, the
completion handoff (the callback's lock, array and eventfd write; the poll's take), the bounce chunk's RDMA.

instructions: callgrind, collecting only under the queue's poll (`--toggle-collect=nq_poll`) and not inside the
fake provider's entry points (post_send, post_recv, poll_cq, req_notify_cq, toggled off again): the target's
code, Python's included for the python case.  Two runs of N and 2N I/Os; the difference divided by N, so setup
cancels.  allocations: malloc/calloc/realloc calls during the polls (an LD_PRELOAD counter, Python's allocator
set to malloc so that its objects count), per I/O.

It runs from a checkout: the fake provider and the malloc counter are built from tests/native, and the queue is
set up by the unit tier's native_diff and loopback_env (tests/unit).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from nvmeof_roce.bench.cost import NATIVE_TESTS, REPO, use_test_doubles

MODULE = "nvmeof_roce.bench.cost.native"  # run again in child processes (under callgrind, with the counter)
PROVIDER_ENTRIES = ("fake_post_send", "fake_post_recv", "fake_poll_cq", "fake_req_notify_cq")
CASES = [(path, op, qd) for path in ("native", "python") for op in ("read", "write") for qd in (1, 32)]
TRACE_CASES = [(path, op, qd) for path in ("native", "traced") for op in ("read", "write") for qd in (1, 32)]
ADAPTIVE_CASES = [(path, op, qd) for path in ("native", "adaptive") for op in ("read", "write") for qd in (1, 32)]
RBD_CASES = [(path, op, qd) for path in ("native", "rbd") for op in ("read", "write") for qd in (1, 32)]
# the fake librbd's calls (librbd's cost, not ours), and our callback that runs inside them (ours again)
FAKE_RBD_ENTRIES = ("rbd_aio_create_completion", "rbd_aio_read", "rbd_aio_write", "rbd_aio_get_return_value",
                    "rbd_aio_release", "rbd_cb")
# --reservations: the namespace with reservations enabled and unused, held by this host (Write Exclusive), and held
# by another host (this host's reads, which its Write Exclusive allows: served by the core)
RESV_CASES = [(path, op, qd) for path in ("native", "resv-unused", "resv-held") for op in ("read", "write")
              for qd in (1, 32)] + [("resv-other", "read", qd) for qd in (1, 32)]


def drive(path: str, op: str, qd: int, ios: int, count_mallocs: bool) -> dict:
    """Run `ios` 4 KiB I/Os at queue depth `qd`; the malloc calls made under poll() when asked."""
    use_test_doubles()
    from loopback_env import SUB_RAM, ram_ns, port  # noqa: E402
    from native_diff import NativeEndpoint, io_capsule  # noqa: E402
    ns = ram_ns(1, "16M", 512)
    if path == "rbd":
        from rbd_fake import rbd_ns, use_fake_rbd  # noqa: E402

        class Patch:  # pytest's monkeypatch, for good: this process ends with the run
            setattr = staticmethod(setattr)
        use_fake_rbd(Patch, {"bench": 16 << 20})
        ns = rbd_ns(1, "bench")
    if path.startswith("resv"):
        ns["resv"] = {"enable": "1"}
    config = {"hosts": [], "ports": [port(1, "10.99.0.1:4420", [SUB_RAM])],
              "subsystems": [{"nqn": SUB_RAM, "namespaces": [ns]}]}
    ep = NativeEndpoint(config, SUB_RAM, depth=32)
    if path == "rbd":
        from rbd_fake import wait_native  # noqa: E402
        wait_native(ep, SUB_RAM)
        assert ep.env.target.subsystem(SUB_RAM).namespaces[1].native_file is not None
    if path in ("resv-held", "resv-other"):
        from loopback_env import RAW_HOSTID  # noqa: E402
        from nvmeof_roce.engine import native_view
        resv = ep.env.target.subsystems[SUB_RAM].namespaces[1].resv
        holder = RAW_HOSTID if path == "resv-held" else bytes(16)  # this queue's host, or another one
        resv.registrants[holder] = 1
        resv.holder, resv.rtype = holder, 1  # Write Exclusive
        native_view.refresh_all(ep.env.target)
    if path == "python":
        ep.env.target.native_data_path = False
        ep.queue.set_view(False, [])
    if path == "traced":
        from nvmeof_roce.transport.rdma.native_trace import RECORDS
        ep.queue.set_trace(RECORDS)
    opc = 0x02 if op == "read" else 0x01
    capsules = [io_capsule(ep, opc, 1, (i % 4096) * 8, 7, 4096, offset=(i % 128) * 4096, cid=i & 0xFFFF)
                for i in range(qd)]
    counter = None
    overhead = 0
    if count_mallocs:
        counter = ctypes.c_ulonglong.in_dll(ctypes.CDLL(None), "malloc_count_calls")
        # reading the counter makes a Python int (a malloc of its own): measured, then subtracted per round
        first = counter.value
        overhead = counter.value - first
    queue, device = ep.queue, ep.device
    mallocs = 0
    done = 0
    before = queue.stats()
    while done < ios:
        for capsule in capsules:
            device.deliver(capsule)
        start = counter.value if counter is not None else 0
        if path == "adaptive":
            while not queue.poll_adaptive(0, budget=256)[1]:
                pass
        else:
            while queue.poll():
                pass
        if counter is not None:
            mallocs += counter.value - start - overhead
        answered = device.responses()
        assert len(answered) == qd and all(c[14:16] == b"\0\0" for c, _ in answered), answered[:2]
        done += qd
    after = queue.stats()
    native_commands = after["native_commands"] - before["native_commands"]
    return {"ios": done, "mallocs": mallocs, "native_commands": native_commands,
            "python_commands": after["python_commands"] - before["python_commands"]}


def build(source: Path, out: Path) -> Path:
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(out), str(source)], check=True)
    return out


def child_env(**extra: str) -> dict:
    """The environment of a child run: this checkout's package first on its path, whatever the current directory."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def callgrind_total(path: str, op: str, qd: int, ios: int, workdir: Path) -> int:
    out = workdir / f"cg.{path}.{op}.{qd}.{ios}"
    # the adaptive poll's own function is collected whole (its nq_poll calls inside: a second toggle would stop it)
    entry = "nq_poll_adaptive" if path == "adaptive" else "nq_poll"
    fake = FAKE_RBD_ENTRIES if path == "rbd" else ()
    cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={entry}",
           *[f"--toggle-collect={f}" for f in PROVIDER_ENTRIES + fake], f"--callgrind-out-file={out}",
           sys.executable, "-m", MODULE, "--drive", path, op, str(qd), str(ios)]
    subprocess.run(cmd, env=child_env(), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    text = out.read_text()
    match = re.search(r"^summary:\s+(\d+)", text, re.M) or re.search(r"^totals:\s+(\d+)", text, re.M)
    return int(match.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ios", type=int, default=256, help="I/Os of the shorter callgrind run (the other has twice)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace", action="store_true",
                    help="native with the per-command trace off and on (in place of native and python)")
    ap.add_argument("--reservations", action="store_true",
                    help="native beside a namespace with reservations enabled and unused, held by this host, and "
                         "held by another (in place of native and python)")
    ap.add_argument("--adaptive", action="store_true",
                    help="native polled as --poll adaptive does, spin bound 0 (in place of python)")
    ap.add_argument("--rbd", action="store_true",
                    help="an RBD namespace on the native path over the fake librbd (in place of python)")
    ap.add_argument("--drive", nargs=4, metavar=("PATH", "OP", "QD", "IOS"), help=argparse.SUPPRESS)
    ap.add_argument("--count-mallocs", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        path, op, qd, ios = args.drive
        print(json.dumps(drive(path, op, int(qd), int(ios), args.count_mallocs)))
        return 0
    if not shutil.which("valgrind"):
        print("valgrind is not installed: apt-get install valgrind", file=sys.stderr)
        return 2
    from nvmeof_roce import native
    if not native.available():
        print(native.missing_reason, file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        counter = build(NATIVE_TESTS / "malloc_count.c", workdir / "malloc_count.so")
        for path, op, qd in (TRACE_CASES if args.trace else RESV_CASES if args.reservations
                             else ADAPTIVE_CASES if args.adaptive else RBD_CASES if args.rbd else CASES):
            n = max(args.ios // qd * qd, qd)
            short = callgrind_total(path, op, qd, n, workdir)
            long = callgrind_total(path, op, qd, 2 * n, workdir)
            env = child_env(LD_PRELOAD=str(counter), PYTHONMALLOC="malloc")
            run = subprocess.run([sys.executable, "-m", MODULE, "--drive", path, op, str(qd), str(n),
                                  "--count-mallocs"], env=env, check=True, capture_output=True, text=True)
            counted = json.loads(run.stdout.strip().splitlines()[-1])
            results.append({"path": path, "op": op, "qd": qd, "instructions_per_io": round((long - short) / n),
                            "mallocs_per_io": round(counted["mallocs"] / counted["ios"], 2),
                            "served_natively": counted["native_commands"] == counted["ios"]})
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{'path':11} {'op':6} {'QD':>3} {'instructions/IO':>16} {'mallocs/IO':>11} {'native':>6}")
    for r in results:
        print(f"{r['path']:11} {r['op']:6} {r['qd']:>3} {r['instructions_per_io']:>16,} {r['mallocs_per_io']:>11} "
              f"{'yes' if r['served_natively'] else 'no':>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
