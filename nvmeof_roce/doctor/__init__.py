"""`nvmeof-roce doctor`: RoCE fabric and host diagnostics.

Reads sysfs/procfs/configfs under a root path and runs the usual tools (ip, dcb, ethtool,
ibv_devinfo, nft, dmesg, ...) to find the configuration mistakes that break RoCE deployments.
Each check reports ok / warn / fail / skipped, the evidence it read and the fix.
See docs/doctor.md.
"""
from .context import Context, DoctorOptions
from .result import CheckResult, Status
from .runner import run_checks

__all__ = ["CheckResult", "Context", "DoctorOptions", "Status", "run_checks"]
