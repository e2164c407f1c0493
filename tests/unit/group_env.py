"""Gateways of a group in one process, for the tests against a development Ceph cluster (ceph/devcluster.py):
each gateway a Target on the loopback fabric (loopback_env.Env) with its own RADOS client and GroupMember
(service/group.py), as on distinct machines.  Used by test_gateway_group.py and
test_gateway_group_reservations.py; a test module's `cluster` fixture yields from
`dev_cluster`."""
import time

import pytest

from loopback_env import Env, port
from nvmeof_roce.ceph import devcluster
from nvmeof_roce.config import parse_config
from nvmeof_roce.control.methods import Control
from nvmeof_roce.service.group import GroupMember

needs_ceph = pytest.mark.skipif(devcluster.missing_tools() != [],
                                reason=f"Ceph is not installed: apt-get install {' '.join(devcluster.missing_tools())} "
                                       "(make deps installs it)")

LEASE = 3  # seconds: the shortest the config takes


def dev_cluster(tmp_path_factory):
    """What a test module's `cluster` fixture (module scope) yields from: a development cluster, started once."""
    c = devcluster.DevCluster(tmp_path_factory.mktemp("ceph") / "c", port=0)
    with c:
        yield c


class FakeServer:
    """What the member asks of serve.py's TargetServer."""

    def __init__(self, env):
        self.target = env.target
        self.loop = env.fabric
        self.listeners = []
        self.exit_code = 0
        self.stop_requested = False

    def request_stop(self):
        self.stop_requested = True


class Gateway:
    """One gateway: its own file (a port, the group settings, maybe a seed), its own RADOS client id (so the
    cluster sees distinct clients, as on distinct machines).  `target_args` go to the Target (file_lock="shared"
    for file namespaces both gateways open in this one process)."""

    def __init__(self, cluster, group, name, home, address, seed=None, client_id=None, lease=LEASE, **target_args):
        local = {"ports": [port(1, address, [])],
                 "nvmeof_roce": {"group": {"name": group, "gateway": name, "ana_groups": home,
                                           "conf": str(cluster.conf), "id": client_id or name, "lease": lease}}}
        if seed:
            local["subsystems"] = seed
        config = parse_config(local, f"{name}.json")
        self.member = GroupMember(config.group, config.to_dict())
        self.member.connect()
        merged = self.member.join()
        self.env = Env(merged, **target_args)
        self.control = Control(self.env.target, config_path=f"/nonexistent/{name}.json")
        self.control.group = self.member
        self.server = FakeServer(self.env)
        self.member.attach(self.server, self.control)

    def state(self, grpid):
        return self.env.target.ana.state(1, grpid)

    def pump(self):
        self.env.fabric.run_watched(0.01)
        self.env.fabric.pump()
        self.member.tick(time.monotonic())

    def kill(self):
        """As SIGKILL to the keeper: no more renewals, no release; the loop side still runs (a hung gateway)."""
        self.member._stop.set()
        self.member._keeper.join(10)
        self.member._watch.close()

    def close(self):
        self.member.close()
        self.env.close()


def run(gateways, until, timeout=20.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for gw in gateways:
            gw.pump()
        if until():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} did not happen in {timeout} s")


def call(gw, others, method, params):
    """An RPC on `gw`: its answer (the change is published before it is answered)."""
    answer = gw.control.call(method, params)
    run([gw] + others, lambda: answer.part is not None, what=f"the answer to {method}")
    assert "result" in answer.part, answer.part
    return answer.part["result"]
