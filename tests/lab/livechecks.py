"""What the live-change lab tests (test_live_resize.py, test_live_namespace_changes.py) measure and check the
same way: fio's JSON result, the target's memory and descriptors, the host's controller of a subsystem, and
LoopProbe, the longest wait of a client of the control socket."""
import glob
import json
import os
import threading
import time

from nvmeof_roce.control import client


def fio_result(proc, out, err, what):
    """The job of a fio run that must have succeeded (`proc` its Popen or CompletedProcess)."""
    assert proc.returncode == 0, f"fio {what} failed ({proc.returncode}): {err}\n{out[-3000:]}"
    job = fio_job(out, err, what)
    assert job["error"] == 0, f"fio {what}: error {job['error']}: {err}"
    return job


def fio_job(out, err, what):
    """The one job of fio's --output-format=json output, whatever its outcome."""
    assert "{" in out, f"fio {what} printed no JSON: {err}\n{out[-3000:]}"
    return json.loads(out[out.index("{"):])["jobs"][0]


def memory_mib(pid):
    """VmRSS and VmPin of process `pid`, in MiB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmPin"):
                fields[name] = int(value.split()[0]) / 1024  # kB
    return fields["VmRSS"], fields.get("VmPin", 0.0)


def open_descriptors(pid, path=None):
    """How many descriptors process `pid` has open; with `path`, only those open on that file (its inode,
    whichever of its names opened it)."""
    if path is None:
        return len(os.listdir(f"/proc/{pid}/fd"))
    st = os.stat(path)
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            other = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        count += (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)
    return count


def controller_of(nqn):
    """/dev/nvmeX, the host's controller of subsystem `nqn`."""
    for ctrl in glob.glob("/sys/class/nvme/nvme*"):
        try:
            with open(f"{ctrl}/subsysnqn") as f:
                if f.read().strip() == nqn:
                    return "/dev/" + os.path.basename(ctrl)
        except OSError:
            pass
    raise AssertionError(f"no controller of {nqn}")


class Repeating:
    """`step()` over and over on a thread, `pause` seconds apart, from the start of a `with` block to its end (or
    until a step returns False); the end waits up to `join_timeout` seconds for the step under way, then
    `check()` says what the steps found, unless the block's own failure is already on its way."""

    pause = 0.0
    join_timeout = 120.0

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def step(self):
        raise NotImplementedError

    def check(self, ended: bool):
        """After the thread was joined (`ended`: it did end): assert on what the steps recorded."""

    def _run(self):
        while not self._stop.is_set():
            if self.step() is False:
                return
            self._stop.wait(self.pause)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=self.join_timeout)
        if exc[0] is None:
            self.check(not self._thread.is_alive())


class LoopProbe(Repeating):
    """Asks the control socket for its method list (answered on the event loop, as the I/O is) every 10 ms on a
    thread, and keeps the longest round trip: how long the loop kept a client waiting while it ran.  It includes
    the scheduling of this process on the guest's busy vCPUs, so it bounds the loop's stall from above."""

    pause = 0.01

    def __init__(self, sock):
        super().__init__()
        self.sock = sock
        self.longest_ms = 0.0
        self.error = None

    def step(self):
        t0 = time.monotonic()
        try:
            client.call(self.sock, "rpc_get_methods")
        except Exception as exc:  # noqa: BLE001 -- reported by check, in the test's thread
            self.error = exc
            return False
        self.longest_ms = max(self.longest_ms, (time.monotonic() - t0) * 1000)

    def check(self, ended):
        assert ended, "the control socket stopped answering"
        assert self.error is None, f"the control socket failed while probed: {self.error!r}"
