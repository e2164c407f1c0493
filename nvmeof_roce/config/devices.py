"""Device paths: /dev, /sys and /proc hold what the kernel provides, so nothing is ever created in them (a file
made there is a RAM file on devtmpfs, gone at reboot with the data on it).  A device path that does not exist
is an error that says which devices do exist (by id, as an admin names a disk that must not change its name at
the next boot) and the likely typo.

A file namespace's file, where it is not there yet: the command that creates it (its directory too, where that
is missing), and whether the filesystem it would be made on can hold the size asked."""
import difflib
import os
import stat
import shlex
from typing import List, Optional, Tuple

SYSTEM_TREES = ("/dev", "/sys", "/proc")
BY_ID_DIR = "/dev/disk/by-id"
_SHOWN_BY_ID = 8  # names listed in a message; the rest are counted


def in_system_tree(path: str) -> bool:
    """Whether `path` (made absolute, `..` resolved) lies in /dev, /sys or /proc."""
    p = os.path.normpath(os.path.abspath(path))
    return any(p == tree or p.startswith(tree + "/") for tree in SYSTEM_TREES)


def _listdir(d: str) -> List[str]:
    try:
        return sorted(os.listdir(d))
    except OSError:
        return []


def _block_devices(d: str) -> List[str]:
    found = []
    for name in _listdir(d):
        p = os.path.join(d, name)
        try:
            if stat.S_ISBLK(os.stat(p).st_mode):
                found.append(p)
        except OSError:
            continue
    return found


def missing_device(path: str) -> Tuple[str, str]:
    """The problem and the fix for a device path under /dev, /sys or /proc that does not exist."""
    by_id = [os.path.join(BY_ID_DIR, n) for n in _listdir(BY_ID_DIR)]
    # by name: a typo in /dev/disk/by-id/NAME or /dev/NAME, wherever the directory listed is
    candidates = {os.path.basename(p): p for p in _block_devices(os.path.dirname(path)) + by_id}
    likely = [candidates[n] for n in
              difflib.get_close_matches(os.path.basename(path), sorted(candidates), n=1, cutoff=0.75)]
    problem = (f"{path}: no such device; the target never creates a file under "
               f"{', '.join(SYSTEM_TREES[:-1])} or {SYSTEM_TREES[-1]}")
    fix = []
    if likely:
        fix.append(f"did you mean {likely[0]}?")
    if by_id:
        names = [os.path.basename(p) for p in by_id]
        more = f", and {len(names) - _SHOWN_BY_ID} more" if len(names) > _SHOWN_BY_ID else ""
        fix.append(f"the devices by id ({BY_ID_DIR}): {', '.join(names[:_SHOWN_BY_ID])}{more}")
    fix.append("name a block device that exists (ls -l /dev/disk/by-id; a loop device: losetup -f --show FILE; "
               "null_blk: /dev/nullb0), or a regular file outside /dev for a file namespace")
    return problem, "; ".join(fix)


def empty_block_device(path: str) -> Tuple[str, str]:
    """The problem and the fix for a block device of 0 bytes: a loop device with no file, a drive with no medium."""
    return (f"{path}: is a block device of 0 bytes (a loop device with no file attached, or no medium)",
            f"attach a file to it (losetup {path} FILE), or name another device")


def existing_parent(path: str) -> str:
    """The nearest directory above `path` (made absolute) that exists: where a file made at `path` would live."""
    d = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(d):
        d = os.path.dirname(d)
    return d


def create_file_command(path: str, size: str = "1G") -> str:
    """The shell command that creates `path` as a file of `size`: `mkdir -p` first when its directory is missing
    (a bare `truncate -s` fails there: "No such file or directory")."""
    directory = os.path.dirname(os.path.abspath(path))
    truncate = f"truncate -s {size} {shlex.quote(path)}"
    return truncate if os.path.isdir(directory) else f"mkdir -p {shlex.quote(directory)} && {truncate}"


def _size_text(n: int) -> str:
    for unit, shift in (("P", 50), ("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.3g}{unit}"
    return f"{n} bytes"


def filesystem_too_small(path: str, size: int) -> Optional[Tuple[str, str]]:
    """The problem and the fix when a file of `size` bytes made at `path` would not fit on the filesystem that
    would hold it (the nearest existing directory's, by os.statvfs: its whole size, not what is free, as a sparse
    file takes room only when written); None when it fits or the filesystem cannot be asked."""
    where = existing_parent(path)
    try:
        vfs = os.statvfs(where)
    except OSError:
        return None
    total = vfs.f_blocks * vfs.f_frsize
    if size <= total:
        return None
    return (f"{size} bytes ({_size_text(size)}) asked for {path}, but the filesystem holding {where} is only "
            f"{total} bytes ({_size_text(total)})",
            f"give a size of at most {_size_text(total)} (nvmeof_roce.size), or put device.path on a filesystem "
            "that holds it")
