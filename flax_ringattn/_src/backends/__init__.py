"""Backends: the kernels of every op, one folder per platform, below the ops.

`base.py` states the block contract of the ring; `registry.py` the selection rules every op's registry follows
(`ring/implementations.py`, `paged/implementations.py`).  A backend imports nothing of an op: what the paged
backends share with the paged op (the ragged batch's schedule, pages as stored) is `_src/ragged.py`, below both;
`tests/test_structure.py` and `tests/test_paged_floors.py` check it.
"""
