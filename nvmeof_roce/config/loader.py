"""The target config's loader: a JSON file or dict into the model (`load_config`, `parse_config`), with every
problem of every host, subsystem and port reported at once, each naming its JSON path (`ConfigError`).

The file is read with bounds (size, nesting) before it is parsed; the `*_collect` forms give the config that
parsed together with the problems, for `target check` to list them all."""
import copy
import importlib
import ipaddress
import json
import os
import re
import stat
from typing import Any, List, Optional

from ..transport.registry import fabric
from .. import shipped
from ..tunables import QID_MAX, TARGET_SETTINGS
from .errors import ConfigError, raise_all
from .keys import KEYRING, check_keyring
from .group import GROUP_KEY, parse_group
from .backends import KINDS, kind_of, names as backend_names
from .model import (ADRFAMS, ANA_GRPID_MAX, ANA_STATES, BLOCK_SIZES, CNTLID_MAX, DEFAULT_MODEL, DEFAULT_TRTYPE,
                    DEFAULT_TRSVCID, DISCOVERY_NQN, MAX_BLOCKS, MAX_INLINE_DATA_SIZE, NSID_MAX, NS_IO_ENGINES,
                    NS_QUEUE_DEPTHS, PORTID_MAX, QOS_LIMITS, QOS_MAX, TREQS, TRTYPES, USERSPACE_KEY, UUID_RE,
                    WORKER_KEYS, AnaGroupConfig, HostConfig, NamespaceConfig, PortConfig, ReferralConfig,
                    SubsystemConfig, TargetConfig, namespace_uuid, parse_flag, parse_size, subsystem_serial,
                    validate_host_nqn, validate_nqn, validate_subsystem_nqn)


class _Ctx:
    """Where we are while parsing: the file name and the field path."""

    def __init__(self, source: str):
        self.source = source

    def err(self, where: str, problem: str, fix: str = "") -> ConfigError:
        return ConfigError(self.source, where, problem, fix)

    def dict_at(self, value: Any, where: str, optional=True) -> dict:
        if value is None and optional:
            return {}
        if not isinstance(value, dict):
            raise self.err(where or "(top level)", f"must be an object, got {type(value).__name__} {value!r}",
                           "write it as a JSON object {...} (see the examples in "
                           f"{shipped('targets')})")
        return value

    def list_at(self, value: Any, where: str) -> list:
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.err(where, f"must be a list, got {type(value).__name__} {value!r}",
                           "write it as a JSON list [...] (see the examples in "
                           f"{shipped('targets')})")
        return value

    def int_at(self, value: Any, where: str, lo: int, hi: int, hexrange=False) -> int:
        rng = f"{lo}..{hi:#X}".replace("0X", "0x") if hexrange else f"{lo}..{hi}"
        try:
            if isinstance(value, bool):
                raise ValueError
            n = value if isinstance(value, int) else int(str(value), 0)
        except (TypeError, ValueError):
            raise self.err(where, f"must be an integer {rng}, got {value!r}", f"give an integer in {rng}") from None
        if not lo <= n <= hi:
            raise self.err(where, f"must be {rng}, got {value!r}", f"give an integer in {rng}")
        return n

    def flag_at(self, value: Any, where: str) -> bool:
        f = parse_flag(value)
        if f is None:
            raise self.err(where, f"must be 0 or 1 (or true/false), got {value!r}", "use 1 to turn it on, 0 to turn it off")
        return f

    def str_at(self, value: Any, where: str) -> str:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise self.err(where, f"must be a string, got {type(value).__name__} {value!r}", "write it as a JSON string")
        return str(value)

    def unknown(self, d: dict, known, where: str) -> None:
        """Every key of `d` not in `known`, each its own problem."""
        raise_all([self.err(f"{where}.{k}" if where else k, "unknown key",
                            f"remove it; known keys here: {', '.join(sorted(known))}") for k in d if k not in known])


class _Problems:
    """The problems of one object (a host, subsystem or port), all of them: `soft(fn, ...)` runs one check and
    records its problem instead of stopping; `done()` raises them together, if any."""

    def __init__(self):
        self.errors: List[ConfigError] = []

    def add(self, exc: ConfigError) -> None:
        self.errors.extend(exc.every())

    def soft(self, fn, *args, default=None):
        try:
            return fn(*args)
        except ConfigError as exc:
            self.add(exc)
            return default

    def fatal(self, exc: ConfigError):
        """A problem after which the object cannot be checked further: raise it with those found so far."""
        self.add(exc)
        raise_all(self.errors)

    def done(self) -> None:
        raise_all(self.errors)




# --------------------------------------------------------------------------- parsing

_TOP_KEYS = {"hosts", "ports", "subsystems", "discovery", USERSPACE_KEY}
_PORT_KEYS = {"portid", "addr", "param", "subsystems", "referrals", "ana_groups", USERSPACE_KEY}
_ADDR_KEYS = {"trtype", "adrfam", "traddr", "trsvcid", "treq", "tsas", "portid"}
_SUBSYS_KEYS = {"nqn", "attr", "allowed_hosts", "namespaces", "passthru", USERSPACE_KEY}
_SUBSYS_FLAGS = {"allow_any_host", "pi_enable"}  # attr values taken as a JSON boolean or nvmetcli's "1"/"0"
_PORT_FLAGS = {"pi_enable"}  # the same for a port's param
_NS_KEYS = {"nsid", "enable", "device", "ana_grpid", "ana", "resv", "buffered_io", "p2pmem",
            "revalidate_size", USERSPACE_KEY}
_DEVICE_KEYS = {"path", "uuid", "nguid", "eui64"}
_NS_US_KEYS = {"backend", "size", "block_size", "queue_depth", "io_engine", "visible_hosts", "qos"}
_HOST_KEYS = {"nqn", "dhchap"}  # auth15: dhchap is honoured by both targets (userspace: engine/auth.py)


def load_config(path) -> TargetConfig:
    """Read and validate a target config file (every problem reported at once)."""
    cfg, errors = load_config_collect(path)
    raise_all(errors)
    return cfg


def load_config_collect(path):
    """(config or None, errors) for a config file."""
    try:
        data = _read_json(path)
    except ConfigError as exc:
        return None, [exc]
    return parse_config_collect(data, str(path))


# Bounds of a config document: a config nvmetcli writes is 6 levels deep; a large one (64 subsystems of 1024
# namespaces) is ~15 MB.  Beyond them a document is refused before it is parsed further (docs/security.md).
MAX_CONFIG_BYTES = 32 << 20
MAX_CONFIG_DEPTH = 32


def _read_json(path):
    """The JSON document of a config file, or ConfigError naming what is wrong with the file itself."""
    source = str(path)
    fix_path = (f"check the path; example configs are in {shipped('targets')} "
                "(nvmeof-roce nvmet save FILE writes the kernel's current config)")
    try:
        # O_NONBLOCK: a FIFO or a device node in the config's place must not block a running target's reload
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(source, "", "no such file", fix_path) from None
    except PermissionError:
        raise ConfigError(source, "", "permission denied reading the file",
                          "run as a user who can read it (or as root)") from None
    except ValueError:  # a NUL byte in the path
        raise ConfigError(source, "", "the path contains a NUL byte", "give the path of a .json file") from None
    except OSError as exc:  # ENOTDIR, ELOOP, ENAMETOOLONG, EIO...
        raise ConfigError(source, "", f"cannot open the file: {exc.strerror}", fix_path) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ConfigError(source, "", "is a directory, not a config file", "give the path of a .json file")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(source, "", "is not a regular file (a FIFO, socket or device)",
                              "give the path of a .json file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(source, "", f"is {st.st_size} bytes, more than the {MAX_CONFIG_BYTES} bytes a config "
                              "may have", "check that this is the config file (a config is a few KB)")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(source, "", f"cannot read the file: {exc.strerror}", fix_path) from None
    finally:
        os.close(fd)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(source, "", f"is more than the {MAX_CONFIG_BYTES} bytes a config may have",
                          "check that this is the config file (a config is a few KB)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(source, f"line {line} byte {exc.start}", "is not valid UTF-8 text",
                          "save the file as UTF-8 (JSON is UTF-8)") from None
    return parse_json_text(text, source)


class _DuplicateKey(Exception):
    """A JSON object with a key twice (json.loads would keep the last silently); located afterwards."""


def _refuse_duplicate_keys(pairs):
    """json's object_pairs_hook: the object as a dict, unless one of its keys appears twice."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise _DuplicateKey()
    return obj


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def find_duplicate_key(text: str):
    """(JSON path of the key, line of its first and second appearance) of the first key that appears twice in
    one object of `text`, a valid JSON document; None if there is none.  The path is the loader's
    (`subsystems[0].namespaces[1].nsid`)."""
    from json.decoder import scanstring
    scan = json.JSONDecoder().scan_once

    def space(pos):
        return _JSON_SPACE.match(text, pos).end()

    def line(pos):
        return text.count("\n", 0, pos) + 1

    def value(pos, path):  # the position after the value at `pos`; a duplicate found is returned as a tuple
        if text[pos] == "{":
            seen = {}
            pos = space(pos + 1)
            if text[pos] == "}":
                return pos + 1
            while True:
                key, after = scanstring(text, pos + 1)
                where = f"{path}.{key}" if path else key
                if key in seen:
                    return where, seen[key], line(pos)
                seen[key] = line(pos)
                end = value(space(space(after) + 1), where)  # past the ':'
                if isinstance(end, tuple):
                    return end
                pos = space(end)
                if text[pos] == "}":
                    return pos + 1
                pos = space(pos + 1)  # past the ','
        if text[pos] == "[":
            pos, index = space(pos + 1), 0
            if text[pos] == "]":
                return pos + 1
            while True:
                end = value(pos, f"{path}[{index}]")
                if isinstance(end, tuple):
                    return end
                pos, index = space(end), index + 1
                if text[pos] == "]":
                    return pos + 1
                pos = space(pos + 1)
        return scan(text, pos)[1]

    found = value(space(0), "")
    return found if isinstance(found, tuple) else None


def parse_json_text(text: str, source: str):
    """A JSON document from text, with its nesting bounded and no key twice in an object: ConfigError naming the
    line (and for a duplicate key its path) for anything else."""
    try:
        data = _decode(text, source, _refuse_duplicate_keys)
    except _DuplicateKey:
        _decode(text, source)  # a syntax error further on is reported first, as such
        try:
            where, first, second = find_duplicate_key(text)
        except (TypeError, ValueError, RecursionError):  # not found where json found it: say what is known
            raise ConfigError(source, "", "a key appears twice in one object (JSON would keep the last "
                              "silently)", "keep one of them") from None
        raise ConfigError(source, where, f"appears twice in its object, on lines {first} and {second} (JSON "
                          "would keep the last silently)",
                          f"keep one of them: delete line {first} or line {second}, after merging what they "
                          "say") from None
    check_depth(data, source)
    return data


def _decode(text: str, source: str, object_pairs_hook=None):
    try:
        return json.loads(text, object_pairs_hook=object_pairs_hook)
    except json.JSONDecodeError as exc:
        raise ConfigError(source, f"line {exc.lineno} column {exc.colno}", f"invalid JSON: {exc.msg}",
                          "fix the JSON syntax (python3 -m json.tool FILE shows the error)") from None
    except RecursionError:
        raise ConfigError(source, "", f"invalid JSON: nested more than {MAX_CONFIG_DEPTH} levels deep",
                          "a config is a few levels deep: check the file's brackets") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ConfigError(source, "", f"invalid JSON: {exc}", "fix the value") from None


def check_depth(data: Any, source: str, limit: int = MAX_CONFIG_DEPTH) -> None:
    """ConfigError if `data` nests lists and objects more than `limit` levels deep (checked without
    recursion, so that no later step recurses too deep on it)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            raise ConfigError(source, "", f"nested more than {limit} levels deep",
                              "a config is a few levels deep: check the file's brackets")
        stack.extend((child, depth + 1) for child in children)


def parse_config(data: dict, source: str = "<config>") -> TargetConfig:
    """Validate a config dict (nvmetcli's shape, plus "nvmeof_roce" keys) into a TargetConfig.
    Every problem found is reported (ConfigErrors when there are several)."""
    cfg, errors = parse_config_collect(data, source)
    raise_all(errors)
    return cfg


def parse_config_collect(data: dict, source: str = "<config>"):
    """(config, errors): parse everything that parses and collect every problem of each host, subsystem and
    port (a problem that makes the rest of an object unreadable, such as a missing NQN, ends that object)."""
    ctx = _Ctx(source)
    errors: List[ConfigError] = []
    try:
        data = ctx.dict_at(data, "", optional=False) if data is not None else {}
    except ConfigError as exc:
        return TargetConfig(source=source), [exc]
    cfg = TargetConfig(source=source, raw=copy.deepcopy(data))

    def attempt(fn, *args):
        try:
            return fn(*args)
        except ConfigError as exc:
            errors.extend(exc.every())  # every problem of that object
            return None

    attempt(ctx.unknown, data, _TOP_KEYS, "")
    attempt(_check_discovery, ctx, data.get("discovery"))
    cfg.userspace = attempt(ctx.dict_at, data.get(USERSPACE_KEY), USERSPACE_KEY) or {}
    attempt(ctx.unknown, cfg.userspace, set(TARGET_SETTINGS) | WORKER_KEYS | {KEYRING, GROUP_KEY}, USERSPACE_KEY)
    if KEYRING in cfg.userspace:
        attempt(check_keyring, cfg.userspace[KEYRING], source)
    if GROUP_KEY in cfg.userspace:  # a gateway of a group (docs/gateway-group.md)
        cfg.group = attempt(parse_group, cfg.userspace[GROUP_KEY], source)
    for name, setting in TARGET_SETTINGS.items():
        if name in cfg.userspace:
            value = attempt(ctx.int_at, cfg.userspace[name], f"{USERSPACE_KEY}.{name}", setting.low, setting.high)
            if value is not None:
                setattr(cfg.settings, name, value)

    # hosts
    seen = {}
    for i, h in enumerate(attempt(ctx.list_at, data.get("hosts"), "hosts") or []):
        host = attempt(_parse_host, ctx, h, f"hosts[{i}]", seen)
        if host is not None:
            cfg.host_entries.append(host)
    cfg.hosts = [h.nqn for h in cfg.host_entries]
    # a host that failed to parse must not make every subsystem naming it fail too
    named_hosts = set(cfg.hosts) | {h.get("nqn") if isinstance(h, dict) else h
                                    for h in (data.get("hosts") or [])
                                    if isinstance(h, str) or isinstance(h, dict) and isinstance(h.get("nqn"), str)} \
        if isinstance(data.get("hosts") or [], list) else set()

    # subsystems
    seen = {}
    for i, s in enumerate(attempt(ctx.list_at, data.get("subsystems"), "subsystems") or []):
        sub = attempt(_parse_subsystem, ctx, s, f"subsystems[{i}]", named_hosts, errors)
        if sub is None:
            continue
        if sub.nqn in seen:
            errors.append(ctx.err(f"subsystems[{i}].nqn",
                                  f"duplicate subsystem {sub.nqn!r} (also subsystems[{seen[sub.nqn]}])",
                                  "give each subsystem its own NQN"))
            continue
        seen[sub.nqn] = i
        cfg.subsystems.append(sub)
    raw_subsystems = data.get("subsystems")
    named_subsystems = None if raw_subsystems is not None and not isinstance(raw_subsystems, list) else (
        {s.nqn for s in cfg.subsystems} | {
            s.get("nqn") for s in (raw_subsystems or []) if isinstance(s, dict) and isinstance(s.get("nqn"), str)})

    # ports
    seen = {}
    endpoints = {}
    for i, p in enumerate(attempt(ctx.list_at, data.get("ports"), "ports") or []):
        port = attempt(_parse_port, ctx, p, f"ports[{i}]", named_subsystems)
        if port is None:
            continue
        if port.portid in seen:
            errors.append(ctx.err(f"ports[{i}].portid",
                                  f"duplicate portid {port.portid} (also ports[{seen[port.portid]}])",
                                  "give each port its own portid"))
            continue
        seen[port.portid] = i
        if _ip_service(port.trtype):
            ep = (port.trtype, port.traddr, port.trsvcid)
            if ep in endpoints:
                errors.append(ctx.err(f"ports[{i}].addr", f"{port.trtype} {port.traddr}:{port.trsvcid} is already "
                                      f"used by ports[{endpoints[ep]}]",
                                      "use another trsvcid (e.g. 4421) or list the subsystems on the one port"))
                continue
            endpoints[ep] = i
        cfg.ports.append(port)
    return cfg, errors


def _parse_host(ctx: "_Ctx", h: Any, where: str, seen: dict) -> HostConfig:
    if isinstance(h, str):
        h = {"nqn": h}
    h = ctx.dict_at(h, where, optional=False)
    problems = _Problems()
    problems.soft(ctx.unknown, h, _HOST_KEYS, where)
    if "nqn" not in h:
        problems.fatal(ctx.err(where, "missing 'nqn'", 'add "nqn": HOSTNQN (nvme gen-hostnqn makes one)'))
    nqn = problems.soft(validate_host_nqn, h["nqn"], ctx.source, f"{where}.nqn")
    if nqn is None:
        problems.done()
    if nqn in seen:
        problems.fatal(ctx.err(f"{where}.nqn", f"duplicate host {nqn!r} (also {seen[nqn]})", "list each host once"))
    seen[nqn] = where
    attrs = {k: problems.soft(ctx.dict_at, v, f"{where}.{k}", default={}) for k, v in h.items() if k != "nqn"}
    problems.done()
    return HostConfig(nqn=nqn, attrs=attrs)


def _check_discovery(ctx: "_Ctx", d: Any) -> None:
    """The top-level "discovery" group nvmetcli saves from kernels 6.7+ (the discovery subsystem's NQN)."""
    d = ctx.dict_at(d, "discovery")
    ctx.unknown(d, {"nqn"}, "discovery")
    if "nqn" in d:
        validate_nqn(d["nqn"], ctx.source, "discovery.nqn")


def _parse_subsystem(ctx: _Ctx, s: Any, where: str, hosts: set, errors: Optional[list] = None) -> SubsystemConfig:
    s = ctx.dict_at(s, where, optional=False)
    problems = _Problems()
    problems.soft(ctx.unknown, s, _SUBSYS_KEYS, where)
    if "nqn" not in s:
        problems.fatal(ctx.err(where, "missing 'nqn'", 'add "nqn": "nqn.2014-08.org.example:name"'))
    nqn = problems.soft(validate_subsystem_nqn, s["nqn"], ctx.source, f"{where}.nqn")
    if nqn is None:
        problems.done()
    if nqn == DISCOVERY_NQN:
        problems.fatal(ctx.err(f"{where}.nqn", "is the discovery NQN; the target provides that subsystem itself",
                               "use another NQN for a storage subsystem"))
    attr = problems.soft(ctx.dict_at, s.get("attr"), f"{where}.attr", default={})
    attrs = {}
    for k, v in attr.items():
        if k in _SUBSYS_FLAGS and isinstance(v, bool):  # a JSON boolean, as nvmetcli's "1"/"0" (flag_at below)
            v = "1" if v else "0"
        value = problems.soft(ctx.str_at, v, f"{where}.attr.{k}")
        if value is not None:
            attrs[k] = value

    allowed = []
    for j, h in enumerate(problems.soft(ctx.list_at, s.get("allowed_hosts"), f"{where}.allowed_hosts", default=[])):
        hw = f"{where}.allowed_hosts[{j}]"
        if problems.soft(validate_host_nqn, h, ctx.source, hw) is None:
            continue
        if h not in hosts:
            problems.add(ctx.err(hw, f"host {h!r} is not in the top-level 'hosts' list",
                                 f'add {{"nqn": "{h}"}} to "hosts"'))
        elif h in allowed:
            problems.add(ctx.err(hw, f"host {h!r} is listed twice", "list each allowed host once"))
        else:
            allowed.append(h)

    if "allow_any_host" in attr:
        # 1 with an allow-list: any host connects and the list waits for allow_any_host 0, as in SPDK
        # (nvmf_subsystem_add_host on an open subsystem); the kernel refuses it (kernel/apply.py kernel_dict)
        allow_any = problems.soft(ctx.flag_at, attr["allow_any_host"], f"{where}.attr.allow_any_host",
                                  default=not allowed)
    else:
        # No explicit choice: a subsystem without an allow-list is open, one with a list is closed.
        allow_any = not allowed

    serial = attrs.get("serial") or subsystem_serial(nqn)
    if len(serial) > 20 or not all(0x20 <= ord(c) < 0x7F for c in serial):
        problems.add(ctx.err(f"{where}.attr.serial", f"must be 1..20 printable ASCII characters, got {serial!r}",
                             "shorten it, or leave it out to get a stable serial derived from the NQN"))
    model = attrs.get("model") or DEFAULT_MODEL
    if len(model) > 40 or not all(0x20 <= ord(c) < 0x7F for c in model):
        problems.add(ctx.err(f"{where}.attr.model", f"must be 1..40 printable ASCII characters, got {model!r}",
                             "shorten it"))
    if "version" in attrs:
        if not re.match(r"^\d+\.\d+(\.\d+)?$", attrs["version"]):
            problems.add(ctx.err(f"{where}.attr.version", f"must look like 1.3 or 2.0.0, got {attrs['version']!r}",
                                 "use MAJOR.MINOR[.TERTIARY]"))
        else:
            # the VS register and Identify Controller VER: MJR 16 bits, MNR 8, TER 8 (NVMe Base 2.0 §3.1.4.2)
            parts = [int(p) for p in attrs["version"].split(".")] + [0]
            if not (1 <= parts[0] <= 0xFFFF and parts[1] <= 0xFF and parts[2] <= 0xFF):
                problems.add(ctx.err(f"{where}.attr.version", f"{attrs['version']!r} does not fit the VS register "
                                     "(major 1..65535, minor and tertiary 0..255)",
                                     "use an NVMe version such as 1.3 or 2.0"))
    # nvmet's attr_firmware: the Firmware Revision of Identify Controller, 1..8 printable characters
    if "firmware" in attrs and not (1 <= len(attrs["firmware"]) <= 8
                                    and all(0x20 <= ord(c) < 0x7F for c in attrs["firmware"])):
        problems.add(ctx.err(f"{where}.attr.firmware",
                             f"must be 1..8 printable ASCII characters, got {attrs['firmware']!r}",
                             'give a firmware revision such as "1.0"'))
    # nvmet's attr_ieee_oui: the IEEE OUI of Identify Controller, 24 bits (decimal or 0x hex, as kstrtou32)
    if "ieee_oui" in attrs:
        problems.soft(ctx.int_at, attrs["ieee_oui"], f"{where}.attr.ieee_oui", 0, 0xFFFFFF, True)
    cmin = cmax = None
    if "cntlid_min" in attrs:
        cmin = problems.soft(ctx.int_at, attrs["cntlid_min"], f"{where}.attr.cntlid_min", 1, CNTLID_MAX, True)
    if "cntlid_max" in attrs:
        cmax = problems.soft(ctx.int_at, attrs["cntlid_max"], f"{where}.attr.cntlid_max", 1, CNTLID_MAX, True)
    if (cmin or 1) > (cmax or CNTLID_MAX):
        problems.add(ctx.err(f"{where}.attr.cntlid_min", f"{cmin} is above cntlid_max {cmax or CNTLID_MAX}",
                             "make cntlid_min <= cntlid_max"))
    for flagname in ("pi_enable",):
        if flagname in attrs:
            problems.soft(ctx.flag_at, attrs[flagname], f"{where}.attr.{flagname}")
    if "qid_max" in attrs:
        problems.soft(ctx.int_at, attrs["qid_max"], f"{where}.attr.qid_max", QID_MAX.low, QID_MAX.high)
    attrs.pop("allow_any_host", None)
    attrs.pop("serial", None)
    attrs.pop("model", None)
    userspace = problems.soft(ctx.dict_at, s.get(USERSPACE_KEY), f"{where}.{USERSPACE_KEY}", default={})
    if errors is None:
        problems.done()

    sub = SubsystemConfig(nqn=nqn, allow_any_host=allow_any, allowed_hosts=allowed, serial=serial,
                          model=model, attrs=attrs, userspace=userspace, raw=copy.deepcopy(s))
    seen = {}
    for j, n in enumerate(ctx.list_at(s.get("namespaces"), f"{where}.namespaces")):
        try:
            ns = _parse_namespace(ctx, n, f"{where}.namespaces[{j}]", nqn)
            if ns.nsid in seen:
                raise ctx.err(f"{where}.namespaces[{j}].nsid",
                              f"duplicate nsid {ns.nsid} (also namespaces[{seen[ns.nsid]}])",
                              "give each namespace of a subsystem its own nsid")
        except ConfigError as exc:
            if errors is None:
                raise
            errors.extend(exc.every())  # the other namespaces are still checked
            continue
        seen[ns.nsid] = j
        sub.namespaces.append(ns)
    problems.done()  # the subsystem's own problems, after its namespaces were checked too
    return sub


def parse_namespace(data: Any, config: TargetConfig, nqn: str, index: Optional[int] = None) -> NamespaceConfig:
    """One namespace of subsystem `nqn` of the running `config` (an RPC's), parsed with the rules of a file: the
    problem names the place it takes, `subsystems[i].namespaces[j]` (j: `index` for a namespace that replaces
    one, else after the last).  A new namespace's NSID must be free in the subsystem."""
    i, sub = next((i, s) for i, s in enumerate(config.subsystems) if s.nqn == nqn)
    j = len(sub.namespaces) if index is None else index
    where = f"subsystems[{i}].namespaces[{j}]"
    ctx = _Ctx(config.source)
    ns = _parse_namespace(ctx, data, where, nqn)
    for k, other in enumerate(sub.namespaces):
        if k != j and other.nsid == ns.nsid:
            raise ctx.err(f"{where}.nsid", f"duplicate nsid {ns.nsid} (also namespaces[{k}])",
                          "give each namespace of a subsystem its own nsid")
    return ns


def _parse_namespace(ctx: _Ctx, n: Any, where: str, subsys_nqn: str) -> NamespaceConfig:
    n = ctx.dict_at(n, where, optional=False)
    ctx.unknown(n, _NS_KEYS, where)
    if "nsid" not in n:
        raise ctx.err(where, "missing 'nsid'", f'add "nsid": 1 (1..0x{NSID_MAX:X})')
    nsid = ctx.int_at(n["nsid"], f"{where}.nsid", 1, NSID_MAX, hexrange=True)
    enabled = ctx.flag_at(n.get("enable", 1), f"{where}.enable")
    dev = ctx.dict_at(n.get("device"), f"{where}.device")
    ctx.unknown(dev, _DEVICE_KEYS, f"{where}.device")
    us = ctx.dict_at(n.get(USERSPACE_KEY), f"{where}.{USERSPACE_KEY}")
    backend = us.get("backend", "file")
    kind = kind_of(backend) if isinstance(backend, str) else None
    ctx.unknown(us, _NS_US_KEYS | ({kind.settings_key} if kind and kind.settings_key else set()),
                f"{where}.{USERSPACE_KEY}")
    if kind is None:
        raise ctx.err(f"{where}.{USERSPACE_KEY}.backend", f"must be one of {', '.join(backend_names())}, got "
                      f"{backend!r}", "; ".join(k.describe() for k in KINDS.values()))
    backend_settings = None
    if kind.settings_key:
        sk = f"{where}.{USERSPACE_KEY}.{kind.settings_key}"
        if kind.settings_key not in us:
            raise ctx.err(sk, f"is required for a {backend} namespace", kind.summary)
        module, _, function = kind.settings_parser.partition(":")
        backend_settings = getattr(importlib.import_module(module), function)(us[kind.settings_key], ctx.source, sk)
    if kind.sized_by_storage and "size" in us:
        raise ctx.err(f"{where}.{USERSPACE_KEY}.size", f"is not for a {backend} namespace: its size is its "
                      "storage's", "remove size (resize the storage, or the namespace by RPC)")
    block_size = 512
    if "block_size" in us:
        bw = f"{where}.{USERSPACE_KEY}.block_size"
        block_size = ctx.int_at(us["block_size"], bw, 1, 1 << 20)
        if block_size not in BLOCK_SIZES:
            raise ctx.err(bw, f"must be 512 or 4096, got {us['block_size']!r}", "use 512 or 4096")
    size = None
    if "size" in us:
        sw = f"{where}.{USERSPACE_KEY}.size"
        try:
            size = parse_size(us["size"])
        except ValueError:
            raise ctx.err(sw, f"is not a size: {us['size']!r}", 'use bytes or K/M/G/T, e.g. "64M" or "1G"') from None
        if size == 0:
            raise ctx.err(sw, "must be more than 0", 'give a size such as "64M"')
        if size % block_size:
            raise ctx.err(sw, f"{size} bytes is not a multiple of the block size {block_size}",
                          f"round it to a multiple of {block_size}")
        if size // block_size > MAX_BLOCKS:
            raise ctx.err(sw, f"{us['size']!r} is {size // block_size} blocks of {block_size} bytes, more than "
                          f"the 64-bit block count (NSZE) can hold",
                          f"give at most {MAX_BLOCKS * block_size >> 50}P")

    queue_depth = None
    if "queue_depth" in us:
        qw = f"{where}.{USERSPACE_KEY}.queue_depth"
        if not kind.engine:
            raise ctx.err(qw, f"is for file and block namespaces, not {backend!r} ones (served inline)",
                          "remove queue_depth")
        queue_depth = ctx.int_at(us["queue_depth"], qw, *NS_QUEUE_DEPTHS)
    io_engine = None
    if "io_engine" in us:
        ew = f"{where}.{USERSPACE_KEY}.io_engine"
        if not kind.engine:
            raise ctx.err(ew, f"is for file and block namespaces, not {backend!r} ones (served inline)",
                          "remove io_engine")
        io_engine = us["io_engine"]
        if io_engine not in NS_IO_ENGINES:
            raise ctx.err(ew, f"must be one of {', '.join(NS_IO_ENGINES)}, got {io_engine!r}",
                          "use \"io_uring\" or \"threads\", or leave it out: io_uring where it works, else threads")

    path = dev.get("path")
    if path is not None:
        path = ctx.str_at(path, f"{where}.device.path")
    if not kind.path:
        if size is None and not kind.sized_by_storage:
            raise ctx.err(f"{where}.{USERSPACE_KEY}.size", f"is required for a {backend} namespace",
                          'add "size": "64M" (bytes or K/M/G/T)')
        if path:
            raise ctx.err(f"{where}.device.path", f"is set but the backend is {backend!r}",
                          'remove device.path, or use "backend": "file"')
    else:
        if not path:
            if us:
                raise ctx.err(f"{where}.device.path", f"is required for a {backend} namespace",
                              'set device.path to a file or block device, or use "backend": "ram" with a "size"')
            raise ctx.err(f"{where}.device.path", "is required (a file or block device)",
                          'set device.path, or add "nvmeof_roce": {"backend": "ram", "size": "64M"} '
                          "for a userspace RAM namespace")
        if "\0" in path:
            raise ctx.err(f"{where}.device.path", f"contains a NUL byte: {path!r}",
                          "no file name holds a NUL byte: write the path without it")
        if not path.startswith("/"):
            raise ctx.err(f"{where}.device.path", f"must be an absolute path, got {path!r}",
                          "the kernel resolves paths from /, write the full path")

    uuid = dev.get("uuid")
    if uuid is not None and uuid != "":
        if not isinstance(uuid, str) or not UUID_RE.match(uuid):
            raise ctx.err(f"{where}.device.uuid", f"is not a UUID: {uuid!r}",
                          "use the 8-4-4-4-12 hex form, or leave it out for a stable generated one")
        uuid = uuid.lower()
    else:
        uuid = namespace_uuid(subsys_nqn, nsid)
    nguid = dev.get("nguid")
    if nguid is not None:
        hexd = str(nguid).replace("-", "")
        if not re.fullmatch(r"[0-9a-fA-F]{32}", hexd):
            raise ctx.err(f"{where}.device.nguid", f"must be 32 hex digits (dashes allowed), got {nguid!r}",
                          "use a 16-byte value such as 0123456789abcdef0123456789abcdef")
    eui64 = dev.get("eui64")
    if eui64 is not None:
        hexd = str(eui64).replace("-", "").replace(":", "")
        if not re.fullmatch(r"[0-9a-fA-F]{16}", hexd):
            raise ctx.err(f"{where}.device.eui64", f"must be 16 hex digits, got {eui64!r}",
                          "use an 8-byte value such as 0123456789abcdef")
    visible_hosts = None
    if "visible_hosts" in us:
        vw = f"{where}.{USERSPACE_KEY}.visible_hosts"
        visible_hosts = []
        for k, h in enumerate(ctx.list_at(us["visible_hosts"], vw)):
            host = validate_host_nqn(h, ctx.source, f"{vw}[{k}]")
            if host in visible_hosts:
                raise ctx.err(f"{vw}[{k}]", f"host {host} is listed twice", "list each host once")
            visible_hosts.append(host)
    qos = {}
    if "qos" in us:
        qw = f"{where}.{USERSPACE_KEY}.qos"
        limits = ctx.dict_at(us["qos"], qw, optional=False)
        ctx.unknown(limits, QOS_LIMITS, qw)
        for name, value in limits.items():
            limit = ctx.int_at(value, f"{qw}.{name}", 0, QOS_MAX)
            if limit:
                qos[name] = limit
    grp = n.get("ana_grpid", (n.get("ana") or {}).get("grpid", 1) if isinstance(n.get("ana"), dict) else 1)
    ana_grpid = ctx.int_at(grp, f"{where}.ana_grpid", 1, ANA_GRPID_MAX)
    buffered = None
    if "buffered_io" in n:
        buffered = ctx.flag_at(n["buffered_io"], f"{where}.buffered_io")
    return NamespaceConfig(nsid=nsid, enabled=enabled, backend=backend, path=path if kind.path else None,
                           size_bytes=size, block_size=block_size, uuid=uuid, nguid=nguid, eui64=eui64,
                           ana_grpid=ana_grpid, buffered_io=buffered, queue_depth=queue_depth, io_engine=io_engine,
                           userspace=us, visible_hosts=visible_hosts, qos=qos, backend_settings=backend_settings,
                           raw=copy.deepcopy(n))


def _ip_service(trtype: str) -> bool:
    """A port of this trtype is addressed by IP (or IB GID) address and service number (rdma, tcp)."""
    f = fabric(trtype)
    return f is not None and f.ip_service


def _check_addr(ctx: _Ctx, where: str, trtype: str, adrfam: str, traddr: str, trsvcid: Any, ip_required=True):
    """trtype/adrfam/traddr/trsvcid consistency; returns trsvcid as int (0 if not applicable)."""
    if trtype not in TRTYPES:
        raise ctx.err(f"{where}.trtype", f"must be one of {', '.join(TRTYPES)}, got {trtype!r}",
                      f'NVMe over RoCE uses "{DEFAULT_TRTYPE}"')
    if adrfam not in ADRFAMS:
        raise ctx.err(f"{where}.adrfam", f"must be one of {', '.join(a for a in ADRFAMS if a)}, got {adrfam!r}",
                      'RoCE over IPv4 uses "ipv4"')
    if _ip_service(trtype):
        if adrfam not in fabric(trtype).adrfams:
            raise ctx.err(f"{where}.adrfam", f"{adrfam!r} does not go with trtype {trtype!r}",
                          'use "ipv4" (or "ipv6")')
        if adrfam in ("ipv4", "ipv6"):
            try:
                ip = ipaddress.ip_address(traddr)
            except ValueError:
                raise ctx.err(f"{where}.traddr", f"{traddr!r} is not an {adrfam} address",
                              f"give the {adrfam} address of the RDMA netdev, e.g. 10.99.0.1") from None
            if (adrfam == "ipv4") != (ip.version == 4):
                raise ctx.err(f"{where}.traddr", f"{traddr!r} is an IPv{ip.version} address but adrfam is {adrfam!r}",
                              f'set adrfam to "ipv{ip.version}"')
        try:
            svc = int(str(trsvcid))
        except ValueError:
            raise ctx.err(f"{where}.trsvcid", f"must be a port number 1..65535, got {trsvcid!r}",
                          "NVMe-oF uses 4420 (8009 for a TCP discovery controller)") from None
        if not 1 <= svc <= 65535:
            raise ctx.err(f"{where}.trsvcid", f"must be a port number 1..65535, got {trsvcid!r}",
                          "NVMe-oF uses 4420")
        return svc
    return 0


def _parse_port(ctx: _Ctx, p: Any, where: str, subsystems: Optional[set]) -> PortConfig:
    p = ctx.dict_at(p, where, optional=False)
    problems = _Problems()
    soft = problems.soft
    soft(ctx.unknown, p, _PORT_KEYS, where)
    if "portid" not in p:
        problems.fatal(ctx.err(where, "missing 'portid'", 'add "portid": 1'))
    portid = soft(ctx.int_at, p["portid"], f"{where}.portid", 0, PORTID_MAX, default=0)
    addr = soft(ctx.dict_at, p.get("addr"), f"{where}.addr", default={})
    soft(ctx.unknown, addr, _ADDR_KEYS, f"{where}.addr")
    trtype = soft(ctx.str_at, addr.get("trtype", DEFAULT_TRTYPE), f"{where}.addr.trtype", default=DEFAULT_TRTYPE)
    adrfam = soft(ctx.str_at, addr.get("adrfam", fabric(trtype).adrfams[0] if _ip_service(trtype) else ""),
                  f"{where}.addr.adrfam", default="ipv4")
    traddr = soft(ctx.str_at, addr.get("traddr", ""), f"{where}.addr.traddr", default="")
    treq = soft(ctx.str_at, addr.get("treq", "not specified"), f"{where}.addr.treq", default="not specified")
    if treq not in TREQS:
        problems.add(ctx.err(f"{where}.addr.treq", f"must be one of {', '.join(TREQS)}, got {treq!r}",
                             'use "not specified"'))
    if "tsas" in addr:
        soft(ctx.str_at, addr["tsas"], f"{where}.addr.tsas")
    svc_raw = addr.get("trsvcid", DEFAULT_TRSVCID if _ip_service(trtype) else "")
    if _ip_service(trtype) and not traddr:
        problems.add(ctx.err(f"{where}.addr.traddr", f"is required for an {trtype} port",
                             "give the IP address of the RDMA netdev, e.g. 10.99.0.1"))
        trsvcid = 0
    else:
        trsvcid = soft(_check_addr, ctx, f"{where}.addr", trtype, adrfam, traddr, svc_raw, default=0)
    params = {}
    for k, v in soft(ctx.dict_at, p.get("param"), f"{where}.param", default={}).items():
        if k in _PORT_FLAGS and isinstance(v, bool):
            v = "1" if v else "0"
        value = soft(ctx.str_at, v, f"{where}.param.{k}")
        if value is not None:
            params[k] = value
    # Parsed once here (decimal or 0x hex, as configfs' kstrtoint accepts); both targets use these values.
    inline = queue_size = None
    if "inline_data_size" in params:
        inline = soft(ctx.int_at, params["inline_data_size"], f"{where}.param.inline_data_size", -1,
                      MAX_INLINE_DATA_SIZE)
    if "max_queue_size" in params:
        queue_size = soft(ctx.int_at, params["max_queue_size"], f"{where}.param.max_queue_size", -1, 1 << 16)

    subs = []
    for j, nqn in enumerate(soft(ctx.list_at, p.get("subsystems"), f"{where}.subsystems", default=[])):
        sw = f"{where}.subsystems[{j}]"
        if subsystems is None or (isinstance(nqn, str) and nqn in subsystems):
            pass  # defined (its own errors, if any, are reported where it is defined)
        elif soft(validate_subsystem_nqn, nqn, ctx.source, sw) is None:
            continue
        else:
            problems.add(ctx.err(sw, f"subsystem {nqn!r} is not defined in 'subsystems'",
                                 "add that subsystem, or remove it from the port"))
            continue
        if nqn in subs:
            problems.add(ctx.err(sw, f"subsystem {nqn!r} is listed twice", "list it once"))
            continue
        subs.append(nqn)

    referrals = []
    names = set()
    for j, r in enumerate(soft(ctx.list_at, p.get("referrals"), f"{where}.referrals", default=[])):
        ref = soft(_parse_referral, ctx, r, f"{where}.referrals[{j}]", names)
        if ref is not None:
            referrals.append(ref)

    anas = []
    for j, a in enumerate(soft(ctx.list_at, p.get("ana_groups"), f"{where}.ana_groups", default=[])):
        group = soft(_parse_ana_group, ctx, a, f"{where}.ana_groups[{j}]", anas)
        if group is not None:
            anas.append(group)

    userspace = soft(ctx.dict_at, p.get(USERSPACE_KEY), f"{where}.{USERSPACE_KEY}", default={})
    problems.done()
    return PortConfig(portid=portid, trtype=trtype, adrfam=adrfam, traddr=traddr, trsvcid=trsvcid, treq=treq,
                      subsystems=subs, referrals=referrals, params=params, ana_groups=anas,
                      inline_data_size=inline, max_queue_size=queue_size, userspace=userspace,
                      raw=copy.deepcopy(p))


def _parse_referral(ctx: _Ctx, r: Any, rw: str, names: set) -> ReferralConfig:
    r = ctx.dict_at(r, rw, optional=False)
    ctx.unknown(r, {"name", "addr", "enable", "portid"}, rw)
    if not r.get("name"):
        raise ctx.err(rw, "missing 'name'", 'add "name": "ref1"')
    name = ctx.str_at(r["name"], f"{rw}.name")
    if name in names:
        raise ctx.err(f"{rw}.name", f"duplicate referral {name!r}", "give each referral its own name")
    names.add(name)
    ra = ctx.dict_at(r.get("addr"), f"{rw}.addr")
    ctx.unknown(ra, _ADDR_KEYS, f"{rw}.addr")
    rt = ctx.str_at(ra.get("trtype", DEFAULT_TRTYPE), f"{rw}.addr.trtype")
    rf = ctx.str_at(ra.get("adrfam", "ipv4"), f"{rw}.addr.adrfam")
    rtraddr = ctx.str_at(ra.get("traddr", ""), f"{rw}.addr.traddr")
    rsvc = ra.get("trsvcid", DEFAULT_TRSVCID)
    _check_addr(ctx, f"{rw}.addr", rt, rf, rtraddr, rsvc)
    rportid = None
    if "portid" in ra:
        rportid = ctx.int_at(ra["portid"], f"{rw}.addr.portid", 0, PORTID_MAX)
    return ReferralConfig(
        name=name, trtype=rt, adrfam=rf, traddr=rtraddr, trsvcid=str(rsvc),
        treq=ctx.str_at(ra.get("treq", "not specified"), f"{rw}.addr.treq"), portid=rportid,
        enabled=ctx.flag_at(r.get("enable", 1), f"{rw}.enable"), raw=copy.deepcopy(r))


def _parse_ana_group(ctx: _Ctx, a: Any, aw: str, anas: list) -> AnaGroupConfig:
    a = ctx.dict_at(a, aw, optional=False)
    ctx.unknown(a, {"grpid", "ana"}, aw)
    if "grpid" not in a:
        raise ctx.err(aw, "missing 'grpid'", 'add "grpid": 1')
    grpid = ctx.int_at(a["grpid"], f"{aw}.grpid", 1, ANA_GRPID_MAX)
    if any(g.grpid == grpid for g in anas):
        raise ctx.err(f"{aw}.grpid", f"duplicate ANA group {grpid}", "list each group once")
    state = ctx.dict_at(a.get("ana"), f"{aw}.ana").get("state", "optimized")
    if state not in ANA_STATES:
        raise ctx.err(f"{aw}.ana.state", f"must be one of {', '.join(ANA_STATES)}, got {state!r}",
                      'use "optimized"')
    return AnaGroupConfig(grpid=grpid, state=state, raw=copy.deepcopy(a))
