"""The CLI's process-level behaviour: a closed pipe, logging under journald."""
import io
import logging
import os
import subprocess
import sys

from nvmeof_roce import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_json_into_a_closed_pipe_ends_without_a_traceback():
    r, w = os.pipe()
    os.close(r)  # `| head` that already exited
    proc = subprocess.run([sys.executable, "-m", "nvmeof_roce", "target", "check",
                           os.path.join(ROOT, "targets", "two-subsystems.json"), "--json"],
                          stdout=w, stderr=subprocess.PIPE, text=True, timeout=120, cwd=ROOT)
    os.close(w)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 141


def test_journald_stream_is_detected_and_gets_priority_prefixes_without_timestamps(tmp_path):
    f = open(tmp_path / "stream", "w")
    st = os.fstat(f.fileno())
    assert cli.stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, f)
    assert not cli.stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"}, f)
    assert not cli.stderr_is_journal({}, f)
    f.close()
    record = logging.LogRecord("nvmeof_roce.engine", logging.INFO, __file__, 1, "serving %s", ("x",), None)
    assert cli.JournalFormatter().format(record) == "<6>nvmeof_roce.engine: serving x"
    record.levelno = logging.ERROR
    assert cli.JournalFormatter().format(record).startswith("<3>")


def test_under_journald_the_cli_logs_without_its_own_timestamp(tmp_path):
    log_path = tmp_path / "journal"
    with open(log_path, "w") as f:
        st = os.fstat(f.fileno())
        env = dict(os.environ, JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        code = ("import logging, nvmeof_roce.cli as c; c.setup_logging(1); "
                "logging.getLogger('nvmeof_roce.x').info('hello')")
        subprocess.run([sys.executable, "-c", code], stderr=f, env=env, check=True, timeout=60)
    assert log_path.read_text() == "<6>nvmeof_roce.x: hello\n"
