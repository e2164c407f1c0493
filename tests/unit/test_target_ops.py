"""Operations around `target serve`: SIGHUP reload, sd_notify, the metrics endpoint (loopback target)."""
import json
import os
import signal
import socket
import urllib.request

import pytest

from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.service.metrics import parse_listen
from nvmeof_roce.service.sdnotify import notify

from loopback_env import SUB_RAM, ram_ns


@pytest.fixture
def notify_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield sock
    sock.close()


def messages(sock):
    out = []
    sock.settimeout(0.5)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except socket.timeout:
        pass
    return out


def test_sd_notify_sends_datagrams_and_is_silent_without_systemd(notify_socket, monkeypatch):
    assert notify("READY=1", "STATUS=serving")
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=serving"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert notify("READY=1") is False


def test_sd_notify_abstract_socket(monkeypatch):
    name = f"nvmeof-roce-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("STOPPING=1")
        assert sock.recv(100) == b"STOPPING=1"
    finally:
        sock.close()


def test_sighup_reloads_the_file_and_notifies(env, tmp_path, notify_socket):
    path = tmp_path / "target.json"
    path.write_text(json.dumps(env.target.config.to_dict()))
    before = signal.getsignal(signal.SIGHUP)
    ops = env.operations(str(path), rpc_socket=str(tmp_path / "t.sock"))
    try:
        ops.ready()
        assert messages(notify_socket) == ["READY=1\nSTATUS=serving 5 subsystem(s), 0 controller(s) on loopback"]
        data = json.loads(path.read_text())
        data["subsystems"][0]["namespaces"].append(ram_ns(4, "1M"))
        path.write_text(json.dumps(data))
        check = ops.should_stop_hook(lambda: False)
        os.kill(os.getpid(), signal.SIGHUP)
        assert check() is False  # the loop's next pass runs the reload
        assert sorted(env.target.subsystems[SUB_RAM].namespaces) == [1, 2, 4]
        assert messages(notify_socket)[:1] == ["RELOADING=1\nSTATUS=reloading"]
        # an invalid edit: refused, nothing changes, systemd hears why
        data["subsystems"][0]["namespaces"].append({"nsid": 5, "nvmeof_roce": {"backend": "ram"}})
        path.write_text(json.dumps(data))
        os.kill(os.getpid(), signal.SIGHUP)
        check()
        assert sorted(env.target.subsystems[SUB_RAM].namespaces) == [1, 2, 4]
        sent = messages(notify_socket)
        assert any("reload refused: subsystems[0].namespaces[3].nvmeof_roce.size" in m for m in sent)
        ops.stopping()
        assert messages(notify_socket) == ["STOPPING=1\nSTATUS=stopping: finishing in-flight commands"]
    finally:
        ops.close()
    assert signal.getsignal(signal.SIGHUP) == before


def test_metrics_endpoint_counts_io(env, tmp_path):
    pytest.importorskip("prometheus_client")
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    ops = env.operations(str(tmp_path / "x.json"), metrics=f":{port}")
    try:
        assert ops.metrics_url == f"http://127.0.0.1:{port}/metrics"
        ctrl = env.connect(SUB_RAM)
        for i in range(5):
            ctrl.write(1, i, b"m" * 512)
        ops.metrics.tick()

        def scrape():
            with urllib.request.urlopen(ops.metrics_url, timeout=10) as r:
                return r.read().decode()

        text = scrape()
        line = f'nvmeof_roce_namespace_writes_total{{nsid="1",subnqn="{SUB_RAM}"}} 5.0'
        assert line in text
        assert f'nvmeof_roce_namespace_write_latency_seconds_count{{nsid="1",subnqn="{SUB_RAM}"}} 5.0' in text
        assert 'nvmeof_roce_controllers{hostnqn=' in text
        for i in range(3):
            ctrl.write(1, i, b"m" * 512)
        ops.metrics._last -= 2  # the next loop tick takes a new snapshot
        ops.metrics.tick()
        assert line.replace("5.0", "8.0") in scrape()
        ctrl.close()
    finally:
        ops.close()


def test_metrics_address_parsing():
    assert parse_listen(":9712") == ("127.0.0.1", 9712)
    assert parse_listen("9712") == ("127.0.0.1", 9712)
    assert parse_listen("0.0.0.0:9100") == ("0.0.0.0", 9100)
    assert parse_listen("[::1]:9100") == ("::1", 9100)
    with pytest.raises(NvmeofError):
        parse_listen("localhost:http")


def test_control_socket_binding_rules(tmp_path, monkeypatch):
    from nvmeof_roce.control import protocol as control_protocol, server as control_server
    from nvmeof_roce.service import ops as opsmod
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    monkeypatch.setattr(control_protocol, "DEFAULT_SOCKET_DIR", str(blocked / "run"))
    # the default place unusable: served without a socket (a warning), not refused
    assert opsmod.bind_control_socket(str(tmp_path / "t.json"), "") == (None, None)
    # an explicit path that cannot be bound: an error naming the fix
    with pytest.raises(NvmeofError) as exc:
        opsmod.bind_control_socket(str(tmp_path / "t.json"), str(blocked / "x.sock"))
    assert "--rpc-socket" in exc.value.fix
    path, sock = opsmod.bind_control_socket(str(tmp_path / "t.json"), str(tmp_path / "ok.sock"))
    try:
        with pytest.raises(control_server.SocketInUse):  # a live owner: refused even for the default place
            opsmod.bind_control_socket(str(tmp_path / "t.json"), path)
    finally:
        sock.close()
    assert opsmod.bind_control_socket(str(tmp_path / "t.json"), None) == (None, None)


def test_metrics_endpoint_with_debian12_prometheus_client_and_process_figures(env, monkeypatch):
    """Debian 12's prometheus_client (0.16) start_http_server returns None: the endpoint must not depend on
    its return value; the registry keeps process_* and the build info; close() frees the port."""
    prometheus_client = pytest.importorskip("prometheus_client")
    monkeypatch.setattr(prometheus_client, "start_http_server", lambda *a, **k: None)
    from nvmeof_roce.service.metrics import Metrics
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    metrics = Metrics(env.target)
    url = metrics.start(f"127.0.0.1:{port}")
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        assert "process_cpu_seconds_total " in text and "process_resident_memory_bytes " in text
        assert 'nvmeof_roce_build_info{python="' in text and 'version="' in text
        assert "nvmeof_roce_namespace_size_bytes{" in text
    finally:
        metrics.close()
    again = socket.socket()
    again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT, fails only while one listens
    again.bind(("127.0.0.1", port))  # the server is gone
    again.close()
