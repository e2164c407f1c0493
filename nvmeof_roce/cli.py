"""`nvmeof-roce` entry point: thin; each layer registers its own sub-commands."""
import argparse
import importlib
import logging
import sys

from . import __version__
from .errors import NvmeofError

# Each module has register(subparsers); a command's handler is set with
# parser.set_defaults(func=handler) and returns an exit code (or None for 0).
COMMAND_MODULES = [
    "nvmeof_roce.lab.commands",
    "nvmeof_roce.target.commands",
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
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = args.func(args)
    except NvmeofError as exc:
        print(f"nvmeof-roce: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nvmeof-roce: interrupted", file=sys.stderr)
        return 130
    return 0 if code is None else int(code)


if __name__ == "__main__":
    sys.exit(main())
