"""Layout, tile math and the launch helper shared by the Pallas Triton kernels.

Head dims: q and k have head dim H, v, the output, do and dv Hv (MLA: Hv may
differ from H).  Triton tensors have power-of-two sizes and matmul dimensions
>= 16, so each of H and Hv is zero-padded to its own `planner.padded_head_dim`
(H = 24 -> 32, Hv = 16 stays 16; DeepSeek's 192 -> 256, 128 stays 128) when
the operands are stacked (`group_rows`, beside the transposing copy it makes),
and the results are sliced back.  Zero columns change nothing: they add 0 to
every q . k score and to do . v, and give zero columns of o, dq, dk and dv,
which the slice drops.

Layout inside the kernels: the G = N / K q heads of one kv head are stacked
token-major into rows, q `[B, N, T, H]` -> `[B, K, T * G, H]` with row
r = t * G + g, so that one kernel instance reads its kv tile once for the whole
group and the group shares one (G * bq, H) x (H, bk) matmul; every block is 2D
and no kernel reshapes a tensor (Triton's reshapes are restrictive).  Per-row
positions and segment ids are repeated G times to match the rows; the tile of
a row block is still `bq` tokens, so the tile-class table of
`masks.tile_kinds` applies unchanged.

Triton programs of a grid run in parallel, so (unlike the TPU kernels, which
accumulate over an "arbitrary" grid axis) each kernel owns one output tile and
loops over the other operand's tiles inside, with `lax.fori_loop`.  A
`lax.switch` on the tile class makes EMPTY tiles load nothing and run no
matmul, and FULL tiles skip the mask arithmetic.

Attention dropout (`spec.dropout_rate > 0`): the int32[4] dropout operand
(seed0, seed1, batch offset, head offset) is one more, whole, kernel input, and
each tile pair's keep mask is `dropout.keep` of the global indices: batch
offset + program_id(0), q head offset + kv head * G + (row % G), the stacked
rows' q positions and the kv tile's positions (loaded on FULL tiles too then).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from flax_ringattn._src import dropout as dropout_lib
from flax_ringattn._src import masks, vma
from flax_ringattn._src.backends.pallas_gpu import planner

F32 = jnp.float32
NT = (((1,), (1,)), ((), ()))  # [m, k] x [n, k]
NN = (((1,), (0,)), ((), ()))  # [m, k] x [k, n]
TN = (((0,), (0,)), ((), ()))  # [k, m] x [k, n]


def group_rows(x, K):
  """[B, T, N, H] -> [B, K, T * G, Hp] (row t * G + g is token t of q head k * G + g; Hp = padded H, zeros)."""
  B, T, N, H = x.shape
  G = N // K
  Hp = planner.padded_head_dim(H)
  x = x.reshape(B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)
  return x if Hp == H else jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, Hp - H)))


def ungroup_rows(x, N, H):
  """Inverse of `group_rows`: [B, K, T * G, Hp] -> [B, T, N, H] (the padding columns dropped)."""
  B, K, R, _ = x.shape
  G = N // K
  x = x[..., :H]
  return x.reshape(B, K, R // G, G, H).transpose(0, 2, 1, 3, 4).reshape(B, R // G, N, H)


def group_stats(x, K):
  """[B, N, T] -> [B, K, T * G] (the rows of `group_rows`)."""
  B, N, T = x.shape
  G = N // K
  return x.reshape(B, K, G, T).transpose(0, 1, 3, 2).reshape(B, K, T * G)


def ungroup_stats(x, N):
  B, K, R = x.shape
  G = N // K
  return x.reshape(B, K, R // G, G).transpose(0, 1, 3, 2).reshape(B, N, R // G)


def dot(a, b, dims, spec):
  return jax.lax.dot_general(a, b, dims, preferred_element_type=F32, precision=spec.precision)


def row_tokens(q_tok, B: int, G: int):
  """The q side's `masks.Tokens` for the stacked rows: every field [B, T * G] (row t * G + g is token t)."""
  return jax.tree.map(lambda a: jnp.repeat(a, G, axis=1), q_tok.per_row(B))


def token_specs(tokens, length: int, index_map):
  """A `masks.Tokens` of BlockSpecs: `length` entries of one batch row of every field."""
  return jax.tree.map(lambda _: pl.BlockSpec((None, length), index_map), tokens)


def load(tokens, index=...):
  """The values of a `masks.Tokens` of refs at `index` (all of a block by default)."""
  return jax.tree.map(lambda r: r[index], tokens)


def dropout_operand(spec, dropout):
  """([BlockSpec], [int32[4]]) of the dropout input (whole, one for all programs), or ([], []) without dropout."""
  if not dropout_lib.require_operand(spec.dropout_rate, dropout):
    return [], []
  return [pl.BlockSpec((4,), lambda *_: (0,))], [jnp.asarray(dropout, jnp.int32).reshape(4)]


def dropout_indices(spec, drop_ref, rows: int, G: int):
  """(seed0, seed1, b, head) for `dropout_scale`, read once per program (None without dropout).

  b is the global batch row of the program (a scalar); head [rows, 1] the global
  q head of each stacked row (row r = t * G + g of kv head program_id(1) is q
  head kv_head * G + g).  Both are 0 with `spec.dropout_broadcast`.
  """
  if drop_ref is None:
    return None
  seed0, seed1 = drop_ref[0], drop_ref[1]
  if spec.dropout_broadcast:
    return seed0, seed1, 0, 0
  b = drop_ref[2] + pl.program_id(0)
  g = jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), jnp.int32(G))
  head = drop_ref[3] + pl.program_id(1) * G + g
  return seed0, seed1, b, head


def dropout_scale(spec, idx, qp, kp):
  """keep / (1 - rate) as f32 [R, bk] for q positions qp [R] and kv positions kp [bk]; None without dropout."""
  if idx is None:
    return None
  seed0, seed1, b, head = idx
  keep = dropout_lib.keep(seed0, seed1, b, head, qp[:, None], kp[None, :], rate=spec.dropout_rate)
  return dropout_lib.keep_scale(keep, spec.dropout_rate)


def scores(q, k, qt, kt, *, spec, masked: bool):
  """Scaled, soft-capped and (if `masked`) masked f32 scores of one tile pair.

  q [R, H], k [bk, H]; qt / kt: the rows' and the kv tile's `masks.Tokens` ([R] / [bk] fields; None when not
  masked).  Returns s [R, bk] (masked entries -inf) and t = tanh(raw / cap) for the soft-cap gradient (None
  without a cap).
  """
  s = dot(q, k, NT, spec) * spec.scale
  t = None
  if spec.logits_soft_cap is not None:
    t = jnp.tanh(s / spec.logits_soft_cap)
    s = spec.logits_soft_cap * t
  if masked:
    s = jnp.where(masks.tile_visible(spec.mask, qt, kt), s, -jnp.inf)
  return s, t


def by_tile_kind(kind, carry, update):
  """update(carry, masked=...) on PARTIAL / FULL tiles; an EMPTY tile returns `carry` untouched (no loads)."""
  return jax.lax.switch(
    jnp.clip(kind, masks.EMPTY, masks.FULL),
    [lambda c: c, lambda c: update(c, masked=True), lambda c: update(c, masked=False)],
    carry,
  )


def tiles(spec, q, k, v, *, backward: bool):
  """(bq, bk) in tokens for one block (see `planner.block_tiles`)."""
  _, T, N, H = q.shape
  _, S, K, _ = k.shape
  Hv = v.shape[3]
  return planner.block_tiles(spec.block_sizes, T=T, S=S, N=N, K=K, H=H, Hv=Hv, dtype=q.dtype, backward=backward)


def call(
  kernel, *, grid, in_specs, out_specs, out_shapes, kernel_name, rows, bk, head_dim, v_head_dim, dtype, interpret, name
):
  """`pl.pallas_call` for the Triton lowering (or Pallas's generic interpreter when `interpret`).

  Inside `jax.shard_map(check_vma=True)`, compiled: the operands are made to
  vary over the same manual axes and the results are declared to vary over
  them too (as the TPU backend does).  Interpreted: the generic interpreter
  evaluates the kernel's loops, traced on refs without varying-axes types, on
  the varying operands, which JAX 0.10.2 rejects ("Scan carry input and output
  got mismatched varying manual axes").  So the call runs in a nested
  shard_map over no axes with check_vma=False, on copies of the operands made
  there (an op traced without the check drops the varying-axes type), and its
  results are marked varying again outside.
  """
  cfg = planner.launch_config(kernel_name, rows=rows, bk=bk, head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype)

  def launch(*args, manual_axis_type=None):
    shapes = [jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=manual_axis_type) for o in out_shapes]
    return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=list(in_specs),
      out_specs=list(out_specs),
      out_shape=shapes,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=bool(interpret),
      name=name,
    )(*args)

  def unchecked(*args):
    return launch(*jax.tree.map(lambda x: jax.lax.max(x, x), args))  # max(x, x) = x, traced without the vma check

  def run(*args):
    leaves, tree = jax.tree.flatten(args)  # arrays and `masks.Tokens` of arrays
    leaves = vma.unify(*leaves)
    args = jax.tree.unflatten(tree, leaves)
    if not any(vma.varying_axes(a) for a in leaves):
      return launch(*args)
    if not interpret:
      return launch(*args, manual_axis_type=vma.manual_axis_type(leaves[0]))
    mesh = jax.sharding.get_abstract_mesh()
    outs = jax.shard_map(unchecked, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=frozenset(), check_vma=False)(
      *args
    )
    return [vma.like(o, leaves[0]) for o in outs]

  return run
