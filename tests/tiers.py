"""`make test`: run the unit tier on the host and the lab tier in one guest boot.

Both tiers always run.  Their pytest summary lines are printed again at the
end, then one combined 'N passed, N failed' line; the exit code is non-zero if
either tier failed.
"""
import re
import subprocess
import sys

SUMMARY = re.compile(r"^=+ (.*(passed|failed|error|skipped|no tests ran).*) =+$")


def run_tier(name, argv):
    print(f"[nvmeof-roce] === {name} tier: {' '.join(argv)}", flush=True)
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


def main():
    venv_python, lab_timeout = sys.argv[1], sys.argv[2]
    unit_code, unit_sum = run_tier("unit", [venv_python, "-m", "pytest", "-m", "not lab", "tests/unit"])
    lab_code, lab_sum = run_tier("lab", [venv_python, "-m", "nvmeof_roce", "lab", "run", "--timeout", lab_timeout,
                                         "--", "python3", "-m", "pytest", "-p", "no:cacheprovider", "-m",
                                         "lab and not long", "tests/lab"])
    print()
    print(f"unit tier (host): {unit_sum or 'no pytest summary'} (exit {unit_code})")
    print(f"lab tier (guest): {lab_sum or 'no pytest summary'} (exit {lab_code})")
    passed = count(unit_sum, "passed") + count(lab_sum, "passed")
    failed = count(unit_sum, "failed") + count(lab_sum, "failed") + count(unit_sum, "error") + count(lab_sum, "error")
    if (unit_code or lab_code) and failed == 0:
        failed = 1  # a tier broke without a pytest summary (boot failure, collection crash)
    skipped = count(unit_sum, "skipped") + count(lab_sum, "skipped")
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 0 if unit_code == 0 and lab_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
