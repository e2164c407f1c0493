"""The RoCE facts in nvmeof_roce.roce, pinned to the kernel's rule."""
import pytest

from nvmeof_roce.roce import roce_mtu_for_netdev_mtu


@pytest.mark.parametrize("netdev_mtu, roce_mtu", [(9000, 4096), (4200, 4096), (4191, 2048), (1500, 1024),
                                                  (1280, 1024), (1100, 512), (300, None)])
def test_roce_mtu_for_netdev_mtu(netdev_mtu, roce_mtu):
    assert roce_mtu_for_netdev_mtu(netdev_mtu) == roce_mtu


def kernel_iboe_get_mtu(mtu):
    """ib_core's iboe_get_mtu() (include/rdma/ib_addr.h), transcribed:

        mtu = mtu - (IB_GRH_BYTES + IB_UDP_BYTES + IB_BTH_BYTES +
                     IB_EXT_XRC_BYTES + IB_EXT_ATOMICETH_BYTES +
                     IB_ICRC_BYTES);
        if (mtu >= ib_mtu_enum_to_int(IB_MTU_4096)) return IB_MTU_4096;
        else if (mtu >= ib_mtu_enum_to_int(IB_MTU_2048)) return IB_MTU_2048;
        ... down to IB_MTU_256; else return 0;

    with include/rdma/ib_pack.h's sizes GRH 40, UDP 8, BTH 12, XRC 4, AtomicETH 28, ICRC 4.
    Written out here, apart from the code under test, so a change to either shows."""
    mtu -= 40 + 8 + 12 + 4 + 28 + 4
    for ib_mtu in (4096, 2048, 1024, 512, 256):
        if mtu >= ib_mtu:
            return ib_mtu
    return None   # the kernel's 0: no IB MTU fits


def test_roce_mtu_follows_the_kernel_over_every_boundary():
    for netdev_mtu in range(1000, 9201):
        assert roce_mtu_for_netdev_mtu(netdev_mtu) == kernel_iboe_get_mtu(netdev_mtu), netdev_mtu


@pytest.mark.parametrize("netdev_mtu, roce_mtu", [(4191, 2048), (4192, 4096), (2143, 1024), (2144, 2048),
                                                  (1119, 512), (1120, 1024), (351, None), (352, 256)])
def test_roce_mtu_edges(netdev_mtu, roce_mtu):
    assert roce_mtu_for_netdev_mtu(netdev_mtu) == roce_mtu
