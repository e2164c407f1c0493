"""Planning and modelling a lossless RoCE fabric: PFC headroom, ECN, DCQCN (`nvmeof-roce fabric`).

- plan.py:      PFC headroom and xoff/xon by the mlx5 driver's and SONiC's formulas, ECN and DCQCN
                parameters, a saved plan the doctor compares a host against
- apply.py:     the commands that apply a plan (dcb, mlnx_qos, sysfs knobs; the switch's settings)
- simulate.py:  a discrete-time model of an incast with PFC and DCQCN, and a PFC deadlock in a ring
- plot.py:      PNG charts of the simulations (matplotlib, the `plot` extra)
- commands.py:  `nvmeof-roce fabric plan|simulate`

Pure computation: no I/O but reading and writing the plan and the PNGs.
"""
