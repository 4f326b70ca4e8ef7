"""XLA block forward: tiled online softmax, skipping EMPTY tiles.

Loop nest: `lax.map` over q tiles, `lax.scan` over kv tiles, and a
`lax.switch` per tile pair on its class (EMPTY: nothing, FULL: no mask
arithmetic, PARTIAL: elementwise mask).  At most one [bq, bk] f32 score tile
per head is live, and XLA's conditional really skips the untaken branch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_ringattn._src import vma
from flax_ringattn._src.backends.xla import common as c


def block_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, spec):
  """See `backends/base.py` for the contract."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  bq, bk = c.tiles(spec, T, S, backward=False)
  kinds = c.tile_kinds(spec.mask, q_pos, kv_pos, q_seg, kv_seg, bq, bk)  # [nq, nk]

  kt, vt = c.kv_tiles(k, bk), c.kv_tiles(v, bk)
  kpt, kst = c.pos_tiles(kv_pos, bk), c.seg_tiles(kv_seg, bk)

  def q_tile(xs):
    q_i, qp_i, qs_i, kind_row = xs

    def update(masked):
      def f(carry, k_j, v_j, kp_j, ks_j):
        m, l, acc = carry
        s, _ = c.scores(q_i, k_j, spec)
        if masked:
          s = c.apply_mask(s, spec, qp_i, kp_j, qs_i, ks_j)
        m_new = jnp.maximum(m, s.max(axis=-1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 instead so
        # exp() gives 0 rather than exp(-inf + inf) = NaN.
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[..., None])
        l = alpha * l + p.sum(axis=-1)
        pv = jnp.einsum(
          "bkgqt,bkth->bkgqh", p.astype(v_j.dtype), v_j, preferred_element_type=c.F32, precision=spec.precision
        )
        return m_new, l, alpha[..., None] * acc + pv

      return f

    branches = [lambda carry, *_: carry, update(masked=True), update(masked=False)]

    def kv_step(carry, xs):
      k_j, v_j, kp_j, ks_j, kind = xs
      return jax.lax.switch(kind, branches, carry, k_j, v_j, kp_j, ks_j), None

    init = (
      vma.like(jnp.full((B, K, G, bq), -jnp.inf, c.F32), q),
      vma.like(jnp.zeros((B, K, G, bq), c.F32), q),
      vma.like(jnp.zeros((B, K, G, bq, H), c.F32), q),
    )
    (m, l, acc), _ = jax.lax.scan(kv_step, init, (kt, vt, kpt, kst, kind_row))
    empty_row = l == 0.0
    o = acc / jnp.where(empty_row, 1.0, l)[..., None]
    lse = jnp.where(empty_row, -jnp.inf, m + jnp.log(jnp.where(empty_row, 1.0, l)))
    return o, lse

  o_t, lse_t = jax.lax.map(q_tile, (c.q_tiles(q, bq, K), c.pos_tiles(q_pos, bq), c.seg_tiles(q_seg, bq), kinds))
  return c.q_untile(o_t), c.row_untile(lse_t)
