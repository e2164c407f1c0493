"""The initiator's native queue (csrc/hostq.c) through a fake verbs provider and NVMe target (hostq_fake.py):
the SQEs it issues, the completions and errors it counts, its batching and signaling, a lost connection."""
from array import array

import pytest

from nvmeof_roce import native
from nvmeof_roce.initiator.perf import hist_percentile

pytestmark = pytest.mark.skipif(not native.available(), reason="the native extension is not built")

from hostq_fake import FakeHost  # noqa: E402

NSID, BLOCK, LBA = 3, 4096, 512
NLB = BLOCK // LBA
SPAN = 1000  # aligned 4 KiB places


@pytest.fixture
def host():
    h = FakeHost(native.module)
    yield h
    h.close()


def run(h, depth=32, read_percent=70, ios=5000, **kw):
    keys = h.expect(nsid=NSID, nlb=NLB, block_size=BLOCK, nblocks=SPAN * NLB, depth=depth)
    return h.queue.perf(nsid=NSID, nlb=NLB, block_size=BLOCK, span_slots=SPAN, queue_depth=depth,
                        read_percent=read_percent, runtime=60.0, max_ios=ios, seed=7, **keys, **kw)


def test_perf_issues_well_formed_commands_and_counts_every_completion(host):
    r = run(host)
    seen = host.stats()
    assert seen["bad"] == 0, f"command {seen['first_bad']} malformed (reason {seen['bad_reason']})"
    assert seen["cid_reuse"] == 0 and seen["rnr"] == 0
    assert r["ios"] == 5000 and r["reads"] + r["writes"] == r["ios"]
    assert r["errors"] == 0 and r["unexpected"] == 0
    # every command the fake saw was answered and either measured or issued at the end (at most QD beyond)
    assert seen["commands"] == r["sends"] and r["ios"] <= seen["commands"] <= r["ios"] + 32
    assert seen["outstanding"] == 0 and seen["max_outstanding"] == 32
    assert 0.6 < r["reads"] / r["ios"] < 0.8  # 70 % reads
    assert seen["reads"] + seen["writes"] == seen["commands"]


def test_perf_batches_doorbells_and_signals_selectively(host):
    r = run(host, read_percent=100)
    seen = host.stats()
    assert r["writes"] == 0 and seen["writes"] == 0
    assert seen["post_send_calls"] == r["doorbells"] and seen["post_send_calls"] < seen["commands"] / 8
    assert seen["signaled"] == r["signaled"] and seen["signaled"] < seen["commands"] / 8
    assert seen["inline"] == seen["sends"]  # 64-byte SQEs fit the QP's inline data
    assert seen["post_recv_calls"] - 64 == r["recv_doorbells"] < seen["commands"] / 8


def test_perf_counts_error_statuses(host):
    host.inject(error_every=10, status=0x80)  # LBA Out of Range on every 10th command
    r = run(host, read_percent=0)
    assert r["writes"] == r["ios"] == 5000
    assert r["errors"] == pytest.approx(500, abs=4) and r["first_error"] == 0x80
    assert r["errors"] <= host.stats()["errors_sent"]


def test_perf_without_inline_data_posts_from_the_slots(host):
    h = FakeHost(native.module, inline_max=0)
    try:
        run(h, depth=16, ios=1000)
        seen = h.stats()
        assert seen["bad"] == 0 and seen["inline"] == 0 and seen["commands"] >= 1000
    finally:
        h.close()


def test_a_lost_connection_ends_perf_with_an_error(host):
    host.inject(fail_after=300)
    with pytest.raises(ConnectionError, match="connection lost"):
        run(host, ios=100000)
    with pytest.raises(ConnectionError):
        host.queue.send(bytes(64))


def test_a_small_send_queue_holds_commands_back_without_losing_any(host):
    h = FakeHost(native.module, slots=32, sq_size=8, interval=4)
    try:
        r = run(h, depth=32, ios=2000)
        seen = h.stats()
        assert seen["bad"] == 0 and r["ios"] == 2000 and r["backlogged"] > 0
        assert seen["outstanding"] == 0 and h.queue.stats()["in_sq"] <= 8
    finally:
        h.close()


def test_send_and_poll_carry_the_connect(host):
    capsule = bytearray(64 + 1024)
    capsule[0], capsule[2:4] = 0x7F, (0x1234).to_bytes(2, "little")
    host.queue.send(bytes(capsule))
    cqes = host.queue.poll(1.0)
    assert len(cqes) == 1 and int.from_bytes(cqes[0][12:14], "little") == 0x1234
    assert host.stats()["other"] == 1 and host.queue.poll(0.0) == []


@pytest.mark.parametrize("bad", [dict(queue_depth=65), dict(read_percent=101), dict(nlb=0), dict(span_slots=0)])
def test_perf_refuses_bad_settings(host, bad):
    keys = host.expect(nsid=NSID, nlb=NLB, block_size=BLOCK, nblocks=SPAN * NLB, depth=64)
    kw = dict(nsid=NSID, nlb=NLB, block_size=BLOCK, span_slots=SPAN, queue_depth=32, read_percent=100, **keys)
    kw.update(bad)
    with pytest.raises(ValueError, match="perf:"):
        host.queue.perf(**kw)
    assert host.stats()["commands"] == 0


def test_histogram_percentiles_match_between_c_and_python(host):
    r = run(host, ios=3000)
    hist = array("Q", r["hist"])
    assert sum(hist) == r["ios"]
    for pct in (50, 90, 99, 99.9):
        assert hist_percentile(hist, r["sub_buckets"], r["ios"], pct) / 1e3 == pytest.approx(r[f"p{pct:g}"])
    assert r["p50"] <= r["p90"] <= r["p99"] <= r["p99.9"] <= r["max"] * 1.04 + 0.001


@pytest.mark.parametrize("kind, reason, counter", [
    ("short", r"a response of 15 bytes \(a CQE is 16\)", "short_responses"),
    ("foreign_cid", r"a response for command ID 0xffff, which is not in flight", "unknown_responses"),
    ("duplicate", r"a response for command ID 0x[0-9a-f]+, which is not in flight", "unknown_responses"),
])
def test_a_hostile_response_fails_the_queue_and_completes_no_command(host, kind, reason, counter):
    # as nvme_rdma_recv_done: a short CQE or one for a command not in flight is a protocol error; the queue fails
    # (a duplicate arrives after its CID's slot was reused: it must not complete the newer command)
    host.misbehave(kind, at=100)
    with pytest.raises(ConnectionError, match=reason):
        run(host, ios=5000)
    stats = host.queue.stats()
    assert stats["failed"] and stats[counter] == 1
    with pytest.raises(ConnectionError, match=reason):
        host.queue.send(bytes(64))


def test_a_short_response_on_the_slow_path_fails_the_queue(host):
    host.misbehave("short", at=1)
    capsule = bytearray(64)
    capsule[0] = 0x7F
    host.queue.send(bytes(capsule))
    with pytest.raises(ConnectionError, match=r"a response of 15 bytes"):
        host.queue.poll(1.0)
    assert host.queue.stats()["short_responses"] == 1


def test_perf_polls_once_more_after_arming_so_a_completion_before_the_arm_never_waits_out_the_sleep():
    """Every response lands just before the host's arm, which raises no event (the verbs contract); a host that
    slept right after arming would wait its whole sleep (100 ms) for each.  It must poll once more and find it."""
    h = FakeHost(native.module, channel=True)
    try:
        h.respond_at_arm()
        r = run(h, depth=1, read_percent=100, ios=40)
        assert r["ios"] == 40 and r["errors"] == 0
        assert h.stats()["arms"] == r["arms"] >= 40  # each response came only with an arm
        assert r["sleeps"] == 0  # and the poll after each arm found it
    finally:
        h.close()
