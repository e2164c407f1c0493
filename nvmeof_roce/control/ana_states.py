"""`target ana-state`: a running target's ANA states, shown and changed by port ID over its control socket.

The states come from `nvmeof_get_status` (its `ports`), a change is SPDK's
`nvmf_subsystem_listener_set_ana_state` on that port's address; under `serve --workers` the supervisor makes it
on every worker (control/fanout.py).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..config import ANA_STATES
from ..errors import NvmeofError
from .client import call
from .protocol import RpcError

TIMEOUT = 60.0


def _call(path: str, method: str, params: Optional[dict], timeout: float) -> Any:
    try:
        return call(path, method, params, timeout=timeout)
    except RpcError as exc:
        where = f" ({exc.field})" if exc.field else ""
        raise NvmeofError(f"{method}{where}: {exc.message}", exc.fix) from None


def ana_states(path: str, timeout: float = TIMEOUT) -> List[dict]:
    """Every (port, group) of the target at `path` with its state: [{"portid", "grpid", "state"}]."""
    status = _call(path, "nvmeof_get_status", None, timeout)
    return [{"portid": p["portid"], "grpid": g["grpid"], "state": g["state"]}
            for p in sorted(status["ports"], key=lambda p: p["portid"]) for g in p["ana_groups"]]


def change_ana_state(path: str, portid: int, grpid: int, state: str, timeout: float = TIMEOUT) -> int:
    """Set group `grpid` on port `portid` to `state` in the target at `path` (every worker of one); returns the
    number of workers that made the change (1 for a single process)."""
    if state not in ANA_STATES:
        raise NvmeofError(f"unknown ANA state {state!r}", f"use one of: {', '.join(ANA_STATES)}")
    status = _call(path, "nvmeof_get_status", None, timeout)
    ports: Dict[int, dict] = {p["portid"]: p for p in status["ports"]}
    port = ports.get(portid)
    if port is None:
        raise NvmeofError(f"port {portid} is not a port of the running target",
                          f"use one of its portids: {', '.join(map(str, sorted(ports)))}")
    groups = [g["grpid"] for g in port["ana_groups"]]
    if grpid not in groups:
        raise NvmeofError(f"ANA group {grpid} does not exist in the running target",
                          f"use one of its groups: {', '.join(map(str, groups))}")
    if not port["subsystems"]:
        # the method names the port by a subsystem listening there; a port without any serves no namespace
        raise NvmeofError(f"port {portid} serves no subsystem, so no host reaches a namespace through it",
                          "add a subsystem to the port first (target add-listener)")
    _call(path, "nvmf_subsystem_listener_set_ana_state", {
        "nqn": port["subsystems"][0], "anagrpid": grpid, "ana_state": state,
        "listen_address": {"trtype": port["trtype"], "adrfam": port["adrfam"], "traddr": port["traddr"],
                           "trsvcid": port["trsvcid"]}}, timeout)
    return len(status.get("workers") or []) or 1
