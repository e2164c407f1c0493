"""A fake /sys/kernel/config/nvmet on a tmp directory, with the rules Linux 6.1's nvmet enforces.

Real directories and files (so a test can look at them), but mkdir populates an object's default
attributes and groups as configfs does, and writes/links/rmdirs are checked the way
drivers/nvme/target/configfs.c checks them, returning the same errno values.
"""
import errno
import os
import shutil
import uuid

from nvmeof_roce.kernel.nvmet import ConfigFS
from nvmeof_roce.nvme.fabrics import DISCOVERY_NQN



def _err(code, path):
    return OSError(code, os.strerror(code), path)


class FakeNvmetFS(ConfigFS):
    def __init__(self, base, rdma_addrs=("10.99.0.1",), sys_module=None, tmpfs_dirs=(), dhchap=False,
                 discovery_nqn=False, devices=(), kernel_612=False):
        # kernel_612: what Debian's 6.12 adds (seen in nvmetcli's save there): attr_firmware, attr_ieee_oui,
        # addr_tsas, param_max_queue_size, a passthru/ directory in every subsystem; with dhchap and
        # discovery_nqn it is that kernel
        self.kernel_612 = kernel_612
        self.dhchap = dhchap
        self.devices = set(devices)   # paths that count as existing block devices (e.g. /dev/nullb0)
        self.base = str(base)
        self.cfs = os.path.join(self.base, "config")
        self.root = os.path.join(self.cfs, "nvmet")
        self.sys_module = sys_module or os.path.join(self.base, "sys_module")
        self.rdma_addrs = set(rdma_addrs)
        self.tmpfs_dirs = [str(d) for d in tmpfs_dirs]
        self.ops = []          # (op, relpath, value) of every mutating call, for assertions
        os.makedirs(self.sys_module, exist_ok=True)
        for m in ("nvmet", "nvmet_rdma", "nvme_fabrics", "nvme_loop"):
            os.makedirs(os.path.join(self.sys_module, m), exist_ok=True)
        for d in ("subsystems", "ports", "hosts"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        if discovery_nqn:   # newer kernels; not Debian's 6.1
            self._file(os.path.join(self.root, "discovery_nqn"), DISCOVERY_NQN)

    # helpers -------------------------------------------------------------
    def rel(self, p):
        return os.path.relpath(p, self.root)

    def parts(self, p):
        r = self.rel(p)
        return [] if r == "." else r.split("/")

    def _file(self, path, value, mode=0o644):
        with open(path, "w") as f:
            f.write(f"{value}\n")
        os.chmod(path, mode)

    def _get(self, path):
        with open(path) as f:
            return f.read().strip()

    def _set(self, path, value):
        with open(path, "w") as f:
            f.write(f"{value}\n")

    def unload(self, module):
        shutil.rmtree(os.path.join(self.sys_module, module), ignore_errors=True)

    def port_enabled(self, port_dir):
        return bool(os.listdir(os.path.join(port_dir, "subsystems")))

    # ConfigFS ---------------------------------------------------------------
    def mkdir(self, p):
        self.ops.append(("mkdir", self.rel(p), None))
        parts = self.parts(p)
        if os.path.lexists(p):
            raise _err(errno.EEXIST, p)
        if not os.path.isdir(os.path.dirname(p)):
            raise _err(errno.ENOENT, p)
        if parts[0] == "subsystems" and len(parts) == 2:
            if parts[1] == DISCOVERY_NQN:
                raise _err(errno.EINVAL, p)
            os.mkdir(p)
            for k, v in {"allow_any_host": "0", "version": "1.3", "serial": uuid.uuid4().hex[:16],
                         "model": "Linux", "cntlid_min": "1", "cntlid_max": "65519", "pi_enable": "0",
                         "qid_max": "128"}.items():
                self._file(f"{p}/attr_{k}", v)
            os.mkdir(f"{p}/namespaces")
            os.mkdir(f"{p}/allowed_hosts")
            if self.kernel_612:
                self._file(f"{p}/attr_firmware", "6.12.0")  # nvmet's default: the kernel release, cut to 8
                self._file(f"{p}/attr_ieee_oui", "0x000000")
                os.mkdir(f"{p}/passthru")
                for k, v in {"device_path": "(null)", "enable": "0", "clear_ids": "1", "admin_timeout": "0",
                             "io_timeout": "0"}.items():
                    self._file(f"{p}/passthru/{k}", v)
        elif parts[0] == "subsystems" and len(parts) == 4 and parts[2] == "namespaces":
            try:
                nsid = int(parts[3])
            except ValueError:
                raise _err(errno.EINVAL, p)
            if nsid == 0 or nsid == 0xFFFFFFFF:
                raise _err(errno.EINVAL, p)
            os.mkdir(p)
            self._file(f"{p}/device_path", "(null)")
            self._file(f"{p}/device_uuid", str(uuid.uuid4()))
            self._file(f"{p}/device_nguid", "00000000-0000-0000-0000-000000000000")
            self._file(f"{p}/enable", "0")
            self._file(f"{p}/buffered_io", "0")
            self._file(f"{p}/ana_grpid", "1")
            self._file(f"{p}/revalidate_size", "", mode=0o200)
        elif parts[0] == "ports" and len(parts) == 2:
            try:
                v = int(parts[1])
                assert 0 <= v <= 0xFFFF
            except (ValueError, AssertionError):
                raise _err(errno.EINVAL, p)
            os.mkdir(p)
            self._addr_files(p)
            self._file(f"{p}/param_inline_data_size", "-1")
            self._file(f"{p}/param_pi_enable", "0")
            if self.kernel_612:
                self._file(f"{p}/param_max_queue_size", "-1")
            os.mkdir(f"{p}/subsystems")
            os.mkdir(f"{p}/referrals")
            os.makedirs(f"{p}/ana_groups/1")
            self._file(f"{p}/ana_groups/1/ana_state", "optimized")
        elif parts[0] == "ports" and len(parts) == 4 and parts[2] == "referrals":
            os.mkdir(p)
            self._addr_files(p)
            self._file(f"{p}/addr_portid", "0")
            self._file(f"{p}/enable", "0")
        elif parts[0] == "ports" and len(parts) == 4 and parts[2] == "ana_groups":
            g = int(parts[3])
            if not 1 <= g <= 128:
                raise _err(errno.EINVAL, p)
            os.mkdir(p)
            self._file(f"{p}/ana_state", "inaccessible")   # what 6.1 starts a new group with
        elif parts[0] == "hosts" and len(parts) == 2:
            os.mkdir(p)   # Debian's 6.1 has no NVME_TARGET_AUTH: no dhchap_* attributes
            if self.dhchap:
                for k, v in {"key": "", "ctrl_key": "", "hash": "hmac(sha256)", "dhgroup": "null"}.items():
                    self._file(f"{p}/dhchap_{k}", v)
        else:
            raise _err(errno.EPERM, p)

    def _addr_files(self, p):
        for k, v in {"adrfam": "", "traddr": "", "treq": "not specified", "trsvcid": "", "trtype": ""}.items():
            self._file(f"{p}/addr_{k}", v)
        if self.kernel_612:
            self._file(f"{p}/addr_tsas", "not specified")

    def rmdir(self, p):
        self.ops.append(("rmdir", self.rel(p), None))
        parts = self.parts(p)
        if not os.path.isdir(p):
            raise _err(errno.ENOENT, p)
        if parts[0] == "subsystems" and len(parts) == 2:
            if os.listdir(f"{p}/namespaces") or os.listdir(f"{p}/allowed_hosts"):
                raise _err(errno.ENOTEMPTY, p)
            for port in os.listdir(os.path.join(self.root, "ports")):
                if os.path.lexists(os.path.join(self.root, "ports", port, "subsystems", parts[1])):
                    raise _err(errno.EBUSY, p)
        elif parts[0] == "ports" and len(parts) == 2:
            if os.listdir(f"{p}/subsystems") or os.listdir(f"{p}/referrals") or \
                    set(os.listdir(f"{p}/ana_groups")) - {"1"}:
                raise _err(errno.ENOTEMPTY, p)
        elif parts[0] == "ports" and len(parts) == 4 and parts[2] == "ana_groups" and parts[3] == "1":
            raise _err(errno.EPERM, p)
        elif parts[0] == "hosts" and len(parts) == 2:
            for s in os.listdir(os.path.join(self.root, "subsystems")):
                if os.path.lexists(os.path.join(self.root, "subsystems", s, "allowed_hosts", parts[1])):
                    raise _err(errno.EBUSY, p)
        shutil.rmtree(p)

    def symlink(self, target, link):
        self.ops.append(("symlink", self.rel(link), self.rel(target)))
        lp = self.parts(link)
        tp = self.parts(target)
        if os.path.lexists(link):
            raise _err(errno.EEXIST, link)
        if not os.path.isdir(target):
            raise _err(errno.ENOENT, target)
        if lp[0] == "subsystems" and len(lp) == 4 and lp[2] == "allowed_hosts":
            if tp[0] != "hosts":
                raise _err(errno.EINVAL, link)
            if self._get(os.path.join(self.root, "subsystems", lp[1], "attr_allow_any_host")) == "1":
                raise _err(errno.EINVAL, link)
        elif lp[0] == "ports" and len(lp) == 4 and lp[2] == "subsystems":
            if tp[0] != "subsystems":
                raise _err(errno.EINVAL, link)
            port = os.path.join(self.root, "ports", lp[1])
            if not self.port_enabled(port):
                trtype = self._get(f"{port}/addr_trtype")
                if trtype == "rdma":
                    if not os.path.isdir(os.path.join(self.sys_module, "nvmet_rdma")):
                        raise _err(errno.EINVAL, link)
                    traddr = self._get(f"{port}/addr_traddr")
                    if traddr not in self.rdma_addrs:
                        raise _err(errno.EADDRNOTAVAIL, link)
                    ep = (trtype, traddr, self._get(f"{port}/addr_trsvcid"))
                    for other in os.listdir(os.path.join(self.root, "ports")):
                        od = os.path.join(self.root, "ports", other)
                        if od != port and self.port_enabled(od) and \
                                (self._get(f"{od}/addr_trtype"), self._get(f"{od}/addr_traddr"),
                                 self._get(f"{od}/addr_trsvcid")) == ep:
                            raise _err(errno.EADDRINUSE, link)
                elif trtype not in ("loop", "tcp"):
                    raise _err(errno.EINVAL, link)
        else:
            raise _err(errno.EPERM, link)
        if lp[0] == "ports" and not self.port_enabled(os.path.join(self.root, "ports", lp[1])):
            idsz = os.path.join(self.root, "ports", lp[1], "param_inline_data_size")
            if self._get(f"{self.root}/ports/{lp[1]}/addr_trtype") == "rdma" and self._get(idsz) == "-1":
                self._set(idsz, "4096")     # nvmet-rdma resolves the default when it enables the port
        os.symlink(target, link)

    def unlink(self, p):
        self.ops.append(("unlink", self.rel(p), None))
        if not os.path.islink(p):
            raise _err(errno.ENOENT if not os.path.lexists(p) else errno.EPERM, p)
        os.unlink(p)

    def write(self, p, value):
        value = str(value)
        self.ops.append(("write", self.rel(p), value))
        parts = self.parts(p)
        leaf = parts[-1]
        if not os.path.isfile(p):
            raise _err(errno.ENOENT, p)
        v = value.strip()
        d = os.path.dirname(p)
        if parts[0] == "ports" and len(parts) == 3:
            if self.port_enabled(d):
                raise _err(errno.EACCES, p)
            self._check_addr(leaf, v, p)
            if leaf == "addr_tsas" and self._get(f"{d}/addr_trtype") != "tcp":
                raise _err(errno.EINVAL, p)  # nvmet_addr_tsas_store: TCP ports only
            if leaf == "addr_trtype" and self.kernel_612:
                self._set(f"{d}/addr_tsas", "connected" if v == "rdma" else "none" if v == "tcp" else "not specified")
        elif parts[0] == "subsystems" and len(parts) == 3 and leaf == "attr_firmware":
            if not 1 <= len(v) <= 8:
                raise _err(errno.EINVAL, p)
        elif parts[0] == "subsystems" and len(parts) == 3 and leaf == "attr_ieee_oui":
            try:
                n = int(v, 0)
            except ValueError:
                raise _err(errno.EINVAL, p)
            if n >= 1 << 24:
                raise _err(errno.EINVAL, p)
            v = f"0x{n:06x}"
        elif parts[0] == "ports" and len(parts) == 5 and parts[2] == "referrals":
            if leaf != "enable" and self._get(f"{d}/enable") == "1":
                raise _err(errno.EACCES, p)
            if leaf.startswith("addr_") and leaf != "addr_portid":
                self._check_addr(leaf, v, p)
        elif parts[0] == "ports" and len(parts) == 5 and parts[2] == "ana_groups":
            if v not in ("optimized", "non-optimized", "inaccessible", "persistent-loss", "change"):
                raise _err(errno.EINVAL, p)
        elif parts[0] == "subsystems" and len(parts) == 5 and parts[2] == "namespaces":
            enabled = self._get(f"{d}/enable") == "1"
            if leaf in ("device_path", "device_uuid", "device_nguid") and enabled:
                raise _err(errno.EBUSY, p)
            if leaf == "buffered_io" and enabled:
                raise _err(errno.EINVAL, p)
            if leaf == "device_uuid":
                try:
                    v = str(uuid.UUID(v))
                except ValueError:
                    raise _err(errno.EINVAL, p)
            if leaf == "device_nguid":
                h = v.replace("-", "")
                if len(h) != 32:
                    raise _err(errno.EINVAL, p)
                v = str(uuid.UUID(h))
            if leaf == "ana_grpid" and not 1 <= int(v) <= 128:
                raise _err(errno.EINVAL, p)
            if leaf == "enable":
                if v in ("1", "y", "Y"):
                    path = self._get(f"{d}/device_path")
                    if not path or path == "(null)":
                        raise _err(errno.EINVAL, p)
                    if not os.path.exists(path) and path not in self.devices:
                        raise _err(errno.ENOENT, p)
                    if any(path.startswith(t + "/") for t in self.tmpfs_dirs) and \
                            self._get(f"{d}/buffered_io") != "1":
                        raise _err(errno.EINVAL, p)
                    v = "1"
                else:
                    v = "0"
        elif parts[0] == "subsystems" and len(parts) == 3:
            if leaf == "attr_allow_any_host":
                if v == "1" and os.listdir(f"{d}/allowed_hosts"):
                    raise _err(errno.EINVAL, p)
            if leaf == "attr_serial" and (len(v) > 20 or not v):
                raise _err(errno.EINVAL, p)
        elif parts[0] == "hosts" and len(parts) == 3:
            if leaf in ("dhchap_key", "dhchap_ctrl_key") and not v.startswith("DHHC-1:"):
                raise _err(errno.EINVAL, p)
        self._set(p, v)

    def _check_addr(self, leaf, v, p):
        ok = {"addr_trtype": ("rdma", "fc", "tcp", "loop"), "addr_adrfam": ("ipv4", "ipv6", "ib", "fc", "loop", "pcie"),
              "addr_treq": ("not specified", "required", "not required")}
        if leaf in ok and v not in ok[leaf]:
            raise _err(errno.EINVAL, p)
