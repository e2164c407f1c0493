"""DH-HMAC-CHAP keys in the config: inline, in a key file, or a keyring key by name.

A host's `dhchap.key` and `dhchap.ctrl_key` (hosts[]) take one of three forms:

- the secret itself, `DHHC-1:NN:<base64>:` (as nvmetcli saves it from configfs);
- the absolute path of a file that holds it (as nvme-cli and SPDK's keyring_file take a key): the file must
  be a regular file of at most 4 KiB that only its owner (the target's user, or root) may read or write,
  mode 0600 or 0400 - a file group or others may read is refused, as ssh refuses such a private key;
- the name of a key in the config's keyring, `"nvmeof_roce": {"keyring": {NAME: PATH}}` (SPDK's
  `keyring_file_add_key` name and path; the userspace target's RPCs keep it).

A key file given through a symbolic link (a secret volume's `..data/` links, /etc/alternatives-style
indirection) is followed once, up front: the file actually opened is the link's target, its mode and owner are
checked on that real file (0600 or 0400, as securefile.py writes secrets), and every message and the key's
origin name both, `key file LINK (a link to TARGET)`, with a fix (chmod, chown) aimed at the target.

Files are read when the config is loaded (start, reload, every change by RPC), so a key is rotated by
replacing its file (write a new one, `mv` it over the old) and reloading.  No message here shows key
material: they name the field, the file and its mode.
"""
import os
import re
import stat
from typing import Dict, List, Optional, Tuple

from .errors import ConfigError
from .model import USERSPACE_KEY, TargetConfig

SECRET_PREFIX = "DHHC-1:"
KEYRING = "keyring"                       # the key of the keyring under the top-level "nvmeof_roce"
KEY_FILE_MAX = 4096                       # a DHHC-1 string of a 64-byte key is 103 characters
KEY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_FORMS = ("a DH-HMAC-CHAP secret (DHHC-1:NN:...:), the absolute path of a 0600 key file, or the name of a key in "
          f"the keyring ({USERSPACE_KEY}.{KEYRING})")


def kind(value: str) -> str:
    """'inline', 'file', 'keyring' or 'bad' (which never echoes the value: it may be a mangled secret)."""
    if value.startswith(SECRET_PREFIX):
        return "inline"
    if value.startswith("/"):
        return "file"
    if KEY_NAME_RE.match(value):
        return "keyring"
    return "bad"


def keyring_of(config: TargetConfig) -> Dict[str, str]:
    """The config's keyring, name -> key file path (the loader checked its shape)."""
    ring = (config.userspace or {}).get(KEYRING) or {}
    return dict(ring) if isinstance(ring, dict) else {}


def check_keyring(ring, source: str) -> Dict[str, str]:
    """The keyring's shape: an object of key names to absolute paths; ConfigError naming the entry."""
    where = f"{USERSPACE_KEY}.{KEYRING}"
    if not isinstance(ring, dict):
        raise ConfigError(source, where, f"must be an object of key names to key file paths, got "
                          f"{type(ring).__name__}", f'write it as {{"key0": "/etc/nvmeof-roce/keys/key0"}}')
    for name, path in ring.items():
        if not KEY_NAME_RE.match(name):
            raise ConfigError(source, f"{where}.{name}", "is not a key name: 1..64 letters, digits, '.', '_' or '-', "
                              "starting with a letter or digit", "rename the key, e.g. key0 or host1-key")
        if not isinstance(path, str) or not path.startswith("/"):
            raise ConfigError(source, f"{where}.{name}", f"must be the absolute path of the key file, got {path!r}",
                              "give the full path of a 0600 file holding the DHHC-1:NN:...: key")
    return dict(ring)


def read_key_file(path: str, source: str, where: str) -> str:
    """The text of key file `path` (stripped), refused unless a regular file only its owner may access.  A link
    is resolved first: the real file is opened and checked, and messages name the link and its target."""
    def bad(problem: str, fix: str) -> ConfigError:
        return ConfigError(source, where, f"key file {shown}: {problem}", fix)

    shown = path
    if not path.startswith("/"):
        raise bad("is not an absolute path", "give the key file's full path (the target's working directory "
                  "is not yours)")
    # the file that holds the key: opened (never through a link again: O_NOFOLLOW), checked, named in every fix
    shown, path = key_file_name(path), os.path.realpath(path)
    try:  # O_NONBLOCK: a FIFO must not block the loop
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise bad(exc.strerror or str(exc), "create it (nvmeof-roce gen-dhchap-key ... > FILE; chmod 600 FILE) "
                  "or fix the path") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise bad("is not a regular file", "give the path of a file holding the DHHC-1:NN:...: key")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise bad(f"is mode {mode:04o}: {'others' if mode & 0o007 else 'its group'} may access it; a key file "
                      "must be private (0600 or 0400), as ssh wants a private key",
                      f"chmod 600 {path}")
        if st.st_uid not in (os.geteuid(), 0):
            raise bad(f"is owned by uid {st.st_uid}, neither the target's user (uid {os.geteuid()}) nor root",
                      f"chown the file to the user that runs the target (chown {os.geteuid()} {path})")
        if st.st_size > KEY_FILE_MAX:
            raise bad(f"is {st.st_size} bytes, more than a key ({KEY_FILE_MAX} at most)",
                      "the file must hold only the DHHC-1:NN:...: key (nvmeof-roce gen-dhchap-key)")
        data = os.read(fd, KEY_FILE_MAX + 1)
    finally:
        os.close(fd)
    try:
        text = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise bad("is not text", "the file must hold only the DHHC-1:NN:...: key") from None
    if not text:
        raise bad("is empty", f"write the key into it: nvmeof-roce gen-dhchap-key ... > {path}")
    return text


def key_file_name(path: str) -> str:
    """How messages name key file `path`: itself, or `LINK (a link to TARGET)` when it goes through a link."""
    real = os.path.realpath(path)
    return path if real == path else f"{path} (a link to {real})"


def secret_text(value: str, ring: Dict[str, str], source: str, where: str) -> Tuple[str, str]:
    """(the DHHC-1 text, where it came from) for a config key value in any of its forms.  The origin is
    "inline", "key file PATH" or "keyring key NAME (PATH)": safe to print."""
    form = kind(value)
    if form == "inline":
        return value, "inline"
    if form == "file":
        return read_key_file(value, source, where), f"key file {key_file_name(value)}"
    if form == "keyring":
        path = ring.get(value)
        if path is None:
            known = ", ".join(sorted(ring)) or "none"
            raise ConfigError(source, where, f"no key {value!r} in the keyring (keys: {known})",
                              f"add it: keyring_file_add_key {{\"name\": \"{value}\", \"path\": ...}} (or "
                              f"{USERSPACE_KEY}.{KEYRING} in the config), or give the key file's path")
        return read_key_file(path, source, where), f"keyring key {value} ({key_file_name(path)})"
    raise ConfigError(source, where, f"is not {_FORMS}", "give one of those (nvmeof-roce gen-dhchap-key makes a key)")


def is_inline(value: Optional[str]) -> bool:
    return isinstance(value, str) and value.startswith(SECRET_PREFIX)


def inline_secret_warnings(config, path: str) -> List[ConfigError]:
    """A warning (as a ConfigError, not raised) for each inline key of a config file its group or others may
    read: `target check` prints them, `target serve` logs them."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return []
    if not mode & 0o044:
        return []
    who = "others" if mode & 0o004 else "its group"
    out = []
    for i, host in enumerate(config.host_entries):
        group = host.attrs.get("dhchap") or {}
        for field in ("key", "ctrl_key"):
            if is_inline(group.get(field)):
                out.append(ConfigError(config.source, f"hosts[{i}].dhchap.{field}",
                                       f"an inline secret in a file {who} may read (mode {mode:04o})",
                                       f"chmod 600 {path}, or put the key in a 0600 file and give its path here "
                                       "(docs/auth.md, key files)"))
    return out
