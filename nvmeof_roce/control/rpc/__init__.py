"""The control socket's methods by family, one module each, gathered by control/methods.py's `Control`."""
