"""The lab's development Ceph cluster (nvmeof_roce/ceph/devcluster.py), started for real from Debian's
packages: one monitor, one memstore OSD, the `rbd` pool; an image written and read back through librbd's
Python binding; the cluster frozen and thawed; stopped."""
import json

import pytest

from nvmeof_roce.ceph import devcluster
from nvmeof_roce.ceph.bindings import rados_and_rbd
from nvmeof_roce.errors import NvmeofError

pytestmark = pytest.mark.skipif(devcluster.missing_tools() != [],
                                reason=f"Ceph is not installed: apt-get install {' '.join(devcluster.missing_tools())} "
                                       "(make deps installs it)")


def test_a_cluster_starts_serves_an_image_and_stops(tmp_path):
    cluster = devcluster.DevCluster(tmp_path / "ceph", port=0)
    with cluster:
        assert cluster.running()
        pid = cluster._pid("mon.a")
        cluster.start()  # a second start of a running cluster is a no-op
        assert cluster._pid("mon.a") == pid
        with pytest.raises(NvmeofError) as err:
            cluster.rbd("info", "rbd/no-such-image")
        assert "rbd info rbd/no-such-image failed" in str(err.value) and str(cluster.directory / "log") in str(err.value)
        status = cluster.status()
        assert status["status"]["osdmap"]["num_up_osds"] == 1
        cluster.rbd("create", "--size", "8M", "rbd/t1")
        info = json.loads(cluster.rbd("info", "--format", "json", "rbd/t1"))
        assert info["size"] == 8 << 20
        rados, rbd = rados_and_rbd()
        with rados.Rados(conffile=str(cluster.conf)) as client:
            with client.open_ioctx("rbd") as ioctx, rbd.Image(ioctx, "t1") as image:
                image.write(b"\xa5" * 4096, 4096)
                assert image.read(4096, 4096) == b"\xa5" * 4096
                assert image.read(0, 4096) == bytes(4096)
    assert not cluster.running()
