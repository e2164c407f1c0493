"""DH-HMAC-CHAP messages and crypto (nvmeof_roce/nvme/auth.py) against independent known answers.

Every expected value below was computed outside this project:
- secrets: nvme-cli 2.3 / libnvme 1.3 (Debian bookworm), `nvme gen-dhchap-key -s HEX -m N -l LEN -n NQN`,
  and `nvme check-dhchap-key` for the CRC;
- HMAC values: `openssl dgst -<hash> -mac HMAC -macopt hexkey:...` over the concatenations the kernel's
  nvmet_auth_host_hash / nvmet_auth_ctrl_hash / nvme_auth_augmented_challenge make;
- DH: two ffdhe2048 keys from `openssl genpkey -algorithm DH -pkeyopt group:ffdhe2048` and their shared
  secret from `openssl pkeyutl -derive -pkeyopt dh_pad:1`;
- the message layouts: byte by byte from NVMe Base 2.0 §8.13 / the kernel's struct nvmf_auth_dhchap_*.
"""
import base64

import pytest

from nvmeof_roce.nvme import auth as A

HOST = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"
SUB = "nqn.2024-01.io.example:auth-test"
K32 = bytes(range(32))
K48 = bytes(range(48))
K64 = bytes(range(64))

# (hash id, key, key length, nvme gen-dhchap-key output with -n HOST)
NVME_CLI_SECRETS = [
    (0, K32, 32, "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:"),
    (1, K32, 32, "DHHC-1:01:bOHk6jHoMxpP5YJr/eF6XNOGuPAzh0iRniebpsVb9ydqVuR5:"),
    (2, K48, 48, "DHHC-1:02:JzgkyQ7IBRNgZgoVJQTRqDZ62Hnj5/kZ+vrrqjiE4TzoZZv5ycVS5cOLCiZ1bQfVVxJqow==:"),
    (3, K64, 64, "DHHC-1:03:D+Ucidhr9Oh00yaKCrMLB2s2c/hsojlyxwni12p59UZ78f4YQ6UMpEcQG4yaPnLJFkljK+euytryvvQe2rYShiu0Vv0=:"),
    (0, K64, 64, "DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vMDEyMzQ1Njc4OTo7PD0+P4zODhA=:"),
]

# openssl: for the nvme-cli secret of each hash: the key transformed with HOST, R1 (null group), R2 (null
# group, controller key = the same secret, transformed with SUB), the augmented C1 with SHARED as session
# key, and R1 over that augmented challenge.  C1 = 40h.., C2 = 80h.., S1 12345678h, S2 9ABCDEF0h, T_ID 0102h.
OPENSSL_RESPONSES = [
    (1, "ed356462731f16b4c6a83d3f8ba8dd7f7ca2b1dd00f5e19b4d4a71434cc39ece",
     "4626140c8f5b5736afcd75c0781ae1f5b31cd692be05464fbf1d046000a639c6",
     "024e6aaa9f58f5e6064fd33f7bc04bee8503280eea98381abcda7ae213f447d6",
     "35a86ebbeaa7009cc4d84156a0a8f7887ef61d81c6e94ff9f9b6f1b1645f3279",
     "46c199fe17a2935ed3a962605215ed71d92c7dac438b9076dc0ccf3e4dd729c2"),
    (2, "f7a981f0778b6efa726a2c8cde7a7213c60f713dac20f2950b9a6bb06a3aec88cfcc6e2c54f4c3455c6258d560f912b5",
     "e84a4dab1a0031f29f6c7421f449da2dbb9e2fddbc3025108b3601dabbe7f97192713614201af596b60484a26ea4f86e",
     "3262f02ea40dd9cab17b0dd45947c7acac3e49827b3946a28dff015fa988b3bd2699aed204af6218cf4a416e3d6089d3",
     "912fae013b6bcf1f68c18c91708821ab345b5bda59062901913d1b4135f8397ed56ad2bae96ea52c97bb5248d4f7485c",
     "1fa99db28dcf4afe340df0c1002f228a51695c62a27f0e7c94814613ee4786f10714493a983168ee61827bc586839eee"),
    (3, "c46cdb7c92223a407270298f86aa208b2911c439a6bb99a507137fd847abee275460e06a06905f2a97293dbab36026fc7d6a4fa3fbe814be81fb47ebf7fcaf6d",
     "641696dc814f85f3ed57d4eece45b93ed1709fc4893f1e85a1300aa7ac8349c74c7a033b673e1ae87884f63819285a3fcc41ba2b4ebbbdd688f19c00530437e4",
     "fda2ba62552df6ae82ff27e241f85019d428a6b66c211095be63d7774b74c06357e24b21a982912e9ee23f02387e0b754dab5f52656a65b34d5336962a7a14ec",
     "fcc2e96c50c4be34ae309bd198902ba0b841edd7c8bcf8c7b00cb9cc9d02670f0eee3383ba615194d2b7234c58a212d6585ba57181befbf956a6a9c608c34ebf",
     "a5b76a434ba56a7f243a9e05e06018b1274f47794bb501d848bf3365b534d61976d6cf19cc3b2b0e743e78d97a945b257369e8a12257729a34fef50a9e1fddd9"),
]
C1_START, C2_START, S1, S2, TID = 0x40, 0x80, 0x12345678, 0x9ABCDEF0, 0x0102

A_PRIV = int(
    "30753051efd75694c131cfe63fa603e85ee7e33afc7068aa8035e7d7", 16)
A_PUB = int(
    "93fa691688fca8023f6ff34895173250903709f51c23cd5dddd571469fcb5d355a6528aed0c90cd8114cdf29227e2371"
    "4c17727476b3ba20223c93ceffe5fe183b645f596699a6adf84a3e6e9398ad5cdf0ec239b6f1c3fecbbeaac5516cfd79"
    "06c65f1fd76194e88be9f9fb32f3ef2e430ba74bdf0c40964234fca4234b05103158aa4fe440f63e10c53380a474b266"
    "b530ec7ca8a1d5603058ded9d46b1ea3fee69a5343c9631acf68247c172a8ea3d2201988d155922265d2e921acd61ec0"
    "7fdb15707434a592d748dc022fee450248df11afdbf6d0f4c14c4749b777213715cf5bab8f043772d4523dddfee29c2a"
    "ffa4c34d9787ebc1f379bf21c38ed74c", 16)
B_PUB = int(
    "6ef26bc399769f6fc691d006713e55ad78fed3776db8a24ec81630685e11710eb9af528264a942c9f57ba5999219f65b"
    "d1fdc8f5d638f57ecbada1c40a33035d21178d2a26c048bae71ed208d36e512501af4f8f50bd71aecaba3c720d52ffb9"
    "3b22c5fbfcca24d4035d16508bc05f737583b520f24e260b26e85ce1b77c398b4cec6ae0cab479309a416339ecc8c6b2"
    "b3b2baffe58c0ff5d9b6b0b7d421c5467355635d26b73af4d92c68029fe6b81dd46421cf0eace6e7d67eabdb1b500411"
    "a5259fe865cf6c6f827605a4115668f9f5fc6ea24b55d4cf635edf288d348021abdb09eba299ae9aa63db58e92c803c3"
    "99dd4cce8c6e338fab90d5b137ddbb89", 16)
SHARED = bytes.fromhex(
    "9532f73b78a412945fa5b383f4096189eebfd5562712e4c85b91cacfaf1a0f58ddc9bd188ee499db84881a6430846864"
    "a3d882321059dc30779b98d857eabb332fe1511975170cbd0253c10476544a3a6cfae0c6d6d0f6509039bfb10df8e209"
    "0c11594e96e4526af0e4da55ea5d14f440792eb463f6ce2f1151626412d8cff543597c8b6cd1cff23bac9db03084bd99"
    "52fe42d8007c13e836e2f06e57397b40c28e445263cace53c1d875913ec365928323ffbd8e85459fecb1c81573258e66"
    "373b4212debf7a0ab05c23dce0bf421d88c466485a730251468235785b2085caa6465eb783397c1bde9b7e367efbe9bb"
    "404b6297c7d68476407d79d982655eeb")


@pytest.mark.parametrize("hmac_id,key,length,expected", NVME_CLI_SECRETS)
def test_secret_generation_matches_nvme_cli(hmac_id, key, length, expected):
    assert A.generate_secret(hmac_id, length, nqn=HOST, key=key) == expected


@pytest.mark.parametrize("hmac_id,key,length,expected", NVME_CLI_SECRETS)
def test_secret_parses_back_with_its_crc(hmac_id, key, length, expected):
    secret = A.parse_secret(expected)
    assert secret.hmac_id == hmac_id and len(secret.key) == length
    assert secret.encode() == expected
    if hmac_id == 0:
        assert secret.key == key


def test_secret_crc_mismatch_is_refused():
    # `nvme check-dhchap-key` says: CRC mismatch (key 00000000, crc 91267e8a)
    with pytest.raises(A.SecretError, match="CRC"):
        A.parse_secret("DHHC-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8AAAAA:")


@pytest.mark.parametrize("text,what", [
    ("DHHC-2:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:", "not a DH-HMAC-CHAP secret"),
    ("DHHC-1:04:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:", "hash field"),
    ("DHHC-1:1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:", "hash field"),
    ("DHHC-1:00:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR!:", "base64"),
    ("DHHC-1:00:" + base64.b64encode(bytes(20)).decode() + ":", "32, 48 or 64"),
    ("secret", "not a DH-HMAC-CHAP secret"),
])
def test_malformed_secrets_name_the_problem(text, what):
    with pytest.raises(A.SecretError, match=what):
        A.parse_secret(text)


@pytest.mark.parametrize("hmac_id,transformed,r1,r2,aug,r1_dh", OPENSSL_RESPONSES)
def test_responses_match_openssl(hmac_id, transformed, r1, r2, aug, r1_dh):
    secret = A.parse_secret(next(s for h, _, _, s in NVME_CLI_SECRETS if h == hmac_id))
    hl = A.hash_len(hmac_id)
    c1 = bytes(range(C1_START, C1_START + hl))
    c2 = bytes(range(C2_START, C2_START + hl))
    assert secret.transform(HOST).hex() == transformed
    assert A.host_response(hmac_id, secret.transform(HOST), c1, S1, TID, HOST, SUB).hex() == r1
    assert A.controller_response(hmac_id, secret.transform(SUB), c2, S2, TID, HOST, SUB).hex() == r2
    assert A.augmented_challenge(hmac_id, SHARED, c1).hex() == aug
    assert A.host_response(hmac_id, secret.transform(HOST), c1, S1, TID, HOST, SUB, session_key=SHARED).hex() == r1_dh


def test_untransformed_secret_is_used_as_is():
    assert A.Secret(K32, 0).transform(HOST) == K32


def test_dh_matches_openssl_ffdhe2048():
    key = A.dh_generate(A.DHGROUP_2048, private=A_PRIV)
    assert key.public == A_PUB
    assert len(key.public_bytes()) == 256
    assert key.shared_secret(B_PUB.to_bytes(256, "big")) == SHARED
    # a DH value without its leading zero bytes means the same number
    assert key.shared_secret(B_PUB.to_bytes(256, "big").lstrip(b"\0")) == SHARED


@pytest.mark.parametrize("group", [A.DHGROUP_2048, A.DHGROUP_3072, A.DHGROUP_4096, A.DHGROUP_6144, A.DHGROUP_8192])
def test_ffdhe_groups_agree_both_ways(group):
    a, b = A.dh_generate(group), A.dh_generate(group)
    bits = A.DHGROUP_BITS[group]
    p = A.FFDHE_PRIMES[bits]
    assert p.bit_length() == bits and p >> (bits - 64) == 2**64 - 1 and p % 2**64 == 2**64 - 1  # RFC 7919 §A
    assert a.shared_secret(b.public_bytes()) == b.shared_secret(a.public_bytes())


@pytest.mark.parametrize("value,reason", [
    (0, A.FAILURE_DHGROUP_UNUSABLE), (1, A.FAILURE_DHGROUP_UNUSABLE), ("p-1", A.FAILURE_DHGROUP_UNUSABLE),
    ("long", A.FAILURE_INCORRECT_PAYLOAD), ("empty", A.FAILURE_INCORRECT_PAYLOAD)])
def test_degenerate_dh_values_are_refused(value, reason):
    key = A.dh_generate(A.DHGROUP_2048)
    p = A.FFDHE_PRIMES[2048]
    raw = {"p-1": (p - 1).to_bytes(256, "big"), "long": bytes(257), "empty": b""}.get(value)
    if raw is None:
        raw = value.to_bytes(256, "big")
    with pytest.raises(A.AuthError) as err:
        key.shared_secret(raw)
    assert err.value.reason == reason


# ------------------------------------------------------------------ golden bytes of each message

def test_negotiate_golden_bytes():
    msg = A.Negotiate(tid=0x1234, hash_ids=[1, 2, 3], dhgroup_ids=[0, 1, 2, 3, 4, 5])
    expected = (bytes.fromhex("00 00 0000 3412 00 01") + bytes.fromhex("01 00 03 06")
                + bytes([1, 2, 3]) + bytes(27) + bytes([0, 1, 2, 3, 4, 5]) + bytes(24))
    assert msg.pack() == expected and len(expected) == 72
    assert A.Negotiate.unpack(expected) == msg


def test_challenge_golden_bytes():
    msg = A.Challenge(tid=0x0102, hash_id=1, dhgroup_id=1, seqnum=0xAABBCCDD, challenge=bytes(range(32)),
                      dh_value=b"\x07" * 256)
    expected = bytes.fromhex("01 01 0000 0201 20 00 01 01 0001 DDCCBBAA") + bytes(range(32)) + b"\x07" * 256
    assert msg.pack() == expected
    assert A.Challenge.unpack(expected) == msg


def test_reply_golden_bytes():
    msg = A.Reply(tid=0x0102, response=b"\x11" * 32, challenge=b"\x22" * 32, seqnum=0x01020304, dh_value=b"\x33" * 4)
    expected = bytes.fromhex("01 02 0000 0201 20 00 01 00 0400 04030201") + b"\x11" * 32 + b"\x22" * 32 + b"\x33" * 4
    assert msg.pack() == expected
    assert A.Reply.unpack(expected, 32) == msg


def test_unidirectional_reply_golden_bytes():
    msg = A.Reply(tid=7, response=b"\x11" * 48)
    expected = bytes.fromhex("01 02 0000 0700 30 00 00 00 0000 00000000") + b"\x11" * 48 + bytes(48)
    assert msg.pack() == expected
    assert A.Reply.unpack(expected, 48) == msg


def test_success1_golden_bytes():
    with_r2 = A.Success1(tid=0x0102, hl=32, response=b"\x44" * 32)
    assert with_r2.pack() == bytes.fromhex("01 03 0000 0201 20 00 01 00000000000000") + b"\x44" * 32
    without = A.Success1(tid=0x0102, hl=64)
    assert without.pack() == bytes.fromhex("01 03 0000 0201 40 00 00 00000000000000")
    assert A.Success1.unpack(with_r2.pack()) == with_r2 and A.Success1.unpack(without.pack()) == without


def test_success2_golden_bytes():
    assert A.Success2(tid=0xBEEF).pack() == bytes.fromhex("01 04 0000 EFBE") + bytes(10)
    assert A.Success2.unpack(bytes.fromhex("01 04 0000 EFBE") + bytes(10)).tid == 0xBEEF


def test_failure_golden_bytes():
    f1 = A.Failure(tid=0x0102, reason=A.FAILURE_FAILED)
    assert f1.pack() == bytes.fromhex("00 F1 0000 0201 01 01")
    f2 = A.Failure(tid=0x0102, reason=A.FAILURE_INCORRECT_PAYLOAD, auth_id=A.ID_FAILURE2)
    assert f2.pack() == bytes.fromhex("00 F0 0000 0201 01 06")
    assert A.Failure.unpack(f2.pack()) == f2


def test_command_dword10_places_secp_and_spsp():
    # SQE bytes 40..43: reserved, SPSP0, SPSP1, SECP
    assert A.auth_cdw10().to_bytes(4, "little") == bytes([0x00, 0x01, 0x01, 0xE9])
    assert A.split_cdw10(A.auth_cdw10(0xEA, 2, 3)) == (0xEA, 2, 3)


# ------------------------------------------------------------------ malformed messages

def _negotiate(**kw):
    return bytearray(A.Negotiate(tid=1, **kw).pack())


@pytest.mark.parametrize("mutate,reason", [
    (lambda b: b[:40], A.FAILURE_INCORRECT_PAYLOAD),                     # shorter than one descriptor
    (lambda b: b.__setitem__(7, 0) or b, A.FAILURE_INCORRECT_PAYLOAD),    # NAPD 0
    (lambda b: b.__setitem__(7, 2) or b, A.FAILURE_INCORRECT_PAYLOAD),    # NAPD 2, one descriptor sent
    (lambda b: b.__setitem__(8, 2) or b, A.FAILURE_NOT_USABLE),           # no DH-HMAC-CHAP descriptor
    (lambda b: b.__setitem__(10, 31) or b, A.FAILURE_INCORRECT_PAYLOAD),  # HALEN 31
    (lambda b: b.__setitem__(11, 31) or b, A.FAILURE_INCORRECT_PAYLOAD),  # DHLEN 31
    (lambda b: b.__setitem__(6, 1) or b, A.FAILURE_CONCAT_MISMATCH),      # SC_C: new TLS PSK
])
def test_malformed_negotiate(mutate, reason):
    with pytest.raises(A.AuthError) as err:
        A.Negotiate.unpack(bytes(mutate(_negotiate())))
    assert err.value.reason == reason


def _reply(**kw):
    args = dict(tid=1, response=b"\x11" * 32, challenge=b"\x22" * 32, seqnum=5)
    args.update(kw)
    return bytearray(A.Reply(**args).pack())


@pytest.mark.parametrize("mutate,reason", [
    (lambda b: b[:12], A.FAILURE_INCORRECT_PAYLOAD),                     # shorter than the header
    (lambda b: b.__setitem__(6, 48) or b, A.FAILURE_INCORRECT_PAYLOAD),   # HL not the negotiated hash's
    (lambda b: b[:-1], A.FAILURE_INCORRECT_PAYLOAD),                     # one byte short
    (lambda b: b + b"\0", A.FAILURE_INCORRECT_PAYLOAD),                  # one byte long
    (lambda b: b.__setitem__(10, 4) or b, A.FAILURE_INCORRECT_PAYLOAD),   # DHVLEN beyond the data
    (lambda b: b.__setitem__(8, 2) or b, A.FAILURE_INCORRECT_PAYLOAD),    # CVALID 2
    (lambda b: b.__setitem__(slice(12, 16), bytes(4)) or b, A.FAILURE_INCORRECT_PAYLOAD),  # CVALID, SEQNUM 0
])
def test_malformed_reply(mutate, reason):
    with pytest.raises(A.AuthError) as err:
        A.Reply.unpack(bytes(mutate(_reply())), 32)
    assert err.value.reason == reason


@pytest.mark.parametrize("buf", [bytes.fromhex("01 04 0000 0100") + bytes(9), bytes.fromhex("01 04 0000 0100") + bytes(11)])
def test_malformed_success2(buf):
    with pytest.raises(A.AuthError) as err:
        A.Success2.unpack(buf)
    assert err.value.reason == A.FAILURE_INCORRECT_PAYLOAD


def test_malformed_failure_and_header():
    with pytest.raises(A.AuthError) as err:
        A.Failure.unpack(bytes.fromhex("00 F0 0000 0100 01"))
    assert err.value.reason == A.FAILURE_INCORRECT_PAYLOAD
    with pytest.raises(A.AuthError):
        A.message_kind(b"\x01\x02\x00")


@pytest.mark.parametrize("mutate,reason", [
    (lambda b: b.__setitem__(8, 9) or b, A.FAILURE_HASH_UNUSABLE),        # unknown hash
    (lambda b: b.__setitem__(6, 48) or b, A.FAILURE_HASH_UNUSABLE),       # HL not the hash's
    (lambda b: b.__setitem__(9, 9) or b, A.FAILURE_DHGROUP_UNUSABLE),     # unknown group
    (lambda b: b[:-1], A.FAILURE_INCORRECT_PAYLOAD),                     # truncated
    (lambda b: b.__setitem__(9, 0) or b, A.FAILURE_INCORRECT_PAYLOAD),    # null group with a DH value
])
def test_malformed_challenge(mutate, reason):
    good = bytearray(A.Challenge(tid=1, hash_id=1, dhgroup_id=1, seqnum=3, challenge=bytes(32),
                                 dh_value=b"\x05" * 256).pack())
    with pytest.raises(A.AuthError) as err:
        A.Challenge.unpack(bytes(mutate(good)))
    assert err.value.reason == reason


def test_names_as_configfs_spells_them():
    assert A.hash_id_by_name("hmac(sha384)") == A.HASH_SHA384
    assert A.hash_id_by_name("sha512") == A.HASH_SHA512
    assert A.hash_id_by_name("md5") is None
    assert A.dhgroup_id_by_name("ffdhe4096") == A.DHGROUP_4096
    assert A.dhgroup_id_by_name("null") == A.DHGROUP_NULL
    assert A.dhgroup_id_by_name("ffdhe1024") is None


@pytest.mark.parametrize("group", [A.DHGROUP_2048, A.DHGROUP_8192])
def test_openssl_and_python_dh_give_the_same_bytes(group):
    """dh_generate uses OpenSSL (the `cryptography` package) where it is installed; its keys agree with the
    pure-Python arithmetic used where it is not (the lab guest), in both directions."""
    pytest.importorskip("cryptography")
    fast = A.dh_generate(group)
    assert fast._key is not None and A.DH_BACKEND == "openssl"
    slow = A.dh_generate(group, private=A.dh_generate(group).private)
    assert slow._key is None
    p = A.FFDHE_PRIMES[A.DHGROUP_BITS[group]]
    assert fast.public == pow(2, fast.private, p)
    assert fast.shared_secret(slow.public_bytes()) == slow.shared_secret(fast.public_bytes())
    assert fast.shared_secret(slow.public_bytes()) == pow(slow.public, fast.private, p).to_bytes(fast.size, "big")
