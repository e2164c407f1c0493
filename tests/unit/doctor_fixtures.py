"""Builds doctor fixture trees: a recorded base host plus scenario overlays (fixtures/doctor/README.md)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Optional

from nvmeof_roce.doctor.context import Context, DoctorOptions
from nvmeof_roce.doctor.machine import Machine
from nvmeof_roce.doctor.result import CheckResult
from nvmeof_roce.doctor.runner import run_checks

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"
OVERLAYS = FIXTURES / "overlays"


def _merge_tool_index(root: Path, overlay: Path) -> None:
    base_file = root / "recorded-tools" / "index.json"
    base = json.loads(base_file.read_text()) if base_file.exists() else []
    extra = json.loads((overlay / "recorded-tools" / "index.json").read_text())
    replaced = {tuple(e["argv"]) for e in extra if "argv" in e}
    now_missing = {tool for e in extra for tool in e.get("missing", [])}
    merged = [e for e in base if "argv" not in e or (tuple(e["argv"]) not in replaced and e["argv"][0] not in now_missing)]
    base_file.write_text(json.dumps(merged + extra, indent=1))


def apply_overlay(root: Path, name: str, part: str = "") -> None:
    """Copy an overlay's files over `root`, delete what its _removed.txt lists, merge its tool recordings."""
    overlay = OVERLAYS / name / part if part else OVERLAYS / name
    removed = overlay / "_removed.txt"
    if removed.exists():
        for line in removed.read_text().split():
            target = root / line.lstrip("/")
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
    for source in overlay.rglob("*"):
        relative = source.relative_to(overlay)
        if relative.parts[0] in ("after", "_removed.txt") or relative == Path("recorded-tools/index.json"):
            continue
        target = root / relative
        if source.is_dir() and not source.is_symlink():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() or target.is_symlink():
            target.unlink()
        shutil.copy2(source, target, follow_symlinks=False)
    if (overlay / "recorded-tools" / "index.json").exists():
        _merge_tool_index(root, overlay)


def build_tree(tmp_path: Path, *overlays: str, base: str = "mlx5-healthy") -> Path:
    """A private copy of the base host with the named overlays applied, in order."""
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / base, root, symlinks=True)
    for name in overlays:
        apply_overlay(root, name)
    return root


def sleep_then_apply(root: Path, overlay: str):
    """A sleep() for the Machine that applies the overlay's after/ files: the second counter sample."""
    calls = []

    def sleep(seconds: float) -> None:
        calls.append(seconds)
        if (OVERLAYS / overlay / "after").exists():
            apply_overlay(root, overlay, "after")

    sleep.calls = calls
    return sleep


def no_discovery(*args):
    raise ImportError("no userspace initiator in unit tests")


def diagnose(root: Path, sleep=None, discover=no_discovery, **options) -> Dict[str, CheckResult]:
    """Run every check on a fixture tree; results keyed by their label ("port.mtu mlx5_0/1")."""
    options.setdefault("interval", 0.5)
    machine = Machine(str(root), sleep=sleep or (lambda s: None))
    results = run_checks(Context(machine, DoctorOptions(**options), discover=discover))
    keyed = {r.label: r for r in results}
    assert len(keyed) == len(results), "two results with the same check and subject"
    return keyed


def status_of(results: Dict[str, CheckResult], label: str) -> Optional[str]:
    return results[label].status.value if label in results else None


def record_tool(root: Path, argv, stdout: str, returncode: int = 0, stderr: str = "") -> None:
    """Add (or replace) one recorded tool run in a built tree."""
    index_file = root / "recorded-tools" / "index.json"
    index = [e for e in json.loads(index_file.read_text()) if e.get("argv") != list(argv)]
    name = "test-" + "-".join(argv).replace("/", "_") + ".txt"
    (root / "recorded-tools" / name).write_text(stdout)
    index.append({"argv": list(argv), "returncode": returncode, "stdout_file": name, "stderr": stderr})
    index_file.write_text(json.dumps(index, indent=1))


def mark_missing(root: Path, *tools: str) -> None:
    """Make tools 'not installed' in a built tree."""
    index_file = root / "recorded-tools" / "index.json"
    index = [e for e in json.loads(index_file.read_text()) if e.get("argv", [""])[0] not in tools]
    index.append({"missing": list(tools)})
    index_file.write_text(json.dumps(index, indent=1))
