"""Namespace backends (nvmeof_roce.engine.backends)."""
import os

import pytest

from nvmeof_roce.engine.backends import BackendError, FileBackend, NullBackend, RamBackend, open_backend
from nvmeof_roce.config import NamespaceConfig


def pattern(n, seed=1):
    return bytes((i * 31 + seed) & 0xFF for i in range(n))


def roundtrip(b):
    data = pattern(8192, 7)
    b.write(4096, data)
    assert b.read(4096, 8192) == data
    out = bytearray(8192)
    b.read_into(4096, memoryview(out))
    assert bytes(out) == data
    # a sub-range into the middle of a bigger buffer
    big = bytearray(b"\xee" * 3 * 512)
    b.read_into(4096 + 512, memoryview(big)[512:1024])
    assert big[:512] == b"\xee" * 512 and big[512:1024] == data[512:1024] and big[1024:] == b"\xee" * 512
    b.write_zeroes(4096 + 1024, 1024)
    got = b.read(4096, 8192)
    assert got[:1024] == data[:1024] and got[1024:2048] == bytes(1024) and got[2048:] == data[2048:]
    b.discard(4096, 512)
    assert b.read(4096, 512) == bytes(512)
    assert b.read(4096 + 512, 512) == data[512:1024]


def test_ram_roundtrip_and_geometry():
    with RamBackend(1 << 20, 512) as b:
        assert (b.block_size, b.num_blocks, b.size_bytes) == (512, 2048, 1 << 20)
        assert b.read(0, 512) == bytes(512)
        roundtrip(b)
        # zero-copy view of the whole namespace
        assert len(b.buffer) == 1 << 20 and b.buffer[4096 + 512:4096 + 1024] == pattern(8192, 7)[512:1024]


def test_ram_4k():
    b = open_backend(NamespaceConfig(nsid=1, backend="ram", size_bytes=1 << 20, block_size=4096))
    assert (b.block_size, b.num_blocks) == (4096, 256)
    roundtrip(b)
    b.close()


def test_null_reads_zeros_discards_writes():
    b = open_backend(NamespaceConfig(nsid=1, backend="null", size_bytes=1 << 30))
    assert b.num_blocks == (1 << 30) // 512
    b.write(0, pattern(4096))
    assert b.read(0, 4096) == bytes(4096)
    buf = bytearray(b"\xff" * 1024)
    b.read_into(1 << 29, memoryview(buf))
    assert buf == bytes(1024)


@pytest.mark.parametrize("kind", ["ram", "null", "file"])
def test_out_of_range_refused(kind, tmp_path):
    if kind == "file":
        p = tmp_path / "f.img"
        p.write_bytes(bytes(1 << 16))
        b = open_backend(NamespaceConfig(nsid=1, backend="file", path=str(p)))
    else:
        b = open_backend(NamespaceConfig(nsid=1, backend=kind, size_bytes=1 << 16))
    with pytest.raises(BackendError, match="outside"):
        b.read((1 << 16) - 512, 1024)
    with pytest.raises(BackendError, match="outside"):
        b.write(1 << 16, b"x" * 512)
    with pytest.raises(BackendError, match="outside"):
        b.write_zeroes(-512, 512)
    b.close()


def test_file_roundtrip_and_flush_survives_reopen(tmp_path):
    p = tmp_path / "ns.img"
    p.write_bytes(bytes(1 << 20))
    ns = NamespaceConfig(nsid=1, backend="file", path=str(p))
    b = open_backend(ns)
    assert isinstance(b, FileBackend) and b.num_blocks == 2048 and b.block_size == 512
    roundtrip(b)
    data = pattern(4096, 3)
    b.write(1 << 19, data)
    b.flush()
    b.close()
    with open(p, "rb") as f:
        f.seek(1 << 19)
        assert f.read(4096) == data
    b2 = open_backend(ns)
    assert b2.read(1 << 19, 4096) == data
    b2.close()


def test_file_unaligned_buffer_falls_back(tmp_path):
    # O_DIRECT (where the filesystem has it) refuses an unaligned buffer; the backend must still work
    p = tmp_path / "ns.img"
    p.write_bytes(bytes(1 << 16))
    b = FileBackend(str(p))
    data = pattern(1024, 9)
    raw = bytearray(1024 + 3)
    raw[3:] = data
    b.write(512, memoryview(raw)[3:])
    out = bytearray(1024 + 5)
    b.read_into(512, memoryview(out)[5:])
    assert bytes(out[5:]) == data
    b.close()


def test_file_created_with_size(tmp_path):
    p = tmp_path / "new.img"
    b = open_backend(NamespaceConfig(nsid=1, backend="file", path=str(p), size_bytes=1 << 20, block_size=4096))
    assert os.path.getsize(p) == 1 << 20 and b.num_blocks == 256
    b.close()


def test_file_missing_names_path_and_fix(tmp_path):
    p = tmp_path / "missing.img"
    with pytest.raises(BackendError) as ei:
        open_backend(NamespaceConfig(nsid=1, backend="file", path=str(p)))
    assert str(p) in ei.value.message and "no such file" in ei.value.message
    assert "truncate -s" in ei.value.fix and "nvmeof_roce.size" in ei.value.fix


def test_file_not_multiple_of_block_size(tmp_path):
    p = tmp_path / "odd.img"
    p.write_bytes(bytes(1000))
    with pytest.raises(BackendError) as ei:
        FileBackend(str(p), 512)
    assert f"{p}: size 1000 is not a multiple of the block size 512" == ei.value.message
    assert "truncate -s 512" in ei.value.fix


def test_file_empty_and_directory(tmp_path):
    e = tmp_path / "empty.img"
    e.write_bytes(b"")
    with pytest.raises(BackendError, match="is empty"):
        FileBackend(str(e))
    with pytest.raises(BackendError, match="not a regular file or block device"):
        FileBackend(str(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_file_permission_denied(tmp_path):
    p = tmp_path / "ro.img"
    p.write_bytes(bytes(4096))
    p.chmod(0o400)
    with pytest.raises(BackendError) as ei:
        FileBackend(str(p))
    assert "permission denied" in ei.value.message and str(p) in ei.value.message


def test_file_permission_denied_as_root(tmp_path, monkeypatch):
    # as root chmod does not stop us: simulate the kernel's EACCES on open
    p = tmp_path / "ro.img"
    p.write_bytes(bytes(4096))
    real_open = os.open

    def deny(path, flags, *a):
        if str(path) == str(p):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", deny)
    with pytest.raises(BackendError) as ei:
        FileBackend(str(p))
    assert ei.value.message == f"{p}: permission denied opening it read-write"
    assert ei.value.fix


def test_file_on_tmpfs_is_buffered_and_works():
    shm = "/dev/shm"
    if not os.path.isdir(shm) or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    p = os.path.join(shm, f"nvmeof-roce-test-{os.getpid()}.img")
    try:
        with open(p, "wb") as f:
            f.truncate(1 << 16)
        b = FileBackend(p)
        roundtrip(b)
        b.flush()
        b.close()
    finally:
        os.unlink(p)


def test_ram_bad_size():
    with pytest.raises(BackendError, match="not a positive multiple of 512"):
        RamBackend(1000, 512)
    with pytest.raises(BackendError, match="not a positive multiple"):
        NullBackend(0, 512)


def _address(view) -> int:
    import ctypes
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_a_ram_resize_keeps_the_data_in_place_and_gives_back_the_pages_past_a_smaller_size():
    ram = RamBackend(64 * 1024)
    ram.pin()
    ram.write(0, b"\xab" * 64 * 1024)
    base = _address(ram.buffer)
    ram.prepare_resize(256 * 1024)()  # grow: the new pages read zeros
    assert _address(ram.buffer) == base and ram.size_bytes == 256 * 1024
    assert ram.read(0, 64 * 1024) == b"\xab" * 64 * 1024 and ram.read(64 * 1024, 4096) == bytes(4096)
    ram.write(192 * 1024, b"\xcd" * 4096)
    ram.prepare_resize(32 * 1024)()  # shrink: the pages past it go back to the kernel
    assert ram._memory.mapped == 32 * 1024 and ram.read(0, 32 * 1024) == b"\xab" * 32 * 1024
    ram.prepare_resize(256 * 1024)()  # and what comes back is zeros, not the old data
    assert _address(ram.buffer) == base and ram.read(32 * 1024, 224 * 1024) == bytes(224 * 1024)
    ram.close()


def test_a_ram_resize_past_its_reservation_copies_into_a_new_one(monkeypatch):
    from nvmeof_roce.engine.backends import ram as backends  # the RAM backend's module (engine/backends/ram.py)
    monkeypatch.setattr(backends, "RAM_RESERVE", 0)  # the reservation is the namespace's own size
    ram = RamBackend(8192)
    ram.write(0, b"\x11" * 8192)
    old = ram.buffer
    commit = ram.prepare_resize(16384)
    assert ram.size_bytes == 8192  # prepared only
    commit()
    assert ram.read(0, 8192) == b"\x11" * 8192 and ram.read(8192, 8192) == bytes(8192)
    assert bytes(old[:16]) == b"\x11" * 16  # a view of the old memory stays valid while it is held
    ram.close()
