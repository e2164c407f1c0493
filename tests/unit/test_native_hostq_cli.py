"""`initiator perf --data-path`: the choice of data path and its refusals (no device needed)."""
import argparse

import pytest

from nvmeof_roce import native
from nvmeof_roce.errors import NvmeofError
from nvmeof_roce.initiator import commands
from nvmeof_roce.transport.base import TransportError


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


def test_the_cm_id_is_not_guessed_from_an_unknown_object():
    from nvmeof_roce.transport.rdma.host_native import cm_id_address

    class Holder:
        def __init__(self):
            self.a, self.b = [1], {"x": 2}

    with pytest.raises(TransportError, match="--data-path python"):
        cm_id_address(Holder(), 5, "10.99.0.1:4420")
