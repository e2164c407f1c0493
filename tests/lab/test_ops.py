"""Operations on a running userspace target, with the Linux kernel host connected and fio running:
namespaces added/resized/removed over the control socket, an allow-list changed, SIGHUP reload, status and
Prometheus metrics, sd_notify, and nvme-cli's connect options through `nvmeof-roce host connect`."""
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, nvme, ram_namespace

pytestmark = pytest.mark.lab

NQN_OPS = "nqn.2024-01.io.nvmeof-roce:ops"
NQN_ACL = "nqn.2024-01.io.nvmeof-roce:ops-acl"
HOST_X = "nqn.2014-08.org.nvmexpress:uuid:0b5e0000-0000-4000-8000-0000000000a1"
METRICS = "127.0.0.1:9712"


def wait_for(what, fn, timeout=30.0, interval=0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def devices(nqn):
    """{nsid: /dev/nvmeXnY} of subsystem `nqn` as the host sees it now."""
    out = {}
    for subsys in glob.glob("/sys/class/nvme-subsystem/nvme-subsys*"):
        if open(f"{subsys}/subsysnqn").read().strip() != nqn:
            continue
        for disk in glob.glob(f"{subsys}/nvme*n*"):
            name = os.path.basename(disk)
            try:
                out[int(open(f"/sys/block/{name}/nsid").read())] = "/dev/" + name
            except OSError:
                pass
    return out


def lsblk_size(device):
    """The size lsblk reports for `device` (bytes), or None when lsblk does not list it."""
    proc = subprocess.run(["lsblk", "-J", "-b", "-o", "NAME,SIZE"], capture_output=True, text=True, check=True)
    for dev in json.loads(proc.stdout)["blockdevices"]:
        if "/dev/" + dev["name"] == device:
            return int(dev["size"])
    return None


class Ops:
    def __init__(self, target, sock):
        self.target = target
        self.sock = sock

    def cli(self, *args, check=True):
        proc = subprocess.run([sys.executable, "-m", "nvmeof_roce", *args], capture_output=True, text=True,
                              timeout=120)
        if check:
            assert proc.returncode == 0, f"nvmeof-roce {' '.join(args)}: {proc.stderr}{proc.stdout}"
        return proc

    def target_cmd(self, *args, check=True):
        return self.cli("target", *args, "--socket", self.sock, check=check)

    def status(self):
        return json.loads(self.target_cmd("status", "--json").stdout)

    def rpc(self, method, params=None):
        args = ["rpc", method] + ([json.dumps(params)] if params is not None else []) + ["--socket", self.sock]
        return json.loads(self.cli(*args).stdout)


def scrape():
    proc = subprocess.run(["busybox", "wget", "-q", "-O", "-", f"http://{METRICS}/metrics"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def metric(text, name, nsid):
    m = re.search(rf'^{name}{{nsid="{nsid}",subnqn="{re.escape(NQN_OPS)}"}} ([0-9.e+]+)$', text, re.M)
    assert m, f"{name} for namespace {nsid} not in the metrics:\n{text[:3000]}"
    return float(m.group(1))


@pytest.fixture(scope="module")
def ops(tmp_path_factory):
    try:  # the metrics endpoint needs prometheus_client in the guest
        import prometheus_client  # noqa: F401
    except ImportError:
        pytest.fail("prometheus_client is missing in the lab guest: rebuild the image (nvmeof-roce lab build)")
    tmp = tmp_path_factory.mktemp("ops")
    notify_path = str(tmp / "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(notify_path)
    notify.settimeout(30)
    cfg = config([
        {"nqn": NQN_OPS, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
         "namespaces": [ram_namespace(1, "64M"), ram_namespace(2, "16M")]},
        {"nqn": NQN_ACL, "attr": {"allow_any_host": "0"}, "allowed_hosts": [], "namespaces": [ram_namespace(1, "8M")]},
    ])
    sock = str(tmp / "ops.sock")
    env = dict(os.environ, NOTIFY_SOCKET=notify_path)
    target = ServedTarget(cfg, str(tmp / "ops.json"), args=["--rpc-socket", sock, "--metrics", METRICS],
                          env=env).start()
    o = Ops(target, sock)
    o.notify = notify
    yield o
    disconnect_all_quietly()
    target.stop()
    notify.close()


def test_ready_is_notified_and_the_socket_is_root_only(ops):
    assert ops.notify.recv(4096).decode().startswith("READY=1\nSTATUS=serving 2 subsystem(s)")
    assert oct(os.stat(ops.sock).st_mode & 0o777) == "0o600"
    second = ops.target.path + ".2.json"
    with open(second, "w") as f:
        json.dump(ops.target.config, f)
    proc = subprocess.run([sys.executable, "-m", "nvmeof_roce", "target", "serve", second, "--rpc-socket", ops.sock],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "another target is running with the control socket" in proc.stderr


def test_live_namespaces_status_and_metrics_while_fio_verifies(ops):
    # nvme-cli's connect options through our host command, against our target
    proc = ops.cli("host", "connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN_OPS, "-o", "json",
                   "-T", "104", "-P", "1", "-W", "1", "-D")
    connected = json.loads(proc.stdout)
    assert connected["nqn"] == NQN_OPS and connected["controller"].startswith("nvme")
    devs = wait_for("namespaces 1 and 2", lambda: (lambda d: d if {1, 2} <= set(d) else None)(devices(NQN_OPS)))
    fio = subprocess.Popen(["fio", "--name=verify", f"--filename={devs[1]}", "--ioengine=libaio", "--direct=1",
                            "--rw=randwrite", "--bs=4k", "--iodepth=8", "--size=16M", "--verify=crc32c",
                            "--verify_backlog=64", "--verify_fatal=1", "--verify_state_save=0", "--time_based",
                            "--runtime=600", "--output-format=json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        def busy():
            s = ops.status()
            ns1 = next(n for sub in s["subsystems"] if sub["nqn"] == NQN_OPS for n in sub["namespaces"]
                       if n["nsid"] == 1)
            return s if ns1["iops"] > 0 else None
        status = wait_for("non-zero IOPS on namespace 1", busy)
        host = next(h for h in status["hosts"] if h["controllers"][0]["subnqn"] == NQN_OPS)
        io_queues = host["controllers"][0]["io_queues"]
        assert len(io_queues) >= 3, io_queues  # default + 1 write (-W) + 1 poll (-P) queue
        sub = next(s for s in status["subsystems"] if s["nqn"] == NQN_OPS)
        assert [q["qid"] for q in sub["controllers"][0]["queues"]] == [0] + io_queues
        listener = status["transport"]["listeners"][0]
        assert listener["address"] == f"{LAB_IP}:4420" and listener["pool"]["chunks"] > 0, listener
        print("status during fio:", json.dumps(sub["namespaces"][0]), json.dumps(status["transport"]))

        first = metric(scrape(), "nvmeof_roce_namespace_writes_total", 1)
        time.sleep(3)
        second = metric(scrape(), "nvmeof_roce_namespace_writes_total", 1)
        assert second > first > 0, (first, second)
        print(f"metrics: writes_total {first:.0f} -> {second:.0f}")

        # add: appears without a reconnect
        added = json.loads(ops.target_cmd("add-ns", NQN_OPS, "--ram", "32M", "--nsid", "3", "--json").stdout)
        assert added == {"nqn": NQN_OPS, "nsid": 3}
        dev3 = wait_for("namespace 3 on the host", lambda: devices(NQN_OPS).get(3))
        assert wait_for("lsblk lists namespace 3", lambda: lsblk_size(dev3)) == 32 << 20
        # resize: the host sees the new size
        ops.target_cmd("resize-ns", NQN_OPS, "3", "48M")
        wait_for("the new size of namespace 3", lambda: lsblk_size(dev3) == 48 << 20)
        # remove: it disappears
        ops.target_cmd("rm-ns", NQN_OPS, "3")
        wait_for("namespace 3 to disappear", lambda: 3 not in devices(NQN_OPS) and lsblk_size(dev3) is None)
        assert set(devices(NQN_OPS)) == {1, 2}
        assert fio.poll() is None, "fio ended early"
    finally:
        fio.send_signal(signal.SIGINT)  # the changes were made under I/O: fio stops, its verify results stand
        out, err = fio.communicate(timeout=300)
    job = json.loads(out[out.index("{"):])["jobs"][0]
    assert fio.returncode in (0, 128) and job["error"] == 0, err  # 128: fio's exit after SIGINT
    assert job["write"]["io_bytes"] > 0
    nvme("disconnect", "-n", NQN_OPS)


def test_host_added_then_removed_from_the_allow_list(ops):
    connect = ["connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN_ACL, "-q", HOST_X, "-l", "2", "-c", "1"]
    refused = nvme(*connect, check=False)
    assert refused.returncode != 0
    ops.target_cmd("add-host", NQN_ACL, HOST_X)
    nvme(*connect)
    dev = wait_for("the allowed host's namespace", lambda: devices(NQN_ACL).get(1))
    ctrls = ops.rpc("nvmf_subsystem_get_controllers", {"nqn": NQN_ACL})
    assert [c["hostnqn"] for c in ctrls] == [HOST_X]
    ops.target_cmd("rm-host", NQN_ACL, HOST_X)
    assert ops.rpc("nvmf_subsystem_get_controllers", {"nqn": NQN_ACL}) == []
    # its controller was ended: the kernel cannot reconnect (not allowed) and gives up after ctrl-loss-tmo
    wait_for("the host to drop the ended controller", lambda: not devices(NQN_ACL), timeout=60)
    assert lsblk_size(dev) is None
    disconnect_all_quietly()


def test_sighup_applies_exactly_the_difference_and_refuses_an_invalid_edit(ops):
    path = ops.target.path
    ops.rpc("save_config", {"path": path})  # the file now equals the running target
    data = json.load(open(path))
    data["subsystems"][0]["namespaces"].append(ram_namespace(6, "8M"))
    with open(path, "w") as f:
        json.dump(data, f)
    plan = json.loads(ops.target_cmd("reload", "--dry-run", path, "--json").stdout)
    assert [(c["action"], c.get("nsid")) for c in plan["changes"]] == [("add-namespace", 6)]
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN_OPS)
    wait_for("namespaces 1 and 2", lambda: {1, 2} <= set(devices(NQN_OPS)))
    before = len(ops.target.output())
    ops.target.proc.send_signal(signal.SIGHUP)
    wait_for("namespace 6 on the host after SIGHUP", lambda: devices(NQN_OPS).get(6))
    log = ops.target.output()[before:]
    applied = re.findall(r"applied: (.*)", log)
    assert applied == [f"{NQN_OPS}: add namespace 6"], log
    # an invalid edit: refused, the running target unchanged
    data["subsystems"][0]["namespaces"].append({"nsid": 7, "nvmeof_roce": {"backend": "ram"}})
    with open(path, "w") as f:
        json.dump(data, f)
    snapshot = ops.rpc("save_config")
    before = len(ops.target.output())
    ops.target.proc.send_signal(signal.SIGHUP)
    wait_for("the refusal in the log", lambda: "reload refused" in ops.target.output()[before:])
    assert "subsystems[0].namespaces[3].nvmeof_roce.size" in ops.target.output()[before:]
    assert ops.rpc("save_config") == snapshot
    assert set(devices(NQN_OPS)) == {1, 2, 6}
    disconnect_all_quietly()


def test_sigterm_notifies_stopping(ops):
    ops.notify.settimeout(1)
    try:
        while True:
            ops.notify.recv(4096)  # READY/RELOADING messages of the earlier tests
    except socket.timeout:
        pass
    ops.notify.settimeout(30)
    assert ops.target.stop() == 0, ops.target.output()
    assert ops.notify.recv(4096).decode().startswith("STOPPING=1")
    assert not os.path.exists(ops.sock)


def test_nvmet_restore_without_a_saved_file_exits_0(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "nvmeof_roce", "nvmet", "restore", str(tmp_path / "none.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "no saved config, nothing to restore" in proc.stdout, proc.stderr


NQN_RELINK = "nqn.2024-01.io.nvmeof-roce:ops-relink"
RELINK_PORT = "4422"


def controller_of(nqn):
    """/sys/class/nvme/nvmeX of the host's controller of subsystem `nqn`, or None."""
    for ctrl in glob.glob("/sys/class/nvme/nvme*"):
        try:
            if open(f"{ctrl}/subsysnqn").read().strip() == nqn:
                return ctrl
        except OSError:
            pass
    return None


def controller_state(ctrl):
    try:
        return open(f"{ctrl}/state").read().strip()
    except OSError:
        return None  # deleted


def test_kernel_host_reconnects_once_its_subsystem_is_made_again(tmp_path):
    """blktests nvme/061's shape: the port's only subsystem deleted and made again by RPC while the kernel host
    is connected.  Meanwhile the port does not listen (as nvmet's disabled port), so the host's reconnects meet
    no listener and it keeps retrying -- an NVMe Connect answered "unknown subsystem" with DNR would have a
    6.12 host delete the controller -- and once the subsystem is back its controller is live again."""
    cfg = config([{"nqn": NQN_RELINK, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                   "namespaces": [ram_namespace(1, "16M")]}], port=int(RELINK_PORT))
    sock = str(tmp_path / "relink.sock")
    target = ServedTarget(cfg, str(tmp_path / "relink.json"), args=["--rpc-socket", sock]).start()
    ops = Ops(target, sock)
    try:
        nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", RELINK_PORT, "-n", NQN_RELINK, "--ctrl-loss-tmo", "60",
             "--reconnect-delay", "1", "--nr-io-queues", "1")
        ctrl = wait_for("the host's controller", lambda: controller_of(NQN_RELINK))
        wait_for("the controller live", lambda: controller_state(ctrl) == "live")
        wait_for("the namespace", lambda: devices(NQN_RELINK).get(1))

        ops.rpc("nvmf_delete_subsystem", {"nqn": NQN_RELINK})
        wait_for("the host to lose the controller's queues", lambda: controller_state(ctrl) != "live", timeout=30)
        time.sleep(5)  # several reconnect attempts (--reconnect-delay 1) against the port without a subsystem
        assert controller_state(ctrl) in ("connecting", "resetting"), (controller_state(ctrl), target.output()[-4000:])

        ops.rpc("nvmf_create_subsystem", {"nqn": NQN_RELINK, "allow_any_host": True})
        ops.rpc("nvmf_subsystem_add_ns", {"nqn": NQN_RELINK, "namespace": {"nsid": 1, "backend": "ram",
                                                                             "size": "16M"}})
        ops.rpc("nvmf_subsystem_add_listener", {"nqn": NQN_RELINK, "listen_address": {
            "trtype": "rdma", "adrfam": "ipv4", "traddr": LAB_IP, "trsvcid": RELINK_PORT}})
        wait_for("the controller live again", lambda: controller_state(ctrl) == "live", timeout=60)
        dev = wait_for("the namespace again", lambda: devices(NQN_RELINK).get(1))
        with open(dev, "rb") as f:
            assert len(f.read(4096)) == 4096
        assert "unknown or unexported subsystem" not in target.output()
    finally:
        nvme("disconnect", "-n", NQN_RELINK, check=False)
        target.stop()
