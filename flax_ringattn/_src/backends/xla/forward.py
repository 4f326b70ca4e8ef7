"""XLA block forward: tiled online softmax, skipping EMPTY tiles.

Loop nest: `lax.fori_loop` over q tiles, `lax.fori_loop` over kv tiles, and a
`lax.switch` per tile pair on its class (EMPTY: nothing, FULL: no mask
arithmetic, PARTIAL: elementwise mask).  Tiles are dynamic slices of the
shards (no tile-major copies); each q tile's o and lse are written into the
outputs carried by the outer loop.  At most one [bq, bk] f32 score tile per
head is live, and XLA's conditional really skips the untaken branch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_ringattn._src import masks, vma
from flax_ringattn._src.backends.xla import common as c


def block_fwd(q, k, v, q_tok, kv_tok, *, spec, dropout=None):
  """See `backends/base.py` for the contract."""
  B, T, N, _ = q.shape
  S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
  G = N // K
  bq, bk = c.tiles(spec, T, S, backward=False)
  kinds = masks.tile_kinds(spec.mask, q_tok, kv_tok, bq, bk)  # [nq, nk]

  def q_step(i, out):
    q_i = c.q_tile(q, i, bq, K)
    qt_i = q_tok.slice(i * bq, bq)

    def update(masked):
      def f(carry, j):
        m, l, acc = carry
        k_j, v_j = c.kv_tile(k, j, bk), c.kv_tile(v, j, bk)
        kt_j = kv_tok.slice(j * bk, bk)
        s, _ = c.scores(q_i, k_j, spec)
        if masked:
          s = c.apply_mask(s, spec, qt_i, kt_j)
        m_new = jnp.maximum(m, s.max(axis=-1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 instead so
        # exp() gives 0 rather than exp(-inf + inf) = NaN.
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l = alpha * l + p.sum(axis=-1)
        # Dropout drops normalised probabilities: the row sum l keeps them all.
        drop = c.dropout_scale(spec, dropout, qt_i.pos, kt_j.pos, p.shape)
        p_v = p if drop is None else p * drop
        pv = jnp.einsum(
          "bkgqt,bkth->bkgqh", p_v.astype(v_j.dtype), v_j, preferred_element_type=c.F32, precision=spec.precision
        )
        return m_new, l, alpha[..., None] * acc + pv

      return f

    branches = [lambda carry, _: carry, update(masked=True), update(masked=False)]

    def kv_step(j, carry):
      return jax.lax.switch(kinds[i, j], branches, carry, j)

    init = (
      vma.like(jnp.full((B, K, G, bq), -jnp.inf, c.F32), q),
      vma.like(jnp.zeros((B, K, G, bq), c.F32), q),
      vma.like(jnp.zeros((B, K, G, bq, Hv), c.F32), q),
    )
    m, l, acc = jax.lax.fori_loop(0, S // bk, kv_step, init)
    empty_row = l == 0.0
    o_i = acc / jnp.where(empty_row, 1.0, l)[..., None]
    lse_i = jnp.where(empty_row, -jnp.inf, m + jnp.log(jnp.where(empty_row, 1.0, l)))
    o, lse = out
    return c.put_q_tile(o, o_i, i), c.put_row_tile(lse, lse_i, i)

  # The outputs wait for the hop's K (it comes out of the ring loop on the last hop).
  out = (vma.like(c.zeros_after((B, T, N, Hv), k), q), vma.like(c.zeros_after((B, N, T), k), q))
  return jax.lax.fori_loop(0, T // bq, q_step, out)
