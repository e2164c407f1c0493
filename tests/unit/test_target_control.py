"""The control socket's RPC methods, live changes and the events hosts get, over the loopback fabric."""
import json
import os
import socket
import threading

import pytest

from nvmeof_roce.config import parse_config
from nvmeof_roce.initiator.controller import NvmeStatusError
from nvmeof_roce.initiator.discovery import read_discovery_log
from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import fabrics as F
from nvmeof_roce.nvme import status as S
from nvmeof_roce.control import live
from nvmeof_roce.control.methods import Control
from nvmeof_roce.control.client import call
from nvmeof_roce.control.protocol import INVALID_PARAMS, METHOD_NOT_FOUND, RpcError, handle_request
from nvmeof_roce.control.server import RpcServer
from nvmeof_roce.errors import NvmeofError

from loopback_env import ADDR2, HOST_A, HOST_B, SUB_ONLY_A, SUB_RAM, Env, port, ram_ns, standard_config

NEW_SUB = "nqn.2024-01.io.test:new"


class LoopListeners(live.Listeners):
    """Ports added live listen on the loopback fabric."""

    def __init__(self, env):
        self.env = env
        self.opened = []

    def open(self, target, p):
        self.env.fabric.listen(f"{p.traddr}:{p.trsvcid}", target.port(p.portid))
        self.opened.append(p.portid)

    def close(self, portid):
        for address, lst in list(self.env.fabric._listeners.items()):
            if getattr(lst.handler, "ctx", None) is not None and lst.handler.ctx.portid == portid:
                lst.close()


@pytest.fixture
def control(env):
    return Control(env.target, LoopListeners(env))


def rpc_error(control, method, params):
    with pytest.raises(RpcError) as exc:
        control.call(method, params)
    return exc.value


def snapshot(target):
    return json.dumps(target.config.to_dict(), sort_keys=True)


# ------------------------------------------------------------------------------------- namespaces

def test_add_ns_appears_to_a_connected_host_with_an_event(env, control):
    ctrl = env.connect(SUB_RAM)
    nsid = control.call("nvmf_subsystem_add_ns", {"nqn": SUB_RAM, "namespace": {"backend": "ram", "size": "1M"}})
    assert nsid == 3  # the lowest free NSID, as SPDK picks
    ctrl.poll_admin()
    assert ctrl.events == [(A.AER_TYPE_NOTICE, A.AER_NOTICE_NS_CHANGED, A.LID_CHANGED_NS)]
    assert ctrl.changed_namespaces() == [3]
    assert ctrl.active_namespaces() == [1, 2, 3]
    ctrl.write(3, 0, b"x" * 512)
    assert ctrl.read(3, 0, 1) == b"x" * 512
    subs = control.call("nvmf_get_subsystems", {"nqn": SUB_RAM})
    assert [n["nsid"] for n in subs[0]["namespaces"]] == [1, 2, 3]
    assert subs[0]["namespaces"][2]["size_bytes"] == 1 << 20
    ctrl.close()


def test_add_ns_errors_name_the_field_and_leave_the_target_unchanged(env, control, tmp_path):
    before = snapshot(env.target)
    err = rpc_error(control, "nvmf_subsystem_add_ns", {"nqn": SUB_RAM, "namespace": {"backend": "ram"}})
    assert err.code == INVALID_PARAMS and err.field == "namespace.size" and "size" in err.fix
    err = rpc_error(control, "nvmf_subsystem_add_ns",
                    {"nqn": SUB_RAM, "namespace": {"nsid": 1, "backend": "ram", "size": "1M"}})
    assert err.field == "namespace.nsid" and "already has namespace 1" in err.message
    err = rpc_error(control, "nvmf_subsystem_add_ns",
                    {"nqn": SUB_RAM, "namespace": {"nsid": 2000, "backend": "ram", "size": "1M"}})
    assert err.field == "namespace.nsid" and "1024" in err.message
    err = rpc_error(control, "nvmf_subsystem_add_ns", {"nqn": SUB_RAM, "namespace": {"bdev_name": "Malloc0"}})
    assert err.field == "namespace.bdev_name" and "path" in err.fix
    err = rpc_error(control, "nvmf_subsystem_add_ns",
                    {"nqn": SUB_RAM, "namespace": {"path": str(tmp_path / "missing.img")}})
    assert err.field == "namespace.path" and "no such file" in err.message
    err = rpc_error(control, "nvmf_subsystem_add_ns", {"nqn": "nqn.2024-01.io.test:nope",
                                                       "namespace": {"backend": "ram", "size": "1M"}})
    assert err.field == "nqn" and SUB_RAM in err.fix
    err = rpc_error(control, "nvmf_subsystem_add_ns", {"nqn": SUB_RAM, "namespace": {"colour": "red"}})
    assert err.field == "namespace.colour"
    err = rpc_error(control, "nvmf_subsystem_add_ns", {"nqn": SUB_RAM, "ns": {}})
    assert err.field == "ns"
    assert snapshot(env.target) == before
    assert sorted(env.target.subsystems[SUB_RAM].namespaces) == [1, 2]


def test_add_ns_takes_the_engine_and_queue_depth_of_a_file_namespace(env, control, tmp_path):
    """`target add-ns --io-engine threads --queue-depth 8` (RPC io_engine, queue_depth): the namespace runs on
    the engine asked for, with that depth; a bad value names the field."""
    img = tmp_path / "added.img"
    img.write_bytes(bytes(1 << 20))
    nsid = control.call("nvmf_subsystem_add_ns", {"nqn": SUB_RAM, "namespace": {
        "path": str(img), "io_engine": "threads", "queue_depth": 8}})
    ns = env.target.subsystems[SUB_RAM].namespaces[nsid]
    io = ns.engine_status()
    assert (io["engine"], io["queue_depth"]) == ("threads", 8) and "io_engine" in io["engine_reason"]
    err = rpc_error(control, "nvmf_subsystem_add_ns", {"nqn": SUB_RAM, "namespace": {
        "path": str(tmp_path / "other.img"), "size": "1M", "io_engine": "aio"}})
    assert err.field == "namespace.io_engine" and "io_uring" in err.fix


def test_remove_ns(env, control):
    ctrl = env.connect(SUB_RAM)
    assert control.call("nvmf_subsystem_remove_ns", {"nqn": SUB_RAM, "nsid": 2}) is True
    ctrl.poll_admin()
    assert ctrl.changed_namespaces() == [2]
    with pytest.raises(NvmeStatusError) as exc:
        ctrl.read(2, 0, 1)
    assert exc.value.status == S.INVALID_NS | S.DNR
    err = rpc_error(control, "nvmf_subsystem_remove_ns", {"nqn": SUB_RAM, "nsid": 2})
    assert err.field == "nsid"
    err = rpc_error(control, "nvmf_subsystem_remove_ns", {"nqn": SUB_RAM})
    assert err.field == "nsid" and "missing" in err.message
    ctrl.close()


def test_resize_ns_keeps_data_and_the_host_sees_the_new_size(env, control):
    ctrl = env.connect(SUB_RAM)
    ctrl.write(2, 10, b"k" * 512)
    result = control.call("nvmf_subsystem_resize_ns", {"nqn": SUB_RAM, "nsid": 2, "size": "4M"})
    assert result == {"nsid": 2, "size_bytes": 4 << 20, "blocks": 8192}
    ctrl.poll_admin()
    assert ctrl.changed_namespaces() == [2]
    assert ctrl.identify_namespace(2).nsze == 8192
    assert ctrl.read(2, 10, 1) == b"k" * 512
    ctrl.write(2, 8191, b"e" * 512)  # the new last block
    assert env.target.config.subsystem(SUB_RAM).namespace(2).size_bytes == 4 << 20
    # errors: not a multiple of the block size, not a size, no such namespace
    err = rpc_error(control, "nvmf_subsystem_resize_ns", {"nqn": SUB_RAM, "nsid": 2, "size": 1000})
    assert err.field == "size" and "512" in err.fix
    err = rpc_error(control, "nvmf_subsystem_resize_ns", {"nqn": SUB_RAM, "nsid": 2, "size": "big"})
    assert err.field == "size"
    err = rpc_error(control, "nvmf_subsystem_resize_ns", {"nqn": SUB_RAM, "nsid": 9, "size": "1M"})
    assert err.field == "nsid"
    assert env.target.subsystems[SUB_RAM].namespaces[2].num_blocks == 8192
    ctrl.close()


def test_resize_file_namespace_grows_the_file(tmp_path):
    e = Env(standard_config(tmp_path))
    try:
        control = Control(e.target)
        from loopback_env import SUB_FILE
        control.call("nvmf_subsystem_resize_ns", {"nqn": SUB_FILE, "nsid": 1, "size": "3M"})
        assert os.path.getsize(tmp_path / "ns1.img") == 3 << 20
        assert e.target.subsystems[SUB_FILE].namespaces[1].num_blocks == 6144
    finally:
        e.close()


# ------------------------------------------------------------------------------------------ hosts

def test_add_then_remove_host_ends_its_controller(env, control):
    with pytest.raises(NvmeStatusError):
        env.connect(SUB_ONLY_A, hostnqn=HOST_B)
    assert control.call("nvmf_subsystem_add_host", {"nqn": SUB_ONLY_A, "host": HOST_B}) is True
    ctrl_b = env.connect(SUB_ONLY_A, hostnqn=HOST_B)
    ctrl_a = env.connect(SUB_ONLY_A, hostnqn=HOST_A)
    assert [c["hostnqn"] for c in control.call("nvmf_subsystem_get_controllers", {"nqn": SUB_ONLY_A})] == \
        [HOST_B, HOST_A]
    control.call("nvmf_subsystem_remove_host", {"nqn": SUB_ONLY_A, "host": HOST_B})
    env.fabric.pump()
    with pytest.raises(Exception):
        ctrl_b.read(1, 0, 1)
    assert [c["hostnqn"] for c in control.call("nvmf_subsystem_get_controllers", {"nqn": SUB_ONLY_A})] == [HOST_A]
    assert ctrl_a.read(1, 0, 1) == bytes(512)  # the other host is untouched
    err = rpc_error(control, "nvmf_subsystem_remove_host", {"nqn": SUB_ONLY_A, "host": HOST_B})
    assert err.field == "host"
    err = rpc_error(control, "nvmf_subsystem_add_host", {"nqn": SUB_ONLY_A, "host": "nqn.not-an-nqn"})
    assert err.field == "host" and "NQN" in err.fix
    err = rpc_error(control, "nvmf_subsystem_add_host", {"nqn": SUB_ONLY_A, "host": HOST_B, "psk": "/x"})
    assert err.field == "psk"
    ctrl_a.close()


def test_allow_any_host(env, control):
    control.call("nvmf_subsystem_remove_host", {"nqn": SUB_ONLY_A, "host": HOST_A})
    with pytest.raises(NvmeStatusError):
        env.connect(SUB_ONLY_A, hostnqn=HOST_A)
    control.call("nvmf_subsystem_allow_any_host", {"nqn": SUB_ONLY_A, "allow_any_host": True})
    ctrl = env.connect(SUB_ONLY_A, hostnqn=HOST_B)
    control.call("nvmf_subsystem_allow_any_host", {"nqn": SUB_ONLY_A, "allow_any_host": False})
    env.fabric.pump()
    assert control.call("nvmf_subsystem_get_controllers", {"nqn": SUB_ONLY_A}) == []
    err = rpc_error(control, "nvmf_subsystem_allow_any_host", {"nqn": SUB_ONLY_A, "allow_any_host": "maybe"})
    assert err.field == "allow_any_host"
    control.call("nvmf_subsystem_add_host", {"nqn": SUB_ONLY_A, "host": HOST_A})
    # as SPDK: any host again, the allow-list kept for when allow_any_host is turned off
    assert control.call("nvmf_subsystem_allow_any_host", {"nqn": SUB_ONLY_A, "allow_any_host": "1"}) is True
    assert env.target.subsystems[SUB_ONLY_A].allowed_hosts == {HOST_A}
    ctrl.close()


# ------------------------------------------------------------------------------ subsystems, ports

def test_create_listen_and_delete_subsystem(env, control):
    assert control.call("nvmf_create_subsystem", {"nqn": NEW_SUB, "allow_any_host": True,
                                                  "serial_number": "SN123", "model_number": "M"}) is True
    control.call("nvmf_subsystem_add_ns", {"nqn": NEW_SUB, "namespace": {"nsid": 7, "backend": "null",
                                                                         "size": "1G"}})
    with pytest.raises(NvmeStatusError):  # not on any port yet
        env.connect(NEW_SUB)
    control.call("nvmf_subsystem_add_listener", {"nqn": NEW_SUB, "listen_address": {
        "trtype": "RDMA", "adrfam": "IPv4", "traddr": "10.99.0.1", "trsvcid": "4420"}})
    ctrl = env.connect(NEW_SUB)
    assert ctrl.id_ctrl.sn.strip() == "SN123" and ctrl.active_namespaces() == [7]
    info = control.call("nvmf_get_subsystems", {"nqn": NEW_SUB})[0]
    assert info["listen_addresses"] == [{"trtype": "RDMA", "adrfam": "IPV4", "traddr": "10.99.0.1",
                                         "trsvcid": "4420"}]
    qpairs = control.call("nvmf_subsystem_get_qpairs", {"nqn": NEW_SUB})
    assert [q["qid"] for q in qpairs] == [0, 1] and all(q["state"] == "active" for q in qpairs)
    control.call("nvmf_subsystem_remove_listener", {"nqn": NEW_SUB, "listen_address": {
        "trtype": "RDMA", "traddr": "10.99.0.1", "trsvcid": "4420"}})
    env.fabric.pump()
    assert control.call("nvmf_subsystem_get_controllers", {"nqn": NEW_SUB}) == []
    err = rpc_error(control, "nvmf_create_subsystem", {"nqn": NEW_SUB})
    assert err.field == "nqn" and "already exists" in err.message
    err = rpc_error(control, "nvmf_create_subsystem", {"nqn": "nqn.bad"})
    assert err.field == "nqn" and "NQN" in err.fix
    err = rpc_error(control, "nvmf_create_subsystem", {"nqn": "nqn.2024-01.io.test:x", "serial_number": "s" * 30})
    assert err.field == "serial_number"
    err = rpc_error(control, "nvmf_create_subsystem", {"nqn": "nqn.2024-01.io.test:x", "max_namespaces": 4})
    assert err.field == "max_namespaces"
    assert control.call("nvmf_delete_subsystem", {"nqn": NEW_SUB}) is True
    assert NEW_SUB not in env.target.subsystems
    err = rpc_error(control, "nvmf_delete_subsystem", {"nqn": NEW_SUB})
    assert err.field == "nqn"
    ctrl.close()


def test_delete_subsystem_ends_its_controllers(env, control):
    ctrl = env.connect(SUB_RAM)
    control.call("nvmf_delete_subsystem", {"nqn": SUB_RAM})
    env.fabric.pump()
    with pytest.raises(Exception):
        ctrl.read(1, 0, 1)
    assert all(SUB_RAM not in p.subsystems for p in env.target.config.ports)


def test_a_port_listens_only_while_it_exports_a_subsystem(env, control):
    """Port 2 exports SUB_RAM alone: once SUB_RAM is deleted nothing listens there, so a host's reconnect is
    refused by the transport (and retried), not answered by an NVMe Connect error with DNR; the subsystem made
    again and linked, the port listens again."""
    from nvmeof_roce.transport.contracts import TransportError
    ctrl = env.connect(SUB_RAM, address=ADDR2)
    control.call("nvmf_delete_subsystem", {"nqn": SUB_RAM})
    env.fabric.pump()
    with pytest.raises(TransportError, match="no listener"):
        env.connect(SUB_RAM, address=ADDR2)
    with pytest.raises(TransportError, match="no listener"):  # not even for discovery, as nvmet's disabled port
        env.connect("nqn.2014-08.org.nvmexpress.discovery", address=ADDR2)
    control.call("nvmf_create_subsystem", {"nqn": SUB_RAM, "allow_any_host": True})
    control.call("nvmf_subsystem_add_ns", {"nqn": SUB_RAM, "namespace": {"nsid": 1, "backend": "ram",
                                                                         "size": "1M"}})
    with pytest.raises(TransportError, match="no listener"):  # not linked to the port yet
        env.connect(SUB_RAM, address=ADDR2)
    control.call("nvmf_subsystem_add_listener", {"nqn": SUB_RAM, "listen_address": {
        "trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.2", "trsvcid": "4421"}})
    again = env.connect(SUB_RAM, address=ADDR2)
    assert again.active_namespaces() == [1]
    env.connect(SUB_ONLY_A).close()  # port 1 exported other subsystems all along: it kept listening
    again.close()
    ctrl.close()


def test_listener_on_a_new_address_opens_a_port(env, control):
    control.call("nvmf_subsystem_add_listener", {"nqn": SUB_ONLY_A, "listen_address": {
        "trtype": "rdma", "adrfam": "ipv4", "traddr": "10.99.0.3", "trsvcid": "4420"}})
    assert control.listeners.opened == [3]
    ctrl = env.connect(SUB_ONLY_A, address="10.99.0.3:4420")
    assert ctrl.active_namespaces() == [1]
    err = rpc_error(control, "nvmf_subsystem_add_listener", {"nqn": SUB_ONLY_A, "listen_address": {
        "trtype": "tcp", "traddr": "10.99.0.3", "trsvcid": "4420"}})
    assert err.field == "listen_address.trtype"
    err = rpc_error(control, "nvmf_subsystem_add_listener", {"nqn": SUB_ONLY_A, "listen_address": {
        "trtype": "rdma", "traddr": "not-an-ip", "trsvcid": "4420"}})
    assert err.field == "listen_address.traddr"
    err = rpc_error(control, "nvmf_subsystem_remove_listener", {"nqn": SUB_ONLY_A, "listen_address": {
        "trtype": "rdma", "traddr": "10.99.0.9", "trsvcid": "4420"}})
    assert err.field == "listen_address"
    ctrl.close()


def test_a_port_that_cannot_listen_leaves_the_target_unchanged(env):
    control = Control(env.target)  # no listeners: adding a port is refused
    before = snapshot(env.target)
    err = rpc_error(control, "nvmf_subsystem_add_listener", {"nqn": SUB_RAM, "listen_address": {
        "trtype": "rdma", "traddr": "10.99.0.4", "trsvcid": "4420"}})
    assert err.field.startswith("ports[") and "restart" in err.fix
    assert snapshot(env.target) == before and 3 not in env.target.port_ids()


# --------------------------------------------------------------------------------------- discovery

def test_discovery_log_change_event_for_a_persistent_discovery_controller(env, control):
    disc = env.connect(F.DISCOVERY_NQN, kato_ms=30000)
    disc.set_features(A.FEAT_ASYNC_EVENT, A.AEN_CFG_DISC_CHANGE)
    disc._submit_aer()
    quiet = env.connect(F.DISCOVERY_NQN, address=ADDR2, kato_ms=30000)  # did not ask for the event
    before = [e.subnqn for e in read_discovery_log(disc)]
    assert NEW_SUB not in before
    genctr = env.target.genctr
    control.call("nvmf_create_subsystem", {"nqn": NEW_SUB, "allow_any_host": True})
    control.call("nvmf_subsystem_add_listener", {"nqn": NEW_SUB, "listen_address": {
        "trtype": "rdma", "traddr": "10.99.0.1", "trsvcid": "4420"}})
    disc.poll_admin()
    assert disc.events == [(A.AER_TYPE_NOTICE, A.AER_NOTICE_DISC_CHANGED, A.LID_DISCOVERY)]
    assert env.target.genctr > genctr
    assert NEW_SUB in [e.subnqn for e in read_discovery_log(disc)]
    quiet.poll_admin()
    assert quiet.events == []
    # a change the discovery controller on port 2 cannot see does not wake the one on port 1 twice
    disc.close()
    quiet.close()


# ------------------------------------------------------------------------------------------- reload

def test_reload_applies_only_the_difference(env, control, tmp_path):
    ctrl = env.connect(SUB_RAM)
    data = env.target.config.to_dict()
    data["subsystems"][0]["namespaces"].append(ram_ns(9, "1M"))
    data["subsystems"][0]["namespaces"][1]["nvmeof_roce"]["size"] = "2M"
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    plan = control.call("nvmeof_reload_config", {"path": str(path), "dry_run": True})
    assert [(c["action"], c["nsid"]) for c in plan["changes"]] == [("resize-namespace", 2), ("add-namespace", 9)]
    assert sorted(env.target.subsystems[SUB_RAM].namespaces) == [1, 2]  # dry run: nothing applied
    ctrl.write(1, 0, b"z" * 512)
    result = control.call("nvmeof_reload_config", {"path": str(path)})
    assert result["applied"] and len(result["changes"]) == 2
    assert sorted(env.target.subsystems[SUB_RAM].namespaces) == [1, 2, 9]
    assert env.target.subsystems[SUB_RAM].namespaces[2].num_blocks == 4096
    assert ctrl.read(1, 0, 1) == b"z" * 512  # namespace 1 untouched, controller still connected
    ctrl.poll_admin()
    assert sorted(ctrl.changed_namespaces()) == [2, 9]
    again = control.call("nvmeof_reload_config", {"path": str(path), "dry_run": True})
    assert again["changes"] == []
    ctrl.close()


def test_reload_removing_a_namespace_under_a_sliced_write_zeroes_waits_for_it(env, control, tmp_path):
    """A reload drops namespace 1 while its Write Zeroes waits for its first slice (engine/work.py): the removal
    is committed once the command completed on the namespace as it was (the pause's drain, as nvmet_ns_disable
    waits for the I/O in flight), and the reload is answered then; no Internal Error from closed memory."""
    from loopback_env import RawQueue
    from nvmeof_roce.control.server import DeferredAnswer
    from nvmeof_roce.nvme import nvm
    ctrl = env.connect(SUB_RAM)
    data = env.target.config.to_dict()
    del data["subsystems"][0]["namespaces"][0]
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    q = RawQueue(ctrl.io_queues[0].transport)
    q.send(nvm.write_zeroes_command(0, 1, 0, 7).pack())
    env.fabric.pump(max_ops=1)  # the job is queued; the loop has not served the eventfd yet
    assert env.target.work.pending == 1
    answer = control.call("nvmeof_reload_config", {"path": str(path)})
    assert isinstance(answer, DeferredAnswer) and answer.part is None
    assert 1 in env.target.subsystem(SUB_RAM).namespaces  # not while its command runs
    assert q.poll_one().status == 0
    assert answer.part["result"]["applied"] and 1 not in env.target.subsystem(SUB_RAM).namespaces
    assert q.exchange(nvm.read_command(0, 1, 0, 0, q.keyed(512)).pack()).status == S.INVALID_NS | S.DNR
    assert env.target.internal_errors == 0
    ctrl.close()


def test_reload_refuses_an_invalid_edit_and_changes_nothing(env, control, tmp_path):
    before = snapshot(env.target)
    data = env.target.config.to_dict()
    data["subsystems"][0]["namespaces"].append(ram_ns(9, "1M"))  # valid
    data["subsystems"][1]["namespaces"][0]["nvmeof_roce"]["size"] = "3K"  # not a multiple of 4096
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    err = rpc_error(control, "nvmeof_reload_config", {"path": str(path)})
    assert err.field == "subsystems[1].namespaces[0].nvmeof_roce.size"
    data["subsystems"][1]["namespaces"][0]["nvmeof_roce"]["size"] = "4M"
    data["subsystems"][0]["attr"]["serial"] = "changed"
    path.write_text(json.dumps(data))
    err = rpc_error(control, "nvmeof_reload_config", {"path": str(path)})
    assert err.field == "subsystems[0].attr.serial" and "restart" in err.fix
    data["subsystems"][0]["attr"]["serial"] = env.target.config.subsystems[0].serial
    data["ports"][0]["param"] = {"inline_data_size": "8192"}
    path.write_text(json.dumps(data))
    err = rpc_error(control, "nvmeof_reload_config", {"path": str(path)})
    assert err.field == "ports[0]"
    path.write_text("{not json")
    err = rpc_error(control, "nvmeof_reload_config", {"path": str(path)})
    assert "JSON" in err.message
    assert snapshot(env.target) == before
    assert sorted(env.target.subsystems[SUB_RAM].namespaces) == [1, 2]


def test_a_failing_backend_undoes_the_prepared_changes(env, control, tmp_path):
    data = env.target.config.to_dict()
    data["subsystems"][0]["namespaces"].append(ram_ns(9, "1M"))
    data["subsystems"][0]["namespaces"].append({"nsid": 10, "device": {"path": str(tmp_path / "none.img")}})
    data["subsystems"][0]["namespaces"][1]["nvmeof_roce"]["size"] = "2M"
    path = tmp_path / "partly.json"
    path.write_text(json.dumps(data))
    err = rpc_error(control, "nvmeof_reload_config", {"path": str(path)})
    assert "no such file" in err.message
    sub = env.target.subsystems[SUB_RAM]
    assert sorted(sub.namespaces) == [1, 2] and sub.namespaces[2].num_blocks == 2048


# --------------------------------------------------------------------------------- stats and status

def test_stats_status_and_save_config(env, control, tmp_path):
    ctrl = env.connect(SUB_RAM, num_io_queues=2)
    for i in range(8):
        ctrl.write(1, i, b"s" * 512)
        ctrl.read(1, i, 1)
    stats = control.call("nvmf_get_stats")
    assert stats["poll_groups"][0]["current_io_qpairs"] == 2
    ns1 = next(n for n in stats["namespaces"] if n["nqn"] == SUB_RAM and n["nsid"] == 1)
    assert ns1["read_commands"] == 8 and ns1["write_commands"] == 8 and ns1["bytes_written"] == 4096
    assert ns1["read_latency_us"]["p50"] > 0 and ns1["write_latency_us"]["p99"] >= ns1["write_latency_us"]["p50"]
    status = control.call("nvmeof_get_status")
    host = next(h for h in status["hosts"] if h["hostnqn"] == HOST_A)
    assert host["controllers"][0]["io_queues"] == [1, 2]
    sub = next(s for s in status["subsystems"] if s["nqn"] == SUB_RAM)
    assert [q["qid"] for q in sub["controllers"][0]["queues"]] == [0, 1, 2]
    saved = control.call("save_config", {"path": str(tmp_path / "saved.json")})
    assert json.loads((tmp_path / "saved.json").read_text()) == saved
    assert parse_config(saved, "saved").subsystem(SUB_RAM).namespace(2).size_bytes == 1 << 20
    err = rpc_error(control, "save_config", {"path": "relative.json"})
    assert err.field == "path"
    ctrl.close()


def test_rates_come_from_samples(env, control):
    clock = [100.0]
    control.sampler.clock = lambda: clock[0]
    ctrl = env.connect(SUB_RAM)
    control.sampler.tick()
    for i in range(20):
        ctrl.read(1, i, 1)
    clock[0] += 2.0
    ns = env.target.subsystems[SUB_RAM].namespaces[1]
    rates = control.sampler.rates(SUB_RAM, ns)
    assert rates["read_iops"] == 10.0 and rates["read_bytes_per_s"] == 5120
    ctrl.close()


def test_unknown_method_and_bad_requests(control):
    def handle(request):  # what the server does with each request: the one dispatch, Control.call
        return handle_request(control.call, request)

    assert handle({"jsonrpc": "2.0", "method": "nope", "id": 4})["error"]["code"] == METHOD_NOT_FOUND
    bad = handle({"method": "nvmf_get_stats", "id": 5})
    assert bad["error"]["code"] == -32600 and bad["id"] == 5
    err = handle({"jsonrpc": "2.0", "method": "nvmf_get_subsystems", "params": [1], "id": 6})["error"]
    assert err["code"] == INVALID_PARAMS and err["data"]["field"] == "params"
    err = handle({"jsonrpc": "2.0", "method": "nvmf_get_subsystems", "params": {"tgt_name": "t"}, "id": 7})
    assert err["error"]["data"]["field"] == "tgt_name"
    assert handle({"jsonrpc": "2.0", "method": "nvmf_get_stats"}) is None  # a notification
    assert "nvmf_subsystem_resize_ns" in control.call("rpc_get_methods")


# ------------------------------------------------------------------------------------------ the socket

def _serve_while(env, fn):
    """Run fn() (a blocking client) in a thread while this thread runs the fabric's loop."""
    out = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: B902 - handed back to the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    while t.is_alive():
        env.fabric.run_watched(0.05)
        env.fabric.pump()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


def test_socket_round_trip_mode_and_single_owner(env, tmp_path):
    path = str(tmp_path / "t.sock")
    control = Control(env.target)
    server = RpcServer(control, path, env.fabric)
    try:
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        subs = _serve_while(env, lambda: call(path, "nvmf_get_subsystems", {"nqn": SUB_RAM}))
        assert subs[0]["nqn"] == SUB_RAM
        with pytest.raises(RpcError) as exc:
            _serve_while(env, lambda: call(path, "nvmf_subsystem_remove_ns", {"nqn": SUB_RAM, "nsid": 77}))
        assert exc.value.field == "nsid"
        with pytest.raises(NvmeofError) as exc:  # a live server holds the socket
            RpcServer(Control(env.target), path, env.fabric)
        assert "another target" in str(exc.value)

        def split_request():  # a request arriving in pieces, then garbage
            s = socket.socket(socket.AF_UNIX)
            s.connect(path)
            s.sendall(b'{"jsonrpc": "2.0", "method": "rpc_get_')
            s.sendall(b'methods", "id": 3}')
            first = s.makefile().readline()
            s.sendall(b"}{")
            second = s.makefile().readline()
            s.close()
            return json.loads(first), json.loads(second)

        first, second = _serve_while(env, split_request)
        assert first["id"] == 3 and "save_config" in first["result"]
        assert second["error"]["code"] == -32700
    finally:
        server.close()
    assert not os.path.exists(path)


def test_stale_socket_is_replaced(env, tmp_path):
    path = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()  # bound but nobody listens: stale
    server = RpcServer(Control(env.target), path, env.fabric)
    try:
        assert _serve_while(env, lambda: call(path, "nvmf_get_stats"))["poll_groups"]
    finally:
        server.close()


def test_plan_lists_port_and_host_changes():
    base = standard_config()
    old = parse_config(base, "old")
    new_data = json.loads(json.dumps(old.to_dict()))
    new_data["ports"][1]["subsystems"].append(SUB_ONLY_A)
    new_data["ports"].append(port(3, "10.99.0.3:4420", [SUB_RAM]))
    new_data["subsystems"][3]["allowed_hosts"].append(HOST_B)
    changes = live.plan(old, parse_config(new_data, "new"))
    assert [(c.action, c.portid if c.portid >= 0 else c.host) for c in changes] == [
        ("add-host", HOST_B), ("link", 2), ("add-port", 3)]


# ------------------------------------------------------------------------------------------ the CLI

def test_cli_verbs_over_the_socket(env, tmp_path, capsys):
    from nvmeof_roce.cli import main
    path = str(tmp_path / "cli.sock")
    server = RpcServer(Control(env.target), path, env.fabric)

    def run(*argv):
        code = _serve_while(env, lambda: main(list(argv)))
        out = capsys.readouterr()
        return code, out.out, out.err

    try:
        code, out, _ = run("target", "add-ns", SUB_RAM, "--ram", "2M", "--nsid", "5", "--socket", path, "--json")
        assert code == 0 and json.loads(out) == {"nqn": SUB_RAM, "nsid": 5}
        code, out, _ = run("target", "resize-ns", SUB_RAM, "5", "4M", "--socket", path)
        assert code == 0 and "8192 blocks" in out
        code, out, _ = run("rpc", "nvmf_get_subsystems", "--param", f"nqn={SUB_RAM}", "--socket", path)
        assert [n["nsid"] for n in json.loads(out)[0]["namespaces"]] == [1, 2, 5]
        code, out, _ = run("rpc", "nvmf_subsystem_add_ns", json.dumps({"nqn": SUB_RAM}),
                           "--param", "namespace.backend=null", "--param", "namespace.size=1M", "--socket", path)
        assert code == 0 and json.loads(out) == 3
        code, out, _ = run("target", "rm-ns", SUB_RAM, "5", "--socket", path)
        assert code == 0 and "removed" in out
        code, out, err = run("target", "rm-ns", SUB_RAM, "5", "--socket", path)
        assert code == 1 and "(nsid)" in err and "fix:" in err
        code, out, _ = run("target", "add-host", SUB_ONLY_A, HOST_B, "--socket", path)
        assert code == 0 and sorted(env.target.subsystems[SUB_ONLY_A].allowed_hosts) == sorted([HOST_A, HOST_B])
        code, out, _ = run("target", "rm-host", SUB_ONLY_A, HOST_B, "--socket", path)
        assert code == 0 and env.target.subsystems[SUB_ONLY_A].allowed_hosts == {HOST_A}
        edited = env.target.config.to_dict()
        edited["subsystems"][0]["namespaces"] = edited["subsystems"][0]["namespaces"][:1]
        (tmp_path / "edit.json").write_text(json.dumps(edited))
        code, out, _ = run("target", "reload", "--dry-run", str(tmp_path / "edit.json"), "--socket", path)
        assert code == 0 and "would apply 2 change(s)" in out and "remove namespace 2" in out
        assert sorted(env.target.subsystems[SUB_RAM].namespaces) == [1, 2, 3]
        ctrl = env.connect(SUB_RAM)
        code, out, _ = run("target", "status", "--socket", path)
        assert code == 0 and HOST_A in out and "longest loop pass" in out
        code, out, _ = run("target", "status", "--json", "--socket", path)
        assert json.loads(out)["hosts"][0]["hostnqn"] == HOST_A
        ctrl.close()
    finally:
        server.close()


def test_initiator_block_count_is_zero_based_like_nvme_cli(env, monkeypatch, capsys):
    from nvmeof_roce.cli import main
    from nvmeof_roce.initiator import commands as icmd
    monkeypatch.setattr(icmd, "_connector", lambda args: env.connector(f"{args.traddr}:{args.trsvcid}"))
    base = ["initiator"]
    common = ["-a", "10.99.0.1", "-n", SUB_RAM, "-q", HOST_A]
    assert main(base + ["write", *common, "--nsid", "1", "--slba", "4", "--pattern", "0x5a", "-c", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes"] == 4 * 512
    assert main(base + ["read", *common, "--nsid", "1", "--slba", "4", "--block-count", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["blocks"] == 4 and bytes.fromhex(got["hex"]) == b"\x5a" * 2048
    assert main(base + ["read", *common, "--slba", "4", "--blocks", "2", "-c", "1"]) == 1
    assert "not both" in capsys.readouterr().err


def test_query_methods_errors(control):
    assert rpc_error(control, "nvmf_get_subsystems", {"nqn": NEW_SUB}).field == "nqn"
    assert [s["nqn"] for s in control.call("nvmf_get_subsystems")][:2] == [F.DISCOVERY_NQN, SUB_RAM]
    err = rpc_error(control, "nvmf_subsystem_get_controllers", {})
    assert err.field == "nqn" and "missing" in err.message
    assert rpc_error(control, "nvmf_subsystem_get_qpairs", {"nqn": NEW_SUB}).field == "nqn"
    assert control.call("nvmf_subsystem_get_qpairs", {"nqn": F.DISCOVERY_NQN}) == []
    assert rpc_error(control, "nvmf_get_stats", {"verbose": True}).field == "verbose"
    assert rpc_error(control, "nvmeof_get_status", {"x": 1}).field == "x"
    err = rpc_error(control, "nvmeof_reload_config", {"path": "/nonexistent/t.json"})
    assert "no such file" in err.message and err.fix
    assert rpc_error(control, "nvmf_subsystem_resize_ns", {"nqn": SUB_RAM, "nsid": 1}).field == "size"
    assert rpc_error(control, "nvmf_subsystem_allow_any_host", {"nqn": SUB_RAM}).field == "allow_any_host"


def test_cli_verbs_for_subsystems_listeners_visibility_qos_and_ana(env, tmp_path, capsys):
    from nvmeof_roce.cli import main
    path = str(tmp_path / "cli.sock")
    server = RpcServer(Control(env.target, LoopListeners(env)), path, env.fabric)

    def run(*argv):
        code = _serve_while(env, lambda: main(list(argv) + ["--socket", path]))
        out = capsys.readouterr()
        return code, out.out, out.err

    try:
        code, out, _ = run("target", "create-subsystem", NEW_SUB, "--allow-any-host", "--serial", "S1", "--json")
        assert code == 0 and json.loads(out) == {"ok": True}
        assert env.target.subsystems[NEW_SUB].serial == "S1" and env.target.subsystems[NEW_SUB].allow_any_host
        code, out, _ = run("target", "add-listener", NEW_SUB, "10.99.0.1", "--trsvcid", "4420")
        assert code == 0 and "listening on 10.99.0.1:4420" in out
        assert NEW_SUB in env.target.config.port(1).subsystems
        code, out, _ = run("target", "add-ns", NEW_SUB, "--ram", "1M", "--no-auto-visible", "--json")
        assert code == 0 and json.loads(out)["nsid"] == 1
        ctrl = env.connect(NEW_SUB, hostnqn=HOST_B)
        assert ctrl.active_namespaces() == []
        code, out, _ = run("target", "ns-add-host", NEW_SUB, "1", HOST_B)
        assert code == 0 and "now visible" in out
        assert ctrl.active_namespaces() == [1]
        code, out, _ = run("target", "set-qos", NEW_SUB, "1", "--rw-ios-per-sec", "500", "--json")
        assert code == 0 and env.target.subsystems[NEW_SUB].namespaces[1].qos.limits == {"rw_ios_per_sec": 500}
        code, out, err = run("target", "set-qos", NEW_SUB, "1")
        assert code == 1 and "no limit given" in err and "fix:" in err
        code, out, _ = run("target", "listener-ana-state", NEW_SUB, "10.99.0.1", "inaccessible")
        assert code == 0 and env.target.ana.state(1, 1) == "inaccessible"
        code, out, _ = run("target", "listener-ana-state", NEW_SUB, "10.99.0.1", "optimized", "--group", "1")
        assert code == 0 and env.target.ana.state(1, 1) == "optimized"
        code, out, _ = run("target", "ns-rm-host", NEW_SUB, "1", HOST_B)
        assert code == 0 and ctrl.active_namespaces() == []
        code, out, err = run("target", "ns-rm-host", NEW_SUB, "1", HOST_B)
        assert code == 1 and "(host)" in err
        ctrl.close()
        code, out, _ = run("target", "rm-listener", NEW_SUB, "10.99.0.1")
        assert code == 0 and NEW_SUB not in env.target.config.port(1).subsystems
        code, out, _ = run("target", "delete-subsystem", NEW_SUB)
        assert code == 0 and NEW_SUB not in env.target.subsystems
        code, out, err = run("target", "delete-subsystem", NEW_SUB)
        assert code == 1 and "(nqn)" in err
    finally:
        server.close()
