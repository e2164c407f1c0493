"""Where the doctor's group checks (checks/group.py) get a gateway group's state: the running target's
`nvmeof_group_status` over its control socket (`--socket`, else the only socket under /run/nvmeof-roce), else the
group's RADOS state read directly (ceph/group/inspect.py) with the cluster settings of the `nvmeof_roce.group`
object of the target config given with `--config`.

Both give the same shape (service/group.py `GroupMember.status`); `GroupView` says which was read, with what
settings, and why there is nothing to check when there is not."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from ..errors import NvmeofError

STATUS_METHOD = "nvmeof_group_status"

# rpc(method, socket or None, timeout) -> the result; raises NvmeofError (no socket, an RpcError, ...)
RpcFunction = Callable[[str, Optional[str], float], Any]
# inspect(settings, timeout) -> a status dict; raises NvmeofError (ceph/group's GroupError) when it cannot
InspectFunction = Callable[[Dict[str, Any], float], Dict[str, Any]]


@dataclass
class GroupView:
    status: Optional[Dict[str, Any]] = None  # nvmeof_group_status's answer, or the RADOS read's
    source: str = ""  # where it was read: "nvmeof_group_status on SOCKET" or "RADOS (...)"
    settings: Dict[str, Any] = field(default_factory=dict)  # conf, id, keyring, pool, namespace, lease
    error: Optional[str] = None  # the group's state could not be read (the cluster: see fix)
    fix: str = ""
    skipped: Optional[str] = None  # there is no group to check, and why
    tried: List[str] = field(default_factory=list)  # what was tried on the way, for the evidence

    @property
    def from_gateway(self) -> bool:
        return self.status is not None and self.status.get("gateway") is not None


def _rpc(method: str, socket: Optional[str], timeout: float) -> Any:
    from ..control.client import call, find_socket
    from ..control.protocol import RpcError
    try:
        return call(find_socket(socket), method, timeout=timeout)
    except RpcError as exc:  # the target answered with an error (not a gateway of a group, ...)
        raise NvmeofError(str(exc).splitlines()[0], getattr(exc, "fix", "")) from None
    except (OSError, ValueError) as exc:
        raise NvmeofError(f"{method}: {exc}", "check the target's log") from None


def _inspect(settings: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    from ..ceph.group.inspect import inspect
    return inspect(settings["conf"], settings["id"], settings.get("keyring"), settings["pool"],
                   settings.get("namespace", ""), settings["name"], timeout)


def group_settings(path: str) -> Optional[Dict[str, Any]]:
    """The `nvmeof_roce.group` object of the target config at `path`, checked as `target serve` checks it (None:
    the config has none); raises NvmeofError (a file that does not read, a group object that does not parse)."""
    from ..config.group import GROUP_KEY, parse_group
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise NvmeofError(f"{path}: {exc}", "give the target config of a gateway (--config FILE)") from None
    section = (data.get("nvmeof_roce") or {}) if isinstance(data, dict) else {}
    if not isinstance(section, dict) or GROUP_KEY not in section:
        return None
    return parse_group(section[GROUP_KEY], path).to_dict()


def read_group_view(config: Optional[str], socket: Optional[str], timeout: float, live: bool,
                    rpc: Optional[RpcFunction] = None, inspect: Optional[InspectFunction] = None) -> GroupView:
    """The group to check: the running target's status when it is a gateway (of the --config's group, when one
    is given), else the RADOS state of --config's group, else nothing (skipped)."""
    rpc = rpc or _rpc
    inspect = inspect or _inspect
    view = GroupView()
    settings = None
    if config:
        try:
            settings = group_settings(config)
        except NvmeofError as exc:
            return GroupView(error=f"--config {exc.message}", fix=exc.fix or "give a gateway's target config")
        if settings is None:
            return GroupView(skipped=f"{config} has no nvmeof_roce.group: not a gateway of a group")
        view.settings = settings
    if live or socket:
        try:
            status = rpc(STATUS_METHOD, socket, timeout)
        except NvmeofError as exc:
            view.tried.append(f"{STATUS_METHOD}: {exc.message}")
        else:
            if settings is None or status.get("group") == settings["name"]:
                view.status, view.source = status, f"{STATUS_METHOD} of gateway {status.get('gateway')}"
                if settings is None:
                    cluster = status.get("cluster") or {}
                    view.settings = {"name": status.get("group"), "lease": status.get("lease_seconds"),
                                     **{k: cluster.get(k) for k in ("conf", "id", "keyring", "pool", "namespace")}}
                return view
            view.tried.append(f"{STATUS_METHOD}: the running target is a gateway of group {status.get('group')}, "
                              f"not of {settings['name']}")
    if settings is None:
        reason = "; ".join(view.tried) or "a captured tree (--root) and no --socket"
        return GroupView(skipped=f"no gateway group to check ({reason}); give --config with a gateway's target "
                         "config, or --socket of a running gateway", tried=view.tried)
    where = (f"RADOS object nvmeof_roce.group.{settings['name']} in pool {settings['pool']}"
             + (f" namespace {settings['namespace']}" if settings.get("namespace") else "")
             + f", read as client.{settings['id']} of {settings['conf']}")
    view.source = where
    try:
        view.status = inspect(settings, timeout)
    except NvmeofError as exc:
        view.error, view.fix = exc.message, exc.fix
    except Exception as exc:  # the bindings missing, ...
        view.error, view.fix = f"{type(exc).__name__}: {exc}", "install python3-rados (make deps)"
    return view
