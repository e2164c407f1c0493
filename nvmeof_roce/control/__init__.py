"""The control plane of a running userspace target: JSON-RPC methods, server, client, live changes."""
