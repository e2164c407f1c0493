"""A change to one namespace waits only for that namespace's commands (docs/native.md "References and fencing").

Our target serves one subsystem on the native data path over rxe: namespace 1 a file on an ext4 filesystem (a loop
device), namespace 2 RAM.  The kernel host connects and runs fio on both.  The filesystem is frozen (`fsfreeze -f`:
a write that reaches it waits in the kernel until the thaw), so namespace 1's writes stall on the native rings.
Then namespace 2 is resized by RPC, twice.  Before the per-namespace fence the resize paused the whole subsystem
and waited for namespace 1's stuck writes (up to 30 s, then failed), and namespace 2's I/O waited with it; now the
resize waits only for namespace 2's commands: the RPC answers in milliseconds and fio on namespace 2 never waits
longer than the bound (`drain_timeout`, 10 s), which the test asserts with fio's own largest completion latency.
`make test-extended` runs it.
"""
import json
import signal
import subprocess
import time

import pytest

from kernel_helpers import sh
from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, namespaces_of, nvme, ram_namespace
from test_stalled_device_close import frozen_fs, fio, status, wait_for  # noqa: F401 (frozen_fs: fixture)

pytestmark = [pytest.mark.lab, pytest.mark.extended]

NQN = "nqn.2024-01.io.nvmeof-roce:fence"
PORT = 4438
BOUND_S = 10  # the target's drain_timeout (tunables.py), which the config below sets explicitly


def namespace_commands(sock, nsid):
    st = status(sock)
    ns = next(n for s in st["subsystems"] if s["nqn"] == NQN for n in s["namespaces"] if n["nsid"] == nsid)
    return ns["read_commands"] + ns["write_commands"], ns


def test_a_resize_of_one_namespace_does_not_wait_for_another_namespaces_stalled_writes(tmp_path, frozen_fs):
    pytest.importorskip("nvmeof_roce._native")
    image = frozen_fs / "ns1.img"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    sock = str(tmp_path / "fence.sock")
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                   "namespaces": [{"nsid": 1, "enable": 1, "device": {"path": str(image)},
                                   "nvmeof_roce": {"backend": "file", "size": "64M", "block_size": 512,
                                                   "io_engine": "io_uring"}},
                                  ram_namespace(2, "64M", 512)]}], port=PORT)
    cfg.setdefault("nvmeof_roce", {})["drain_timeout"] = BOUND_S
    target = ServedTarget(cfg, str(tmp_path / "fence.json"), args=["--rpc-socket", sock]).start(timeout=240)
    stalled = free = None
    try:
        assert status(sock)["data_path"] == "native"
        nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", str(PORT), "-n", NQN)
        dev1, dev2 = namespaces_of(NQN, expect=2)
        free = fio(dev2, "ns2", 900)
        stalled = fio(dev1, "ns1", 900)
        wait_for("writes reaching both namespaces",
                 lambda: namespace_commands(sock, 1)[0] > 100 and namespace_commands(sock, 2)[0] > 100, 60)
        sh("fsfreeze", "-f", str(frozen_fs), timeout=60)
        held = wait_for("namespace 1's writes held on the native rings",
                        lambda: (namespace_commands(sock, 1)[1]["io"] or {}).get("native_in_flight", 0), 30)
        from nvmeof_roce.control import client
        answers = []
        for size in ("96M", "64M"):
            before = namespace_commands(sock, 2)[0]
            t0 = time.monotonic()
            answer = client.call(sock, "nvmf_subsystem_resize_ns", {"nqn": NQN, "nsid": 2, "size": size})
            answers.append((time.monotonic() - t0) * 1000)
            assert answer["size_bytes"] == int(size[:-1]) << 20, answer
            time.sleep(2)
            assert namespace_commands(sock, 2)[0] > before, "namespace 2 served nothing after the resize"
        still_held = (namespace_commands(sock, 1)[1]["io"] or {}).get("native_in_flight", 0)
        free.send_signal(signal.SIGINT)
        out, err = free.communicate(timeout=120)
        job = json.loads(out[out.index("{"):])["jobs"][0]
        clat_max_ms = job["write"]["clat_ns"]["max"] / 1e6
        print(f"\nnamespace 1: {held} writes held on the rings by the frozen filesystem ({still_held} still held "
              f"after the resizes); namespace 2 resized twice, the RPC answered in "
              f"{', '.join(f'{ms:.0f}' for ms in answers)} ms; fio on namespace 2: "
              f"{job['write']['io_bytes'] >> 20} MiB, largest completion latency {clat_max_ms:.0f} ms "
              f"(bound {BOUND_S} s)")
        assert still_held, "namespace 1's writes were no longer stalled: the test did not open its window"
        assert job["error"] == 0, f"fio on namespace 2: error {job['error']}: {err}"
        assert clat_max_ms < BOUND_S * 1000, f"a write of namespace 2 waited {clat_max_ms:.0f} ms"
        assert max(answers) < BOUND_S * 1000, answers
        assert status(sock)["internal_errors"] == 0
    finally:
        subprocess.run(["fsfreeze", "-u", str(frozen_fs)], capture_output=True)
        for proc in (stalled, free):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
        disconnect_all_quietly()
        assert target.stop() == 0, target.output()[-4000:]
