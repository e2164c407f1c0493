"""The outcome of one diagnostic check: a status, what was read, and what to do."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List


class Status(str, Enum):
    """How a check came out.  Ordered from harmless to serious by `SEVERITY`."""

    OK = "ok"
    SKIPPED = "skipped"
    WARN = "warn"
    FAIL = "fail"


SEVERITY = {Status.OK: 0, Status.SKIPPED: 1, Status.WARN: 2, Status.FAIL: 3}


@dataclass
class CheckResult:
    """One line of the doctor's report.

    check:    stable identifier, e.g. "port.mtu"
    subject:  what was checked, e.g. "mlx5_0/1" (device/port), "" for the whole host
    status:   ok / warn / fail / skipped
    summary:  one line for the table
    evidence: what was read, one "source: value" line each, so an admin can re-check by hand
    fix:      what to do about a warn or fail ("" when nothing is needed)
    details:  the parsed values, for --json consumers
    """

    check: str
    subject: str
    status: Status
    summary: str
    evidence: List[str] = field(default_factory=list)
    fix: str = ""
    details: Dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """The check name with its subject, as shown in the table."""
        return f"{self.check} {self.subject}" if self.subject else self.check

    def to_json(self) -> Dict[str, Any]:
        return {
            "check": self.check,
            "subject": self.subject,
            "status": self.status.value,
            "summary": self.summary,
            "evidence": list(self.evidence),
            "fix": self.fix,
            "details": self.details,
        }


def ok(check: str, subject: str, summary: str, evidence=(), fix: str = "", **details) -> CheckResult:
    return CheckResult(check, subject, Status.OK, summary, list(evidence), fix, details)


def warn(check: str, subject: str, summary: str, evidence=(), fix: str = "", **details) -> CheckResult:
    return CheckResult(check, subject, Status.WARN, summary, list(evidence), fix, details)


def fail(check: str, subject: str, summary: str, evidence=(), fix: str = "", **details) -> CheckResult:
    return CheckResult(check, subject, Status.FAIL, summary, list(evidence), fix, details)


def skipped(check: str, subject: str, reason: str, evidence=(), **details) -> CheckResult:
    """A check that could not run; `reason` says why (missing tool, not applicable, ...)."""
    details.setdefault("reason", reason)
    return CheckResult(check, subject, Status.SKIPPED, reason, list(evidence), "", details)


def worst(results: List[CheckResult]) -> Status:
    """The most serious status among `results` (OK for none)."""
    status = Status.OK
    for r in results:
        if SEVERITY[r.status] > SEVERITY[status]:
            status = r.status
    return status


def exit_code(results: List[CheckResult]) -> int:
    """0 when nothing failed, 1 when any check failed (warnings do not fail the run)."""
    return 1 if any(r.status is Status.FAIL for r in results) else 0
