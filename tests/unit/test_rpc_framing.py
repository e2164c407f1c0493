"""The control socket's framing: requests cut anywhere, nested deep, large, and clients that do not read."""
import json
import socket

import pytest

from nvmeof_roce.control import protocol as C, server as control_server
from nvmeof_roce.control.methods import Control
from nvmeof_roce.control.server import RpcServer

from test_target_control import _serve_while

REQUEST = json.dumps({"jsonrpc": "2.0", "method": "nvmf_get_subsystems",
                      "params": {"nqn": "nqn.2024-01.io.test:ram"}, "id": 1, "note": "naïve ✓"}, ensure_ascii=False).encode()


@pytest.fixture
def server(env, tmp_path):
    path = str(tmp_path / "t.sock")
    s = RpcServer(Control(env.target), path, env.fabric)
    yield path
    s.close()


def _client(path, *pieces, replies=1):
    def run():
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        f = s.makefile("rb")
        for piece in pieces:
            s.sendall(piece)
            import time
            time.sleep(0.02)  # each piece arrives in its own read
        out = [json.loads(f.readline()) for _ in range(replies)]
        s.close()
        return out
    return run


@pytest.mark.parametrize("cut", [10, REQUEST.index(b"2.0") + 1, REQUEST.index("ï".encode()) + 1,
                                 REQUEST.index("✓".encode()) + 2, len(REQUEST) - 1])
def test_a_request_cut_anywhere_gets_one_answer(env, server, cut):
    """Inside a token, a number, a string, or a UTF-8 sequence: one answer, not two parse errors."""
    replies = _serve_while(env, _client(server, REQUEST[:cut], REQUEST[cut:] + REQUEST, replies=2))
    for reply in replies:
        assert reply["id"] == 1 and reply["result"][0]["nqn"] == "nqn.2024-01.io.test:ram"


def test_every_byte_in_its_own_read(env, server):
    replies = _serve_while(env, _client(server, *[bytes([b]) for b in REQUEST[:80]], REQUEST[80:]))
    assert replies[0]["id"] == 1 and "result" in replies[0]


def test_deep_nesting_gets_an_answer_and_the_client_is_dropped(env, server):
    deep = b'{"jsonrpc": "2.0", "method": "x", "id": 1, "params": ' + b"[" * 100000
    (reply,) = _serve_while(env, _client(server, deep))
    assert reply["error"]["code"] == C.INVALID_REQUEST and "nested more than" in reply["error"]["message"]


def test_a_request_too_large_gets_an_answer(env, server):
    big = b'{"jsonrpc": "2.0", "method": "x", "id": 1, "params": {"a": "' + b"x" * (C.MAX_REQUEST_BYTES + 10)
    (reply,) = _serve_while(env, _client(server, big))
    assert "larger than" in reply["error"]["message"]


def test_not_utf8_and_not_json_are_answered_and_the_connection_goes_on(env, server):
    replies = _serve_while(env, _client(server, b'{"method": "\xff"}', b"{1: 2}", REQUEST, replies=3))
    assert [r.get("error", {}).get("code") for r in replies] == [C.PARSE_ERROR, C.PARSE_ERROR, None]
    assert "not UTF-8" in replies[0]["error"]["message"]


def test_a_client_that_does_not_read_is_dropped(env, server, monkeypatch):
    monkeypatch.setattr(control_server, "MAX_PENDING_REPLY_BYTES", 1 << 16)
    rpc = next(h.__self__ for h in env.target.tick_hooks if isinstance(getattr(h, "__self__", None), RpcServer))
    s = socket.socket(socket.AF_UNIX)
    s.connect(server)
    s.setblocking(False)
    many = (json.dumps({"jsonrpc": "2.0", "method": "rpc_get_methods", "id": 1}) * 4000).encode()
    sent = 0
    try:
        for _ in range(4000):  # send, never read
            try:
                sent += s.send(many[sent:sent + 65536])
            except (BlockingIOError, ConnectionResetError, BrokenPipeError):
                pass
            env.fabric.run_watched(0.001)
            if not rpc.conns or sent >= len(many):
                break
        for _ in range(50):
            env.fabric.run_watched(0.001)
        assert rpc.conns == {}  # dropped: its replies are not queued without bound
    finally:
        s.close()
