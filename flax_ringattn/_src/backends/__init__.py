"""Backends: the kernels of every op, one folder per platform, below the ops.

`base.py` states the block contract of the ring; `registry.py` the selection rules every op's registry follows
(`ring/implementations.py`, `paged/implementations.py`).  A backend imports nothing of an op but the paged
folder's floor (`paged/common.py`, `paged/metadata.py`: input rules and the ragged-batch schedule, which import
nothing above them); `tests/test_structure.py` checks it.
"""
