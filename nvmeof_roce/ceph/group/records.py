"""What a gateway group keeps in RADOS: the object's name, its omap keys and the records' JSON.

One object per group, `nvmeof_roce.group.<group>`, in the pool the gateways are given; its omap:

    epoch                      decimal: bumped by every change of the keys below but `resv.*`
    config.<section>           one section of the group's target config (`subsystems`, `hosts`, ...), opaque JSON
    member.<gateway>           Member: the gateway's RADOS client (address, instance id), ports, start time
    ana.<grpid>                AnaGroup: the ANA group's home gateway and current owner (the owner's client)
    failback.<grpid>           FailbackRequest: the owner is asked to hand the ANA group back to its home
    resv.<nqn>.<nsid>          Reservation: one namespace's registrants, holder, type, generation (own CAS)

One lock object per ANA group carries its lease: `nvmeof_roce.group.<group>.ana.<grpid>` (ceph/group/ana.py).
Values are compact JSON with sorted keys, ASCII only, so that equal records are equal bytes (compare-and-swap
by value, omap_cmp) and never empty (an absent omap key compares equal to the empty value).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .errors import GroupError

OBJECT_PREFIX = "nvmeof_roce.group."
EPOCH_KEY = "epoch"
CONFIG_PREFIX = "config."
MEMBER_PREFIX = "member."
ANA_PREFIX = "ana."
FAILBACK_PREFIX = "failback."
RESERVATION_PREFIX = "resv."

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(kind: str, name: str) -> str:
    """A group or gateway name: it is part of object names, omap keys and lock cookies."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise GroupError(f"{kind} name {name!r} is not usable",
                         f"name the {kind} with letters, digits, '.', '_' and '-' (at most 128, a letter or "
                         "digit first)")
    return name


def group_object(group: str) -> str:
    return OBJECT_PREFIX + check_name("group", group)


def lease_object(group: str, grpid: int) -> str:
    return f"{group_object(group)}.ana.{int(grpid)}"


def encode(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def decode(key: str, raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise GroupError(f"the group object's omap key {key!r} is not JSON: {exc}",
                         "remove the key (rados rmomapkey) or restore it from another gateway's saved config")


def reservation_key(nqn: str, nsid: int) -> str:
    return f"{RESERVATION_PREFIX}{nqn}.{int(nsid)}"


def parse_reservation_key(key: str) -> Tuple[str, int]:
    nqn, _, nsid = key[len(RESERVATION_PREFIX):].rpartition(".")
    return nqn, int(nsid)


@dataclass(frozen=True)
class Member:
    """A gateway of the group and its RADOS client: the address a survivor blocklists, the instance id its lock
    is held under (`client.<instance_id>`)."""
    gateway: str
    addr: str
    instance_id: int
    ports: List[Any] = field(default_factory=list)
    started: float = 0.0  # wall-clock time the gateway joined (time.time())
    # The gateway's other RADOS clients (the native data path's, one per rbd namespace): fenced with `addr`,
    # published before they serve (service/group.py, ceph/clients.py announce)
    fence_addrs: List[str] = field(default_factory=list)

    @classmethod
    def of(cls, gateway: str, cluster, ports: Optional[List[Any]] = None, started: float = 0.0) -> "Member":
        """This process's member record for `gateway` on the connected `rados.Rados` `cluster`."""
        return cls(check_name("gateway", gateway), blocklist_address(cluster.get_addrs()),
                   int(cluster.get_instance_id()), list(ports or []), started)

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Dict[str, Any]) -> "Member":
        return cls(value["gateway"], value["addr"], int(value["instance_id"]), list(value.get("ports", [])),
                   float(value.get("started", 0.0)), list(value.get("fence_addrs", [])))


@dataclass(frozen=True)
class AnaGroup:
    """An ANA group: its home gateway (where it belongs when all are up) and who owns its lease now."""
    grpid: int
    home: str
    owner: Optional[Member] = None  # the client that took the lease (None: nobody, or handed back)
    since: float = 0.0  # wall-clock time of the last change of owner

    def to_json(self) -> Dict[str, Any]:
        return {"grpid": self.grpid, "home": self.home, "since": self.since,
                "owner": self.owner.to_json() if self.owner else None}

    @classmethod
    def from_json(cls, value: Dict[str, Any]) -> "AnaGroup":
        owner = value.get("owner")
        return cls(int(value["grpid"]), value["home"], Member.from_json(owner) if owner else None,
                   float(value.get("since", 0.0)))


@dataclass(frozen=True)
class FailbackRequest:
    """The owner of `grpid` is asked to hand it back to `to` (its home): by an admin, or its settle time passed."""
    grpid: int
    to: str
    reason: str  # "admin" | "settle"
    requested: float  # wall-clock time

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Dict[str, Any]) -> "FailbackRequest":
        return cls(int(value["grpid"]), value["to"], value["reason"], float(value["requested"]))


@dataclass
class Reservation:
    """One namespace's NVMe reservation as every gateway sees it: registrants (host identifier, hex -> key),
    the holder's host identifier, the type (0: none), the generation.  `rev` counts the record's writes, so a
    compare-and-swap never mistakes a record changed and changed back for the one it read.  `changes`: what
    the last changes told (the engine's, opaque here: engine/shared_resv.py), written with the state."""
    registrants: Dict[str, int] = field(default_factory=dict)
    holder: Optional[str] = None
    rtype: int = 0
    generation: int = 0
    rev: int = 0
    changes: List[Any] = field(default_factory=list)

    def is_empty(self) -> bool:
        """Nothing registered, held or counted yet: the same as no record (the record is removed)."""
        return not self.registrants and self.holder is None and self.rtype == 0 and self.generation == 0

    def same_state(self, other: "Reservation") -> bool:
        return (self.registrants, self.holder, self.rtype, self.generation) == \
            (other.registrants, other.holder, other.rtype, other.generation)

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Dict[str, Any]) -> "Reservation":
        return cls({str(k): int(v) for k, v in value.get("registrants", {}).items()}, value.get("holder"),
                   int(value.get("rtype", 0)), int(value.get("generation", 0)), int(value.get("rev", 0)),
                   list(value.get("changes", [])))


def blocklist_address(addrs: str) -> str:
    """The address `osd blocklist add` takes for a client, from `Rados.get_addrs()` ("127.0.0.1:0/3328954605",
    or a vector "[v2:...,v1:...]" on some clusters) or a lock's locker address: the first address, without its
    "v1:"/"v2:"/"any:" type (the OSDs match a blocklist entry whatever the type since Nautilus)."""
    text = addrs.strip().strip("[]").split(",")[0].strip()
    for prefix in ("v1:", "v2:", "any:"):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text
