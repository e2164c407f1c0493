"""RADOS names in the config: pools, RADOS namespaces, images, client ids and a gateway group's names
(config/rbd.py, config/group.py): what rbd's CLI and RADOS object names take without quoting surprises."""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, Iterable, Optional

from .errors import ConfigError

_PATTERNS: Dict[int, "re.Pattern[str]"] = {}


def is_rados_name(value: Any, longest: int) -> bool:
    """Letters, digits, '_', '.', '+', '-' ('+' and '-' not first), at most `longest` characters."""
    if longest not in _PATTERNS:
        _PATTERNS[longest] = re.compile(rf"[A-Za-z0-9_.][A-Za-z0-9_.+-]{{0,{longest - 1}}}")
    return isinstance(value, str) and _PATTERNS[longest].fullmatch(value) is not None


def rados_names(value: dict, defaults: Dict[str, Optional[str]], longest: int,
                err: Callable[[str, str, str], ConfigError], fix: str,
                may_be_empty: Iterable[str] = ("namespace",)) -> Dict[str, str]:
    """Each key of `defaults`, in order, read from `value` (its default when absent) and checked as a RADOS name of
    at most `longest` characters (only the keys of `may_be_empty` may be ""): {key: name}, or the ConfigError
    `err(key, problem, fix)` for the first that is not one."""
    names = {}
    for key, default in defaults.items():
        v = value.get(key, default)
        if not isinstance(v, str) or (v and not is_rados_name(v, longest)) or (not v and key not in may_be_empty):
            raise err(key, f"is not a RADOS name: {v!r}", fix)
        names[key] = v
    return names
