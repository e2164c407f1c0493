"""Asymmetric Namespace Access (docs/protocol.md §5.9; docs/multipath.md).

An ANA group is a set of namespaces (each namespace's `ana_grpid`); each *port* gives every group a state.  A
host reaches a namespace through one controller per port, so the state of (port, group) is the state of that
path.  The model is nvmet's (nvmet_ports_make, nvmet_execute_get_log_page_ana, nvmet_check_ana_state):

- the groups are 1 (always) plus every `grpid` listed in some port's `ana_groups`; a namespace may only use one
  of them (nvmet refuses any other ana_grpid with EINVAL);
- on a port, group 1 starts optimized, a group the port lists starts in the listed state, and any other group
  is inaccessible there;
- the ANA log page lists every group with the state on the reading controller's port, its namespaces (none with
  RGO), and one change count that moves whenever any state changes;
- I/O to a namespace whose group is inaccessible, persistent-loss or change on that port fails with the ANA
  status (SCT 3, no DNR: the host retries on another path);
- a state change sends the ANA change notice (0x03) to every controller on that port that enabled it (Set
  Features Async Event Configuration bit 11).

Controllers that arrived through no particular port (a Target used directly as the handler, in tests) see every
group optimized.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional

from ..config import ANA_GRPID_MAX, ANA_STATES, ConfigError, TargetConfig
from ..errors import NvmeofError
from ..nvme import admin as A
from ..nvme import identify as I
from ..nvme import log as L
from ..nvme import status as S
from . import fast_path_view

if TYPE_CHECKING:
    from .core import Target

log = logging.getLogger(__name__)

DEFAULT_GRPID = 1
ANATT_SECONDS = 10  # ANA transition time the host waits in "change" before resetting (nvmet's value)
ANACAP = (I.ANACAP_OPTIMIZED | I.ANACAP_NON_OPTIMIZED | I.ANACAP_INACCESSIBLE | I.ANACAP_PERSISTENT_LOSS
          | I.ANACAP_CHANGE)
ANA_AER_RESULT = A.aer_result(A.AER_TYPE_NOTICE, A.AER_NOTICE_ANA, A.LID_ANA)

# I/O status on a path in each state (nvmet_check_ana_state); optimized and non-optimized serve I/O.
IO_STATUS = {"inaccessible": S.ANA_INACCESSIBLE, "persistent-loss": S.ANA_PERSISTENT_LOSS,
             "change": S.ANA_TRANSITION}
# Identify Namespace NUSE is 0 where the namespace cannot be reached (nvmet_execute_identify_ns)
UNREACHABLE = ("inaccessible", "persistent-loss")


class AnaError(NvmeofError):
    pass


class AnaTable:
    """The ANA state of every (port, group), and the change count."""

    def __init__(self, config: TargetConfig):
        groups = {DEFAULT_GRPID}
        for port in config.ports:
            groups.update(a.grpid for a in port.ana_groups)
        self.groups: List[int] = sorted(groups)
        for i, sub in enumerate(config.subsystems):
            for j, ns in enumerate(sub.namespaces):
                if ns.ana_grpid not in groups:
                    raise ConfigError(config.source, f"subsystems[{i}].namespaces[{j}].ana_grpid",
                                      f"ANA group {ns.ana_grpid} is not defined on any port",
                                      f'add {{"grpid": {ns.ana_grpid}, "ana": {{"state": "optimized"}}}} to the '
                                      "ana_groups of the ports that serve it, or use group 1")
        self._states: Dict[int, Dict[int, str]] = {}
        for port in config.ports:
            states = {g: "inaccessible" for g in self.groups}
            states[DEFAULT_GRPID] = "optimized"
            for a in port.ana_groups:
                states[a.grpid] = a.state
            self._states[port.portid] = states
        self.chgcnt = 1

    def portids(self) -> List[int]:
        return sorted(self._states)

    def state(self, portid: Optional[int], grpid: int) -> str:
        if portid is None:
            return "optimized"
        return self._states[portid].get(grpid, "inaccessible")

    def io_status(self, portid: Optional[int], grpid: int) -> int:
        """0 when I/O may proceed on this path, else the ANA status."""
        if portid is None:
            return 0
        return IO_STATUS.get(self._states[portid].get(grpid, "inaccessible"), 0)

    def states(self) -> Dict[int, Dict[int, str]]:
        return {p: dict(s) for p, s in self._states.items()}

    def check(self, portid: int, grpid: int, state: str) -> None:
        """Raise AnaError naming the bad argument, with the values that would work."""
        if portid not in self._states:
            raise AnaError(f"port {portid} is not a port of this target",
                           f"use one of the configured portids: {', '.join(map(str, self.portids()))}")
        if grpid not in self.groups:
            raise AnaError(f"ANA group {grpid} does not exist",
                           f"use one of the groups {', '.join(map(str, self.groups))} (a group exists when a port "
                           f"lists it in ana_groups; 1 always exists; at most {ANA_GRPID_MAX})")
        if state not in ANA_STATES:
            raise AnaError(f"unknown ANA state {state!r}", f"use one of: {', '.join(ANA_STATES)}")

    def set_state(self, portid: int, grpid: int, state: str) -> bool:
        """Change one state; True if it changed (the change count moves)."""
        self.check(portid, grpid, state)
        if self._states[portid][grpid] == state:
            return False
        self._states[portid][grpid] = state
        self.chgcnt += 1
        return True

    def log_page(self, portid: Optional[int], namespaces: Iterable, rgo: bool) -> bytes:
        """The ANA log page as a controller on `portid` reads it (nvmet_execute_get_log_page_ana)."""
        members: Dict[int, List[int]] = {g: [] for g in self.groups}
        if not rgo:
            for ns in sorted(namespaces, key=lambda n: n.nsid):
                members.setdefault(ns.ana_grpid, []).append(ns.nsid)
        descs = [L.AnaGroupDescriptor(grpid=g, state=L.ANA_STATES[self.state(portid, g)], chgcnt=self.chgcnt,
                                      nsids=[] if rgo else members[g]) for g in self.groups]
        return L.AnaLog(chgcnt=self.chgcnt, groups=descs).pack()

    @staticmethod
    def log_size(max_nsid: int) -> int:
        """The largest ANA log: what the Linux host reads (nvme_mpath_init_identify), must fit MDTS."""
        return L.ANA_HEADER_SIZE + ANA_GRPID_MAX * L.ANA_DESC_SIZE + 4 * max_nsid


def set_ana_state(target: "Target", portid: int, grpid: int, state: str) -> bool:
    """Change (port, group) to `state` and send the ANA change notice to that port's controllers."""
    if not target.ana.set_state(portid, grpid, state):
        return False
    log.warning("ANA: port %d group %d is now %s (change count %d)", portid, grpid, state, target.ana.chgcnt)
    for ctrl in target.controllers():
        if ctrl.is_discovery or ctrl.dead or ctrl.port.portid != portid:
            continue
        ctrl.add_event(A.AEN_CFG_ANA_CHANGE, ANA_AER_RESULT)
        target.deliver_events(ctrl)
    if target.has_fast_path:
        fast_path_view.refresh_all(target)  # before any fast-path queue polls again
    return True


def apply_states(target: "Target", states: Dict[int, Dict[int, str]]) -> List[str]:
    """Apply {portid: {grpid: state}}; entries for unknown ports or groups are reported, not applied."""
    problems = []
    for portid, groups in sorted(states.items()):
        for grpid, state in sorted(groups.items()):
            try:
                set_ana_state(target, portid, grpid, state)
            except AnaError as exc:
                problems.append(str(exc))
    return problems
