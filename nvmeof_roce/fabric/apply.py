"""The commands that apply a plan's host settings, and the switch settings to ask for.

Every command is one line an admin can run as root, with a comment saying what it does.  The
doctor's `fabric.plan` check prints the same commands as the fix for each difference, so the two
never disagree: both come from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

RDMA_CM_CONFIGFS = "/sys/kernel/config/rdma_cm"
NET_CLASS = "/sys/class/net"


@dataclass
class Command:
    tool: str  # "dcb", "mlnx_qos", "ip", "sysfs", "configfs", "debugfs", "sonic"
    line: str
    why: str

    def to_json(self) -> Dict[str, str]:
        return {"tool": self.tool, "command": self.line, "why": self.why}


def pfc_command(netdev: str, priority: int) -> str:
    return f"dcb pfc set dev {netdev} prio-pfc all:off {priority}:on"


def pfc_delay_command(netdev: str, metres: int) -> str:
    return f"dcb pfc set dev {netdev} delay {metres}"


def dscp_command(netdev: str, dscp: int, priority: int) -> str:
    return f"dcb app add dev {netdev} dscp-prio {dscp}:{priority}"


def mtu_command(netdev: str, mtu: int) -> str:
    return f"ip link set dev {netdev} mtu {mtu}"


def tos_command(rdma_dev: str, port: int, tos: int) -> str:
    base = f"{RDMA_CM_CONFIGFS}/{rdma_dev}"
    return f"mkdir -p {base} && echo {tos} > {base}/ports/{port}/default_roce_tos"


def ecn_command(netdev: str, point: str, priority: int) -> str:
    return f"echo 1 > {NET_CLASS}/{netdev}/ecn/{point}/enable/{priority}"


def dcqcn_sysfs_command(netdev: str, knob: str, value) -> str:
    point = "roce_np" if knob in ("min_time_between_cnps", "cnp_dscp", "cnp_802p_prio") else "roce_rp"
    return f"echo {value} > {NET_CLASS}/{netdev}/ecn/{point}/{knob}"


def mlnx_qos_command(netdev: str, priority: int, cable_m: int) -> str:
    pfc = ",".join("1" if p == priority else "0" for p in range(8))
    return f"mlnx_qos -i {netdev} --trust dscp --pfc {pfc} --cable_len {cable_m}"


# The upstream kernel's names for the same DCQCN knobs (debugfs cc_params of mlx5_ib).
DEBUGFS_NAMES = {"rpg_time_reset": "rp_time_reset", "rpg_byte_reset": "rp_byte_reset", "rpg_threshold": "rp_threshold",
                 "rpg_ai_rate": "rp_ai_rate", "rpg_hai_rate": "rp_hai_rate", "rpg_gd": "rp_gd",
                 "rpg_min_dec_fac": "rp_min_dec_fac", "rpg_min_rate": "rp_min_rate", "dce_tcp_g": "rp_dce_tcp_g",
                 "dce_tcp_rtt": "rp_dce_tcp_rtt", "initial_alpha_value": "rp_initial_alpha_value",
                 "rate_reduce_monitor_period": "rp_rate_reduce_monitor_period",
                 "min_time_between_cnps": "np_min_time_between_cnps"}


def host_commands(plan: dict, netdev: str = "$NETDEV", rdma_dev: str = "$RDMA_DEV", port: int = 1,
                  pci: Optional[str] = None) -> List[Command]:
    """The host side of a plan, in the order to run it."""
    host = plan["host"]
    prio, dscp = host["priority"], host["dscp"]
    cmds = [
        Command("ip", mtu_command(netdev, host["mtu"]), f"MTU {host['mtu']} on the RoCE netdev (the switch port too)"),
        Command("dcb", pfc_command(netdev, prio), f"PFC on priority {prio} only"),
        Command("dcb", pfc_delay_command(netdev, host["pfc_delay"]),
                f"cable length {host['pfc_delay']} m: mlx5 takes the PFC delay field as metres of cable and, on "
                "buffers the driver owns, sizes the NIC's headroom from it (calculate_xoff)"),
    ]
    for d, p in sorted(host["dscp_to_priority"].items(), key=lambda kv: int(kv[0])):
        what = "RoCE data" if int(d) == dscp else "CNPs"
        cmds.append(Command("dcb", dscp_command(netdev, int(d), p),
                            f"{what}: DSCP {d} -> priority {p} (mlx5 switches to DSCP trust with the first entry)"))
    cmds.append(Command("configfs", tos_command(rdma_dev, port, host["tos"]),
                        f"RDMA CM connections default to ToS {host['tos']} (DSCP {dscp}); nvme connect --tos overrides"))
    for point, role in (("roce_np", "notification point: answer ECN marks with CNPs"),
                        ("roce_rp", "reaction point: slow down on CNPs")):
        for p in host["ecn_priorities"]:
            cmds.append(Command("sysfs", ecn_command(netdev, point, p), f"ECN {role} on priority {p} (MLNX_OFED "
                                "sysfs; upstream mlx5 has DCQCN on by default and no such file)"))
    for knob, value in host["dcqcn"].items():
        cmds.append(Command("sysfs", dcqcn_sysfs_command(netdev, knob, value), f"DCQCN {knob} = {value} (MLNX_OFED)"))
        where = f"/sys/kernel/debug/mlx5/{pci or '$PCI'}/cc_params/{DEBUGFS_NAMES[knob]}"
        cmds.append(Command("debugfs", f"echo {value} > {where}", f"the same knob on the upstream kernel"))
    cmds.append(Command("mlnx_qos", mlnx_qos_command(netdev, prio, host["pfc_delay"]),
                        "where NVIDIA's mlnx_qos is installed instead of dcb: trust, PFC and cable length in one"))
    return cmds


def switch_settings(plan: dict, interface: str = "$SWITCH_PORT") -> List[Command]:
    """What the switch port must match (SONiC's CLI shown; other switches have the same settings)."""
    host, ecn = plan["host"], plan["ecn"]
    sonic = plan["headroom"]["sonic"]
    return [
        Command("sonic", f"config interface mtu {interface} {plan['inputs']['peer_mtu']}", "the switch port's MTU"),
        Command("sonic", f"config interface cable-length {interface} {host['pfc_delay']}m",
                f"the dynamic buffer manager then reserves {sonic['headroom']} B of headroom "
                f"(xoff {sonic['xoff']}, xon {sonic['xon']}) for each lossless PG"),
        Command("sonic", f"config interface pfc priority {interface} {host['priority']} on",
                f"PFC on priority {host['priority']}, mapped from DSCP {host['dscp']} (DSCP_TO_TC_MAP)"),
        Command("sonic", f"config ecn -profile AZURE_LOSSLESS -gmin {ecn['kmin']} -gmax {ecn['kmax']} "
                         f"-gdrop {int(round(ecn['pmax'] * 100))}",
                f"ECN marking on the lossless queue: Kmin {ecn['kmin']} B, Kmax {ecn['kmax']} B, "
                f"Pmax {ecn['pmax'] * 100:g} %"),
    ]
