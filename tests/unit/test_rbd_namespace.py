"""An RBD namespace served end to end over the loopback fabric, against a real development Ceph cluster
(ceph/devcluster.py: one monitor, one memstore OSD, started once for this module): writes read back through the
target and, directly, from the image through librbd; Flush, FUA, Write Zeroes and Deallocate; the size and the
NGUID from the image; a resize by the engine resizes the image; config refusals name the field; and the native
data path (csrc/be_rbd.c) on the same cluster, read back with the Python binding."""
import json
import subprocess
import sys
from pathlib import Path
import socket
import time

import pytest

from loopback_env import ADDR1, HOST_A, Env, port, ram_ns
from nvmeof_roce.ceph import devcluster
from nvmeof_roce.ceph import clients
from nvmeof_roce.ceph.bindings import rados_and_rbd
from nvmeof_roce.control.stats import target_status
from nvmeof_roce.engine.backends import rbd as rbd_backend
from nvmeof_roce.nvme.status import NvmeStatusError
from nvmeof_roce.nvme import admin as A

pytestmark = pytest.mark.skipif(devcluster.missing_tools() != [],
                                reason=f"Ceph is not installed: apt-get install {' '.join(devcluster.missing_tools())} "
                                       "(make deps installs it)")

SUB = "nqn.2024-01.io.test:rbd"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = devcluster.DevCluster(tmp_path_factory.mktemp("ceph") / "c", port=0)
    with c:
        yield c


def rbd_ns(nsid, cluster, image, **rbd):
    return {"nsid": nsid, "nvmeof_roce": {"backend": "rbd",
                                          "rbd": {"pool": "rbd", "image": image, "conf": str(cluster.conf), **rbd}}}


def config(namespaces):
    return {"hosts": [{"nqn": HOST_A}], "ports": [port(1, ADDR1, [SUB])],
            "subsystems": [{"nqn": SUB, "namespaces": namespaces}]}


def image_bytes(cluster, name, offset, length):
    rados, rbd = rados_and_rbd()
    with rados.Rados(conffile=str(cluster.conf)) as client, client.open_ioctx("rbd") as ioctx, \
            rbd.Image(ioctx, name, read_only=True) as image:
        return image.read(offset, length)


def test_a_host_writes_an_rbd_namespace_and_the_data_is_in_the_image(cluster):
    cluster.rbd("create", "--size", "8M", "rbd/e2e")
    env = Env(config([rbd_ns(1, cluster, "e2e"), ram_ns(2, "1M")]))
    try:
        ctrl = env.connect(SUB, num_io_queues=1)
        ns = env.target.subsystem(SUB).namespaces[1]
        assert ns.engine_choice.name == "async" and ns.num_blocks == (8 << 20) // 512
        pattern = bytes(range(256)) * 64  # 32 blocks
        ctrl.write(1, 100, pattern)
        assert ns.io.name == "async"
        assert ctrl.read(1, 100, 32) == pattern
        ctrl.write(1, 200, b"\x3c" * 4096, fua=True)
        ctrl.flush(1)
        assert image_bytes(cluster, "e2e", 100 * 512, len(pattern)) == pattern  # in Ceph, not only in the target
        assert image_bytes(cluster, "e2e", 200 * 512, 4096) == b"\x3c" * 4096
        ctrl.write_zeroes(1, 100, 8)
        assert image_bytes(cluster, "e2e", 100 * 512, 4096) == bytes(4096)
        assert ctrl.read(2, 0, 1) == bytes(512)  # the RAM namespace beside it serves as ever
        ident = ctrl.identify_namespace(1)
        assert ident.nsze == (8 << 20) // 512
        assert bytes(ident.nguid) == ns.backend.nguid() != bytes(16)
        ctrl.close()
        assert env.target.internal_errors == 0
    finally:
        env.close()


def test_every_gateway_reports_the_same_nguid_for_one_image_and_another_for_another(cluster):
    cluster.rbd("create", "--size", "4M", "rbd/same")
    cluster.rbd("create", "--size", "4M", "rbd/other")
    nguids = []
    for image in ("same", "same", "other"):
        env = Env(config([rbd_ns(1, cluster, image)]))
        try:
            nguids.append(env.target.subsystem(SUB).namespaces[1].nguid)
        finally:
            env.close()
    assert nguids[0] == nguids[1] != nguids[2]


def test_create_makes_a_missing_image_once_and_a_missing_image_without_it_is_named(cluster):
    env = Env(config([rbd_ns(1, cluster, "made", create={"size": "2M"})]))
    try:
        assert env.target.subsystem(SUB).namespaces[1].num_blocks == (2 << 20) // 512
    finally:
        env.close()
    assert json.loads(cluster.rbd("info", "--format", "json", "rbd/made"))["size"] == 2 << 20
    with pytest.raises(Exception) as err:
        Env(config([rbd_ns(1, cluster, "never-made")]))
    assert "rbd/never-made" in str(err.value) and "rbd create" in str(err.value)


def test_a_resize_by_the_engine_resizes_the_image(cluster):
    cluster.rbd("create", "--size", "4M", "rbd/grow")
    env = Env(config([rbd_ns(1, cluster, "grow")]))
    try:
        ns = env.target.subsystem(SUB).namespaces[1]
        commit = ns.backend.prepare_resize(6 << 20)
        commit()
        assert json.loads(cluster.rbd("info", "--format", "json", "rbd/grow"))["size"] == 6 << 20
        cluster.rbd("resize", "--size", "8M", "rbd/grow")  # outside: the backend reads it back
        assert ns.backend.storage_size() == 8 << 20
    finally:
        env.close()


def test_a_resize_by_rpc_resizes_the_image_and_the_host_is_told(cluster):
    """nvmf_subsystem_resize_ns on an rbd namespace (whose config has no size: the image's is its size): the
    image is resized, the namespace takes the size, the host gets the namespace-changed notice."""
    from nvmeof_roce.control.methods import Control
    cluster.rbd("create", "--size", "4M", "rbd/by-rpc")
    env = Env(config([rbd_ns(1, cluster, "by-rpc")]))
    try:
        ctrl = env.connect(SUB, num_io_queues=1)
        control = Control(env.target)
        answer = control.call("nvmf_subsystem_resize_ns", {"nqn": SUB, "nsid": 1, "size": "6M"})
        if not isinstance(answer, dict):  # answered once the namespace's commands drained
            assert pump_until(env, lambda: answer.part is not None)
            assert "result" in answer.part, answer.part
            answer = answer.part["result"]
        assert answer["size_bytes"] == 6 << 20
        assert json.loads(cluster.rbd("info", "--format", "json", "rbd/by-rpc"))["size"] == 6 << 20
        assert "size" not in json.dumps(env.target.config.subsystem(SUB).namespaces[0].to_dict().get(
            "nvmeof_roce", {}))
        assert pump_until(env, lambda: (ctrl.poll_admin() or True) and ctrl.changed_namespaces() == [1])
        assert ctrl.identify_namespace(1).nsze == (6 << 20) // 512
        ctrl.close()
    finally:
        env.close()


def pump_until(env, done, timeout=15.0, advance=0.0):
    """Run the loop (the loopback fabric's watched fds, where the target's completions come back) until
    `done()`, waiting in real time for Ceph's threads: nothing else polls.  `advance`: seconds the target's
    clock moves on each pass (its ticks: the retries of a pending namespace)."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        env.clock.advance(advance)
        env.fabric.run_watched(0.05)
        env.fabric.pump()
    return True


def test_a_resize_made_outside_reaches_the_host_from_the_watch_alone(cluster):
    cluster.rbd("create", "--size", "4M", "rbd/outside")
    env = Env(config([rbd_ns(1, cluster, "outside"), ram_ns(2, "1M")]))
    try:
        ctrl = env.connect(SUB, num_io_queues=1)
        ns = env.target.subsystem(SUB).namespaces[1]
        rados, rbd = rados_and_rbd()
        with rados.Rados(conffile=str(cluster.conf)) as client, client.open_ioctx("rbd") as ioctx, \
                rbd.Image(ioctx, "outside") as image:
            image.resize(6 << 20)  # another client: the target is told only by the image's header watch
            assert pump_until(env, lambda: ns.num_blocks == (6 << 20) // 512)
            ctrl.poll_admin()
            assert ctrl.events == [(A.AER_TYPE_NOTICE, A.AER_NOTICE_NS_CHANGED, A.LID_CHANGED_NS)]
            assert ctrl.changed_namespaces() == [1]
            assert ctrl.identify_namespace(1).nsze == (6 << 20) // 512
            ctrl.write(1, (5 << 20) // 512, b"\x42" * 512)  # past the old end
            assert image.read(5 << 20, 512) == b"\x42" * 512
            image.resize(3 << 20)  # a shrink: the namespace follows, the blocks past the end are gone
            assert pump_until(env, lambda: ns.num_blocks == (3 << 20) // 512)
            ctrl.poll_admin()
            assert len(ctrl.events) == 2 and ctrl.identify_namespace(1).nsze == (3 << 20) // 512
            with pytest.raises(NvmeStatusError):
                ctrl.read(1, (5 << 20) // 512, 1)
        assert ns.storage_size is None and ns.backend.storage_size() == 3 << 20
        ctrl.close()
        assert env.target.internal_errors == 0
    finally:
        env.close()


def test_a_lost_watch_is_registered_again_and_the_namespace_keeps_reading_its_size_and_serving(cluster):
    """librados reports a lost watch (a cluster that went away, a blocklist) with (watch id, error); the watcher
    closes the old watch and registers a new one, and the namespace keeps reading its size and serving."""
    cluster.rbd("create", "--size", "4M", "rbd/rewatched")
    env = Env(config([rbd_ns(1, cluster, "rewatched")]))
    try:
        ctrl = env.connect(SUB, num_io_queues=1)
        ns = env.target.subsystem(SUB).namespaces[1]
        first = ns.backend._watch
        ns.backend._on_watch_error(0, -107)  # as librados calls it: (watch id, error)
        assert pump_until(env, lambda: ns.backend._watch is not None and ns.backend._watch is not first)
        assert ns.backend.header_size() == 4 << 20  # its pool context still open
        cluster.rbd("resize", "--size", "6M", "rbd/rewatched")  # seen through the new watch
        assert pump_until(env, lambda: ns.num_blocks == (6 << 20) // 512)
        ctrl.write(1, 0, b"\x17" * 512)
        assert image_bytes(cluster, "rewatched", 0, 512) == b"\x17" * 512
        ctrl.close()
    finally:
        env.close()


def test_a_cluster_unreachable_at_start_leaves_its_namespace_pending_and_it_comes_in_once_it_answers(
        cluster, tmp_path, monkeypatch):
    monkeypatch.setattr(rbd_backend, "RBD_CONNECT_TIMEOUT", 1)  # a monitor that does not answer: 1 s, not 10
    monkeypatch.setattr(clients, "FAILED_HOLD", 0.0)
    conf = tmp_path / "ceph.conf"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nothing listens there once the socket closes
    conf.write_text(f"[global]\nmon host = 127.0.0.1:{dead}\nauth client required = none\n")
    cluster.rbd("create", "--size", "4M", "rbd/late")
    ns1 = rbd_ns(1, cluster, "late")
    ns1["nvmeof_roce"]["rbd"]["conf"] = str(conf)
    env = Env(config([ns1, ram_ns(2, "1M")]))  # serves: the RAM namespace now, the rbd one once it opens
    try:
        sub = env.target.subsystem(SUB)
        assert list(sub.namespaces) == [2]
        pending = target_status(env.target)["subsystems"][0]["pending_namespaces"]
        assert [p["nsid"] for p in pending] == [1] and pending[0]["backend"] == "rbd"
        assert "timed out" in pending[0]["reason"] and "ceph -s" in pending[0]["fix"]
        ctrl = env.connect(SUB, num_io_queues=1, kato_ms=300_000)  # the test clock runs fast: no expiry
        assert ctrl.active_namespaces() == [2]  # the host does not see it meanwhile
        ctrl.write(2, 0, b"\x11" * 512)
        # the retries back off, on a thread of their own: the loop keeps serving meanwhile
        assert pump_until(env, lambda: env.target.pending.entries[(SUB, 1)].attempts >= 2, advance=0.2)
        assert ctrl.read(2, 0, 1) == b"\x11" * 512 and list(sub.namespaces) == [2]
        conf.write_text(cluster.conf.read_text())  # the cluster answers now
        assert pump_until(env, lambda: 1 in sub.namespaces, timeout=30, advance=0.2)
        assert target_status(env.target)["subsystems"][0]["pending_namespaces"] == []
        ctrl.poll_admin()
        assert (A.AER_TYPE_NOTICE, A.AER_NOTICE_NS_CHANGED, A.LID_CHANGED_NS) in ctrl.events
        assert ctrl.changed_namespaces() == [1] and ctrl.active_namespaces() == [1, 2]
        ctrl.write(1, 8, b"\x5e" * 512)
        assert image_bytes(cluster, "late", 8 * 512, 512) == b"\x5e" * 512
        ctrl.close()
        assert env.target.internal_errors == 0
    finally:
        env.close()


def test_a_missing_image_still_fails_the_start_and_is_not_left_pending(cluster):
    with pytest.raises(Exception) as err:
        Env(config([rbd_ns(1, cluster, "never-there"), ram_ns(2, "1M")]))
    assert "rbd create" in str(err.value)


def test_namespaces_of_one_cluster_share_one_client_and_close_off_the_loop(cluster):
    assert clients.wait_closed(30)  # the namespaces of the tests before have let their clients go
    cluster.rbd("create", "--size", "4M", "rbd/share-a")
    cluster.rbd("create", "--size", "4M", "rbd/share-b")
    env = Env(config([rbd_ns(1, cluster, "share-a"), rbd_ns(2, cluster, "share-b")]))
    sub = env.target.subsystem(SUB)
    a, b = sub.namespaces[1].backend, sub.namespaces[2].backend
    assert a.client is b.client and clients.held()[a.cluster_key()] == 2
    key = a.cluster_key()
    cluster.pause()  # a cluster that went away: closing its images waits for it, the loop does not
    try:
        started = time.monotonic()
        env.close()
        assert time.monotonic() - started < 1.0
    finally:
        cluster.resume()
    assert clients.wait_closed(30) and key not in clients.held()


def test_the_native_data_path_serves_an_rbd_namespace_through_librbd_in_c(cluster):
    """The C queue (fake verbs provider) on a real image: its own client opened in C (csrc/be_rbd.c, Debian's
    librbd by dlopen), librbd's completions on librbd's thread; what it wrote is read back with the Python binding."""
    from native_diff import io_capsule, pattern
    from native_fake import needs_native
    from rbd_fake import collect, rbd_endpoint, rbd_ns as fake_rbd_ns, status_of
    if needs_native.args[0]:
        pytest.skip(needs_native.kwargs["reason"])
    cluster.rbd("create", "--size", "8M", "rbd/native")
    ep = rbd_endpoint([fake_rbd_ns(1, "native", conf=str(cluster.conf))])  # "native": true (rbd_fake.rbd_ns)
    try:
        data = pattern(16384, seed=41)
        ep.buf.view[:16384] = data
        for capsule in (io_capsule(ep, 0x01, 1, 64, 31, 16384, offset=0, cid=1),
                        io_capsule(ep, 0x01, 1, 200, 7, 4096, offset=0, cid=2, cdw12_hi=0x4000)):  # FUA
            assert ep.device.deliver(capsule) == 0
        assert [status_of(c) for c in collect(ep, 2)] == [0, 0]
        assert image_bytes(cluster, "native", 64 * 512, 16384) == data  # in Ceph, through librbd in C
        assert image_bytes(cluster, "native", 200 * 512, 4096) == data[:4096]
        assert ep.device.deliver(io_capsule(ep, 0x02, 1, 64, 31, 16384, offset=65536, cid=3)) == 0
        assert [status_of(c) for c in collect(ep, 1)] == [0]
        assert ep.host_bytes()[65536:65536 + 16384] == data
        for capsule in (io_capsule(ep, 0x00, 1, 0, 0, 0, cid=4), io_capsule(ep, 0x08, 1, 64, 15, 0, cid=5)):
            assert ep.device.deliver(capsule) == 0
        assert [status_of(c) for c in collect(ep, 2)] == [0, 0]
        assert image_bytes(cluster, "native", 64 * 512, 16384) == bytes(8192) + data[8192:]
        stats = ep.queue.stats()
        assert stats["file_commands"] == 5 and stats["file_handed_back"] == 0 and stats["python_commands"] == 1
    finally:
        ep.close()


def test_the_native_path_answers_a_cluster_that_does_not_answer_with_ana_transition(cluster):
    """The cluster frozen (SIGSTOP) under a native Read: librados's op timeout (10 s) fails it with ETIMEDOUT,
    answered in C with ANA Transition, no DNR; the loop was never held (the queue polled all along), and once the
    cluster is back the next command is served."""
    from native_diff import io_capsule
    from native_fake import needs_native
    from rbd_fake import cid_of, collect, rbd_endpoint, rbd_ns as fake_rbd_ns, status_of
    from nvmeof_roce.nvme import status as S
    if needs_native.args[0]:
        pytest.skip(needs_native.kwargs["reason"])
    cluster.rbd("create", "--size", "4M", "rbd/frozen")
    ep = rbd_endpoint([fake_rbd_ns(1, "frozen", conf=str(cluster.conf))])
    try:
        cluster.pause()
        try:
            assert ep.device.deliver(io_capsule(ep, 0x02, 1, 0, 7, 4096, cid=1)) == 0
            ep.buf.view[:4096] = bytes(range(256)) * 16
            assert ep.device.deliver(io_capsule(ep, 0x01, 1, 8, 7, 4096, cid=3)) == 0
            started = time.monotonic()
            collect(ep, 0)  # both calls made on librbd in this poll's thread (rbd_non_blocking_aio false)
            assert time.monotonic() - started < 3, "librbd's calls waited for the frozen cluster in the poll"
            answers = collect(ep, 2, timeout=40)
        finally:
            cluster.resume()
        assert sorted(cid_of(c) for c in answers) == [1, 3]
        for c in answers:
            assert status_of(c) == S.ANA_TRANSITION and not status_of(c) & S.DNR
        assert ep.device.deliver(io_capsule(ep, 0x02, 1, 0, 7, 4096, cid=2)) == 0
        assert [status_of(c) for c in collect(ep, 1, timeout=40)] == [0]
    finally:
        ep.close()


WATCH_CLOSED_TWICE = """
import gc, json, sys, time
sys.path.insert(0, sys.argv[2])
from nvmeof_roce.ceph import clients
from nvmeof_roce.ceph.bindings import rados_and_rbd
rados, _ = rados_and_rbd()
victim = rados.Rados(conffile=sys.argv[1], conf={"rados_osd_op_timeout": "3"})
victim.connect()
ioctx = victim.open_ioctx("rbd")
ioctx.write_full("watched", b"x")
watch = ioctx.watch("watched", lambda *a: None, lambda *a: None)
with rados.Rados(conffile=sys.argv[1]) as admin:
    addr = victim.get_addrs().strip("[]").split(",")[0]
    addr = addr.split(":", 1)[1] if addr.startswith(("v1:", "v2:", "any:")) else addr
    admin.mon_command(json.dumps({"prefix": "osd blocklist", "blocklistop": "add", "addr": addr}), b"")
    admin.wait_for_latest_osdmap()
try:
    ioctx.read("watched")  # the client learns it is blocklisted
except rados.Error:
    pass
time.sleep(3)  # and its watch is told (its error callback)
try:
    watch.close()
except rados.Error as exc:
    print("close failed:", exc)
    if sys.argv[3] == "keep":
        clients.keep_unclosable(watch)
del watch
gc.collect()
print("done")
"""


@pytest.mark.parametrize("keep", ["keep", "free"])
def test_a_watch_whose_close_failed_is_never_freed_for_librados_would_free_it_twice(cluster, tmp_path, keep):
    """A blocklisted client's watch fails to close; freeing the object closes it again and librados frees its
    memory twice (the process aborts).  clients.keep_unclosable keeps it: the process ends cleanly.  The "free"
    case shows the abort the project avoids (if a Ceph release fixes it, that case fails and can go)."""
    script = tmp_path / "watch.py"
    script.write_text(WATCH_CLOSED_TWICE)
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, str(script), str(cluster.conf), root, keep], capture_output=True,
                          text=True, timeout=120)
    assert "close failed" in proc.stdout, proc.stdout + proc.stderr
    if keep == "keep":
        assert proc.returncode == 0 and "done" in proc.stdout, proc.stdout + proc.stderr
    else:
        assert proc.returncode != 0, proc.stdout + proc.stderr
