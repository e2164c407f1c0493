"""A RAM namespace resized live, round after round, while the kernel host writes it and reads it back verified.

Our target serves one RAM namespace on the native data path (the default) over rxe; the kernel host (nvme-rdma)
is connected.  Each round starts a fio job writing 4-128 KiB blocks at QD32 with a new random seed (so new data
and new verify headers) over the first 64 MiB, the region that exists at every size; while it writes, the
namespace is resized by RPC, alternately to 110 MiB and back to 64 MiB (the commit waits for the commands in
flight, docs/native.md).  The host re-reads the size (the Namespace Attribute Changed notice's rescan), then a
second fio run reads back what that round wrote (`--verify_only`): no verify error is allowed.

After each round the target's resident and pinned memory (/proc/PID/status VmRSS, VmPin: rxe pins a memory
registration's pages and counts them there) are recorded with the RPC's round trip, the longest wait of a client
probing the control socket during the round (LoopProbe) and the event loop's longest pass since start; the table
is printed and the memory must stay flat once warm (see RSS_BOUND_MIB).

`make test-extended` runs it (a few minutes in the guest); NVMEOF_LIVE_RESIZE_ROUNDS sets the number of rounds
(`nvmeof-roce lab run --env NVMEOF_LIVE_RESIZE_ROUNDS=10 -- ...`).
"""
import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from nvmeof_roce.control import client
from livechecks import LoopProbe, controller_of, fio_result, memory_mib
from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, namespaces_of, nvme, ram_namespace

pytestmark = [pytest.mark.lab, pytest.mark.extended]

NQN = "nqn.2024-01.io.nvmeof-roce:live-resize"
PORT = 4436
ROUNDS = int(os.environ.get("NVMEOF_LIVE_RESIZE_ROUNDS", "50"))
SMALL_MIB, LARGE_MIB = 64, 110
REGION_MIB = SMALL_MIB  # what exists at both sizes: every fio job stays inside it
WRITE_MIB_PER_ROUND = 32  # per round, at random offsets of the region (fio's random map: no block twice)
WARM_ROUND = 10  # memory is compared from this round on: the first ones fill the pool, the caches, the heap
# Once warm, memory may grow by at most this much over the remaining rounds at the same size.  A namespace's
# old mapping or registration kept by a resize would add its pages (46 MiB or more) at once; a leak of 0.4 MiB
# per resize would cross it in 40 rounds; a Python heap serving 40 more RPCs and status calls stays well below.
RSS_BOUND_MIB = 16


def fio_args(device, seed):
    """One round's fio job: the same arguments write and verify (--verify_only replays the offsets and sizes)."""
    return ["fio", "--name=resize", f"--filename={device}", "--ioengine=libaio", "--direct=1", "--rw=randwrite",
            "--bsrange=4k-128k", "--iodepth=32", f"--size={REGION_MIB}M", f"--io_size={WRITE_MIB_PER_ROUND}M",
            f"--randseed={seed}", "--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0",
            "--output-format=json"]


def host_size_bytes(device):
    with open(f"/sys/block/{os.path.basename(device)}/size") as f:
        return int(f.read()) * 512


def wait_for_host_size(device, size, timeout=10.0):
    """Wait for the host's own rescan (the notice); after `timeout`, ask for one (nvme ns-rescan).  True when the
    notice sufficed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if host_size_bytes(device) == size:
            return True
        time.sleep(0.05)
    nvme("ns-rescan", controller_of(NQN))
    deadline = time.monotonic() + 10
    while host_size_bytes(device) != size:
        assert time.monotonic() < deadline, f"{device}: the host sees {host_size_bytes(device)} bytes, not {size}"
        time.sleep(0.05)
    return False


def namespace_status(sock):
    status = client.call(sock, "nvmeof_get_status")
    ns = next(n for s in status["subsystems"] if s["nqn"] == NQN for n in s["namespaces"] if n["nsid"] == 1)
    return status, ns


@pytest.fixture
def served(tmp_path):
    pytest.importorskip("nvmeof_roce._native")
    sock = str(tmp_path / "resize.sock")
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                   "namespaces": [ram_namespace(1, f"{SMALL_MIB}M", 512)]}], port=PORT)
    target = ServedTarget(cfg, str(tmp_path / "resize.json"), args=["--rpc-socket", sock]).start(timeout=240)
    target.sock = sock
    yield target
    disconnect_all_quietly()
    assert target.stop() == 0, target.output()[-4000:]


def test_ram_namespace_resized_live_under_verified_writes_keeps_data_and_memory_flat(served):
    status, _ = namespace_status(served.sock)
    assert status["data_path"] == "native", status["data_path"]
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", str(PORT), "-n", NQN)
    device = namespaces_of(NQN, expect=1)[0]
    assert host_size_bytes(device) == SMALL_MIB << 20

    with LoopProbe(served.sock) as baseline:  # the same writes without a resize: what the loop's I/O costs alone
        quiet = subprocess.run(fio_args(device, 0x5EED0000) + ["--do_verify=0"], capture_output=True, text=True,
                               timeout=300)
    fio_result(quiet, quiet.stdout, quiet.stderr, "write without a resize")
    before_ms = namespace_status(served.sock)[0]["transport"]["loop"]["longest_pass_s"] * 1000
    print(f"\nwhile fio writes without a resize: the probe's longest wait {baseline.longest_ms:.1f} ms; the loop's "
          f"longest pass since start {before_ms:.1f} ms")
    # per round: (round, MiB, RSS MiB, VmPin MiB, RPC ms, fio still writing at the answer, notice sufficed,
    # the probe's longest wait in ms, the loop's longest pass since start in ms)
    rows = []
    print(f"{'round':>5} {'MiB':>4} {'RSS MiB':>8} {'VmPin MiB':>9} {'RPC ms':>8} {'under I/O':>9} "
          f"{'notice':>6} {'probe ms':>8} {'longest pass ms':>15}")  # a row per round as it ends (-s shows them)
    started = time.monotonic()
    for rnd in range(1, ROUNDS + 1):
        size_mib = LARGE_MIB if rnd % 2 else SMALL_MIB
        seed = 0x5EED0000 + rnd
        _, ns = namespace_status(served.sock)
        writes_before = ns["write_commands"]
        # the probe runs while fio writes, the resize is committed and the host takes the new size
        with LoopProbe(served.sock) as probe:
            writer = subprocess.Popen(fio_args(device, seed) + ["--do_verify=0"], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
            try:
                # resize once the host's writes reach the namespace: the commit has commands in flight to wait for
                deadline = time.monotonic() + 30
                while namespace_status(served.sock)[1]["write_commands"] == writes_before:
                    assert writer.poll() is None, f"round {rnd}: fio ended before writing: {writer.communicate()}"
                    assert time.monotonic() < deadline, f"round {rnd}: no write reached the namespace in 30 s"
                    time.sleep(0.02)
                t0 = time.monotonic()
                answer = client.call(served.sock, "nvmf_subsystem_resize_ns",
                                     {"nqn": NQN, "nsid": 1, "size": f"{size_mib}M"})
                rpc_ms = (time.monotonic() - t0) * 1000
                under_io = writer.poll() is None
            finally:
                out, err = writer.communicate(timeout=300)
            written = fio_result(writer, out, err, f"write, round {rnd}")["write"]["io_bytes"]
            assert answer["size_bytes"] == size_mib << 20, answer
            notice = wait_for_host_size(device, size_mib << 20)
        check = subprocess.run(fio_args(device, seed) + ["--verify_only"], capture_output=True, text=True,
                               timeout=300)
        job = fio_result(check, check.stdout, check.stderr, f"--verify_only, round {rnd}")
        assert job["read"]["io_bytes"] == written >= WRITE_MIB_PER_ROUND << 20, (written, job["read"])
        rss, pinned = memory_mib(served.proc.pid)
        status, ns = namespace_status(served.sock)
        assert ns["size_bytes"] == size_mib << 20 and ns["errors"] == 0, ns
        assert status["internal_errors"] == 0, status["internal_errors"]
        longest_ms = status["transport"]["loop"]["longest_pass_s"] * 1000
        rows.append((rnd, size_mib, rss, pinned, rpc_ms, under_io, notice, probe.longest_ms, longest_ms))
        print(f"{rnd:>5} {size_mib:>4} {rss:>8.1f} {pinned:>9.1f} {rpc_ms:>8.1f} {'yes' if under_io else 'no':>9} "
              f"{'yes' if notice else 'no':>6} {probe.longest_ms:>8.1f} {longest_ms:>15.1f}", flush=True)
    elapsed = time.monotonic() - started

    print(f"{ROUNDS} live resizes ({SMALL_MIB} <-> {LARGE_MIB} MiB) under fio's verified writes, "
          f"{WRITE_MIB_PER_ROUND} MiB per round, in {elapsed:.0f} s")
    rpc, probe = [r[4] for r in rows], [r[7] for r in rows]
    for size_mib in (LARGE_MIB, SMALL_MIB):
        of_size = [r for r in rows if r[1] == size_mib]
        print(f"to {size_mib} MiB: RPC median {statistics.median(r[4] for r in of_size):.1f} ms, max "
              f"{max(r[4] for r in of_size):.1f} ms; probe median {statistics.median(r[7] for r in of_size):.1f} ms, "
              f"max {max(r[7] for r in of_size):.1f} ms")
    print(f"RPC round trip: median {statistics.median(rpc):.1f} ms, max {max(rpc):.1f} ms; resizes committed while "
          f"fio was still writing: {sum(r[5] for r in rows)} of {ROUNDS}; sizes seen by the host from the notice "
          f"alone: {sum(r[6] for r in rows)} of {ROUNDS}; the probe's longest wait per round: median "
          f"{statistics.median(probe):.1f} ms, max {max(probe):.1f} ms; the loop's longest pass since start: "
          f"{rows[-1][8]:.1f} ms")
    cli_status = subprocess.run([sys.executable, "-m", "nvmeof_roce", "target", "status", "--json", "--socket",
                                 served.sock], capture_output=True, text=True, timeout=120)
    assert cli_status.returncode == 0, cli_status.stderr
    print("target status --json: transport.loop =", json.loads(cli_status.stdout)["transport"]["loop"])

    growth = {}
    for size_mib in (SMALL_MIB, LARGE_MIB):
        warm = [r for r in rows if r[0] >= WARM_ROUND and r[1] == size_mib]
        if len(warm) < 2:
            continue
        growth[size_mib] = (max(r[2] for r in warm) - warm[0][2], max(r[3] for r in warm) - warm[0][3])
    print("memory growth from round", WARM_ROUND, "on, per size (RSS MiB, VmPin MiB):", growth)
    for size_mib, (rss_growth, pin_growth) in growth.items():
        assert rss_growth < RSS_BOUND_MIB and pin_growth < RSS_BOUND_MIB, (
            f"at {size_mib} MiB the target's memory grew by {rss_growth:.1f} MiB RSS, {pin_growth:.1f} MiB pinned "
            f"after round {WARM_ROUND}")
    assert all(r[5] for r in rows), "a resize was committed after fio's writes had ended: write more per round"
    assert "Traceback" not in served.output()
