"""The host and key methods: a subsystem's allow-list, a host's DH-HMAC-CHAP keys, the keyring (SPDK's
keyring_file_* methods).  Each edits the running config and applies the difference (control/methods.py
`Control._edit`).  Mixed into control/methods.py's `Control`."""
from __future__ import annotations

from typing import List, Optional

from ...config import USERSPACE_KEY, ConfigError
from ...config import keys
from ...nvme import auth as nvme_auth
from ..protocol import RpcError
from .params import Params


class HostMethods:
    """nvmf_subsystem_add_host, nvmf_subsystem_remove_host, nvmf_subsystem_set_keys, nvmeof_set_host_keys,
    keyring_file_add_key, keyring_file_remove_key, keyring_get_keys."""

    def rpc_nvmf_subsystem_add_host(self, params) -> bool:
        """SPDK's method; dhchap_key / dhchap_ctrlr_key name keyring keys (keyring_file_add_key) as in SPDK, or are
        a key file's path or the secret itself (config/keys.py).  They become the host's keys (hosts[].dhchap)."""
        p = Params("nvmf_subsystem_add_host", params, ("nqn", "host", "psk", "dhchap_key", "dhchap_ctrlr_key"))
        nqn, host = p.str("nqn"), p.str("host")
        keys_given = _dhchap_keys(p)
        if p.has("psk"):
            raise RpcError("psk: TLS is not supported on RDMA", "psk", "leave psk out")
        self._sub(nqn)  # on a subsystem that allows any host, the host is listed for when it stops (as SPDK)

        def edit(d):
            if not any(h["nqn"] == host for h in d["hosts"]):
                d["hosts"].append({"nqn": host})
            if keys_given:
                _set_dhchap_keys(next(h for h in d["hosts"] if h["nqn"] == host), *keys_given)
            s = d["subsystems"][self._subsystem_index(d, nqn)]
            if host in s["allowed_hosts"]:
                raise RpcError(f"host {host} is already allowed on {nqn}", "host", "nothing to do")
            s["allowed_hosts"].append(host)

        self._edit(edit, lambda where: _key_field(where) or ("host" if "hosts" in where else where))
        return True

    def rpc_nvmf_subsystem_remove_host(self, params) -> bool:
        p = Params("nvmf_subsystem_remove_host", params, ("nqn", "host"))
        nqn, host = p.str("nqn"), p.str("host")
        self._sub(nqn)

        def edit(d):
            s = d["subsystems"][self._subsystem_index(d, nqn)]
            if host not in s["allowed_hosts"]:
                raise RpcError(f"host {host} is not on the allow-list of {nqn}", "host",
                               "nvmf_get_subsystems lists the allowed hosts")
            s["allowed_hosts"].remove(host)

        self._edit(edit)
        return True

    def rpc_nvmf_subsystem_set_keys(self, params) -> bool:
        """Set (rotate) or clear a host's DH-HMAC-CHAP keys, SPDK's method: each key a keyring key's name (as
        SPDK), a key file's path, or the secret itself (DHHC-1:NN:...:, `nvmeof-roce gen-dhchap-key`).  The key
        belongs to the host (hosts[].dhchap, as nvmet's hosts/NQN/dhchap_key), so it applies on every subsystem
        the host may use.  New connections and re-authentications use it; connected controllers keep theirs
        until they reconnect.  Without dhchap_key the keys are cleared."""
        p = Params("nvmf_subsystem_set_keys", params, ("nqn", "host", "dhchap_key", "dhchap_ctrlr_key"))
        nqn, host = p.str("nqn"), p.str("host")
        key = p.str("dhchap_key", required=False)
        ctrl_key = p.str("dhchap_ctrlr_key", required=False)
        if ctrl_key and not key:
            raise RpcError("dhchap_ctrlr_key without dhchap_key", "dhchap_ctrlr_key",
                           "give the host key (dhchap_key) too: bidirectional authentication needs both")
        sub = self._sub(nqn)
        if host not in sub.allowed_hosts:
            raise RpcError(f"host {host} is not on the allow-list of {nqn}", "host",
                           f"nvmf_subsystem_add_host with nqn {nqn} and host {host} first")

        def edit(d):
            entry = next(h for h in d["hosts"] if h["nqn"] == host)
            group = dict(entry.get("dhchap") or {})
            group.pop("key", None)
            group.pop("ctrl_key", None)
            if key:
                group["key"] = key
            if ctrl_key:
                group["ctrl_key"] = ctrl_key
            if key:
                entry["dhchap"] = group
            else:
                entry.pop("dhchap", None)

        self._edit(edit, lambda where: {"dhchap.key": "dhchap_key", "dhchap.ctrl_key": "dhchap_ctrlr_key"}.get(
            where.split("]", 1)[1].lstrip(".") if where.startswith("hosts[") else where, where))
        return True

    def rpc_nvmeof_set_host_keys(self, params) -> bool:
        """A host's DH-HMAC-CHAP settings (hosts[].dhchap; nvmet's hosts/NQN/dhchap_*): the secrets themselves
        (DHHC-1:NN:...:), a key file's path or a keyring key's name.  No dhchap_key clears them: the host connects
        unauthenticated."""
        p = Params("nvmeof_set_host_keys", params, ("host", "dhchap_key", "dhchap_ctrlr_key", "dhchap_hash",
                                                      "dhchap_dhgroup"))
        host = p.str("host")
        group = {}
        for name, key in (("dhchap_key", "key"), ("dhchap_ctrlr_key", "ctrl_key"), ("dhchap_hash", "hash"),
                          ("dhchap_dhgroup", "dhgroup")):
            if p.p.get(name):  # "" is "not set", as blktests passes an empty key
                group[key] = p.str(name)

        def edit(d):
            entry = next((h for h in d["hosts"] if h["nqn"] == host), None)
            if entry is None:
                if not group:
                    return
                entry = {"nqn": host}
                d["hosts"].append(entry)
            if group:
                entry["dhchap"] = group
            else:
                entry.pop("dhchap", None)

        self._edit(edit, lambda where: {"key": "dhchap_key", "ctrl_key": "dhchap_ctrlr_key", "hash": "dhchap_hash",
                                        "dhgroup": "dhchap_dhgroup"}.get(where.rsplit(".", 1)[-1], "host"))
        return True

    # -- the keyring: SPDK's keyring_file_* methods.  A key is a name for a 0600 key file; the keyring lives in the
    # config (nvmeof_roce.keyring: name -> path), so save_config and --persist keep it, and hosts[].dhchap names
    # its keys (nvmf_subsystem_add_host / nvmf_subsystem_set_keys with dhchap_key: NAME).  The files are read at
    # each load of the config: replace a key's file and reload to rotate it.
    def rpc_keyring_file_add_key(self, params) -> bool:
        p = Params("keyring_file_add_key", params, ("name", "path"))
        name, path = p.str("name"), p.str("path")
        if not keys.KEY_NAME_RE.match(name):
            raise RpcError("name is not a key name: 1..64 letters, digits, '.', '_' or '-', starting with a letter "
                           "or digit", "name", "pick a name such as key0 or host1-key")
        if name in keys.keyring_of(self.target.config):
            raise RpcError(f"key {name!r} already exists", "name",
                           "pick another name, or keyring_file_remove_key it first")
        try:  # as SPDK: an absolute path to a file only its owner may read; and it must hold a DH-HMAC-CHAP key
            text = keys.read_key_file(path, self.target.config.source, "path")
            nvme_auth.parse_secret(text)
        except ConfigError as exc:
            raise RpcError(exc.problem, "path", exc.fix) from None
        except nvme_auth.SecretError as exc:
            raise RpcError(f"key file {path}: {exc}", "path", "the file must hold the whole DHHC-1:NN:...: key "
                           "(nvmeof-roce gen-dhchap-key ... > FILE)") from None

        def edit(d):
            d.setdefault(USERSPACE_KEY, {}).setdefault(keys.KEYRING, {})[name] = path

        self._edit(edit)
        return True

    def rpc_keyring_file_remove_key(self, params) -> bool:
        """Remove a key from the keyring; refused while a host's keys name it (SPDK would leave such a host
        unable to authenticate)."""
        p = Params("keyring_file_remove_key", params, ("name",))
        name = p.str("name")
        if name not in keys.keyring_of(self.target.config):
            raise RpcError(f"no key {name!r} in the keyring", "name", "keyring_get_keys lists the keys")
        users = _key_users(self.target.config, name)
        if users:
            raise RpcError(f"key {name!r} is in use by host {', '.join(users)}", "name",
                           "give the host another key first (nvmf_subsystem_set_keys), or remove the host")

        def edit(d):
            ring = d[USERSPACE_KEY][keys.KEYRING]
            del ring[name]
            if not ring:
                del d[USERSPACE_KEY][keys.KEYRING]
            if not d[USERSPACE_KEY]:
                del d[USERSPACE_KEY]

        self._edit(edit)
        return True

    def rpc_keyring_get_keys(self, params) -> List[dict]:
        """The keys as SPDK lists them (name, module, removed, probed, refcnt, path): never their contents.
        refcnt is 1 (the keyring) plus the host keys that name it."""
        Params("keyring_get_keys", params, ())
        return [{"name": name, "module": "keyring_file", "removed": False, "probed": False,
                 "refcnt": 1 + len(_key_users(self.target.config, name)), "path": path}
                for name, path in sorted(keys.keyring_of(self.target.config).items())]


def _dhchap_keys(p: Params) -> Optional[tuple]:
    """(dhchap_key, dhchap_ctrlr_key) of a method that takes them, or None; each a keyring key's name, a key file's
    path or the secret (config/keys.py checks which when the config is applied)."""
    key = p.str("dhchap_key", required=False)
    ctrl_key = p.str("dhchap_ctrlr_key", required=False)
    if ctrl_key and not key:
        raise RpcError("dhchap_ctrlr_key without dhchap_key", "dhchap_ctrlr_key",
                       "give the host key (dhchap_key) too: bidirectional authentication needs both")
    return (key, ctrl_key) if key else None

def _set_dhchap_keys(entry: dict, key: str, ctrl_key: str) -> None:
    group = dict(entry.get("dhchap") or {})
    group.pop("ctrl_key", None)
    group["key"] = key
    if ctrl_key:
        group["ctrl_key"] = ctrl_key
    entry["dhchap"] = group

def _key_field(where: str) -> str:
    """The RPC parameter of a config error on a host's key, or ''."""
    tail = where.split("]", 1)[1].lstrip(".") if where.startswith("hosts[") else ""
    return {"dhchap.key": "dhchap_key", "dhchap.ctrl_key": "dhchap_ctrlr_key"}.get(tail, "")

def _key_users(config, name: str) -> List[str]:
    """The hosts whose key or controller key is keyring key `name`."""
    return [h.nqn for h in config.host_entries
            if name in ((h.attrs.get("dhchap") or {}).get("key"), (h.attrs.get("dhchap") or {}).get("ctrl_key"))]
