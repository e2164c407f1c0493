"""Lab-tier tests run inside the QEMU guest (`make test` boots it once for all of them).

The guest's init exports NVMEOF_LAB=1.  Outside the guest these tests are
skipped with the command that runs them; inside it, nothing is skipped for
lack of RDMA: a missing rxe0 there is a failure.
"""
import os

import pytest

IN_LAB = os.environ.get("NVMEOF_LAB") == "1"


def pytest_collection_modifyitems(config, items):
    if IN_LAB:
        return
    skip = pytest.mark.skip(reason="lab test: run it with `nvmeof-roce lab run -- python3 -m pytest -m lab tests/lab`")
    for item in items:
        if "lab" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def nvme_host_modules():
    """The kernel NVMe-oF host (nvme-cli needs nvme_fabrics loaded to scan its topology)."""
    if IN_LAB:
        import subprocess
        subprocess.run(["modprobe", "-a", "nvme_rdma", "nvme_fabrics"], check=True)


CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def no_fio_state_left_in_the_checkout(request):
    """fio saves a verify job's state as local-<job>-<n>-verify.state in its working directory (the checkout,
    in the guest) unless told --verify_state_save=0: a test that leaves one fails, naming it."""
    import glob
    before = set(glob.glob(os.path.join(CHECKOUT, "*-verify.state")))
    yield
    left = sorted(set(glob.glob(os.path.join(CHECKOUT, "*-verify.state"))) - before)
    for path in left:
        os.unlink(path)
    assert not left, (f"{request.node.nodeid} left fio verify state in the checkout: "
                      f"{', '.join(map(os.path.basename, left))}; give that fio run --verify_state_save=0")
