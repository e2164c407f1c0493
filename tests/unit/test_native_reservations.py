"""Reservations on the native data path (engine/fast_path_view.py, engine/reservations.py): the C queue serves a
namespace for a controller only while its reservation lets that host read and write; a conflicting Write of a
restricted host reaches the core, which answers Reservation Conflict, and never the namespace's memory."""
import pytest

from loopback_env import HOST_B, SUB_RAM, standard_config
from native_diff import NativeEndpoint, io_capsule, pattern
from native_fake import needs_native
from nvmeof_roce.nvme import reservation as R

pytestmark = needs_native

READ, WRITE = 0x02, 0x01
CONFLICT = 0x4083  # Reservation Conflict | DNR
ID_B = "00000000-0000-4000-8000-0000000000bb"


def status_of(cqe: bytes) -> int:
    return int.from_bytes(cqe[14:16], "little") >> 1


@pytest.fixture
def ep():
    config = standard_config()
    config["subsystems"][0]["namespaces"][0]["resv"] = {"enable": "1"}
    endpoint = NativeEndpoint(config, SUB_RAM)
    yield endpoint
    endpoint.close()


def test_a_conflicting_write_on_a_native_queue_goes_to_the_core_and_never_reaches_the_namespace(ep):
    target = ep.env.target
    ns = target.subsystems[SUB_RAM].namespaces[1]
    # enabled but unused: the native queue serves the namespace itself
    python_before = ep.queue.stats()["python_commands"]
    (cqe,) = ep.exchange(io_capsule(ep, WRITE, 1, 0, 0, 512))
    assert status_of(cqe) == 0 and ep.queue.stats()["python_commands"] == python_before
    assert bytes(ns.direct_view[:512]) == pattern(512)
    # another host takes Write Exclusive through the engine: the native views of the subsystem change with it
    b = ep.env.connect(SUB_RAM, hostnqn=HOST_B, hostid=ID_B, num_io_queues=1)
    b.write(1, 0, b"\x33" * 512)
    b.resv_register(1, nrkey=7)
    b.resv_acquire(1, R.WRITE_EXCLUSIVE, 7)
    ep.fresh_buffer()
    python_before = ep.queue.stats()["python_commands"]
    (cqe,) = ep.exchange(io_capsule(ep, WRITE, 1, 0, 0, 512))
    assert status_of(cqe) == CONFLICT
    assert ep.queue.stats()["python_commands"] == python_before + 1  # answered by the core, not the C queue
    assert bytes(ns.direct_view[:512]) == b"\x33" * 512  # the Write never reached the namespace
    # reads are still allowed under Write Exclusive (by the core now), and the holder's release gives the
    # namespace back to the native queue
    (cqe,) = ep.exchange(io_capsule(ep, READ, 1, 0, 0, 512))
    assert status_of(cqe) == 0 and ep.host_bytes()[:512] == b"\x33" * 512
    b.resv_release(1, R.WRITE_EXCLUSIVE, 7)
    python_before = ep.queue.stats()["python_commands"]
    (cqe,) = ep.exchange(io_capsule(ep, WRITE, 1, 0, 0, 512, offset=512))
    assert status_of(cqe) == 0 and ep.queue.stats()["python_commands"] == python_before
    b.close()
