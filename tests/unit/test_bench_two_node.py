"""`bench --two-node`: the target node's serving loop and the host node's remote targets, met through the
rendezvous files; the topology in the report; argument forwarding.  (The real run: docs/benchmarks.md.)"""
import json
import subprocess
import sys
import threading

import pytest

from nvmeof_roce.bench import report, twonode
from nvmeof_roce.bench.targets import TargetUnderTest


class Recorded(TargetUnderTest):
    kind = "test double"

    def __init__(self, name, port, events):
        self.name = name
        super().__init__(twonode.TARGET_NODE, port)
        self.events = events

    def setup(self):
        self.events.append(("setup", self.name))

    def teardown(self):
        self.events.append(("teardown", self.name))


def test_target_node_serves_until_the_host_node_is_done(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_SYNC", str(tmp_path))
    events = []
    targets = [Recorded("kernel", 4420, events), Recorded("userspace", 4421, events)]
    codes = []
    t = threading.Thread(target=lambda: codes.append(twonode.serve_targets(targets, (), None, 18515, 30)))
    t.start()
    remote = twonode.remote_targets(30)  # what the host node sees
    assert [(r.name, r.traddr, r.trsvcid, r.kind) for r in remote] == \
        [("kernel", "10.99.1.1", 4420, "test double"), ("userspace", "10.99.1.1", 4421, "test double")]
    assert remote[1].subnqn == targets[1].subnqn and remote[1].describe()["node"] == "10.99.1.1"
    assert events == [("setup", "kernel"), ("setup", "userspace")]  # up, and staying up
    remote[0].setup(), remote[0].teardown()  # nothing happens on the host node
    twonode.done()
    t.join(30)
    assert codes == [0] and events[2:] == [("teardown", "userspace"), ("teardown", "kernel")]


def test_target_node_tears_down_what_it_set_up_when_one_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_SYNC", str(tmp_path))
    events = []

    class Broken(Recorded):
        def setup(self):
            raise RuntimeError("configfs refused")
    with pytest.raises(RuntimeError):
        twonode.serve_targets([Recorded("kernel", 4420, events), Broken("userspace", 4421, events)], (), None,
                              18515, 5)
    # like the one-node runner: a target whose setup failed half way is torn down too (teardown is idempotent)
    assert events == [("setup", "kernel"), ("teardown", "userspace"), ("teardown", "kernel")]
    assert not (tmp_path / "bench-targets").exists()


def test_forwarded_arguments():
    assert twonode.forwarded_argv(["--two-node", "--repeats", "3", "--out", "x", "--timeout=9", "--capture"]) == \
        ["--repeats", "3", "--capture"]


def test_report_names_the_topology():
    one = report.new_result(date="d", machine={}, params={"repeats": 1}, targets={})
    assert "topology: one node" in report.render(one)
    two = dict(one, topology=twonode.topology())
    assert "topology: two nodes: targets on 10.99.1.1, host and fio on 10.99.1.2, virtio-net" in report.render(two)
    assert "Topology: two nodes: targets on 10.99.1.1" in report.render_markdown(two)


def test_capture_needs_two_nodes():
    r = subprocess.run([sys.executable, "-m", "nvmeof_roce", "bench", "--capture", "--no-perftest"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "--capture needs --two-node" in r.stderr


def test_userspace_config_is_moved_to_the_target_node_address(tmp_path):
    out = twonode.config_on_target_node("targets/demo.json", tmp_path)
    cfg = json.loads(out.read_text())
    assert [p["addr"]["traddr"] for p in cfg["ports"]] == ["10.99.1.1"] and cfg["ports"][0]["addr"]["trsvcid"] == "4421"
