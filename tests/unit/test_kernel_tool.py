"""tool.run: the one way external programs are run (subprocess; no third-party runner)."""
import subprocess
import sys

import pytest

from nvmeof_roce.errors import NvmeofError, ToolMissing
from nvmeof_roce.kernel import tool


def test_run_reports_exit_code_output_and_c_locale():
    res = tool.run("sh", ["-c", 'echo "out $LC_ALL"; echo err >&2; exit 3'], package="dash")
    assert (res.exit_code, res.stdout, res.stderr, res.ok) == (3, "out C\n", "err\n", False)
    assert res.argv[0] == "sh" and tool.run("true", [], package="coreutils").ok


def test_run_stdin_is_closed_and_undecodable_bytes_are_replaced():
    res = tool.run("sh", ["-c", "cat; printf '\\377ok'"], package="dash", timeout=10)
    assert res.ok and res.stdout == "\ufffdok"


def test_run_missing_timeout_and_signal_are_clear_errors():
    with pytest.raises(ToolMissing):
        tool.run("no-such-tool-nvmeof", [], package="nothing")
    with pytest.raises(NvmeofError, match="timed out after 0.2 s"):
        tool.run("sleep", ["5"], package="coreutils", timeout=0.2)
    with pytest.raises(NvmeofError, match="killed by a signal \\(SIGKILL\\)"):
        tool.run("sh", ["-c", "kill -9 $$"], package="dash")


def test_the_package_does_not_import_sh():
    code = ("import sys, nvmeof_roce.cli; nvmeof_roce.cli.build_parser(); "
            "print('sh' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
