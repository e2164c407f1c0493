"""Helpers for lab tests: run `nvmeof-roce target serve` as a real process, and nvme-cli calls."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

LAB_IP = "10.99.0.1"


class ServedTarget:
    """`nvmeof-roce target serve CONFIG` in a subprocess; waits until it listens."""

    def __init__(self, config: dict, path: str, log_path: str = None, args=(), env=None):
        self.config = config
        self.path = path
        self.args = list(args)  # more `target serve` options
        self.env = env
        with open(path, "w") as f:
            json.dump(config, f)
        self.ready = path + ".ready"
        self.log_path = log_path or path + ".log"
        self.proc = None

    def start(self, timeout: float = 60.0):
        if os.path.exists(self.ready):
            os.unlink(self.ready)
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen([sys.executable, "-m", "nvmeof_roce", "-v", "target", "serve", self.path,
                                      "--ready-file", self.ready, *self.args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.ready):
            if self.proc.poll() is not None:
                raise AssertionError(f"target exited with {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"target not ready in {timeout} s:\n{self.output()}")
            time.sleep(0.1)
        return self

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"target did not stop within {timeout} s after {sig}:\n{self.output()}")


def nvme(*args, check=True, timeout=60):
    proc = subprocess.run(["nvme", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"nvme {' '.join(args)} failed ({proc.returncode}): {proc.stderr}{proc.stdout}")
    return proc


def namespaces_of(nqn: str, expect: int = 1, timeout: float = 15.0):
    """Block devices (/dev/nvmeXnY) of subsystem `nqn`, sorted by NSID, once `expect` of them exist."""
    deadline = time.monotonic() + timeout
    while True:
        for subsys in glob.glob("/sys/class/nvme-subsystem/nvme-subsys*"):
            with open(f"{subsys}/subsysnqn") as f:
                if f.read().strip() != nqn:
                    continue
            disks = [os.path.basename(p) for p in glob.glob(f"{subsys}/nvme*n*")]
            if len(disks) >= expect:
                disks.sort(key=nsid_of)
                return ["/dev/" + d for d in disks]
        if time.monotonic() > deadline:
            raise AssertionError(f"{expect} namespace(s) of {nqn} did not appear")
        time.sleep(0.1)


def nsid_of(disk: str) -> int:
    """The namespace ID of /dev/DISK from the driver itself (NVME_IOCTL_ID): the disk numbers follow the
    order the kernel finished scanning, which 6.12's asynchronous scan does not keep."""
    import fcntl
    try:
        fd = os.open(f"/dev/{disk}", os.O_RDONLY)
    except OSError:
        return int(open(f"/sys/block/{disk}/nsid").read()) if os.path.exists(f"/sys/block/{disk}/nsid") else 0
    try:
        return fcntl.ioctl(fd, 0x4E40)  # _IO('N', 0x40)
    finally:
        os.close(fd)


def disconnect_all_quietly():
    subprocess.run(["nvme", "disconnect-all"], capture_output=True)


def ram_namespace(nsid, size="64M", block_size=512):
    return {"nsid": nsid, "enable": 1, "nvmeof_roce": {"backend": "ram", "size": size, "block_size": block_size}}


def file_namespace(nsid, path, size="64M", block_size=512):
    return {"nsid": nsid, "enable": 1, "device": {"path": path},
            "nvmeof_roce": {"backend": "file", "size": size, "block_size": block_size}}


def config(subsystems, port=4420, hosts=()):
    return {
        "hosts": [{"nqn": h} for h in hosts],
        "ports": [{"portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": LAB_IP,
                                         "trsvcid": str(port), "treq": "not specified"},
                   "subsystems": [s["nqn"] for s in subsystems], "referrals": []}],
        "subsystems": subsystems,
    }
