"""Facts about RoCE that several layers need (kernel/ management and doctor/ both import this).

- `roce_mtu_for_netdev_mtu()`: the RoCE (IB) MTU a netdev MTU allows, as the kernel's ib_core
  computes it for a RoCE path in `iboe_get_mtu()` (include/rdma/ib_addr.h).
"""
from typing import Optional

# The headers ib_core subtracts from the netdev MTU in iboe_get_mtu() (sizes from
# include/rdma/ib_pack.h): the worst case of one RoCE packet's headers after the Ethernet header.
IB_GRH_BYTES = 40            # GRH; a RoCE v2 IPv4 header is smaller, the kernel budgets for IPv6
IB_UDP_BYTES = 8
IB_BTH_BYTES = 12
IB_EXT_XRC_BYTES = 4
IB_EXT_ATOMICETH_BYTES = 28  # the largest extended transport header after the BTH
IB_ICRC_BYTES = 4
ROCE_HEADER_OVERHEAD = (IB_GRH_BYTES + IB_UDP_BYTES + IB_BTH_BYTES + IB_EXT_XRC_BYTES
                        + IB_EXT_ATOMICETH_BYTES + IB_ICRC_BYTES)   # 96

IB_MTUS = (4096, 2048, 1024, 512, 256)   # the IB MTU enum's sizes, largest first


def roce_mtu_for_netdev_mtu(netdev_mtu: int) -> Optional[int]:
    """The largest IB MTU that fits in a netdev MTU with the RoCE headers (None if not even 256 fits):
    9000 → 4096, 4200 → 4096, 4191 → 2048, 1500 → 1024."""
    room = netdev_mtu - ROCE_HEADER_OVERHEAD
    for mtu in IB_MTUS:
        if room >= mtu:
            return mtu
    return None
