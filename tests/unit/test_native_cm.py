"""The native module's RDMA CM (csrc/cm_channel.c) through the fake librdmacm (tests/native/fakecm.c): events as
plain data, accept and reject with their private data, the ids a channel owns, both ends of a connection."""
import errno
import os
import select

import pytest

from nvmeof_roce import native
from nvmeof_roce.nvme import cm as cmdata
from nvmeof_roce.transport.contracts import TransportError

pytestmark = pytest.mark.skipif(not native.available(), reason="the native extension is not built")

import fakecm  # noqa: E402
from nvmeof_roce.transport.rdma.cmchannel import CmChannel  # noqa: E402

ADDR, PORT = "192.0.2.1", 4420


@pytest.fixture
def channel():
    fakecm.load(native.module)
    ch = CmChannel()
    yield ch
    ch.close()


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_a_connect_request_arrives_as_plain_data_with_the_peer_and_private_data(channel):
    listener = channel.listen(ADDR, PORT)
    private = cmdata.CmConnectRequest(0, 1, 32, 31, 7).pack()
    fakecm.connect(ADDR, PORT, "198.51.100.9", 51234, private, responder_resources=4, initiator_depth=9)
    assert readable(channel.fd)
    [ev] = channel.events()
    assert not readable(channel.fd)  # everything taken
    assert ev.name == "CONNECT_REQUEST" and ev.listen_id == listener.handle
    assert ev.id not in (0, listener.handle) and channel.stats()["ids"] == 2  # the child id, kept with its handle
    assert ev.peer == "198.51.100.9:51234" and ev.local == f"{ADDR}:{PORT}"
    assert cmdata.CmConnectRequest.unpack(ev.private_data).qid == 1
    assert (ev.responder_resources, ev.initiator_depth) == (4, 9)
    assert fakecm.counters()["acked"] == fakecm.counters()["posted"]  # acked before Python saw it


def test_accept_and_reject_send_the_private_data_python_packed(channel):
    channel.listen(ADDR, PORT)
    first = fakecm.connect(ADDR, PORT, "198.51.100.9", 1, b"x" * 32)
    second = fakecm.connect(ADDR, PORT, "198.51.100.9", 2, b"y" * 32)
    a, b = channel.events()
    from nvmeof_roce.transport.rdma.cmchannel import CmId
    CmId(channel, a.id).accept(cmdata.CmAccept(0, 32).pack(), 0, 8, 0x77)
    CmId(channel, b.id).reject(cmdata.CmReject(0, cmdata.STS_INVALID_HSQSIZE).pack())
    assert fakecm.answer(first) == ("accepted", cmdata.CmAccept(0, 32).pack(), 0, 8, 0x77)
    assert fakecm.answer(second).state == "rejected"
    assert fakecm.answer(second).private_data == cmdata.CmReject(0, cmdata.STS_INVALID_HSQSIZE).pack()
    assert [e.name for e in channel.events()] == ["ESTABLISHED"]


@pytest.mark.parametrize("kind", ["DISCONNECTED", "TIMEWAIT_EXIT", "DEVICE_REMOVAL", "ADDR_CHANGE"])
def test_each_event_names_the_id_it_is_for(channel, kind):
    channel.listen(ADDR, PORT)
    ids = [fakecm.connect(ADDR, PORT, "198.51.100.9", p, b"") for p in (1, 2, 3)]
    handles = {ev.peer: ev.id for ev in channel.events()}
    assert len(set(handles.values())) == 3
    fakecm.event(ids[1], getattr(native.module, "CM_EVENT_" + kind))
    [ev] = channel.events()
    assert (ev.name, ev.id, ev.peer) == (kind, handles["198.51.100.9:2"], "198.51.100.9:2")


def test_a_handle_that_is_not_the_channels_is_refused_not_followed(channel):
    channel.listen(ADDR, PORT)
    child = fakecm.connect(ADDR, PORT, "198.51.100.9", 1, b"")
    [ev] = channel.events()
    other = CmChannel()
    try:
        with pytest.raises(ValueError, match="not one of this channel's"):
            other.channel.accept(ev.id, b"", 0, 0)
        with pytest.raises(ValueError, match="not one of this channel's"):
            native.module.destroy_cm_qp(other.channel, ev.id)
        with pytest.raises(ValueError, match="not one of this channel's"):
            channel.channel.destroy(12345)
        for wrapped in (ev.id + 2**64, ev.id - 2**64):  # taken exactly, never modulo 2**64
            with pytest.raises(ValueError, match=f"CM id {wrapped} is not one of this channel's"):
                channel.channel.accept(wrapped, b"", 0, 0)
        with pytest.raises(TypeError, match="a CM id's channel is a CmChannel"):
            native.module.destroy_cm_qp(channel, ev.id)  # the Python wrapper, not its native channel
    finally:
        other.close()
    assert fakecm.answer(child).state == "pending"
    native.module.destroy_cm_qp(channel.channel, ev.id)  # found: it has no QP, nothing to do
    channel.channel.destroy(ev.id)
    assert fakecm.answer(child).state == "destroyed"
    with pytest.raises(ValueError, match="not one of this channel's"):  # destroyed: the handle is stale now
        channel.channel.disconnect(ev.id)


def test_a_destroyed_ids_handle_never_names_the_id_made_where_it_was(channel):
    """librdmacm may put a new id at the address of one destroyed: the old id's handle, which a queue closing
    late or a late event's handler may still hold, is refused by every call and leaves the new connection alone;
    the new id has a handle of its own, which works."""
    from nvmeof_roce.transport.rdma.verbs import QPS_INIT
    channel.listen(ADDR, PORT)
    old_id = fakecm.connect(ADDR, PORT, "198.51.100.9", 1, b"")
    [old] = channel.events()
    channel.channel.accept(old.id, b"", 0, 0)
    assert [e.name for e in channel.events()] == ["ESTABLISHED"]
    channel.channel.destroy(old.id)
    fakecm.recycle_next_id()
    new_id = fakecm.connect(ADDR, PORT, "198.51.100.7", 2, b"")
    assert new_id == old_id  # the new connection's id is where the old one was
    [new] = channel.events()
    assert new.peer == "198.51.100.7:2"
    stale = f"CM id {old.id} is not one of this channel's"
    for call, args in (("accept", (b"", 0, 0)), ("reject", (b"",)), ("disconnect", ()), ("establish", ()),
                       ("destroy", ()), ("peer", ()), ("device", ()), ("qp_attr", (QPS_INIT,)),
                       ("resolve_route", (1000,)), ("connect", (b"", 0, 0)),
                       ("resolve_addr", (None, ADDR, PORT, 1000))):
        with pytest.raises(ValueError, match=stale):
            getattr(channel.channel, call)(old.id, *args)
    for helper, args in ((native.module.create_cm_qp, (64, 34, 16)), (native.module.destroy_cm_qp, ()),
                         (native.module.create_host_qp, (64, 32, 32, 64)),
                         (native.module.destroy_host_qp, (0, 0))):
        with pytest.raises(ValueError, match=stale):
            helper(channel.channel, old.id, *args)
    assert fakecm.answer(new_id).state == "pending" and channel.events() == []  # nothing reached it
    assert new.id != old.id
    channel.channel.accept(new.id, b"ok", 0, 4)
    assert fakecm.answer(new_id) == ("accepted", b"ok", 0, 4, 0)
    assert channel.stats()["ids"] == 2  # the listener and the new child


def test_closing_the_channel_destroys_every_id_and_never_one_with_an_event_unacked(channel):
    before = fakecm.counters()
    channel.listen(ADDR, PORT)
    for p in range(5):
        fakecm.connect(ADDR, PORT, "198.51.100.9", p, b"")
    channel.events()
    fakecm.connect(ADDR, PORT, "198.51.100.9", 99, b"")  # pending, never taken by events()
    channel.close()
    after = fakecm.counters()
    assert after["ids"] == before["ids"]  # the listener, the five children and the pending one
    assert after["destroy_unacked"] == before["destroy_unacked"] == 0
    assert after["acked"] == after["posted"]


def test_a_failure_to_take_an_event_hands_over_the_events_taken_before_it_and_is_raised_by_the_next_call(channel):
    """rdma_get_cm_event failing part way through events(): the events taken before it are acked already, so
    they are returned (a connect request among them dropped would leave its host unanswered and its id kept for
    nobody); the next call meets the failure, then the events behind it come."""
    channel.listen(ADDR, PORT)
    fakecm.connect(ADDR, PORT, "198.51.100.9", 1, b"")
    fakecm.connect(ADDR, PORT, "198.51.100.9", 2, b"")
    fakecm.fail_get_event(errno.ENOMEM, nth=2)
    assert [(ev.name, ev.peer) for ev in channel.events()] == [("CONNECT_REQUEST", "198.51.100.9:1")]
    fakecm.fail_get_event(errno.ENOMEM)
    with pytest.raises(OSError, match="rdma_get_cm_event") as raised:
        channel.events()
    assert raised.value.errno == errno.ENOMEM
    assert [(ev.name, ev.peer) for ev in channel.events()] == [("CONNECT_REQUEST", "198.51.100.9:2")]
    assert channel.stats()["ids"] == 3 and fakecm.counters()["acked"] == fakecm.counters()["posted"]


def test_addresses_are_checked_and_ipv6_peers_are_written_in_brackets(channel):
    with pytest.raises(ValueError, match="target.example: not an IPv4 or IPv6 address"):
        channel.listen("target.example", PORT)
    channel.listen("2001:db8::1", PORT)
    fakecm.connect("2001:db8::1", PORT, "2001:db8::9", 4000, b"")
    assert channel.events()[0].peer == "[2001:db8::9]:4000"
    with pytest.raises(OSError):  # the fake, like the kernel, refuses a second listener on the same address
        channel.listen("2001:db8::1", PORT)


def test_a_number_past_its_field_is_refused_never_wrapped(channel):
    """A port, responder resources, initiator depth or QP number out of its range is a ValueError naming it:
    2**32 + 4420 is not taken as port 4420, nor -1 as 4294967295, and nothing listens or is accepted."""
    with pytest.raises(ValueError, match=f"port {2**32 + PORT}: out of range"):
        channel.channel.listen(ADDR, 2**32 + PORT)
    with pytest.raises(ValueError, match="port -1: out of range"):
        channel.channel.listen(ADDR, -1)
    assert channel.stats()["ids"] == 0
    channel.listen(ADDR, PORT)
    child = fakecm.connect(ADDR, PORT, "198.51.100.9", 1, b"")
    [ev] = channel.events()
    for numbers, named in (((2**32 + 1, 0), "responder resources 4294967297"), ((0, -1), "initiator depth -1")):
        with pytest.raises(ValueError, match=named):
            channel.channel.accept(ev.id, b"", *numbers)
    with pytest.raises(ValueError, match="QP number 4294967296: out of range"):
        channel.channel.accept(ev.id, b"", 0, 0, 2**32)
    assert fakecm.answer(child).state == "pending"
    host = channel.create_id()
    with pytest.raises(ValueError, match=f"port {2**32 + PORT}: out of range"):
        host.resolve_addr(None, ADDR, 2**32 + PORT, 1000)
    assert channel.events() == []


def test_a_channel_that_cannot_be_made_non_blocking_is_refused_with_its_errno_and_never_waited_on():
    """fcntl failing on the new channel: OSError with fcntl's errno (not one the cleanup left), and the channel
    destroyed without taking events from its still blocking fd (librdmacm would wait there for ever)."""
    fakecm.load(native.module)
    before = fakecm.counters()
    fakecm.bad_channel_fd()
    with pytest.raises(OSError, match="making the CM event channel non-blocking") as raised:
        native.module.CmChannel()
    assert raised.value.errno == errno.EBADF
    assert fakecm.counters()["blocking_waits"] == before["blocking_waits"] == 0


def test_the_channel_takes_no_keyword_it_would_ignore():
    fakecm.load(native.module)
    with pytest.raises(TypeError):
        native.module.CmChannel(backlog=5)


def test_both_ends_of_a_connection_through_our_cm(channel):
    """Our initiator's active id against our listener: resolve, connect with the NVMe-oF request, the accept's
    private data on the host's ESTABLISHED; a reject's on its REJECTED."""
    target = CmChannel()
    try:
        target.listen(ADDR, PORT)
        host = channel.create_id()
        host.resolve_addr(None, ADDR, PORT, 1000)
        assert [e.name for e in channel.events()] == ["ADDR_RESOLVED"]
        host.resolve_route(1000)
        assert [e.name for e in channel.events()] == ["ROUTE_RESOLVED"]
        host.connect(cmdata.CmConnectRequest(0, 2, 64, 63, 1).pack(), 16, 0)  # a QP of librdmacm's (qp_num 0)
        [req] = target.events()
        assert cmdata.CmConnectRequest.unpack(req.private_data).hsqsize == 63 and req.responder_resources == 16
        from nvmeof_roce.transport.rdma.cmchannel import CmId
        CmId(target, req.id).accept(cmdata.CmAccept(0, 64).pack(), 0, 16)
        [est] = channel.events()
        assert est.name == "ESTABLISHED" and cmdata.CmAccept.unpack(est.private_data).crqsize == 64
        host.disconnect()
        assert [e.name for e in channel.events()] == ["DISCONNECTED"]
        assert [e.name for e in target.events()] == ["ESTABLISHED", "DISCONNECTED"]

        own = channel.create_id()  # a QP of our own (the Python data path): CONNECT_RESPONSE, then establish
        own.resolve_addr(None, ADDR, PORT, 1000)
        own.resolve_route(1000)
        channel.events()
        own.connect(cmdata.CmConnectRequest(0, 3, 64, 63, 1).pack(), 16, 0, 0x43)
        [req] = target.events()
        CmId(target, req.id).accept(cmdata.CmAccept(0, 64).pack(), 0, 16, 0x44)
        [resp] = channel.events()
        assert resp.name == "CONNECT_RESPONSE" and target.events() == []
        own.establish()
        assert [e.name for e in target.events()] == ["ESTABLISHED"]

        refused = channel.create_id()
        refused.resolve_addr(None, ADDR, PORT, 1000)
        refused.resolve_route(1000)
        channel.events()
        refused.connect(b"\x00" * 32, 16, 0)
        [req] = target.events()
        CmId(target, req.id).reject(cmdata.CmReject(0, cmdata.STS_INVALID_QID).pack())
        [rej] = channel.events()
        assert rej.name == "REJECTED" and cmdata.CmReject.unpack(rej.private_data).sts == cmdata.STS_INVALID_QID
    finally:
        target.close()


def test_an_unreachable_address_is_an_event_not_a_hang(channel):
    host = channel.create_id()
    host.resolve_addr(None, "192.0.2.77", PORT, 1000)
    [ev] = channel.events()
    assert ev.name == "ADDR_ERROR" and ev.status < 0


def test_without_a_device_the_channel_says_so():
    """The real librdmacm on a machine without RDMA devices (or the fake loaded: then it opens)."""
    try:
        CmChannel().close()
    except TransportError as exc:
        assert "RDMA CM event channel" in str(exc)


def test_the_qp_attributes_of_a_connection_come_from_the_cm(channel):
    """What the Python data path modifies its own QP with (rdma_init_qp_attr): the route's GID and the host's
    responder resources, as the fake CM computes them from the connection."""
    from nvmeof_roce.transport.rdma.cmchannel import CmId
    from nvmeof_roce.transport.rdma.verbs import QPS_INIT, QPS_RTR, QPS_RTS, gid_text
    channel.listen(ADDR, PORT)
    fakecm.connect(ADDR, PORT, "198.51.100.9", 1, b"", responder_resources=5)
    [ev] = channel.events()
    child = CmId(channel, ev.id)
    init, mask = child.qp_attr(QPS_INIT)
    assert init["qp_state"] == QPS_INIT and mask & 1  # IBV_QP_STATE
    rtr, _ = child.qp_attr(QPS_RTR)
    assert rtr["ah_attr"]["is_global"] == 1
    assert gid_text(rtr["ah_attr"]["dgid"]) == "0000:0000:0000:0000:0000:ffff:c633:6409"  # ::ffff:198.51.100.9
    rts, _ = child.qp_attr(QPS_RTS)
    assert rts["max_rd_atomic"] == 5
    with pytest.raises(OSError):
        child.qp_attr(7)  # no such state: the CM's own error, raised


class _Opens:
    """A stand-in for pyverbs' CompChannel: opens one file as it is made, closed by close()."""

    def __init__(self, opener):
        self.fd = opener()
        self.closed = False

    def close(self):
        os.close(self.fd)
        self.closed = True


def test_a_completion_channels_fd_is_found_without_proc_and_never_guessed():
    """verbs.create_with_fd: the lowest free number before, an anonymous-inode file after (as a completion
    channel's is); a new object that opened anything else is closed and refused."""
    from nvmeof_roce.transport.rdma.verbs import create_with_fd
    obj, fd = create_with_fd(lambda: _Opens(lambda: os.eventfd(0)))
    assert fd == obj.fd and os.get_blocking(fd) is False  # non-blocking for the event loop
    obj.close()
    made = []
    with pytest.raises(TransportError, match="not the anonymous-inode file"):
        create_with_fd(lambda: made.append(_Opens(lambda: os.open(os.devnull, os.O_RDONLY))) or made[-1])
    assert made[0].closed  # not left open behind the error


def _native_child(channel, port):
    """A connect request taken, and librdmacm's QP made on its id as the native data path makes it (create_cm_qp):
    (the fake's id, the CmId, the QP's objects)."""
    from nvmeof_roce.transport.rdma.cmchannel import CmId
    fake = fakecm.connect(ADDR, PORT, "198.51.100.9", port, b"", responder_resources=4, initiator_depth=16)
    [ev] = [e for e in channel.events() if e.name == "CONNECT_REQUEST"]
    objects = native.module.create_cm_qp(channel.channel, ev.id, 64, 34, 16)
    return fake, CmId(channel, ev.id), objects


def test_the_native_path_takes_its_qp_to_rts_itself_with_a_finite_rnr_retry(channel):
    """rdma_accept would take the QP to RTR and RTS with rdma_init_qp_attr's values, whose RNR retry count is the
    host's REQ's (7, for ever, from a Linux host: the fake's too); accept_rts makes the transitions itself with
    verbs.RNR_RETRY (6) and the ACK timeout bounded, and hides the QP from rdma_accept, which then modifies
    nothing (a second RTR from RTS would fail, as on a device) and sends the QP's number in the REP."""
    from nvmeof_roce.transport.rdma.verbs import ACK_TIMEOUT, RNR_RETRY
    channel.listen(ADDR, PORT)
    fake, child, objects = _native_child(channel, 1)
    assert fakecm.qp(fake).state == "INIT"  # librdmacm leaves a QP it made at INIT
    rts = child.accept_rts(cmdata.CmAccept(0, 32).pack(), 0, 4, RNR_RETRY, ACK_TIMEOUT)
    qp = fakecm.qp(fake)
    assert qp.state == "RTS" and qp.rnr_retry == RNR_RETRY == 6 and rts["rnr_retry"] == 6
    assert qp.modifies == 3  # INIT, RTR, RTS: ours only, rdma_accept made none
    assert qp.max_rd_atomic == 4 and qp.max_dest_rd_atomic == 0  # our initiator depth; no READs served to the host
    assert 0 < qp.timeout <= ACK_TIMEOUT and qp.retry_cnt == 7
    answer = fakecm.answer(fake)
    assert answer.state == "accepted" and answer.qp_num == objects["qp_num"] == qp.qp_num
    native.module.destroy_cm_qp(channel.channel, child.handle)  # the QP is back on its id: found and destroyed
    assert fakecm.qp(fake).state == "RESET"

    # the reason: librdmacm's own transitions (plain rdma_accept with the QP on the id) take the host's count
    fake2, child2, _ = _native_child(channel, 2)
    child2.accept(cmdata.CmAccept(0, 32).pack(), 0, 4)
    assert fakecm.qp(fake2).state == "RTS" and fakecm.qp(fake2).rnr_retry == 7
    native.module.destroy_cm_qp(channel.channel, child2.handle)


def test_accept_rts_checks_its_arguments_and_needs_a_qp(channel):
    from nvmeof_roce.transport.rdma.cmchannel import CmId
    channel.listen(ADDR, PORT)
    fakecm.connect(ADDR, PORT, "198.51.100.9", 1, b"")
    [ev] = channel.events()
    with pytest.raises(RuntimeError, match="no QP"):
        CmId(channel, ev.id).accept_rts(b"", 0, 4, 6, 19)
    native.module.create_cm_qp(channel.channel, ev.id, 64, 34, 16)
    for rnr, timeout in ((8, 19), (-1, 19), (6, 0), (6, 32)):
        with pytest.raises(ValueError):
            CmId(channel, ev.id).accept_rts(b"", 0, 4, rnr, timeout)
    native.module.destroy_cm_qp(channel.channel, ev.id)


def test_a_qp_is_destroyed_before_its_cm_id_on_every_path(channel):
    """The owner's order (the QP, once what it flushed was reaped, then the id) holds, and no path of the channel
    breaks it: destroy() refuses an id whose QP is still there (the id is kept, its queue's to close), and
    close() destroys such a QP before its id."""
    channel.listen(ADDR, PORT)
    before = fakecm.counters()
    fake, child, _ = _native_child(channel, 1)
    child.accept_rts(b"", 0, 4, 6, 19)
    native.module.destroy_cm_qp(channel.channel, child.handle)
    child.close()
    qp_at, id_at = fakecm.destroy_order(fake)
    assert 0 < qp_at < id_at

    fake2, child2, _ = _native_child(channel, 2)
    with pytest.raises(RuntimeError, match="still has its QP"):
        channel.channel.destroy(child2.handle)
    assert fakecm.answer(fake2).state != "destroyed" and fakecm.qp(fake2).state == "INIT"  # nothing was destroyed
    channel.close()  # the last resort: the QP, then the id
    qp_at, id_at = fakecm.destroy_order(fake2)
    assert 0 < qp_at < id_at
    after = fakecm.counters()
    assert after["destroy_with_qp"] == before["destroy_with_qp"] == 0
    assert after["qps_destroyed"] - before["qps_destroyed"] == 2
