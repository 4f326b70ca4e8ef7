"""Backends: the kernels of every op, one folder per platform, below the ops.

`base.py` states the block contract of the ring; `registry.py` the selection rules every op's registry follows
(`ring/implementations.py`, `paged/implementations.py`).  A backend never imports an op.
"""
