"""NVMe in-band authentication, DH-HMAC-CHAP (NVMe Base 2.0 §8.13, TP 8006): messages and crypto.

Pure protocol, no I/O: the AUTH_Negotiate, DH-HMAC-CHAP_Challenge, _Reply, _Success1,
_Success2 and AUTH_Failure1/2 messages with pack/unpack, the `DHHC-1:NN:base64:` secrets
(CRC-32 check, the key transformation with an NQN), the RFC 7919 ffdhe groups, the
augmented challenge and the host and controller responses.  The byte order of every
computation is the Linux kernel's (nvme_auth_transform_key, nvme_auth_augmented_challenge,
nvmet_auth_host_hash / nvmet_auth_ctrl_hash, nvme_auth_dhchap_setup_host_response).

Authentication Send / Receive are fabrics commands 0x05 / 0x06; SECP 0xE9 in SQE byte 43,
SPSP0/SPSP1 (both 01h) in bytes 41/42, the transfer (TL) or allocation (AL) length in CDW11.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import struct
import zlib
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

# -- the Authentication Send / Receive commands (§6.2, §6.3)
SECP_DHCHAP = 0xE9  # NVMe-oF security protocol (NVME_AUTH_DHCHAP_PROTOCOL_IDENTIFIER)
SPSP = 0x01  # SPSP0 and SPSP1 are both 01h for DH-HMAC-CHAP


def auth_cdw10(secp: int = SECP_DHCHAP, spsp0: int = SPSP, spsp1: int = SPSP) -> int:
    """CDW10 of Authentication Send/Receive: SPSP0 in byte 41, SPSP1 in 42, SECP in 43."""
    return ((secp & 0xFF) << 24) | ((spsp1 & 0xFF) << 16) | ((spsp0 & 0xFF) << 8)


def split_cdw10(cdw10: int) -> Tuple[int, int, int]:
    """(secp, spsp0, spsp1) from CDW10."""
    return (cdw10 >> 24) & 0xFF, (cdw10 >> 8) & 0xFF, (cdw10 >> 16) & 0xFF


# Connect response DW0 bits 17/18: AUTHREQ.ATR (authentication required), AUTHREQ.ASCR (secure channel)
CONNECT_AUTHREQ_ATR = 1 << 17
CONNECT_AUTHREQ_ASCR = 1 << 18

# -- message types (AUTH_Type) and identifiers (AUTH_Id)
TYPE_COMMON = 0x00
TYPE_DHCHAP = 0x01
ID_NEGOTIATE = 0x00
ID_CHALLENGE = 0x01
ID_REPLY = 0x02
ID_SUCCESS1 = 0x03
ID_SUCCESS2 = 0x04
ID_FAILURE2 = 0xF0
ID_FAILURE1 = 0xF1

AUTHID_DHCHAP = 0x01  # authentication protocol identifier in a Negotiate descriptor
SC_C_NONE = 0x00  # secure channel concatenation: none

# AUTH_Failure reason code (rescode) and its explanations (rescode_exp)
REASON_FAILED = 0x01
FAILURE_FAILED = 0x01
FAILURE_NOT_USABLE = 0x02  # authentication protocol not usable
FAILURE_CONCAT_MISMATCH = 0x03
FAILURE_HASH_UNUSABLE = 0x04
FAILURE_DHGROUP_UNUSABLE = 0x05
FAILURE_INCORRECT_PAYLOAD = 0x06
FAILURE_INCORRECT_MESSAGE = 0x07  # incorrect protocol message

FAILURE_NAMES = {
    FAILURE_FAILED: "authentication failed",
    FAILURE_NOT_USABLE: "authentication protocol not usable",
    FAILURE_CONCAT_MISMATCH: "secure channel concatenation mismatch",
    FAILURE_HASH_UNUSABLE: "hash function not usable",
    FAILURE_DHGROUP_UNUSABLE: "DH group not usable",
    FAILURE_INCORRECT_PAYLOAD: "incorrect payload",
    FAILURE_INCORRECT_MESSAGE: "incorrect protocol message",
}

# -- hash functions (HashID) and DH groups (DHgroup ID)
HASH_SHA256 = 1
HASH_SHA384 = 2
HASH_SHA512 = 3
HASHES = {HASH_SHA256: ("sha256", 32), HASH_SHA384: ("sha384", 48), HASH_SHA512: ("sha512", 64)}
HASH_NAMES = {HASH_SHA256: "hmac(sha256)", HASH_SHA384: "hmac(sha384)", HASH_SHA512: "hmac(sha512)"}

DHGROUP_NULL = 0
DHGROUP_2048 = 1
DHGROUP_3072 = 2
DHGROUP_4096 = 3
DHGROUP_6144 = 4
DHGROUP_8192 = 5
DHGROUP_NAMES = {DHGROUP_NULL: "null", DHGROUP_2048: "ffdhe2048", DHGROUP_3072: "ffdhe3072",
                 DHGROUP_4096: "ffdhe4096", DHGROUP_6144: "ffdhe6144", DHGROUP_8192: "ffdhe8192"}
DHGROUP_BITS = {DHGROUP_2048: 2048, DHGROUP_3072: 3072, DHGROUP_4096: 4096, DHGROUP_6144: 6144,
                DHGROUP_8192: 8192}
# Private exponent sizes: twice the groups' security strength (RFC 7919 §5.2)
_EXPONENT_BITS = {2048: 225, 3072: 275, 4096: 325, 6144: 375, 8192: 400}

MAX_IDS = 30  # hash and DH group identifiers per protocol descriptor


def hash_len(hash_id: int) -> int:
    return HASHES[hash_id][1] if hash_id in HASHES else 0


def hash_id_by_name(name: str) -> Optional[int]:
    """hmac(sha256) / sha256 / 1 -> 1 (the configfs dhchap_hash spelling, or the bare name or id)."""
    text = str(name).strip().lower()
    for hid, full in HASH_NAMES.items():
        if text in (full, HASHES[hid][0], str(hid)):
            return hid
    return None


def dhgroup_id_by_name(name: str) -> Optional[int]:
    """null / ffdhe2048 ... ffdhe8192 (configfs dhchap_dhgroup), or the numeric id."""
    text = str(name).strip().lower()
    for gid, full in DHGROUP_NAMES.items():
        if text in (full, str(gid)):
            return gid
    return None


class AuthError(Exception):
    """A malformed or unacceptable message: `reason` is the AUTH_Failure reason code explanation."""

    def __init__(self, reason: int, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


# ---------------------------------------------------------------------------- secrets

SECRET_PREFIX = "DHHC-1"
SECRET_KEY_LENGTHS = (32, 48, 64)  # nvme_auth_extract_key accepts 36, 52 or 68 bytes with the CRC


class SecretError(ValueError):
    pass


@dataclass(frozen=True)
class Secret:
    """A DH-HMAC-CHAP secret: the key bytes and the hash its transformation uses (0: none)."""

    key: bytes
    hmac_id: int = 0

    def __repr__(self) -> str:  # never print key material
        return f"Secret(hmac_id={self.hmac_id}, {len(self.key)} bytes)"

    def transform(self, nqn: str) -> bytes:
        """The key HMAC uses for a response (nvme_auth_transform_key): the key itself for hash 0,
        else HMAC_H(key, NQN || "NVMe-over-Fabrics") with H the secret's own hash."""
        if self.hmac_id == 0:
            return self.key
        name = HASHES[self.hmac_id][0]
        return hmac.new(self.key, nqn.encode() + b"NVMe-over-Fabrics", name).digest()

    def encode(self) -> str:
        return format_secret(self.key, self.hmac_id)


def format_secret(key: bytes, hmac_id: int = 0) -> str:
    """DHHC-1:NN:base64(key || CRC-32 of the key, little endian):"""
    if len(key) not in SECRET_KEY_LENGTHS:
        raise SecretError(f"a DH-HMAC-CHAP key is 32, 48 or 64 bytes, not {len(key)}")
    if hmac_id not in (0, *HASHES):
        raise SecretError(f"hash id {hmac_id}: use 0 (none), 1 (SHA-256), 2 (SHA-384) or 3 (SHA-512)")
    crc = struct.pack("<I", zlib.crc32(key) & 0xFFFFFFFF)
    return f"{SECRET_PREFIX}:{hmac_id:02x}:{base64.b64encode(key + crc).decode()}:"


def parse_secret(text: str) -> Secret:
    """Parse `DHHC-1:NN:base64:` (nvme_auth_parse_key + nvme_auth_extract_key), checking the CRC."""
    if not isinstance(text, str):
        raise SecretError("a DH-HMAC-CHAP secret is a string like DHHC-1:01:<base64>:")
    parts = text.strip().split(":")
    if len(parts) < 3 or parts[0] != SECRET_PREFIX or (len(parts) == 4 and parts[3]) or len(parts) > 4:
        raise SecretError(f"not a DH-HMAC-CHAP secret (expected {SECRET_PREFIX}:NN:<base64>:)")
    try:
        hmac_id = int(parts[1], 16)
    except ValueError:
        raise SecretError(f"hash field {parts[1]!r} is not 00, 01, 02 or 03") from None
    if len(parts[1]) != 2 or hmac_id not in (0, *HASHES):
        raise SecretError(f"hash field {parts[1]!r} is not 00, 01, 02 or 03")
    try:
        raw = base64.b64decode(parts[2], validate=True)
    except (binascii.Error, ValueError):
        raise SecretError("the key is not valid base64") from None
    if len(raw) - 4 not in SECRET_KEY_LENGTHS:
        raise SecretError(f"the key is {max(0, len(raw) - 4)} bytes; it must be 32, 48 or 64 (plus a 4-byte CRC)")
    key, crc = raw[:-4], struct.unpack("<I", raw[-4:])[0]
    if zlib.crc32(key) & 0xFFFFFFFF != crc:
        raise SecretError("the key's CRC-32 does not match (a character was lost or changed)")
    return Secret(key, hmac_id)


def generate_secret(hmac_id: int = 0, key_length: Optional[int] = None, nqn: Optional[str] = None,
                    key: Optional[bytes] = None) -> str:
    """A new secret, as `nvme gen-dhchap-key` makes it: random key bytes (or `key`), transformed with
    `nqn` when a hash is given (libnvme's nvme_gen_dhchap_key), then encoded with its CRC."""
    if key_length is None:
        key_length = hash_len(hmac_id) or 32
    if key_length not in SECRET_KEY_LENGTHS:
        raise SecretError(f"key length {key_length}: use 32, 48 or 64")
    raw = key if key is not None else secrets.token_bytes(key_length)
    if len(raw) != key_length:
        raise SecretError(f"the given key is {len(raw)} bytes, not {key_length}")
    if hmac_id and nqn:
        raw = Secret(raw, hmac_id).transform(nqn)
        if len(raw) != key_length:
            raise SecretError(f"key length {key_length} does not match the {HASH_NAMES[hmac_id]} "
                              f"transformation ({len(raw)} bytes)")
    return format_secret(raw, hmac_id)


# ---------------------------------------------------------------------------- DH (RFC 7919)

FFDHE_PRIMES = {
    2048: int(
        "FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1D8B9C583CE2D3695A9E13641146433FBCC939DCE249B3EF9"
        "7D2FE363630C75D8F681B202AEC4617AD3DF1ED5D5FD65612433F51F5F066ED0856365553DED1AF3B557135E7F57C935"
        "984F0C70E0E68B77E2A689DAF3EFE8721DF158A136ADE73530ACCA4F483A797ABC0AB182B324FB61D108A94BB2C8E3FB"
        "B96ADAB760D7F4681D4F42A3DE394DF4AE56EDE76372BB190B07A7C8EE0A6D709E02FCE1CDF7E2ECC03404CD28342F61"
        "9172FE9CE98583FF8E4F1232EEF28183C3FE3B1B4C6FAD733BB5FCBC2EC22005C58EF1837D1683B2C6F34A26C1B2EFFA"
        "886B423861285C97FFFFFFFFFFFFFFFF", 16),
    3072: int(
        "FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1D8B9C583CE2D3695A9E13641146433FBCC939DCE249B3EF9"
        "7D2FE363630C75D8F681B202AEC4617AD3DF1ED5D5FD65612433F51F5F066ED0856365553DED1AF3B557135E7F57C935"
        "984F0C70E0E68B77E2A689DAF3EFE8721DF158A136ADE73530ACCA4F483A797ABC0AB182B324FB61D108A94BB2C8E3FB"
        "B96ADAB760D7F4681D4F42A3DE394DF4AE56EDE76372BB190B07A7C8EE0A6D709E02FCE1CDF7E2ECC03404CD28342F61"
        "9172FE9CE98583FF8E4F1232EEF28183C3FE3B1B4C6FAD733BB5FCBC2EC22005C58EF1837D1683B2C6F34A26C1B2EFFA"
        "886B4238611FCFDCDE355B3B6519035BBC34F4DEF99C023861B46FC9D6E6C9077AD91D2691F7F7EE598CB0FAC186D91C"
        "AEFE130985139270B4130C93BC437944F4FD4452E2D74DD364F2E21E71F54BFF5CAE82AB9C9DF69EE86D2BC522363A0D"
        "ABC521979B0DEADA1DBF9A42D5C4484E0ABCD06BFA53DDEF3C1B20EE3FD59D7C25E41D2B66C62E37FFFFFFFFFFFFFFFF", 16),
    4096: int(
        "FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1D8B9C583CE2D3695A9E13641146433FBCC939DCE249B3EF9"
        "7D2FE363630C75D8F681B202AEC4617AD3DF1ED5D5FD65612433F51F5F066ED0856365553DED1AF3B557135E7F57C935"
        "984F0C70E0E68B77E2A689DAF3EFE8721DF158A136ADE73530ACCA4F483A797ABC0AB182B324FB61D108A94BB2C8E3FB"
        "B96ADAB760D7F4681D4F42A3DE394DF4AE56EDE76372BB190B07A7C8EE0A6D709E02FCE1CDF7E2ECC03404CD28342F61"
        "9172FE9CE98583FF8E4F1232EEF28183C3FE3B1B4C6FAD733BB5FCBC2EC22005C58EF1837D1683B2C6F34A26C1B2EFFA"
        "886B4238611FCFDCDE355B3B6519035BBC34F4DEF99C023861B46FC9D6E6C9077AD91D2691F7F7EE598CB0FAC186D91C"
        "AEFE130985139270B4130C93BC437944F4FD4452E2D74DD364F2E21E71F54BFF5CAE82AB9C9DF69EE86D2BC522363A0D"
        "ABC521979B0DEADA1DBF9A42D5C4484E0ABCD06BFA53DDEF3C1B20EE3FD59D7C25E41D2B669E1EF16E6F52C3164DF4FB"
        "7930E9E4E58857B6AC7D5F42D69F6D187763CF1D5503400487F55BA57E31CC7A7135C886EFB4318AED6A1E012D9E6832"
        "A907600A918130C46DC778F971AD0038092999A333CB8B7A1A1DB93D7140003C2A4ECEA9F98D0ACC0A8291CDCEC97DCF"
        "8EC9B55A7F88A46B4DB5A851F44182E1C68A007E5E655F6AFFFFFFFFFFFFFFFF", 16),
    6144: int(
        "FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1D8B9C583CE2D3695A9E13641146433FBCC939DCE249B3EF9"
        "7D2FE363630C75D8F681B202AEC4617AD3DF1ED5D5FD65612433F51F5F066ED0856365553DED1AF3B557135E7F57C935"
        "984F0C70E0E68B77E2A689DAF3EFE8721DF158A136ADE73530ACCA4F483A797ABC0AB182B324FB61D108A94BB2C8E3FB"
        "B96ADAB760D7F4681D4F42A3DE394DF4AE56EDE76372BB190B07A7C8EE0A6D709E02FCE1CDF7E2ECC03404CD28342F61"
        "9172FE9CE98583FF8E4F1232EEF28183C3FE3B1B4C6FAD733BB5FCBC2EC22005C58EF1837D1683B2C6F34A26C1B2EFFA"
        "886B4238611FCFDCDE355B3B6519035BBC34F4DEF99C023861B46FC9D6E6C9077AD91D2691F7F7EE598CB0FAC186D91C"
        "AEFE130985139270B4130C93BC437944F4FD4452E2D74DD364F2E21E71F54BFF5CAE82AB9C9DF69EE86D2BC522363A0D"
        "ABC521979B0DEADA1DBF9A42D5C4484E0ABCD06BFA53DDEF3C1B20EE3FD59D7C25E41D2B669E1EF16E6F52C3164DF4FB"
        "7930E9E4E58857B6AC7D5F42D69F6D187763CF1D5503400487F55BA57E31CC7A7135C886EFB4318AED6A1E012D9E6832"
        "A907600A918130C46DC778F971AD0038092999A333CB8B7A1A1DB93D7140003C2A4ECEA9F98D0ACC0A8291CDCEC97DCF"
        "8EC9B55A7F88A46B4DB5A851F44182E1C68A007E5E0DD9020BFD64B645036C7A4E677D2C38532A3A23BA4442CAF53EA6"
        "3BB454329B7624C8917BDD64B1C0FD4CB38E8C334C701C3ACDAD0657FCCFEC719B1F5C3E4E46041F388147FB4CFDB477"
        "A52471F7A9A96910B855322EDB6340D8A00EF092350511E30ABEC1FFF9E3A26E7FB29F8C183023C3587E38DA0077D9B4"
        "763E4E4B94B2BBC194C6651E77CAF992EEAAC0232A281BF6B3A739C1226116820AE8DB5847A67CBEF9C9091B462D538C"
        "D72B03746AE77F5E62292C311562A846505DC82DB854338AE49F5235C95B91178CCF2DD5CACEF403EC9D1810C6272B04"
        "5B3B71F9DC6B80D63FDD4A8E9ADB1E6962A69526D43161C1A41D570D7938DAD4A40E329CD0E40E65FFFFFFFFFFFFFFFF", 16),
    8192: int(
        "FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1D8B9C583CE2D3695A9E13641146433FBCC939DCE249B3EF9"
        "7D2FE363630C75D8F681B202AEC4617AD3DF1ED5D5FD65612433F51F5F066ED0856365553DED1AF3B557135E7F57C935"
        "984F0C70E0E68B77E2A689DAF3EFE8721DF158A136ADE73530ACCA4F483A797ABC0AB182B324FB61D108A94BB2C8E3FB"
        "B96ADAB760D7F4681D4F42A3DE394DF4AE56EDE76372BB190B07A7C8EE0A6D709E02FCE1CDF7E2ECC03404CD28342F61"
        "9172FE9CE98583FF8E4F1232EEF28183C3FE3B1B4C6FAD733BB5FCBC2EC22005C58EF1837D1683B2C6F34A26C1B2EFFA"
        "886B4238611FCFDCDE355B3B6519035BBC34F4DEF99C023861B46FC9D6E6C9077AD91D2691F7F7EE598CB0FAC186D91C"
        "AEFE130985139270B4130C93BC437944F4FD4452E2D74DD364F2E21E71F54BFF5CAE82AB9C9DF69EE86D2BC522363A0D"
        "ABC521979B0DEADA1DBF9A42D5C4484E0ABCD06BFA53DDEF3C1B20EE3FD59D7C25E41D2B669E1EF16E6F52C3164DF4FB"
        "7930E9E4E58857B6AC7D5F42D69F6D187763CF1D5503400487F55BA57E31CC7A7135C886EFB4318AED6A1E012D9E6832"
        "A907600A918130C46DC778F971AD0038092999A333CB8B7A1A1DB93D7140003C2A4ECEA9F98D0ACC0A8291CDCEC97DCF"
        "8EC9B55A7F88A46B4DB5A851F44182E1C68A007E5E0DD9020BFD64B645036C7A4E677D2C38532A3A23BA4442CAF53EA6"
        "3BB454329B7624C8917BDD64B1C0FD4CB38E8C334C701C3ACDAD0657FCCFEC719B1F5C3E4E46041F388147FB4CFDB477"
        "A52471F7A9A96910B855322EDB6340D8A00EF092350511E30ABEC1FFF9E3A26E7FB29F8C183023C3587E38DA0077D9B4"
        "763E4E4B94B2BBC194C6651E77CAF992EEAAC0232A281BF6B3A739C1226116820AE8DB5847A67CBEF9C9091B462D538C"
        "D72B03746AE77F5E62292C311562A846505DC82DB854338AE49F5235C95B91178CCF2DD5CACEF403EC9D1810C6272B04"
        "5B3B71F9DC6B80D63FDD4A8E9ADB1E6962A69526D43161C1A41D570D7938DAD4A40E329CCFF46AAA36AD004CF600C838"
        "1E425A31D951AE64FDB23FCEC9509D43687FEB69EDD1CC5E0B8CC3BDF64B10EF86B63142A3AB8829555B2F747C932665"
        "CB2C0F1CC01BD70229388839D2AF05E454504AC78B7582822846C0BA35C35F5C59160CC046FD8251541FC68C9C86B022"
        "BB7099876A460E7451A8A93109703FEE1C217E6C3826E52C51AA691E0E423CFC99E9E31650C1217B624816CDAD9A95F9"
        "D5B8019488D9C0A0A1FE3075A577E23183F81D4A3F2FA4571EFC8CE0BA8A4FE8B6855DFE72B0A66EDED2FBABFBE58A30"
        "FAFABE1C5D71A87E2F741EF8C1FE86FEA6BBFDE530677F0D97D11D49F7A8443D0822E506A9F4614E011E2A94838FF88C"
        "D68C8BB7C5C6424CFFFFFFFFFFFFFFFF", 16),
}
DH_GENERATOR = 2


try:  # OpenSSL's modular exponentiation: an ffdhe8192 exchange in ~15 ms instead of ~90 ms of pure Python
    from cryptography.hazmat.primitives.asymmetric import dh as _openssl_dh
except ImportError:  # pragma: no cover - the pure-Python arithmetic below gives the same bytes
    _openssl_dh = None

DH_BACKEND = "openssl" if _openssl_dh is not None else "python"


@dataclass
class DhKey:
    """One side's ephemeral DH key in an ffdhe group: x and g^x mod p (`_key`: the same key in OpenSSL)."""

    group: int
    private: int
    public: int
    _key: object = field(default=None, repr=False, compare=False)

    @property
    def size(self) -> int:
        return DHGROUP_BITS[self.group] // 8

    def public_bytes(self) -> bytes:
        """The DH value as sent: big endian, left-padded to the size of p (as the kernel's kpp sends it)."""
        return self.public.to_bytes(self.size, "big")

    def shared_secret(self, peer: bytes) -> bytes:
        """The session key: peer^x mod p, left-padded to the size of p (nvme_auth_gen_shared_secret)."""
        p = FFDHE_PRIMES[DHGROUP_BITS[self.group]]
        if not peer or len(peer) > self.size:
            raise AuthError(FAILURE_INCORRECT_PAYLOAD,
                            f"DH value of {len(peer)} bytes for {DHGROUP_NAMES[self.group]} "
                            f"(at most {self.size})")
        y = int.from_bytes(peer, "big")
        if not 1 < y < p - 1:  # 0, 1 and p-1 would force a known session key
            raise AuthError(FAILURE_DHGROUP_UNUSABLE, "DH value outside 2 .. p-2")
        if self._key is not None:
            try:
                numbers = _openssl_dh.DHPublicNumbers(y, _openssl_dh.DHParameterNumbers(p, DH_GENERATOR))
                return self._key.exchange(numbers.public_key()).rjust(self.size, b"\0")
            except ValueError as exc:  # OpenSSL's own public value checks
                raise AuthError(FAILURE_DHGROUP_UNUSABLE, f"DH value refused: {exc}") from None
        return pow(y, self.private, p).to_bytes(self.size, "big")


def dh_generate(group: int, private: Optional[int] = None) -> DhKey:
    """A new ephemeral key in ffdhe `group` (or the one with exponent `private`, for tests)."""
    if group not in DHGROUP_BITS:
        raise ValueError(f"DH group {group} is not an ffdhe group")
    bits = DHGROUP_BITS[group]
    p = FFDHE_PRIMES[bits]
    if private is None and _openssl_dh is not None:
        # OpenSSL knows the RFC 7919 groups and picks a short exponent for them, as we do below
        key = _openssl_dh.DHParameterNumbers(p, DH_GENERATOR).parameters().generate_private_key()
        return DhKey(group, key.private_numbers().x, key.public_key().public_numbers().y, key)
    if private is None:
        private = secrets.randbits(_EXPONENT_BITS[bits]) | (1 << (_EXPONENT_BITS[bits] - 1))
    return DhKey(group, private, pow(DH_GENERATOR, private, p))


# ---------------------------------------------------------------------------- responses

def _hmac(hash_id: int, key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, digestmod=HASHES[hash_id][0])
    for part in parts:
        mac.update(part)
    return mac.digest()


def augmented_challenge(hash_id: int, session_key: bytes, challenge: bytes) -> bytes:
    """Ca = HMAC_H(H(Ks), C) (nvme_auth_augmented_challenge); the challenge as is for the null group."""
    if not session_key:
        return challenge
    hashed = hashlib.new(HASHES[hash_id][0], session_key).digest()
    return _hmac(hash_id, hashed, challenge)


def host_response(hash_id: int, key: bytes, challenge: bytes, seqnum: int, tid: int, hostnqn: str,
                  subnqn: str, session_key: bytes = b"") -> bytes:
    """R1 = HMAC(Kh', C1a || S1 || T_ID || SC_C || "HostHost" || NQNh || 00h || NQNc), with Kh' the host
    key transformed with the host NQN (nvmet_auth_host_hash, nvme_auth_dhchap_setup_host_response)."""
    c = augmented_challenge(hash_id, session_key, challenge)
    return _hmac(hash_id, key, c, struct.pack("<IH", seqnum, tid), b"\0", b"HostHost", hostnqn.encode(), b"\0",
                 subnqn.encode())


def controller_response(hash_id: int, key: bytes, challenge: bytes, seqnum: int, tid: int, hostnqn: str,
                        subnqn: str, session_key: bytes = b"") -> bytes:
    """R2 = HMAC(Kc', C2a || S2 || T_ID || SC_C || "Controller" || NQNc || 00h || NQNh), with Kc' the
    controller key transformed with the subsystem NQN (nvmet_auth_ctrl_hash)."""
    c = augmented_challenge(hash_id, session_key, challenge)
    return _hmac(hash_id, key, c, struct.pack("<IH", seqnum, tid), b"\0", b"Controller", subnqn.encode(), b"\0",
                 hostnqn.encode())


def responses_equal(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)


# ---------------------------------------------------------------------------- messages

_COMMON = struct.Struct("<BBxxH")  # AUTH_Type, AUTH_Id, reserved, T_ID
_NEGOTIATE = struct.Struct("<BBxxHBB")  # + SC_C, NAPD: 8 bytes
_DESCRIPTOR = struct.Struct("<BxBB60s")  # AuthID, reserved, HALEN, DHLEN, 30 hash ids + 30 DH group ids
_CHALLENGE = struct.Struct("<BBxxHBxBBHI")  # HL, HashID, DHgroup ID, DHVLEN, SEQNUM: 16 bytes
_REPLY = struct.Struct("<BBxxHBxBxHI")  # HL, CVALID, DHVLEN, SEQNUM: 16 bytes
_SUCCESS1 = struct.Struct("<BBxxHBxB7x")  # HL, RVALID: 16 bytes
_SUCCESS2 = struct.Struct("<BBxxH10x")  # 16 bytes
_FAILURE = struct.Struct("<BBxxHBB")  # rescode, rescode explanation: 8 bytes


@dataclass
class Negotiate:
    """AUTH_Negotiate (host to controller): the hashes and DH groups the host offers."""

    tid: int
    hash_ids: List[int] = field(default_factory=lambda: [HASH_SHA256, HASH_SHA384, HASH_SHA512])
    dhgroup_ids: List[int] = field(default_factory=lambda: list(DHGROUP_NAMES))
    sc_c: int = SC_C_NONE
    auth_id: int = AUTHID_DHCHAP

    def pack(self) -> bytes:
        ids = bytes(self.hash_ids).ljust(MAX_IDS, b"\0") + bytes(self.dhgroup_ids).ljust(MAX_IDS, b"\0")
        return (_NEGOTIATE.pack(TYPE_COMMON, ID_NEGOTIATE, self.tid, self.sc_c, 1)
                + _DESCRIPTOR.pack(self.auth_id, len(self.hash_ids), len(self.dhgroup_ids), ids))

    @classmethod
    def unpack(cls, buf: bytes) -> "Negotiate":
        """Validates like nvmet_auth_negotiate: raises AuthError with the failure reason."""
        if len(buf) < _NEGOTIATE.size + _DESCRIPTOR.size:
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"AUTH_Negotiate of {len(buf)} bytes (at least "
                            f"{_NEGOTIATE.size + _DESCRIPTOR.size})")
        _, _, tid, sc_c, napd = _NEGOTIATE.unpack_from(buf)
        if napd == 0 or len(buf) < _NEGOTIATE.size + napd * _DESCRIPTOR.size:
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"AUTH_Negotiate with NAPD {napd} in {len(buf)} bytes")
        msg = None
        for i in range(napd):
            auth_id, halen, dhlen, ids = _DESCRIPTOR.unpack_from(buf, _NEGOTIATE.size + i * _DESCRIPTOR.size)
            if auth_id != AUTHID_DHCHAP:
                continue
            if halen > MAX_IDS or dhlen > MAX_IDS:
                raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"HALEN {halen} / DHLEN {dhlen} above {MAX_IDS}")
            msg = cls(tid, list(ids[:halen]), list(ids[MAX_IDS:MAX_IDS + dhlen]), sc_c, auth_id)
            break
        if msg is None:
            raise AuthError(FAILURE_NOT_USABLE, "AUTH_Negotiate offers no DH-HMAC-CHAP protocol descriptor")
        if sc_c != SC_C_NONE:
            raise AuthError(FAILURE_CONCAT_MISMATCH, f"secure channel concatenation SC_C {sc_c} is not supported")
        return msg


@dataclass
class Challenge:
    """DH-HMAC-CHAP_Challenge (controller to host): C1, S1 and the controller's DH value."""

    tid: int
    hash_id: int
    dhgroup_id: int
    seqnum: int
    challenge: bytes
    dh_value: bytes = b""

    def pack(self) -> bytes:
        return (_CHALLENGE.pack(TYPE_DHCHAP, ID_CHALLENGE, self.tid, len(self.challenge), self.hash_id,
                                self.dhgroup_id, len(self.dh_value), self.seqnum) + self.challenge + self.dh_value)

    @classmethod
    def unpack(cls, buf: bytes) -> "Challenge":
        if len(buf) < _CHALLENGE.size:
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"DH-HMAC-CHAP_Challenge of {len(buf)} bytes")
        _, _, tid, hl, hash_id, dhgid, dhvlen, seqnum = _CHALLENGE.unpack_from(buf)
        if hash_id not in HASHES or hl != hash_len(hash_id):
            raise AuthError(FAILURE_HASH_UNUSABLE, f"challenge with hash {hash_id} and HL {hl}")
        if dhgid not in DHGROUP_NAMES:
            raise AuthError(FAILURE_DHGROUP_UNUSABLE, f"challenge with DH group {dhgid}")
        if len(buf) < _CHALLENGE.size + hl + dhvlen:
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"challenge of {len(buf)} bytes, HL {hl} DHVLEN {dhvlen}")
        if (dhgid == DHGROUP_NULL) != (dhvlen == 0):
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"DHVLEN {dhvlen} with DH group {DHGROUP_NAMES[dhgid]}")
        start = _CHALLENGE.size
        return cls(tid, hash_id, dhgid, seqnum, bytes(buf[start:start + hl]),
                   bytes(buf[start + hl:start + hl + dhvlen]))


@dataclass
class Reply:
    """DH-HMAC-CHAP_Reply (host to controller): R1, and for bidirectional authentication S2 and C2."""

    tid: int
    response: bytes
    challenge: bytes = b""  # C2; empty: unidirectional (CVALID 0)
    seqnum: int = 0
    dh_value: bytes = b""

    def pack(self) -> bytes:
        hl = len(self.response)
        c2 = self.challenge if self.challenge else bytes(hl)
        return (_REPLY.pack(TYPE_DHCHAP, ID_REPLY, self.tid, hl, 1 if self.challenge else 0, len(self.dh_value),
                            self.seqnum) + self.response + c2 + self.dh_value)

    @classmethod
    def unpack(cls, buf: bytes, expected_hl: int) -> "Reply":
        """Validates like nvmet_auth_reply (and SPDK's nvmf_auth_reply_exec)."""
        if len(buf) < _REPLY.size:
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"DH-HMAC-CHAP_Reply of {len(buf)} bytes (at least 16)")
        _, _, tid, hl, cvalid, dhvlen, seqnum = _REPLY.unpack_from(buf)
        if hl != expected_hl:
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"reply HL {hl}, the negotiated hash has {expected_hl}")
        if len(buf) != _REPLY.size + 2 * hl + dhvlen:
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"reply of {len(buf)} bytes with HL {hl} and DHVLEN "
                            f"{dhvlen} (expected {_REPLY.size + 2 * hl + dhvlen})")
        if cvalid not in (0, 1):
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"reply CVALID {cvalid}")
        if cvalid and seqnum == 0:
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, "reply with CVALID 1 and sequence number 0")
        start = _REPLY.size
        return cls(tid, bytes(buf[start:start + hl]), bytes(buf[start + hl:start + 2 * hl]) if cvalid else b"",
                   seqnum, bytes(buf[start + 2 * hl:start + 2 * hl + dhvlen]))


@dataclass
class Success1:
    """DH-HMAC-CHAP_Success1 (controller to host): R2 when the host asked to authenticate the controller."""

    tid: int
    hl: int
    response: bytes = b""  # empty: RVALID 0

    def pack(self) -> bytes:
        # HL is always set, RVALID or not: the Linux host checks it (SPDK notes the same).
        return _SUCCESS1.pack(TYPE_DHCHAP, ID_SUCCESS1, self.tid, self.hl, 1 if self.response else 0) + self.response

    @classmethod
    def unpack(cls, buf: bytes) -> "Success1":
        if len(buf) < _SUCCESS1.size:
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"DH-HMAC-CHAP_Success1 of {len(buf)} bytes")
        _, _, tid, hl, rvalid = _SUCCESS1.unpack_from(buf)
        if rvalid and len(buf) < _SUCCESS1.size + hl:
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"Success1 with RVALID and HL {hl} in {len(buf)} bytes")
        return cls(tid, hl, bytes(buf[_SUCCESS1.size:_SUCCESS1.size + hl]) if rvalid else b"")


@dataclass
class Success2:
    """DH-HMAC-CHAP_Success2 (host to controller): the host accepted the controller's response."""

    tid: int

    def pack(self) -> bytes:
        return _SUCCESS2.pack(TYPE_DHCHAP, ID_SUCCESS2, self.tid)

    @classmethod
    def unpack(cls, buf: bytes) -> "Success2":
        if len(buf) != _SUCCESS2.size:
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"DH-HMAC-CHAP_Success2 of {len(buf)} bytes (16)")
        return cls(_SUCCESS2.unpack_from(buf)[2])


@dataclass
class Failure:
    """AUTH_Failure1 (controller to host) or AUTH_Failure2 (host to controller)."""

    tid: int
    reason: int  # the reason code explanation (rescode_exp)
    auth_id: int = ID_FAILURE1
    rescode: int = REASON_FAILED

    def pack(self) -> bytes:
        return _FAILURE.pack(TYPE_COMMON, self.auth_id, self.tid, self.rescode, self.reason)

    @classmethod
    def unpack(cls, buf: bytes) -> "Failure":
        if len(buf) < _FAILURE.size:
            raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"AUTH_Failure of {len(buf)} bytes (8)")
        auth_type, auth_id, tid, rescode, reason = _FAILURE.unpack_from(buf)
        return cls(tid, reason, auth_id, rescode)

    def describe(self) -> str:
        return FAILURE_NAMES.get(self.reason, f"reason {self.reason:#x}")


def message_kind(buf: bytes) -> Tuple[int, int, int]:
    """(AUTH_Type, AUTH_Id, T_ID) of a message; AuthError if it is too short to have them."""
    if len(buf) < _COMMON.size:
        raise AuthError(FAILURE_INCORRECT_PAYLOAD, f"authentication message of {len(buf)} bytes")
    return _COMMON.unpack_from(buf)
