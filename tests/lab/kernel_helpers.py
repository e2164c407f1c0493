"""Helpers for the kernel-layer lab tests (nvmet, host, rdma, shell): run the real CLI, make block devices."""
import json
import os
import subprocess
import sys
import time

LAB_IP = "10.99.0.1"
NVMET = "/sys/kernel/config/nvmet"
SHARE = "/mnt/share"
HOSTNQN = open("/etc/nvme/hostnqn").read().strip() if os.path.exists("/etc/nvme/hostnqn") else None


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def cli(*args, ok=True, timeout=300, subprocess_=False):
    """Run `nvmeof-roce ARGS`; with --json in ARGS returns the parsed output, else the result.

    In-process through nvmeof_roce.cli.main (the same code the entry point runs): a new interpreter costs
    ~10 s of imports over the lab's 9p mount under emulation. subprocess_=True runs the real entry point."""
    args = [str(a) for a in args]
    if subprocess_:
        p = subprocess.run([sys.executable, "-m", "nvmeof_roce", *args], capture_output=True, text=True,
                           timeout=timeout)
        proc = Result(p.returncode, p.stdout, p.stderr)
    else:
        import contextlib
        import io
        from nvmeof_roce import cli as climod
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = climod.main(args)
            except SystemExit as exc:       # argparse
                code = exc.code if isinstance(exc.code, int) else 2
        proc = Result(code, out.getvalue(), err.getvalue())
    if ok is True:
        assert proc.returncode == 0, f"nvmeof-roce {' '.join(args)} failed ({proc.returncode}):\n" \
                                     f"{proc.stderr}\n{proc.stdout}"
    elif ok is False:
        assert proc.returncode != 0, f"nvmeof-roce {' '.join(args)} should have failed:\n{proc.stdout}"
    if "--json" in args and proc.returncode == 0:
        return json.loads(proc.stdout)
    return proc


def sh(*args, check=True, timeout=120):
    proc = subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{' '.join(map(str, args))} failed: {proc.stderr}{proc.stdout}"
    return proc


def modprobe(*mods):
    sh("modprobe", "-a", *mods)


def loop_device(path, size_mb):
    """A loop block device over a new file (nvmet exports it as a block namespace)."""
    modprobe("loop")
    with open(path, "wb") as f:
        f.truncate(size_mb << 20)
    return sh("losetup", "--find", "--show", path).stdout.strip()


def loop_detach(dev):
    sh("losetup", "-d", dev, check=False)


def sparse_file(path, size_mb):
    with open(path, "wb") as f:
        f.truncate(size_mb << 20)
    return path


_KEYS = ("nqn", "portid", "nsid", "name", "grpid")


def _key(item):
    return next((str(item[k]) for k in _KEYS if isinstance(item, dict) and k in item), None)


def is_subset(want, have, path=""):
    """Every key/value of `want` is in `have`. Lists of objects are matched by their nqn/portid/nsid/name/grpid,
    lists of strings as sets (the kernel lists them sorted); values compared as strings."""
    if isinstance(want, dict):
        assert isinstance(have, dict), f"{path}: {have!r} is not an object"
        for k, v in want.items():
            assert k in have, f"{path}.{k} missing in {sorted(have)}"
            is_subset(v, have[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(have, list), f"{path}: {have!r} is not a list"
        if all(_key(w) is not None for w in want):
            by = {_key(h): h for h in have}
            for w in want:
                assert _key(w) in by, f"{path}: {_key(w)} missing (kernel has {sorted(by)})"
                is_subset(w, by[_key(w)], f"{path}[{_key(w)}]")
        else:
            assert sorted(map(str, want)) == sorted(map(str, have)), f"{path}: {want!r} != {have!r}"
    else:
        assert str(want) == str(have), f"{path}: file has {want!r}, kernel has {have!r}"


def nvme_json(*args):
    return json.loads(sh("nvme", *args, "-o", "json").stdout or "null")


def block_device_of(nqn, nsid, timeout=10.0):
    """/dev/nvmeXnY of namespace `nsid` of the connected subsystem `nqn` (nvme list -v, our parser)."""
    from nvmeof_roce.kernel.nvme_cli import parse_list
    deadline = time.monotonic() + timeout
    while True:
        for n in parse_list(sh("nvme", "list", "-v", "-o", "json").stdout):
            if n["subnqn"] == nqn and n["nsid"] == nsid and os.path.exists(n["device"]):
                return n["device"]
        if time.monotonic() > deadline:
            raise AssertionError(f"no block device for {nqn} nsid {nsid}")
        time.sleep(0.2)


def disconnect_quietly(*nqns):
    for nqn in nqns:
        subprocess.run(["nvme", "disconnect", "-n", nqn], capture_output=True)


def save_capture(name, text):
    """Keep a real tool output for the unit-test fixtures when the lab runs with --share."""
    if os.path.isdir(SHARE) and os.access(SHARE, os.W_OK):
        d = os.path.join(SHARE, "captured")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name), "w") as f:
            f.write(text)
