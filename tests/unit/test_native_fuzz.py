"""The native data path against the Python one under the differential fuzz (tests/unit/native_fuzz.py): the corpus
of cases that once failed first, then a short seeded sample (narrow, and widened: several hosts and controllers,
reservations, ended controllers, host and file namespace changes); `make test-native-fuzz` runs 100,000 capsules
and more (NATIVE_FUZZ_CAPSULES) under the sanitizers, the widened cases among them (NATIVE_FUZZ_WIDE)."""
import json
import os
import time
from pathlib import Path

import pytest

import native_fuzz
from native_fake import needs_native

pytestmark = needs_native

CORPUS = Path(__file__).parent / "fixtures" / "native_fuzz" / "corpus.json"
SAMPLE_SEEDS = range(1000, 1012)
WIDE_SAMPLE_SEEDS = range(2000, 2030)
SUMMARY = Path(os.environ.get("NATIVE_FUZZ_SUMMARY", "build/native-fuzz-summary.txt"))


def corpus():
    entries = json.loads(CORPUS.read_text())["cases"]
    return [pytest.param(e["seed"], bool(e.get("known")), e.get("groups", 0), bool(e.get("wide")),
                         id=f"seed-{e['seed']}{'-wide' if e.get('wide') else ''}",
                         marks=[pytest.mark.xfail(raises=native_fuzz.Divergence, strict=True, reason=e["xfail"])]
                         if e.get("xfail") else [])
            for e in entries]


def poll_groups(n: int):
    from nvmeof_roce import native
    from nvmeof_roce.transport.rdma.pollgroups import PollGroups
    return PollGroups(native.module, n) if n else None


@pytest.mark.parametrize("seed,known,groups,wide", corpus())
def test_the_corpus_of_cases_that_once_failed_replays_without_divergence(seed, known, groups, wide):
    threads = poll_groups(groups)
    try:
        native_fuzz.run([seed], known=known, groups=threads, wide=wide)
    finally:
        if threads is not None:
            threads.close()


def test_a_seeded_sample_of_batches_live_changes_and_faults_shows_no_divergence():
    tally = native_fuzz.run(SAMPLE_SEEDS)
    print(tally.summary())
    assert tally.cases == len(SAMPLE_SEEDS) and tally.capsules > 0 and tally.native_answers > 0


def test_a_seeded_sample_of_widened_cases_reservations_and_ended_controllers_shows_no_divergence():
    """Hosts A and B on the subsystem, reservations changed between and during batches (a preempt and abort of
    host A while its native Write's READ is on the wire among them), host A's controller ended mid-flight (keep-alive
    expiry, Disconnect, admin queue gone, host removed) then a live change with its work still on the wire, host B
    removed and allowed again, the file namespace resized and replaced under load."""
    tally = native_fuzz.run(WIDE_SAMPLE_SEEDS, wide=True)
    print(tally.summary())
    assert tally.cases == tally.wide_cases == len(WIDE_SAMPLE_SEEDS)
    assert tally.resv["preempt-and-abort ok"] and tally.fenced_on_wire and tally.overwrites
    assert tally.resv["(mid-batch)"] and sum(tally.ended.values()) >= 3
    assert any(k.startswith("host-b-removed") for k in tally.changes)
    assert any(k.startswith("file-resize") for k in tally.changes) and any(k.startswith("replace-file")
                                                                           for k in tally.changes)


@pytest.mark.fuzz
@pytest.mark.skipif("NATIVE_FUZZ_CAPSULES" not in os.environ, reason="make test-native-fuzz runs it at scale")
def test_native_fuzz_at_scale():
    """NATIVE_FUZZ_CAPSULES capsules from NATIVE_FUZZ_SEED on (the corpus's seeds first); NATIVE_FUZZ_GROUPS=2 runs
    the native queues on two poll-group threads (the TSan pass).  The counts are printed (-s shows them)."""
    want = int(os.environ["NATIVE_FUZZ_CAPSULES"])
    first = int(os.environ.get("NATIVE_FUZZ_SEED", "1"))
    groups = poll_groups(int(os.environ.get("NATIVE_FUZZ_GROUPS", "0")))
    wide = os.environ.get("NATIVE_FUZZ_WIDE", "1") != "0"
    started = time.monotonic()
    try:
        tally = native_fuzz.run(native_fuzz.replay_first(first), capsules=want, groups=groups, wide=wide)
    finally:
        if groups is not None:
            groups.close()
    line = (f"native fuzz{' on poll-group threads' if groups else ''}{' (widened)' if wide else ''}: "
            f"{tally.summary()}; {time.monotonic() - started:.0f} s")
    print("\n" + line)
    if os.environ.get("NATIVE_FUZZ_SUMMARY") is not None:  # make test-native-fuzz prints them at its end
        SUMMARY.parent.mkdir(parents=True, exist_ok=True)
        with SUMMARY.open("a") as f:
            f.write(line + "\n")
    assert tally.capsules >= want
