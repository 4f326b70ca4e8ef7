"""Pallas GPU (Triton) backend specifics: selection and errors, planner, tile skipping, float16, padded and
MLA head dims (v head dim != q/k's).

The shared numerical suite (test_ring_attention.py) runs this backend on every
feature case in Pallas's generic interpreter; these tests cover what only this
backend has.  Off GPU the kernels run with interpret=True; on a GPU
(`benchmarks/gpu_check.sh`) the tests marked `gpu` run them compiled.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import assert_dropout_matches_reference, dropout, make_case, make_inputs, reference_with_grads
from conftest import make_mesh
from jax import export
from jax.experimental.pallas import tpu as pltpu
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src import masks
from flax_ringattn._src.backends import pallas_gpu
from flax_ringattn._src.backends.base import AttentionSpec
from flax_ringattn._src.backends.pallas_gpu import PallasGpuBackend, planner
from flax_ringattn._src.backends.pallas_gpu import common as gpu_common
from flax_ringattn._src.backends.pallas_gpu.backward import block_bwd
from flax_ringattn._src.backends.pallas_gpu.forward import block_fwd
from flax_ringattn._src.ring.implementations import get_backend


def interpret(test):
  """The `interpret` timeout; Pallas's generic interpreter has no race detector (and these kernels no DMAs)."""
  return pytest.mark.races_not_read("Triton interpret mode: no race detector")(pytest.mark.interpret(test))


ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU  # on a GPU the same tests run the compiled Triton kernels


def _inputs(B, T, S, N, K, H, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (B, S, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, S, K, H), jnp.float32).astype(dtype)
  do = jax.random.normal(ks[3], (B, T, N, H), jnp.float32).astype(dtype)
  return q, k, v, do


@pytest.mark.skipif(ON_GPU, reason="checks the errors raised off GPU")
def test_selection_and_errors_off_gpu(caplog):
  q = k = v = jnp.zeros((1, 64, 2, 16))
  assert "pallas_gpu" in fr.available_implementations()
  with pytest.raises(NotImplementedError, match=r"pallas_gpu needs an NVIDIA GPU \(default backend is 'cpu'\); pass "):
    fr.ring_attention(q, k, v, implementation="pallas_gpu")
  with pytest.raises(NotImplementedError, match=r"pallas_gpu needs an NVIDIA GPU"):
    fr.ring_attention(q, k, v, implementation="pallas_gpu", interpret=False)
  # implementation=None skips the GPU kernels off GPU, says why, and runs XLA.
  with caplog.at_level(logging.INFO, logger="flax_ringattn"):
    spec = AttentionSpec(mask=masks.MaskSpec(), scale=0.25)
    backend = get_backend(None, dtype=jnp.float32, spec=spec, shapes=(q.shape, k.shape))
  assert backend.name == "xla"
  assert "implementation=None skips pallas_gpu: pallas_gpu needs an NVIDIA GPU" in caplog.text


def test_interpret_argument_errors():
  q = k = v = jnp.zeros((1, 64, 2, 16))
  with pytest.raises(TypeError, match=r"implementation='pallas_gpu' runs in Pallas's generic interpreter: interpret "):
    fr.ring_attention(q, k, v, implementation="pallas_gpu", interpret=pltpu.InterpretParams())
  with pytest.raises(TypeError, match=r"interpret must be True, False or None, got 'yes'"):
    fr.ring_attention(q, k, v, implementation="pallas_gpu", interpret="yes")
  with pytest.raises(
    ValueError,
    match=r"applies to implementation='pallas_tpu' only \(or 'pallas_tpu_ring'; or 'pallas_gpu' with interpret",
  ):
    fr.ring_attention(q, k, v, implementation="xla", interpret=True)


def test_unsupported_shapes_and_dtypes():
  spec = AttentionSpec(mask=masks.MaskSpec(), scale=0.25)
  backend = PallasGpuBackend(interpret=True)
  with pytest.raises(
    NotImplementedError, match=r"pallas_gpu supports float32, bfloat16 and float16 inputs, got dtype="
  ):
    backend.check_supported(dtype=jnp.int8, spec=spec, shapes=((1, 64, 2, 16), (1, 64, 2, 16)))
  # Any head dim: the kernels pad q/k's and v's each to a power of two >= 16 (test_padded_mla_head_dims_with_dropout).
  backend.check_supported(dtype=jnp.float32, spec=spec, shapes=((1, 64, 2, 24), (1, 64, 2, 24)))
  with pytest.raises(NotImplementedError, match=r"power-of-two number of q heads per kv head .* got N=6, K=2 \(3 per"):
    fr.ring_attention(
      jnp.zeros((1, 64, 6, 16)), *[jnp.zeros((1, 64, 2, 16))] * 2, implementation="pallas_gpu", interpret=True
    )


@interpret
def test_tile_errors():
  x = jnp.zeros((1, 40, 2, 16))  # 40 = 8 * 5: no power-of-two tile >= 16 divides it
  with pytest.raises(
    NotImplementedError, match=r"no power-of-two block_q tile in \[16, 512\] divides the shard length 40"
  ):
    fr.ring_attention(x, x, x, implementation="pallas_gpu", interpret=True, block_sizes=fr.BlockSizes())
  y = jnp.zeros((1, 64, 2, 16))
  with pytest.raises(ValueError, match=r"BlockSizes block_kv=8 is below the smallest GPU tile here, 16 tokens"):
    fr.ring_attention(y, y, y, implementation="pallas_gpu", interpret=True, block_sizes=fr.BlockSizes(block_kv=8))


def test_planner():
  # The table's GPUs: the default tiles fit, with the 128-row forward tile at head_dim 128, GQA 4:1, bf16.
  for arch in planner.SMEM_PER_BLOCK:
    b = planner.plan_block_sizes(4096, 4096, 32, 8, 128, jnp.bfloat16, arch=arch)
    for kernel, (bq, bk) in (("fwd", (b.block_q, b.block_kv)), ("dq", b.bwd), ("dkv", b.bwd)):
      cfg = planner.launch_config(kernel, rows=4 * bq, bk=bk, head_dim=128, dtype=jnp.bfloat16, arch=arch)
      assert cfg.smem_bytes <= planner.SMEM_PER_BLOCK[arch] * planner.SAFETY_MARGIN
  h100 = planner.plan_block_sizes(4096, 4096, 32, 8, 128, jnp.bfloat16, arch="sm_90")
  assert (4 * h100.block_q, h100.block_kv) == (128, 64)
  # A T4 cannot hold bf16 tiles of 128 rows at head_dim 256 and must shrink them.
  t4 = planner.plan_block_sizes(4096, 4096, 8, 8, 256, jnp.bfloat16, arch="sm_75")
  assert t4.block_q < 128 and t4.bwd[0] < 64
  with pytest.raises(ValueError, match=r"the dq tile of 16 q rows x 16 kv tokens with head_dim=256 \(float32\)"):
    planner.plan_block_sizes(4096, 4096, 8, 8, 256, jnp.float32, arch="sm_75")  # not even the smallest tile fits
  with pytest.raises(ValueError, match=r"pallas_gpu: the fwd tile of 256 q rows x 256 kv tokens with head_dim=256 "):
    planner.launch_config("fwd", rows=256, bk=256, head_dim=256, dtype=jnp.float32, arch="sm_75")
  with pytest.raises(
    ValueError, match=r"needs about \d+ bytes of shared memory, more than the \d+ bytes usable on sm_75"
  ):
    planner.launch_config("dkv", rows=256, bk=256, head_dim=256, dtype=jnp.float32, arch="sm_75")
  with pytest.raises(ValueError, match=r"unknown GPU arch='sm_1'"):
    planner.smem_bytes("sm_1")
  with pytest.raises(ValueError, match=r"kernel must be 'fwd', 'dq' or 'dkv', got 'x'"):
    planner.smem_model("x", rows=16, bk=16, head_dim=16, dtype=jnp.float32, stages=1)


def test_planner_mla_head_dims():
  """DeepSeek-V3's MLA (q/k head dim 192, v 128, 128 heads, bf16) on the H100/H200 (sm_90): q/k tiles count at
  H (192, padded to 256), v/o/do tiles at Hv (128), so the default tiles fit with two pipeline stages; counting v
  at q/k's head dim (Hv = 192, padded to 256) would leave one."""
  arch, dt = "sm_90", jnp.bfloat16
  budget = planner.SMEM_PER_BLOCK[arch] * planner.SAFETY_MARGIN
  assert planner.padded_head_dim(192) == 256 and planner.padded_head_dim(128) == 128
  assert planner.padded_head_dim(24) == 32 and planner.padded_head_dim(8) == 16
  mla = planner.plan_block_sizes(4096, 4096, 128, 128, 192, dt, arch=arch, v_head_dim=128)
  assert (mla.block_q, mla.block_kv, mla.bwd) == (128, 64, (64, 64))  # the default tiles, unshrunk
  for kernel, (bq, bk) in (("fwd", (mla.block_q, mla.block_kv)), ("dq", mla.bwd), ("dkv", mla.bwd)):
    cfg = planner.launch_config(kernel, rows=bq, bk=bk, head_dim=192, v_head_dim=128, dtype=dt, arch=arch)
    wide = planner.launch_config(kernel, rows=bq, bk=bk, head_dim=192, v_head_dim=192, dtype=dt, arch=arch)
    assert cfg.smem_bytes <= budget and (cfg.num_stages, wide.num_stages) == (2, 1), kernel
    for stages in (1, 2, 3):
      tile = dict(rows=bq, bk=bk, head_dim=192, dtype=dt, stages=stages)
      assert planner.smem_model(kernel, **tile, v_head_dim=128) < planner.smem_model(kernel, **tile, v_head_dim=192)
  # By hand, the forward at 2 stages: q 128 x 256, k 64 x 256 and v 64 x 128 twice, p 128 x 64, 2 bytes each.
  fwd = planner.smem_model("fwd", rows=128, bk=64, head_dim=192, v_head_dim=128, dtype=dt, stages=2)
  assert fwd == 2 * (128 * 256 + 2 * 64 * (256 + 128) + 128 * 64)
  assert planner.smem_model("dkv", rows=64, bk=64, head_dim=128, dtype=dt, stages=2) == planner.smem_model(
    "dkv", rows=64, bk=64, head_dim=128, v_head_dim=128, dtype=dt, stages=2
  )
  with pytest.raises(ValueError, match=r"the dq tile of 256 q rows x 256 kv tokens with head_dim=192, v_head_dim=128 "):
    planner.launch_config("dq", rows=256, bk=256, head_dim=192, v_head_dim=128, dtype=jnp.float32, arch="sm_75")


@pytest.mark.skipif(ON_GPU, reason="plans for the off-GPU default arch, not the attached GPU")
def test_kernel_tiles_plan_with_the_v_head_dim():
  """block_sizes=None: the kernels' tiles come from the planner with v's own head dim.  On the default arch off
  GPU (sm_80), f32 q/k at 256: a v head dim of 16 leaves room for 64-token kv tiles, one of 256 does not."""
  assert planner.current_arch() == "sm_80"
  spec = AttentionSpec(mask=masks.MaskSpec(), scale=0.25)
  sds = jax.ShapeDtypeStruct
  q, k = sds((1, 4096, 8, 256), jnp.float32), sds((1, 4096, 8, 256), jnp.float32)
  narrow = gpu_common.tiles(spec, q, k, sds((1, 4096, 8, 16), jnp.float32), backward=False)
  wide = gpu_common.tiles(spec, q, k, sds((1, 4096, 8, 256), jnp.float32), backward=False)
  assert (narrow, wide) == ((32, 64), (32, 32))


@interpret
def test_padded_mla_head_dims_with_dropout():
  """q/k head dim 24 (padded to 32) and v head dim 8 (padded to 16: below a Triton matmul's 16) with GQA, a
  causal mask, per-head dropout and a soft cap: forward and q/k/v gradients against the reference with the same
  keep mask (each kernel regenerates it on its v-width tiles), and out / dv keep v's head dim."""
  case = make_case(
    "mla_dropout", "causal", "gqa", N=4, group=2, B=1, T=64, H=24, Hv=8, soft_cap=20.0, dropout=dropout("per-head", 9)
  )
  q, k, v, do, seg = make_inputs(case, jnp.float32)

  def ring(q, k, v):
    return fr.ring_attention(
      q,
      k,
      v,
      implementation="pallas_gpu",
      interpret=INTERPRET,
      block_sizes=fr.BlockSizes(block_q=16, block_kv=16),
      **case.options(),
    )

  out, vjp = jax.vjp(jax.jit(ring), q, k, v)
  grads = vjp(do)
  ref_out, ref_grads = reference_with_grads(case, q, k, v, do, seg)
  assert out.shape == (1, 64, 4, 8) and grads[2].shape == v.shape == (1, 64, 2, 8)
  assert_close(out, ref_out, jnp.float32)
  assert_close(grads, ref_grads, jnp.float32, "grad")


def _poisoned_block(monkeypatch=None, kinds=None):
  """Causal block whose last kv tile lies after every query: EMPTY for all q tiles, filled with NaN."""
  B, T, S, N, K, H = 1, 32, 48, 4, 2, 16
  q, k, v, do = _inputs(B, T, S, N, K, H, jnp.float32)
  q_pos, kv_pos = jnp.arange(T), jnp.arange(S)  # keys 32..47 are in no query's past
  k = k.at[:, T:].set(jnp.nan)
  v = v.at[:, T:].set(jnp.nan)
  spec = AttentionSpec(
    mask=masks.MaskSpec(is_causal=True), scale=0.25, block_sizes=fr.BlockSizes(block_q=8, block_kv=16)
  )
  if kinds is not None:
    monkeypatch.setattr(masks, "tile_kinds", lambda *a: jnp.full((T // 8, S // 16), kinds, jnp.int32))
  # Operands as arguments, not closed-over constants (XLA would try to constant-fold the interpreted kernels).
  fwd = jax.jit(
    lambda q, k, v, qp, kp: block_fwd(q, k, v, masks.Tokens(qp), masks.Tokens(kp), spec=spec, interpret=INTERPRET)
  )
  bwd = jax.jit(
    lambda q, k, v, do, lse, dl, qp, kp: block_bwd(
      q, k, v, do, lse, dl, masks.Tokens(qp), masks.Tokens(kp), spec=spec, interpret=INTERPRET
    )
  )
  o, lse = fwd(q, k, v, q_pos, kv_pos)
  delta = jnp.einsum("btnh,btnh->bnt", do, o)
  grads = bwd(q, k, v, do, lse, delta, q_pos, kv_pos)
  return (q, k, v, do), (o, lse), grads


@interpret
def test_empty_tiles_load_nothing(monkeypatch):
  """NaN in the EMPTY kv tile: any load or matmul of it would turn 0 * NaN into NaN in o, dq, dk or dv."""
  (q, k, v, _), (o, lse), (dq, dk, dv) = _poisoned_block()
  T = q.shape[1]
  ref = fr.reference_attention(q, k[:, :T], v[:, :T], is_causal=True, scale=0.25)
  assert_close(o, ref, jnp.float32)
  for g in (o, lse, dq, dk[:, :T], dv[:, :T]):
    assert np.isfinite(np.asarray(g)).all()
  assert np.all(np.asarray(dk[:, T:]) == 0.0) and np.all(np.asarray(dv[:, T:]) == 0.0)
  # The test can fail: with every tile classed PARTIAL the poisoned tile is loaded and multiplied.
  _, (o, _), (dq, _, _) = _poisoned_block(monkeypatch, masks.PARTIAL)
  assert np.isnan(np.asarray(o)).any() and np.isnan(np.asarray(dq)).any()


@interpret
def test_full_tiles_skip_the_mask(monkeypatch):
  """A tile classed FULL runs no mask arithmetic: forcing FULL on a causal block gives unmasked attention."""
  B, T, N, K, H = 1, 32, 2, 2, 16
  q, k, v, _ = _inputs(B, T, T, N, K, H, jnp.float32)
  pos = jnp.arange(T)
  spec = AttentionSpec(
    mask=masks.MaskSpec(is_causal=True), scale=0.25, block_sizes=fr.BlockSizes(block_q=16, block_kv=16)
  )
  monkeypatch.setattr(masks, "tile_kinds", lambda *a: jnp.full((2, 2), masks.FULL, jnp.int32))
  fwd = jax.jit(
    lambda q, k, v, qp, kp: block_fwd(q, k, v, masks.Tokens(qp), masks.Tokens(kp), spec=spec, interpret=INTERPRET)
  )
  o, _ = fwd(q, k, v, pos, pos)
  assert_close(o, fr.reference_attention(q, k, v, scale=0.25), jnp.float32)


@interpret
def test_float16():
  B, T, N, K, H = 1, 64, 4, 2, 16
  q, k, v, do = _inputs(B, T, T, N, K, H, jnp.float16)

  def ring(q, k, v):
    return fr.ring_attention(
      q,
      k,
      v,
      is_causal=True,
      implementation="pallas_gpu",
      interpret=INTERPRET,
      block_sizes=fr.BlockSizes(block_q=16, block_kv=16),
    )

  out, vjp = jax.vjp(jax.jit(ring), q, k, v)
  grads = vjp(do)
  ref_out, ref_vjp = jax.vjp(lambda q, k, v: fr.reference_attention(q, k, v, is_causal=True), q, k, v)
  assert out.dtype == jnp.float16 and all(g.dtype == jnp.float16 for g in grads)
  assert_close(out, ref_out, jnp.float16)
  assert_close(grads, ref_vjp(do), jnp.float16, "grad")


@interpret
@pytest.mark.parametrize("kind,cap", [("per-head", None), ("broadcast", 2.0)], ids=["per-head", "broadcast-cap"])
def test_dropout_matches_the_reference(kind, cap):
  """Forward and q/k/v gradients with attention dropout on a zigzag ring of 2: the kernels regenerate the
  reference's keep mask from global (batch, q head, q position, kv position), over GQA's stacked rows, FULL and
  PARTIAL tiles, and the forward's mask again in the dq and dk/dv kernels."""
  case = make_case(
    "docs", "segments", "gqa", N=4, group=2, B=2, T=64, load_balance=True, soft_cap=cap, dropout=dropout(kind, 9)
  )
  assert_dropout_matches_reference(
    make_mesh((2,), ("sp",)),
    "sp",
    2,
    case,
    doc_len=20,
    implementation="pallas_gpu",
    interpret=INTERPRET,
    block_sizes=fr.BlockSizes(block_q=16, block_kv=16),
  )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize(
  "segments,cap,dropout,heads",
  [
    (False, None, None, (128, 128)),
    (True, 30.0, None, (128, 128)),
    (True, 30.0, "per-head", (128, 128)),
    (False, None, "broadcast", (128, 128)),
    (True, None, "per-head", (192, 128)),
    ("positions", None, "broadcast", (128, 128)),
  ],
  ids=["plain", "seg-cap", "seg-cap-dropout", "broadcast-dropout", "mla-seg-dropout", "positions-chunk-spans"],
)
def test_kernels_lower_to_triton_for_cuda(dtype, segments, cap, dropout, heads):
  """jax.export runs the Pallas -> Triton IR lowering for CUDA on this CPU machine: block shapes, loads, loops,
  tile-class branches and kernel ops (the dropout hash's wrapping int32 multiplies and logical shifts included)
  must all be accepted by the Triton lowering (Triton's own compiler runs only on a GPU, so this cannot catch
  what it would reject).  The MLA row (DeepSeek-V3's q/k head dim 192, v 128) checks that every tile is a
  power of two: Triton rejects a load of 192 columns, so q/k must be padded to 256 and v kept at 128."""
  terms = dict(chunk_size=64, has_bidirectional=True, has_positions=True) if segments == "positions" else {}
  spec = AttentionSpec(
    mask=masks.MaskSpec(is_causal=True, window=(300, 0), has_segments=bool(segments), **terms),
    scale=0.1,
    logits_soft_cap=cap,
    dropout_rate=0.0 if dropout is None else 0.1,
    dropout_broadcast=dropout == "broadcast",
  )
  (B, T, N, K), (H, Hv) = (2, 512, 8, 2), heads
  sds = jax.ShapeDtypeStruct
  q, k, v, do = sds((B, T, N, H), dtype), sds((B, T, K, H), dtype), sds((B, T, K, Hv), dtype), sds((B, T, N, Hv), dtype)
  pos = sds((B, T) if segments == "positions" else (T,), jnp.int32)
  seg = sds((B, T), jnp.int32) if segments else None
  bid = jnp.zeros((B, T), jnp.int32) if segments == "positions" else None  # closed over: a constant
  stat = sds((B, N, T), jnp.float32)
  drop = None if dropout is None else sds((4,), jnp.int32)
  fwd = jax.jit(
    lambda q, k, v, qp, kp, qs, ks, d: block_fwd(
      q, k, v, masks.Tokens(qp, qs, bid), masks.Tokens(kp, ks, bid), spec=spec, interpret=False, dropout=d
    )
  )
  bwd = jax.jit(
    lambda q, k, v, do, lse, dl, qp, kp, qs, ks, d: block_bwd(
      q, k, v, do, lse, dl, masks.Tokens(qp, qs, bid), masks.Tokens(kp, ks, bid), spec=spec, interpret=False, dropout=d
    )
  )
  # The Triton custom call has no export compatibility guarantee; we only lower, never serialise for later.
  triton = "__gpu$xla.gpu.triton"
  kw = dict(platforms=("cuda",), disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])
  text = export.export(fwd, **kw)(q, k, v, pos, pos, seg, seg, drop).mlir_module()
  text += export.export(bwd, **kw)(q, k, v, do, stat, stat, pos, pos, seg, seg, drop).mlir_module()
  assert text.count(f"@{triton}") == 3  # forward, dq, dk/dv


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices")
def test_ring_lowers_to_triton_for_cuda(monkeypatch):
  """The compiled path inside the ring's shard_map (varying-axes types declared on the kernels' results):
  forward and backward of a 2-device ring lower to Triton kernels for CUDA."""
  monkeypatch.setattr(pallas_gpu, "on_gpu", lambda: True)
  mesh = make_mesh((2,), ("sp",))
  q, k = jax.ShapeDtypeStruct((1, 256, 8, 64), jnp.bfloat16), jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)

  def loss(q, k, v):
    out = fr.ring_attention(q, k, v, mesh=mesh, is_causal=True, implementation="pallas_gpu", interpret=False)
    return out.astype(jnp.float32).sum()

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  triton = "__gpu$xla.gpu.triton"
  kw = dict(platforms=("cuda",), disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)])
  text = export.export(grad, **kw)(q, k, k).mlir_module()
  for name in ("ring_block_fwd_gpu", "ring_block_bwd_dq_gpu", "ring_block_bwd_dkv_gpu"):
    assert f'name = "{name}"' in text, name


def test_current_arch(monkeypatch):
  class Gpu:
    compute_capability = "9.0"

  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "devices", lambda *a: [Gpu()])
  assert planner.current_arch() == "sm_90"
  Gpu.compute_capability = "12.0"  # not in the table: the least shared memory of sm_80 .. sm_120
  assert planner.current_arch() == "sm_86"
