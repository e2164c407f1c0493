"""RDMA software stack: kernel modules, /dev/infiniband device files, the locked-memory limit, our native module."""
from __future__ import annotations

import os
import re
import stat
from typing import List, Optional, Tuple

from ..context import Context
from ..result import CheckResult, fail, ok, skipped, warn

# Needed by every userspace RDMA program (pyverbs, perftest, our target and initiator).
USERSPACE_MODULES = ("ib_uverbs", "rdma_ucm")
# RDMA providers: one of them must be loaded for any RDMA device to exist.
PROVIDER_MODULES = (
    "mlx5_ib", "mlx4_ib", "irdma", "bnxt_re", "qedr", "hns_roce_hw_v2", "erdma", "mana_ib",
    "efa", "vmw_pvrdma", "ocrdma", "iw_cxgb4", "rdma_rxe", "siw",
)
# Kernel NVMe-oF: loaded on demand (nvme connect / enabling an nvmet port) if the module exists.
KERNEL_NVME_MODULES = {
    "nvme_rdma": "the kernel host (nvme connect -t rdma)",
    "nvmet_rdma": "the kernel target (nvmeof-roce nvmet apply)",
}

MEMLOCK_LOW = 1 << 30  # below 1 GiB, registering target buffers or a RAM namespace fails
CAP_IPC_LOCK = 14

LOADED, BUILTIN, AVAILABLE, MISSING = "loaded", "built-in", "available", "missing"


def _kernel_release(ctx: Context) -> Optional[str]:
    return ctx.machine.read("/proc/sys/kernel/osrelease")


def _module_names_in(text: Optional[str], only_before_colon: bool = False) -> set:
    """Module names from modules.dep / modules.builtin lines ("kernel/.../nvme-rdma.ko.xz: ...")."""
    names = set()
    for line in (text or "").splitlines():
        path = line.split(":")[0] if only_before_colon else line.strip()
        base = os.path.basename(path)
        m = re.match(r"(.+?)\.ko(\.(xz|zst|gz))?$", base)
        if m:
            names.add(m.group(1).replace("-", "_"))
    return names


class ModuleTable:
    """Where each kernel module stands: loaded, built-in, available on disk, or missing."""

    def __init__(self, ctx: Context):
        machine = ctx.machine
        self.proc_modules = machine.read("/proc/modules")
        self.loaded = {line.split()[0] for line in (self.proc_modules or "").splitlines() if line.strip()}
        self.release = _kernel_release(ctx)
        self._ctx = ctx
        self._dep: Optional[set] = None
        self._builtin: Optional[set] = None

    def _lib(self, name: str) -> Optional[str]:
        if not self.release:
            return None
        return self._ctx.machine.read(f"/lib/modules/{self.release}/{name}")

    def state(self, module: str) -> str:
        if module in self.loaded:
            return LOADED
        machine = self._ctx.machine
        if machine.is_dir(f"/sys/module/{module}") and machine.read(f"/sys/module/{module}/initstate") is None:
            return BUILTIN  # built-in modules have /sys/module/X but no initstate
        if self._builtin is None:
            self._builtin = _module_names_in(self._lib("modules.builtin"))
        if module in self._builtin:
            return BUILTIN
        if self._dep is None:
            self._dep = _module_names_in(self._lib("modules.dep"), only_before_colon=True)
        return AVAILABLE if module in self._dep else MISSING


def check_kernel_modules(ctx: Context) -> CheckResult:
    """Detects a missing RDMA stack: ib_uverbs/rdma_ucm (userspace verbs and CM), an RDMA
    provider (mlx5_ib, irdma, bnxt_re, rdma_rxe, ...), and whether nvme_rdma/nvmet_rdma exist.
    Without the first two no userspace RDMA program can open a device; without a provider
    there is no device at all."""
    table = ModuleTable(ctx)
    evidence, problems, fixes = [], [], []
    if table.proc_modules is None:
        evidence.append("/proc/modules: absent (a kernel without loadable modules: only built-ins count)")
    states = {}
    for module in USERSPACE_MODULES + tuple(KERNEL_NVME_MODULES):
        states[module] = table.state(module)
    providers = [m for m in PROVIDER_MODULES if table.state(m) in (LOADED, BUILTIN)]
    for module, state in states.items():
        evidence.append(f"{module}: {state}")
    evidence.append(f"RDMA providers loaded: {', '.join(providers) or 'none'}")
    evidence.append(f"kernel: {table.release or '?'} (/proc/modules, /sys/module, /lib/modules/{table.release or '?'})")

    not_loaded = [m for m in USERSPACE_MODULES if states[m] not in (LOADED, BUILTIN)]
    status = "ok"
    if not_loaded:
        status = "fail"
        problems.append(f"{', '.join(not_loaded)} not loaded")
        if any(states[m] == MISSING for m in not_loaded):
            fixes.append("this kernel has no userspace RDMA modules: install the distribution's full kernel "
                         "modules (Ubuntu: linux-modules-extra-$(uname -r); Debian: the -amd64, not -cloud-amd64, kernel)")
        fixes.append(f"modprobe -a {' '.join(not_loaded)}; to load them at boot: "
                     f"printf '%s\\n' {' '.join(not_loaded)} > /etc/modules-load.d/rdma.conf")
    if not providers:
        status = "fail"
        problems.append("no RDMA provider driver loaded")
        fixes.append("load the NIC's RDMA driver (mlx5_ib, irdma, bnxt_re, qedr, ...), or for Soft-RoCE: "
                     "modprobe rdma_rxe && rdma link add rxe0 type rxe netdev ETH")
    missing_nvme = [m for m in KERNEL_NVME_MODULES if states[m] == MISSING]
    if missing_nvme:
        if status == "ok":
            status = "warn"
        problems.append(f"{', '.join(missing_nvme)} not available in this kernel")
        users = "; ".join(f"{m} is needed by {KERNEL_NVME_MODULES[m]}" for m in missing_nvme)
        fixes.append(f"{users}: install the kernel's extra modules (Ubuntu: linux-modules-extra-$(uname -r)); "
                     "the userspace target and initiator do not need them")

    loaded = [m for m, s in states.items() if s in (LOADED, BUILTIN)] + providers
    on_demand = [m for m, s in states.items() if s == AVAILABLE]
    summary = "loaded: " + ", ".join(loaded) if loaded else "nothing loaded"
    if on_demand:
        summary += f"; on demand: {', '.join(on_demand)}"
    details = {"modules": states, "providers": providers}
    if status == "fail":
        return fail("stack.modules", "", "; ".join(problems), evidence, "\n".join(fixes), **details)
    if status == "warn":
        return warn("stack.modules", "", "; ".join(problems), evidence, "\n".join(fixes), **details)
    return ok("stack.modules", "", summary, evidence, **details)


def _uverbs_nodes(ctx: Context) -> dict:
    """{ib device name: "uverbsN"} from /sys/class/infiniband_verbs/uverbsN/ibdev."""
    nodes = {}
    for node in ctx.machine.listdir("/sys/class/infiniband_verbs"):
        ibdev = ctx.machine.read(f"/sys/class/infiniband_verbs/{node}/ibdev")
        if ibdev:
            nodes[ibdev] = node
    return nodes


def check_device_files(ctx: Context) -> CheckResult:
    """Detects missing or unusable /dev/infiniband nodes: uverbsN for each device (ib_uverbs)
    and rdma_cm (rdma_ucm) must exist and be openable.  A world-writable uverbs node (the
    kernel's default 0666) lets any local user drive the RDMA device: a warning on shared hosts."""
    machine = ctx.machine
    if not ctx.devices:
        return skipped("stack.device_files", "", "no RDMA device to check")
    nodes = _uverbs_nodes(ctx)
    evidence, missing, world_writable, no_access = [], [], [], []
    wanted: List[Tuple[str, str]] = []
    for device in ctx.devices:
        if device.name in nodes:
            wanted.append((f"/dev/infiniband/{nodes[device.name]}", f"uverbs node of {device.name}"))
        else:
            missing.append(f"uverbs node of {device.name}")
            evidence.append(f"/sys/class/infiniband_verbs/*/ibdev: no uverbs node for {device.name}")
    wanted.append(("/dev/infiniband/rdma_cm", "RDMA CM"))
    for path, what in wanted:
        mode = machine.file_mode(path)
        if mode is None:
            missing.append(f"{path} ({what})")
            evidence.append(f"{path}: absent")
            continue
        evidence.append(f"{path}: {stat.filemode(mode)} ({what})")
        if mode & stat.S_IWOTH:
            world_writable.append(path)
        if machine.is_live and os.geteuid() != 0 and not os.access(path, os.R_OK | os.W_OK):
            no_access.append(path)
    details = {"uverbs": nodes}
    if missing:
        return fail("stack.device_files", "", f"missing: {', '.join(missing)}", evidence,
                    "modprobe -a ib_uverbs rdma_ucm (they create uverbsN and rdma_cm); without udev, "
                    "mount devtmpfs on /dev (mount -t devtmpfs devtmpfs /dev)", **details)
    if no_access:
        return fail("stack.device_files", "", f"not readable and writable by uid {os.geteuid()}: "
                    f"{', '.join(no_access)}", evidence,
                    "run as root, or give the user access: a udev rule such as "
                    "KERNEL==\"uverbs*\", GROUP=\"rdma\", MODE=\"0660\" and add the user to group rdma", **details)
    if world_writable:
        return warn("stack.device_files", "", f"world-writable: {', '.join(world_writable)}", evidence,
                    "any local user can use the RDMA device (0666 is the kernel's default); on a shared host "
                    "restrict it: /etc/udev/rules.d/90-rdma-restrict.rules with "
                    "KERNEL==\"uverbs*\", GROUP=\"rdma\", MODE=\"0660\", then udevadm trigger "
                    "and add RDMA users to group rdma", **details)
    return ok("stack.device_files", "", "present, not world-writable", evidence, **details)


def _memlock_limits(text: Optional[str]) -> Optional[Tuple[Optional[int], Optional[int]]]:
    """(soft, hard) bytes from /proc/self/limits' "Max locked memory" line; None = unlimited."""
    for line in (text or "").splitlines():
        if line.startswith("Max locked memory"):
            fields = line[len("Max locked memory"):].split()
            soft, hard = fields[0], fields[1]
            return (None if soft == "unlimited" else int(soft), None if hard == "unlimited" else int(hard))
    return None


def _has_cap_ipc_lock(status_text: Optional[str]) -> bool:
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status_text or "", re.M)
    return bool(m) and bool(int(m.group(1), 16) & (1 << CAP_IPC_LOCK))


def _human_bytes(value: Optional[int]) -> str:
    if value is None:
        return "unlimited"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:g} {unit}"
    return f"{value} bytes"


def check_memlock_limit(ctx: Context) -> CheckResult:
    """Detects an RLIMIT_MEMLOCK ("ulimit -l") too low to pin RDMA buffers.  Every memory
    region registered with the HCA is pinned and counted against it; the default (8 MiB, or
    64 KiB on older kernels) makes ibv_reg_mr fail with ENOMEM/EPERM.  CAP_IPC_LOCK (root)
    bypasses the limit."""
    limits = _memlock_limits(ctx.machine.read("/proc/self/limits"))
    if limits is None:
        return skipped("stack.memlock", "", "/proc/self/limits is not readable")
    soft, hard = limits
    capable = _has_cap_ipc_lock(ctx.machine.read("/proc/self/status"))
    evidence = [f"/proc/self/limits: Max locked memory soft {_human_bytes(soft)}, hard {_human_bytes(hard)}",
                f"/proc/self/status: CAP_IPC_LOCK {'present' if capable else 'absent'}"]
    details = {"soft": soft, "hard": hard, "cap_ipc_lock": capable}
    fix = ("for logins: /etc/security/limits.d/rdma.conf with '* soft memlock unlimited' and "
           "'* hard memlock unlimited', then log in again; for a systemd service: LimitMEMLOCK=infinity "
           "in its unit ([Service]); for a container: --ulimit memlock=-1:-1")
    if soft is None:
        return ok("stack.memlock", "", "ulimit -l unlimited", evidence, **details)
    if capable:
        return ok("stack.memlock", "", f"ulimit -l {_human_bytes(soft)}, but CAP_IPC_LOCK bypasses it "
                  "(services running as other users still need the limit raised)", evidence, **details)
    if soft < MEMLOCK_LOW:
        return warn("stack.memlock", "", f"ulimit -l {_human_bytes(soft)} is too low to register RDMA buffers",
                    evidence, fix, **details)
    return ok("stack.memlock", "", f"ulimit -l {_human_bytes(soft)}", evidence, **details)


def check_native_module(ctx: Context) -> CheckResult:
    """Whether this installation can serve RDMA as `target serve` does: its native module (nvmeof_roce._native,
    built from csrc/: the RDMA CM of the userspace target and initiator and their fast data path), and what the
    RDMA transport itself requires before it listens (the same call serve makes: pyverbs, Debian's
    python3-pyverbs, seen from this Python).  Either missing, serve cannot listen on RDMA; a build without a
    compiler or a -dev package fails unless NVMEOF_ROCE_PURE_PYTHON=1 asked for that."""
    from ... import native
    from ...errors import NvmeofError
    from ...transport import registry
    if not ctx.machine.is_live:
        return skipped("stack.native", "", "a captured tree: this check is about the installation running doctor")
    try:
        registry.get("rdma").require()  # what TargetServer checks for each RDMA port before it listens
        rdma_problem = None
    except NvmeofError as exc:
        rdma_problem = exc
    if not native.available():
        evidence = [native.missing_reason or ""]
        if rdma_problem is not None:
            evidence.append(rdma_problem.message)
        return fail("stack.native", "", "not built: the userspace target cannot listen on RDMA (kernel nvmet and "
                    "the tools still work)", evidence,
                    "apt-get install gcc python3-dev libibverbs-dev librdmacm-dev liburing-dev, then reinstall the "
                    "package (pip install --force-reinstall --no-deps, or make venv)"
                    + (f"; and {rdma_problem.fix}" if rdma_problem is not None and rdma_problem.fix else ""),
                    reason=native.missing_reason)
    where = getattr(native.module, "__file__", "") or "nvmeof_roce._native"
    if rdma_problem is not None:
        return fail("stack.native", "", "built, but the RDMA transport cannot run: target serve fails on an RDMA "
                    f"port ({rdma_problem.message})", [f"loaded {where}", rdma_problem.message],
                    rdma_problem.fix or "apt-get install python3-pyverbs", path=where, reason=rdma_problem.message)
    return ok("stack.native", "", "built: target serve runs the native data path and the RDMA CM in C",
              [f"loaded {where}", "the RDMA transport's requirements (pyverbs) are met"], path=where)


AUTH_OPTIONS = {"CONFIG_NVME_HOST_AUTH": "host", "CONFIG_NVME_TARGET_AUTH": "target"}


def _kernel_config(ctx: Context, release: Optional[str]) -> Tuple[Optional[str], str]:
    """The kernel's build config: /boot/config-RELEASE, else /proc/config.gz (CONFIG_IKCONFIG_PROC)."""
    if release:
        text = ctx.machine.read(f"/boot/config-{release}")
        if text:
            return text, f"/boot/config-{release}"
    try:
        import gzip
        with gzip.open(ctx.machine.path("/proc/config.gz"), "rt") as f:
            return f.read(), "/proc/config.gz"
    except (OSError, EOFError, ValueError, AttributeError):
        return None, ""


def check_nvme_auth(ctx: Context) -> CheckResult:
    """Reports whether the kernel does NVMe in-band authentication (DH-HMAC-CHAP): the host side
    (CONFIG_NVME_HOST_AUTH: nvme connect --dhchap-secret) and the target side (CONFIG_NVME_TARGET_AUTH:
    nvmet's hosts/*/dhchap_key), from the kernel config, else from the nvme-auth module being there.
    Debian 12's 6.1 kernel has neither; its 6.12 kernel has both. Informational: the userspace
    target and initiator authenticate on any kernel."""
    release = _kernel_release(ctx)
    text, source = _kernel_config(ctx, release)
    evidence = []
    sides = {}
    if text is not None:
        for option, side in AUTH_OPTIONS.items():
            m = re.search(rf"^{option}=(y|m)$", text, re.M)
            sides[side] = bool(m)
            evidence.append(f"{source}: {option}={m.group(1) if m else 'not set'}")
    else:
        state = ModuleTable(ctx).state("nvme_auth")
        evidence.append(f"no kernel config readable (/boot/config-{release or '?'}, /proc/config.gz); "
                        f"module nvme_auth: {state}")
        present = state != MISSING
        sides = {"host": present, "target": present}
    have = [s for s, yes in sides.items() if yes]
    details = {"host": sides.get("host"), "target": sides.get("target"), "kernel": release}
    if len(have) == 2:
        return ok("stack.nvme_auth", "", "NVMe in-band authentication (DH-HMAC-CHAP): host and target",
                  evidence, **details)
    missing = [s for s in ("host", "target") if s not in have]
    summary = (f"NVMe in-band authentication (DH-HMAC-CHAP): {'only the ' + have[0] if have else 'no'} kernel "
               f"support ({' and '.join(missing)} missing in {release or 'this kernel'})")
    fix = ("only needed for DH-HMAC-CHAP with the kernel's host or nvmet: use a kernel built with "
           "CONFIG_NVME_HOST_AUTH/CONFIG_NVME_TARGET_AUTH (Debian 12: linux-image-6.12-amd64); the userspace "
           "target and initiator authenticate on this kernel too (docs/auth.md)")
    return ok("stack.nvme_auth", "", summary, evidence, fix=fix, **details)
