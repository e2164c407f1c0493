"""The daemon around the protocol engine (engine/): `target serve` and its workers, live changes applied to the
running server (ops.py), metrics, the run directory, the target CLI; the control socket's server and methods are
control/'s."""
