"""Poll groups: `target serve --cores N` polls the native I/O queues on N threads without the GIL (docs/native.md).

Each `_native.PollGroup` (csrc/pollgroup.c) is one thread that busy-polls the queues given to it; a queue joins
one group when its connection is accepted, round-robin, as SPDK spreads qpairs over its poll groups.  What needs
Python (capsules for the core, the Python side's send completions, a failure) waits in the queue's mailbox,
whose eventfd the event loop watches (`NativeTargetQueue.start_polling`).
"""
from __future__ import annotations

import itertools
import logging
from typing import List

log = logging.getLogger(__name__)


class PollGroups:
    """N poll-group threads and the round-robin that gives each new native queue to one of them."""

    def __init__(self, module, count: int, budget: int = 64):
        if count < 1:
            raise ValueError("a poll group needs a thread at least")
        self.groups: List = []
        try:
            for _ in range(count):
                self.groups.append(module.PollGroup(budget=budget))
        except BaseException:
            self.close()
            raise
        self._next = itertools.cycle(range(count))

    def assign(self, native_queue):
        """(the group now polling `native_queue`, its mailbox eventfd)."""
        index = next(self._next)
        group = self.groups[index]
        fd = group.add(native_queue)
        log.info("native queue polled by poll group %d of %d", index + 1, len(self.groups))
        return group, fd

    def status(self) -> list:
        return [group.stats() for group in self.groups]

    def close(self) -> None:
        """Stop every thread (joined); their queues are let go."""
        for group in self.groups:
            group.close()
