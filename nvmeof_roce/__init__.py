"""nvmeof-roce: NVMe over Fabrics on RDMA over Converged Ethernet."""

__version__ = "0.1.0"
