"""One request lifecycle for the target core and the transports: the states, the legal transitions, the check.

A command is two objects: the core's `Request` (engine/request.py) and, on RDMA, the transport's `TxRequest`
(transport/rdma/requests.py).  Both take their `state` from `RequestState`, in the manner of SPDK's
`spdk_nvmf_rdma_request_state` (lib/nvmf/rdma.c), and both move only through `move()` (the core's three
transitions every command makes inline the same `NEXT` lookup), which checks the pair (old, new) against `LEGAL`: an illegal transition (completing a request twice, executing a free one) raises
`IllegalTransition` instead of silently leaking or reusing a slot.  The check is one tuple index and one
set lookup.

    FREE -> NEW (a capsule arrived) -> EXECUTING (the command's handler has it)
    host data on the way (the core sees one state, the RDMA transport three):
        EXECUTING -> [NEED_BUFFER -> NEED_READ_CREDIT ->] TRANSFERRING_HOST_TO_CONTROLLER -> EXECUTING
    the AER: EXECUTING -> HELD (until an event)
    the end: core      NEW | EXECUTING | TRANSFERRING_HOST_TO_CONTROLLER | HELD -> FREE (response handed over)
             transport EXECUTING -> READY_TO_COMPLETE -> COMPLETING (data WRITE + response SEND posted) -> FREE
    a closing queue frees whatever it holds (any state but FREE -> FREE), and ends a transfer with an error
    (NEED_BUFFER | NEED_READ_CREDIT | TRANSFERRING_HOST_TO_CONTROLLER -> EXECUTING).
"""
from __future__ import annotations

import enum


class RequestState(enum.IntEnum):
    FREE = 0
    NEW = 1  # its capsule arrived; being parsed and checked
    EXECUTING = 2  # its handler runs, or its device call or slices run (the completion comes back on the loop)
    NEED_BUFFER = 3  # transport: an RDMA READ waits for a data chunk
    NEED_READ_CREDIT = 4  # transport: ... then for one of the host's responder resources (ORD) and a send entry
    TRANSFERRING_HOST_TO_CONTROLLER = 5  # host data is being fetched (the core waits; RDMA: the READ is posted)
    HELD = 6  # no response until an event (an AER)
    READY_TO_COMPLETE = 7  # transport: the core completed it; its data chunk and send entries are awaited
    COMPLETING = 8  # transport: data WRITE (if any) and response SEND posted; FREE once a completion retires them


# The states as plain ints for the hot path (an int hashes and compares faster than an IntEnum member);
# `RequestState(state).name` names one.
FREE = int(RequestState.FREE)
NEW = int(RequestState.NEW)
EXECUTING = int(RequestState.EXECUTING)
NEED_BUFFER = int(RequestState.NEED_BUFFER)
NEED_READ_CREDIT = int(RequestState.NEED_READ_CREDIT)
TRANSFERRING_HOST_TO_CONTROLLER = int(RequestState.TRANSFERRING_HOST_TO_CONTROLLER)
HELD = int(RequestState.HELD)
READY_TO_COMPLETE = int(RequestState.READY_TO_COMPLETE)
COMPLETING = int(RequestState.COMPLETING)

LEGAL = frozenset(
    [(FREE, NEW), (NEW, EXECUTING),
     (EXECUTING, NEED_BUFFER), (NEED_BUFFER, NEED_READ_CREDIT), (NEED_READ_CREDIT, TRANSFERRING_HOST_TO_CONTROLLER),
     (EXECUTING, TRANSFERRING_HOST_TO_CONTROLLER), (TRANSFERRING_HOST_TO_CONTROLLER, EXECUTING),
     (NEED_BUFFER, EXECUTING), (NEED_READ_CREDIT, EXECUTING),
     (EXECUTING, HELD),
     (EXECUTING, READY_TO_COMPLETE), (READY_TO_COMPLETE, COMPLETING)]
    + [(int(state), FREE) for state in RequestState if state != FREE])

# LEGAL by the state a request leaves: what move() looks up (one tuple index, one set membership)
NEXT = tuple(frozenset(new for old, new in LEGAL if old == state) for state in range(len(RequestState)))


class IllegalTransition(RuntimeError):
    """A request was moved along no edge of the lifecycle: a bug in the core or a transport."""

    def __init__(self, request, new: RequestState):
        super().__init__(f"{request!r}: illegal request transition {RequestState(request.state).name} -> "
                         f"{RequestState(new).name}")
        self.request = request
        self.old = request.state
        self.new = new


def move(request, new: int) -> None:
    """Set `request.state` to `new` if (state, new) is a transition of the lifecycle (LEGAL), else raise."""
    if new not in NEXT[request.state]:
        raise IllegalTransition(request, new)
    request.state = new
