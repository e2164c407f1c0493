"""`nvmeof-roce lab ceph start | stop | status | pause | resume`: the development Ceph cluster
(ceph/devcluster.py) in a lab guest (`lab run --ceph` starts it before the command) or on any machine with
Debian's Ceph packages, for the RBD namespaces' tests and benchmarks."""
from __future__ import annotations

from pathlib import Path

from ..ceph.devcluster import DEFAULT_PORT, DevCluster
from ..output import emit

DEFAULT_DIR = "/run/nvmeof-roce/ceph"  # tmpfs in the guest: the cluster goes with the boot


def _cluster(args) -> DevCluster:
    return DevCluster(Path(args.dir), addr=args.addr, port=args.port)


def cmd_start(args) -> int:
    cluster = _cluster(args).start()
    emit(cluster.status(), args.json, lambda s: print(f"ceph: cluster up, conf {s['conf']} (mon {s['mon']})"))
    return 0


def cmd_stop(args) -> int:
    _cluster(args).stop()
    return 0


def cmd_pause(args) -> int:
    _cluster(args).pause()
    return 0


def cmd_resume(args) -> int:
    _cluster(args).resume()
    return 0


def cmd_status(args) -> int:
    status = _cluster(args).status()
    emit(status, args.json, lambda s: print(f"ceph: {'running' if s['running'] else 'stopped'}, conf {s['conf']}"
                                            + (f", health {s['status']['health']['status']}" if 'status' in s else "")))
    return 0 if status["running"] else 1


def register(sub) -> None:
    ceph = sub.add_parser("ceph", help="a development Ceph cluster (one monitor, one memstore OSD) for RBD tests",
                          description="One monitor and one OSD on the in-memory object store, no authentication, "
                          "the pool 'rbd', every file under --dir. For tests and benchmarks, never for data.")
    actions = ceph.add_subparsers(dest="ceph_command", metavar="ACTION")
    for name, func, text in (("start", cmd_start, "make and start the cluster (a no-op when it runs)"),
                             ("stop", cmd_stop, "stop its daemons"),
                             ("status", cmd_status, "whether it runs, and ceph status"),
                             ("pause", cmd_pause, "freeze its daemons (SIGSTOP): the cluster is gone to clients"),
                             ("resume", cmd_resume, "thaw them (SIGCONT)")):
        p = actions.add_parser(name, help=text)
        p.add_argument("--dir", default=DEFAULT_DIR, help=f"the cluster's directory (default {DEFAULT_DIR})")
        p.add_argument("--addr", default="127.0.0.1", help="the monitor's address (default 127.0.0.1)")
        p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"the monitor's port (default {DEFAULT_PORT})")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
    ceph.set_defaults(func=lambda args: (ceph.print_help(), 2)[1])
