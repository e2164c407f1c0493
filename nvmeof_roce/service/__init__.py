"""The daemon around the protocol engine (target/): `target serve` and its workers, the control socket, live
changes, metrics, the target CLI."""
