"""Showing the results: a table (coloured on a terminal) plus the evidence and fix of every
warning and failure, or the JSON list for --json."""
from __future__ import annotations

import textwrap
from typing import Dict, List, Sequence

from .result import CheckResult, Status, worst

COLOURS: Dict[Status, str] = {
    Status.OK: "\033[32m",  # green
    Status.WARN: "\033[33m",  # yellow
    Status.FAIL: "\033[1;31m",  # bold red
    Status.SKIPPED: "\033[2m",  # dim
}
RESET = "\033[0m"
SUMMARY_WIDTH = 72
FIX_WIDTH = 60


def to_json(results: Sequence[CheckResult]) -> List[dict]:
    return [r.to_json() for r in results]


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _paint(text: str, status: Status, colour: bool) -> str:
    return f"{COLOURS[status]}{text}{RESET}" if colour else text


def render_table(results: Sequence[CheckResult], colour: bool = False) -> str:
    """CHECK / RESULT / EVIDENCE / FIX, one row per result; the fix column shows its first line."""
    headers = ("CHECK", "RESULT", "EVIDENCE", "FIX")
    rows = [(r.label, r.status.value, _clip(r.summary, SUMMARY_WIDTH),
             _clip(r.fix.splitlines()[0], FIX_WIDTH) if r.fix and r.status in (Status.WARN, Status.FAIL) else "")
            for r in results]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(headers)]

    def line(cells, status=None):
        padded = [c.ljust(widths[i]) for i, c in enumerate(cells)]
        if status is not None:
            padded[1] = _paint(padded[1], status, colour)
        return "  ".join(padded).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(row, r.status) for row, r in zip(rows, results)]
    return "\n".join(out)


def render_problems(results: Sequence[CheckResult], colour: bool = False) -> str:
    """The full evidence and fix of each warning and failure."""
    blocks = []
    for r in results:
        if r.status not in (Status.WARN, Status.FAIL):
            continue
        block = [f"{_paint(r.status.value.upper(), r.status, colour)} {r.label}: {r.summary}"]
        block += [f"    read: {e}" for e in r.evidence]
        for i, fix_line in enumerate(r.fix.splitlines()):
            prefix = "    fix:  " if i == 0 else "          "
            block += textwrap.wrap(fix_line, 100, initial_indent=prefix, subsequent_indent="          ")
        blocks.append("\n".join(block))
    return "\n\n".join(blocks)


def render_text(results: Sequence[CheckResult], colour: bool = False) -> str:
    counts = {s: sum(1 for r in results if r.status is s) for s in Status}
    overall = worst(list(results))
    parts = [render_table(results, colour)]
    problems = render_problems(results, colour)
    if problems:
        parts.append(problems)
    parts.append(_paint(f"{counts[Status.OK]} ok, {counts[Status.WARN]} warn, {counts[Status.FAIL]} fail, "
                        f"{counts[Status.SKIPPED]} skipped", overall, colour))
    return "\n\n".join(parts)
