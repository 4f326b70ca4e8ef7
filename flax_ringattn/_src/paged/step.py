"""The serving step a model's paged attention runs in, reachable from inside the model's own code.

A model's `__call__` passes no ragged metadata to its attention: `fr.ServingEngine` (`_src/serving/`) enters
`serving_step(...)` around its call of the model, and every paged attention the call reaches (a converted
`PagedMultiHeadAttention` called as the model calls it, a converted hand-written site) reads the step here.
Thread-local, so one trace per thread sees one step.

Kinds of step:
* "ragged": the new tokens of every slot back to back, `cu_q_lens` [S + 1] and `num_seqs` [1];
* "ring_prefill": one prompt of `num_tokens` tokens into slot `slot`, laid out for the ring prefill (padded,
  zigzag-ordered, sharded over the caches' sequence axis);
* "discover": an abstract call of the model, run once, in which each site records the cache it needs
  (`needs`) instead of attending.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

_LOCAL = threading.local()


@dataclasses.dataclass
class Step:
  kind: str  # "ragged" | "ring_prefill" | "discover"
  cu_q_lens: object = None  # [S + 1] int32
  num_seqs: object = None  # [1] int32
  slot: object = None  # ring prefill: the slot (int32 scalar)
  num_tokens: object = None  # ring prefill: the prompt's real tokens
  needs: list = dataclasses.field(default_factory=list)  # discover: (owner, key, CacheNeed) of each site
  # ragged: the step's page allocation, made once for all the caches (they share one page table), or None
  reservation: object = None


@dataclasses.dataclass(frozen=True)
class CacheNeed:
  """The shapes of the paged cache one site keeps."""

  num_kv_heads: int
  head_dim: int
  v_head_dim: int
  dtype: object


@contextlib.contextmanager
def serving_step(step: Step):
  """Makes `step` the current serving step for the duration (nesting restores the outer one)."""
  outer = getattr(_LOCAL, "step", None)
  _LOCAL.step = step
  try:
    yield step
  finally:
    _LOCAL.step = outer


def current() -> Step | None:
  """The serving step under way, or None outside `ServingEngine`'s calls of the model."""
  return getattr(_LOCAL, "step", None)
