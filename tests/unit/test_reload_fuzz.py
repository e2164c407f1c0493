"""Reload fuzzing (tests/unit/reload_fuzz.py): a few hundred broken configs here; `make test-reload-fuzz`
runs 10,000 (RELOAD_FUZZ_COUNT) and prints the summary."""
import json
import logging
import os

import pytest

import reload_fuzz

pytestmark = pytest.mark.fuzz


def test_broken_configs_are_refused_and_the_host_loses_nothing(tmp_path, caplog):
    count = int(os.environ.get("RELOAD_FUZZ_COUNT", "300"))
    seed = int(os.environ.get("RELOAD_FUZZ_SEED", "22"))
    caplog.set_level(logging.CRITICAL)  # each refusal logs an error; thousands of them are not the point here
    summary = reload_fuzz.run(count, seed, str(tmp_path))
    print("\nreload fuzz:", json.dumps(summary, indent=1))
    assert summary["configs"] == count and sum(summary["by_kind"].values()) == count
    assert set(summary["by_kind"]) == set(reload_fuzz.KINDS)
