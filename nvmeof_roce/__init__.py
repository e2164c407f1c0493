"""nvmeof-roce: NVMe over Fabrics on RDMA over Converged Ethernet."""

from pathlib import Path

__version__ = "0.1.0"

SHIPPED = ("fio-jobs", "targets")  # directories of the checkout the wheel carries too (setup.py)


def shipped(name: str) -> Path:
    """The checkout's directory `name` (one of SHIPPED) when this package runs from a checkout, else the copy
    the installed wheel carries in nvmeof_roce/share/."""
    package = Path(__file__).resolve().parent
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / name).is_dir():
        return checkout / name
    return package / "share" / name
