"""The checks, in the order the report shows them.

Each check is one function with a docstring saying what it detects and why, listed here as
(scope, check id, function).  The scope says how it is called: "host" checks take the Context, "device" checks (Context, Device), "port"
checks (Context, Port); each returns a CheckResult (or a list of them).
"""
from . import addressing, device, fabric, group, kernel_log, nvme, stack

CHECKS = [
    ("host", "stack.modules", stack.check_kernel_modules),
    ("host", "stack.device_files", stack.check_device_files),
    ("host", "stack.memlock", stack.check_memlock_limit),
    ("host", "device.present", device.check_rdma_devices),
    ("device", "device.soft_roce", device.check_soft_roce),
    ("port", "port.state", device.check_port_state),
    ("port", "port.link_layer", device.check_link_layer),
    ("port", "port.mtu", device.check_port_mtu),
    ("port", "address.gids", addressing.check_roce_v2_gids),
    ("port", "address.roce_mode", addressing.check_roce_mode),
    ("host", "address.traddr_gid", addressing.check_gid_for_traddr),
    ("host", "address.route", addressing.check_route_to_traddr),
    ("host", "address.path_mtu", addressing.check_path_mtu),
    ("port", "fabric.pfc", fabric.check_pfc),
    ("port", "fabric.ecn", fabric.check_ecn),
    ("port", "fabric.plan", fabric.check_plan),  # only with --plan FILE
    ("host", "fabric.counters", fabric.check_error_counters),
    ("host", "nvme.host_identity", nvme.check_host_identity),
    ("host", "stack.nvme_auth", stack.check_nvme_auth),
    ("host", "stack.native", stack.check_native_module),
    ("host", "nvme.firewall", nvme.check_firewall),
    ("host", "nvme.target", nvme.check_target_reachable),
    ("host", "kernel.messages", kernel_log.check_kernel_messages),
    ("host", "group", group.check_gateway_group),  # group.cluster, group.members, group.ana (a gateway group)
]
