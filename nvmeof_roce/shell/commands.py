"""`nvmeof-roce shell`: an interactive configshell over the kernel nvmet tree, or one-shot commands.

    nvmeof-roce shell                                   interactive (tab completion, history)
    nvmeof-roce shell ls /                              one command (the words after `shell`)
    nvmeof-roce shell -c "cd /subsystems; create nqn.2014-08.org.example:s1"
    nvmeof-roce shell -f script.txt                     one command per line (# comments)
    nvmeof-roce shell < script.txt                      the same, from stdin
"""
import argparse
import logging
import os
import sys
import warnings
from typing import Iterable, List

from ..errors import NvmeofError
from ..kernel.nvmet import NVMET_ROOT, Root

PREFS_DIR = "~/.nvmeof-roce/shell"


def split_commands(text: str) -> List[str]:
    """Command lines from a -c string or a script: split on ';' and newlines, drop blanks and # comments."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        out.extend(c.strip() for c in line.split(";") if c.strip())
    return out


def make_shell(root: Root, prefs_dir=None):
    # configshell-fb 2.0.3 uses pyparsing names pyparsing 3.3 deprecates; not the user's concern
    warnings.filterwarnings("ignore", message=r".*deprecated - use .*", category=DeprecationWarning)
    import configshell
    from .nodes import UIRoot
    shell = configshell.ConfigShell(prefs_dir)
    # configshell's Console binds the stdout it saw at import time: use the current one
    shell.con._stdout, shell.con._stderr = sys.stdout, sys.stderr
    shell.prefs["color_mode"] = sys.stdout.isatty()
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        # configshell's Log.debug calls inspect.stack() (reading the source of every frame) even when
        # nothing is logged: seconds per command on a slow filesystem
        shell.log.debug = lambda msg: None
    UIRoot(shell, root)
    return shell


def run_commands(root: Root, commands: Iterable[str]) -> int:
    """Run shell command lines one after another from /; stop at the first error (exit 1)."""
    from configshell import ExecutionError
    shell = make_shell(root)
    for cmd in commands:
        try:
            shell.run_cmdline(cmd)
        except (ExecutionError, NvmeofError) as exc:
            print(f"nvmeof-roce: error: {cmd}: {exc}", file=sys.stderr)
            return 1
        except Exception as exc:   # noqa: BLE001 - pyparsing errors for a malformed line
            if type(exc).__name__.startswith("Parse"):
                print(f"nvmeof-roce: error: {cmd}: cannot parse the command ({exc})", file=sys.stderr)
                return 1
            raise
    return 0


def interactive(root: Root) -> int:
    from configshell import ExecutionError
    prefs = os.path.expanduser(PREFS_DIR)
    try:
        shell = make_shell(root, prefs)
    except OSError:
        shell = make_shell(root)
    print("nvmeof-roce shell over the kernel nvmet tree. 'help' lists commands, 'exit' leaves.")
    while not shell._exit:
        try:
            shell.run_interactive()
        except (ExecutionError, NvmeofError) as exc:
            shell.log.error(str(exc))
        except Exception as exc:   # noqa: BLE001 - keep the session on a malformed line
            if type(exc).__name__.startswith("Parse"):
                shell.log.error(f"cannot parse the command: {exc}")
            else:
                raise
    return 0


def cmd_shell(args) -> int:
    root = Root(args.root or NVMET_ROOT)
    if args.command and args.words:
        raise NvmeofError("give the commands either with -c or after 'shell', not both",
                          'e.g. nvmeof-roce shell -c "cd /subsystems; ls"')
    if args.command:
        return run_commands(root, split_commands(args.command))
    if args.words:
        return run_commands(root, [" ".join(args.words)])
    if args.file:
        try:
            with open(args.file, "r", encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise NvmeofError(f"{args.file}: cannot read the script: {exc.strerror}", "check the path") from None
        return run_commands(root, split_commands(text))
    if not sys.stdin.isatty():
        return run_commands(root, split_commands(sys.stdin.read()))
    return interactive(root)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "shell", help="a configshell over the kernel nvmet tree (interactive, or one-shot commands)",
        description="Navigate and change the kernel target like nvmetcli: cd, ls, create/delete, get/set attribute "
                    "groups, enable/disable, saveconfig/restoreconfig. With -c, -f, stdin or words after 'shell' "
                    "it runs the commands and exits (non-zero at the first failure).")
    p.add_argument("-c", "--command", help="commands separated by ';' (or newlines)")
    p.add_argument("-f", "--file", help="a script: one command per line, # comments")
    p.add_argument("--root", default=NVMET_ROOT, help=argparse.SUPPRESS)
    p.add_argument("words", nargs=argparse.REMAINDER, help="one command, e.g.: ls /subsystems")
    p.set_defaults(func=cmd_shell)
