"""`target serve` turns on Python's fault handler, so a crash inside pyverbs or a provider leaves a stack."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_target_serve_enables_the_fault_handler_before_anything_can_crash(tmp_path):
    # A process of its own: the handler is process-wide. The config does not exist, so serve stops with its
    # error right after the handler is on; the probe reports whether it was.
    probe = (
        "import faulthandler, sys\n"
        "from nvmeof_roce.cli import main\n"
        "assert not faulthandler.is_enabled()\n"
        f"code = main(['target', 'serve', {str(tmp_path / 'missing.json')!r}])\n"
        "print('fault handler on' if faulthandler.is_enabled() else 'fault handler off', code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert "fault handler on" in proc.stdout, proc.stdout + proc.stderr
    assert "missing.json" in proc.stderr  # and the missing config is still named
