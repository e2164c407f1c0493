"""blktests' NVME_TARGET_CONTROL hook (lab/blktests_control.py) and what blktests' nvme group needs from the
target, over the loopback fabric: its subsystem names (nvme/031), the discovery generation counter (nvme/030),
qid_max changes on reconnect (nvme/048), keys from `setup` (nvme/041)."""
import os
import subprocess
from pathlib import Path

import pytest

from nvmeof_roce.initiator.controller import HostError, NvmeStatusError
from nvmeof_roce.initiator.discovery import read_discovery_log
from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme.auth import generate_secret
from nvmeof_roce.lab import blktests_control as B
from nvmeof_roce.control.methods import Control
from nvmeof_roce.control.protocol import RpcError

from loopback_env import ADDR1, Env, port
from test_target_control import LoopListeners

HOST = B.BLKTESTS_HOSTNQN
SCRIPT = Path(B.__file__).with_name("nvme_target_control.sh")


@pytest.fixture
def env():
    e = Env({"hosts": [], "subsystems": [], "ports": [port(1, ADDR1, [])]})
    yield e
    assert e.target.internal_errors == 0
    e.close()


@pytest.fixture
def control(env):
    return Control(env.target, LoopListeners(env))


@pytest.fixture
def state(tmp_path):
    traddr, trsvcid = ADDR1.rsplit(":", 1)
    return {"traddr": traddr, "trsvid": trsvcid, "dir": str(tmp_path), "size": "4M"}


def rpc_of(control):
    return lambda method, params=None: control.call(method, params)


def connect(env, subnqn, **kw):
    return env.connect(subnqn, hostnqn=HOST, hostid=B.BLKTESTS_HOSTID, **kw)


def test_setup_serves_blktests_subsystem_names_and_cleanup_removes_them(env, control, state, tmp_path):
    # nvme/031: ten subsystems "blktests-subsystem-N", each set up, connected, disconnected, cleaned up.
    # Before, every setup was refused: the names are not NQNs (nvmet takes any configfs directory name).
    rpc = rpc_of(control)
    for i in range(3):
        nqn = f"blktests-subsystem-{i}"
        B.setup(rpc, state, nqn, B.BLKTESTS_SUBSYS_UUID, HOST)
        ctrl = connect(env, nqn)
        assert ctrl.identify_namespace(1).nsze == (4 << 20) // 512
        ctrl.write(1, 7, b"q" * 512)
        assert ctrl.read(1, 7, 1) == b"q" * 512
        ctrl.close()
        B.cleanup(rpc, state, nqn)
        assert nqn not in env.target.subsystems
        assert not os.path.exists(B.namespace_file(state, nqn))
    # a stranger is not let in: the subsystem is closed to all but the given host
    B.setup(rpc, state, B.BLKTESTS_SUBSYSNQN, B.BLKTESTS_SUBSYS_UUID, HOST)
    with pytest.raises((HostError, NvmeStatusError)):
        env.connect(B.BLKTESTS_SUBSYSNQN, hostnqn="nqn.2014-08.org.nvmexpress:uuid:" + "1" * 8 + "-1111-4111-8111-"
                    + "1" * 12)
    sub = control.call("nvmf_get_subsystems", {"nqn": B.BLKTESTS_SUBSYSNQN})[0]
    assert sub["namespaces"][0]["uuid"] == B.BLKTESTS_SUBSYS_UUID  # blktests finds the disk by this UUID


def test_setup_of_a_name_nvmet_refuses_too_is_refused_and_leaves_nothing(env, control, state):
    rpc = rpc_of(control)
    with pytest.raises(RpcError) as exc:
        B.setup(rpc, state, "blktests/1", B.BLKTESTS_SUBSYS_UUID, HOST)
    assert exc.value.field == "nqn" and "'/'" in exc.value.message
    with pytest.raises(RpcError):
        B.setup(rpc, state, F.DISCOVERY_NQN, B.BLKTESTS_SUBSYS_UUID, HOST)
    assert list(env.target.subsystems) == []


def test_setup_passes_the_keys_and_cleanup_clears_them(env, control, state):
    rpc = rpc_of(control)
    hostkey, ctrlkey = generate_secret(1, nqn=HOST), generate_secret(3)
    B.setup(rpc, state, B.BLKTESTS_SUBSYSNQN, B.BLKTESTS_SUBSYS_UUID, HOST, hostkey=hostkey, ctrlkey=ctrlkey)
    assert env.target.config.to_dict()["hosts"] == [{"nqn": HOST, "dhchap": {"key": hostkey, "ctrl_key": ctrlkey}}]
    B.cleanup(rpc, state, B.BLKTESTS_SUBSYSNQN)
    assert env.target.config.to_dict()["hosts"] == [{"nqn": HOST}]
    with pytest.raises(B.NvmeofError):
        B.setup(rpc, state, B.BLKTESTS_SUBSYSNQN, B.BLKTESTS_SUBSYS_UUID, HOST, ctrlkey=hostkey)


def test_a_key_from_setup_is_required_on_connect(env, control, state):
    # nvme/041: setup --hostkey; a connect without the key fails, one with it succeeds.
    rpc = rpc_of(control)
    hostkey = generate_secret(1, nqn=HOST)
    B.setup(rpc, state, B.BLKTESTS_SUBSYSNQN, B.BLKTESTS_SUBSYS_UUID, HOST, hostkey=hostkey)
    connect(env, B.BLKTESTS_SUBSYSNQN, dhchap_secret=hostkey).close()
    with pytest.raises((HostError, NvmeStatusError)):
        connect(env, B.BLKTESTS_SUBSYSNQN)


def test_set_host_keys_names_the_bad_field(control):
    with pytest.raises(RpcError) as exc:
        control.call("nvmeof_set_host_keys", {"host": HOST, "dhchap_key": "DHHC-1:00:nope:"})
    assert exc.value.field == "dhchap_key"
    with pytest.raises(RpcError) as exc:
        control.call("nvmeof_set_host_keys", {"host": HOST, "dhchap_key": generate_secret(1, nqn=HOST),
                                              "dhchap_dhgroup": "ffdhe1234"})
    assert exc.value.field == "dhchap_dhgroup"
    assert control.target.config.to_dict()["hosts"] == []


def test_discovery_generation_counter_follows_blktests_030(env, control, state):
    # nvme/030's steps (it writes nvmet's configfs itself, so it is skipped through the hook), through RPC:
    # each change of what a host may discover raises the discovery log's GENCTR.
    rpc = rpc_of(control)

    def genctr():
        disc = env.connect(F.DISCOVERY_NQN, hostnqn=HOST)
        entries = read_discovery_log(disc)
        header = disc.get_log_page(A.LID_DISCOVERY, 16, nsid=0)
        disc.close()
        return int.from_bytes(header[:8], "little"), [e.subnqn for e in entries]

    B.setup(rpc, state, "blktests-subsystem-1", B.BLKTESTS_SUBSYS_UUID, HOST)
    g0, seen = genctr()
    assert seen == ["blktests-subsystem-1"]
    control.call("nvmf_create_subsystem", {"nqn": "blktests-subsystem-2"})
    control.call("nvmf_subsystem_add_listener", {"nqn": "blktests-subsystem-2", "listen_address": {
        "trtype": "RDMA", "traddr": state["traddr"], "trsvcid": state["trsvid"]}})
    g1, _ = genctr()
    assert g1 > g0, "adding a subsystem to a port"
    control.call("nvmf_subsystem_add_host", {"nqn": "blktests-subsystem-2", "host": HOST})
    g2, seen = genctr()
    assert g2 > g1 and "blktests-subsystem-2" in seen, "adding host to allow_hosts"
    control.call("nvmf_subsystem_remove_host", {"nqn": "blktests-subsystem-2", "host": HOST})
    g3, seen = genctr()
    assert g3 > g2 and "blktests-subsystem-2" not in seen, "removing host from allow_hosts"
    control.call("nvmf_delete_subsystem", {"nqn": "blktests-subsystem-2"})
    g4, _ = genctr()
    assert g4 > g3, "removing a subsystem from a port"


def test_qid_max_change_ends_the_controllers_and_a_reconnect_gets_the_new_count(env, control, state):
    # nvme/048: attr_qid_max 1 then 2 while a host is connected; nvmet ends the controllers and the host's
    # reconnect is granted the new count.  Before, the change was refused as needing a restart.
    rpc = rpc_of(control)
    B.setup(rpc, state, B.BLKTESTS_SUBSYSNQN, B.BLKTESTS_SUBSYS_UUID, HOST)
    ctrl = connect(env, B.BLKTESTS_SUBSYSNQN, num_io_queues=2)
    assert len(ctrl.io_queues) == 2
    cntlid = ctrl.cntlid
    assert control.call("nvmeof_subsystem_set_qid_max", {"nqn": B.BLKTESTS_SUBSYSNQN, "qid_max": 1}) is True
    env.fabric.pump()
    assert cntlid not in env.target.subsystems[B.BLKTESTS_SUBSYSNQN].controllers
    ctrl = connect(env, B.BLKTESTS_SUBSYSNQN, num_io_queues=2)
    assert len(ctrl.io_queues) == 1
    control.call("nvmeof_subsystem_set_qid_max", {"nqn": B.BLKTESTS_SUBSYSNQN, "qid_max": 2})
    ctrl = connect(env, B.BLKTESTS_SUBSYSNQN, num_io_queues=2)
    assert len(ctrl.io_queues) == 2
    ctrl.close()
    with pytest.raises(RpcError) as exc:
        control.call("nvmeof_subsystem_set_qid_max", {"nqn": B.BLKTESTS_SUBSYSNQN, "qid_max": 0})
    assert exc.value.field == "qid_max"


def test_the_shell_script_answers_config_from_the_state_file(tmp_path):
    state = tmp_path / "blktests.state"
    env = dict(os.environ, NVMEOF_BLKTESTS_STATE=str(state))
    missing = subprocess.run([str(SCRIPT), "config", "--show-trtype"], env=env, capture_output=True, text=True)
    assert missing.returncode == 1 and "start' first" in missing.stderr
    state.write_text("trtype=rdma\ntraddr=10.99.0.1\ntrsvid=4420\nhost-traddr=10.99.0.1\n"
                     f"subsysnqn={B.BLKTESTS_SUBSYSNQN}\n")
    for opt, want in (("--show-trtype", "rdma"), ("--show-trsvid", "4420"), ("--show-host-traddr", "10.99.0.1"),
                      ("--show-subsysnqn", B.BLKTESTS_SUBSYSNQN)):
        out = subprocess.run([str(SCRIPT), "config", opt], env=env, capture_output=True, text=True, check=True)
        assert out.stdout == want + "\n"
    # the Python side reads the same file the same way
    assert B.read_state(str(state))["trsvid"] == "4420"


@pytest.mark.parametrize("mdts, commands", [(None, 5), (8, 1)])
def test_mdts_sets_the_largest_command_nvme_029_writes(tmp_path, mdts, commands):
    # nvme/029: `nvme write --block-count=1024` (1025 blocks of 512: 524800 bytes) is one passthrough command,
    # which the kernel host cannot split: it fails above MDTS.  `serve --mdts 8` advertises nvmet-rdma's 1 MiB.
    from nvmeof_roce.transport.resources import ResourceLimits
    limits = ResourceLimits() if mdts is None else ResourceLimits(mdts=mdts)
    e = Env({"hosts": [], "ports": [port(1, ADDR1, ["blktests-subsystem-1"])], "subsystems": [
        {"nqn": "blktests-subsystem-1", "namespaces": [
            {"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "2M"}}]}]}, limits=limits)
    ctrl = e.connect("blktests-subsystem-1", hostnqn=HOST, io_slot_size=1 << 20)
    assert ctrl.identify_controller().mdts == (mdts or 5)
    data = os.urandom(1025 * 512)
    ctrl.write(1, 511, data)
    assert ctrl.read(1, 511, 1025) == data
    assert e.target.subsystems["blktests-subsystem-1"].namespaces[1].write_commands == commands
    ctrl.close()
    e.close()
    with pytest.raises(B.NvmeofError):
        ResourceLimits(mdts=9)
