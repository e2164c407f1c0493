"""The two-node tier: each test boots two lab guests joined by a virtual wire (`lab run --nodes 2`), from the
host.  Slow (minutes per scenario on 2 cores) and it needs the lab lock: run with `make test-two-node`, which
holds /tmp/nvmeof-lab.lock and sets NVMEOF_TWO_NODE=1.  Without that variable these tests are skipped with
that command; they are not part of `make test`."""
import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("NVMEOF_TWO_NODE") == "1":
        return
    skip = pytest.mark.skip(reason="two-node lab test: run it with `make test-two-node`")
    for item in items:
        if "twonode" in item.keywords:
            item.add_marker(skip)
