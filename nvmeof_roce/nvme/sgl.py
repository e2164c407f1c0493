"""SGL descriptors in the SQE's DPTR field (docs/protocol.md §2.2).

Byte 15 of the 16-byte descriptor (SQE byte 39) is the SGL identifier: bits
7:4 the type, bits 3:0 the subtype.  Two layouts matter on RDMA:

  keyed data block (type 4):  ADDR (8) | LENGTH (3) | KEY (4) | 0x40 or 0x4F
  data block (type 0):        ADDR (8) | LENGTH (4) | reserved (3) | 0x01

Bytes 8..15 are handled as one little-endian 64-bit word (`word`) so a parser
can take the whole descriptor with two integers from one struct unpack.
"""
from __future__ import annotations

import struct

# Descriptor types (bits 7:4 of the identifier)
TYPE_DATA_BLOCK = 0x0
TYPE_BIT_BUCKET = 0x1
TYPE_SEGMENT = 0x2
TYPE_LAST_SEGMENT = 0x3
TYPE_KEYED_DATA_BLOCK = 0x4
TYPE_TRANSPORT_DATA_BLOCK = 0x5

# Subtypes (bits 3:0)
SUBTYPE_ADDRESS = 0x0
SUBTYPE_OFFSET = 0x1
SUBTYPE_INVALIDATE_KEY = 0xF  # keyed only: the target may SEND with Invalidate of KEY

# Whole identifier bytes used on RDMA
ID_KEYED = 0x40
ID_KEYED_INVALIDATE = 0x4F
ID_IN_CAPSULE = 0x01  # data block, offset into the in-capsule data area

KEYED_MAX_LENGTH = 0xFFFFFF  # 24-bit LENGTH

_SGL = struct.Struct("<QQ")


class SglDescriptor:
    """One SGL descriptor; `length` and `key` are decoded according to the type."""

    __slots__ = ("addr", "length", "key", "sgl_id")

    def __init__(self, addr: int = 0, length: int = 0, key: int = 0, sgl_id: int = ID_KEYED):
        self.addr = addr
        self.length = length
        self.key = key
        self.sgl_id = sgl_id

    # -- constructors for the three forms used on RDMA
    @classmethod
    def keyed(cls, addr: int, length: int, key: int, invalidate: bool = False) -> "SglDescriptor":
        if not 0 <= length <= KEYED_MAX_LENGTH:
            raise ValueError(f"keyed SGL length {length} does not fit 24 bits")
        return cls(addr, length, key, ID_KEYED_INVALIDATE if invalidate else ID_KEYED)

    @classmethod
    def in_capsule(cls, length: int, offset: int = 0) -> "SglDescriptor":
        return cls(offset, length, 0, ID_IN_CAPSULE)

    @classmethod
    def no_data(cls) -> "SglDescriptor":
        """What the Linux host sends for commands without data: keyed, all zero."""
        return cls(0, 0, 0, ID_KEYED)

    @property
    def type(self) -> int:
        return self.sgl_id >> 4

    @property
    def subtype(self) -> int:
        return self.sgl_id & 0xF

    @property
    def is_keyed(self) -> bool:
        return self.type == TYPE_KEYED_DATA_BLOCK

    # -- the 64-bit word at descriptor bytes 8..15
    @property
    def word(self) -> int:
        if self.is_keyed:
            return (self.length & 0xFFFFFF) | ((self.key & 0xFFFFFFFF) << 24) | (self.sgl_id << 56)
        return (self.length & 0xFFFFFFFF) | (self.sgl_id << 56)

    @classmethod
    def from_words(cls, addr: int, word: int) -> "SglDescriptor":
        sgl_id = word >> 56
        if (sgl_id >> 4) == TYPE_KEYED_DATA_BLOCK:
            return cls(addr, word & 0xFFFFFF, (word >> 24) & 0xFFFFFFFF, sgl_id)
        return cls(addr, word & 0xFFFFFFFF, 0, sgl_id)

    def pack(self) -> bytes:
        return _SGL.pack(self.addr, self.word)

    @classmethod
    def unpack(cls, buf, offset: int = 0) -> "SglDescriptor":
        addr, word = _SGL.unpack_from(buf, offset)
        return cls.from_words(addr, word)

    def __eq__(self, other):
        if not isinstance(other, SglDescriptor):
            return NotImplemented
        return (self.addr, self.length, self.key, self.sgl_id) == (other.addr, other.length, other.key, other.sgl_id)

    def __repr__(self) -> str:
        return (f"SglDescriptor(addr={self.addr:#x}, length={self.length}, key={self.key:#x}, "
                f"sgl_id={self.sgl_id:#04x})")
