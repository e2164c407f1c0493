"""Printing results: a human table/text, or JSON with --json."""
import argparse
import json
import sys
from typing import Any, Iterable, Sequence


def add_json_option(parser) -> None:
    """The `--json` flag every command that prints a result has."""
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


class OutputFormat(argparse.Action):
    """nvme-cli's -o/--output-format json|normal: sets `json` as --json does, and keeps the word in
    `output_format` for a command whose -o json is nvme-cli's own schema (`host list`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        namespace.json = values == "json"
        namespace.output_format = values


def add_output_format(parser) -> None:
    """-o/--output-format beside a command's --json (cli.py gives it to every command that has --json)."""
    parser.add_argument("-o", "--output-format", choices=("json", "normal"), action=OutputFormat,
                        dest="output_format", help="as nvme-cli: json (= --json) or normal (the default)")


def emit(result: Any, as_json: bool, human=None) -> None:
    """Print `result` as JSON, or through `human(result)` (default: str)."""
    if as_json:
        json.dump(result, sys.stdout, indent=2, sort_keys=False, default=str)
        sys.stdout.write("\n")
    elif human is not None:
        human(result)
    else:
        print(result)


def address(traddr: Any, trsvcid: Any) -> str:
    """An IP transport address as a reader writes it: 10.0.0.1:4420, and [fe80::1]:4420 for IPv6."""
    host = str(traddr)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{trsvcid}"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain left-aligned text table."""
    rows = [[("" if c is None else str(c)) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    lines = ["  ".join(h.ljust(widths[i]) for i, h in enumerate(headers)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
    return "\n".join(lines)


def progress(message: str) -> None:
    """A progress line for anything slow; goes to stderr so --json stdout stays clean."""
    print(f"[nvmeof-roce] {message}", file=sys.stderr, flush=True)
