"""`serve --workers`: the per-worker configs (ports, CNTLID ranges, shared RAM), discovery of every path,
and run-time ANA changes through the run directory, over the loopback fabric."""
import os
import threading

import pytest

from loopback_env import ADDR1, HOST_A, Env, port, ram_ns
from nvmeof_roce.config import parse_config
from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.initiator.discovery import discover
from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.status import NvmeStatusError
from nvmeof_roce.target import ana_control, workers
from nvmeof_roce.target.ana_control import AnaControl, change_state, current_states, publish
from nvmeof_roce.target.workers import split_cntlid_range, worker_configs

SUB = "nqn.2024-01.io.test:mp"


def mp_config(**attr) -> dict:
    return {"hosts": [], "ports": [port(1, ADDR1, [SUB])],
            "subsystems": [{"nqn": SUB, "attr": dict(attr),
                            "namespaces": [ram_ns(1, "1M", device={"nguid": "00112233445566778899aabbccddeeff"})]}]}


def test_split_cntlid_range_is_disjoint_and_covers_it():
    assert split_cntlid_range(1, 0xFFEF, 2) == [(1, 0x7FF8), (0x7FF9, 0xFFEF)]
    ranges = split_cntlid_range(10, 20, 3)
    assert ranges == [(10, 13), (14, 17), (18, 20)]
    with pytest.raises(ValueError, match="cannot be split over 4 workers"):
        split_cntlid_range(1, 3, 4)


def test_worker_configs_ports_ranges_and_shared_ram(tmp_path, monkeypatch):
    monkeypatch.setattr(workers, "SHM_DIR", str(tmp_path))
    cfg = parse_config(mp_config(cntlid_min="100", cntlid_max="199"), "mp.json")
    configs, listen, groups = worker_configs(cfg, 2, str(tmp_path / "run"))
    assert listen == {0: [1], 1: [2]} and groups == [[1, 2]]
    parsed = [parse_config(c, f"w{i}") for i, c in enumerate(configs)]
    for p in parsed:  # every worker knows both paths: 4420 and 4421
        assert [(x.portid, x.trsvcid) for x in p.ports] == [(1, 4420), (2, 4421)]
    subs = [p.subsystems[0] for p in parsed]
    assert [(s.cntlid_min, s.cntlid_max) for s in subs] == [(100, 149), (150, 199)]
    # the same identity on every worker
    assert len({(s.nqn, s.serial, s.namespaces[0].uuid, s.namespaces[0].nguid) for s in subs}) == 1
    ns = subs[0].namespaces[0]
    assert ns.backend == "file" and ns.path == subs[1].namespaces[0].path
    assert ns.path.startswith(str(tmp_path))


def _worker_env(tmp_path, monkeypatch, n=2):
    """The targets of n workers, each on its own loopback fabric address, sharing the RAM namespace file."""
    monkeypatch.setattr(workers, "SHM_DIR", str(tmp_path))
    cfg = parse_config(mp_config(), "mp.json")
    configs, listen, groups = worker_configs(cfg, n, str(tmp_path / "run"))
    workers._create_shm(cfg, str(tmp_path / "run"))
    envs = []
    for i, c in enumerate(configs):
        env = Env(c, file_lock="shared")  # the workers of one target share the namespace file
        for group in groups:
            for portid in group:
                env.target.discovery_siblings[portid] = group
        envs.append(env)
    return envs


def test_workers_share_data_and_hand_out_disjoint_cntlids(tmp_path, monkeypatch):
    w0, w1 = _worker_env(tmp_path, monkeypatch)
    a = w0.connect(SUB, "10.99.0.1:4420")
    b = w1.connect(SUB, "10.99.0.1:4421")
    assert a.cntlid <= 0x7FF8 < b.cntlid
    assert a.identify_namespace(1).nguid == b.identify_namespace(1).nguid
    a.write(1, 5, b"x" * 512, fua=True)
    assert b.read(1, 5, 1) == b"x" * 512  # written through one worker, read through the other
    b.write_zeroes(1, 5, 1)
    b.flush(1)
    assert a.read(1, 5, 1) == bytes(512)
    a.close()
    b.close()
    w0.close()
    w1.close()


def test_discovery_of_any_worker_lists_every_path(tmp_path, monkeypatch):
    w0, w1 = _worker_env(tmp_path, monkeypatch)
    for env, addr in ((w0, "10.99.0.1:4420"), (w1, "10.99.0.1:4421")):
        entries = discover(env.connector(addr), hostnqn=HOST_A)
        assert sorted((e.portid, e.trsvcid, e.subnqn) for e in entries) == [(1, "4420", SUB), (2, "4421", SUB)]
    w0.close()
    w1.close()


def test_run_time_ana_change_through_the_run_dir(tmp_path):
    env = Env({"ports": [port(1, ADDR1, [SUB])], "subsystems": [{"nqn": SUB, "namespaces": [ram_ns(1)]}]})
    run_dir = str(tmp_path / "run")
    publish(run_dir, env.target.ana, workers=1)
    control = AnaControl(run_dir, env.target)
    try:
        control.poll()  # the start: applies the file as published
        ctrl = env.connect(SUB)
        assert current_states(run_dir) == {1: {1: "optimized"}}
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("n", change_state(run_dir, 1, 1, "inaccessible")))
        t.start()
        while t.is_alive():  # the signal handler runs in this (the main) thread; the loop applies it
            control.poll()
            t.join(0.01)
        assert result == {"n": 1}
        ctrl.poll_admin()
        assert ctrl.events == [(A.AER_TYPE_NOTICE, A.AER_NOTICE_ANA, A.LID_ANA)]
        assert ctrl.ana_log().groups[0].state_name == "inaccessible"
        with pytest.raises(NvmeStatusError) as exc:
            ctrl.read(1, 0, 1)
        assert exc.value.status == S.ANA_INACCESSIBLE
        assert current_states(run_dir) == {1: {1: "inaccessible"}}
        with pytest.raises(NvmeofError, match="port 9 is not a port"):
            change_state(run_dir, 9, 1, "optimized")
        with pytest.raises(NvmeofError, match="ANA group 4 does not exist"):
            change_state(run_dir, 1, 4, "optimized")
        with pytest.raises(NvmeofError, match="unknown ANA state"):
            change_state(run_dir, 1, 1, "fast")
        ctrl.close()
    finally:
        control.close()
        ana_control.unpublish(run_dir)
        env.close()


def test_a_second_target_on_the_same_run_dir_is_refused(tmp_path):
    env = Env({"ports": [port(1, ADDR1, [SUB])], "subsystems": [{"nqn": SUB, "namespaces": [ram_ns(1)]}]})
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "target.pid"), "w") as f:
        f.write(f"{os.getppid()}\n")  # a live process that is not us
    with pytest.raises(NvmeofError, match="another target"):
        publish(run_dir, env.target.ana, workers=1)
    env.close()


def test_the_supervisor_creates_a_file_namespace_once(tmp_path, monkeypatch):
    monkeypatch.setattr(workers, "SHM_DIR", str(tmp_path))
    image = tmp_path / "disk.img"
    cfg = parse_config({"ports": [port(1, ADDR1, [SUB])], "subsystems": [{"nqn": SUB, "namespaces": [
        {"nsid": 1, "device": {"path": str(image)}, "nvmeof_roce": {"backend": "file", "size": "1M"}},
        ram_ns(2, "2M")]}]}, "mp.json")
    shm = workers._create_shm(cfg, str(tmp_path / "run"))
    assert image.stat().st_size == 1 << 20
    assert len(shm) == 1 and os.path.getsize(shm[0]) == 2 << 20
