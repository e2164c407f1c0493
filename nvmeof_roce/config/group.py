"""A gateway group's settings: the `group` object of the config's top-level `nvmeof_roce` section
(docs/gateway-group.md).

    "nvmeof_roce": {"group": {"name": "gw-group", "gateway": "gw-a", "ana_groups": [2],
                              "conf": "/etc/ceph/ceph.conf", "id": "admin", "pool": "rbd",
                              "lease": 10, "failback": "manual"}}

A gateway serves the group's subsystems, namespaces and hosts (kept in RADOS, in `pool`) on its own ports (this
file's).  `ana_groups` are the ANA groups this gateway is the home of: it takes them when it starts and they are
free, and takes them back on failback.  `lease` is the ANA group lease in seconds: a gateway that could not renew
stops serving its groups before it ends; a survivor takes them over once it ended.  `failback` is "manual" (the
admin asks: `nvmeof-roce rpc nvmeof_group_failback`) or a settle time in seconds after the home gateway is back.
Checked offline here; the cluster, the pool and the key are checked when `target serve` connects.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

from .errors import ConfigError
from .rados_names import rados_names

GROUP_KEY = "group"
GROUP_KEYS = {"name", "gateway", "ana_groups", "conf", "id", "keyring", "pool", "namespace", "lease", "failback"}
DEFAULT_CONF = "/etc/ceph/ceph.conf"
DEFAULT_ID = "admin"
DEFAULT_POOL = "rbd"
DEFAULT_LEASE = 10  # seconds: the host's ANA transition time (ANATT) is 10 s too
LEASE_RANGE = (3, 120)
ANA_GRPID_MAX = 128  # as config.ANA_GRPID_MAX (kept here to stay free of the loader)
NAME_LONGEST = 64
# The group's and the gateway's names are part of RADOS object names, omap keys and lock cookies: the same rule as
# the group's records keep (ceph/group/records.py check_name), stricter than other RADOS names (no '+', a letter
# or digit first), so that a file `target check` passes does not fail at the gateway's start.
MEMBER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(frozen=True)
class GroupSettings:
    name: str
    gateway: str
    ana_groups: Tuple[int, ...]
    conf: str = DEFAULT_CONF
    client_id: str = DEFAULT_ID
    keyring: Optional[str] = None
    pool: str = DEFAULT_POOL
    namespace: str = ""
    lease: int = DEFAULT_LEASE
    failback: Union[str, int] = "manual"  # "manual" or a settle time in seconds

    def to_dict(self) -> dict:
        d = {"name": self.name, "gateway": self.gateway, "ana_groups": list(self.ana_groups), "conf": self.conf,
             "id": self.client_id, "pool": self.pool, "lease": self.lease, "failback": self.failback}
        if self.keyring:
            d["keyring"] = self.keyring
        if self.namespace:
            d["namespace"] = self.namespace
        return d


def parse_group(value: Any, source: str, where: str = "nvmeof_roce.group") -> GroupSettings:
    """The `group` object -> GroupSettings, or a ConfigError naming the key and the fix."""
    def err(key: str, problem: str, fix: str) -> ConfigError:
        return ConfigError(source, f"{where}.{key}" if key else where, problem, fix)

    example = '"group": {"name": "gw-group", "gateway": "gw-a", "ana_groups": [2]}'
    if not isinstance(value, dict):
        raise err("", f"must be an object, got {value!r}", f"write it as {example}")
    unknown = sorted(set(value) - GROUP_KEYS)
    if unknown:
        raise err(unknown[0], "is not a key of a gateway group", f"use {', '.join(sorted(GROUP_KEYS))}")
    for key in ("name", "gateway", "ana_groups"):
        if key not in value:
            raise err(key, "is required", f"write {example}")
    names = rados_names(value, {"name": None, "gateway": None, "id": DEFAULT_ID, "pool": DEFAULT_POOL,
                                "namespace": ""}, NAME_LONGEST, err, "letters, digits, '_', '.', '+', '-' (at most "
                        f"{NAME_LONGEST})")
    for key in ("name", "gateway"):
        if not MEMBER_NAME.fullmatch(names[key]):
            raise err(key, f"is not usable as a group's {'gateway' if key == 'gateway' else 'group'} name: "
                           f"{names[key]!r}", "letters, digits, '.', '_' and '-', a letter or digit first")
    groups = value["ana_groups"]
    if (not isinstance(groups, list) or not groups
            or not all(isinstance(g, int) and not isinstance(g, bool) and 1 <= g <= ANA_GRPID_MAX for g in groups)
            or len(set(groups)) != len(groups)):
        raise err("ana_groups", f"must be a list of distinct ANA group ids 1..{ANA_GRPID_MAX}, got {groups!r}",
                  'the ANA groups this gateway is the home of, e.g. "ana_groups": [2]; each gateway of the group '
                  "lists its own")
    for key in ("conf", "keyring"):
        v = value.get(key, DEFAULT_CONF if key == "conf" else None)
        if v is not None and (not isinstance(v, str) or not os.path.isabs(v)):
            raise err(key, f"must be an absolute path, got {v!r}", f'e.g. "{key}": "/etc/ceph/ceph.'
                      f'{"conf" if key == "conf" else "client.admin.keyring"}"')
    lease = value.get("lease", DEFAULT_LEASE)
    if not isinstance(lease, int) or isinstance(lease, bool) or not LEASE_RANGE[0] <= lease <= LEASE_RANGE[1]:
        raise err("lease", f"must be whole seconds {LEASE_RANGE[0]}..{LEASE_RANGE[1]}, got {lease!r}",
                  f'e.g. "lease": {DEFAULT_LEASE} (a failover takes about one lease; docs/gateway-group.md)')
    failback = value.get("failback", "manual")
    if failback != "manual" and (not isinstance(failback, int) or isinstance(failback, bool) or failback < 0):
        raise err("failback", f"must be \"manual\" or a settle time in whole seconds, got {failback!r}",
                  '"failback": "manual" (nvmeof_group_failback moves a group home) or e.g. "failback": 30')
    return GroupSettings(name=names["name"], gateway=names["gateway"], ana_groups=tuple(groups),
                         conf=value.get("conf", DEFAULT_CONF), client_id=names["id"], keyring=value.get("keyring"),
                         pool=names["pool"], namespace=names["namespace"], lease=lease, failback=failback)
