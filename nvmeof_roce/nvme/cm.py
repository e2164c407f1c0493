"""RDMA CM private data for NVMe-oF (docs/protocol.md §1.3 - §1.5).

The connect request is 32 bytes as sent, but on IB/RoCE the CONNECT_REQUEST
event delivers 56 (zero padded): parse only the first 10 bytes.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from .fabrics import ADMIN_QUEUE_DEPTH  # noqa: F401  (the CM private data's default sizes; importers use it here)

# Reject STS values (§1.5)
STS_INVALID_LEN = 1
STS_INVALID_RECFMT = 2
STS_INVALID_QID = 3
STS_INVALID_HSQSIZE = 4
STS_INVALID_HRQSIZE = 5
STS_NO_RESOURCES = 6
STS_INVALID_IRD = 7
STS_INVALID_ORD = 8
STS_INVALID_CNTLID = 9

STS_NAMES = {
    STS_INVALID_LEN: "invalid private data length",
    STS_INVALID_RECFMT: "invalid record format",
    STS_INVALID_QID: "invalid queue ID",
    STS_INVALID_HSQSIZE: "invalid host SQ size",
    STS_INVALID_HRQSIZE: "invalid host RQ size",
    STS_NO_RESOURCES: "no resources",
    STS_INVALID_IRD: "invalid IRD",
    STS_INVALID_ORD: "invalid ORD",
    STS_INVALID_CNTLID: "invalid controller ID",
}

# The CM reject STS for each reason the target refuses a queue (transport/contracts.py Refusal and transport/rdma/connect.py CmRefusal, by value).
REJECT_STATUS = {
    "invalid_recfmt": STS_INVALID_RECFMT,
    "invalid_qid": STS_INVALID_QID,
    "invalid_hsqsize": STS_INVALID_HSQSIZE,
    "invalid_hrqsize": STS_INVALID_HRQSIZE,
    "no_resources": STS_NO_RESOURCES,
}

REQUEST_SIZE = 32
REQUEST_PARSED = 10  # RECFMT, QID, HRQSIZE, HSQSIZE, CNTLID
ACCEPT_SIZE = 32
REJECT_SIZE = 4


_REQUEST = struct.Struct("<HHHHH22x")
_REQUEST_HEAD = struct.Struct("<HHHHH")
_ACCEPT = struct.Struct("<HH28x")
_REJECT = struct.Struct("<HH")


class PrivateDataError(ValueError):
    """Connect request private data that cannot be parsed; `sts` is the reject status to send."""

    def __init__(self, sts: int, message: str):
        super().__init__(message)
        self.sts = sts


def sts_name(sts: int) -> str:
    return STS_NAMES.get(sts, f"unknown status {sts}")


@dataclass
class CmConnectRequest:
    """RECFMT 0, QID 2, HRQSIZE 4 (1's based), HSQSIZE 6 (0's based), CNTLID 8, 22 reserved."""

    recfmt: int = 0
    qid: int = 0
    hrqsize: int = ADMIN_QUEUE_DEPTH
    hsqsize: int = ADMIN_QUEUE_DEPTH - 1
    cntlid: int = 0

    def pack(self) -> bytes:
        return _REQUEST.pack(self.recfmt, self.qid, self.hrqsize, self.hsqsize, self.cntlid)

    @classmethod
    def unpack(cls, data) -> "CmConnectRequest":
        """Parse the first 10 bytes; a longer (56-byte, zero padded) buffer is normal on RoCE."""
        if data is None or len(data) == 0:
            raise PrivateDataError(STS_INVALID_LEN, "connect request without private data")
        if len(data) < REQUEST_PARSED:
            raise PrivateDataError(STS_INVALID_LEN, f"connect request private data is {len(data)} bytes")
        return cls(*_REQUEST_HEAD.unpack_from(bytes(data[:REQUEST_PARSED])))


@dataclass
class CmAccept:
    """RECFMT 0, CRQSIZE 2 (controller receive queue size), 28 reserved."""

    recfmt: int = 0
    crqsize: int = 0

    def pack(self) -> bytes:
        return _ACCEPT.pack(self.recfmt, self.crqsize)

    @classmethod
    def unpack(cls, data) -> "CmAccept":
        if len(data) < 4:
            raise ValueError(f"accept private data is {len(data)} bytes")
        return cls(*_REJECT.unpack_from(bytes(data[:4])))


@dataclass
class CmReject:
    """RECFMT 0, STS 2."""

    recfmt: int = 0
    sts: int = 0

    def pack(self) -> bytes:
        return _REJECT.pack(self.recfmt, self.sts)

    @classmethod
    def unpack(cls, data) -> "CmReject":
        if len(data) < REJECT_SIZE:
            raise ValueError(f"reject private data is {len(data)} bytes")
        return cls(*_REJECT.unpack_from(bytes(data[:REJECT_SIZE])))
