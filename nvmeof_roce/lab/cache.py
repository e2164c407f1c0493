"""Where the lab keeps what it builds and downloads: images, packages, siw modules, private apt states."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    base = os.environ.get("NVMEOF_ROCE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "nvmeof-roce")
    return Path(base) / "lab"
