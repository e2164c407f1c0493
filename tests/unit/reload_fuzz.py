"""Reload fuzzing: broken configs thrown at a running loopback target while a host does verified I/O.

`run(count, seed, workdir)` writes `count` broken configs, one at a time, where the target reads its config,
and reloads after each as SIGHUP does (`Operations.reload`); between reloads the host writes a block with a
fresh pattern and reads it back, and at the end every block written is read back again.  Invariants:

  - the target never stops: every reload returns, no internal error is counted;
  - every broken config is refused, with a message and the field (or file) it names;
  - the host keeps its controller and no write is lost.

Kinds (each a way the file can be wrong): random bytes, a truncated good config, a namespace at a hostile path
(ENOTDIR, ELOOP, a NUL byte, a directory, a FIFO, a character device, ENAMETOOLONG, a relative path), the
config file itself replaced (missing, a directory, a FIFO, a link loop), a file past the size limit, deep
nesting, and a good config with one value replaced by one of the wrong type.

`make test-reload-fuzz` runs 10,000 (tests/unit/test_reload_fuzz.py reads RELOAD_FUZZ_COUNT).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections import Counter
from typing import Any, List, Tuple

from nvmeof_roce import config as config_module

from loopback_env import SUB_RAM, Env, standard_config

KINDS = ("random-bytes", "truncated", "hostile-path", "config-file", "huge", "nested", "wrong-type")
NS_BLOCKS = 2048  # blocks of namespace 1 of SUB_RAM (1 MiB of 512)


def _paths(node: Any, prefix: tuple = ()) -> List[tuple]:
    """Every (path, value) in a JSON document."""
    out = [(prefix, node)]
    if isinstance(node, dict):
        for k, v in node.items():
            out.extend(_paths(v, prefix + (k,)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.extend(_paths(v, prefix + (i,)))
    return out


def _replace(doc: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


def _wrong_type(value: Any, rng: random.Random) -> Any:
    """A value of a type the schema never takes where `value` is: a container for a scalar, the other
    container (or a scalar) for a container."""
    if isinstance(value, dict):
        return rng.choice([[1, 2], [], 3.5, None and 0 or [{}]])
    if isinstance(value, list):
        return rng.choice([{"a": 1}, {}, 7, "x"])
    return rng.choice([{"k": value}, [value], {}, []])


class ReloadFuzzer:
    def __init__(self, workdir: str, seed: int = 1):
        self.dir = workdir
        self.rng = random.Random(seed)
        self.env = Env(standard_config())
        self.path = os.path.join(workdir, "target.json")
        self.good = self.env.target.config.to_dict()
        self._write_text(json.dumps(self.good))
        self.ops = self.env.operations(self.path)
        self.ctrl = self.env.connect(SUB_RAM)
        self.written = {}  # block -> the byte written there
        self.refusals: Counter = Counter()
        self.kinds: Counter = Counter()
        self.scratch = os.path.join(workdir, "scratch")
        os.makedirs(self.scratch, exist_ok=True)
        self._write_count = 0

    def close(self) -> None:
        self.ctrl.close()
        self.ops.close()
        self.env.close()

    # -- the file
    def _clear(self) -> None:
        if os.path.islink(self.path) or os.path.isfile(self.path):
            os.unlink(self.path)
        elif os.path.isdir(self.path):
            shutil.rmtree(self.path)
        elif os.path.exists(self.path):
            os.unlink(self.path)

    def _write_text(self, text: str) -> None:
        self._write_bytes(text.encode("utf-8", "surrogatepass"))

    def _write_bytes(self, data: bytes) -> None:
        self._clear()
        with open(self.path, "wb") as f:
            f.write(data)

    # -- the kinds
    def _random_bytes(self) -> None:
        while True:
            data = bytes(self.rng.getrandbits(8) for _ in range(self.rng.randrange(0, 2048)))
            try:
                if isinstance(json.loads(data), dict):
                    continue  # "{}" would be a valid (empty) config
            except (ValueError, RecursionError):
                pass
            break
        self._write_bytes(data)

    def _truncated(self) -> None:
        text = json.dumps(self.good, indent=self.rng.choice([None, 1]))
        end = len(text.rstrip()) - 1  # the closing brace
        self._write_text(text[:self.rng.randrange(0, end)])

    def _hostile_path(self) -> None:
        s = self.scratch
        choices = {
            "enotdir": lambda: self._touch(os.path.join(s, "plain")) or os.path.join(s, "plain", "ns.img"),
            "eloop": lambda: self._link(os.path.join(s, "loop"), os.path.join(s, "loop")),
            "nul": lambda: s + "/a\0b",
            "directory": lambda: s,
            "fifo": lambda: self._fifo(os.path.join(s, "fifo")),
            "chardev": lambda: "/dev/null",
            "too-long": lambda: "/" + "x" * 5000,
            "relative": lambda: "relative/ns.img",
            "missing-dir": lambda: os.path.join(s, "no", "such", "dir", "ns.img"),
        }
        name = self.rng.choice(sorted(choices))
        doc = json.loads(json.dumps(self.good))
        doc["subsystems"][0]["namespaces"].append({"nsid": 9, "device": {"path": choices[name]()},
                                                   "nvmeof_roce": {"backend": "file"}})
        self._write_text(json.dumps(doc))

    def _config_file(self) -> None:
        how = self.rng.choice(["missing", "directory", "fifo", "eloop", "dangling"])
        self._clear()
        if how == "directory":
            os.mkdir(self.path)
        elif how == "fifo":
            os.mkfifo(self.path)
        elif how == "eloop":
            os.symlink(self.path, self.path)
        elif how == "dangling":
            os.symlink(os.path.join(self.scratch, "gone"), self.path)

    def _huge(self) -> None:
        self._clear()
        with open(self.path, "wb") as f:
            f.write(b'{"hosts": [')
            f.truncate(config_module.MAX_CONFIG_BYTES + self.rng.randrange(1, 1 << 20))

    def _nested(self) -> None:
        depth = self.rng.choice([config_module.MAX_CONFIG_DEPTH + 1, 500, 5000, 200000])
        if self.rng.random() < 0.5:
            self._write_text("[" * depth + "]" * depth)
        else:
            doc = json.loads(json.dumps(self.good))
            inner: Any = 1
            for _ in range(min(depth, 900)):  # json.dumps itself recurses
                inner = {"x": inner}
            doc["subsystems"][0]["nvmeof_roce"] = inner
            self._write_text(json.dumps(doc))

    def _wrong_type_doc(self) -> None:
        doc = json.loads(json.dumps(self.good))
        path, value = self.rng.choice([pv for pv in _paths(doc) if pv[0]])
        self._write_text(json.dumps(_replace(doc, path, _wrong_type(value, self.rng))))

    def _touch(self, path):
        if not os.path.exists(path):
            open(path, "w").close()

    def _link(self, path, to):
        if not os.path.lexists(path):
            os.symlink(to, path)
        return path

    def _fifo(self, path):
        if not os.path.exists(path):
            os.mkfifo(path)
        return path

    # -- one round
    def _io(self) -> None:
        self._write_count += 1
        block = self.rng.randrange(NS_BLOCKS)
        byte = bytes([self._write_count % 251 + 1])
        self.ctrl.write(1, block, byte * 512)
        self.written[block] = byte
        assert self.ctrl.read(1, block, 1) == byte * 512, f"block {block} lost its write"

    def one(self, kind: str) -> Tuple[str, dict]:
        getattr(self, "_" + kind.replace("-", "_") if kind != "wrong-type" else "_wrong_type_doc")()
        started = time.monotonic()
        result = self.ops.reload()  # what the loop runs after SIGHUP
        elapsed = time.monotonic() - started
        assert result.get("applied") is False, (kind, result)
        error = result["error"]
        assert error.get("message") and error.get("data", {}).get("field"), (kind, error)
        assert self.env.target.internal_errors == 0
        assert not self.env.target.closed
        self._io()
        self.kinds[kind] += 1
        self.refusals[_category(error["message"])] += 1
        return kind, {"elapsed": elapsed}

    def run(self, count: int) -> dict:
        slowest = 0.0
        start = time.monotonic()
        for i in range(count):
            _, info = self.one(KINDS[i % len(KINDS)] if i < len(KINDS) else self.rng.choice(KINDS))
            slowest = max(slowest, info["elapsed"])
        self._write_text(json.dumps(self.good))  # and a good one is still taken
        assert self.ops.reload()["changes"] == []
        for block, byte in self.written.items():
            assert self.ctrl.read(1, block, 1) == byte * 512, f"block {block} lost its write"
        return {"configs": count, "seconds": round(time.monotonic() - start, 1), "slowest_reload_s":
                round(slowest, 3), "by_kind": dict(self.kinds), "refusals": dict(self.refusals.most_common()),
                "blocks_verified": len(self.written)}


def _category(message: str) -> str:
    """A refusal's kind, for the summary: the message without its variable parts."""
    for words in ("not valid UTF-8", "invalid JSON: nested", "invalid JSON", "nested more than", "more than the",
                  "no such file", "is a directory", "not a regular file", "cannot open the file",
                  "NUL byte", "Not a directory", "symbolic links", "File name too long", "no such file",
                  "not a regular file or block device", "must be an absolute path", "cannot create",
                  "must be an object", "must be a list", "must be a string", "must be an integer",
                  "must be 0 or 1", "unknown key", "not an NQN", "non-empty string", "is not a UUID",
                  "not defined", "is required", "is not a size", "must be one of", "must be a port number"):
        if words in message:
            return words
    return message[:60]


def run(count: int, seed: int, workdir: str) -> dict:
    fuzzer = ReloadFuzzer(workdir, seed)
    try:
        return fuzzer.run(count)
    finally:
        fuzzer.close()
