"""`make test`: run the unit tier on the host, the lab tier in one guest boot (Debian's 6.1 kernel), and
the interoperability and authentication lab tests in a second boot with Debian's 6.12 kernel.

Every tier always runs.  Their pytest summary lines are printed again at the
end, then one combined 'N passed, N failed' line; the exit code is non-zero if
any tier failed.
"""
import re
import subprocess
import sys
import time

# The second kernel generation: the kernel host and nvmet against our target and initiator, and in-band
# authentication (which 6.1 lacks).  Kept small: each guest boot under emulation costs minutes.
LAB_612_TESTS = ["tests/lab/test_auth.py", "tests/lab/test_kernel_host_userspace_target.py",
                 "tests/lab/test_nvmet_configfs.py", "tests/lab/test_initiator_over_rxe.py", "tests/lab/test_nvmetcli_corpus_served.py"]

# Debian 13 (trixie: its 6.12 kernel, nvme-cli 2.13, rdma-core 56, Python 3.13): the kernel host against our
# target on the native data path (fio crc32c verify, discovery, DH-HMAC-CHAP, multipath failover with --workers),
# the `host` wrapper's commands, and nvmet.  `lab run` puts the native module for the guest's Python in the
# checkout before the boot (lab/guest_native.py: _native.cpython-313-*.so beside the host's, built once per image
# and sources in a chroot), and the tier fails if it does not import.
LAB_TRIXIE_TESTS = ["tests/lab/test_kernel_host_userspace_target.py", "tests/lab/test_native_data_path.py",
                    "tests/lab/test_auth.py", "tests/lab/test_multipath.py", "tests/lab/test_kernel_host.py",
                    "tests/lab/test_nvmet_configfs.py", "tests/lab/test_host_identity_nvme_cli.py"]
NATIVE_FIRST = "python3 -c 'import nvmeof_roce._native'"

SUMMARY = re.compile(r"^=+ (.*(passed|failed|error|skipped|no tests ran).*) =+$")


def run_tier(name, argv):
    print(f"[nvmeof-roce] === {name}: {' '.join(argv)}", flush=True)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    summary = None
    for line in proc.stdout:
        sys.stdout.write(line)
        m = SUMMARY.match(re.sub(r"\x1b\[[0-9;]*m", "", line.strip()))
        if m:
            summary = m.group(1)
    proc.wait()
    return proc.returncode, summary


def count(summary, word):
    m = re.search(rf"(\d+) {word}", summary or "")
    return int(m.group(1)) if m else 0


def lab_tier(venv_python, lab_timeout, kernel, tests):
    return [venv_python, "-m", "nvmeof_roce", "lab", "run", "--kernel", kernel, "--timeout", lab_timeout, "--",
            "python3", "-m", "pytest", "-p", "no:cacheprovider", "--durations=12", "-m", "lab and not long and not extended", *tests]


def trixie_tier(venv_python, lab_timeout, tests=LAB_TRIXIE_TESTS, kernel="trixie"):
    """A Debian 13 guest (`trixie`, or `unstable`: the same userland on Debian unstable's kernel)."""
    pytest = ("python3 -m pytest -p no:cacheprovider --durations=12 -m 'lab and not long and not extended' "
              + " ".join(tests))
    return [venv_python, "-m", "nvmeof_roce", "lab", "run", "--kernel", kernel, "--timeout", lab_timeout, "--",
            "sh", "-c", f"{NATIVE_FIRST} && {pytest}"]


def main():
    venv_python, lab_timeout = sys.argv[1], sys.argv[2]
    only = sys.argv[3] if len(sys.argv) > 3 else None  # `make test-trixie`: that tier alone
    trixie = ("lab tier (guest, Debian 13 trixie)", trixie_tier(venv_python, lab_timeout))
    # Debian unstable's newest kernel (docs/lab.md): the 6.12 subset on it, by hand (`tests/tiers.py PY 3000 unstable`)
    unstable = ("lab tier (guest, Debian 13 on unstable's kernel)",
                trixie_tier(venv_python, lab_timeout, LAB_612_TESTS, kernel="unstable"))
    tiers = [
        ("unit tier (host)", [venv_python, "-m", "pytest", "--durations=12", "-m", "not lab", "tests/unit"]),
        ("lab tier (guest, kernel 6.1)", lab_tier(venv_python, lab_timeout, "6.1", ["tests/lab"])),
        ("lab tier (guest, kernel 6.12)", lab_tier(venv_python, lab_timeout, "6.12", LAB_612_TESTS)),
    ]
    if only == "trixie":
        tiers = [trixie]
    elif only == "unstable":
        tiers = [unstable]
    elif only:
        sys.exit(f"tests/tiers.py: unknown tier {only!r} (trixie, unstable)")
    results = []
    for name, argv in tiers:
        started = time.monotonic()
        code, summary = run_tier(name, argv)
        results.append((name, code, summary, time.monotonic() - started))
    print()
    for name, code, summary, seconds in results:
        print(f"{name}: {summary or 'no pytest summary'} (exit {code}, {seconds:.0f} s)")
    passed = sum(count(s, "passed") for _, _, s, _ in results)
    failed = sum(count(s, "failed") + count(s, "error") for _, _, s, _ in results)
    if any(code for _, code, _, _ in results) and failed == 0:
        failed = 1  # a tier broke without a pytest summary (boot failure, collection crash)
    skipped = sum(count(s, "skipped") for _, _, s, _ in results)
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 0 if all(code == 0 for _, code, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
