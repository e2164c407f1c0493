"""The host NQN and host ID, derived exactly as libnvme does (nvme_host_get_ids), so that our initiator, our
nvme-cli wrapper and nvme-cli itself present one identity for a host.

The order (libnvme src/nvme/tree.c nvme_host_get_ids, fabrics.c nvmf_hostid_generate; docs/protocol.md §10):

1. the values given (command line);
2. the first host of the JSON config (/etc/nvme/config.json, `-J`): its "hostnqn" and "hostid";
3. $LIBNVME_HOSTID / $LIBNVME_HOSTNQN if set (set and empty: none), else /etc/nvme/hostid and
   /etc/nvme/hostnqn (the first line);
4. a host NQN without a host ID: the host ID is what follows "uuid:" in the NQN;
5. no host ID still: the machine's UUID: /sys/class/dmi/id/product_uuid (a 36-character line), else the
   SMBIOS type 1 entry under /sys/firmware/dmi/entries (unless its UUID bytes are all zero), else the
   device tree's /proc/device-tree/ibm,partition-uuid, else a random (version 4) UUID;
6. no host NQN: nqn.2014-08.org.nvmexpress:uuid:<host ID>.

libnvme 1.0 dropped nvme-cli 1.x's UUID derived from /etc/machine-id; so do we.  The order is the same in
libnvme 1.3 (Debian 12's nvme-cli 2.3) and libnvme 1.13 (Debian 13's nvme-cli 2.13): nvme_host_get_ids and
nvmf_hostid_generate / nvmf_hostnqn_generate_from_hostid did not change between them, and the lab checks it
against both (tests/lab/test_host_identity_nvme_cli.py).  A random identity differs at
every run (as nvme-cli's does): `nvme gen-hostnqn > /etc/nvme/hostnqn` fixes one, and `nvmeof-roce doctor` says so.
"""
from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional, Tuple

from .errors import NvmeofError

log = logging.getLogger(__name__)

UUID_NQN_PREFIX = "nqn.2014-08.org.nvmexpress:uuid:"
ETC_NVME = "/etc/nvme"
CONFIG_JSON = "/etc/nvme/config.json"
NQN_SIZE = 256      # NVMF_NQN_SIZE: libnvme reads at most this - 1 bytes of /etc/nvme/hostnqn
HOSTID_SIZE = 37    # NVMF_HOSTID_SIZE
SMBIOS_SYSTEM_INFORMATION = 1


@dataclass
class Paths:
    """Where the machine's identity is read (tests point these at a tree of their own)."""
    etc_dir: str = ETC_NVME
    product_uuid: str = "/sys/class/dmi/id/product_uuid"
    dmi_entries: str = "/sys/firmware/dmi/entries"
    device_tree_uuid: str = "/proc/device-tree/ibm,partition-uuid"
    environ: Dict[str, str] = field(default_factory=lambda: os.environ)

    def __post_init__(self):  # libnvme's own overrides of the DMI and device-tree places
        self.dmi_entries = self.environ.get("LIBNVME_DMI_ENTRIES_DIR", self.dmi_entries)
        self.device_tree_uuid = self.environ.get("LIBNVME_UUID_IBM", self.device_tree_uuid)


@dataclass
class HostIdentity:
    hostnqn: str
    hostid: str
    source: str  # where each came from, e.g. "hostnqn: /etc/nvme/hostnqn, hostid: the host NQN's UUID"

    def to_dict(self):
        return asdict(self)


def _read_file(path: str, size: int) -> Optional[str]:
    """nvmf_read_file: up to size - 1 bytes, cut at the first newline; None if missing or empty."""
    try:
        with open(path, "rb") as f:
            data = f.read(size - 1)
    except OSError:
        return None
    text = data.split(b"\0", 1)[0].decode("utf-8", "replace")
    if not text:
        return None
    return text.split("\n", 1)[0]


def _from_env_or_file(name: str, path: str, size: int, environ) -> Tuple[Optional[str], str]:
    var = f"LIBNVME_{name.upper()}"
    if var in environ:
        return (environ[var] or None), f"${var}"
    return _read_file(path, size), path


def _uuid_from_product_uuid(paths: Paths) -> Optional[str]:
    try:
        with open(paths.product_uuid, "r", encoding="ascii", errors="replace") as f:
            line = f.readline()
    except OSError:
        return None
    return line[:36] if len(line) == 37 else None  # getline() must return 36 characters and the newline


def _uuid_from_dmi_entries(paths: Paths) -> Optional[str]:
    """The System UUID of the SMBIOS type 1 entry (DMTF SMBIOS 3.0 §7.2.1: the first three fields little
    endian), skipping an all-zero one."""
    try:
        names = sorted(os.listdir(paths.dmi_entries))
    except OSError:
        return None
    for name in names:
        if name.startswith("."):
            continue
        try:
            with open(os.path.join(paths.dmi_entries, name, "type")) as f:
                if int(f.read(512).split()[0]) != SMBIOS_SYSTEM_INFORMATION:
                    continue
            with open(os.path.join(paths.dmi_entries, name, "raw"), "rb") as f:
                raw = f.read(512)
        except (OSError, ValueError, IndexError):
            continue
        if len(raw) < 24 or not any(raw[8:24]):
            continue
        return str(uuid.UUID(bytes_le=bytes(raw[8:24])))
    return None


def _uuid_from_device_tree(paths: Paths) -> Optional[str]:
    try:
        with open(paths.device_tree_uuid, "rb") as f:
            text = f.read(36).split(b"\0", 1)[0].decode("ascii", "replace")
    except OSError:
        return None
    return text or None


def generate_hostid(paths: Optional[Paths] = None) -> Tuple[str, str]:
    """nvmf_hostid_generate: (host ID, where it came from)."""
    paths = paths or Paths()
    for source, read in ((paths.product_uuid, _uuid_from_product_uuid), (paths.dmi_entries, _uuid_from_dmi_entries),
                         (paths.device_tree_uuid, _uuid_from_device_tree)):
        value = read(paths)
        if value:
            return value, source
    return str(uuid.uuid4()), "random"


def config_json_host(path: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """The first host's (hostnqn, hostid) of a libnvme JSON config (a list of hosts); (None, None) without one.
    A file that is there but not libnvme's JSON is an error naming the file."""
    if not path or path == "none":
        return None, None
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:
        raise NvmeofError(f"{path}: not a libnvme JSON config: {exc}",
                          "fix the file (nvme connect -O prints one), or pass -J none") from None
    if not isinstance(data, list) or not all(isinstance(h, dict) for h in data):
        raise NvmeofError(f"{path}: not a libnvme JSON config (a list of hosts)",
                          'write [{"hostnqn": ..., "hostid": ..., "subsystems": [...]}], or pass -J none')
    if not data:
        return None, None
    return data[0].get("hostnqn") or None, data[0].get("hostid") or None


_random_identity: Optional[Tuple[str, str]] = None  # one random identity per process, as one nvme-cli run has


def host_identity(hostnqn: Optional[str] = None, hostid: Optional[str] = None, *,
                  config_json: Optional[str] = CONFIG_JSON, paths: Optional[Paths] = None) -> HostIdentity:
    """The host NQN and host ID as libnvme's nvme_host_get_ids derives them (see the module's docstring)."""
    global _random_identity
    paths = paths or Paths()
    src = {}
    if hostnqn:
        src["hostnqn"] = "option"
    if hostid:
        src["hostid"] = "option"
    if not (hostnqn and hostid):
        j_nqn, j_id = config_json_host(config_json)
        if not hostid and j_id:
            hostid, src["hostid"] = j_id, config_json
        if not hostnqn and j_nqn:
            hostnqn, src["hostnqn"] = j_nqn, config_json
    if not hostid:
        hostid, where = _from_env_or_file("hostid", os.path.join(paths.etc_dir, "hostid"), HOSTID_SIZE,
                                          paths.environ)
        if hostid:
            src["hostid"] = where
    if not hostnqn:
        hostnqn, where = _from_env_or_file("hostnqn", os.path.join(paths.etc_dir, "hostnqn"), NQN_SIZE,
                                           paths.environ)
        if hostnqn:
            src["hostnqn"] = where
    if not hostid and hostnqn and "uuid:" in hostnqn:
        hostid, src["hostid"] = hostnqn[hostnqn.index("uuid:") + len("uuid:"):], "the host NQN's UUID"
    if not hostid:
        hostid, where = generate_hostid(paths)
        if where == "random":
            if _random_identity is None:
                _random_identity = (hostid, where)
            hostid = _random_identity[0]
            log.warning("no /etc/nvme/hostnqn and no machine UUID (DMI, device tree): using a random host "
                        "identity, different at every run; fix: nvme gen-hostnqn > /etc/nvme/hostnqn")
        src["hostid"] = where
    if not hostnqn:
        hostnqn, src["hostnqn"] = UUID_NQN_PREFIX + hostid, "the host ID"
    try:
        uuid.UUID(hostid)
    except ValueError:
        raise NvmeofError(f"host ID {hostid!r} (from {src['hostid']}) is not a UUID",
                          "use a UUID (nvme gen-hostnqn's form), e.g. in /etc/nvme/hostid") from None
    if "uuid:" in hostnqn and hostnqn[hostnqn.index("uuid:") + 5:] != hostid:
        log.info("host ID %s does not match the UUID in host NQN %s (the kernel accepts it; libnvme warns too)",
                 hostid, hostnqn)
    return HostIdentity(hostnqn=hostnqn, hostid=hostid,
                        source=f"hostnqn: {src['hostnqn']}, hostid: {src['hostid']}")
