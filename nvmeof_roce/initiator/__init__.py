"""The userspace NVMe-oF initiator: `Controller.connect(...)`, `discover(...)`."""
from ..nvme.status import NvmeStatusError
from .discovery import DiscoveryEntry, discover
from .controller import CommandTimeout, Completion, Controller, HostError, QueueFull, default_host_identity

__all__ = ["Controller", "Completion", "NvmeStatusError", "HostError", "CommandTimeout", "QueueFull",
           "discover", "DiscoveryEntry", "default_host_identity"]
