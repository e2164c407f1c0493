"""`nvmeof-roce` entry point: thin; each layer registers its own sub-commands."""
import argparse
import importlib
import logging
import os
import sys

from . import __version__
from .errors import NvmeofError
from .output import add_output_format

# Each module has register(subparsers); a command's handler is set with
# parser.set_defaults(func=handler) and returns an exit code (or None for 0).
COMMAND_MODULES = [
    "nvmeof_roce.lab.commands",
    "nvmeof_roce.service.commands",
    "nvmeof_roce.initiator.commands",
    "nvmeof_roce.kernel.nvmet_commands",
    "nvmeof_roce.kernel.host_commands",
    "nvmeof_roce.kernel.rdma_commands",
    "nvmeof_roce.shell.commands",
    "nvmeof_roce.bench.commands",
    "nvmeof_roce.doctor.commands",
    "nvmeof_roce.fabric.commands",
    "nvmeof_roce.systemd",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nvmeof-roce",
        description="NVMe over Fabrics on RDMA (RoCE): userspace target and initiator, "
        "kernel nvmet/nvme-cli management, benchmarks, and a QEMU lab.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    for command in commands(parser):
        add_common_options(command)
    return parser


def commands(parser: argparse.ArgumentParser):
    """Every command's own parser (`target check`, `host list`, ...): the leaves of the tree, each once."""
    seen = set()

    def walk(p):
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs and p is not parser:
            yield p
        for action in subs:
            for child in action.choices.values():
                if id(child) not in seen:
                    seen.add(id(child))
                    yield from walk(child)
    return list(walk(parser))


def add_common_options(command: argparse.ArgumentParser) -> None:
    """What works after the command as before it: -v (counted with the ones before), and nvme-cli's
    -o json|normal wherever --json is."""
    options = command._option_string_actions
    if "-v" not in options and "--verbose" not in options:
        command.add_argument("-v", "--verbose", action="count", default=0, dest="verbose_after",
                             help="more logging (-vv for debug), as before the command")
    if "--json" in options and "-o" not in options and "--output-format" not in options:
        add_output_format(command)


def stderr_is_journal(environ=os.environ, stream=None) -> bool:
    """True when stderr is systemd-journald's stream ($JOURNAL_STREAM names its device and inode)."""
    dev, _, ino = environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat((stream or sys.stderr).fileno())
        return (st.st_dev, st.st_ino) == (int(dev), int(ino))
    except (ValueError, OSError, AttributeError):
        return False


class JournalFormatter(logging.Formatter):
    """For journald: no timestamp (the journal adds its own), the level as sd-daemon's <N> prefix so
    `journalctl -p` filters on it."""

    PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def __init__(self):
        super().__init__("%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{self.PRIORITY.get(record.levelno, 6)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


def setup_logging(verbose: int) -> None:
    handler = logging.StreamHandler()
    if stderr_is_journal():
        handler.setFormatter(JournalFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    root = logging.getLogger()
    if root.handlers:  # a caller (a test) that set up logging keeps its own, as logging.basicConfig does
        return
    root.addHandler(handler)
    root.setLevel(logging.WARNING - 10 * min(verbose, 2))


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.verbose += getattr(args, "verbose_after", 0)
    setup_logging(args.verbose)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (`... --json | head`): as a program killed by SIGPIPE, without a traceback;
        # stdout points at /dev/null so the interpreter's final flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except NvmeofError as exc:
        print(f"nvmeof-roce: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nvmeof-roce: interrupted", file=sys.stderr)
        return 130
    return 0 if code is None else int(code)


if __name__ == "__main__":
    sys.exit(main())
