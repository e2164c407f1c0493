"""A reload (SIGHUP, `target reload`, the RPC) with a broken config is refused with a message naming the
problem, and the target keeps serving its connected hosts (issue: a typo must not stop the target)."""
import json
import os
import time

import pytest

from nvmeof_roce.control.methods import Control
from nvmeof_roce.control.protocol import RpcError

from loopback_env import SUB_RAM, ram_ns


def _good(env) -> dict:
    return env.target.config.to_dict()


def _with_ns_path(env, path: str) -> dict:
    data = _good(env)
    data["subsystems"][0]["namespaces"].append({"nsid": 7, "device": {"path": path},
                                                "nvmeof_roce": {"backend": "file"}})
    return data


def _write_json(path, data) -> None:
    path.write_text(json.dumps(data))


def _broken(kind, env, tmp_path, path):
    """Write a broken config of `kind` at `path`; returns a word the refusal must contain."""
    if kind == "not-utf8":
        text = json.dumps(_good(env)).replace('"hosts"', '"ho\udcffsts"', 1)
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        return "UTF-8"
    if kind == "deep-brackets":
        path.write_text("[" * 100000 + "]" * 100000)
        return "nested"
    if kind == "deep-object":
        data = _good(env)
        inner = {}
        for _ in range(200):
            inner = {"x": inner}
        data["subsystems"][0]["nvmeof_roce"] = inner
        _write_json(path, data)
        return "nested"
    if kind == "huge-integer":
        path.write_text('{"hosts": [], "ports": [], "subsystems": [{"nqn": "x", "namespaces": [{"nsid": '
                        + "9" * 10000 + "}]}]}")
        return "digits"
    if kind == "enotdir":
        (tmp_path / "plain").write_text("x")
        _write_json(path, _with_ns_path(env, str(tmp_path / "plain" / "ns.img")))
        return "Not a directory"
    if kind == "eloop":
        os.symlink(str(tmp_path / "loop"), str(tmp_path / "loop"))
        _write_json(path, _with_ns_path(env, str(tmp_path / "loop")))
        return "symbolic links"
    if kind == "nul-in-path":
        _write_json(path, _with_ns_path(env, str(tmp_path) + "/a\0b"))
        return "NUL"
    raise AssertionError(kind)


KINDS = ["not-utf8", "deep-brackets", "deep-object", "huge-integer", "enotdir", "eloop", "nul-in-path"]


@pytest.fixture
def ops(env, tmp_path):
    path = tmp_path / "target.json"
    _write_json(path, _good(env))
    o = env.operations(str(path))
    yield o, path
    o.close()


def _io(ctrl, byte: bytes) -> None:
    ctrl.write(1, 5, byte * 512)
    assert ctrl.read(1, 5, 1) == byte * 512


@pytest.mark.parametrize("kind", KINDS)
def test_sighup_reload_of_a_broken_config_is_refused_and_the_target_keeps_serving(env, ops, tmp_path, kind):
    o, path = ops
    ctrl = env.connect(SUB_RAM)
    _io(ctrl, b"a")
    expected = _broken(kind, env, tmp_path, path)
    result = o.reload()  # what the loop runs after SIGHUP
    assert result["applied"] is False
    assert expected in result["error"]["message"], result
    _io(ctrl, b"b")  # the host kept its controller
    assert sorted(env.target.subsystems[SUB_RAM].namespaces) == [1, 2]
    _write_json(path, dict(_good(env), subsystems=[dict(_good(env)["subsystems"][0],
                                                        namespaces=[ram_ns(1, "2M"), ram_ns(2, "1M"),
                                                                    ram_ns(3, "1M")])] +
                           _good(env)["subsystems"][1:]))
    assert o.reload()["changes"]  # a good config after it still applies
    ctrl.close()


@pytest.mark.parametrize("kind", ["enotdir", "eloop", "nul-in-path"])
def test_rpc_add_ns_with_a_hostile_path_is_refused(env, tmp_path, kind):
    control = Control(env.target)
    hostile = {"enotdir": lambda: (tmp_path / "f").write_text("x") or str(tmp_path / "f" / "x"),
               "eloop": lambda: os.symlink(str(tmp_path / "l"), str(tmp_path / "l")) or str(tmp_path / "l"),
               "nul-in-path": lambda: str(tmp_path) + "/a\0b"}[kind]()
    with pytest.raises(RpcError) as err:
        control.call("nvmf_subsystem_add_ns", {"nqn": SUB_RAM, "namespace": {"path": hostile}})
    assert err.value.field == "namespace.path"


def test_a_fifo_in_the_config_s_place_is_refused_without_blocking(env, ops, tmp_path):
    """The reload runs on the event loop: opening a FIFO without a writer would block it for good."""
    o, path = ops
    path.unlink()
    os.mkfifo(str(path))
    start = time.monotonic()
    result = o.reload()
    assert time.monotonic() - start < 5
    assert result["applied"] is False and "not a regular file" in result["error"]["message"]


def test_a_huge_config_is_refused_before_it_is_read(env, ops):
    from nvmeof_roce import config
    o, path = ops
    with open(path, "r+b") as f:
        f.truncate(config.MAX_CONFIG_BYTES + 1)
    result = o.reload()
    assert result["applied"] is False and "more than the" in result["error"]["message"]
