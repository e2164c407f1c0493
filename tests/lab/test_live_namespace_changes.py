"""A file namespace replaced live, and an NSID removed and re-added, round after round, while the kernel host writes
them; what the target acknowledged is read back verified.

Our target serves two file namespaces on the native data path (the default) over rxe; the kernel host (nvme-rdma)
is connected.  Through every round of both tests a background loop of fio runs writes NSID 1 and reads it back
verified (4-128 KiB at QD32, a new seed per run): not one of its runs may fail, as a change of NSID 2 pauses the
subsystem (docs/native.md, "Quiesce") and must only hold NSID 1's commands, never fail them.

Replaced: NSID 2's file has two names (a hard link, as an admin moving a file to a new path keeps it while both
exist).  Each round fio writes 32 MiB of NSID 2 at random offsets, 4-128 KiB at QD32 with a new seed; once its
writes reach the namespace the config is reloaded (`nvmeof_reload_config`) naming the file by its other name, which
replaces the namespace (control/live.py ReplaceNamespace: the commit waits for the namespace's commands in flight,
the old backend closes after its last one, the new one takes the file lock over).  The namespace keeps its
configured UUID, so the host sees the same namespace: the Namespace Attribute Changed notice makes it re-identify
NSID 2, its identifiers are unchanged, and it keeps the block device (the same /dev/nvmeXnY); its writes in flight
wait through the pause and none fails.  (Without a configured UUID each replacement would bring a new random one,
and the host would drop the block device: "identifiers changed".)  Then `fio --verify_only` reads back the round.

Removed and re-added: each round fio writes NSID 2 with `--verify_state_save=1`; once its writes reach the
namespace, `nvmf_subsystem_remove_ns` removes it.  The host's writes then fail (Invalid Namespace from the target,
then no path once the host's rescan removed the block device), so fio ends with an error, as expected, and saves
which of its writes completed.  Once the host's block device of NSID 2 is gone, `nvmf_subsystem_add_ns` adds the
same file again with the same UUID; the host creates a new block device (found by its NSID, not by a name), and
`fio --verify_only --verify_state_load=1` reads back exactly the writes fio saw acknowledged: 0 verify errors.

Each round records the RPC's round trip, the longest wait of a client probing the control socket (LoopProbe), the
event loop's longest pass, the target's VmRSS and VmPin, its open descriptors (all, and those on NSID 2's file);
the table is printed (-s shows it) and memory and descriptors must stay flat once warm.

`make test-extended` runs them (minutes in the guest); NVMEOF_LIVE_NS_ROUNDS sets the rounds of each (20:
`nvmeof-roce lab run --env NVMEOF_LIVE_NS_ROUNDS=5 -- ...`).
"""
import errno
import glob
import json
import os
import statistics
import subprocess
import time

import pytest

from nvmeof_roce.control import client
from livechecks import LoopProbe, Repeating, controller_of, fio_job, fio_result, memory_mib, open_descriptors
from targetproc import LAB_IP, ServedTarget, nsid_of, config, disconnect_all_quietly, file_namespace, nvme

pytestmark = [pytest.mark.lab, pytest.mark.extended]

NQN = "nqn.2024-01.io.nvmeof-roce:live-ns"
PORT = 4437
ROUNDS = int(os.environ.get("NVMEOF_LIVE_NS_ROUNDS", "20"))
NS_MIB = 64
WRITE_MIB_PER_ROUND = 32  # replaced: per round, at random offsets (fio's random map: no block twice)
REMOVE_AFTER_WRITES = 200  # removed: the namespace goes once this many of the round's writes reached it
UUID2 = "6d1f0c52-6a43-4b7e-9f55-2f0e8e1a7c02"  # NSID 2's, kept by every replacement and re-add
WARM_ROUND = 5  # memory and descriptors are compared from this round on (pools, caches and the heap are warm)
# Once warm, memory may grow by at most this much over the remaining rounds: an old backend, ring or bounce
# registration kept by each change would add megabytes a round; a Python heap serving the RPCs stays below.
RSS_BOUND_MIB = 16
# ... and the descriptors by at most this many (a control-socket connection being closed as they are counted).
FD_SLACK = 2
# What the host's writes of a removed namespace end with: Invalid Namespace (the kernel's BLK_STS_NOTSUPP), an I/O
# error, or no device once the rescan removed it.
HOST_ERRORS = (errno.EOPNOTSUPP, errno.EIO, errno.ENXIO, errno.ENODEV)


def fio_args(device, seed, name, io_mib):
    """A round's fio job on NSID 2: the same arguments write and verify (--verify_only replays them)."""
    return ["fio", f"--name={name}", f"--filename={device}", "--ioengine=libaio", "--direct=1", "--rw=randwrite",
            "--bsrange=4k-128k", "--iodepth=32", f"--size={NS_MIB}M", f"--io_size={io_mib}M",
            f"--randseed={seed}", "--verify=crc32c", "--verify_fatal=1", "--output-format=json"]


def namespace_status(sock, nsid):
    """The target's status and namespace `nsid`'s (None when it has none)."""
    status = client.call(sock, "nvmeof_get_status")
    sub = next(s for s in status["subsystems"] if s["nqn"] == NQN)
    return status, next((n for n in sub["namespaces"] if n["nsid"] == nsid), None)


def host_device(nsid):
    """The host's block device of NSID `nsid` of NQN, by the NSID the driver reports; None when it has none."""
    for subsys in glob.glob("/sys/class/nvme-subsystem/nvme-subsys*"):
        with open(f"{subsys}/subsysnqn") as f:
            if f.read().strip() != NQN:
                continue
        for disk in glob.glob(f"{subsys}/nvme*n*"):
            name = os.path.basename(disk)
            try:
                if nsid_of(name) == nsid:
                    return "/dev/" + name
            except OSError:
                pass  # going away
    return None


def wait_for_host_device(nsid, present, timeout=10.0):
    """Wait until the host has (or no longer has) a block device of `nsid`: from the notice's rescan first, then,
    after `timeout`, from an `nvme ns-rescan`.  Returns (device or None, True when the notice sufficed)."""
    for notice, wait in ((True, timeout), (False, 20.0)):
        if not notice:
            nvme("ns-rescan", controller_of(NQN))
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            device = host_device(nsid)
            if (device is not None) == present:
                return device, notice
            time.sleep(0.05)
    raise AssertionError(f"the host {'has no' if present else 'still has a'} block device of NSID {nsid}: "
                         f"{host_device(nsid)}")


class VerifiedWriter(Repeating):
    """fio writing and reading back NSID 1 in a loop on a thread (each run 8 MiB of 4-128 KiB at QD32, a new
    seed), until stopped: it must never fail while NSID 2 changes beside it."""

    join_timeout = 600.0

    def __init__(self, device, workdir):
        super().__init__()
        self.device, self.workdir = device, workdir
        self.runs, self.failures = 0, []

    def step(self):
        proc = subprocess.run(
            ["fio", "--name=beside", f"--filename={self.device}", "--ioengine=libaio", "--direct=1",
             "--rw=randwrite", "--bsrange=4k-128k", "--iodepth=32", f"--size={NS_MIB}M", "--io_size=8M",
             f"--randseed={0xB5D0000 + self.runs}", "--verify=crc32c", "--do_verify=1", "--verify_fatal=1",
             "--verify_state_save=0", "--output-format=json"],
            capture_output=True, text=True, timeout=600, cwd=self.workdir)
        self.runs += 1
        try:
            error = fio_job(proc.stdout, proc.stderr, "beside")["error"]
        except (AssertionError, ValueError) as exc:
            error = exc
        if proc.returncode != 0 or error != 0:
            self.failures.append(f"run {self.runs}: exit {proc.returncode}, error {error}: {proc.stderr[-2000:]}")

    def check(self, ended):
        assert ended, "fio on NSID 1 did not end"


@pytest.fixture
def served(tmp_path):
    pytest.importorskip("nvmeof_roce._native")
    sock = str(tmp_path / "live-ns.sock")
    target = ServedTarget(namespaces_config(tmp_path, str(tmp_path / "ns2.img")), str(tmp_path / "live-ns.json"),
                          args=["--rpc-socket", sock]).start(timeout=240)
    target.sock = sock
    target.tmp = tmp_path
    yield target
    disconnect_all_quietly()
    assert target.stop() == 0, target.output()[-4000:]


def namespaces_config(tmp_path, ns2_path):
    ns2 = file_namespace(2, ns2_path, f"{NS_MIB}M", 512)
    ns2["device"]["uuid"] = UUID2
    return config([{"nqn": NQN, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                    "namespaces": [file_namespace(1, str(tmp_path / "ns1.img"), f"{NS_MIB}M", 512), ns2]}],
                  port=PORT)


def connect(served):
    status, ns2 = namespace_status(served.sock, 2)
    assert status["data_path"] == "native", status["data_path"]
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", str(PORT), "-n", NQN)
    ns1_device, _ = wait_for_host_device(1, present=True, timeout=15)
    ns2_device, _ = wait_for_host_device(2, present=True, timeout=15)
    print(f"\nNSID 2: {ns2['path']}, I/O engine {ns2['io']}")
    return ns1_device, ns2_device


def wait_for_writes(sock, writes_before, writer, what, count=1):
    """Wait until `count` more of the host's writes reached NSID 2 while `writer` still runs."""
    deadline = time.monotonic() + 60
    while namespace_status(sock, 2)[1]["write_commands"] < writes_before + count:
        assert writer.poll() is None, f"{what}: fio ended before writing: {writer.communicate()}"
        assert time.monotonic() < deadline, f"{what}: {count} writes did not reach NSID 2 in 60 s"
        time.sleep(0.02)


class Rounds:
    """The per-round table: printed as each round ends, checked for flat memory and descriptors at the end."""
    def __init__(self, served, rpc):
        self.served, self.rows = served, []
        print(f"{'round':>5} {'RSS MiB':>8} {'VmPin MiB':>9} {'fds':>4} {'on file':>7} {rpc + ' ms':>10} "
              f"{'under I/O':>9} {'notice':>6} {'probe ms':>8} {'longest pass ms':>15} {'MiB verified':>12} "
              f"{'add ms' if rpc == 'remove' else ''}")

    def add(self, rnd, rpc_ms, under_io, notice, probe_ms, verified_bytes, path, add_ms=None):
        pid = self.served.proc.pid
        rss, pinned = memory_mib(pid)
        fds, on_file = open_descriptors(pid), open_descriptors(pid, path)
        status, ns = namespace_status(self.served.sock, 2)
        assert ns["errors"] == 0 and status["internal_errors"] == 0, (ns, status["internal_errors"])
        longest_ms = status["transport"]["loop"]["longest_pass_s"] * 1000
        row = dict(round=rnd, rss=rss, pinned=pinned, fds=fds, on_file=on_file, rpc_ms=rpc_ms, under_io=under_io,
                   notice=notice, probe_ms=probe_ms, longest_ms=longest_ms, verified=verified_bytes / (1 << 20),
                   add_ms=add_ms)
        self.rows.append(row)
        print(f"{rnd:>5} {rss:>8.1f} {pinned:>9.1f} {fds:>4} {on_file:>7} {rpc_ms:>10.1f} "
              f"{'yes' if under_io else 'no':>9} {'yes' if notice else 'no':>6} {probe_ms:>8.1f} "
              f"{longest_ms:>15.1f} {row['verified']:>12.1f} {'' if add_ms is None else f'{add_ms:.1f}'}",
              flush=True)

    def _adds(self):
        adds = [r["add_ms"] for r in self.rows if r["add_ms"] is not None]
        return f" (re-add: median {statistics.median(adds):.1f} ms, max {max(adds):.1f} ms)" if adds else ""

    def check(self, what, beside):
        rows = self.rows
        rpc, probe = [r["rpc_ms"] for r in rows], [r["probe_ms"] for r in rows]
        warm = [r for r in rows if r["round"] >= WARM_ROUND] or rows[-1:]
        rss_growth = max(r["rss"] for r in warm) - warm[0]["rss"]
        pin_growth = max(r["pinned"] for r in warm) - warm[0]["pinned"]
        print(f"{len(rows)} rounds ({what}): 0 verify errors, {sum(r['verified'] for r in rows):.0f} MiB verified; "
              f"RPC median {statistics.median(rpc):.1f} ms, max {max(rpc):.1f} ms{self._adds()}; changes made while "
              f"fio was writing: {sum(r['under_io'] for r in rows)} of {len(rows)}; seen by the host from the notice "
              f"alone: {sum(r['notice'] for r in rows)} of {len(rows)}; the probe's longest wait per round: median "
              f"{statistics.median(probe):.1f} ms, max {max(probe):.1f} ms; the loop's longest pass since start "
              f"{rows[-1]['longest_ms']:.1f} ms; RSS {rows[0]['rss']:.1f} -> {rows[-1]['rss']:.1f} MiB (from round "
              f"{warm[0]['round']} on: +{rss_growth:.2f} MiB RSS, +{pin_growth:.2f} MiB VmPin); descriptors "
              f"{rows[0]['fds']} -> {rows[-1]['fds']}, on NSID 2's file {sorted({r['on_file'] for r in rows})}; "
              f"NSID 1 beside it: {beside.runs} fio runs written and verified, {len(beside.failures)} failed")
        assert not beside.failures, "fio on NSID 1 failed while NSID 2 changed:\n" + "\n".join(beside.failures)
        assert beside.runs >= 1
        assert rss_growth < RSS_BOUND_MIB and pin_growth < RSS_BOUND_MIB, (
            f"the target's memory grew by {rss_growth:.1f} MiB RSS, {pin_growth:.1f} MiB pinned after round "
            f"{warm[0]['round']}")
        assert max(r["fds"] for r in warm) - warm[0]["fds"] <= FD_SLACK, [r["fds"] for r in rows]
        assert len({r["on_file"] for r in rows}) == 1, ("the target's descriptors on NSID 2's file changed",
                                                        [r["on_file"] for r in rows])
        assert all(r["under_io"] for r in rows), "a change was made after fio's writes had ended: write more"
        assert "Traceback" not in self.served.output()


def test_file_namespace_replaced_live_under_verified_writes_keeps_data_descriptors_and_memory_flat(served):
    tmp = served.tmp
    paths = [str(tmp / "ns2.img"), str(tmp / "ns2-moved.img")]
    ns1_device, device = connect(served)
    os.link(paths[0], paths[1])
    configs = []
    for i, path in enumerate(paths):
        configs.append(str(tmp / f"live-ns-{i}.json"))
        with open(configs[-1], "w") as f:
            json.dump(namespaces_config(tmp, path), f)
    table = Rounds(served, "reload")
    with VerifiedWriter(ns1_device, str(tmp)) as beside:
        for rnd in range(1, ROUNDS + 1):
            path = paths[rnd % 2]
            seed = 0x5EED1000 + rnd
            args = fio_args(device, seed, "replace", WRITE_MIB_PER_ROUND) + ["--verify_state_save=0"]
            with LoopProbe(served.sock) as probe:
                writes_before = namespace_status(served.sock, 2)[1]["write_commands"]
                writer = subprocess.Popen(args + ["--do_verify=0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True)
                try:
                    wait_for_writes(served.sock, writes_before, writer, f"round {rnd}")
                    t0 = time.monotonic()
                    answer = client.call(served.sock, "nvmeof_reload_config", {"path": configs[rnd % 2]})
                    rpc_ms = (time.monotonic() - t0) * 1000
                    under_io = writer.poll() is None
                finally:
                    out, err = writer.communicate(timeout=300)
            # no write of the host failed: the replacement held them, the host kept its block device
            written = fio_result(writer, out, err, f"write, round {rnd}")["write"]["io_bytes"]
            assert [(c["action"], c.get("nsid")) for c in answer["changes"]] == [("replace-namespace", 2)], answer
            _, ns = namespace_status(served.sock, 2)
            assert ns["path"] == path and ns["uuid"] == UUID2, ns
            assert host_device(2) == device, f"round {rnd}: the host's NSID 2 is now {host_device(2)}, not {device}"
            check = subprocess.run(args + ["--verify_only"], capture_output=True, text=True, timeout=600)
            job = fio_result(check, check.stdout, check.stderr, f"--verify_only, round {rnd}")
            assert job["read"]["io_bytes"] == written >= WRITE_MIB_PER_ROUND << 20, (written, job["read"])
            table.add(rnd, rpc_ms, under_io, True, probe.longest_ms, written, path)
    table.check("file namespace replaced, alternately named by its two links", beside)


def test_nsid_removed_and_re_added_under_writes_keeps_every_acknowledged_write(served):
    tmp = served.tmp
    path = str(tmp / "ns2.img")
    ns1_device, device = connect(served)
    add = {"nqn": NQN, "namespace": {"nsid": 2, "path": path, "uuid": UUID2, "size": f"{NS_MIB}M",
                                     "block_size": 512}}
    table = Rounds(served, "remove")
    ended_with = {}
    with VerifiedWriter(ns1_device, str(tmp)) as beside:
        for rnd in range(1, ROUNDS + 1):
            workdir = tmp / f"round{rnd}"
            workdir.mkdir()
            seed = 0x5EED2000 + rnd
            # one CPU, so one of the host's I/O queues: the writes reach the target in the order fio issued them,
            # and those the removal fails are the last ones issued (fio's saved state assumes it, below)
            args = fio_args(device, seed, "readd", NS_MIB) + ["--verify_state_save=1", "--cpus_allowed=0"]
            with LoopProbe(served.sock) as probe:
                writes_before = namespace_status(served.sock, 2)[1]["write_commands"]
                writer = subprocess.Popen(args + ["--do_verify=0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, cwd=workdir)
                try:
                    wait_for_writes(served.sock, writes_before, writer, f"round {rnd}", REMOVE_AFTER_WRITES)
                    t0 = time.monotonic()
                    assert client.call(served.sock, "nvmf_subsystem_remove_ns", {"nqn": NQN, "nsid": 2}) is True
                    rpc_ms = (time.monotonic() - t0) * 1000
                    under_io = writer.poll() is None
                finally:
                    out, err = writer.communicate(timeout=300)
                # the host's writes after the removal fail: fio ends with an error and saves what completed
                job = fio_job(out, err, f"write, round {rnd}")
                assert writer.returncode != 0 and job["error"] in HOST_ERRORS, (
                    f"round {rnd}: fio ended with {writer.returncode}, error {job['error']}: {err[-2000:]}")
                ended_with[job["error"]] = ended_with.get(job["error"], 0) + 1
                written = job["write"]["io_bytes"]
                assert namespace_status(served.sock, 2)[1] is None
                _, gone_by_notice = wait_for_host_device(2, present=False)
                state = glob.glob(str(workdir / "*-verify.state"))
                assert state, f"round {rnd}: fio saved no verify state in {workdir}"
                t0 = time.monotonic()
                assert client.call(served.sock, "nvmf_subsystem_add_ns", add) == 2
                add_ms = (time.monotonic() - t0) * 1000
                device, back_by_notice = wait_for_host_device(2, present=True)
            check = subprocess.run([a if not a.startswith("--filename=") else f"--filename={device}" for a in args]
                                   + ["--verify_only", "--verify_state_load=1", "--verify_state_save=0",
                                      "--iodepth=1"],
                                   capture_output=True, text=True, timeout=600, cwd=workdir)
            job = fio_result(check, check.stdout, check.stderr, f"--verify_only of what completed, round {rnd}")
            verified = job["read"]["io_bytes"]
            # fio's saved state: how many writes it issued, and where the last iodepth (32) of those that succeeded
            # went.  The read-back verifies every write issued before the last 32, then those of the last 32 up to
            # the first that did not succeed; it checks that window as it reads, one at a time (--iodepth=1: at
            # QD32 it would read 32 further before checking).  As the failed writes are the last ones issued, it
            # verifies each acknowledged write: exactly the bytes fio wrote.
            assert verified == written > 0, f"round {rnd}: {verified} bytes verified of {written} written"
            for p in state:
                os.unlink(p)
            table.add(rnd, rpc_ms, under_io, gone_by_notice and back_by_notice, probe.longest_ms, verified, path,
                      add_ms)
    print(f"fio's write job ended with errno {ended_with} (rounds per errno)")
    table.check("NSID 2 removed under writes and re-added", beside)
