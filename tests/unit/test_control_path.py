"""The path of an RPC that changes one namespace: which of our modules it crosses, from the CLI client to the
engine and back (docs/architecture.md "One RPC: a namespace added to a running target").

How it is counted: the client (`target add-ns`'s function, or control/client.py's `call`) runs in a thread and
the target's loop in this one, each under `sys.setprofile`; every Python function called is recorded by the
module it belongs to (its globals' `__name__`), on the target's side only while control/server.py's
`_readable` is on the stack (the request's handling, not the loop around it).  A host is connected to the
subsystem (it gets the notice) and a discovery controller to the target, and the running config is persisted.

Before the namespace verbs (engine/api.py add_namespace, set_namespace_size, remove_namespace) the same
nvmf_subsystem_add_ns crossed 29 modules in ~1,400 calls: the whole config to a dict, re-parsed, re-checked,
its keys re-read (config/keys.py, engine/auth.py), planned and applied by control/live.py, the discovery logs
compared (engine/discovery.py)."""
import argparse
import os
import sys
import threading
from collections import Counter

import pytest

from nvmeof_roce.control import client, commands
from nvmeof_roce.control.methods import Control
from nvmeof_roce.control.server import RpcServer
from nvmeof_roce.nvme import fabrics as F

from loopback_env import SUB_RAM

# What an RPC that changes one namespace does not need: the whole-config round trip of a reload.
NOT_ON_THE_PATH = {"control.live", "engine.auth", "config.keys", "engine.discovery", "transport.registry"}
# The control plane's and the config's part of the path: the socket, the dispatch, the parameters, the
# namespace parsed and checked as the loader does, the config written back (persist).
CONTROL_SIDE = {"control.commands", "control.client", "control.server", "control.protocol", "control.methods",
                "control.rpc.params", "control.rpc.namespaces", "config.model", "config.loader", "config.userspace",
                "config.errors"}


def modules_entered(env, tmp_path, client_call):
    """Counter {module relative to the package: functions called} of one call `client_call(socket path)`."""
    path = str(tmp_path / "t.sock")
    control = Control(env.target, config_path=str(tmp_path / "t.json"), persist=True)
    server = RpcServer(control, path, env.fabric)
    server_file = sys.modules[RpcServer.__module__].__file__
    seen: Counter = Counter()

    def handling(frame) -> bool:
        while frame is not None:
            if frame.f_code.co_filename == server_file and frame.f_code.co_name == "_readable":
                return True
            frame = frame.f_back
        return False

    def record(only_handling):
        def profile(frame, event, _arg):
            if event == "call":
                name = frame.f_globals.get("__name__", "")
                if name.startswith("nvmeof_roce.") and (not only_handling or handling(frame)):
                    seen[name.partition(".")[2]] += 1
        return profile

    out = {}

    def run_client():
        sys.setprofile(record(False))
        try:
            out["result"] = client_call(path)
        except BaseException as exc:  # noqa: B902 - handed back to the test
            out["error"] = exc
        finally:
            sys.setprofile(None)

    thread = threading.Thread(target=run_client)
    thread.start()
    sys.setprofile(record(True))
    try:
        while thread.is_alive():
            env.fabric.run_watched(0.05)
            env.fabric.pump()
    finally:
        sys.setprofile(None)
        thread.join()
        server.close()
    if "error" in out:
        raise out["error"]
    return seen


@pytest.fixture
def connected(env):
    ctrl = env.connect(SUB_RAM)
    disc = env.connect(F.DISCOVERY_NQN, kato_ms=30000)
    yield env
    disc.close()
    ctrl.close()


def _add_ns(path):
    args = argparse.Namespace(nqn=SUB_RAM, nsid=None, path=None, size=None, ram="1M", null=None, block_size=None,
                              queue_depth=None, io_engine=None, uuid=None, nguid=None, eui64=None,
                              no_auto_visible=False, socket=path, timeout=10.0, json=True)
    return commands._cmd_add_ns(args)


def test_add_ns_goes_from_the_client_to_the_engine_verb_without_the_config_round_trip(connected, tmp_path, capsys):
    seen = modules_entered(connected, tmp_path, _add_ns)
    assert 3 in connected.target.subsystems[SUB_RAM].namespaces
    assert '"nsid": 3' in capsys.readouterr().out
    assert not NOT_ON_THE_PATH & set(seen), sorted(seen)
    control_side = {m for m in seen if m.startswith(("control.", "config."))}
    assert control_side <= CONTROL_SIDE, sorted(control_side - CONTROL_SIDE)
    assert "engine.api" in seen and "securefile" in seen
    assert len(seen) <= 24, sorted(seen)  # 29 before (the module docstring)
    saved = (tmp_path / "t.json").read_text()
    assert '"nsid": 3' in saved  # the persisted config is the engine's


def test_resize_and_remove_ns_take_the_same_short_path(connected, tmp_path):
    for step in "abc":
        (tmp_path / step).mkdir()
    modules_entered(connected, tmp_path / "a", _add_ns)
    resize = modules_entered(connected, tmp_path / "b", lambda p: client.call(
        p, "nvmf_subsystem_resize_ns", {"nqn": SUB_RAM, "nsid": 3, "size": "2M"}))
    assert connected.target.subsystems[SUB_RAM].namespaces[3].num_blocks == (2 << 20) // 512
    remove = modules_entered(connected, tmp_path / "c", lambda p: client.call(
        p, "nvmf_subsystem_remove_ns", {"nqn": SUB_RAM, "nsid": 3}))
    assert 3 not in connected.target.subsystems[SUB_RAM].namespaces
    for seen in (resize, remove):
        assert not NOT_ON_THE_PATH & set(seen), sorted(seen)
        assert {m for m in seen if m.startswith(("control.", "config."))} <= CONTROL_SIDE
    assert os.path.exists(tmp_path / "c" / "t.json")
