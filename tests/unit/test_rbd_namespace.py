"""An RBD namespace served end to end over the loopback fabric, against a real development Ceph cluster
(ceph/devcluster.py: one monitor, one memstore OSD, started once for this module): writes read back through the
target and, directly, from the image through librbd; Flush, FUA, Write Zeroes and Deallocate; the size and the
NGUID from the image; a resize by the engine resizes the image; config refusals name the field."""
import json
import time

import pytest

from loopback_env import ADDR1, HOST_A, Env, port, ram_ns
from nvmeof_roce.ceph import devcluster
from nvmeof_roce.ceph.bindings import rados_and_rbd
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


def pump_until(env, done, timeout=15.0):
    """Run the loop (the loopback fabric's watched fds, where the target's completions come back) until
    `done()`, waiting in real time for Ceph's threads: nothing else polls."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
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
