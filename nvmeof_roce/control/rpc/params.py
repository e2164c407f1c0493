"""The RPC methods' parameters: `Params` checks a method's named parameters (each error names the parameter and
the fix), `config_error` words a config problem as the RPC's (its field in the RPC's names), `rpc_error` the
outcome of a change given up after it was accepted."""
from __future__ import annotations

from typing import Any, Callable, Optional

from ...config import ConfigError, parse_flag
from ..protocol import RpcError


class Params:
    """One method's named parameters, checked against the names it takes (SPDK's `tgt_name` only empty)."""

    def __init__(self, method: str, params: Any, known: tuple):
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise RpcError(f"{method}: params must be an object (named parameters), got {type(params).__name__}",
                           "params", 'send "params": {"nqn": ...}')
        for k in params:
            if k not in known and k != "tgt_name":
                raise RpcError(f"{method}: unknown parameter {k!r}", k,
                               f"remove it; {method} takes {', '.join(known) or 'no parameters'}")
        if params.get("tgt_name") not in (None, ""):
            raise RpcError("tgt_name: this target process serves one target; it has no named targets", "tgt_name",
                           "leave tgt_name out")
        self.method = method
        self.p = params

    def has(self, name: str) -> bool:
        return self.p.get(name) is not None

    def str(self, name: str, required: bool = True, default: str = "") -> str:
        v = self.p.get(name)
        if v is None:
            if required:
                raise RpcError(f"{self.method}: missing parameter {name!r}", name, f"add \"{name}\": ...")
            return default
        if not isinstance(v, str) or not v:
            raise RpcError(f"{name} must be a non-empty string, got {v!r}", name, f"give {name} as a JSON string")
        return v

    def int(self, name: str, required: bool = True, default: Optional[int] = None) -> Optional[int]:
        v = self.p.get(name)
        if v is None:
            if required:
                raise RpcError(f"{self.method}: missing parameter {name!r}", name, f"add \"{name}\": N")
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            try:
                v = int(str(v), 0)
            except ValueError:
                raise RpcError(f"{name} must be an integer, got {v!r}", name, f"give {name} as a number") from None
        return v

    def bool(self, name: str, required: bool = False, default: bool = False) -> bool:
        v = self.p.get(name)
        if v is None:
            if required:
                raise RpcError(f"{self.method}: missing parameter {name!r}", name, f"add \"{name}\": true or false")
            return default
        flag = parse_flag(v)  # a JSON boolean, or nvmetcli's "1"/"0" as the config takes them
        if flag is None:
            raise RpcError(f"{name} must be true or false, got {v!r}", name,
                           f'give {name} as true or false (or "1"/"0")')
        return flag

    def dict(self, name: str) -> dict:
        v = self.p.get(name)
        if not isinstance(v, dict):
            raise RpcError(f"{self.method}: parameter {name!r} must be an object, got {v!r}", name,
                           f"give \"{name}\": {{...}}")
        return v


def rpc_error(error: Exception) -> RpcError:
    """The answer to a live change given up after it was accepted (a drain that did not end: engine/api.py)."""
    if isinstance(error, RpcError):
        return error
    if isinstance(error, ConfigError):
        return RpcError(error.problem, error.where, error.fix)
    return RpcError(str(error), "", "see the target's log")


def config_error(exc: ConfigError, rpc_fields: Optional[Callable[[str], str]] = None) -> RpcError:
    """A config problem of the change an RPC asked for, as that RPC's error: `rpc_fields` maps the config field to
    the RPC's parameter (or gives the config field back when no parameter is its)."""
    field = rpc_fields(exc.where) if rpc_fields else exc.where
    return RpcError(exc.problem if field else str(exc), field or exc.where, exc.fix)
