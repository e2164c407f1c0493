"""The null backend (registry entry "null", config/backends.py; native entry "null", csrc/be_null.c): reads zeros,
writes are discarded."""
from .base import Backend, BackendError, check_new_size


class NullBackend(Backend):
    kind = "null"
    native = "null"

    def __init__(self, size_bytes: int, block_size: int = 512):
        if size_bytes <= 0 or size_bytes % block_size:
            raise BackendError(f"null namespace: size {size_bytes} is not a positive multiple of {block_size}",
                               "give a size that is a multiple of the block size")
        self.block_size = block_size
        self.num_blocks = size_bytes // block_size

    def read_into(self, offset, buf):
        buf = memoryview(buf).cast("B")
        self._check(offset, len(buf))
        buf[:] = bytes(len(buf))

    def write(self, offset, data, dsync=False):
        self._check(offset, len(memoryview(data).cast("B")))

    def write_zeroes(self, offset, length):
        self._check(offset, length)

    def zero_steps(self, offset, length, deallocate, slice_bytes):
        self._check(offset, length)
        return iter(())  # nothing stored, nothing to zero
    def prepare_resize(self, size_bytes):
        check_new_size("null", size_bytes, self.block_size)

        def commit():
            self.num_blocks = size_bytes // self.block_size
        return commit
