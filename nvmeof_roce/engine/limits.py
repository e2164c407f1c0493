"""The userspace target's limits, in one place: what it advertises (Identify Controller, CAP) and enforces.

Spec fields are named where a limit shows up on the wire; docs/protocol.md §1.6, §3.4 and §5.2 explain
what the Linux host does with them.
"""

from ..transport.resources import DEFAULT_MDTS

# Data transfer (docs/protocol.md §3.4): MDTS in units of the 4 KiB minimum page size, `serve --mdts`
# (ResourceLimits.mdts; the kernel host splits larger block I/O, passthrough commands cannot be split).
MDTS = DEFAULT_MDTS  # a running target's: Target.limits.mdts, Target.max_transfer

# Namespaces: Identify Controller NN, the highest NSID a subsystem may use.
MAX_NSID = 1024

# Queues (docs/protocol.md §1.6): the defaults are nvmet's (inline_data_size = PAGE_SIZE, max_queue_size 128).
DEFAULT_IN_CAPSULE_SIZE = 4096
DEFAULT_QUEUE_SIZE = 128  # CAP.MQES = 127
MIN_QUEUE_SIZE = 16
MAX_QUEUE_SIZE = 1024
MAX_QUEUES = 4096  # queues per target before CM connects are refused with "no resources"

# Per controller (Identify Controller AERL and ELPE are these minus one, 0's based).
MAX_AER = 4
ERROR_LOG_ENTRIES = 64

# Controllers (docs/security.md "Limits"): per host NQN first, so that one host cannot take every controller,
# then over the whole target.  I/O controllers' global cap is `--max-controllers` (ResourceLimits); discovery
# controllers have their own, so discovery keeps working when the I/O controllers are all taken and the other
# way round.  A host needs one I/O controller per subsystem and path, one discovery controller per port.
MAX_CONTROLLERS_PER_HOST = 64  # I/O controllers one host NQN may hold
MAX_DISCOVERY_CONTROLLERS_PER_HOST = 8  # discovery controllers one host NQN may hold
MAX_DISCOVERY_CONTROLLERS = 64  # discovery controllers over all hosts
