"""Running one two-node scenario from the host: `nvmeof-roce lab run --nodes 2`, each node running SCRIPT ROLE
SCENARIO, then what the nodes left in the share (their console output, each node's result JSON)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def two_nodes(share: Path, scenario: str, script: str = "node.py", timeout: int = 1800):
    share.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "nvmeof_roce", "lab", "run", "--nodes", "2", "--share", str(share),
                           "--timeout", str(timeout),
                           "--target-cmd", f"python3 tests/twonode/{script} target {scenario}",
                           "--host-cmd", f"python3 tests/twonode/{script} host {scenario}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout + 120)
    (share / "console.log").write_text(proc.stdout + proc.stderr)
    results = {}
    for node in ("target", "host"):
        path = share / f"{node}-result.json"
        results[node] = json.loads(path.read_text()) if path.exists() else None
    return proc, results
