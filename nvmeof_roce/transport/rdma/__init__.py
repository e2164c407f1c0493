"""RDMA on rdma-core: the CM, the target's queues (pyverbs and native), the host side."""
