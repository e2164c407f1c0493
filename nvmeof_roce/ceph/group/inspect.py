"""A gateway group read from outside its gateways, with a RADOS client of its own (`nvmeof-roce doctor --config`
when no running gateway answers `nvmeof_group_status`; docs/doctor.md): the group's state object, each ANA group's
lease holder and the OSD blocklist.  Read only: nothing is written, no lease taken, no watch registered.

`inspect(conf, client_id, keyring, pool, namespace, group, timeout)` -> a dict in the shape of a gateway's
`nvmeof_group_status` (service/group.py `GroupMember.status`), as far as RADOS tells it: the members' records, each
ANA group's home, owner, lease holder and the time left on its lock (the OSD's expiry against this machine's
clock), the failback requests, and which members' clients are blocklisted.  No events (they are each gateway's
own) and no "here" (no gateway is asking).  A cluster that cannot be reached raises CephCallFailed.
"""
from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional

from . import clslock
from .ana import LOCK_NAME
from .errors import CephCallFailed, GroupError, call_failed
from .records import blocklist_address, lease_object
from .store import GroupStore, rados_module


def blocklisted(cluster) -> List[str]:
    """The addresses in the OSD blocklist now (`osd blocklist ls`)."""
    ret, out, status = cluster.mon_command(json.dumps({"prefix": "osd blocklist ls", "format": "json"}), b"")
    if ret != 0:
        raise CephCallFailed(f"osd blocklist ls failed ({ret}): {status}",
                             "give the client the mon cap 'profile rbd' (or read-only 'allow r')", abs(ret))
    text = (out or b"").decode(errors="replace").strip()
    entries = json.JSONDecoder().raw_decode(text)[0] if text else []  # the CLI prints the ranges after it
    return [blocklist_address(e.get("addr", "")) for e in entries if isinstance(e, dict)]


def inspect(conf: str, client_id: str, keyring: Optional[str], pool: str, namespace: str, group: str,
            timeout: float = 5.0, now=time.time) -> Dict[str, Any]:
    rados = rados_module()
    settings = {"rados_osd_op_timeout": str(max(1, int(timeout))), "rados_mon_op_timeout": str(max(1, int(timeout))),
                "client_mount_timeout": str(max(1, int(timeout)))}
    if keyring:
        settings["keyring"] = keyring
    where = f"the Ceph cluster of {conf} as client.{client_id}" + (f" (keyring {keyring})" if keyring else "")
    cluster = None
    try:
        cluster = rados.Rados(conffile=conf, rados_id=client_id, conf=settings)
        cluster.connect(timeout=timeout)
    except Exception as exc:
        if cluster is not None:
            cluster.shutdown()
        raise CephCallFailed(f"cannot reach {where}: {exc}",
                             f"check the cluster (ceph -s -c {conf} --id {client_id}"
                             + (f" --keyring {keyring}" if keyring else "") + "), the network to its monitors "
                             "and the key") from None
    try:
        try:
            ioctx = cluster.open_ioctx(pool)
        except rados.Error as exc:
            raise call_failed(f"{where}: opening pool {pool}", exc)
        try:
            if namespace:
                ioctx.set_namespace(namespace)
            return _read(ioctx, cluster, group, pool, now)
        finally:
            ioctx.close()
    finally:
        cluster.shutdown()


def _read(ioctx, cluster, group: str, pool: str, now) -> Dict[str, Any]:
    store = GroupStore(ioctx, group)
    snapshot = store.read()
    if not snapshot.exists:
        raise GroupError(f"gateway group {group}: no state object {store.object} in pool {pool}",
                         "start a gateway of the group (target serve), or give the pool and namespace its "
                         "gateways use")
    fenced = set(blocklisted(cluster))
    wall = now()
    groups = []
    for grpid, ana in sorted(snapshot.ana_groups.items()):
        info = clslock.get_info(ioctx, lease_object(group, grpid), LOCK_NAME)
        locker = info.lockers[0] if info and info.lockers else None
        groups.append({"ana_group": grpid, "home": ana.home, "owner": ana.owner.gateway if ana.owner else None,
                       "owner_instance": ana.owner.instance_id if ana.owner else None, "since": ana.since,
                       "holder": {"gateway": locker.cookie, "instance_id": locker.instance_id} if locker else None,
                       "lease_remaining": round(max(0.0, locker.expires - wall), 3) if locker else 0.0,
                       "holder_read_ago": 0.0,
                       "failback": snapshot.failbacks[grpid].to if grpid in snapshot.failbacks else None})
    records = []
    for name, m in sorted(snapshot.members.items()):
        addrs = [m.addr] + list(m.fence_addrs)
        records.append({"gateway": name, "addr": m.addr, "instance_id": m.instance_id, "started": m.started,
                        "fence_addrs": list(m.fence_addrs), "blocklisted": [a for a in addrs if a in fenced]})
    return {"group": group, "gateway": None, "epoch": snapshot.epoch, "members": sorted(snapshot.members),
            "member_records": records, "ana_groups": groups, "events": [], "fenced": False}
