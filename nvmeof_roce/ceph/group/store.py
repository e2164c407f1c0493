"""The gateway group's shared state in one RADOS object's omap: read, atomic update, watch.

`GroupStore(ioctx, group)`:

- `read()` -> `GroupSnapshot`: epoch, config sections, members, ANA groups, failback requests, reservations: what
  the OSD holds, the same for every gateway that asks.
- `update(change)`: read, let `change(state)` edit a `GroupState` copy, write what differs in one write op that
  compares `epoch` first (`omap_cmp`) and bumps it; when another gateway changed the object in between, the
  OSD refuses the op (ECANCELED) and the whole read-change-write is done again (`change` may run several
  times: no side effects in it).  Then the object's watchers are notified (`Ioctx.notify`, acks awaited at most
  NOTIFY_TIMEOUT_MS).
- `watch(callback)` -> `GroupWatch`: a thread that reads the object when a notify comes (`Ioctx.watch`) and at
  least every `poll_interval` (the fallback: a watch lost, or none possible), and calls `callback(snapshot)`
  when it differs from the last one; never on the target's event loop.

Reservation records (`resv.*`) are not epoch-governed: `ReservationStore` (reservations.py) changes each by its
own compare-and-swap; they are in the snapshot and read-only in `update`, but for the removal of records whose
namespace is gone from the config (`GroupState.dropped_reservations`: in the same write op as the config, each
compared with the value read).
"""
from __future__ import annotations

import copy
import errno as errno_codes
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ..bindings import rados_and_rbd
from . import records as R
from .errors import GroupConflict, call_failed, errno_of
from .records import AnaGroup, FailbackRequest, Member, Reservation

log = logging.getLogger(__name__)

UPDATE_ATTEMPTS = 32  # read-change-write rounds before GroupConflict
READ_PAGE = 512  # omap values per read op; more than one page is checked against the epoch
POLL_INTERVAL = 5.0  # seconds between the watch thread's reads when nothing notified it
NOTIFY_TIMEOUT_MS = 1000  # a watcher acks at once (its callback only wakes its thread)
WATCH_RETRY = 2.0  # seconds before registering a lost watch again


def rados_module():
    return rados_and_rbd()[0]


@dataclass
class GroupState:
    """The editable part of the group's state, given to `update`'s `change`: edit it in place.  The reservation
    records are not epoch-governed (ReservationStore changes them): `reservation_values` (the records' bytes as
    read) is read-only; a change may only add records to `dropped_reservations`, removed in the same write op
    when each is still the value read (a namespace gone from the config takes its record with it)."""
    config: Dict[str, Any]
    members: Dict[str, Member]
    ana_groups: Dict[int, AnaGroup]
    failbacks: Dict[int, FailbackRequest]
    reservation_values: Dict[Tuple[str, int], bytes] = field(default_factory=dict)
    dropped_reservations: Set[Tuple[str, int]] = field(default_factory=set)

    def omap(self) -> Dict[str, bytes]:
        """Every epoch-governed key and its value (the epoch itself left out)."""
        values = {R.CONFIG_PREFIX + name: R.encode(section) for name, section in self.config.items()}
        values.update({R.MEMBER_PREFIX + gw: R.encode(m.to_json()) for gw, m in self.members.items()})
        values.update({f"{R.ANA_PREFIX}{g}": R.encode(a.to_json()) for g, a in self.ana_groups.items()})
        values.update({f"{R.FAILBACK_PREFIX}{g}": R.encode(f.to_json()) for g, f in self.failbacks.items()})
        return values


@dataclass(frozen=True)
class GroupSnapshot:
    """The group's state as one read saw it.  Treat its dicts as read-only (`update` hands out copies)."""
    group: str
    epoch: int = 0
    config: Dict[str, Any] = field(default_factory=dict)
    members: Dict[str, Member] = field(default_factory=dict)
    ana_groups: Dict[int, AnaGroup] = field(default_factory=dict)
    failbacks: Dict[int, FailbackRequest] = field(default_factory=dict)
    reservations: Dict[Tuple[str, int], Reservation] = field(default_factory=dict)
    exists: bool = False  # the object exists (epoch 0 and absent: nothing was ever written)
    # the reservation records' bytes as read (what a removal compares with: GroupState.dropped_reservations)
    reservation_values: Dict[Tuple[str, int], bytes] = field(default_factory=dict, compare=False, repr=False)

    def editable(self) -> GroupState:
        return GroupState(copy.deepcopy(self.config), dict(self.members), dict(self.ana_groups),
                          dict(self.failbacks), dict(self.reservation_values))

    @classmethod
    def from_omap(cls, group: str, values: Dict[str, bytes], exists: bool) -> "GroupSnapshot":
        config, members, ana, failbacks, resv, resv_values = {}, {}, {}, {}, {}, {}
        for key, raw in values.items():
            if key == R.EPOCH_KEY:
                continue
            value = R.decode(key, raw)
            if key.startswith(R.CONFIG_PREFIX):
                config[key[len(R.CONFIG_PREFIX):]] = value
            elif key.startswith(R.MEMBER_PREFIX):
                members[key[len(R.MEMBER_PREFIX):]] = Member.from_json(value)
            elif key.startswith(R.ANA_PREFIX):
                ana[int(key[len(R.ANA_PREFIX):])] = AnaGroup.from_json(value)
            elif key.startswith(R.FAILBACK_PREFIX):
                failbacks[int(key[len(R.FAILBACK_PREFIX):])] = FailbackRequest.from_json(value)
            elif key.startswith(R.RESERVATION_PREFIX):
                resv[R.parse_reservation_key(key)] = Reservation.from_json(value)
                resv_values[R.parse_reservation_key(key)] = raw
            # other keys: a newer gateway's; kept as they are (update writes only the keys it knows)
        epoch = int(values.get(R.EPOCH_KEY, b"0") or b"0")
        return cls(group, epoch, config, members, ana, failbacks, resv, exists, resv_values)


class GroupStore:
    """The group `group`'s state object in the pool of `ioctx` (an open `rados.Ioctx`).  Blocking calls: run them
    off the target's event loop."""

    def __init__(self, ioctx, group: str):
        self.ioctx = ioctx
        self.group = R.check_name("group", group)
        self.object = R.group_object(group)

    # -- reading -------------------------------------------------------------------------------------------

    def read(self) -> GroupSnapshot:
        """The group's state now.  A read of more than one page is checked against the epoch and done again
        when a change came between its pages."""
        for _ in range(UPDATE_ATTEMPTS):
            values, exists, pages = self._read_values()
            if pages == 1 or self._read_values(only_epoch=True)[0].get(R.EPOCH_KEY) == values.get(R.EPOCH_KEY):
                return GroupSnapshot.from_omap(self.group, values, exists)
        raise GroupConflict(f"group {self.group}: the state object kept changing while it was read",
                            "retry; if it persists, look for a gateway updating it in a loop")

    def _read_values(self, only_epoch: bool = False) -> Tuple[Dict[str, bytes], bool, int]:
        rados = rados_module()
        values: Dict[str, bytes] = {}
        start_after, pages = "", 0
        while True:
            pages += 1
            with rados.ReadOpCtx() as op:
                if only_epoch:
                    it, _ = self.ioctx.get_omap_vals_by_keys(op, (R.EPOCH_KEY,))
                else:
                    it, _ = self.ioctx.get_omap_vals(op, start_after, "", READ_PAGE)
                try:
                    self.ioctx.operate_read_op(op, self.object)
                except rados.ObjectNotFound:
                    return {}, False, pages
                except rados.Error as exc:
                    raise call_failed(f"group {self.group}: reading {self.object}", exc)
                page = list(it)
            values.update((k, bytes(v)) for k, v in page)
            if only_epoch or len(page) < READ_PAGE:
                return values, True, pages
            start_after = page[-1][0]

    # -- changing ------------------------------------------------------------------------------------------

    def update(self, change: Callable[[GroupState], None], note: str = "") -> GroupSnapshot:
        """Apply `change` atomically (see the module's doc); the snapshot after it.  Nothing is written when
        `change` changes nothing, or raises (its exception goes to the caller)."""
        rados = rados_module()
        for attempt in range(UPDATE_ATTEMPTS):
            before = self.read()
            state = before.editable()
            change(state)
            old, new = before.editable().omap(), state.omap()
            changed = {k: v for k, v in new.items() if old.get(k) != v}
            dropped = {k: before.reservation_values[k] for k in state.dropped_reservations
                       if k in before.reservation_values}
            removed = tuple(k for k in old if k not in new) + tuple(R.reservation_key(*k) for k in dropped)
            if not changed and not removed:
                return before
            epoch = before.epoch + 1
            with rados.WriteOpCtx() as op:
                if before.exists:
                    op.omap_cmp(R.EPOCH_KEY, str(before.epoch), rados.LIBRADOS_CMPXATTR_OP_EQ)
                else:
                    op.new(rados.LIBRADOS_CREATE_EXCLUSIVE)  # two first writers: one gets EEXIST and retries
                for key, raw in dropped.items():  # a record changed since the read is not dropped: done again
                    op.omap_cmp(R.reservation_key(*key), raw.decode(), rados.LIBRADOS_CMPXATTR_OP_EQ)
                keys = tuple(changed) + (R.EPOCH_KEY,)
                self.ioctx.set_omap(op, keys, tuple(changed.values()) + (str(epoch).encode(),))
                if removed:
                    self.ioctx.remove_omap_keys(op, removed)
                try:
                    self.ioctx.operate_write_op(op, self.object)
                except rados.Error as exc:
                    if errno_of(exc) in (errno_codes.ECANCELED, errno_codes.EEXIST):
                        time.sleep(random.uniform(0, 0.002 * (attempt + 1)))  # another gateway's change came first
                        continue
                    raise call_failed(f"group {self.group}: writing {self.object}", exc)
            self.notify(note or f"epoch {epoch}")
            resv = {k: v for k, v in before.reservations.items() if k not in dropped}
            values = {k: v for k, v in before.reservation_values.items() if k not in dropped}
            return GroupSnapshot(self.group, epoch, state.config, state.members, state.ana_groups,
                                 state.failbacks, resv, True, values)
        raise GroupConflict(f"group {self.group}: {UPDATE_ATTEMPTS} attempts to change {self.object} each met "
                            "another gateway's change", "retry; if it persists, look for a gateway updating "
                            "the group in a loop")

    def ensure(self) -> None:
        """Make the object (epoch 0) unless it exists: a watch or a compare-and-swap needs it."""
        rados = rados_module()
        with rados.WriteOpCtx() as op:
            op.new(rados.LIBRADOS_CREATE_EXCLUSIVE)
            self.ioctx.set_omap(op, (R.EPOCH_KEY,), (b"0",))
            try:
                self.ioctx.operate_write_op(op, self.object)
            except rados.ObjectExists:
                pass
            except rados.Error as exc:
                raise call_failed(f"group {self.group}: creating {self.object}", exc)

    def notify(self, message: str) -> None:
        """Tell the object's watchers it changed: waits for their acks, at most NOTIFY_TIMEOUT_MS (a watch of a
        gateway that died without being fenced lingers until the OSD's watch timeout; a fenced one's is dropped
        with the blocklist).  Synchronous on purpose: Ceph 16.2's `Ioctx.aio_notify` followed by the ioctx's
        close and the client's shutdown crashes librados (SIGSEGV in its io_context_pool thread)."""
        try:
            self.ioctx.notify(self.object, message, NOTIFY_TIMEOUT_MS)
        except Exception as exc:  # the change is written: a watcher that missed it finds it at its next poll
            log.info("group %s: notify %r: %s (a watcher did not ack in time)", self.group, message, exc)

    # -- members -------------------------------------------------------------------------------------------

    def join(self, gateway: str, cluster, ports: Optional[List[Any]] = None,
             now: Callable[[], float] = time.time) -> GroupSnapshot:
        """Record this process as `gateway`'s member: its client's address and instance id, ports, start time."""
        member = Member.of(gateway, cluster, ports, now())
        return self.update(lambda s: s.members.__setitem__(gateway, member), f"member {gateway}")

    def leave(self, gateway: str) -> GroupSnapshot:
        return self.update(lambda s: s.members.pop(gateway, None), f"member {gateway} left")

    def watch(self, callback: Callable[[GroupSnapshot], None], poll_interval: float = POLL_INTERVAL,
              use_watch: bool = True) -> "GroupWatch":
        return GroupWatch(self, callback, poll_interval, use_watch)


class GroupWatch:
    """Calls `callback(snapshot)` on a thread of its own when the group's state changes: woken by a RADOS
    notify on the object, and reading it at least every `poll_interval` seconds whatever happens (a notify
    lost with the watch, a watch that cannot be registered).  `last` is the latest snapshot read."""

    def __init__(self, store: GroupStore, callback: Callable[[GroupSnapshot], None],
                 poll_interval: float = POLL_INTERVAL, use_watch: bool = True):
        self.store = store
        self.callback = callback
        self.poll_interval = poll_interval
        self.use_watch = use_watch
        self.notifications = 0  # notifies received (tests, status)
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._handle = None
        self._next_register = 0.0
        store.ensure()
        self.last = store.read()
        self.read_at = time.monotonic()  # when `last` was read (or found unchanged) last
        self._register()
        self._thread = threading.Thread(target=self._run, name=f"group {store.group} watch", daemon=True)
        self._thread.start()

    def fresh(self, max_age: float) -> Optional[GroupSnapshot]:
        """The latest snapshot when it was read at most `max_age` seconds ago (None: older, the watch's reads are
        failing or it is closed): what another reader of the group's state may use instead of reading it."""
        if self._closed.is_set() or time.monotonic() - self.read_at > max_age:
            return None
        return self.last

    @property
    def watching(self) -> bool:
        """A RADOS watch is registered now (else the thread polls)."""
        return self._handle is not None

    def _register(self) -> None:
        if not self.use_watch or self._handle is not None or time.monotonic() < self._next_register:
            return
        try:
            self._handle = self.store.ioctx.watch(self.store.object, self._on_notify, self._on_error)
        except Exception as exc:
            self._next_register = time.monotonic() + WATCH_RETRY
            log.warning("group %s: watch on %s: %s; polling every %.0f s", self.store.group, self.store.object,
                        exc, self.poll_interval)

    def _on_notify(self, notify_id, notifier_id, watch_id, data) -> None:
        # librados' thread: only wake ours (the ack goes back when this returns)
        self.notifications += 1
        self._wake.set()

    def _on_error(self, *args) -> None:
        # Ceph 16.2's binding calls it with (watch id, error), though its docstring says (error)
        log.warning("group %s: the watch on %s failed (%s); registering it again", self.store.group,
                    self.store.object, args[-1] if args else "?")
        handle, self._handle = self._handle, None
        self._next_register = time.monotonic() + WATCH_RETRY
        self._wake.set()
        if handle is not None:
            threading.Thread(target=self._close_handle, args=(handle,), daemon=True).start()

    @staticmethod
    def _close_handle(handle) -> None:
        try:
            handle.close()
        except Exception:
            from ..clients import keep_unclosable
            keep_unclosable(handle)  # freeing a watch whose close failed frees librados memory twice

    def _run(self) -> None:
        while not self._closed.is_set():
            interval = self.poll_interval if self._handle is not None or not self.use_watch else \
                min(self.poll_interval, WATCH_RETRY)
            self._wake.wait(interval)
            self._wake.clear()
            if self._closed.is_set():
                return
            self._register()
            try:
                snapshot = self.store.read()
            except Exception as exc:
                log.warning("group %s: reading the state: %s", self.store.group, exc)
                continue
            self.read_at = time.monotonic()
            if snapshot != self.last:
                self.last = snapshot
                try:
                    self.callback(snapshot)
                except Exception:
                    log.exception("group %s: the watch's callback failed", self.store.group)

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout)
        handle, self._handle = self._handle, None
        if handle is not None:
            self._close_handle(handle)
