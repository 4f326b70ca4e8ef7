"""Pallas TPU backend specifics: multi-tile skipping, TPU lowering, selection and errors.

The shared numerical suite (test_ring_attention.py) runs this backend on every
feature case; these tests cover what only this backend has.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import assert_block_output_is_the_cast
from conftest import make_mesh
from flax import nnx
from jax import export
from jax.sharding import PartitionSpec as P
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src import masks, validation
from flax_ringattn._src.backends.base import AttentionSpec
from flax_ringattn._src.backends.pallas_tpu import common
from flax_ringattn._src.backends.pallas_tpu.block.backward import block_bwd
from flax_ringattn._src.backends.pallas_tpu.block.forward import block_fwd
from flax_ringattn._src.testing.interpret import interpret_params, no_races
from flax_ringattn.testing import kernel_debug

interpret = pytest.mark.interpret


def test_fetch_index_points_empty_tiles_at_the_tile_in_vmem():
  """`fetch_index` points EMPTY steps at a tile already in VMEM."""
  E, P_, F = masks.EMPTY, masks.PARTIAL, masks.FULL
  kinds = jnp.array(
    [
      [F, P_, E, E],  # trailing empties keep the last live tile
      [E, E, P_, F],  # leading empties fetch the first live tile early
      [E, P_, E, F],  # a gap keeps the tile before it
      [E, E, E, E],  # nothing live: tile 0, once
    ]
  )
  np.testing.assert_array_equal(
    np.asarray(common.fetch_index(kinds)), [[0, 1, 1, 1], [2, 2, 2, 3], [1, 1, 1, 3], [0, 0, 0, 0]]
  )


def _inputs(B, T, S, N, K, H, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, S, K, H), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (B, T, N, H), jnp.float32).astype(dtype)
  return q, k, v, do


MULTI_TILE = [
  dict(is_causal=True),
  dict(is_causal=True, local_window_size=(150, 0)),
  dict(local_window_size=(40, 200)),
  dict(is_causal=True, segments=True),
]


@interpret
@pytest.mark.parametrize("opts", MULTI_TILE, ids=lambda o: "-".join(f"{k}" for k in o))
@pytest.mark.parametrize("n", [2])  # rings 1 and 4 run on 2 x 2 tiles in the shared suite
def test_many_tiles_per_shard(opts, n):
  """Shards of 256 tokens in 2 kv tiles and 4 q tiles: tile skipping, fetch redirection and masks across tiles."""
  opts = dict(opts)
  B, T, N, K, H = 1, 256 * n, 2, 1, 32  # one kv head with a GQA group of 2: interpret mode pays per grid step
  q, k, v, do = _inputs(B, T, T, N, K, H, jnp.float32)
  seg = None
  if opts.pop("segments", False):
    t = jnp.arange(T)
    seg = ((t >= 90).astype(jnp.int32) + (t >= 200) + (t >= 400))[None]  # documents cross tile edges
  _check_ring(q, k, v, do, seg, make_mesh((n,), ("sp",)), fr.BlockSizes(block_q=64, block_kv=128), opts)


def _check_ring(q, k, v, do, seg, mesh, blocks, opts, *, token_major=None):
  """ring_attention on the Pallas TPU kernels (interpret mode, race detector) against the reference: the output
  and the gradients of q, k and v, at q's dtype's tolerance.  `token_major` (a bool): whether the forward must
  read q token-major, as the [B, T * N, H] view of a shard that only that forward makes shows in the trace."""

  def ring(q, k, v):
    return fr.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      segment_ids=seg,
      implementation="pallas_tpu",
      interpret=interpret_params(),
      block_sizes=blocks,
      **opts,
    )

  if token_major is not None:
    B, T, N, H = q.shape
    view = f"[{B},{T // (1 if mesh is None else mesh.size) * N},{H}]"
    assert (view in str(jax.make_jaxpr(ring)(q, k, v))) == token_major, (view, token_major)
  with no_races():
    out, vjp = jax.vjp(jax.jit(ring), q, k, v)
    grads = vjp(do)
  ref_out, ref_vjp = jax.vjp(lambda q, k, v: fr.reference_attention(q, k, v, segment_ids=seg, **opts), q, k, v)
  assert_close(out, ref_out, q.dtype)
  assert_close(grads, ref_vjp(do), q.dtype, "grad")


TOKEN_MAJOR = [
  # (B, K, dtype, ring size, options): GQA on a ring of 2 (per-hop partials merged), MHA bf16, MQA with dropout
  # over two batch rows (the batch index of every token-major block, and dropout's batch offset)
  (1, 2, jnp.float32, 2, dict(is_causal=True, segments=True)),
  (1, 8, jnp.bfloat16, 1, dict(is_causal=True, logits_soft_cap=5.0)),
  (2, 1, jnp.float32, 1, dict(local_window_size=(40, 100), dropout_rate=0.25, dropout_rng=jax.random.key(3))),
]


@interpret
@pytest.mark.parametrize(
  "B, K, dtype, n, opts", TOKEN_MAJOR, ids=["gqa-ring2-seg", "mha-bf16-cap", "mqa-window-drop-b2"]
)
def test_token_major_forward(B, K, dtype, n, opts):
  """N = 8 heads of 128 and 128-row q tiles: the forward reads q and writes o and lse in the caller's token-major
  layout (`tiling.token_major_forward`), gathering each kv group's heads with strided loads and storing o with
  strided stores; forward and gradients against the reference, 2 x 2 tiles per shard."""
  opts = dict(opts)
  N, H, per_shard = 8, 128, 256
  T = per_shard * n
  q, k, v, do = _inputs(B, T, T, N, K, H, dtype)
  seg = None
  if opts.pop("segments", False):
    t = jnp.arange(T)
    seg = jnp.broadcast_to((t >= 90).astype(jnp.int32) + (t >= 300), (B, T))
  mesh = make_mesh((n,), ("sp",)) if n > 1 else None
  _check_ring(q, k, v, do, seg, mesh, fr.BlockSizes(block_q=128, block_kv=128), opts, token_major=True)


SUB_TILES = [
  # (B, N, K, dtype, ring size, options): 256 x 128 tiles, so a PARTIAL tile is two 128-row sub-tiles
  (1, 8, 2, jnp.float32, 2, dict(is_causal=True, segments=True)),  # token-major, a ring of 2
  (2, 4, 1, jnp.bfloat16, 1, dict(local_window_size=(100, 30), dropout_rate=0.25, dropout_rng=jax.random.key(5))),
]


@interpret
@pytest.mark.parametrize("B, N, K, dtype, n, opts", SUB_TILES, ids=["causal-seg-ring2", "window-drop-b2-bf16"])
def test_partial_tiles_in_sub_tiles(B, N, K, dtype, n, opts):
  """A PARTIAL forward tile of twice as many rows as columns is computed as two row sub-tiles, each classified on
  its own (`tiling.forward_sub_tiles`): causal diagonals and window edges give EMPTY, FULL and PARTIAL sub-tiles,
  and dropout's keep mask is hashed from the sub-tile's own positions.  Forward and gradients against the
  reference; the kernel traces a FULL body and two bodies per sub-tile (10 matmuls, 4 without sub-tiles)."""
  opts = dict(opts)
  T = 512 * n
  q, k, v, do = _inputs(B, T, T, N, K, 128, dtype)
  seg = None
  if opts.pop("segments", False):
    t = jnp.arange(T)
    seg = jnp.broadcast_to((t >= 200).astype(jnp.int32) + (t >= 700), (B, T))
  mesh = make_mesh((n,), ("sp",)) if n > 1 else None
  blocks = fr.BlockSizes(block_q=256, block_kv=128)
  _check_ring(q, k, v, do, seg, mesh, blocks, opts, token_major=N == 8)

  def kernel_matmuls():
    # The forward alone (no mesh), a new function each time (make_jaxpr caches by function): its kernel's matmuls
    def fwd(q, k, v):
      return fr.ring_attention(
        q, k, v, segment_ids=seg, implementation="pallas_tpu", interpret=True, block_sizes=blocks, **opts
      )

    return str(jax.make_jaxpr(fwd)(q, k, v)).count("dot_general")

  assert kernel_matmuls() == 10
  with kernel_debug(whole_partial_tiles=True):
    assert kernel_matmuls() == 4


VARIANTS = [
  # (N, K, H, dtype, KernelDebug fields, options)
  (8, 2, 128, jnp.float32, dict(natural_exp=True), dict(is_causal=True, segments=True)),
  (
    8,
    8,
    128,
    jnp.bfloat16,
    dict(forward_layout="heads_major"),
    # exp2 with a soft cap (log2(e) after the cap); a window (60, 0): q tile 0's kv tile 1 is a trailing EMPTY
    # step (its matmuls and DMA skipped); two batch rows
    dict(local_window_size=(60, 0), logits_soft_cap=30.0, batch=2),
  ),
  # The two-kernel backward (dq kernel + dk/dv kernel; the default elsewhere is the fused one, whose EMPTY tiles
  # write zero dq partials): 4 q heads per kv head, causal + segments (EMPTY, PARTIAL and FULL tiles).  (Its bf16,
  # window and soft-cap paths are the fused kernel's own `_probs_and_dscores`, run by every other test.)
  (8, 2, 128, jnp.float32, dict(fused_backward=False), dict(is_causal=True, segments=True)),
]


@interpret
@pytest.mark.parametrize(
  "N, K, H, dtype, variant, opts",
  VARIANTS,
  ids=["natural-exp-token-major", "cap-heads-major-bf16", "split-bwd-causal-segments"],
)
def test_kernel_variants(N, K, H, dtype, variant, opts):
  """The block kernels' A/B variants for chip runs (`KernelDebug.natural_exp`: the softmax with exp instead of in
  log2 units, token-major, 4 q heads per kv head; `forward_layout="heads_major"` where the token-major forward would
  run; `fused_backward=False`: a dq kernel and a dk/dv kernel instead of the fused one) compute the same attention:
  forward and gradients against the reference, 2 x 2 tiles, race-checked."""
  opts = dict(opts)
  T = 256
  q, k, v, do = _inputs(opts.pop("batch", 1), T, T, N, K, H, dtype)
  seg = None
  if opts.pop("segments", False):
    seg = (jnp.arange(T) >= 100).astype(jnp.int32)[None]
  token_major = N == 8 and variant.get("forward_layout") != "heads_major"
  with kernel_debug(**variant):
    _check_ring(q, k, v, do, seg, None, fr.BlockSizes(block_q=128, block_kv=128), opts, token_major=token_major)
    if variant.get("fused_backward") is False:  # the gradients above came from the two kernels
      loss = lambda q: fr.ring_attention(  # noqa: E731
        q, k, v, implementation="pallas_tpu", interpret=True, block_sizes=fr.BlockSizes(block_q=128, block_kv=128)
      ).sum()
      program = str(jax.make_jaxpr(jax.grad(loss))(q))
      assert "ring_block_bwd_dq" in program and "ring_block_bwd_dkv" in program
      assert "ring_block_bwd_fused" not in program
  with pytest.raises(ValueError, match="forward_layout must be 'heads_major' or None, got 'rows'"):
    kernel_debug(forward_layout="rows").__enter__()


@interpret
def test_block_output_in_the_callers_dtype():
  """A ring of one asks the block forward for o in q's dtype (`ring_loop.direct`): the kernel writes bf16 itself,
  bit for bit the float32 output cast, both layouts (`cases.assert_block_output_is_the_cast`; its compiled
  32-bit-word stores run in the chip tier).  With sinks, or on a ring of two, o stays float32."""
  with no_races():
    assert_block_output_is_the_cast(interpret=interpret_params())
  q, k, v = (jnp.ones((1, 256, 8, 128), jnp.bfloat16),) * 3

  def kernel_out_dtypes(**opts):
    f = lambda q, k, v: fr.ring_attention(q, k, v, implementation="pallas_tpu", interpret=True, **opts)  # noqa: E731

    def eqns(jaxpr):
      yield from jaxpr.eqns
      for sub in jax.extend.core.subjaxprs(jaxpr):
        yield from eqns(sub)

    calls = [e for e in eqns(jax.make_jaxpr(f)(q, k, v).jaxpr) if e.primitive.name == "pallas_call"]
    assert calls
    return {str(o.aval.dtype) for e in calls for o in e.outvars}

  assert "bfloat16" in kernel_out_dtypes()
  assert "bfloat16" not in kernel_out_dtypes(sinks=jnp.zeros((8,)))
  assert "bfloat16" not in kernel_out_dtypes(mesh=make_mesh((2,), ("sp",)))  # per-hop partials, merged in float32
  assert "bfloat16" in kernel_out_dtypes(mesh=make_mesh((2,), ("sp",)), strategy="all_gather")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(
  "segments,cap,dropout,Hv",
  [
    (False, None, False, None),
    (True, 30.0, False, None),
    (True, 30.0, True, None),
    (True, None, False, 128),
    ("positions", None, True, None),
  ],
  ids=["plain", "seg-cap", "seg-cap-dropout", "seg-mla", "positions-chunk-spans-dropout"],
)
def test_kernels_lower_to_mosaic_for_tpu(dtype, segments, cap, dropout, Hv):
  """jax.export runs the Pallas -> Mosaic lowering for TPU on this CPU machine: block shapes, index maps and
  kernel ops (the dropout hash's wrapping int32 multiplies and logical shifts included) must all be accepted by
  the TPU lowering (Mosaic's own compiler passes run only on a TPU).  MLA: DeepSeek's qk 192, v 128 (the
  heads-major forward).  "plain" also lowers the forward's row sub-tiles (256 x 128 tiles)."""
  terms = dict(chunk_size=64, has_bidirectional=True, has_positions=True) if segments == "positions" else {}
  plain = not segments
  spec = AttentionSpec(
    mask=masks.MaskSpec(is_causal=True, window=(300, 0), has_segments=bool(segments), **terms),
    scale=0.1,
    logits_soft_cap=cap,
    block_sizes=fr.BlockSizes(block_q=256, block_kv=128) if plain else fr.BlockSizes(block_q=128, block_kv=256),
    dropout_rate=0.1 if dropout else 0.0,
    dropout_broadcast=False,
  )
  B, T, N, K, H = 2, 512, 8, 2, 128 if Hv is None else 192
  sds = jax.ShapeDtypeStruct
  q, k = sds((B, T, N, H), dtype), sds((B, T, K, H), dtype)
  v, do = sds((B, T, K, Hv or H), dtype), sds((B, T, N, Hv or H), dtype)
  pos = sds((B, T) if segments == "positions" else (T,), jnp.int32)
  seg = sds((B, T), jnp.int32) if segments else None
  stat = sds((B, N, T), jnp.float32)
  drop = sds((4,), jnp.int32) if dropout else None
  bid = jnp.zeros((B, T), jnp.int32) if segments == "positions" else None  # closed over: a constant
  fwd = jax.jit(
    lambda q, k, v, qp, kp, qs, ks, d: block_fwd(
      q,
      k,
      v,
      masks.Tokens(qp, qs, bid),
      masks.Tokens(kp, ks, bid),
      spec=spec,
      interpret=None,
      dropout=d,
      out_dtype=dtype,  # bf16: o stored through 32-bit words (`common.store_strided_rows`)
    )
  )
  bwd_of = lambda spec: jax.jit(  # noqa: E731
    lambda q, k, v, do, lse, dl, qp, kp, qs, ks, d: block_bwd(
      q, k, v, do, lse, dl, masks.Tokens(qp, qs, bid), masks.Tokens(kp, ks, bid), spec=spec, interpret=None, dropout=d
    )
  )
  bwd = bwd_of(spec)
  text = export.export(fwd, platforms=("tpu",))(q, k, v, pos, pos, seg, seg, drop).mlir_module()
  text += export.export(bwd, platforms=("tpu",))(q, k, v, do, stat, stat, pos, pos, seg, seg, drop).mlir_module()
  assert text.count("tpu_custom_call") == 2  # forward, the fused backward
  bwd = bwd_of(dataclasses.replace(spec, block_sizes=dataclasses.replace(spec.block_sizes, fused_bwd=False)))
  text = export.export(bwd, platforms=("tpu",))(q, k, v, do, stat, stat, pos, pos, seg, seg, drop).mlir_module()
  assert text.count("tpu_custom_call") == 2  # the two-kernel backward: dq, dk/dv


@pytest.fixture
def fresh_traces():
  """Tests that patch a planner constant: the block kernels' jit caches its traces by shapes and options, so the
  caches are cleared around them (a trace under the patch must not serve the tests after)."""
  jax.clear_caches()
  yield
  jax.clear_caches()


def _backward_kernels(q, k, v, block_sizes) -> set[str]:
  """The block backward kernels in the gradient's jaxpr (traced only) of a ring of one on q, k, v."""
  loss = lambda q: fr.ring_attention(  # noqa: E731
    q, k, v, implementation="pallas_tpu", interpret=True, is_causal=True, block_sizes=block_sizes
  ).sum()
  program = str(jax.make_jaxpr(jax.grad(loss))(q))
  return {n for n in ("ring_block_bwd_fused", "ring_block_bwd_dq", "ring_block_bwd_dkv") if n in program}


def test_backward_is_fused_unless_its_dq_partials_do_not_fit(monkeypatch, fresh_traces):
  """`BlockSizes.fused_bwd`: None (the default, and the planner's choice) runs the fused backward; False the dq and
  dk/dv kernels; None where one kv tile's dq partial ([B, N, T, H]) alone would pass FUSED_DQ_MAX_BYTES the two
  kernels too (HBM the call did not plan for; a larger total runs in kv chunks, `test_fused_backward_in_kv_chunks`)."""
  from flax_ringattn._src.backends.pallas_tpu.planners import block as block_planner

  q, k, v, _ = _inputs(2, 256, 256, 8, 2, 128, jnp.bfloat16)
  tiles = fr.BlockSizes(block_q=128, block_kv=128)
  assert _backward_kernels(q, k, v, tiles) == {"ring_block_bwd_fused"}
  assert _backward_kernels(q, k, v, None) == {"ring_block_bwd_fused"}  # the planner's tiles
  split = {"ring_block_bwd_dq", "ring_block_bwd_dkv"}
  assert _backward_kernels(q, k, v, dataclasses.replace(tiles, fused_bwd=False)) == split
  # 2 kv tiles x [2, 8, 256, 128] bf16 = 2 MiB of partials, 1 MiB a tile: one byte less allowed, and the two run
  partials = block_planner.fused_dq_bytes(B=2, T=256, S=256, N=8, H=128, bk=128, dtype=jnp.bfloat16)
  assert partials == 2 * 2**20
  monkeypatch.setattr(block_planner, "FUSED_DQ_MAX_BYTES", partials // 2 - 1)
  jax.clear_caches()  # the block kernels' jit traced these shapes with the bound unpatched
  assert _backward_kernels(q, k, v, tiles) == split
  assert _backward_kernels(q, k, v, dataclasses.replace(tiles, fused_bwd=True)) == {"ring_block_bwd_fused"}
  with pytest.raises(TypeError, match=r"BlockSizes.fused_bwd must be a bool or None, got 1"):
    fr.BlockSizes(fused_bwd=1)


@interpret
def test_fused_backward_in_kv_chunks(monkeypatch, fresh_traces):
  """Where the dq partials would pass FUSED_DQ_MAX_BYTES the fused backward runs over kv chunks (a scan of kernel
  calls, here 2 chunks of one kv tile): forward and gradients still match the reference, with causal + segments
  (EMPTY, PARTIAL and FULL tiles) and dropout (hashed from global positions, so a chunk drops what the whole
  would), race-checked."""
  from flax_ringattn._src.backends.pallas_tpu.planners import block as block_planner

  T, tiles = 256, fr.BlockSizes(block_q=64, block_kv=128)
  q, k, v, do = _inputs(1, T, T, 8, 2, 128, jnp.float32)
  seg = (jnp.arange(T) >= 100).astype(jnp.int32)[None]
  monkeypatch.setattr(block_planner, "FUSED_DQ_MAX_BYTES", 8 * T * 128 * 4)  # one kv tile's f32 partial
  jax.clear_caches()  # no trace of these shapes from before the patch
  opts = dict(is_causal=True, dropout_rate=0.2, dropout_rng=jax.random.key(7))
  assert block_planner.fused_dq_chunks(B=1, T=T, S=T, N=8, H=128, bk=128, dtype=jnp.float32) == 2
  loss = lambda q: fr.ring_attention(  # noqa: E731
    q, k, v, segment_ids=seg, implementation="pallas_tpu", interpret=True, block_sizes=tiles, **opts
  ).sum()
  program = str(jax.make_jaxpr(jax.grad(loss))(q))
  assert "scan" in program and "ring_block_bwd_fused" in program and "ring_block_bwd_dq" not in program
  # The scan's float32 dq accumulator is tied to do (an optimization barrier), not a free constant XLA may place
  # early: compiled for a v5e, every layer of a remat'd 24-block decoder at 32k held its own at once.
  assert "optimization_barrier" in program
  _check_ring(q, k, v, do, seg, None, tiles, opts)


def test_layers_with_the_same_shapes_share_one_kernel_trace():
  """The backend's block kernels sit behind one jit each (`pallas_tpu._block_fwd` / `_block_bwd`): two calls with the
  same shapes and options, as two decoder layers make, lower to one Mosaic kernel per direction that both call,
  not one per call (lowered for TPU on this CPU machine); another shape gets its own."""
  from flax_ringattn._src.backends.pallas_tpu import PallasTpuBackend

  spec = AttentionSpec(
    mask=masks.MaskSpec(is_causal=True), scale=0.125, block_sizes=fr.BlockSizes(block_q=128, block_kv=128)
  )
  backend = PallasTpuBackend()
  sds = jax.ShapeDtypeStruct
  T = 256
  pos = jnp.arange(T, dtype=jnp.int32)

  def two_layers(q, k, v, q2):
    tok = masks.Tokens(pos)
    o1, _ = backend.fwd(q, k, v, tok, tok, spec=spec, out_dtype=q.dtype)
    o2, _ = backend.fwd(o1.astype(q.dtype) + q, k, v, tok, tok, spec=spec, out_dtype=q.dtype)
    o3, _ = backend.fwd(
      q2,
      q2,
      q2,
      masks.Tokens(jnp.arange(2 * T, dtype=jnp.int32)),
      masks.Tokens(jnp.arange(2 * T, dtype=jnp.int32)),
      spec=spec,
      out_dtype=q.dtype,
    )
    return o2, o3

  q = sds((1, T, 4, 128), jnp.bfloat16)
  q2 = sds((1, 2 * T, 4, 128), jnp.bfloat16)
  text = export.export(jax.jit(two_layers), platforms=("tpu",))(q, q, q, q2).mlir_module()
  assert text.count("tpu_custom_call") == 2  # one forward kernel for both T = 256 calls, one for T = 512


def test_selection_and_errors():
  q = k = v = jnp.zeros((1, 64, 2, 16))
  if jax.default_backend() != "tpu":
    assert "pallas_tpu" in fr.available_implementations()
    with pytest.raises(NotImplementedError, match=r"pallas_tpu needs a TPU .* pass interpret=True"):
      fr.ring_attention(q, k, v, implementation="pallas_tpu")
    # implementation=None off TPU falls back to XLA (the result is checked elsewhere).
    fr.ring_attention(q, k, v)
  with pytest.raises(ValueError, match=r"interpret=... applies to implementation='pallas_tpu' only"):
    fr.ring_attention(q, k, v, implementation="xla", interpret=True)
  with pytest.raises(TypeError, match=r"interpret must be a bool, None or a .*InterpretParams, got 'yes'"):
    fr.ring_attention(q, k, v, implementation="pallas_tpu", interpret="yes")
  with pytest.raises(NotImplementedError, match=r"pallas_tpu supports float32 and bfloat16 inputs, got dtype=float16"):
    h = q.astype(jnp.float16)
    fr.ring_attention(h, h, h, implementation="pallas_tpu", interpret=True)


@interpret
def test_interpret_alone_selects_the_kernels():
  """interpret= without implementation= still picks pallas_tpu, deprecated: one DeprecationWarning per process (its
  key is discarded first: another test may have spent it), and the Pallas kernels run."""
  q, k, v, _ = _inputs(1, 64, 64, 2, 2, 16, jnp.float32)
  validation._warned.discard(("ring_attention", "interpret"))
  match = r"ring_attention: interpret=\.\.\. without implementation= picks implementation='pallas_tpu'"
  with pytest.warns(DeprecationWarning, match=match) as record:
    jaxpr = str(jax.make_jaxpr(lambda q, k, v: fr.ring_attention(q, k, v, interpret=interpret_params()))(q, k, v))
    with no_races():
      out = fr.ring_attention(q, k, v, is_causal=True, interpret=interpret_params())
  assert len([r for r in record if "without implementation=" in str(r.message)]) == 1
  assert "pallas_call" in jaxpr
  assert_close(out, fr.reference_attention(q, k, v, is_causal=True), jnp.float32)


@interpret
def test_layer_with_interpret_matches_mha():
  """The one-line swap, with the TPU kernels interpreted on a 2-device ring."""
  mesh = make_mesh((2,), ("sp",))
  kw = dict(num_heads=4, in_features=32, qkv_features=32, decode=False, rngs=nnx.Rngs(0))
  mha = nnx.MultiHeadAttention(**kw)
  ring = fr.RingMultiHeadAttention(
    **kw,
    mesh=mesh,
    seq_axis="sp",
    implementation="pallas_tpu",
    interpret=interpret_params(),
    block_sizes=fr.BlockSizes(block_q=32, block_kv=128),
  )
  nnx.update(ring, nnx.state(mha))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 64, 32))
  expected = mha(x, is_causal=True)
  x = jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, P(None, "sp", None)))
  with no_races():  # jitted: eager dispatch of every interpreted kernel op would take a minute
    got = nnx.jit(lambda layer, x: layer(x, is_causal=True))(ring, x)
  assert_close(got, expected, jnp.float32)
