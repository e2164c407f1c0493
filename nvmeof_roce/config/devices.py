"""Device paths: /dev, /sys and /proc hold what the kernel provides, so nothing is ever created in them (a file
made there is a RAM file on devtmpfs, gone at reboot with the data on it).  A device path that does not exist
is an error that says which devices do exist (by id, as an admin names a disk that must not change its name at
the next boot) and the likely typo."""
import difflib
import os
import stat
from typing import List, Tuple

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
