"""Runs every check against one Context and collects the results."""
from __future__ import annotations

import logging
import traceback
from typing import Callable, List, Optional

from ..errors import ToolMissing
from .context import Context, DoctorOptions
from .machine import Machine, ToolNotRun, missing_tool_reason
from .result import CheckResult, skipped, warn

log = logging.getLogger(__name__)


def _call(check_id: str, function: Callable, subject: str, *args) -> List[CheckResult]:
    """One check call; a tool that cannot run becomes 'skipped', a crash becomes a warning."""
    try:
        result = function(*args)
    except (ToolMissing, ToolNotRun) as exc:
        return [skipped(check_id, subject, missing_tool_reason(exc))]
    except Exception as exc:  # a bug in a check must not hide the other checks
        log.debug("check %s crashed", function.__name__, exc_info=True)
        return [warn(check_id, subject, f"the check itself failed: {type(exc).__name__}: {exc}",
                     traceback.format_exc().splitlines()[-3:],
                     "this is a bug in nvmeof-roce doctor: please report it with the output of --json")]
    return result if isinstance(result, list) else [result]


def run_checks(context: Context, checks: Optional[list] = None) -> List[CheckResult]:
    """Run `checks` (default: all, in report order) and return their results in order."""
    if checks is None:
        from .checks import CHECKS as checks
    results: List[CheckResult] = []
    for scope, check_id, function in checks:
        if scope == "host":
            results += _call(check_id, function, "", context)
        elif scope == "device":
            for device in context.devices:
                results += _call(check_id, function, device.name, context, device)
        elif scope == "port":
            for port in context.ports:
                results += _call(check_id, function, port.name, context, port)
        else:
            raise ValueError(f"unknown check scope {scope!r}")
    return results


def diagnose(root: str = "/", options: Optional[DoctorOptions] = None, runner=None, discover=None,
             sleep=None, machine: Optional[Machine] = None) -> List[CheckResult]:
    """Build a Machine and Context and run every check: the one-call entry point."""
    if machine is None:
        kwargs = {"sleep": sleep} if sleep is not None else {}
        machine = Machine(root, runner=runner, **kwargs)
    return run_checks(Context(machine, options, discover=discover))
