"""XLA block backward: recompute probabilities from the final lse.

Loop nest: `lax.scan` over kv tiles (dK/dV of the tile accumulate in the
inner carry), `lax.scan` over q tiles inside it (each emits its dQ
contribution, added to a dQ accumulator carried by the outer loop), and the
same per-tile `lax.switch` on EMPTY / PARTIAL / FULL as the forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_ringattn._src import vma
from flax_ringattn._src.backends.xla import common as c


def block_bwd(q, k, v, do, lse, delta, q_pos, kv_pos, q_seg, kv_seg, *, spec):
  """See `backends/base.py` for the contract."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  bq, bk = c.tiles(spec, T, S, backward=True)
  kinds = c.tile_kinds(spec.mask, q_pos, kv_pos, q_seg, kv_seg, bq, bk)  # [nq, nk]
  prec = spec.precision

  q_xs = (
    c.q_tiles(q, bq, K),
    c.q_tiles(do, bq, K),
    c.row_tiles(lse, bq, K),
    c.row_tiles(delta, bq, K),
    c.pos_tiles(q_pos, bq),
    c.seg_tiles(q_seg, bq),
  )

  def kv_tile(dq_acc, xs):
    k_j, v_j, kp_j, ks_j, kind_col = xs

    def update(masked):
      def f(carry, q_i, do_i, lse_i, dl_i, qp_i, qs_i):
        dk, dv = carry
        s, t = c.scores(q_i, k_j, spec)
        if masked:
          s = c.apply_mask(s, spec, qp_i, kp_j, qs_i, ks_j)
        # lse = -inf only for rows with no visible key anywhere; their s is
        # -inf everywhere, so shifting by 0 gives p = 0 (not NaN).
        p = jnp.exp(s - jnp.where(jnp.isneginf(lse_i), 0.0, lse_i)[..., None])
        dv = dv + jnp.einsum(
          "bkgqt,bkgqh->bkth", p.astype(do_i.dtype), do_i, preferred_element_type=c.F32, precision=prec
        )
        dp = jnp.einsum("bkgqh,bkth->bkgqt", do_i, v_j, preferred_element_type=c.F32, precision=prec)
        ds = p * (dp - dl_i[..., None])
        if t is not None:
          ds = ds * (1.0 - t * t)  # d(cap * tanh(x / cap)) / dx
        ds = (ds * spec.scale).astype(q_i.dtype)
        dq_i = jnp.einsum("bkgqt,bkth->bkgqh", ds, k_j, preferred_element_type=c.F32, precision=prec)
        dk = dk + jnp.einsum("bkgqt,bkgqh->bkth", ds, q_i, preferred_element_type=c.F32, precision=prec)
        return (dk, dv), dq_i

      return f

    def skip(carry, *_):
      return carry, vma.like(jnp.zeros((B, K, G, bq, H), c.F32), q)

    branches = [skip, update(masked=True), update(masked=False)]

    def q_step(carry, xs):
      *q_args, kind = xs
      return jax.lax.switch(kind, branches, carry, *q_args)

    zeros_kv = vma.like(jnp.zeros((B, K, bk, H), c.F32), q)
    (dk, dv), dq_t = jax.lax.scan(q_step, (zeros_kv, zeros_kv), (*q_xs, kind_col))
    return dq_acc + dq_t, (dk, dv)

  dq0 = vma.like(jnp.zeros((T // bq, B, K, G, bq, H), c.F32), q)
  kv_xs = (c.kv_tiles(k, bk), c.kv_tiles(v, bk), c.pos_tiles(kv_pos, bk), c.seg_tiles(kv_seg, bk), kinds.T)
  dq_t, (dk_t, dv_t) = jax.lax.scan(kv_tile, dq0, kv_xs)
  return c.q_untile(dq_t), c.kv_untile(dk_t), c.kv_untile(dv_t)
