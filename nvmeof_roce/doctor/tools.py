"""One small wrapper per external tool the checks run, each with the parser of its output.

Every wrapper takes the `Machine`, runs one command through it and returns parsed data.
A tool that is not installed raises `ToolMissing` (from machine.run); a tool that ran
but failed raises `ToolFailed` carrying its own message.  The parsers are plain functions
of the text, tested on recorded outputs.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ..errors import NvmeofError
from .machine import Machine, ToolResult


class ToolFailed(NvmeofError):
    """The tool ran but exited non-zero (no permission, unsupported device, ...)."""

    def __init__(self, result: ToolResult):
        super().__init__(f"'{result.command}' failed: {result.error}")
        self.result = result

    @property
    def not_supported(self) -> bool:
        return bool(re.search(r"not supported|No such device", self.result.error, re.I))

    @property
    def not_permitted(self) -> bool:
        return bool(re.search(r"not permitted|permission denied", self.result.error, re.I))


def _checked(result: ToolResult) -> ToolResult:
    if result.returncode != 0:
        raise ToolFailed(result)
    return result


# --- ip ------------------------------------------------------------------------------


@dataclass
class Route:
    """`ip -j route get ADDR`: which device a packet to ADDR leaves through."""

    dst: str
    dev: str
    prefsrc: Optional[str]
    gateway: Optional[str]
    is_local: bool
    raw: dict


def parse_ip_route_get(text: str) -> Route:
    entry = json.loads(text)[0]
    return Route(
        dst=entry.get("dst", ""),
        dev=entry.get("dev", ""),
        prefsrc=entry.get("prefsrc"),
        gateway=entry.get("gateway"),
        is_local=entry.get("type") == "local",
        raw=entry,
    )


def ip_route_get(machine: Machine, address: str) -> Route:
    """`ip -j route get ADDR`."""
    return parse_ip_route_get(_checked(machine.run(["ip", "-j", "route", "get", address])).stdout)


# --- dcb (iproute2) ------------------------------------------------------------------


@dataclass
class DcbPfc:
    """`dcb -j pfc show dev X`: the priorities with PFC on, and the delay field (mlx5 reads it as the
    cable length in metres and sizes the headroom of the buffers it owns from it)."""

    priorities: List[int]
    delay: Optional[int]


def parse_dcb_pfc_show(text: str) -> DcbPfc:
    """The JSON is {"pfc_cap":8,"macsec_bypass":false,"delay":0,"prio_pfc":[false,...]}."""
    data = json.loads(text)
    delay = data.get("delay")
    return DcbPfc([prio for prio, enabled in enumerate(data.get("prio_pfc", [])) if enabled],
                  delay if isinstance(delay, int) else None)


def parse_dcb_pfc(text: str) -> List[int]:
    """`dcb -j pfc show dev X` → the priorities with PFC on."""
    return parse_dcb_pfc_show(text).priorities


def dcb_pfc(machine: Machine, netdev: str) -> DcbPfc:
    return parse_dcb_pfc_show(_checked(machine.run(["dcb", "-j", "pfc", "show", "dev", netdev])).stdout)


def dcb_pfc_priorities(machine: Machine, netdev: str) -> List[int]:
    return dcb_pfc(machine, netdev).priorities


def parse_dcb_app_dscp(text: str) -> Dict[int, int]:
    """`dcb -j app show dev X` → {dscp: priority} from "dscp_prio": [[26, 3], ...]."""
    data = json.loads(text) if text.strip() else {}
    mapping = {}
    for pair in data.get("dscp_prio", []):
        numbers = [p for p in pair if isinstance(p, int)]
        if len(numbers) >= 2:
            mapping[numbers[0]] = numbers[1]
    return mapping


def dcb_app_dscp(machine: Machine, netdev: str) -> Dict[int, int]:
    return parse_dcb_app_dscp(_checked(machine.run(["dcb", "-j", "app", "show", "dev", netdev])).stdout)


# --- mlnx_qos (NVIDIA) ---------------------------------------------------------------


@dataclass
class MlnxQos:
    """The parts of `mlnx_qos -i X` the checks use."""

    pfc_priorities: List[int]
    trust: Optional[str]  # "pcp" or "dscp"
    dscp_to_prio: Dict[int, int] = field(default_factory=dict)


def parse_mlnx_qos(text: str) -> MlnxQos:
    trust = None
    m = re.search(r"Priority trust state:\s*(\w+)", text)
    if m:
        trust = m.group(1)
    dscp_to_prio = {}
    for prio, dscps in re.findall(r"prio:\s*(\d+)\s+dscp:\s*([\d, ]+)", text):
        for d in re.findall(r"\d+", dscps):
            dscp_to_prio[int(d)] = int(prio)
    pfc = []
    m = re.search(r"PFC configuration:.*?^\s*enabled\s+([01\s]+)$", text, re.S | re.M)
    if m:
        pfc = [i for i, bit in enumerate(m.group(1).split()) if bit == "1"]
    return MlnxQos(pfc, trust, dscp_to_prio)


def mlnx_qos(machine: Machine, netdev: str) -> MlnxQos:
    return parse_mlnx_qos(_checked(machine.run(["mlnx_qos", "-i", netdev])).stdout)


# --- lldptool (lldpad) ---------------------------------------------------------------


def parse_lldptool_pfc(text: str) -> List[int]:
    """`lldptool -t -i X -V PFC` → priorities from "PFC enabled: 3 4" ("none" → [])."""
    m = re.search(r"PFC enabled:\s*(.*)", text)
    if not m:
        return []
    return [int(p) for p in re.findall(r"\d", m.group(1))]


def lldptool_pfc_priorities(machine: Machine, netdev: str) -> List[int]:
    return parse_lldptool_pfc(_checked(machine.run(["lldptool", "-t", "-i", netdev, "-V", "PFC"])).stdout)


# --- ethtool -------------------------------------------------------------------------


def parse_ethtool_stats(text: str) -> Dict[str, int]:
    """`ethtool -S X` ("NIC statistics:" then "     name: value" lines) → {name: value}."""
    stats = {}
    for line in text.splitlines():
        m = re.match(r"\s+([^:]+):\s+(-?\d+)\s*$", line)
        if m:
            stats[m.group(1).strip()] = int(m.group(2))
    return stats


def ethtool_stats(machine: Machine, netdev: str) -> Dict[str, int]:
    return parse_ethtool_stats(_checked(machine.run(["ethtool", "-S", netdev])).stdout)


# --- ibv_devinfo (rdma-core) ---------------------------------------------------------


def parse_ibv_devinfo(text: str) -> Dict[int, Dict[str, str]]:
    """`ibv_devinfo -d DEV` → {port: {"state": "PORT_ACTIVE (4)", "active_mtu": "4096 (5)", ...}}."""
    ports: Dict[int, Dict[str, str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s*port:\s*(\d+)", line)
        if m:
            current = ports.setdefault(int(m.group(1)), {})
            continue
        m = re.match(r"\s*(\w+):\s*(.+?)\s*$", line)
        if m and current is not None:
            current[m.group(1)] = m.group(2)
    return ports


def ibv_devinfo(machine: Machine, device: str) -> Dict[int, Dict[str, str]]:
    return parse_ibv_devinfo(_checked(machine.run(["ibv_devinfo", "-d", device])).stdout)


def mtu_bytes(value: Optional[str]) -> Optional[int]:
    """"4096 (5)" → 4096."""
    if not value:
        return None
    m = re.match(r"(\d+)", value)
    return int(m.group(1)) if m else None


# --- firewall: nft / iptables-save ---------------------------------------------------


def nft_ruleset(machine: Machine) -> dict:
    """`nft -j list ruleset` as parsed JSON."""
    return json.loads(_checked(machine.run(["nft", "-j", "list", "ruleset"])).stdout or '{"nftables": []}')


def iptables_save(machine: Machine) -> str:
    return _checked(machine.run(["iptables-save"])).stdout


# --- dmesg ---------------------------------------------------------------------------


def dmesg(machine: Machine) -> List[str]:
    """Kernel log lines from `dmesg` (fails when dmesg_restrict forbids it)."""
    return _checked(machine.run(["dmesg"])).stdout.splitlines()
