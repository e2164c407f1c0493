"""The backend seam (docs/architecture.md "The backend seam"): a backend registered in Python serves a loopback
target end to end through the registry alone, and each C entry (csrc/backend.c) serves its namespaces' commands
through the native queue on the fake verbs provider."""
import pytest

from loopback_env import SUB_FILE, SUB_NULL, SUB_RAM, file_ns, null_ns, port, ram_ns
from native_diff import LoopbackEndpoint, NativeEndpoint, close_all, io_capsule, pattern
from native_fake import needs_native

from nvmeof_roce.config import ConfigError, parse_config
from nvmeof_roce.config.backends import BackendKind, KINDS, register, unregister
from nvmeof_roce.engine.backends import Backend, BackendError, check_new_size, open_backend

READ, WRITE, FLUSH, WRITE_ZEROES, DSM = 0x02, 0x01, 0x00, 0x08, 0x09
SUB_TEST = "nqn.2024-01.io.test:seam"


def status_of(cqe: bytes) -> int:
    return int.from_bytes(cqe[14:16], "little") >> 1


class BytesBackend(Backend):
    """A test-only backend: its storage a bytearray, every call counted.  Nothing of the engine names it: it is a
    module (this one) and a registry entry (the fixture's `register`)."""
    kind = "test-bytes"
    calls: dict = {}

    def __init__(self, size_bytes: int, block_size: int = 512):
        if not size_bytes or size_bytes % block_size:
            raise BackendError(f"test-bytes: size {size_bytes}", "a multiple of the block size")
        self.block_size, self.num_blocks = block_size, size_bytes // block_size
        self.data = bytearray(size_bytes)
        BytesBackend.calls = {}
        BytesBackend.opened = self

    def _count(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1

    def nguid(self):
        return bytes(range(0xA0, 0xB0))

    def read_into(self, offset, buf):
        buf = memoryview(buf).cast("B")
        self._check(offset, len(buf))
        self._count("read")
        buf[:] = self.data[offset:offset + len(buf)]

    def write(self, offset, data, dsync=False):
        data = memoryview(data).cast("B")
        self._check(offset, len(data))
        self._count("write")
        self.data[offset:offset + len(data)] = data

    def flush(self):
        self._count("flush")

    def write_zeroes(self, offset, length):
        self._check(offset, length)
        self._count("write_zeroes")
        self.data[offset:offset + length] = bytes(length)

    def discard(self, offset, length):
        self._count("discard")
        self.write_zeroes(offset, length)

    def prepare_resize(self, size_bytes):
        check_new_size(self.kind, size_bytes, self.block_size)

        def commit():
            self.data = self.data[:size_bytes].ljust(size_bytes, b"\0")
            self.num_blocks = size_bytes // self.block_size
        return commit


@pytest.fixture
def test_kind():
    kind = register(BackendKind("test-bytes", f"{__name__}:BytesBackend", path=False, size_required=True,
                                summary="a test's bytearray"))
    yield kind
    unregister(kind.name)


def seam_config(ns: dict) -> dict:
    return {"hosts": [], "ports": [port(1, "10.99.0.1:4420", [SUB_TEST])],
            "subsystems": [{"nqn": SUB_TEST, "namespaces": [ns]}]}


def test_a_backend_registered_in_python_serves_a_loopback_target_end_to_end(test_kind):
    ep = LoopbackEndpoint(seam_config({"nsid": 1, "nvmeof_roce": {"backend": "test-bytes", "size": "1M"}}),
                          SUB_TEST)
    try:
        backend = BytesBackend.opened
        ns = ep.env.target.subsystem(SUB_TEST).namespaces[1]
        assert ns.backend is backend and ns.num_blocks == 2048
        assert ns.nguid == bytes(range(0xA0, 0xB0))  # its storage's identity, the config giving none
        data = pattern(4096, seed=11)
        ep.buf.view[8192:8192 + 4096] = data
        (w,) = ep.exchange(io_capsule(ep, WRITE, 1, 16, 7, 4096, offset=8192, cid=1))
        (r,) = ep.exchange(io_capsule(ep, READ, 1, 16, 7, 4096, offset=0, cid=2))
        (f,) = ep.exchange(io_capsule(ep, FLUSH, 1, 0, 0, 0, cid=3))
        (z,) = ep.exchange(io_capsule(ep, WRITE_ZEROES, 1, 16, 0, 0, cid=4))
        assert [status_of(c) for c in (w, r, f, z)] == [0, 0, 0, 0]
        assert ep.host_bytes()[:4096] == data
        assert bytes(backend.data[16 * 512:17 * 512]) == bytes(512)  # the block Write Zeroes zeroed
        assert bytes(backend.data[17 * 512:16 * 512 + 4096]) == data[512:]
        assert {k: backend.calls.get(k, 0) for k in ("write", "read", "flush", "write_zeroes")} == \
            {"write": 1, "read": 1, "flush": 1, "write_zeroes": 1}
        # the resize notice: the storage's size changed outside; the namespace keeps its own until resized
        backend.notice_resize(2 << 20)
        assert ns.storage_size == 2 << 20 and ns.num_blocks == 2048
    finally:
        close_all(ep)


def test_the_config_takes_the_kinds_of_the_registry(test_kind, tmp_path):
    cfg = parse_config(seam_config({"nsid": 1, "nvmeof_roce": {"backend": "test-bytes", "size": "64K"}}), "t")
    ns = cfg.subsystems[0].namespaces[0]
    assert ns.backend == "test-bytes" and ns.path is None
    assert type(open_backend(ns)) is BytesBackend
    with pytest.raises(ConfigError, match="size.*is required for a test-bytes namespace"):
        parse_config(seam_config({"nsid": 1, "nvmeof_roce": {"backend": "test-bytes"}}), "t")
    unregister("test-bytes")
    with pytest.raises(ConfigError, match="must be one of ram, file, null, block, rbd, got 'test-bytes'"):
        parse_config(seam_config({"nsid": 1, "nvmeof_roce": {"backend": "test-bytes", "size": "64K"}}), "t")
    assert set(KINDS) == {"ram", "file", "null", "block", "rbd"}


def test_a_block_namespace_takes_a_block_device_only(tmp_path):
    path = tmp_path / "disk.img"
    path.write_bytes(bytes(1 << 20))
    cfg = parse_config(seam_config({"nsid": 1, "device": {"path": str(path)}, "nvmeof_roce": {"backend": "block"}}),
                       "t")
    ns = cfg.subsystems[0].namespaces[0]
    assert ns.path == str(path)
    with pytest.raises(BackendError, match="not a block device"):
        open_backend(ns)
    ns.backend = "file"  # "file" takes a file or a block device
    backend = open_backend(ns)
    assert backend.kind == "file" and backend.native == "file" and backend.storage_size() == 1 << 20
    with open(path, "ab") as f:  # grown outside the target: check_size gives the resize notice
        f.write(bytes(4096))
    seen = []
    backend.watch_resize(lambda b, size: seen.append(size))
    assert backend.check_size() == (1 << 20) + 4096 and seen == [(1 << 20) + 4096]
    backend.close()


# ------------------------------------------------------------------ the C entries, through the fake provider

def _entry_config(kind: str, tmp_path) -> tuple:
    if kind == "ram":
        return {"hosts": [], "ports": [port(1, "10.99.0.1:4420", [SUB_RAM])],
                "subsystems": [{"nqn": SUB_RAM, "namespaces": [ram_ns(1, "1M")]}]}, SUB_RAM
    if kind == "null":
        return {"hosts": [], "ports": [port(1, "10.99.0.1:4420", [SUB_NULL])],
                "subsystems": [{"nqn": SUB_NULL, "namespaces": [null_ns(1, "1M")]}]}, SUB_NULL
    return {"hosts": [], "ports": [port(1, "10.99.0.1:4420", [SUB_FILE])],
            "subsystems": [{"nqn": SUB_FILE, "namespaces": [file_ns(1, tmp_path / "ns.img", "1M")]}]}, SUB_FILE


# what each entry serves itself (the rest goes to the core, which answers through the same queue):
# Write Zeroes and deallocate (DSM) are the core's on every entry for now; a file namespace's Flush is its
# fdatasync on the core's engine (be_uring.c has no flush entry)
NATIVE = {"ram": {"read", "write", "flush"}, "null": {"read", "write", "flush"}, "file": {"read", "write"}}


@needs_native
@pytest.mark.parametrize("kind", ["ram", "null", "file"])
def test_each_c_entry_serves_read_write_flush_zeroes_and_discard(kind, tmp_path):
    config, nqn = _entry_config(kind, tmp_path)
    ep = NativeEndpoint(config, nqn)
    try:
        ns = ep.env.target.subsystem(nqn).namespaces[1]
        assert ns.backend.native == kind
        data = pattern(4096, seed=21)
        ranges = (0).to_bytes(4, "little") + (2).to_bytes(4, "little") + (38).to_bytes(8, "little")  # blocks 38-39
        cases = [
            ("write", io_capsule(ep, WRITE, 1, 32, 7, 4096, offset=8192, cid=1)),
            ("read", io_capsule(ep, READ, 1, 32, 7, 4096, offset=0, cid=2)),
            ("flush", io_capsule(ep, FLUSH, 1, 0, 0, 0, cid=3)),
            ("zeroes", io_capsule(ep, WRITE_ZEROES, 1, 32, 0, 0, cid=4)),  # the first block of the write
            ("discard", io_capsule(ep, DSM, 1, 4 << 32, 0, 16, sgl_id=0x01, cid=5, extra=ranges)),  # AD, 1 range
            ("read", io_capsule(ep, READ, 1, 32, 7, 4096, offset=16384, cid=6)),
        ]
        ep.buf.view[8192:8192 + 4096] = data
        for what, capsule in cases:
            before = ep.queue.stats()
            (cqe,) = ep.exchange(capsule)
            assert status_of(cqe) == 0, (kind, what)
            after = ep.queue.stats()
            native = after["native_commands"] - before["native_commands"]
            assert native == (1 if what in NATIVE[kind] else 0), (kind, what, native)
            assert after["python_commands"] - before["python_commands"] == 1 - native, (kind, what)
        expected = bytes(4096) if kind == "null" else data
        assert ep.host_bytes()[:4096] == expected
        zeroed = bytes(4096) if kind == "null" else bytes(512) + data[512:3072] + bytes(1024)
        assert ep.host_bytes()[16384:16384 + 4096] == zeroed
    finally:
        ep.close()
