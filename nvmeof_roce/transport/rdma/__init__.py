"""RDMA on rdma-core: the CM, the target's queues (pyverbs and native), the host side.

- verbs.py: the pyverbs import shim (`require_pyverbs`), the logger cache, and the helpers every module uses
  (a completion channel's fd, the CM's QP attributes as pyverbs' QPAttr)
- memory.py: registered memory and each port's `DataPool`
- cmchannel.py: the RDMA CM of the native module (csrc/cm_channel.c): events as plain data, ids as handles
- cm.py: `RdmaListener`, the target's listener (accept, reject, CM events)
- queue.py: `RdmaTargetQueue`, a target queue on pyverbs
- requests.py: `RequestBook`, the target queues' per-command state machine (no device)
- native_queue.py, native.py: target I/O queues whose data path runs in C (docs/native.md)
- pollgroups.py: threads that poll native queues (`--cores`)
- host.py, host_native.py: the initiator's queues (`RdmaConnector`), in Python and in C
"""
