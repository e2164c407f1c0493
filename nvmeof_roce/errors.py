"""Errors shared by every layer: each carries the fix a user should apply."""


class NvmeofError(Exception):
    """A failure the user can act on. `fix` names what to do about it; `field`, the config key or parameter at
    fault when a subclass knows it (BackendError), else empty."""

    field: "str | None" = ""

    def __init__(self, message: str, fix: str = ""):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        if self.fix:
            return f"{self.message}\n  fix: {self.fix}"
        return self.message


class ToolMissing(NvmeofError):
    """An external program (nvme, fio, rdma, qemu-system-x86_64, ...) is not installed."""

    def __init__(self, tool: str, package: str):
        super().__init__(f"{tool}: command not found", f"install the Debian package '{package}' (apt-get install {package})")
        self.tool = tool
        self.package = package
