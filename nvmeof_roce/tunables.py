"""Every tunable of the userspace target, declared once: name, type, default, range, help.

Read from here by the config loader (config/loader.py: the top-level "nvmeof_roce" settings, `workers`, a
subsystem's `qid_max`, which the RPC method nvmeof_subsystem_set_qid_max edits through the same loader), by
`target serve`'s options (service/serve.py, service/workers.py) and checked against docs/target.md's tables
by tests/unit/test_tunables.py. `ResourceLimits` (transport/resources.py) holds the values of the resource
options in force, with its defaults and range checks taken from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

from .errors import NvmeofError

Number = Union[int, float]


@dataclass(frozen=True)
class Tunable:
    """One setting: `name` is its config key or its option without `--` and with `_` for `-`."""
    name: str
    type: type  # int or float
    default: Optional[Number]  # None: no value unless one is given (see `help`)
    low: Number
    high: Number
    help: str  # one line, the --help text and the meaning in the docs' table
    metavar: str = "N"

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def range_text(self) -> str:
        return f"{self.low:g}..{self.high:g}"

    def in_range(self, value: Number) -> bool:
        return self.low <= value <= self.high

    def check_option(self, value: Number) -> Number:
        """`value` given as the command-line option: returned, or NvmeofError naming the option and the range."""
        if not self.in_range(value):
            raise NvmeofError(f"{self.option} {value:g}: out of range", f"use {self.low:g}-{self.high:g}")
        return value


@dataclass(frozen=True)
class Choice:
    """One setting that takes one of a few words (a `target serve` option): `name` as for a Tunable."""
    name: str
    choices: Tuple[str, ...]
    default: str
    help: str  # one line, the --help text and the meaning in the docs

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check_option(self, value: str) -> str:
        """`value` given as the command-line option: returned, or NvmeofError naming the option and the words."""
        if value not in self.choices:
            raise NvmeofError(f"{self.option} {value}: not a choice", f"use one of: {', '.join(self.choices)}")
        return value


def _declare(*tunables: Tunable) -> Dict[str, Tunable]:
    return {t.name: t for t in tunables}


# `target serve` options: what the target commits to its ports and queues (ResourceLimits' fields;
# docs/target.md "Resources"). Forwarded as they are to each worker of `serve --workers`.
RESOURCE_LIMITS: Dict[str, Tunable] = _declare(
    Tunable("data_buffers", int, 1024, 8, 1 << 20,
            "data buffers registered at start per port, each MDTS (128 KiB) bytes, shared by the port's queues"),
    Tunable("queue_min_buffers", int, 1, 1, 64, "data buffers guaranteed to each queue once its NVMe Connect succeeds"),
    Tunable("max_queues_per_ctrl", int, 128, 1, 65535,
            "most I/O queues Set Features Number of Queues grants one controller (also capped by the subsystem's "
            "qid_max and the pool)"),
    Tunable("max_queues_per_host", int, 256, 1, 1 << 20, "most I/O queues of one host NQN over all its controllers"),
    Tunable("max_controllers", int, 256, 1, 65519,
            "most I/O controllers over all hosts, after each host's own cap (discovery controllers have their own "
            "caps)"),
    Tunable("max_connecting_per_address", int, 0, 0, 1 << 20,
            "most connections from one peer address awaiting their NVMe Connect; more are refused at the CM "
            "(0: --max-queues-per-host + 1, what one host opens before its Connects)"),
    Tunable("connect_timeout", float, 5.0, 0.5, 600, "close a connection without a successful NVMe Connect after "
            "this long", metavar="SECONDS"),
    Tunable("queue_file_buffers", int, 32, 1, 4096,
            "bounce buffers, each MDTS bytes, that each native I/O queue registers for file and block namespaces' "
            "I/O (at most its depth); a command waits for a free one"),
    Tunable("mdts", int, 5, 1, 8, "largest command: 4 KiB x 2^N, advertised as MDTS and the size of each data buffer "
            "(5: 128 KiB; nvmet-rdma's is 8: 1 MiB, for nvme-cli passthrough of more)"),
)

# Settings in the config's top-level "nvmeof_roce" object (docs/target.md "Target settings").
TARGET_SETTINGS: Dict[str, Tunable] = _declare(
    Tunable("max_kato", int, 300, 1, 3600, "seconds: the longest keep-alive timeout a host may ask for; also the "
            "idle limit of an I/O controller connected with KATO 0"),
    Tunable("discovery_idle_limit", int, 120, 1, 3600,
            "seconds a discovery controller with KATO 0 may stay idle (nvmet: 120)"),
    Tunable("drain_timeout", int, 10, 1, 600, "seconds a change to a namespace (a live change, a Preempt and Abort) "
            "waits for the commands in flight on it before their queues are torn down (their hosts reconnect and "
            "retry); at twice this the change is given up. Under the Linux host's 30 s I/O timeout"),
    Tunable("persist", int, 0, 0, 1, "1: write every accepted live change to the config file, atomically; "
            "`serve --persist` / `--no-persist` override it, the systemd unit passes --persist"),
)

# `serve --workers N` or the config's nvmeof_roce.workers (docs/multipath.md); no default: one process.
WORKERS = Tunable("workers", int, None, 1, 64, "serve with N worker processes, one RDMA listener each on "
                  "trsvcid+i (default: the config's nvmeof_roce.workers, else one process)")

# A subsystem's attr.qid_max (nvmet's attr_qid_max; RPC nvmeof_subsystem_set_qid_max); no default: the target's.
QID_MAX = Tunable("qid_max", int, None, 1, 65535, "the most I/O queues a controller of the subsystem may have")

# `target serve --poll`: how the native data path's queues learn of completions (docs/native.md).
POLL = Choice("poll", ("interrupt", "adaptive", "busy"), "interrupt",
              "how native I/O queues find their completions: interrupt sleeps on the completion channels (the "
              "default), adaptive keeps polling a queue up to --poll-spin-us after its last completion before it "
              "sleeps, busy polls every native queue on each event-loop pass without sleeping (lower latency, "
              "one core kept busy); needs --data-path native")

# `target serve --poll adaptive --poll-spin-us N`: the bound of an adaptive poll's spin (docs/native.md).
POLL_SPIN_US = Tunable("poll_spin_us", int, 200, 1, 100000, "with --poll adaptive: µs a native queue keeps "
                       "polling after its last completion before it arms its CQs and sleeps", metavar="US")

# `target serve --cores N`: poll-group threads of the native data path (docs/native.md, "Poll groups").
CORES = Tunable("cores", int, 1, 1, 64, "poll native I/O queues on N threads without the GIL, each queue on one "
                "thread, round-robin as hosts connect (1: the event loop polls them); needs --data-path native "
                "--poll busy and at most one thread per CPU")

# `target serve --trace`: the native data path's per-command trace (docs/native.md, "The per-command trace").
TRACE = Choice("trace", ("off", "on"), "off",
               "the native data path's per-command trace: each native I/O queue records its commands' events in a "
               "ring and the lines are logged at debug level (-vv), as the Python data path's; the RPC "
               "trace_enable_tpoint_group turns it on while serving; needs --data-path native")

ALL: Tuple[Tunable, ...] = (*RESOURCE_LIMITS.values(), *TARGET_SETTINGS.values(), WORKERS, QID_MAX, CORES,
                            POLL_SPIN_US)
