"""`available_implementations(op=...)`: the names each op's registry accepts."""

from __future__ import annotations

from flax_ringattn._src.paged.implementations import PAGED
from flax_ringattn._src.ring.implementations import RING

_REGISTRIES = {"ring": RING, "paged": PAGED}


def available_implementations(op: str = "ring") -> tuple[str, ...]:
  """Every `implementation=` name of `ring_attention` (op="ring") or `paged_attention` (op="paged"), aliases
  first, then in the order `implementation=None` tries them."""
  if op not in _REGISTRIES:
    raise ValueError(f"unknown {op=}; choose one of {tuple(_REGISTRIES)}")
  return _REGISTRIES[op].names()
