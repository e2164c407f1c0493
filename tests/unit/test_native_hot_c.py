"""The native queue's hot path (csrc/nq_hot.c) with no Python: tests/native/nq_hot_test.c, a C program linked with
the fake verbs provider (tests/native/fakeprov.c), built here with -DNQ_CHECKED (every request state change checked
against nq_next) under AddressSanitizer and UBSan, and run.  Then the check itself: the same program built with one
move taken out of the table aborts and names it.
"""
import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from native_fake import needs_native

pytestmark = [needs_native, pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")]

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
SOURCES = [ROOT / "tests" / "native" / "nq_hot_test.c", CSRC / "nq_setup.c", CSRC / "nq_owner.c", CSRC / "mailbox.c",
           CSRC / "uring.c", CSRC / "trace.c",
           CSRC / "backend.c", CSRC / "be_ram.c", CSRC / "be_null.c", CSRC / "be_uring.c", CSRC / "be_rbd.c",
           ROOT / "tests" / "native" / "fakeprov.c"]
FLAGS = ["-std=gnu11", "-O1", "-g", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror", "-DNQ_CHECKED",
         "-DNATIVE_PLAIN_C", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def build(hot_source: str, tag: str) -> Path:
    """The program with `hot_source` as csrc/nq_hot.c; no Python include path, so no Python header can be in it."""
    digest = hashlib.sha256(hot_source.encode() + b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:12]
    out = ROOT / "build" / "tests" / f"nq_hot_test-{tag}-{digest}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    hot = out.with_suffix(".nq_hot.c")
    hot.write_text(hot_source)
    subprocess.run(["gcc", *FLAGS, f"-I{CSRC}", "-o", str(out), str(hot), *map(str, SOURCES), "-luring", "-lpthread"],
                   check=True)
    return out


def run(program: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(program)], capture_output=True, text=True, timeout=120,
                          env={"ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "print_stacktrace=1"})


def test_the_hot_path_serves_reads_and_writes_counts_credits_and_closes_without_python():
    done = run(build((CSRC / "nq_hot.c").read_text(), "checked"))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_a_move_the_transition_table_does_not_allow_aborts_in_the_checked_build():
    source = (CSRC / "nq_hot.c").read_text()
    allowed = "    [NQ_NEED_RESPONSE] = NQ_TO(NQ_COMPLETING),"
    assert allowed in source
    done = run(build(source.replace(allowed, "    [NQ_NEED_RESPONSE] = 0,"), "no-response-move"))
    assert done.returncode != 0
    assert "moved from NEED_RESPONSE to COMPLETING, which nq_next does not allow" in done.stderr, done.stderr
