"""The host NQN and host ID our host_identity derives are the ones nvme-cli (libnvme) itself sends.

For each /etc/nvme arrangement the kernel host connects to our target with plain `nvme connect` (no -q/-I);
the controller's sysfs hostnqn and hostid are what libnvme derived, and host_identity() must give the same.
These are libnvme 1.13's rules (Debian 13). libnvme 1.3 (Debian 12's nvme-cli 2.3) has others, which a lab run on
6.1 showed: with only /etc/nvme/hostnqn the host ID is the kernel's per-boot random one, with only /etc/nvme/hostid
the NQN is made from the machine's DMI UUID (all zeros under QEMU), and LIBNVME_HOSTID is not read; so on libnvme
older than 1.13 these cases are skipped (host_identity follows 1.13; docs/kernel.md).
"""
import glob
import os
import shutil
import subprocess

import pytest

from nvmeof_roce.host_identity import UUID_NQN_PREFIX, Paths, host_identity
from targetproc import LAB_IP, ServedTarget, config, disconnect_all_quietly, nvme, ram_namespace

pytestmark = pytest.mark.lab


def _libnvme_version():
    try:
        out = subprocess.run(["nvme", "version"], capture_output=True, text=True).stdout
    except OSError:
        return (0, 0)  # no nvme-cli: the lab guest has it
    for line in out.splitlines():
        if line.startswith("libnvme version"):
            return tuple(int(x) for x in line.split()[2].split(".")[:2] if x.isdigit())
    return (0, 0)


OLD_LIBNVME = pytest.mark.skipif(_libnvme_version() < (1, 13), reason="libnvme older than 1.13 derives the host "
                                 "identity otherwise (the kernel's random host ID, the NQN from DMI): module docstring")

NQN = "nqn.2024-01.io.nvmeof-roce:lab-identity"
ETC = "/etc/nvme"
UUID_A = "0f6b3c52-7a1e-4c2d-9e55-6d1f0a3b8c01"
UUID_B = "5a0e9d44-2b7c-4f1a-8d3e-c7b2e1f09a17"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("identity")
    cfg = config([{"nqn": NQN, "attr": {"allow_any_host": "1"}, "allowed_hosts": [],
                   "namespaces": [ram_namespace(1, "16M")]}])
    target = ServedTarget(cfg, str(tmp / "target.json")).start()
    saved = str(tmp / "etc-nvme")
    shutil.copytree(ETC, saved)
    yield target
    disconnect_all_quietly()
    shutil.rmtree(ETC)
    shutil.copytree(saved, ETC)
    assert target.stop() == 0, target.output()


def arrange(files):
    for name in ("hostnqn", "hostid"):
        path = os.path.join(ETC, name)
        if os.path.exists(path):
            os.unlink(path)
        if files.get(name) is not None:
            with open(path, "w") as f:
                f.write(files[name] + "\n")


def sent_identity(env=None):
    """Connect with nvme-cli's own identity; return (hostnqn, hostid) the kernel controller was created with."""
    proc = subprocess.run(["nvme", "connect", "-t", "rdma", "-a", LAB_IP, "-s", "4420", "-n", NQN],
                          capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    try:
        for ctrl in glob.glob("/sys/class/nvme/nvme*"):
            if open(f"{ctrl}/subsysnqn").read().strip() == NQN:
                return open(f"{ctrl}/hostnqn").read().strip(), open(f"{ctrl}/hostid").read().strip()
        raise AssertionError(f"no controller of {NQN} after nvme connect")
    finally:
        nvme("disconnect", "-n", NQN)


@pytest.mark.parametrize("files,env", [
    ({"hostnqn": UUID_NQN_PREFIX + UUID_A, "hostid": UUID_B}, {}),        # both files, not matching
    pytest.param({"hostnqn": UUID_NQN_PREFIX + UUID_A}, {}, marks=OLD_LIBNVME),  # host ID from the NQN's UUID
    pytest.param({"hostid": UUID_B}, {}, marks=OLD_LIBNVME),                     # host NQN from the host ID
    pytest.param({"hostnqn": UUID_NQN_PREFIX + UUID_A}, {"LIBNVME_HOSTID": UUID_B},
                 marks=OLD_LIBNVME),                                             # the environment over the file
], ids=["both-files", "hostnqn-only", "hostid-only", "env-hostid"])
def test_our_identity_is_the_one_nvme_cli_sends(served, files, env):
    arrange(files)
    sent = sent_identity(env)
    ours = host_identity(config_json="none", paths=Paths(environ={**os.environ, **env}))
    assert (ours.hostnqn, ours.hostid) == sent, ours.source


@OLD_LIBNVME
def test_with_no_files_both_derive_the_host_nqn_from_the_machine_host_id(served):
    """No /etc/nvme/host*: libnvme takes the machine's UUID (DMI, device tree) or a random one; the NQN is
    always uuid:<that host ID>.  Where the machine has a UUID, ours is the same one."""
    arrange({})
    hostnqn, hostid = sent_identity()
    assert hostnqn == UUID_NQN_PREFIX + hostid
    ours = host_identity(config_json="none")
    assert ours.hostnqn == UUID_NQN_PREFIX + ours.hostid
    if "random" not in ours.source:
        assert (ours.hostnqn, ours.hostid) == (hostnqn, hostid), ours.source
