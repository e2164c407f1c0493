"""blktests' NVME_TARGET_CONTROL hook, served by one running userspace target (docs/conformance.md).

blktests (tests/nvme) drives an external target through a script it calls as

    SCRIPT config --show-trtype|--show-traddr|--show-trsvid|--show-hostnqn|--show-hostid|--show-host-traddr|
                  --show-subsysnqn|--show-subsys-uuid|--show-blkdev-type
    SCRIPT setup --subsysnqn N --subsys-uuid U --hostnqn H [--hostkey K] [--ctrkey C]
    SCRIPT cleanup --subsysnqn N

(blktests' common/nvme spells the controller key option `--ctrkey`; `--ctrlkey`, the documented name, is taken
too).  The script the project ships is `nvme_target_control.sh` beside this module: it answers `config` from the
state file that `start` writes (blktests asks it several times per test, so it stays a shell `sed`), and runs
this module for the rest:

    start [--traddr A] [--trsvcid S] [--dir D] [--size SIZE] [-- SERVE-ARGS]   one target process for the run
    stop                                                                     SIGTERM, wait, remove the state
    setup / cleanup                                                          subsystems added and removed live

`setup` is what blktests' kernel path does in configfs, through the control socket's RPC methods: a subsystem
closed to all but the host, one file namespace of SIZE with UUID U, the host's DH-HMAC-CHAP keys, and the
subsystem on the one port.  `cleanup` deletes it (its controllers end, as nvmet's rmdir does), its file and the
host's keys.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional

from ..errors import NvmeofError
from ..service.run_dir import pid_alive
from ..control.client import RpcError, call

# blktests' own defaults (common/nvme: def_hostid, def_hostnqn, def_subsysnqn, def_subsys_uuid), so a run against
# this target connects with the same identities as one against nvmet.
BLKTESTS_HOSTID = "0f01fb42-9f7f-4856-b0b3-51e60b8de349"
BLKTESTS_HOSTNQN = f"nqn.2014-08.org.nvmexpress:uuid:{BLKTESTS_HOSTID}"
BLKTESTS_SUBSYSNQN = "blktests-subsystem-1"
BLKTESTS_SUBSYS_UUID = "91fdba0d-f87b-4c25-b80f-db7be1418b9e"
DEFAULT_TRADDR = "10.99.0.1"  # the lab's rxe0 address (docs/lab.md)
DEFAULT_SIZE = "1G"           # blktests' NVME_IMG_SIZE default
DEFAULT_DIR = "/var/tmp/nvmeof-blktests"
READY_TIMEOUT = 180.0         # `target serve` under TCG emulation takes tens of seconds to listen

Rpc = Callable[[str, Optional[dict]], Any]


def read_state(path: str) -> Dict[str, str]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise NvmeofError(f"no state file {path}: the target for blktests is not started",
                          "run 'nvme_target_control.sh start' before blktests' ./check") from None
    return dict(line.split("=", 1) for line in lines if "=" in line)


def _write_state(path: str, state: Dict[str, str]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("".join(f"{k}={v}\n" for k, v in state.items()))
    os.replace(tmp, path)


def namespace_file(state: Dict[str, str], subsysnqn: str) -> str:
    return os.path.join(state["dir"], subsysnqn.replace("/", "_") + ".img")


def setup(rpc: Rpc, state: Dict[str, str], subsysnqn: str, subsys_uuid: str, hostnqn: str,
          hostkey: str = "", ctrlkey: str = "") -> None:
    """What blktests' _nvmet_target_setup makes in configfs, on the running target."""
    if ctrlkey and not hostkey:
        raise NvmeofError("--ctrlkey without --hostkey", "give the host key too (bidirectional authentication "
                          "needs both)")
    path = namespace_file(state, subsysnqn)
    rpc("nvmf_create_subsystem", {"nqn": subsysnqn, "allow_any_host": False})
    try:
        # A fresh file each time, as blktests truncates its image for each test.
        if os.path.exists(path):
            os.unlink(path)
        rpc("nvmf_subsystem_add_ns", {"nqn": subsysnqn, "namespace": {
            "nsid": 1, "path": path, "size": state["size"], "uuid": subsys_uuid}})
        rpc("nvmeof_set_host_keys", {"host": hostnqn, "dhchap_key": hostkey, "dhchap_ctrlr_key": ctrlkey})
        rpc("nvmf_subsystem_add_host", {"nqn": subsysnqn, "host": hostnqn})
        rpc("nvmf_subsystem_add_listener", {"nqn": subsysnqn, "listen_address": {
            "trtype": "RDMA", "adrfam": "IPv4", "traddr": state["traddr"], "trsvcid": state["trsvid"]}})
    except (RpcError, NvmeofError):
        cleanup(rpc, state, subsysnqn)
        raise


def cleanup(rpc: Rpc, state: Dict[str, str], subsysnqn: str) -> None:
    """What blktests' _nvmet_target_cleanup removes: the subsystem (its controllers end), its file, the host's
    keys (nvmet removes the host's directory)."""
    subs = rpc("nvmf_get_subsystems", None)
    sub = next((s for s in subs if s["nqn"] == subsysnqn), None)
    if sub is None:
        raise NvmeofError(f"no subsystem {subsysnqn!r} on the target", "nothing to clean up")
    rpc("nvmf_delete_subsystem", {"nqn": subsysnqn})
    still_allowed = {h["nqn"] for s in subs if s["nqn"] != subsysnqn for h in s.get("hosts", [])}
    for host in sub.get("hosts", []):
        if host["nqn"] not in still_allowed:
            rpc("nvmeof_set_host_keys", {"host": host["nqn"]})
    path = namespace_file(state, subsysnqn)
    if os.path.exists(path):
        os.unlink(path)


def _socket_rpc(socket_path: str) -> Rpc:
    def rpc(method: str, params: Optional[dict] = None) -> Any:
        try:
            return call(socket_path, method, params)
        except RpcError as exc:
            where = f" ({exc.field})" if exc.field else ""
            raise NvmeofError(f"{method}{where}: {exc.message}", exc.fix) from None
    return rpc


def start(state_path: str, traddr: str, trsvcid: str, directory: str, size: str, serve_args: List[str]) -> None:
    if os.path.exists(state_path):
        old = read_state(state_path)
        if pid_alive(int(old.get("pid", "0"))):
            raise NvmeofError(f"a target for blktests is already running (pid {old['pid']}, {state_path})",
                              "stop it first: nvme_target_control.sh stop")
    os.makedirs(directory, exist_ok=True)
    os.makedirs(os.path.dirname(state_path) or ".", exist_ok=True)
    config = os.path.join(directory, "target.json")
    socket_path = os.path.join(directory, "target.sock")
    ready = os.path.join(directory, "target.ready")
    log_path = os.path.join(directory, "target.log")
    with open(config, "w") as f:
        json.dump({"hosts": [], "subsystems": [], "ports": [{
            "portid": 1, "addr": {"trtype": "rdma", "adrfam": "ipv4", "traddr": traddr, "trsvcid": trsvcid},
            "subsystems": [], "referrals": []}]}, f, indent=2)
    if os.path.exists(ready):
        os.unlink(ready)
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "nvmeof_roce", "-v", "target", "serve", config,
                                 "--rpc-socket", socket_path, "--ready-file", ready, *serve_args],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT
    while not os.path.exists(ready):
        if proc.poll() is not None:
            raise NvmeofError(f"the target exited with {proc.returncode} before listening", f"see {log_path}")
        if time.monotonic() > deadline:
            proc.terminate()
            raise NvmeofError(f"the target did not listen within {READY_TIMEOUT:.0f} s", f"see {log_path}")
        time.sleep(0.2)
    _write_state(state_path, {
        "trtype": "rdma", "traddr": traddr, "trsvid": trsvcid, "host-traddr": traddr,
        "hostnqn": BLKTESTS_HOSTNQN, "hostid": BLKTESTS_HOSTID, "subsysnqn": BLKTESTS_SUBSYSNQN,
        "subsys-uuid": BLKTESTS_SUBSYS_UUID, "blkdev-type": "file",
        "pid": str(proc.pid), "socket": socket_path, "dir": directory, "size": size, "log": log_path})


def stop(state_path: str, timeout: float = 60.0) -> None:
    state = read_state(state_path)
    pid = int(state.get("pid", "0"))
    if pid_alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(pid):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    break
            except ChildProcessError:
                pass  # not our child (started by another `start` process): poll until it is gone
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.2)
    os.unlink(state_path)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="nvme_target_control.sh",
                                description="blktests' NVME_TARGET_CONTROL for the nvmeof-roce userspace target")
    p.add_argument("--state", required=True, help="the state file `start` writes and the other verbs read")
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("start", help="start one target for the whole blktests run")
    s.add_argument("--traddr", default=DEFAULT_TRADDR)
    s.add_argument("--trsvcid", default="4420")
    s.add_argument("--dir", default=DEFAULT_DIR, help="backing files, config, socket and log of the target")
    s.add_argument("--size", default=DEFAULT_SIZE, help="size of each subsystem's namespace file")
    s.add_argument("serve_args", nargs="*", help="more `target serve` options (after --)")
    sub.add_parser("stop", help="stop the target")
    s = sub.add_parser("setup")
    s.add_argument("--subsysnqn", required=True)
    s.add_argument("--subsys-uuid", required=True)
    s.add_argument("--hostnqn", required=True)
    s.add_argument("--hostkey", default="")
    s.add_argument("--ctrlkey", "--ctrkey", dest="ctrlkey", default="")
    s = sub.add_parser("cleanup")
    s.add_argument("--subsysnqn", required=True)
    sub.add_parser("config", help="--show-KEY: one value of the state file (the shell script answers it itself)")
    argv = list(sys.argv[1:] if argv is None else argv)
    show = [a for a in argv if a.startswith("--show-")]
    args = p.parse_args([a for a in argv if not a.startswith("--show-")])
    try:
        if args.verb == "start":
            start(args.state, args.traddr, args.trsvcid, args.dir, args.size, args.serve_args)
        elif args.verb == "stop":
            stop(args.state)
        elif args.verb == "config":
            state = read_state(args.state)
            for opt in show:
                print(state[opt[len("--show-"):]])
        else:
            state = read_state(args.state)
            rpc = _socket_rpc(state["socket"])
            if args.verb == "setup":
                setup(rpc, state, args.subsysnqn, args.subsys_uuid, args.hostnqn, args.hostkey, args.ctrlkey)
            else:
                cleanup(rpc, state, args.subsysnqn)
    except (NvmeofError, KeyError) as exc:
        print(f"nvme_target_control: {exc}", file=sys.stderr)
        _log(args.state, argv, f"FAILED: {exc}")
        return 1
    _log(args.state, argv, "ok")
    return 0


def _log(state_path: str, argv: List[str], outcome: str) -> None:
    """blktests sends the script's output to /dev/null: each call and its outcome also go to DIR/control.log."""
    try:
        directory = read_state(state_path)["dir"]
        with open(os.path.join(directory, "control.log"), "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {' '.join(argv)}: {outcome}\n")
    except (NvmeofError, KeyError, OSError):
        pass  # no state (stop removed it, start failed): nothing to log to


if __name__ == "__main__":
    sys.exit(main())
