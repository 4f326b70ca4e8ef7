"""Drafts for speculative decoding: who proposes the tokens `ServingEngine` verifies in one step.

A draft is any object with `propose(contexts, max_tokens) -> list[list[int]]`: for each sequence (its prompt and
the tokens generated so far, a list of ints) at most `max_tokens[i]` proposed next tokens, possibly none.  The
engine feeds a sequence's last token and its proposals as that sequence's rows of one ragged step, keeps the
longest prefix the model itself would have produced, and rolls the rest back out of the cache, so the output is
the model's whatever the draft proposes: a draft only changes how many steps it takes.  A draft model plugs in
through the same method (batched: one call per step for every decoding sequence).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol


class Draft(Protocol):
  def propose(self, contexts: Sequence[Sequence[int]], max_tokens: Sequence[int]) -> list[list[int]]: ...


@dataclasses.dataclass(frozen=True)
class NGramDraft:
  """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last `n` tokens.

  Proposes up to `k` tokens per sequence, found in the sequence's own prompt and output (no second model).  It
  pays off where the output repeats its context (code edits, retrieval, summaries that quote).
  """

  n: int = 2
  k: int = 4

  def __post_init__(self):
    for name in ("n", "k"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"NGramDraft: {name} must be a positive int, got {name}={value!r}")

  def propose(self, contexts, max_tokens):
    return [self._one(list(c), min(self.k, int(m))) for c, m in zip(contexts, max_tokens, strict=True)]

  def _one(self, context: list[int], limit: int) -> list[int]:
    n = self.n
    if limit <= 0 or len(context) <= n:
      return []
    tail = context[-n:]
    # The latest earlier occurrence: its continuation is the best guess of what comes next.
    for start in range(len(context) - n - 1, -1, -1):
      if context[start : start + n] == tail:
        return context[start + n : start + n + limit]
    return []
