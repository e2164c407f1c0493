"""`serve --workers`: the per-worker configs (ports, CNTLID ranges, shared RAM), discovery of every path,
the supervisor's control socket, and run-time ANA changes through it (`target ana-state`), over the loopback
fabric."""
import json
import os
import select
import threading

import pytest

from loopback_env import ADDR1, HOST_A, HOST_B, Env, port, ram_ns
from test_target_control import _serve_while
from nvmeof_roce.config import parse_config
from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.initiator.discovery import discover
from nvmeof_roce.nvme import admin as A
from nvmeof_roce.nvme import auth as nvme_auth
from nvmeof_roce.nvme import status as S
from nvmeof_roce.nvme.status import NvmeStatusError
from nvmeof_roce.service import run_dir as run_directory
from nvmeof_roce.service import worker_configs as wc
from nvmeof_roce.service import workers
from nvmeof_roce.control.ana_states import ana_states, change_ana_state
from nvmeof_roce.control.client import call
from nvmeof_roce.control.fanout import ControlSocket
from nvmeof_roce.control.methods import Control
from nvmeof_roce.control.protocol import RpcError
from nvmeof_roce.control.server import RpcServer, bind_unix_socket
from nvmeof_roce.service.worker_configs import split_cntlid_range, worker_configs

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
    monkeypatch.setattr(wc, "SHM_DIR", str(tmp_path))
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
    monkeypatch.setattr(wc, "SHM_DIR", str(tmp_path))
    cfg = parse_config(mp_config(), "mp.json")
    configs, listen, groups = worker_configs(cfg, n, str(tmp_path / "run"))
    wc.create_shared_files(cfg, str(tmp_path / "run"))
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


def test_run_time_ana_change_through_the_control_socket(tmp_path):
    env = Env({"ports": [port(1, ADDR1, [SUB])], "subsystems": [{"nqn": SUB, "namespaces": [ram_ns(1)]}]})
    path = str(tmp_path / "t.sock")
    server = RpcServer(Control(env.target), path, env.fabric)
    try:
        ctrl = env.connect(SUB)
        assert _serve_while(env, lambda: ana_states(path)) == [{"portid": 1, "grpid": 1, "state": "optimized"}]
        assert _serve_while(env, lambda: change_ana_state(path, 1, 1, "inaccessible")) == 1
        ctrl.poll_admin()
        assert ctrl.events == [(A.AER_TYPE_NOTICE, A.AER_NOTICE_ANA, A.LID_ANA)]
        assert ctrl.ana_log().groups[0].state_name == "inaccessible"
        with pytest.raises(NvmeStatusError) as exc:
            ctrl.read(1, 0, 1)
        assert exc.value.status == S.ANA_INACCESSIBLE
        assert _serve_while(env, lambda: ana_states(path)) == [{"portid": 1, "grpid": 1, "state": "inaccessible"}]
        with pytest.raises(NvmeofError, match="port 9 is not a port"):
            _serve_while(env, lambda: change_ana_state(path, 9, 1, "optimized"))
        with pytest.raises(NvmeofError, match="ANA group 4 does not exist"):
            _serve_while(env, lambda: change_ana_state(path, 1, 4, "optimized"))
        with pytest.raises(NvmeofError, match="unknown ANA state"):
            _serve_while(env, lambda: change_ana_state(path, 1, 1, "fast"))
        assert env.target.ana.state(1, 1) == "inaccessible"  # the refused changes changed nothing
        ctrl.close()
    finally:
        server.close()
        env.close()


def test_target_ana_state_command_shows_and_changes_states(tmp_path, capsys):
    from nvmeof_roce.cli import main
    env = Env({"ports": [port(1, ADDR1, [SUB])], "subsystems": [{"nqn": SUB, "namespaces": [ram_ns(1)]}]})
    path = str(tmp_path / "t.sock")
    server = RpcServer(Control(env.target), path, env.fabric)

    def run(*argv):
        code = _serve_while(env, lambda: main(["target", "ana-state", "--socket", path] + list(argv)))
        out = capsys.readouterr()
        return code, out.out, out.err

    try:
        code, out, _ = run("--port", "1", "--group", "1", "non-optimized")
        assert code == 0 and out == "port 1 group 1: non-optimized (applied by 1 worker(s))\n"
        code, out, _ = run("--json")
        assert code == 0 and json.loads(out) == [{"portid": 1, "grpid": 1, "state": "non-optimized"}]
        code, out, _ = run()
        assert code == 0 and "non-optimized" in out and "PORT" in out
        code, out, err = run("--port", "3", "optimized")
        assert code == 1 and "port 3 is not a port of the running target" in err and "fix:" in err
        code, out, err = run("--port", "1")
        assert code == 1 and "give both --port and STATE" in err
    finally:
        server.close()
        env.close()


def test_a_second_target_on_the_same_run_dir_is_refused(tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "target.pid"), "w") as f:
        f.write(f"{os.getppid()}\n")  # a live process that is not us
    with pytest.raises(NvmeofError, match="another target"):
        run_directory.claim(run_dir)


def test_the_supervisor_creates_a_file_namespace_once(tmp_path, monkeypatch):
    monkeypatch.setattr(wc, "SHM_DIR", str(tmp_path))
    image = tmp_path / "disk.img"
    cfg = parse_config({"ports": [port(1, ADDR1, [SUB])], "subsystems": [{"nqn": SUB, "namespaces": [
        {"nsid": 1, "device": {"path": str(image)}, "nvmeof_roce": {"backend": "file", "size": "1M"}},
        ram_ns(2, "2M")]}]}, "mp.json")
    shm = wc.create_shared_files(cfg, str(tmp_path / "run"))
    assert image.stat().st_size == 1 << 20
    assert len(shm) == 1 and os.path.getsize(shm[0]) == 2 << 20


# ----------------------------------------------------------------------- the supervisor's control socket

class _Workers:
    """A Supervisor (not started: no processes) whose n workers are loopback targets, each with its own
    control socket as `serve --worker-index I --rpc-socket RUN_DIR/worker-I.sock` has."""

    def __init__(self, tmp_path, monkeypatch, config: dict, n: int = 2):
        monkeypatch.setattr(wc, "SHM_DIR", str(tmp_path))
        self.config_path = tmp_path / "mp.json"
        self.config_path.write_text(json.dumps(config))
        self.sup = workers.Supervisor(str(self.config_path), n, cpus=None, run_dir=str(tmp_path / "run"),
                                      ready_file=None, worker_args=[], rpc_socket=str(tmp_path / "sup.sock"))
        self.sup.shm_files = wc.create_shared_files(self.sup.config, self.sup.run_dir)
        self.envs, self.ops = [], []
        self.control = None
        for i in range(n):
            env = Env(json.loads(open(self.sup.paths[i]).read()), file_lock="shared")
            self.envs.append(env)
            self.ops.append(env.operations(self.sup.paths[i], rpc_socket=self.sup.sockets[i]))

    def run(self, fn):
        """fn() (blocking calls to the workers' sockets) in a thread while this thread serves every worker."""
        out = {}

        def go():
            try:
                out["result"] = fn()
            except BaseException as exc:  # noqa: B902 - handed back to the test
                out["error"] = exc

        t = threading.Thread(target=go)
        t.start()
        while t.is_alive():
            if self.control is not None and select.select([self.control.sock], [], [], 0)[0]:
                threading.Thread(target=self.control.serve_one).start()  # it waits for the workers' answers
            for env in self.envs:
                env.fabric.run_watched(0.01)
                env.fabric.pump()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["result"]

    def call(self, method, params=None):
        return self.run(lambda: self.sup.control.call(method, params))

    def serve_control(self) -> str:
        """The supervisor's own control socket, answered while `run` runs; its path."""
        self.control = ControlSocket(bind_unix_socket(self.sup.rpc_socket), self.sup.control.call)
        return self.sup.rpc_socket

    def close(self):
        if self.control is not None:
            self.control.sock.close()
        for ops in self.ops:
            ops.close()
        for env in self.envs:
            env.close()


@pytest.fixture
def two_workers(tmp_path, monkeypatch):
    w = _Workers(tmp_path, monkeypatch, mp_config())
    yield w
    w.close()


def test_supervisor_control_changes_every_worker_and_keeps_it_for_a_restart(two_workers):
    w = two_workers
    assert w.call("nvmf_subsystem_add_ns", {"nqn": SUB, "namespace": {"nsid": 7, "backend": "null",
                                                                       "size": "1M"}}) == 7
    for env in w.envs:
        assert sorted(env.target.subsystems[SUB].namespaces) == [1, 7]
    for path in w.sup.paths:  # a worker restarted now starts with the namespace
        assert 7 in [ns["nsid"] for ns in json.loads(open(path).read())["subsystems"][0]["namespaces"]]
    with pytest.raises(RpcError) as exc:  # a refusal on worker 0 changes nothing anywhere
        w.call("nvmf_subsystem_remove_ns", {"nqn": SUB, "nsid": 99})
    assert exc.value.field == "nsid"
    for method, params, field in (
            ("nvmf_subsystem_add_ns", {"nqn": SUB, "namespace": {"backend": "ram", "size": "1M"}}, "namespace.backend"),
            ("nvmf_subsystem_add_listener", {"nqn": SUB, "listen_address": {}}, "method"),
            ("save_config", None, "method")):
        with pytest.raises(RpcError) as exc:
            w.call(method, params)
        assert exc.value.field == field and exc.value.fix, method
    for env in w.envs:
        assert sorted(env.target.subsystems[SUB].namespaces) == [1, 7]


def test_supervisor_control_answers_from_every_worker(two_workers):
    w = two_workers
    a = w.envs[0].connect(SUB, "10.99.0.1:4420")
    b = w.envs[1].connect(SUB, "10.99.0.1:4421", hostnqn=HOST_B)
    a.write(1, 0, b"a" * 512)
    b.write(1, 1, b"b" * 1024)
    ctrls = w.call("nvmf_subsystem_get_controllers", {"nqn": SUB})
    assert sorted((c["worker"], c["hostnqn"]) for c in ctrls) == [(0, HOST_A), (1, HOST_B)]
    status = w.call("nvmeof_get_status")
    sub = status["subsystems"][0]
    assert sorted(c["worker"] for c in sub["controllers"]) == [0, 1]
    assert sub["namespaces"][0]["write_commands"] == 2 and sub["namespaces"][0]["bytes_written"] == 1536
    assert sorted(h["hostnqn"] for h in status["hosts"]) == [HOST_A, HOST_B]
    assert [x["socket"] for x in status["workers"]] == w.sup.sockets
    assert (status["config"], status["socket"]) == (str(w.config_path), w.sup.rpc_socket)  # the supervisor's
    stats = w.call("nvmf_get_stats")
    assert len(stats["poll_groups"]) == 2 and stats["namespaces"][0]["write_commands"] == 2
    text = w.call("nvmeof_get_metrics")
    for worker in ("0", "1"):
        assert f'nvmeof_roce_namespace_writes_total{{nsid="1",subnqn="{SUB}",worker="{worker}"}} 1.0' in text
        assert f'process_cpu_seconds_total{{worker="{worker}"}}' in text
    assert 'process_cpu_seconds_total{worker="supervisor"}' in text
    assert text.count("# TYPE process_cpu_seconds_total counter") == 1  # one family, every process in it
    assert 'nvmeof_roce_build_info{python=' in text
    a.close()
    b.close()


def test_ana_state_through_the_supervisor_changes_every_worker(two_workers):
    """`target ana-state` against `serve --workers`: the supervisor makes the change on every worker."""
    w = two_workers
    path = w.serve_control()
    a = w.envs[0].connect(SUB, "10.99.0.1:4420")
    b = w.envs[1].connect(SUB, "10.99.0.1:4421")
    assert w.run(lambda: ana_states(path)) == [{"portid": 1, "grpid": 1, "state": "optimized"},
                                               {"portid": 2, "grpid": 1, "state": "optimized"}]
    assert w.run(lambda: change_ana_state(path, 2, 1, "inaccessible")) == 2
    for env in w.envs:  # every worker changed
        assert env.target.ana.states() == {1: {1: "optimized"}, 2: {1: "inaccessible"}}
    b.poll_admin()
    assert b.events == [(A.AER_TYPE_NOTICE, A.AER_NOTICE_ANA, A.LID_ANA)]
    with pytest.raises(NvmeStatusError) as exc:
        b.read(1, 0, 1)
    assert exc.value.status == S.ANA_INACCESSIBLE
    assert a.read(1, 0, 1) == bytes(512)  # the other path serves
    for worker_config in w.sup.paths:  # a worker restarted now comes back in the state set at run time
        ports = {p["portid"]: p for p in json.loads(open(worker_config).read())["ports"]}
        assert [g["ana"]["state"] for g in ports[2]["ana_groups"]] == ["inaccessible"]
    assert w.run(lambda: ana_states(path))[1] == {"portid": 2, "grpid": 1, "state": "inaccessible"}
    with pytest.raises(NvmeofError, match="port 9 is not a port"):
        w.run(lambda: change_ana_state(path, 9, 1, "optimized"))
    with pytest.raises(NvmeofError, match="ANA group 4 does not exist"):
        w.run(lambda: change_ana_state(path, 2, 4, "optimized"))
    with pytest.raises(NvmeofError, match="unknown ANA state"):
        w.run(lambda: change_ana_state(path, 2, 1, "fast"))
    assert w.run(lambda: change_ana_state(path, 2, 1, "optimized")) == 2
    for env in w.envs:
        assert env.target.ana.states() == {1: {1: "optimized"}, 2: {1: "optimized"}}
    assert b.read(1, 0, 1) == bytes(512)
    a.close()
    b.close()


def test_supervisor_reload_applies_on_every_worker_or_none(two_workers):
    w = two_workers
    data = mp_config()
    data["subsystems"][0]["namespaces"].append(ram_ns(2, "2M"))
    w.config_path.write_text(json.dumps(data))
    result = w.run(lambda: w.sup.reload())
    assert result["applied"] and [c["action"] for c in result["changes"]] == ["add-namespace"]
    assert [x["changes"] for x in result["workers"]] == [1, 1]
    for env in w.envs:
        assert sorted(env.target.subsystems[SUB].namespaces) == [1, 2]
    # the new RAM namespace is one file both workers share
    a = w.envs[0].connect(SUB, "10.99.0.1:4420")
    b = w.envs[1].connect(SUB, "10.99.0.1:4421")
    a.write(2, 3, b"r" * 512)
    assert b.read(2, 3, 1) == b"r" * 512
    a.close()
    b.close()
    # an edit a worker refuses: no worker changes (the dry run on every worker comes first)
    data["subsystems"][0]["attr"]["serial"] = "0123456789"  # a live serial change is refused
    data["subsystems"][0]["namespaces"].append(ram_ns(3, "1M"))
    w.config_path.write_text(json.dumps(data))
    with pytest.raises(RpcError) as exc:
        w.run(lambda: w.sup.reload())
    assert exc.value.field.endswith("attr.serial")
    for env in w.envs:
        assert sorted(env.target.subsystems[SUB].namespaces) == [1, 2]
    # a file that does not load: refused with the field
    w.config_path.write_text(json.dumps({"subsystems": [{"nqn": SUB, "namespaces": [{"nsid": 1}]}]}))
    with pytest.raises(RpcError) as exc:
        w.run(lambda: w.sup.control.call("nvmeof_reload_config", {"dry_run": False}))
    assert exc.value.field


def test_supervisor_control_socket_round_trip(two_workers, tmp_path):
    w = two_workers
    sock = bind_unix_socket(str(tmp_path / "s.sock"))
    server = ControlSocket(sock, w.sup.control.call)
    out = {}

    def client():
        out["methods"] = call(str(tmp_path / "s.sock"), "rpc_get_methods")
        try:
            call(str(tmp_path / "s.sock"), "no_such_method")
        except RpcError as exc:
            out["error"] = exc

    t = threading.Thread(target=client)
    t.start()
    while t.is_alive():
        if select.select([sock], [], [], 0.01)[0]:
            threading.Thread(target=server.serve_one).start()
        for env in w.envs:
            env.fabric.run_watched(0.01)
            env.fabric.pump()
    t.join()
    sock.close()
    assert "nvmf_subsystem_add_ns" in out["methods"] and "nvmeof_get_metrics" in out["methods"]
    assert out["error"].code == -32601


def test_workers_get_their_socket_and_never_see_notify_socket(tmp_path, monkeypatch):
    """systemd hears the supervisor only: a worker's READY=1 would tell it the target is up before every
    worker listens."""
    monkeypatch.setattr(wc, "SHM_DIR", str(tmp_path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    path = tmp_path / "mp.json"
    path.write_text(json.dumps(mp_config()))
    started = []

    class Recorder:
        def __init__(self, cmd, preexec_fn=None, env=None):
            started.append((cmd, env))
            self.pid = 4242

    monkeypatch.setattr(workers.subprocess, "Popen", Recorder)
    sup = workers.Supervisor(str(path), 2, cpus=None, run_dir=str(tmp_path / "run"), ready_file=None,
                             worker_args=[], rpc_socket=str(tmp_path / "sup.sock"))
    sup._spawn(0)
    sup._spawn(1)
    for i, (cmd, env) in enumerate(started):
        assert "NOTIFY_SOCKET" not in env
        assert cmd[cmd.index("--rpc-socket") + 1] == str(tmp_path / "run" / f"worker-{i}.sock")
        assert cmd[cmd.index("--worker-index") + 1] == str(i)


def test_the_keyring_through_the_supervisor_is_every_worker_s(two_workers, tmp_path):
    """keyring_file_add_key goes to every worker (and into the configs a restarted worker starts with);
    keyring_get_keys is answered once, as one process answers it."""
    w = two_workers
    path = tmp_path / "key0"
    path.write_text(nvme_auth.generate_secret(1, 32) + "\n")
    path.chmod(0o600)
    assert w.call("keyring_file_add_key", {"name": "key0", "path": str(path)}) is True
    for env in w.envs:
        assert env.target.config.userspace["keyring"] == {"key0": str(path)}
    for saved in w.sup.paths:
        assert json.loads(open(saved).read())["nvmeof_roce"]["keyring"] == {"key0": str(path)}
    assert [k["name"] for k in w.call("keyring_get_keys")] == ["key0"]
