"""The userspace target's unit, nvmeof-roce-target@.service, with `"workers": 2`, run as systemd runs it.

The lab guest's PID 1 is a shell script, not systemd, so this test does what systemd does with the unit:
it runs ExecStart with $NOTIFY_SOCKET pointing at a datagram socket the test reads (Type=notify), with the
capability bounding set emptied and no_new_privs (CapabilityBoundingSet=, NoNewPrivileges=yes) to show that
RDMA needs neither, then runs ExecReload's command and waits for it as `systemctl reload` does, and sends
SIGTERM as `systemctl stop` does.  The commands are the unit's own lines, with %i and the config directory
filled in."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from nvmeof_roce.systemd import render
from targetproc import LAB_IP, config, disconnect_all_quietly, nvme, ram_namespace

pytestmark = [pytest.mark.lab, pytest.mark.extended]  # make test-extended (minutes under TCG)

NQN = "nqn.2024-01.io.nvmeof-roce:unit-workers"
INSTANCE = "labw2"
METRICS = "127.0.0.1:9714"


def unit_commands(conf_dir: str):
    """ExecStart and ExecReload of the unit, for instance INSTANCE, run with this Python."""
    exe = f"{sys.executable} -m nvmeof_roce"
    lines = render("nvmeof-roce-target@.service", exe).replace("%i", INSTANCE).splitlines()

    def value(key):
        (line,) = [x for x in lines if x.startswith(key + "=")]
        return line.split("=", 1)[1].replace("/etc/nvmeof-roce", conf_dir).split()

    return value("ExecStart"), value("ExecReload")


def notifications(sock, timeout):
    """Datagrams on the notify socket until `timeout` passes without one."""
    out = []
    sock.settimeout(timeout)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except socket.timeout:
        pass
    return out


def wait_message(sock, key, proc, timeout=150.0):
    """The first datagram holding `key` (e.g. READY=1), and every datagram before it."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        sock.settimeout(0.5)
        try:
            msg = sock.recv(4096).decode()
        except socket.timeout:
            continue
        seen.append(msg)
        if key in msg.split("\n"):
            return seen
    raise AssertionError(f"no {key} from the service (exit status {proc.poll()}) within {timeout} s; got {seen}")


def worker_nsids(run_dir, i):
    out = subprocess.run([sys.executable, "-m", "nvmeof_roce", "rpc", "nvmf_get_subsystems", "--param", f"nqn={NQN}",
                          "--socket", f"{run_dir}/worker-{i}.sock"], capture_output=True, text=True, timeout=60,
                         check=True)
    (sub,) = json.loads(out.stdout)
    return [n["nsid"] for n in sub["namespaces"]]


def test_unit_with_two_workers_ready_reload_and_metrics(tmp_path):
    if not (shutil.which("setpriv") and shutil.which("prlimit")):
        pytest.skip("setpriv and prlimit (util-linux) are missing")
    conf_dir = str(tmp_path / "etc")
    os.makedirs(conf_dir)
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1"}, "namespaces": [ram_namespace(1, "16M")]}], port=4430)
    cfg["nvmeof_roce"] = {"workers": 2}
    cfg_path = f"{conf_dir}/{INSTANCE}.json"
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    start, reload_cmd = unit_commands(conf_dir)
    run_dir = f"/run/nvmeof-roce/{INSTANCE}"
    assert start[start.index("--run-dir") + 1] == run_dir
    control = start[start.index("--rpc-socket") + 1]
    os.makedirs(run_dir, mode=0o700, exist_ok=True)  # RuntimeDirectory=nvmeof-roce/%i

    notify_path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(notify_path)
    env = dict(os.environ, NOTIFY_SOCKET=notify_path)
    # LimitMEMLOCK=infinity, then CapabilityBoundingSet= and NoNewPrivileges=yes: root without any capability
    # (registered memory is pinned: without the limit raised, memory registration fails with ENOMEM)
    argv = ["prlimit", "--memlock=unlimited", "--", "setpriv", "--bounding-set", "-all", "--inh-caps", "-all",
            "--no-new-privs", "--"] + start + ["--metrics", METRICS]  # --metrics as a drop-in would add it
    log_path = str(tmp_path / "service.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        seen = wait_message(sock, "READY=1", proc)
        # READY=1 came from the supervisor alone, once: both workers listen by then
        assert sum("READY=1" in m.split("\n") for m in seen) == 1, seen
        assert f"MAINPID={proc.pid}" in seen[-1]
        assert all(os.path.exists(f"{run_dir}/worker-{i}.ready") for i in range(2))
        for svc in ("4430", "4431"):  # both listen: the kernel host connects to each path
            nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", svc, "-n", NQN)
        with open(f"/proc/{proc.pid}/status") as f:
            caps = {k: v.strip() for k, v in (line.split(":", 1) for line in f if line.startswith("Cap"))}
        assert caps["CapEff"] == caps["CapBnd"] == "0000000000000000", caps  # served without any capability

        # metrics from both workers, through the supervisor's endpoint
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(f"http://{METRICS}/metrics", timeout=30) as r:
                text = r.read().decode()
            ctrl_lines = [x for x in text.splitlines() if x.startswith("nvmeof_roce_controllers{")]
            if {w for w in ("0", "1") if any(f'worker="{w}"' in x for x in ctrl_lines)} == {"0", "1"}:
                break
            assert time.monotonic() < deadline, text
            time.sleep(1)  # each worker takes a snapshot once a second
        assert 'process_cpu_seconds_total{worker="supervisor"}' in text
        assert 'process_cpu_seconds_total{worker="1"}' in text and "nvmeof_roce_build_info{" in text

        # ExecReload: waits for the result, which every worker applied
        cfg["subsystems"][0]["namespaces"].append(ram_namespace(2, "8M"))
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        t0 = time.monotonic()
        out = subprocess.run(reload_cmd + ["--json"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr + out.stdout
        result = json.loads(out.stdout)
        assert result["applied"] and [w["changes"] for w in result["workers"]] == [1, 1], result
        assert worker_nsids(run_dir, 0) == worker_nsids(run_dir, 1) == [1, 2]
        print(f"ExecReload returned after {time.monotonic() - t0:.1f} s with both workers reloaded")
        # a refused reload: ExecReload fails (systemctl reload reports it) and no worker changes
        bad = json.loads(json.dumps(cfg))
        bad["subsystems"][0]["attr"]["serial"] = "changed0123"
        with open(cfg_path, "w") as f:
            json.dump(bad, f)
        out = subprocess.run(reload_cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "serial" in out.stderr + out.stdout, out.stderr + out.stdout
        assert worker_nsids(run_dir, 0) == worker_nsids(run_dir, 1) == [1, 2]

        # SIGHUP (systemctl kill -s HUP) reloads too, with RELOADING=1 then READY=1
        cfg["subsystems"][0]["namespaces"].append(ram_namespace(3, "8M"))
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        notifications(sock, 0.2)
        proc.send_signal(signal.SIGHUP)
        seen = wait_message(sock, "READY=1", proc, timeout=120)
        assert any("RELOADING=1" in m.split("\n") for m in seen), seen
        assert worker_nsids(run_dir, 0) == worker_nsids(run_dir, 1) == [1, 2, 3]
        assert proc.poll() is None  # SIGHUP no longer kills the supervisor

        disconnect_all_quietly()
        proc.send_signal(signal.SIGTERM)  # systemctl stop
        assert proc.wait(60) == 0
        assert any("STOPPING=1" in m.split("\n") for m in notifications(sock, 0.5))
        assert not os.path.exists(control) and not os.path.exists(f"{run_dir}/target.pid")
    finally:
        disconnect_all_quietly()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        sock.close()
        print(open(log_path).read()[-4000:])
