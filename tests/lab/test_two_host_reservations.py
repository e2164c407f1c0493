"""Reservations from two kernel hosts in one guest (docs/reservations.md): two controllers of one subsystem with
their own host NQN and host ID, reached through their controller devices (/dev/nvmeX with --namespace-id, which go
down that controller's path only; the namespace device of the multipath head would pick one path for both).

The blktests nvme/054 sequence through nvme-cli's resv-* commands (the wrapper `nvmeof-roce host resv-*` runs),
Write Exclusive, Exclusive Access and All Registrants seen from the other host, and the edge cases where kernel
nvmet (drivers/nvme/target/pr.c, Linux 6.13+) and our target answer differently: run against our target and
against kernel nvmet configured through `nvmeof-roce nvmet apply` (as an admin would) in the same guest, each
command's status and, after each step, the Reservation Report (with and without the extended data structure)
compared field by field (test_nvmet_and_ours_compared_field_by_field; skipped where nvmet has no resv_enable).
Against our target only: the holder's reconnect, preempt and abort under the preempted host's fio, and PTPL across a
restart of the target (nvmet has no PTPL)."""
import contextlib
import copy
import glob
import json
import os
import re
import subprocess
import time

import pytest

from nvmeof_roce.kernel.nvme_cli import NvmeCli, NvmeCliError, parse_resv_report
from nvmeof_roce.nvme import status as S
from kernel_helpers import cli, loop_detach, loop_device, modprobe, save_capture
from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, file_namespace, namespaces_of, nvme

pytestmark = [pytest.mark.lab, pytest.mark.extended]  # a few minutes in the guest: make test-extended

NQN = "nqn.2024-01.io.nvmeof-roce:lab-resv"
HOST_A = ("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000aa", "00000000-0000-4000-8000-0000000000aa")
HOST_B = ("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-0000000000bb", "00000000-0000-4000-8000-0000000000bb")
PORT_OF = {HOST_A: "4420", HOST_B: "4421"}
KEY_A, KEY_B = 0xA1, 0xB2
WE, EA, WE_ALL = 1, 2, 5
KINDS = ("ours", "nvmet")  # our target, kernel nvmet
CLI = NvmeCli()


def connect(host) -> str:
    """Connect `host` (NQN, ID) and return its controller device."""
    before = set(glob.glob("/sys/class/nvme/nvme*"))
    # Each host on a port of its own: nvme-cli 2.3 (Debian 12) answers "already connected" for a second host on the
    # same address and service id even with --duplicate-connect, as a lab run showed.
    nvme("connect", "-t", "rdma", "-a", LAB_IP, "-s", PORT_OF[host], "-n", NQN, "--hostnqn", host[0],
         "--hostid", host[1], "--ctrl-loss-tmo=60", "--reconnect-delay=1")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        for path in set(glob.glob("/sys/class/nvme/nvme*")) - before:
            try:
                # live, and its namespace scanned (a command on the controller device goes to its namespace)
                if open(f"{path}/hostnqn").read().strip() == host[0] and \
                        open(f"{path}/state").read().strip() == "live" and glob.glob(f"{path}/nvme*n1"):
                    return "/dev/" + os.path.basename(path)
            except OSError:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no live controller of {host[0]}")


def io(dev: str, write: bool, slba: int = 0):
    """One 512-byte Read or Write through this controller: (ok, what nvme-cli said)."""
    args = ["io-passthru", dev, "--namespace-id=1", "--data-len=512", f"--cdw10={slba}", "--cdw12=0"]
    if write:
        args += ["--opcode=0x01", "--write", "--input-file=/dev/urandom"]
    else:
        args += ["--opcode=0x02", "--read"]
    proc = nvme(*args, check=False)
    return proc.returncode == 0, (proc.stderr + proc.stdout if proc.returncode else "")


def conflict(said: str) -> bool:
    """nvme-cli named the status Reservation Conflict (libnvme's text, or nvme-cli 1.x's RESERVATION_CONFLICT)."""
    return re.search(r"reservation.conflict", said, re.I) is not None


def report(dev: str) -> dict:
    return CLI.resv_report(dev, nsid=1)


def hostid_hex(host) -> str:
    return host[1].replace("-", "")


def status_of(said: str) -> int:
    """The status nvme-cli printed ("NVMe status: NAME: text(0x4083)", or with --output-format=json
    {"error": ..., "type": "nvme", "value": 16515}): Status Code Type and Status Code (0x083 Reservation Conflict,
    0x002 Invalid Field...), without DNR; -1 when it printed no NVMe status."""
    m = re.search(r"NVMe status: .*?\((0x[0-9a-fA-F]+)\)", said, re.S)
    if m:
        return int(m.group(1), 16) & S.CODE_MASK
    m = re.search(r'"type"\s*:\s*"nvme".*?"value"\s*:\s*(\d+)', said, re.S)
    return int(m.group(1)) & S.CODE_MASK if m else -1


OK, INVALID_OPCODE, INVALID_FIELD, CONFLICT = 0, S.INVALID_OPCODE, S.INVALID_FIELD, S.RESERVATION_CONFLICT
HOSTID_INCONSISTENT = S.HOST_ID_INCONSISTENT


def _namespace_config(image: str) -> dict:
    ns = file_namespace(1, image, "64M", 512)
    ns["resv"] = {"enable": "1"}
    return ns


def _two_port_config(ns: dict) -> dict:
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1"}, "allowed_hosts": [], "namespaces": [ns]}])
    second = copy.deepcopy(cfg["ports"][0])
    second["portid"], second["addr"]["trsvcid"] = 2, PORT_OF[HOST_B]
    cfg["ports"].append(second)
    return cfg


class KernelTarget:
    """The same subsystem, namespace (a loop device: 512-byte blocks, as ours) and two ports given to kernel
    nvmet through `nvmeof-roce nvmet apply`.  start() skips the test where that refuses "resv" (nvmet without
    resv_enable: before Linux 6.13), with the refusal as the reason."""

    def __init__(self, path: str):
        self.path = path
        self.loop = None

    def start(self):
        modprobe("nvmet", "nvmet_rdma")
        self.loop = loop_device("/var/tmp/nvmeof-roce-resv-nvmet.img", 64)
        ns = {"nsid": 1, "enable": 1, "device": {"path": self.loop}, "resv": {"enable": "1"}}
        with open(self.path, "w") as f:
            json.dump(_two_port_config(ns), f)
        res = cli("nvmet", "apply", "--no-prune", self.path, ok=None)
        if res.returncode != 0:
            said = (res.stderr + res.stdout).strip()
            self.stop()
            if "resv_enable" in said:
                pytest.skip(f"kernel nvmet of {os.uname().release} has no reservations: {said}")
            raise AssertionError(f"nvmet apply failed: {said}")
        # our nvmet layer set resv_enable before it enabled the namespace
        with open(f"/sys/kernel/config/nvmet/subsystems/{NQN}/namespaces/1/resv_enable") as f:
            assert f.read().strip() in ("1", "Y"), "nvmet apply did not set resv_enable"
        return self

    def stop(self):
        from nvmeof_roce.config import parse_config
        from nvmeof_roce.kernel import apply as applymod
        from nvmeof_roce.kernel.nvmet import Root
        with open(self.path) as f:
            applymod.remove(Root(), parse_config(json.load(f), self.path))
        if self.loop:
            loop_detach(self.loop)
            self.loop = None


def ours_target(tmp_path) -> ServedTarget:
    image = "/var/tmp/nvmeof-roce-resv.img"
    if os.path.exists(image):
        os.unlink(image)
    return ServedTarget(_two_port_config(_namespace_config(image)), str(tmp_path / "resv.json"))


@contextlib.contextmanager
def started(kind: str, tmp_path):
    target = ours_target(tmp_path) if kind == "ours" else KernelTarget(str(tmp_path / "resv-nvmet.json"))
    target.start()
    try:
        yield target
    finally:
        disconnect_all_quietly()
        target.stop()


@pytest.fixture
def served(tmp_path):
    with started("ours", tmp_path) as target:
        yield target


# --------------------------------------------------------------------------------------- the shared sequence

class Run:
    """One target's run of the sequence: for each step the status its command got and then the namespace's
    Reservation Report as nvme-cli prints it (JSON, --eds) and the status of the same report without --eds."""

    def __init__(self, kind: str, a: str):
        self.kind, self.a, self.steps = kind, a, []

    def do(self, label: str, call, *args, **kw) -> int:
        try:
            call(*args, **kw)
            status = OK
        except NvmeCliError as exc:
            status = status_of(exc.message)
            assert status != -1, exc.message  # nvme-cli itself refused: not a target's answer
        self._record(label, status, with_report=True)
        return status

    def io(self, label: str, dev: str, write: bool):
        ok, said = io(dev, write)
        status = OK if ok else status_of(said)
        self._record(label, status, with_report=False)
        return ok, said

    def _record(self, label: str, status: int, with_report: bool):
        step = {"step": label, "status": status}
        if with_report:
            step["report"] = report(self.a)
            # nvme-cli without --eds sets EDS itself for a controller with 128-bit host identifiers (CTRATT bit 0,
            # which both set): what it prints then, or the status it got (printed as a JSON object then)
            proc = nvme("resv-report", self.a, "--namespace-id=1", "--numd=1023", "--output-format=json",
                        check=False)
            step["report_without_eds"] = parse_resv_report(proc.stdout) if proc.returncode == 0 else \
                status_of(proc.stdout + proc.stderr)
            # the Reservation Report with EDS 0 as it goes on the wire: both refuse it, as 8 bytes cannot hold
            # the 128-bit host identifier
            proc = nvme("io-passthru", self.a, "--opcode=0x0e", "--namespace-id=1", "--data-len=4096", "--read",
                        "--cdw10=1023", "--cdw11=0", check=False)
            step["report_eds_0"] = OK if proc.returncode == 0 else status_of(proc.stdout + proc.stderr)
        self.steps.append(step)


# Steps where the specification and kernel nvmet part (docs/reservations.md, "Compared with kernel nvmet"): the
# status each kind answers.  The sequence asserts them for its kind; test_nvmet_and_ours_compared_field_by_field
# asserts the same, and equality for every other step and field.
EDGE_STATUS = {
    # NVMe base spec, Reservation Release: an RTYPE that is not the held reservation's type is Invalid Field in
    # Command.  pr.c's nvmet_pr_release answers Reservation Conflict.
    "A releases its Write Exclusive as Exclusive Access": {"ours": INVALID_FIELD, "nvmet": CONFLICT},
    # Under an All Registrants type every registrant is a reservation holder, and a holder acquiring the type it
    # holds succeeds.  pr.c's nvmet_pr_acquire compares the registrant with its one `holder` pointer (the host that
    # acquired it) and answers the others Reservation Conflict.
    "B acquires the All Registrants reservation it holds": {"ours": OK, "nvmet": CONFLICT},
    # A reserved Reservation Register/Release Action is a reserved field value: Invalid Field in Command.  pr.c's
    # default cases answer Invalid Command Opcode.
    "B registers with the reserved action 3": {"ours": INVALID_FIELD, "nvmet": INVALID_OPCODE},
    "B releases with the reserved action 2": {"ours": INVALID_FIELD, "nvmet": INVALID_OPCODE},
}

# Report fields where the two differ after a step, (step, field) -> {kind: value}.
EDGE_REPORT = {
    # Any holder of an All Registrants reservation releases it (the spec: each registrant is a holder); pr.c's
    # nvmet_pr_release returns success without effect for every registrant but its `holder` pointer.  Both agree
    # again after A's release in the next step.
    ("B releases the All Registrants reservation", "rtype"): {"ours": 0, "nvmet": 5},
    ("B releases the All Registrants reservation", "holds"): {"ours": [False, False], "nvmet": [True, True]},
    # PTPL: ours keeps the state in its reservation file and advertises it (RESCAP bit 0); nvmet has no PTPL
    # (RESCAP bit 0 clear, Report's PTPLS always 0) and accepts CPTPL 11b without keeping it.
    ("B re-registers asking to persist through power loss", "ptpls"): {"ours": 1, "nvmet": 0},
}
# The holder preempting with another host's key (not its own, not 0): the spec's Preempt unregisters the
# registrants with that key and leaves the reservation as it is; pr.c's nvmet_pr_preempt, which looks at
# `holder == reg` before it compares PRKEY, changes the type to the one asked and unregisters nobody.
SELF_PREEMPT = "A, holding Write Exclusive, preempts B's key asking for Exclusive Access"
A_ONLY, A_AND_B = [hostid_hex(HOST_A)], [hostid_hex(HOST_A), hostid_hex(HOST_B)]
EDGE_REPORT.update({
    (SELF_PREEMPT, "rtype"): {"ours": WE, "nvmet": EA}, (SELF_PREEMPT, "regctl"): {"ours": 1, "nvmet": 2},
    (SELF_PREEMPT, "hostid"): {"ours": A_ONLY, "nvmet": A_AND_B},
    (SELF_PREEMPT, "rkey"): {"ours": [KEY_A], "nvmet": [KEY_A, KEY_B]},
    (SELF_PREEMPT, "holds"): {"ours": [True], "nvmet": [True, False]},
    (SELF_PREEMPT, "cntlid"): {"ours": [0xFFFF], "nvmet": [0xFFFF, 0xFFFF]},
})


def edge(label: str, kind: str) -> int:
    return EDGE_STATUS[label][kind]


def the_sequence(kind: str) -> Run:
    """blktests nvme/054 (register, replace, unregister, acquire, release, preempt, clear), Write Exclusive and
    Exclusive Access from the other host, then the edge cases (EDGE_STATUS, EDGE_REPORT).  Asserts what the
    specification fixes; returns the record."""
    b = connect(HOST_B)
    a = connect(HOST_A)
    run = Run(kind, a)
    run.do("connected", lambda: None)
    run.steps[-1]["rescap"] = _rescap(a)
    r = run.steps[-1]["report"]
    assert (r["rtype"], r["regctl"], r["registrants"]) == (0, 0, [])
    assert run.steps[-1]["report_eds_0"] == HOSTID_INCONSISTENT  # 128-bit host identifiers: extended only
    gen = r["generation"]
    # register, replace, unregister (blktests nvme/054)
    assert run.do("A registers key 4", CLI.resv_register, a, nrkey=4, nsid=1) == OK
    r = run.steps[-1]["report"]
    assert [(g["hostid"], g["rkey"], g["holds"]) for g in r["registrants"]] == [(hostid_hex(HOST_A), 4, False)]
    assert r["generation"] == gen + 1
    assert run.do("A replaces key 4 with A1", CLI.resv_register, a, rrega=2, crkey=4, nrkey=KEY_A, nsid=1) == OK
    assert run.steps[-1]["report"]["registrants"][0]["rkey"] == KEY_A
    assert run.do("A unregisters with the old key 4", CLI.resv_register, a, rrega=1, crkey=4, nsid=1) == CONFLICT
    assert run.do("A unregisters", CLI.resv_register, a, rrega=1, crkey=KEY_A, nsid=1) == OK
    assert run.steps[-1]["report"]["registrants"] == []
    # acquire, release
    assert run.do("A registers A1", CLI.resv_register, a, nrkey=KEY_A, nsid=1) == OK
    assert run.do("B registers B2", CLI.resv_register, b, nrkey=KEY_B, nsid=1) == OK
    assert run.do("A acquires Write Exclusive", CLI.resv_acquire, a, WE, KEY_A, nsid=1) == OK
    r = run.steps[-1]["report"]
    assert r["rtype"] == WE and [(g["hostid"], g["holds"]) for g in r["registrants"]] == [
        (hostid_hex(HOST_A), True), (hostid_hex(HOST_B), False)]
    save_capture(f"resv-report-eds-{kind}.json", nvme("resv-report", b, "--namespace-id=1", "--numd=1023", "--eds",
                                                      "--output-format=json").stdout)
    # Write Exclusive: the other host reads, its writes conflict; the holder writes
    assert run.io("B reads under Write Exclusive", b, write=False)[0]
    ok, said = run.io("B writes under Write Exclusive", b, write=True)
    assert not ok and conflict(said), said
    assert run.io("A writes under its Write Exclusive", a, write=True)[0]
    assert run.do("A releases Write Exclusive", CLI.resv_release, a, WE, KEY_A, nsid=1) == OK
    assert run.steps[-1]["report"]["rtype"] == 0 and run.io("B writes, released", b, write=True)[0]
    # Exclusive Access: the other host's reads conflict too
    assert run.do("A acquires Exclusive Access", CLI.resv_acquire, a, EA, KEY_A, nsid=1) == OK
    ok, said = run.io("B reads under Exclusive Access", b, write=False)
    assert not ok and conflict(said), said
    # preempt: B takes it from A (A's registration goes), then clears everything
    assert run.do("B preempts A", CLI.resv_acquire, b, WE, KEY_B, racqa=1, prkey=KEY_A, nsid=1) == OK
    r = run.steps[-1]["report"]
    assert r["rtype"] == WE and [g["hostid"] for g in r["registrants"]] == [hostid_hex(HOST_B)]
    ok, said = run.io("A writes, preempted", a, write=True)
    assert not ok and conflict(said), said
    assert run.do("B clears", CLI.resv_release, b, 0, KEY_B, rrela=1, nsid=1) == OK
    r = run.steps[-1]["report"]
    assert (r["rtype"], r["registrants"]) == (0, []) and run.io("A writes, cleared", a, write=True)[0]

    # the edge cases
    assert run.do("A registers A1 again", CLI.resv_register, a, nrkey=KEY_A, nsid=1) == OK
    assert run.do("B registers B2 again", CLI.resv_register, b, nrkey=KEY_B, nsid=1) == OK
    assert run.do("A acquires Write Exclusive again", CLI.resv_acquire, a, WE, KEY_A, nsid=1) == OK
    label = "A releases its Write Exclusive as Exclusive Access"
    assert run.do(label, CLI.resv_release, a, EA, KEY_A, nsid=1) == edge(label, kind)
    assert run.steps[-1]["report"]["rtype"] == WE  # not released
    assert run.do("A releases Write Exclusive again", CLI.resv_release, a, WE, KEY_A, nsid=1) == OK
    assert run.do("A acquires Write Exclusive - All Registrants", CLI.resv_acquire, a, WE_ALL, KEY_A, nsid=1) == OK
    r = run.steps[-1]["report"]
    assert r["rtype"] == WE_ALL and [g["holds"] for g in r["registrants"]] == [True, True]  # every registrant
    label = "B acquires the All Registrants reservation it holds"
    assert run.do(label, CLI.resv_acquire, b, WE_ALL, KEY_B, nsid=1) == edge(label, kind)
    assert run.io("B writes under All Registrants", b, write=True)[0]
    run.do("B releases the All Registrants reservation", CLI.resv_release, b, WE_ALL, KEY_B, nsid=1)
    run.do("A releases the All Registrants reservation", CLI.resv_release, a, WE_ALL, KEY_A, nsid=1)
    assert run.steps[-1]["report"]["rtype"] == 0
    label = "B registers with the reserved action 3"
    assert run.do(label, CLI.resv_register, b, rrega=3, crkey=KEY_B, nrkey=KEY_B, nsid=1) == edge(label, kind)
    label = "B releases with the reserved action 2"
    assert run.do(label, CLI.resv_release, b, 0, KEY_B, rrela=2, nsid=1) == edge(label, kind)
    assert run.do("B re-registers asking to persist through power loss", CLI.resv_register, b, nrkey=KEY_B,
                  cptpl=3, nsid=1) == OK
    assert run.do("B re-registers asking not to persist", CLI.resv_register, b, nrkey=KEY_B, cptpl=2, nsid=1) == OK
    assert run.steps[-1]["report"]["ptpls"] == 0
    assert run.do("A acquires Write Exclusive a last time", CLI.resv_acquire, a, WE, KEY_A, nsid=1) == OK
    assert run.do(SELF_PREEMPT, CLI.resv_acquire, a, EA, KEY_A, racqa=1, prkey=KEY_B, nsid=1) == OK
    assert run.do("A clears", CLI.resv_release, a, 0, KEY_A, rrela=1, nsid=1) == OK
    r = run.steps[-1]["report"]
    assert (r["rtype"], r["registrants"]) == (0, [])
    return run


def _rescap(dev: str) -> int:
    return int(json.loads(nvme("id-ns", dev, "--namespace-id=1", "--output-format=json").stdout)["rescap"])


_RUNS = {}  # kind -> Run: each kind's sequence runs once in a session, for its own test and the comparison


def run_of(kind: str, tmp_path) -> Run:
    if kind not in _RUNS:
        with started(kind, tmp_path):
            _RUNS[kind] = the_sequence(kind)
    return _RUNS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_the_nvme_054_sequence_and_the_conflicts_two_hosts_see(kind, tmp_path):
    run_of(kind, tmp_path)


FIELDS = ("status", "generation", "rtype", "regctl", "ptpls", "hostid", "rkey", "holds", "cntlid",
          "report_without_eds", "report_eds_0", "rescap")
SAME_AS_EDS = "as with --eds"


def fields_of(step: dict) -> dict:
    out = {"status": step["status"]}
    r = step.get("report")
    if r is not None:
        out.update({k: r[k] for k in ("generation", "rtype", "regctl", "ptpls")})
        for k in ("hostid", "rkey", "holds", "cntlid"):
            out[k] = [g[k] for g in r["registrants"]]
        without = step["report_without_eds"]
        out["report_without_eds"] = SAME_AS_EDS if without == r else without
        out["report_eds_0"] = step["report_eds_0"]
    if "rescap" in step:
        out["rescap"] = step["rescap"]
    return out


def test_nvmet_and_ours_compared_field_by_field(tmp_path):
    """The same sequence against kernel nvmet and ours: equal in every field of every step, except where
    EDGE_STATUS and EDGE_REPORT say how each answers and why.  Where a field is not fixed by the specification:
    RESCAP (ours sets bit 0, PTPL, where it has a reservation file; nvmet has no PTPL), asserted for each side.
    The generation is compared as is: both count every successful Register (also a re-register with the same
    key), Preempt and Clear, and no Acquire or Release, as the specification's PRGENERATION does."""
    nvmet = run_of("nvmet", tmp_path)  # first: skips where nvmet has no resv_enable, before ours runs
    ours = run_of("ours", tmp_path)
    assert [s["step"] for s in nvmet.steps] == [s["step"] for s in ours.steps]
    rows, wrong, compared = [], [], {f: [0, 0] for f in FIELDS}  # field -> [steps compared, equal]
    for n, o in zip(nvmet.steps, ours.steps):
        label, fn, fo = n["step"], fields_of(n), fields_of(o)
        for field in FIELDS:
            if field not in fn and field not in fo:
                continue
            vn, vo = fn.get(field), fo.get(field)
            compared[field][0] += 1
            compared[field][1] += vn == vo
            if field in ("status", "report_without_eds", "report_eds_0"):
                expected = EDGE_STATUS.get(label) if field == "status" else None
            elif field == "rescap":
                expected = {"nvmet": RESCAP_TYPES_IEKEY, "ours": RESCAP_TYPES_IEKEY | RESCAP_PTPL}
            else:
                expected = EDGE_REPORT.get((label, field))
            if expected is None:
                ok = vn == vo
            else:
                ok = (vn, vo) == (expected["nvmet"], expected["ours"])
            if vn != vo or not ok:
                rows.append((label, field, _shown(field, vn), _shown(field, vo)))
            if not ok:
                wrong.append(rows[-1])
    table = "\n".join(f"| {label} | {field} | {vn} | {vo} |" for label, field, vn, vo in rows)
    print(f"\n{len(nvmet.steps)} steps; per field, steps compared and equal: "
          + ", ".join(f"{f} {c}/{e}" for f, (c, e) in compared.items())
          + f"\nwhere nvmet and ours differ:\n| step | field | nvmet | ours |\n|---|---|---|---|\n{table}")
    save_capture("resv-nvmet-vs-ours.json", json.dumps({"nvmet": nvmet.steps, "ours": ours.steps}, indent=1))
    assert not wrong, "not as expected:\n" + "\n".join(map(str, wrong))


RESCAP_PTPL, RESCAP_TYPES_IEKEY = 0x01, 0xFE  # bit 0 PTPL; bits 1-6 the six types; bit 7 IEKEY (NVMe 1.3)


def _shown(field: str, value):
    if field in ("status", "report_without_eds", "report_eds_0") and isinstance(value, int):
        return "success" if value == OK else S.describe(value)
    if field == "rescap" and isinstance(value, int):
        return f"{value:#04x}"
    return value


def test_held_across_the_holders_reconnect_and_with_ptpl_across_a_target_restart(served):
    b = connect(HOST_B)
    a = connect(HOST_A)
    CLI.resv_register(a, nrkey=KEY_A, cptpl=3, nsid=1)  # persist through power loss
    CLI.resv_acquire(a, WE, KEY_A, nsid=1)
    nvme("disconnect", "-d", os.path.basename(a))
    a = connect(HOST_A)
    assert report(a)["registrants"][0]["holds"] and io(a, write=True)[0]
    assert not io(b, write=True)[0]
    served.stop()
    served.start()
    _wait_live(a)  # both hosts reconnect by themselves (--ctrl-loss-tmo)
    _wait_live(b)
    r = report(b)
    assert r["ptpls"] == 1 and r["rtype"] == WE and r["registrants"][0]["hostid"] == hostid_hex(HOST_A)
    assert not io(b, write=True)[0] and io(a, write=True)[0]


def test_preempt_and_abort_while_the_preempted_host_runs_fio(served):
    b = connect(HOST_B)  # first: the multipath head's I/O goes down B's path
    a = connect(HOST_A)
    (head,) = namespaces_of(NQN)
    CLI.resv_register(a, nrkey=KEY_A, nsid=1)
    CLI.resv_register(b, nrkey=KEY_B, nsid=1)
    CLI.resv_acquire(b, WE, KEY_B, nsid=1)
    fio = subprocess.Popen(["fio", "--name=fenced", f"--filename={head}", "--rw=randwrite", "--bs=4k", "--size=32M",
                            "--iodepth=16", "--ioengine=libaio", "--direct=1", "--time_based", "--runtime=30",
                            "--verify_state_save=0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(3)
        assert fio.poll() is None, fio.stdout.read()
        CLI.resv_acquire(a, WE, KEY_A, racqa=2, prkey=KEY_B, nsid=1)  # preempt and abort
        out, _ = fio.communicate(timeout=60)
    finally:
        if fio.poll() is None:
            fio.kill()
    # the fenced host's writes fail from then on: fio stops with an error long before its 30 s
    assert fio.returncode != 0, out
    r = report(a)
    assert r["rtype"] == WE and [g["hostid"] for g in r["registrants"]] == [hostid_hex(HOST_A)]
    assert io(a, write=True)[0] and not io(b, write=True)[0]
    assert served.proc.poll() is None  # the target serves on


def _live(dev: str) -> bool:
    try:
        return open(f"/sys/class/nvme/{os.path.basename(dev)}/state").read().strip() == "live"
    except OSError:
        return False


def _wait_live(dev: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not _live(dev):
        if time.monotonic() > deadline:
            raise AssertionError(f"{dev} did not reconnect in {timeout} s")
        time.sleep(0.2)


# --------------------------------------------------------------------------------------- fencing (docs/native.md)

PREEMPT_ROUNDS = int(os.environ.get("NVMEOF_PREEMPT_ROUNDS", "20"))
FENCED_RANGE = 2 << 20  # bytes both hosts write, from LBA 0
CHUNK = 128 << 10


def _write_range_as(dev: str, fill: int) -> None:
    """Write FENCED_RANGE bytes of `fill` through this controller, 128 KiB per command."""
    with open("/var/tmp/nvmeof-roce-fill.bin", "wb") as f:
        f.write(bytes([fill]) * CHUNK)
    for off in range(0, FENCED_RANGE, CHUNK):
        nvme("io-passthru", dev, "--namespace-id=1", "--opcode=0x01", "--write", f"--data-len={CHUNK}",
             f"--cdw10={off // 512}", f"--cdw12={CHUNK // 512 - 1}", "--input-file=/var/tmp/nvmeof-roce-fill.bin")


def _blocks_not(head: str, fill: int) -> list:
    """The 512-byte blocks of FENCED_RANGE that do not hold `fill`, read back with O_DIRECT through the multipath
    head (a host that lost its registration may still read under Write Exclusive)."""
    data = subprocess.run(["dd", f"if={head}", f"bs={CHUNK}", f"count={FENCED_RANGE // CHUNK}", "iflag=direct",
                           "status=none"], capture_output=True, check=True).stdout
    assert len(data) == FENCED_RANGE, len(data)
    return [i for i in range(FENCED_RANGE // 512) if data[i * 512:(i + 1) * 512] != bytes([fill]) * 512]


@pytest.fixture
def served_ram(tmp_path):
    """Our target with a RAM namespace (reservations on), served by the native data path."""
    ns = {"nsid": 1, "nvmeof_roce": {"backend": "ram", "size": "64M", "block_size": 512}, "resv": {"enable": "1"}}
    target = ServedTarget(_two_port_config(ns), str(tmp_path / "resv-ram.json"))
    target.start()
    try:
        yield target
    finally:
        disconnect_all_quietly()
        target.stop()


def test_after_a_preempt_and_abort_every_block_holds_the_preempting_hosts_data(served_ram):
    """Issue 47's lab sequence: host A holds Write Exclusive and writes a 2 MiB range at QD32 in 64-128 KiB blocks;
    host B preempts and aborts A and, once answered, writes the same range; after A's I/O has failed, every block
    holds B's data: none of A's Writes in flight at the preempt landed after it.  PREEMPT_ROUNDS rounds."""
    a = connect(HOST_A)  # first: the multipath head's I/O goes down A's path
    b = connect(HOST_B)
    (head,) = namespaces_of(NQN)
    CLI.resv_register(b, nrkey=KEY_B, nsid=1)
    answered = []
    for round_ in range(PREEMPT_ROUNDS):
        CLI.resv_register(a, nrkey=KEY_A, nsid=1)  # preempted last round: registered again
        if round_:
            CLI.resv_release(b, WE, KEY_B, nsid=1)
        CLI.resv_acquire(a, WE, KEY_A, nsid=1)
        fio = subprocess.Popen(["fio", "--name=holder", f"--filename={head}", "--rw=randwrite", "--bsrange=64k-128k",
                                f"--size={FENCED_RANGE}", "--iodepth=32", "--ioengine=libaio", "--direct=1",
                                "--time_based", "--runtime=60", f"--randseed={round_ + 1}"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            time.sleep(1.5)
            assert fio.poll() is None, fio.stdout.read()
            t0 = time.monotonic()
            CLI.resv_acquire(b, WE, KEY_B, racqa=2, prkey=KEY_A, nsid=1)  # preempt and abort
            answered.append(time.monotonic() - t0)
            fill = 0x40 + round_
            _write_range_as(b, fill)
            out, _ = fio.communicate(timeout=90)
        finally:
            if fio.poll() is None:
                fio.kill()
        assert fio.returncode != 0, out  # A's writes failed once it was preempted
        bad = _blocks_not(head, fill)
        assert bad == [], f"round {round_}: {len(bad)} blocks do not hold B's data (first {bad[:8]})"
        assert served_ram.proc.poll() is None
    print(f"preempt and abort: {PREEMPT_ROUNDS} rounds, every block B's; the preempt answered in "
          f"{min(answered) * 1000:.0f}-{max(answered) * 1000:.0f} ms (nvme-cli's run included)")
