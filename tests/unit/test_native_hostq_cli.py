"""`initiator perf --data-path`: the choice of data path and its refusals (no device needed)."""
import argparse

import pytest

from nvmeof_roce import native
from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.initiator import commands


def test_native_is_the_default_when_built_and_refused_with_the_fix_when_not(monkeypatch):
    monkeypatch.setattr(native, "module", object())
    assert commands._perf_data_path(argparse.Namespace(data_path=None)) == "native"
    assert commands._perf_data_path(argparse.Namespace(data_path="python")) == "python"
    monkeypatch.setattr(native, "module", None)
    monkeypatch.setattr(native, "missing_reason", "the native data path is not built (no module)")
    assert commands._perf_data_path(argparse.Namespace(data_path=None)) == "python"
    with pytest.raises(NvmeofError, match="--data-path native: the native data path is not built") as exc:
        commands._perf_data_path(argparse.Namespace(data_path="native"))
    assert exc.value.fix == "or use --data-path python"

