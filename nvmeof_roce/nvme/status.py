"""NVMe status codes (docs/protocol.md §2.4, §6.3).

Convention (the Linux kernel's): a status *code* is ``(SCT << 8) | SC``, with
``DNR`` (0x4000) and ``MORE`` (0x2000) or-ed in.  On the wire, in CQE bytes
14..15, the code is shifted left by one (bit 0 is the phase tag, always 0 on
fabrics).  ``CQE.status`` holds the code, not the wire value.
"""
from __future__ import annotations

from ..errors import NvmeofError

DNR = 0x4000  # do not retry
MORE = 0x2000  # more information in the error log
CRD_MASK = 0x1800  # command retry delay selector
CODE_MASK = 0x07FF  # SCT (bits 10:8) and SC (bits 7:0)

# Generic command status (SCT 0)
SUCCESS = 0x000
INVALID_OPCODE = 0x001
INVALID_FIELD = 0x002
CMDID_CONFLICT = 0x003
DATA_XFER_ERROR = 0x004
POWER_LOSS = 0x005
INTERNAL = 0x006
ABORT_REQ = 0x007
ABORT_QUEUE = 0x008
FUSED_FAIL = 0x009
FUSED_MISSING = 0x00A
INVALID_NS = 0x00B
CMD_SEQ_ERROR = 0x00C
SGL_INVALID_LAST = 0x00D
SGL_INVALID_COUNT = 0x00E
SGL_INVALID_DATA = 0x00F
SGL_INVALID_METADATA = 0x010
SGL_INVALID_TYPE = 0x011
SGL_INVALID_OFFSET = 0x016
SGL_INVALID_SUBTYPE = 0x017
HOST_ID_INCONSISTENT = 0x018
KA_TIMEOUT_EXPIRED = 0x019
KA_TIMEOUT_INVALID = 0x01A
PREEMPT_ABORT = 0x01B
NS_WRITE_PROTECTED = 0x020
LBA_RANGE = 0x080
CAP_EXCEEDED = 0x081
NS_NOT_READY = 0x082
RESERVATION_CONFLICT = 0x083

# Command specific status (SCT 1)
CQ_INVALID = 0x100
QID_INVALID = 0x101
QUEUE_SIZE = 0x102
ABORT_LIMIT = 0x103
ASYNC_LIMIT = 0x105
INVALID_LOG_PAGE = 0x109
CONNECT_FORMAT = 0x180
CONNECT_CTRL_BUSY = 0x181
CONNECT_INVALID_PARAM = 0x182
CONNECT_RESTART_DISC = 0x183
CONNECT_INVALID_HOST = 0x184
DISCOVERY_RESTART = 0x190
AUTH_REQUIRED = 0x191

# Media and data integrity errors (SCT 2)
WRITE_FAULT = 0x280
READ_ERROR = 0x281
ACCESS_DENIED = 0x286

# Path related status (SCT 3)
ANA_PERSISTENT_LOSS = 0x301
ANA_INACCESSIBLE = 0x302
ANA_TRANSITION = 0x303
HOST_PATH_ERROR = 0x370

STATUS_NAMES = {
    SUCCESS: "Success",
    INVALID_OPCODE: "Invalid Command Opcode",
    INVALID_FIELD: "Invalid Field in Command",
    CMDID_CONFLICT: "Command ID Conflict",
    DATA_XFER_ERROR: "Data Transfer Error",
    POWER_LOSS: "Commands Aborted due to Power Loss Notification",
    INTERNAL: "Internal Error",
    ABORT_REQ: "Command Abort Requested",
    ABORT_QUEUE: "Command Aborted due to SQ Deletion",
    FUSED_FAIL: "Command Aborted due to Failed Fused Command",
    FUSED_MISSING: "Command Aborted due to Missing Fused Command",
    INVALID_NS: "Invalid Namespace or Format",
    CMD_SEQ_ERROR: "Command Sequence Error",
    SGL_INVALID_LAST: "Invalid SGL Segment Descriptor",
    SGL_INVALID_COUNT: "Invalid Number of SGL Descriptors",
    SGL_INVALID_DATA: "Data SGL Length Invalid",
    SGL_INVALID_METADATA: "Metadata SGL Length Invalid",
    SGL_INVALID_TYPE: "SGL Descriptor Type Invalid",
    SGL_INVALID_OFFSET: "SGL Offset Invalid",
    SGL_INVALID_SUBTYPE: "SGL Sub-Type Invalid",
    HOST_ID_INCONSISTENT: "Host Identifier Inconsistent Format",
    KA_TIMEOUT_EXPIRED: "Keep Alive Timer Expired",
    PREEMPT_ABORT: "Command Aborted due to Preempt and Abort",
    KA_TIMEOUT_INVALID: "Keep Alive Timeout Invalid",
    NS_WRITE_PROTECTED: "Namespace is Write Protected",
    LBA_RANGE: "LBA Out of Range",
    CAP_EXCEEDED: "Capacity Exceeded",
    NS_NOT_READY: "Namespace Not Ready",
    RESERVATION_CONFLICT: "Reservation Conflict",
    CQ_INVALID: "Completion Queue Invalid",
    QID_INVALID: "Invalid Queue Identifier",
    QUEUE_SIZE: "Invalid Queue Size",
    ABORT_LIMIT: "Abort Command Limit Exceeded",
    ASYNC_LIMIT: "Asynchronous Event Request Limit Exceeded",
    INVALID_LOG_PAGE: "Invalid Log Page",
    CONNECT_FORMAT: "Connect Incompatible Format",
    CONNECT_CTRL_BUSY: "Connect Controller Busy",
    CONNECT_INVALID_PARAM: "Connect Invalid Parameters",
    CONNECT_RESTART_DISC: "Connect Restart Discovery",
    CONNECT_INVALID_HOST: "Connect Invalid Host",
    DISCOVERY_RESTART: "Discovery Restart",
    AUTH_REQUIRED: "Authentication Required",
    WRITE_FAULT: "Write Fault",
    READ_ERROR: "Unrecovered Read Error",
    ACCESS_DENIED: "Access Denied",
    ANA_PERSISTENT_LOSS: "Asymmetric Access Persistent Loss",
    ANA_INACCESSIBLE: "Asymmetric Access Inaccessible",
    ANA_TRANSITION: "Asymmetric Access Transition",
    HOST_PATH_ERROR: "Host Pathing Error",
}


def status_name(status: int) -> str:
    """Human name of a status code; DNR/More/CRD bits are ignored."""
    code = status & CODE_MASK
    name = STATUS_NAMES.get(code)
    if name is None:
        name = f"Unknown status (SCT {code >> 8:#x}, SC {code & 0xFF:#04x})"
    return name


def describe(status: int) -> str:
    """Name plus the raw code and flags, e.g. 'LBA Out of Range (0x80, DNR)'."""
    flags = []
    if status & DNR:
        flags.append("DNR")
    if status & MORE:
        flags.append("More")
    extra = ", ".join([f"{status & CODE_MASK:#x}"] + flags)
    return f"{status_name(status)} ({extra})"


def to_wire(status: int) -> int:
    """The 16-bit CQE STATUS field for a status code (phase bit 0)."""
    return (status << 1) & 0xFFFF


def from_wire(field: int) -> int:
    """The status code carried by a 16-bit CQE STATUS field."""
    return (field >> 1) & 0x7FFF


class NvmeStatusError(NvmeofError):
    """A command completed with a non-zero NVMe status."""

    def __init__(self, status: int, command: str = "", result: int = 0):
        self.status = status
        self.code = status & CODE_MASK
        self.name = status_name(status)
        self.dnr = bool(status & DNR)
        self.result = result
        self.command = command
        what = f"{command}: " if command else ""
        super().__init__(f"{what}NVMe status {describe(status)}")
