"""Ceph for the target: the lab's development cluster, and (later) RADOS/RBD clients."""
