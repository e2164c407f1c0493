"""The tests/ tree as pytest sees it from the repository root: every tier (unit, lab, two-node) is collected by a
plain `pytest`, without errors, and no two modules of it share a basename.

The tiers' folders have no __init__.py, so pytest imports their modules by basename (each folder is put on
sys.path): two modules called the same in two folders make the second an import error, or a test module
silently importing the other folder's helper."""
import ast
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


def modules_under_tests():
    """Every Python module under tests/ but conftest.py and __init__.py (which pytest imports apart)."""
    return sorted(p for p in TESTS.rglob("*.py") if p.name not in ("conftest.py", "__init__.py"))


def shared_basenames(paths):
    """{basename: the folders holding a module of that name}, for names held by more than one folder."""
    folders = defaultdict(set)
    for path in paths:
        folders[path.name].add(str(path.parent.relative_to(REPO)))
    return {name: sorted(dirs) for name, dirs in folders.items() if len(dirs) > 1}


def defines_tests(path: Path) -> bool:
    """The module has a test function or test class at its top level (pytest's default name prefixes)."""
    tree = ast.parse(path.read_text(), str(path))
    return any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")
               or isinstance(node, ast.ClassDef) and node.name.startswith("Test") for node in tree.body)


def test_no_two_modules_under_tests_share_a_basename():
    shared = shared_basenames(modules_under_tests())
    assert not shared, ("modules of the same name in different test folders (pytest imports them by basename "
                        f"from the root, so one hides the other): {shared}; rename one")


def test_the_basename_check_finds_a_name_in_two_tiers():
    paths = [TESTS / "unit" / "test_ops.py", TESTS / "lab" / "test_ops.py", TESTS / "lab" / "test_auth.py"]
    assert shared_basenames(paths) == {"test_ops.py": ["tests/lab", "tests/unit"]}


def collect(*args):
    """`pytest --collect-only -q ARGS` run from the repository root: the process and its output's lines."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    return proc, proc.stdout.splitlines()


def test_a_plain_pytest_from_the_root_collects_every_test_module_without_errors():
    # `-m ""` clears the default marker filter of pyproject.toml's addopts: collection, not selection, is checked
    proc, lines = collect("-m", "")
    collected = {line.split("::")[0] for line in lines if "::" in line}
    report = [line for line in lines if "::" not in line]  # the errors and the summary, without the test ids
    assert proc.returncode == 0, "`pytest --collect-only` from the root failed:\n" + "\n".join(report[-60:]) + proc.stderr
    with_tests = {str(p.relative_to(REPO)) for p in modules_under_tests() if defines_tests(p)}
    missing = sorted(with_tests - collected)
    assert not missing, ("test modules a plain `pytest` from the root does not collect (name them test_*.py, "
                         f"in a folder under tests/ that pytest walks): {missing}")
    assert {path.split("/")[1] for path in collected} >= {"unit", "lab", "twonode"}


def test_every_lab_and_two_node_test_carries_its_tier_marker_so_a_host_run_skips_it():
    # tests/lab/conftest.py and tests/twonode/conftest.py skip by marker, not by folder
    proc, lines = collect("-m", "not lab and not twonode", "tests/lab", "tests/twonode")
    unmarked = [line for line in lines if "::" in line]
    assert not unmarked, f"tests of the lab or two-node tier without their marker (lab, twonode): {unmarked}"
    assert proc.returncode == 5, "\n".join(lines[-40:]) + proc.stderr  # 5: every test deselected, no error
