"""The block contract: the one interface every ring backend implements.

A ring hop hands a backend one (q shard, kv shard) pair plus the global token
positions of both shards.  The backend knows nothing of rings, devices or
hops; the ring loop (`_src/ring/ring_loop.py`) knows nothing of tiles.

Forward::

    o, lse = backend.fwd(q, k, v, q_tok, kv_tok, spec=spec, out_dtype=None)

    q [B, T, N, H], k/v [B, S, K, H] (input dtype); q_tok / kv_tok: the
    `masks.Tokens` of the q and kv shards (positions [T] / [S] shared by every
    row, or [B, T] / [B, S] with `spec.mask.has_positions`; segment ids and
    bidirectional ids [B, T] / [B, S] or None), read by the kernels through
    `masks.tile_kinds` and `masks.pair_visible`.
    o   [B, T, N, H] float32, normalised over this block's keys only; in
                     `out_dtype` when given: a caller whose block output is
                     the call's output as it is (a ring of one, the
                     all-gather strategy, no sinks) has the kernel write it
                     in q's dtype, with no float32 copy and cast
    lse [B, N, T]    float32 log-sum-exp of this block's scores; -inf for a row
                     with no visible key in the block (its o row is 0)

Backward, given the *final* (whole-ring) lse and delta = rowsum(dO * O)::

    dq, dk, dv = backend.bwd(q, k, v, do, lse, delta, q_tok, kv_tok, spec=spec)

    do [B, T, N, H] (input dtype), lse / delta [B, N, T] float32
    dq [B, T, N, H], dk / dv [B, S, K, H], all float32, the contribution of this
    block pair (dk/dv already summed over the q heads of each GQA group).

Because the lse is final, exp(s - lse) are this block's true probabilities and
the block backward needs no state from other hops.

Attention dropout (`spec.dropout_rate > 0`): both calls also get
`dropout=` int32[4] (seed0, seed1, batch offset, head offset) and keep
probability (b, n, i, j) iff `dropout.keep(...)` of the *global* batch row
(offset + b), q head (offset + n), q position q_pos[i] and kv position
kv_pos[j] is true (`spec.dropout_broadcast`: batch and head are 0), scaling
kept ones by 1 / (1 - rate).  Dropout acts on the normalised probabilities: o
is dropped, lse is not; the backward masks dP the same way (the given delta
already uses the dropped O).  Without dropout the keyword is not passed, so a
backend that cannot drop must raise NotImplementedError from `check_supported`
when `spec.dropout_rate > 0`.
"""

from __future__ import annotations

from typing import Protocol

from flax_ringattn._src.options import AttentionSpec

__all__ = ["AttentionSpec", "BlockBackend"]


class BlockBackend(Protocol):
  """What the ring loop calls; see the module docstring for shapes."""

  name: str
  # True when every ring member must call fwd / bwd the same number of times
  # (the ring then never skips a masked hop with lax.cond; the kernels skip
  # its tiles instead).
  calls_must_be_uniform: bool

  def check_supported(self, *, dtype, spec: AttentionSpec, shapes: tuple[int, ...]) -> None:
    """Raises NotImplementedError for valid input this backend cannot run."""

  def fwd(self, q, k, v, q_tok, kv_tok, *, spec: AttentionSpec, dropout=None, out_dtype=None): ...

  def bwd(self, q, k, v, do, lse, delta, q_tok, kv_tok, *, spec: AttentionSpec, dropout=None): ...
