"""DH-HMAC-CHAP end to end on a kernel with NVMe in-band authentication (Debian's 6.12 in the lab).

- the kernel host (`nvme connect --dhchap-secret [--dhchap-ctrl-secret]`) to our userspace target, for
  every hash with the null group, ffdhe2048 and ffdhe4096, uni- and bidirectional, with fio verify;
- a wrong host key, a wrong controller key and no key are each refused: the target's log says which,
  the host's dmesg shows an authentication failure;
- our initiator against the kernel's nvmet configured by `nvmeof-roce nvmet apply` from the same file
  our target serves, and against our target.

Skipped on a kernel without CONFIG_NVME_AUTH (Debian's 6.1): `nvmeof-roce lab run --kernel 6.12`.
"""
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from kernel_helpers import save_capture
from targetproc import LAB_IP, ServedTarget, disconnect_all_quietly, namespaces_of, nvme

pytestmark = pytest.mark.lab

SUB = "nqn.2024-01.io.nvmeof-roce:auth"
PORT = 4420


def _kernel_has_auth() -> bool:
    if os.environ.get("NVMEOF_LAB") != "1":
        return True  # conftest skips lab tests outside the guest anyway
    return subprocess.run(["modprobe", "-a", "nvme-auth"], capture_output=True).returncode == 0


if not _kernel_has_auth():
    pytest.skip(f"kernel {os.uname().release} has no NVMe in-band authentication (CONFIG_NVME_AUTH): "
                "run with `nvmeof-roce lab run --kernel 6.12`", allow_module_level=True)


def gen_key(hmac_id: int) -> str:
    """A key from the independent tool: nvme-cli's gen-dhchap-key."""
    length = {0: 32, 1: 32, 2: 48, 3: 64}[hmac_id]
    return nvme("gen-dhchap-key", "-m", str(hmac_id), "-l", str(length), "-n", "nqn.2014-08.org.nvmexpress:x"
                ).stdout.strip()


# One host NQN (and host ID: the kernel refuses one ID under two NQNs) per setting.
CASES = [  # (name, hash, dhgroup, bidirectional)
    ("sha256-null", "hmac(sha256)", "null", False),
    ("sha256-2048-bi", "hmac(sha256)", "ffdhe2048", True),
    ("sha384-2048", "hmac(sha384)", "ffdhe2048", False),
    ("sha384-4096-bi", "hmac(sha384)", "ffdhe4096", True),
    ("sha512-null-bi", "hmac(sha512)", "null", True),
    ("sha512-4096", "hmac(sha512)", "ffdhe4096", False),
]


def host_of(name: str):
    hostid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"nvmeof-roce-auth-{name}"))
    return f"nqn.2014-08.org.nvmexpress:uuid:{hostid}", hostid


@pytest.fixture(scope="module")
def keys():
    out = {}
    for i, (name, _, _, bidi) in enumerate(CASES):
        out[name] = (gen_key(i % 3 + 1), gen_key(3 - i % 3) if bidi else None)
    out["nokey"] = (gen_key(1), gen_key(2))
    return out


def auth_config(keys, namespace_path: str) -> dict:
    """The one file both targets use: hosts in the shape `nvmet save` writes."""
    hosts = []
    for name, hash_name, dhgroup, _ in CASES + [("nokey", "hmac(sha256)", "null", True)]:
        key, ctrl_key = keys[name]
        hosts.append({"nqn": host_of(name)[0], "dhchap": {"key": key, "ctrl_key": ctrl_key or "",
                                                           "hash": hash_name, "dhgroup": dhgroup}})
    return {
        "hosts": hosts,
        "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": LAB_IP,
                                         "trsvcid": str(PORT), "treq": "not specified"},
                   "subsystems": [SUB], "referrals": []}],
        "subsystems": [{"nqn": SUB, "attr": {"allow_any_host": "0"}, "allowed_hosts": [h["nqn"] for h in hosts],
                        "namespaces": [{"nsid": 1, "enable": 1, "device": {"path": namespace_path},
                                        "buffered_io": 1}]}],
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory, keys):
    tmp = tmp_path_factory.mktemp("auth")
    image = "/tmp/nvmeof-auth-ns1.img"  # /tmp: tmpfs in the guest
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    cfg = auth_config(keys, image)
    path = str(tmp / "auth.json")
    return {"config": cfg, "path": path, "tmp": tmp}


@pytest.fixture(scope="module")
def served(setup):
    target = ServedTarget(setup["config"], setup["path"]).start()
    yield target
    disconnect_all_quietly()
    assert target.stop() == 0, target.output()


def dmesg_mark() -> int:
    return len(subprocess.run(["dmesg"], capture_output=True, text=True).stdout.splitlines())


def dmesg_since(mark: int) -> str:
    return "\n".join(subprocess.run(["dmesg"], capture_output=True, text=True).stdout.splitlines()[mark:])


def connect(name, key, ctrl_key=None, check=True):
    hostnqn, hostid = host_of(name)
    args = ["connect", "-t", "rdma", "-a", LAB_IP, "-s", str(PORT), "-n", SUB, "-q", hostnqn, "-I", hostid,
            "-i", "1", "--dhchap-secret", key]
    if ctrl_key:
        args += ["--dhchap-ctrl-secret", ctrl_key]
    return nvme(*args, check=check)


def fio_verify(device):
    proc = subprocess.run(["fio", "--name=auth", f"--filename={device}", "--ioengine=libaio", "--direct=1",
                           "--rw=randwrite", "--bs=4k", "--iodepth=8", "--size=1M", "--verify=crc32c",
                           "--verify_fatal=1", "--verify_state_save=0", "--output-format=json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr + proc.stdout[-2000:]
    job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
    assert job["error"] == 0 and job["write"]["io_bytes"] == 1 << 20


@pytest.mark.parametrize("name,hash_name,dhgroup,bidi", CASES, ids=[c[0] for c in CASES])
def test_kernel_host_authenticates_to_our_target(served, keys, name, hash_name, dhgroup, bidi):
    key, ctrl_key = keys[name]
    mark = dmesg_mark()
    connect(name, key, ctrl_key)
    try:
        (dev,) = namespaces_of(SUB, expect=1)
        fio_verify(dev)
        kernel = dmesg_since(mark)
        assert "qid 0: authenticated" in kernel, kernel
        if name == "sha256-null":
            reauthenticate(served, dev, key, host_of(name)[0])
    finally:
        nvme("disconnect", "-n", SUB, check=False)
    log = served.output()
    host = host_of(name)[0]
    expect = f"queue 0 (host {host}): authenticated ({'bidirectional, ' if bidi else ''}{hash_name}, {dhgroup})"
    assert expect in log, log[-3000:]
    assert f"queue 1 (host {host}): authenticated" in log  # the I/O queue authenticated on its own
    time.sleep(0.3)


def reauthenticate(served, dev, key, host):
    """The host re-authenticates a live controller (writing its dhchap_secret); I/O goes on after it."""
    ctrl = os.path.basename(dev)[:dev.rindex("n") - len("/dev/")]
    line = f"queue 0 (host {host}): authenticated"
    before = served.output().count(line)
    with open(f"/sys/class/nvme/{ctrl}/dhchap_secret", "w") as f:
        f.write(key)
    deadline = time.monotonic() + 20
    while served.output().count(line) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert served.output().count(line) > before, served.output()[-2000:]
    fio_verify(dev)


def _refused(served, name, key, ctrl_key, target_says, host_says):
    before = len(served.output())
    mark = dmesg_mark()
    proc = connect(name, key, ctrl_key, check=False)
    assert proc.returncode != 0, "the connect should have been refused"
    kernel = dmesg_since(mark)
    assert host_says in kernel, kernel
    assert "rdma" not in kernel.lower() or "authentic" in kernel.lower()  # an authentication failure, not transport
    deadline = time.monotonic() + 10
    while target_says not in served.output()[before:] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert target_says in served.output()[before:], served.output()[before:]
    assert not namespaces_of_quiet(SUB)
    save_capture(f"auth-{target_says.replace(' ', '-')}.txt",
                 f"host dmesg:\n{kernel}\n\ntarget log:\n{served.output()[before:]}")
    return kernel


def namespaces_of_quiet(nqn):
    try:
        return namespaces_of(nqn, expect=1, timeout=0.5)
    except AssertionError:
        return []


def test_wrong_host_key_is_refused(served, keys):
    wrong = gen_key(1)
    _refused(served, "sha256-null", wrong, None, "wrong host key", "authentication failed")


def test_wrong_controller_key_is_refused(served, keys):
    key, _ = keys["sha256-2048-bi"]
    _refused(served, "sha256-2048-bi", key, gen_key(3), "wrong controller key", "authentication failed")


def test_no_key_is_refused(served):
    hostnqn, hostid = host_of("nokey")
    before = len(served.output())
    mark = dmesg_mark()
    proc = nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", str(PORT), "-n", SUB, "-q", hostnqn, "-I", hostid,
                check=False)
    assert proc.returncode != 0
    kernel = dmesg_since(mark)
    assert "authentication" in kernel and "qid 0" in kernel, kernel
    deadline = time.monotonic() + 10
    while "never started DH-HMAC-CHAP" not in served.output()[before:] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "never started DH-HMAC-CHAP" in served.output()[before:], served.output()[before:]
    save_capture("auth-no-key.txt", f"host dmesg:\n{kernel}\n\nnvme connect:\n{proc.stderr}\n\n"
                                    f"target log:\n{served.output()[before:]}")


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "nvmeof_roce", *args], capture_output=True, text=True,
                          timeout=timeout)


def initiator_test(name, key, ctrl_key, timeout=10):
    hostnqn, hostid = host_of(name)
    args = ["initiator", "connect-test", "-a", LAB_IP, "-s", str(PORT), "-n", SUB, "-q", hostnqn, "-I", hostid,
            "-S", key, "--blocks", "16", "--timeout", str(timeout), "--json"]
    if ctrl_key:
        args += ["-C", ctrl_key]
    return cli(*args)


def test_our_initiator_authenticates_to_our_target(served, keys):
    key, ctrl_key = keys["sha384-4096-bi"]
    out = initiator_test("sha384-4096-bi", key, ctrl_key)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["ok"]
    wrong = initiator_test("sha384-4096-bi", gen_key(2), None)
    assert wrong.returncode != 0 and "refused authentication" in wrong.stderr, wrong.stderr


def test_our_initiator_authenticates_to_kernel_nvmet(setup, keys, served):
    """The same config file, applied to the kernel's nvmet (our target stopped: same address and port)."""
    assert served.stop() == 0, served.output()
    subprocess.run(["modprobe", "-a", "nvmet", "nvmet_rdma"], check=True)
    applied = cli("nvmet", "apply", setup["path"], "--json")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    try:
        shown = json.loads(cli("nvmet", "show", "--json").stdout)
        host = next(h for h in shown["hosts"] if h["nqn"] == host_of("sha512-null-bi")[0])
        assert host["dhchap"]["hash"] == "hmac(sha512)" and host["dhchap"]["key"].startswith("DHHC-1:")
        for name in ("sha512-null-bi", "sha384-2048", "sha384-4096-bi"):
            key, ctrl_key = keys[name]
            out = initiator_test(name, key, ctrl_key)
            assert out.returncode == 0, f"{name}: {out.stdout}{out.stderr}"
            assert json.loads(out.stdout)["ok"]
        key, ctrl_key = keys["sha256-2048-bi"]
        wrong = initiator_test("sha256-2048-bi", key, gen_key(3))
        assert wrong.returncode != 0 and "controller authentication failed" in wrong.stderr, wrong.stderr
        mark = dmesg_mark()
        wrong = initiator_test("sha256-null", gen_key(1), None, timeout=3)
        assert wrong.returncode != 0 and "refused authentication" in wrong.stderr, wrong.stderr
        save_capture("auth-nvmet-wrong-host-key.dmesg", dmesg_since(mark))
    finally:
        from nvmeof_roce.config import parse_config
        from nvmeof_roce.kernel import apply as applymod
        from nvmeof_roce.kernel.nvmet import Root
        applymod.remove(Root(), parse_config(setup["config"], setup["path"]))  # exactly what this test made


# ------------------------------------------------------------------ key rotation while hosts are connected

ROT_PORT = 4421
ROT_A = "nqn.2024-01.io.nvmeof-roce:rotate-a"
ROT_B = "nqn.2024-01.io.nvmeof-roce:rotate-b"


def _rotation_config(key_a: str, key_b: str) -> dict:
    host_a, host_b = host_of("rotate-a")[0], host_of("rotate-b")[0]
    ram = {"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "32M"}}
    return {
        "hosts": [{"nqn": host_a, "dhchap": {"key": key_a, "hash": "hmac(sha256)", "dhgroup": "ffdhe2048"}},
                  {"nqn": host_b, "dhchap": {"key": key_b, "hash": "hmac(sha256)", "dhgroup": "null"}}],
        "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": LAB_IP,
                                         "trsvcid": str(ROT_PORT)}, "subsystems": [ROT_A, ROT_B]}],
        "subsystems": [{"nqn": ROT_A, "attr": {"allow_any_host": "0"}, "allowed_hosts": [host_a],
                        "namespaces": [ram]},
                       {"nqn": ROT_B, "attr": {"allow_any_host": "0"}, "allowed_hosts": [host_b],
                        "namespaces": [ram]}],
    }


def _connect_rot(name, sub, key, check=True):
    hostnqn, hostid = host_of(name)
    return nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", str(ROT_PORT), "-n", sub, "-q", hostnqn, "-I",
                hostid, "-i", "1", "--dhchap-secret", key, check=check)


def _wait_for(served, text, start, timeout=20):
    deadline = time.monotonic() + timeout
    while text not in served.output()[start:] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert text in served.output()[start:], served.output()[start:][-3000:]


def _refused_then_accepted(served, old, new):
    """The old key no longer connects host A; the new one does, with verified I/O."""
    proc = _connect_rot("rotate-a", ROT_A, old, check=False)
    assert proc.returncode != 0, "the old key must be refused"
    assert not namespaces_of_quiet(ROT_A)
    _connect_rot("rotate-a", ROT_A, new)
    try:
        (dev,) = namespaces_of(ROT_A, expect=1)
        fio_verify(dev)
    finally:
        nvme("disconnect", "-n", ROT_A, check=False)


def _write_key_file(path: str, key: str) -> None:
    """As an admin replaces a key file: a new 0600 file renamed over the old one."""
    fd = os.open(path + ".new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.rename(path + ".new", path)


@pytest.mark.long  # over a minute under emulation: `make test-auth-rotation` (6.12), not `make test`
def test_rotate_a_host_key_by_reload_and_by_rpc_while_another_host_runs_fio_verify(tmp_path):
    """Host B runs fio verify on its controller through three rotations of host A's key (SIGHUP reload, the
    nvmf_subsystem_set_keys RPC, then a 0600 key file the config names replaced and SIGHUP): A's old key is
    refused on reconnect, the new one accepted, A's
    controller connected before the rotation keeps working until it disconnects (as nvmet), and B sees no
    error and is never reconnected."""
    k1, k2, k3, k4, kb = gen_key(1), gen_key(1), gen_key(1), gen_key(1), gen_key(1)
    path = str(tmp_path / "rotate.json")
    sock = str(tmp_path / "rotate.sock")
    served = ServedTarget(_rotation_config(k1, kb), path, args=["--rpc-socket", sock]).start()
    fio_b = None
    try:
        _connect_rot("rotate-b", ROT_B, kb)
        (dev_b,) = namespaces_of(ROT_B, expect=1)
        # fio verify jobs back to back on B until the rotations are done (the loop stops at its first error)
        stop = str(tmp_path / "stop")
        fio = (f"fio --name=hostb --filename={dev_b} --ioengine=libaio --direct=1 --rw=randwrite --bs=4k "
               "--iodepth=4 --size=2M --verify=crc32c --verify_fatal=1 --verify_state_save=0 --output-format=terse")
        fio_b = subprocess.Popen(["sh", "-c", f"n=0; while [ ! -e {stop} ]; do {fio} >/dev/null || exit 1; "
                                  "n=$((n+1)); done; echo $n"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
        _connect_rot("rotate-a", ROT_A, k1)
        (dev_a,) = namespaces_of(ROT_A, expect=1)

        # 1. by reload: the file gets k2, SIGHUP
        start = len(served.output())
        with open(path, "w") as f:
            json.dump(_rotation_config(k2, kb), f)
        served.proc.send_signal(signal.SIGHUP)
        _wait_for(served, "DH-HMAC-CHAP settings changed", start)
        fio_verify(dev_a)  # connected with k1 before the rotation: unaffected until it reconnects
        nvme("disconnect", "-n", ROT_A)
        _refused_then_accepted(served, k1, k2)

        # 2. by RPC
        out = cli("rpc", "nvmf_subsystem_set_keys", json.dumps({"nqn": ROT_A, "host": host_of("rotate-a")[0],
                                                                 "dhchap_key": k3}), "--socket", sock)
        assert out.returncode == 0, out.stdout + out.stderr
        _refused_then_accepted(served, k2, k3)

        # 3. by key file: the config names a 0600 file holding k3; then the file is replaced with k4, SIGHUP
        key_path = str(tmp_path / "rotate-a.key")
        _write_key_file(key_path, k3)
        start = len(served.output())
        with open(path, "w") as f:
            json.dump(_rotation_config(key_path, kb), f)
        served.proc.send_signal(signal.SIGHUP)
        _wait_for(served, "DH-HMAC-CHAP settings changed", start)
        _connect_rot("rotate-a", ROT_A, k3)
        (dev_a,) = namespaces_of(ROT_A, expect=1)
        start = len(served.output())
        _write_key_file(key_path, k4)
        served.proc.send_signal(signal.SIGHUP)
        _wait_for(served, f"DH-HMAC-CHAP key changed in key file {key_path}", start)
        fio_verify(dev_a)  # connected with k3 before the file was replaced: unaffected
        nvme("disconnect", "-n", ROT_A)
        _refused_then_accepted(served, k3, k4)
        for secret in (k1, k2, k3, k4, kb):
            assert secret not in served.output()  # no key in the log

        assert fio_b.poll() is None, fio_b.communicate()  # still running: no error on B so far
        open(stop, "w").close()
        stdout, stderr = fio_b.communicate(timeout=120)
        assert fio_b.returncode == 0 and int(stdout) >= 2, stderr + stdout  # verified jobs, none failed
        host_b = host_of("rotate-b")[0]
        assert f"host {host_b}) deleted" not in served.output()  # B was never reconnected
        save_capture("auth-rotation.txt", served.output()[-6000:])
    finally:
        if fio_b is not None and fio_b.poll() is None:
            fio_b.kill()
        nvme("disconnect", "-n", ROT_A, check=False)
        nvme("disconnect", "-n", ROT_B, check=False)
        assert served.stop() == 0, served.output()[-3000:]
