"""An RBD namespace's settings: the `rbd` object of a namespace's `nvmeof_roce` section, with the names of rbd's
own CLI (`--pool`, `--namespace`, `--image`, `-c/--conf`, `--id`, `--keyring`):

    "nvmeof_roce": {"backend": "rbd",
                    "rbd": {"pool": "rbd", "image": "ns1", "conf": "/etc/ceph/ceph.conf", "id": "admin",
                            "namespace": "", "keyring": "/etc/ceph/ceph.client.admin.keyring",
                            "create": {"size": "1G"}}}

`pool` and `image` are required; `conf` defaults to /etc/ceph/ceph.conf, `id` to admin.  A `keyring` holds the
client's secret: it must be a 0600 file of root's (as every key file of the target).  `create` makes the image
with that size when it does not exist (and only then).  Size, block count and the NGUID come from the image,
not from the config: the namespace's `size` is refused for an rbd namespace.  Checked offline here; what only
the cluster can tell (the pool, the image, the key) is said by `target check` as not checked.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from .errors import ConfigError
from .model import parse_size
from .rados_names import rados_names

DEFAULT_CONF = "/etc/ceph/ceph.conf"
DEFAULT_ID = "admin"
RBD_KEYS = {"pool", "image", "conf", "id", "namespace", "keyring", "create", "native"}

# The native path's client (csrc/be_rbd.c), beside the settings both paths share: librbd dispatches a call in the
# caller's thread (the queue's poll) instead of handing it to its io_context thread first, a thread hop fewer per
# command (docs/rbd.md "Figures"); librbd's dispatch layers queue what must wait (a refresh, the exclusive lock) and
# go on later, so the call does not wait for the cluster.  What could wait in it is librados' own throttle of ops in
# flight (objecter_inflight_ops, objecter_inflight_op_bytes: the caller sleeps until enough complete): off (0), the
# namespace's depth bounds the calls instead (be_rbd.c rbd_start).
NATIVE_RBD_OPTIONS = (("rbd_non_blocking_aio", "false"), ("objecter_inflight_ops", "0"),
                      ("objecter_inflight_op_bytes", "0"))

NAME_LONGEST = 254  # RADOS pool, namespace and image names: what rbd's CLI takes (config/rados_names.py)


@dataclass(frozen=True)
class RbdSettings:
    pool: str
    image: str
    conf: str = DEFAULT_CONF
    client_id: str = DEFAULT_ID
    namespace: str = ""
    keyring: Optional[str] = None
    create_size: Optional[int] = None  # bytes: create the image at this size when it does not exist
    native: bool = True  # the native data path serves it through librbd in C; false: the reference (core) path

    def spec(self) -> str:
        """pool[/namespace]/image, as rbd's CLI names an image."""
        return "/".join(p for p in (self.pool, self.namespace, self.image) if p)

    def to_dict(self) -> dict:
        d = {"pool": self.pool, "image": self.image, "conf": self.conf, "id": self.client_id}
        if self.namespace:
            d["namespace"] = self.namespace
        if self.keyring:
            d["keyring"] = self.keyring
        if self.create_size is not None:
            d["create"] = {"size": self.create_size}
        if not self.native:
            d["native"] = False
        return d


def parse_rbd(value: Any, source: str, where: str) -> RbdSettings:
    """The `rbd` object at `where` (NAMESPACE.nvmeof_roce.rbd) -> RbdSettings, or a ConfigError naming the key."""
    def err(key: str, problem: str, fix: str) -> ConfigError:
        return ConfigError(source, f"{where}.{key}" if key else where, problem, fix)

    example = '"rbd": {"pool": "rbd", "image": "ns1"}'
    if not isinstance(value, dict):
        raise err("", f"must be an object, got {value!r}", f"write it as {example}")
    unknown = sorted(set(value) - RBD_KEYS)
    if unknown:
        raise err(unknown[0], "is not a key of an rbd namespace", f"use {', '.join(sorted(RBD_KEYS))}")
    for key in ("pool", "image"):
        if key not in value:
            raise err(key, "is required", f"write {example}")
    names = rados_names(value, {"pool": None, "image": None, "namespace": "", "id": DEFAULT_ID}, NAME_LONGEST, err,
                        "letters, digits, '_', '.', '+', '-' (as rbd's CLI takes)")
    conf = value.get("conf", DEFAULT_CONF)
    if not isinstance(conf, str) or not os.path.isabs(conf):
        raise err("conf", f"must be an absolute path to a ceph.conf, got {conf!r}", f'e.g. "conf": "{DEFAULT_CONF}"')
    keyring = value.get("keyring")
    if keyring is not None and (not isinstance(keyring, str) or not os.path.isabs(keyring)):
        raise err("keyring", f"must be an absolute path to a keyring file, got {keyring!r}",
                  '"keyring": "/etc/ceph/ceph.client.admin.keyring" (a 0600 file of root\'s)')
    create_size = None
    if "create" in value:
        create = value["create"]
        if not isinstance(create, dict) or set(create) != {"size"}:
            raise err("create", f"must be {{\"size\": SIZE}}, got {create!r}", '"create": {"size": "1G"}')
        try:
            create_size = parse_size(create["size"])
        except ValueError:
            raise err("create.size", f"is not a size: {create['size']!r}", 'use bytes or K/M/G/T, e.g. "1G"') from None
        if create_size <= 0:
            raise err("create.size", "must be more than 0", 'e.g. "1G"')
    native = value.get("native", True)
    if not isinstance(native, bool):
        raise err("native", f"must be true or false, got {native!r}",
                  '"native": false serves it on the reference (core) path; the default, true, on the native data path '
                  'through librbd in C (docs/rbd.md)')
    return RbdSettings(pool=names["pool"], image=names["image"], conf=conf, client_id=names["id"],
                       namespace=names["namespace"], keyring=keyring, create_size=create_size, native=native)


# What `target check` cannot know without the cluster (it never connects to one).
UNCHECKED = ("offline: the cluster, the pool, the image and the client's key are checked when target serve opens it "
             "(a cluster that does not answer then leaves this namespace pending, retried in the background, while "
             "the others serve; a missing image or a refused key stops the start)")


def offline_problems(settings: RbdSettings) -> Tuple[List[Tuple[str, str, str]], str]:
    """What can be checked of an rbd namespace without its cluster: the conf file is readable, a keyring is a
    regular 0600 file of root's.  ([(key, problem, fix)], the note of what was not checked)."""
    problems = []
    if not os.path.isfile(settings.conf) or not os.access(settings.conf, os.R_OK):
        problems.append(("conf", f"{settings.conf} is not a readable file",
                         "give the cluster's ceph.conf (its mon host line is what the client needs)"))
    if settings.keyring:
        try:
            st = os.stat(settings.keyring)
        except OSError as exc:
            problems.append(("keyring", f"{settings.keyring}: {exc.strerror}",
                             f"give client.{settings.client_id}'s keyring file (ceph auth get client."
                             f"{settings.client_id} -o FILE; chmod 600 FILE)"))
        else:
            if not stat.S_ISREG(st.st_mode):
                problems.append(("keyring", f"{settings.keyring} is not a regular file", "give the keyring file"))
            elif st.st_mode & 0o077 or st.st_uid != os.geteuid():
                problems.append(("keyring", f"{settings.keyring} holds a secret but is mode "
                                 f"{stat.S_IMODE(st.st_mode):04o} owned by uid {st.st_uid}",
                                 f"chmod 600 {settings.keyring}; chown {os.geteuid()} {settings.keyring}"))
    return problems, UNCHECKED
