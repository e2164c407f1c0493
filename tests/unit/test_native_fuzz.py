"""The native data path against the Python one under the differential fuzz (tests/unit/native_fuzz.py): the corpus
of cases that once failed first, then a short seeded sample; `make test-native-fuzz` runs 100,000 capsules and more
(NATIVE_FUZZ_CAPSULES) under the sanitizers."""
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


def corpus():
    entries = json.loads(CORPUS.read_text())["cases"]
    return [pytest.param(e["seed"], bool(e.get("known")), e.get("groups", 0), id=f"seed-{e['seed']}",
                         marks=[pytest.mark.xfail(raises=native_fuzz.Divergence, strict=True, reason=e["xfail"])]
                         if e.get("xfail") else [])
            for e in entries]


def poll_groups(n: int):
    from nvmeof_roce import native
    from nvmeof_roce.transport.rdma.pollgroups import PollGroups
    return PollGroups(native.module, n) if n else None


@pytest.mark.parametrize("seed,known,groups", corpus())
def test_the_corpus_of_cases_that_once_failed_replays_without_divergence(seed, known, groups):
    threads = poll_groups(groups)
    try:
        native_fuzz.run([seed], known=known, groups=threads)
    finally:
        if threads is not None:
            threads.close()


def test_a_seeded_sample_of_batches_live_changes_and_faults_shows_no_divergence():
    tally = native_fuzz.run(SAMPLE_SEEDS)
    print(tally.summary())
    assert tally.cases == len(SAMPLE_SEEDS) and tally.capsules > 0 and tally.native_answers > 0


@pytest.mark.fuzz
@pytest.mark.skipif("NATIVE_FUZZ_CAPSULES" not in os.environ, reason="make test-native-fuzz runs it at scale")
def test_native_fuzz_at_scale():
    """NATIVE_FUZZ_CAPSULES capsules from NATIVE_FUZZ_SEED on (the corpus's seeds first); NATIVE_FUZZ_GROUPS=2 runs
    the native queues on two poll-group threads (the TSan pass).  The counts are printed (-s shows them)."""
    want = int(os.environ["NATIVE_FUZZ_CAPSULES"])
    first = int(os.environ.get("NATIVE_FUZZ_SEED", "1"))
    groups = poll_groups(int(os.environ.get("NATIVE_FUZZ_GROUPS", "0")))
    started = time.monotonic()
    try:
        tally = native_fuzz.run(native_fuzz.replay_first(first), capsules=want, groups=groups)
    finally:
        if groups is not None:
            groups.close()
    print(f"\nnative fuzz{' on poll-group threads' if groups else ''}: {tally.summary()}; "
          f"{time.monotonic() - started:.0f} s")
    assert tally.capsules >= want
