"""The target's RDMA listener (transport/rdma/cm.py) on the native module's CM through the fake librdmacm
(tests/native/fakecm.c), with the fake device of fakeverbs.py for the queues: hostile connect requests, a connect
flood from one address, events naming their connection, keep-alive expiry.  Each test runs in a child
interpreter (the pyverbs stand-ins replace pyverbs in sys.modules), as test_rdma_target_fake.py's do."""
import pytest

from nvmeof_roce import native
from test_rdma_target_fake import run_child as run_fake_child

pytestmark = pytest.mark.skipif(not native.available(), reason="the native extension is not built")

# What each child adds to test_rdma_target_fake.py's SETUP (the stand-ins, the fake CM loaded, the project's
# imports): the log kept in `log`; serve() a target on the fake CM, pump() its loop, request() a connect request.
SETUP = r"""
import logging
import fakecm
from nvmeof_roce import native
from nvmeof_roce.nvme import cm
from nvmeof_roce.transport.resources import ResourceLimits
EV = native.module
log = []
class Keep(logging.Handler):
    def emit(self, record):
        log.append(record.getMessage())
logging.getLogger("nvmeof_roce").addHandler(Keep())
logging.getLogger("nvmeof_roce").setLevel(logging.INFO)
now = [1000.0]  # the target's clock, where serve(clock=True): the test moves it

def serve(limits=None, clock=False):  # a target on the fake device and CM (the Python data path)
    server = TargetServer(parse_config(tc.config_dict(), source="test"), data_path="python", limits=limits)
    if clock:
        server.target.clock = lambda: now[0]
    return server, server.loop.listeners[0]

def pump(n=5):
    for _ in range(n):
        server.loop.run_once(0)

def request(qid=1, hsqsize=31, peer="10.0.0.50", port=[30000]):
    port[0] += 1
    private = cm.CmConnectRequest(0, qid, hsqsize + 1, hsqsize, 0xffff).pack()
    return fakecm.connect(tc.TRADDR, tc.TRSVCID, peer, port[0], private)
"""


def run_child(body: str) -> None:
    run_fake_child(SETUP + body)


def test_hostile_connect_requests_get_their_nvme_status_and_the_target_keeps_serving():
    run_child(r"""
server, listener = serve()
cases = {
    "short": (fakecm.connect(tc.TRADDR, tc.TRSVCID, "10.0.0.66", 1, b"\x00" * 5), cm.STS_INVALID_LEN),
    "recfmt": (fakecm.connect(tc.TRADDR, tc.TRSVCID, "10.0.0.66", 2,
                              cm.CmConnectRequest(7, 1, 32, 31, 0xffff).pack()), cm.STS_INVALID_RECFMT),
    "qid": (request(qid=4000, peer="10.0.0.66"), cm.STS_INVALID_QID),
    "admin depth": (request(qid=0, hsqsize=200, peer="10.0.0.66"), cm.STS_INVALID_HSQSIZE),
}
pump()
for name, (handle, sts) in cases.items():
    answer = fakecm.answer(handle)
    assert answer.state == "destroyed", (name, answer)  # rejected, then its id destroyed at once
    assert cm.CmReject.unpack(answer.private_data).sts == sts, (name, answer)
assert listener.queues == {} and listener.cm.stats()["ids"] == 1  # only the listening id is left
assert fakecm.counters()["destroy_unacked"] == 0
# a well-behaved host still connects and does I/O
ctrl = Controller.connect(tc.FakeConnector(server.loop), tc.SUBNQN, hostnqn=tc.HOSTNQN, num_io_queues=1,
                          queue_size=32, enable_aen=False)
assert len(ctrl.io_queues) == 1 and ctrl.identify_controller() is not None
server.close()
assert fakecm.counters()["ids"] == 0  # every id the target made is destroyed
print("ok")
""")


def test_a_connect_flood_from_one_address_is_refused_at_the_cm_and_other_addresses_connect():
    run_child(r"""
server, listener = serve(ResourceLimits(max_connecting_per_address=3, connect_timeout=5.0), clock=True)
flood = [request(peer="10.0.0.66") for _ in range(6)]
pump()
states = [fakecm.answer(h).state for h in flood]
assert states[:3] == ["accepted"] * 3, states
assert all(s == "destroyed" for s in states[3:]), states
assert all(cm.CmReject.unpack(fakecm.answer(h).private_data).sts == cm.STS_NO_RESOURCES for h in flood[3:])
assert any("refusing connections from 10.0.0.66" in line and "--max-connecting-per-address 3" in line
           for line in log), log
other = request(peer="10.0.0.77")
pump()
assert fakecm.answer(other).state == "accepted"  # another address is not refused
now[0] += 5.1  # the flood's queues never sent their Connect: closed at the connect timeout
server.target.tick(now[0])
pump()
assert all(fakecm.answer(h).state == "destroyed" for h in flood)
again = request(peer="10.0.0.66")
pump()
assert fakecm.answer(again).state == "accepted"  # the address is let in again
server.close()
print("ok")
""")


def test_each_cm_event_closes_exactly_the_queue_it_names():
    run_child(r"""
server, listener = serve()
ids = [request(peer="10.0.0.50") for _ in range(5)]
pump()
assert len(listener.queues) == 5
for handle, kind in zip(ids[1:], ("DISCONNECTED", "TIMEWAIT_EXIT", "DEVICE_REMOVAL", "ADDR_CHANGE")):
    fakecm.event(handle, getattr(EV, "CM_EVENT_" + kind))
    pump()
    assert fakecm.answer(handle).state == "destroyed", kind
assert len(listener.queues) == 1 and listener.disconnects_attributed == 4
assert fakecm.answer(ids[0]).state == "accepted"  # the queue no event named is still open
assert any("queue 1 (10.0.0.50:" in line and "host disconnected (CM DEVICE_REMOVAL)" in line for line in log), log
server.close()
print("ok")
""")


def test_a_host_that_vanishes_is_ended_by_keep_alive_and_its_cm_ids_destroyed():
    run_child(r"""
server, listener = serve(clock=True)
ctrl = Controller.connect(tc.FakeConnector(server.loop), tc.SUBNQN, hostnqn=tc.HOSTNQN, num_io_queues=2,
                          queue_size=32, kato_ms=5000, enable_aen=False)
assert len(listener.queues) == 3
ends = [ctrl.admin.transport.end] + [q.transport.end for q in ctrl.io_queues]
now[0] += 4.0
server.target.tick(now[0])
assert len(listener.queues) == 3  # within KATO: kept
now[0] += 10.0  # no command, no keep-alive, no CM event: the host is gone
server.target.tick(now[0])
pump()
assert listener.queues == {} and listener.cm.stats()["ids"] == 1
assert all(fakecm.answer(end.handle).state == "destroyed" for end in ends)
assert any("keep-alive timeout" in line for line in log), log
server.close()
print("ok")
""")
