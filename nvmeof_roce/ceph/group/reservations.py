"""NVMe reservations of the group's namespaces in RADOS: one omap key per namespace, changed atomically.

`ReservationStore(ioctx, group)` keeps `resv.<subsystem nqn>.<nsid>` in the group's object (records.py):

- `read(nqn, nsid)` -> `Reservation`: the OSD's record (an empty one when there is none): every gateway that
  reads gets the same answer.
- `update(nqn, nsid, change)`: `change(reservation)` edits a copy in place; the write compares the key's value
  with the one read (`omap_cmp`, equal bytes) and fails with ECANCELED when another gateway wrote it between, and
  is then done again from a new read.  A record with nothing registered, held or counted (generation 0) is
  removed.  The group's watchers are notified ("resv.<nqn>.<nsid>").
- `remove(nqn, nsid)`: the namespace is gone.

The epoch of the group is not bumped: reservation commands do not contend with config changes, and a
compare-and-swap on the record itself is as strong for one record (each write bumps its `rev`).
"""
from __future__ import annotations

import copy
import errno as errno_codes
import random
import time
from typing import Callable, Optional

from . import records as R
from .errors import GroupConflict, call_failed, errno_of
from .records import Reservation
from .store import UPDATE_ATTEMPTS, GroupStore, rados_module


class ReservationStore:
    def __init__(self, ioctx, group: str):
        self.store = GroupStore(ioctx, group)
        self.ioctx = ioctx

    def _read_raw(self, key: str) -> Optional[bytes]:
        rados = rados_module()
        with rados.ReadOpCtx() as op:
            it, _ = self.ioctx.get_omap_vals_by_keys(op, (key,))
            try:
                self.ioctx.operate_read_op(op, self.store.object)
            except rados.ObjectNotFound:
                return None
            except rados.Error as exc:
                raise call_failed(f"group {self.store.group}: reading {key}", exc)
            values = dict(it)
        raw = values.get(key)
        return bytes(raw) if raw else None

    def read(self, nqn: str, nsid: int) -> Reservation:
        raw = self._read_raw(R.reservation_key(nqn, nsid))
        return Reservation.from_json(R.decode("resv", raw)) if raw else Reservation()

    def update(self, nqn: str, nsid: int, change: Callable[[Reservation], None]) -> Reservation:
        """Apply `change` to the namespace's reservation atomically; the record after it.  `change` may run more
        than once (another gateway's write came between): no side effects in it."""
        def edit(before: Reservation) -> Optional[Reservation]:
            after = copy.deepcopy(before)
            change(after)
            return after
        return self._apply(nqn, nsid, edit) or Reservation()

    def remove(self, nqn: str, nsid: int) -> None:
        """Forget the namespace's reservation (the namespace is gone from the group)."""
        self._apply(nqn, nsid, lambda before: None)

    def _apply(self, nqn: str, nsid: int,
               compute: Callable[[Reservation], Optional[Reservation]]) -> Optional[Reservation]:
        rados = rados_module()
        key = R.reservation_key(nqn, nsid)
        for attempt in range(UPDATE_ATTEMPTS):
            raw = self._read_raw(key)
            before = Reservation.from_json(R.decode(key, raw)) if raw else Reservation()
            after = compute(before)
            if after is None and raw is None:
                return None
            if after is not None and after.same_state(before):
                return before
            with rados.WriteOpCtx() as op:
                # an absent key compares equal to "": the first record is created by the same compare
                op.omap_cmp(key, raw.decode() if raw else "", rados.LIBRADOS_CMPXATTR_OP_EQ)
                if after is None or after.is_empty():
                    self.ioctx.remove_omap_keys(op, (key,))
                else:
                    after.rev = before.rev + 1
                    self.ioctx.set_omap(op, (key,), (R.encode(after.to_json()),))
                try:
                    self.ioctx.operate_write_op(op, self.store.object)
                except rados.ObjectNotFound:
                    self.store.ensure()  # no group object yet
                    continue
                except rados.Error as exc:
                    if errno_of(exc) == errno_codes.ECANCELED:
                        time.sleep(random.uniform(0, 0.002 * (attempt + 1)))
                        continue
                    raise call_failed(f"group {self.store.group}: writing {key}", exc)
            self.store.notify(key)
            return after
        raise GroupConflict(f"group {self.store.group}: {UPDATE_ATTEMPTS} attempts to change {key} each met "
                            "another gateway's change", "retry the reservation command")
