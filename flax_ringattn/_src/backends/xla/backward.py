"""XLA block backward: recompute probabilities from the final lse.

Loop nest: `lax.fori_loop` over q tiles (the tile's dQ accumulates in the
inner carry and is written into the dQ output once), `lax.fori_loop` over kv
tiles inside it (each adds its dK/dV contribution into the dK/dV outputs in
place), and the same per-tile `lax.switch` on EMPTY / PARTIAL / FULL as the
forward.  Tiles are dynamic slices of the shards (no tile-major copies); dQ,
dK and dV are carried by the outer loop, so a block costs its three outputs
plus a few tiles of memory.  With bk < bq the per-pair read-modify-write is
the small dK/dV tile, and each q-side tile (q, dO, lse, delta) is cut once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_ringattn._src import masks, vma
from flax_ringattn._src.backends.xla import common as c


def block_bwd(q, k, v, do, lse, delta, q_tok, kv_tok, *, spec, dropout=None):
  """See `backends/base.py` for the contract."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  bq, bk = c.tiles(spec, T, S, backward=True)
  kinds = masks.tile_kinds(spec.mask, q_tok, kv_tok, bq, bk)  # [nq, nk]
  prec = spec.precision

  def q_step(i, grads):
    q_i, do_i = c.q_tile(q, i, bq, K), c.q_tile(do, i, bq, K)
    lse_i, dl_i = c.row_tile(lse, i, bq, K), c.row_tile(delta, i, bq, K)
    qt_i = q_tok.slice(i * bq, bq)
    # lse = -inf only for rows with no visible key anywhere; their s is -inf
    # everywhere, so shifting by 0 gives p = 0 (not NaN).
    shift = jnp.where(jnp.isneginf(lse_i), 0.0, lse_i)[..., None]

    def update(masked):
      def f(carry, j):
        dq_i, dk_j, dv_j = carry
        k_j, v_j = c.kv_tile(k, j, bk), c.kv_tile(v, j, bk)
        kt_j = kv_tok.slice(j * bk, bk)
        s, t = c.scores(q_i, k_j, spec)
        if masked:
          s = c.apply_mask(s, spec, qt_i, kt_j)
        p = jnp.exp(s - shift)
        # The forward's dropout mask, regenerated from the same global indices.
        drop = c.dropout_scale(spec, dropout, qt_i.pos, kt_j.pos, p.shape)
        p_v = p if drop is None else p * drop
        dv_j = dv_j + jnp.einsum(
          "bkgqt,bkgqh->bkth", p_v.astype(do_i.dtype), do_i, preferred_element_type=c.F32, precision=prec
        )
        dp = jnp.einsum("bkgqh,bkth->bkgqt", do_i, v_j, preferred_element_type=c.F32, precision=prec)
        if drop is not None:
          dp = dp * drop
        ds = p * (dp - dl_i[..., None])
        if t is not None:
          ds = ds * (1.0 - t * t)  # d(cap * tanh(x / cap)) / dx
        ds = (ds * spec.scale).astype(q_i.dtype)
        dq_i = dq_i + jnp.einsum("bkgqt,bkth->bkgqh", ds, k_j, preferred_element_type=c.F32, precision=prec)
        dk_j = dk_j + jnp.einsum("bkgqt,bkgqh->bkth", ds, q_i, preferred_element_type=c.F32, precision=prec)
        return dq_i, dk_j, dv_j

      return f

    branches = [lambda carry, _: carry, update(masked=True), update(masked=False)]

    def kv_step(j, carry):
      dq_i, dk, dv = carry
      # Only tiles pass through the switch, never the whole dK / dV.
      tiles = (dq_i, c.kv_tile(dk, j, bk), c.kv_tile(dv, j, bk))
      dq_i, dk_j, dv_j = jax.lax.switch(kinds[i, j], branches, tiles, j)
      return dq_i, c.put_kv_tile(dk, dk_j, j), c.put_kv_tile(dv, dv_j, j)

    dq, dk, dv = grads
    dq_i = vma.like(jnp.zeros((B, K, G, bq, H), c.F32), q)
    dq_i, dk, dv = jax.lax.fori_loop(0, S // bk, kv_step, (dq_i, dk, dv))
    return c.put_q_tile(dq, dq_i, i), dk, dv

  # The gradient buffers wait for the hop's K/V and for delta (the end of the forward).
  grads = (
    vma.like(c.zeros_after((B, T, N, H), k, delta), q),
    vma.like(c.zeros_after(k.shape, k, delta), k),
    vma.like(c.zeros_after(v.shape, k, delta), k),
  )
  return jax.lax.fori_loop(0, T // bq, q_step, grads)
