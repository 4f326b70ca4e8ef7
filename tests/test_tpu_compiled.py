"""The compiled-on-TPU tier (`make test-tpu`, marker `tpu`): the Pallas TPU kernels compiled on the chip, no
interpret mode, forward and gradients against the float64 numpy oracles (tests/dense_oracle.py,
tests/paged_oracle.py) run on the host.

a. block kernels: `ring_attention(implementation="pallas_tpu")` on one device, and the forward's bf16 output bit for
   bit its float32 output cast;
b. the ragged paged kernel: `paged_attention(implementation="pallas_tpu")` over decode, prefill, chunked-prefill
   and mixed batches, foreign pages and tails NaN-poisoned; and its fused cache write (`attend_and_write`);
c. the in-kernel ring (`implementation="pallas_tpu_ring"`) as a ring of one, slots in VMEM and in HBM.

One compiled program per configuration (22; the output-dtype check compiles 4 more), fed all of its inputs; one
process (one program at a time holds the chip).  Without a TPU every test skips ("no TPU attached") and nothing compiles.  FLAX_RINGATTN_TPU_TIER_ON_CPU=1
runs the same tests on CPU in interpret mode at a quarter of the lengths (about 1.5 min on 2 cores), `=full` at
the chip's (about 3 min): a check of the tests, not of the kernels.

Tolerances are the table's (tests/tolerances.py: float32 1e-5, bfloat16 2e-2).  float32 runs pass
`precision=HIGHEST` (the paged kernel takes it for float32 by itself): at DEFAULT precision an f32 matmul on a TPU
is one bf16 pass, which no 1e-5 bar survives (FLAX_RINGATTN_TPU_TIER_F32_PRECISION=default runs them at the
op's default instead).  A float32 tensor that still misses the table passes, with a warning in the run's summary,
when its error is at most 1.1 x the XLA path's on the same chip + 1e-6 (`_compare`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import Case, assert_block_output_is_the_cast, dtype_id, make_case, make_inputs, make_sinks, with_sinks
from conftest import make_mesh
from dense_oracle import dense_oracle
from paged_cases import case_batch, features, kv_pages_args, merged, paged_vjp, poison, slot_mask
from paged_oracle import paged_oracle

import flax_ringattn as fr
from flax_ringattn._src.paged import op as paged_ops
from flax_ringattn._src.testing.checks import assert_close
from flax_ringattn._src.testing.interpret import interpret_params
from flax_ringattn.testing import kernel_debug

ON_TPU = jax.default_backend() == "tpu"
ON_CPU = not ON_TPU and os.environ.get("FLAX_RINGATTN_TPU_TIER_ON_CPU", "0") != "0"
pytestmark = [
  pytest.mark.tpu,
  pytest.mark.skipif(not (ON_TPU or ON_CPU), reason="no TPU attached"),
  pytest.mark.skipif(
    ON_TPU and "PYTEST_XDIST_WORKER" in os.environ, reason="one process holds the chip: run `make test-tpu`"
  ),
]
INTERPRET = {} if ON_TPU else dict(interpret=True)  # the escape hatch: the same calls in interpret mode
DIV = 4 if ON_CPU and os.environ["FLAX_RINGATTN_TPU_TIER_ON_CPU"] != "full" else 1  # "full": the chip's lengths
F32, BF16 = jnp.float32, jnp.bfloat16
# float32 runs' matmul precision (module docstring); None: the op's default.
F32_PRECISION = {"highest": jax.lax.Precision.HIGHEST, "default": None}[
  os.environ.get("FLAX_RINGATTN_TPU_TIER_F32_PRECISION", "highest")
]
TINY = 1e-6
DTYPES = [pytest.param(F32, id="f32"), pytest.param(BF16, id="bf16")]


def _n(tokens: int) -> int:
  """A length (tokens, window side, chunk) at the tier's scale: as written on the chip, a quarter in the hatch."""
  return tokens // DIV


# -- running and comparing --------------------------------------------------------------------------------------


def _compiled(f, *args, kernels: int):
  """f jitted, lowered and compiled once for these argument shapes; on the chip, checks that the program holds at
  least `kernels` Pallas TPU kernels (a named implementation never falls back, but a silent XLA path would pass
  every comparison)."""
  lowered = jax.jit(f).lower(*args)
  if ON_TPU:
    found = lowered.as_text().count("tpu_custom_call")
    assert found >= kernels, f"expected at least {kernels} Pallas TPU kernels in the program, found {found}"
  return lowered.compile()


def _compare(got: dict, want: dict, dtype, xla=None):
  """Every tensor of `got` against the float64 oracle's `want` at the table's tolerance ("out" as the forward,
  the rest as gradients).  dsinks [N] sums a term of either sign over every row of the call, so its error grows
  with the rows while a value may cancel to near 0: its atol is relative to its largest |value| (>= 1).

  float32 with `xla()` (the same tensors from the XLA path on this chip, computed only when a kernel tensor misses
  the table): that tensor then passes, with a warning, when its error is at most 1.1 x the XLA path's + TINY and
  the XLA path's own error is of rounding size (within the bfloat16 row of the table), so a kernel and an XLA path
  that both disagree with the oracle by more (a different mask, a sink applied twice) still fail."""
  ref = None
  for name, value in got.items():
    kind = "fwd" if name == "out" else "grad"
    exact = np.asarray(want[name], np.float64)
    norm = max(1.0, float(np.abs(exact).max())) if name == "dsinks" else 1.0
    try:
      assert_close(np.asarray(value, np.float32) / norm, exact / norm, dtype, kind, name=name)
    except AssertionError as e:
      if xla is None or dtype != F32:
        raise
      ref = xla() if ref is None else ref
      try:
        assert_close(np.asarray(ref[name], np.float32) / norm, exact / norm, BF16, kind, name=f"XLA's {name}")
      except AssertionError as xla_error:
        raise AssertionError(f"{e}\nand the XLA path on this chip misses too: {xla_error}") from None
      err = float(np.abs(np.asarray(value, np.float64) - exact).max())
      err_xla = float(np.abs(np.asarray(ref[name], np.float64) - exact).max())
      if not err <= 1.1 * err_xla + TINY:  # (NaN fails)
        raise AssertionError(f"{e}\nand the XLA path on this chip does better: max |diff| {err_xla:.3g}") from None
      warnings.warn(
        f"{name} (float32) misses the table (max |diff| {err:.3g}) but is within 1.1x of the XLA path's error on "
        f"this chip ({err_xla:.3g})",
        stacklevel=2,
      )


# -- a. block kernels and c. the in-kernel ring: dense cases --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Dense:
  """A registry case (tests/cases.py) with the options `Case` does not carry: Llama 4's chunk and, for the
  in-kernel ring, where its slots live."""

  case: Case
  chunk: int | None = None
  slots: str | None = None
  # `KernelDebug.fused_backward`: False runs the dq and dk/dv kernels instead of the fused backward (None: the
  # default, fused at these sizes)
  fused_backward: bool | None = None


def _dense(name, mask="none", heads="mha", *, N=4, group=2, T=512, H=128, **fields):
  return make_case(name, mask, heads, N=N, group=group, T=_n(T), H=H, **fields)


# ring_attention(implementation="pallas_tpu") on one device: each case is one program per dtype.
# "full" and "causal_gqa" run the forward token-major (`tiling.token_major_forward`: N = 8, heads of 128, q tiles a
# multiple of 128, as the planner picks at these lengths); the others heads-major (N = 4, or MLA's 192).
BLOCK = [
  Dense(_dense("full", N=8, B=2)),
  Dense(_dense("causal_gqa", "causal", "gqa", N=8, T=1024, B=1)),
  Dense(_dense("segments_window_cap_gqa", "segments", "gqa", T=1024, B=1, window=(_n(255), 0), soft_cap=5.0)),
  # two-sided window, not causal; sinks; MLA head dims (DeepSeek: qk 192, v 128)
  Dense(_dense("window_sinks_mla", "window", "gqa", N=8, B=1, window=(_n(200), _n(56)), sinks=True, H=192, Hv=128)),
  Dense(_dense("chunk_hd64", "causal", T=1024, B=2, H=64), chunk=_n(256)),
  # Llama-3.2-1B's head layout in small (4 q heads per kv head of 64), the two-kernel backward
  Dense(_dense("split_bwd_causal_gqa_hd64", "causal", "gqa", N=8, group=4, T=1024, B=1, H=64), fused_backward=False),
]


def _ring(slots, dtype, name, *axes, **fields):
  """A ring-of-one case: its slots forced into "vmem" or "hbm" (`kernel_debug`), one dtype."""
  return pytest.param(Dense(_dense(name, *axes, **fields), slots=slots), dtype, id=f"{slots}-{name}-{dtype_id(dtype)}")


# implementation="pallas_tpu_ring" on a ring of one: one program each.
RING = [
  _ring("vmem", BF16, "causal_segments_sinks_gqa", "segments", "gqa", T=1024, B=1, sinks=True),
  _ring("vmem", F32, "window_cap_mla", "window", "gqa", B=2, window=(_n(100), _n(30)), soft_cap=5.0, H=192, Hv=128),
  _ring("hbm", BF16, "causal_sinks_mla_mqa", "causal", "mqa", T=1024, B=1, sinks=True, H=192, Hv=128),
  _ring("hbm", F32, "segments_window_cap_gqa", "segments", "gqa", B=2, window=(_n(200), 0), soft_cap=5.0),
]


def _dense_run(run: Dense, dtype, implementation: str):
  """`run` through ring_attention(implementation=...): a function of (q, k, v, do, seg, sinks) -> (out, grads)."""
  opts = dict(run.case.options(), chunk_size=run.chunk, implementation=implementation)
  opts["precision"] = F32_PRECISION if dtype == F32 else None
  if implementation != "xla":
    opts |= INTERPRET
  if implementation == "pallas_tpu_ring":
    opts["mesh"] = make_mesh((1,), ("sp",))

  def vjp(q, k, v, do, seg, sinks):
    f = lambda q, k, v, sinks=None: fr.ring_attention(q, k, v, segment_ids=seg, sinks=sinks, **opts)  # noqa: E731
    f, extra = with_sinks(f, sinks)
    out, pullback = jax.vjp(f, q, k, v, *extra)
    return out, pullback(do)

  return vjp


def _named(out, grads):
  return dict(zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), strict=False))


def _check_dense(run: Dense, dtype, implementation: str, kernels: int):
  case = run.case
  q, k, v, do, seg = make_inputs(case, dtype)
  sinks = make_sinks(case)
  args = (q, k, v, do, seg, sinks)
  fields = dict(slots=run.slots) if run.slots else {}
  fields |= dict(fused_backward=run.fused_backward) if run.fused_backward is not None else {}
  debug = kernel_debug(**fields) if fields else contextlib.nullcontext()
  with debug:  # (read when the call is traced)
    got = _compiled(_dense_run(run, dtype, implementation), *args, kernels=kernels)(*args)
  host = lambda x: None if x is None else np.asarray(x)  # noqa: E731
  want_out, want_grads = dense_oracle(
    *(host(x) for x in (q, k, v)),
    do=host(do),
    is_causal=case.is_causal,
    local_window_size=case.window,
    segment_ids=host(seg),
    logits_soft_cap=case.soft_cap,
    scale=case.scale,
    sinks=host(sinks),
    chunk_size=run.chunk,
  )
  xla = lambda: _named(*jax.jit(_dense_run(run, dtype, "xla"))(*args))  # noqa: E731
  _compare(_named(*got), _named(want_out, want_grads), dtype, xla)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("run", BLOCK, ids=lambda r: r.case.name)
def test_block_kernels(run, dtype):
  """Forward, dq, dk, dv (and dsinks) of the block kernels (the forward and the fused backward: two kernels; with
  the two-kernel backward three) on one device."""
  _check_dense(run, dtype, "pallas_tpu", kernels=3 if run.fused_backward is False else 2)


def test_block_output_in_the_callers_dtype():
  """The block forward's bf16 o (a ring of one's) is bit for bit its float32 o cast, token-major (compiled: stored
  through 32-bit words, two heads per word) and heads-major."""
  assert_block_output_is_the_cast(interpret=None if ON_TPU else interpret_params())


@pytest.mark.parametrize("run, dtype", RING)
def test_kernel_ring_of_one(run, dtype):
  """The in-kernel ring's forward and backward kernels on a one-device mesh, slots in VMEM or HBM."""
  _check_dense(run, dtype, "pallas_tpu_ring", kernels=2)


# -- b. the ragged paged kernel ------------------------------------------------------------------------------

SEQS = 8  # max_num_seqs
# (q_len, kv_len) of the live sequences of each batch mix (the new tokens are the last q_len of kv_len), at a
# capacity of 256 tokens per sequence and 256 rows of q.
MIXES = {
  "decode": [(1, 1), (1, 17), (1, 64), (1, 100), (1, 129), (1, 200), (1, 255), (1, 256)],
  "prefill": [(97, 97), (64, 64), (33, 33), (16, 16), (1, 1)],
  "chunked": [(40, 200), (16, 256), (33, 65), (7, 8), (64, 150), (2, 100)],
  # decode, prefill and chunks with q_len 0 (a history, or nothing at all), q_len = kv_len = 1, a full sequence
  "mixed": [(1, 130), (57, 57), (0, 7), (0, 0), (1, 1), (32, 48), (16, 256), (1, 255)],
}


def _mix(name):
  """MIXES[name] at the tier's scale."""
  shrink = lambda x: 0 if x == 0 else max(1, x // DIV)  # noqa: E731
  return [(shrink(q), max(shrink(q), shrink(kv))) for q, kv in MIXES[name]]


@dataclasses.dataclass(frozen=True)
class Paged:
  """A registry case (causal: its window, soft cap, scale, heads, sinks, v head dim) on paged batches of `dtype`
  rows, pages of `page_size` tokens stored as `page_dtype` (None: dtype) with `scales` (make_batch's
  scale_shape), Llama 4's `chunk`, and bidirectional span ids with `spans`."""

  case: Case
  dtype: object
  page_size: int
  page_dtype: str | None = None
  scales: object = None
  chunk: int | None = None
  spans: bool = False
  # pages merged, [P, page_size, K * H] (the oracle reads the same values as [P, ps, K, H]); "kv": kv pages
  # [P, 2, page_size, K * H] (`kv_pages_args`)
  merged: bool | str = False

  @property
  def quantized(self) -> bool:
    return self.page_dtype is not None

  def geometry(self) -> dict:
    per_seq = _n(256) // self.page_size
    return dict(
      num_pages=(SEQS + 1) * per_seq,  # a sequence's worth of pages nobody reads
      page_size=self.page_size,
      pages_per_seq=per_seq,
      num_tokens=_n(256),
      max_num_seqs=SEQS,
      dtype=self.dtype,
      page_dtype=None if self.page_dtype is None else jnp.dtype(self.page_dtype),
      scale_shape=self.scales,
    )

  def batch(self, rng, mix):
    b = case_batch(self.case, rng, _mix(mix), **self.geometry())
    return b, (_span_ids(b) if self.spans else None)

  def options(self) -> dict:
    return dict(features(self.case), chunk_size=self.chunk)


def _paged_case(name, mask="causal", heads="gqa", *, H=128, **fields):
  """N = 8 q heads; GQA 4:1 (K = 2) unless `heads` says otherwise."""
  return make_case(name, mask, heads, N=8, group=4, H=H, **fields)


PAGED = {
  "plain_bf16": Paged(_paged_case("plain"), BF16, 16),
  "window_cap_sinks_f32": Paged(
    _paged_case("window_cap_sinks", "causal_window", window=(_n(63), 0), soft_cap=5.0, sinks=True), F32, 16
  ),
  "sinks_mla_bf16": Paged(_paged_case("sinks_mla", H=192, Hv=128, sinks=True), BF16, 16),
  "int8_cap_sinks_bf16": Paged(
    _paged_case("int8", soft_cap=5.0, sinks=True), BF16, 16, page_dtype="int8", scales=("token", "page")
  ),
  "fp8_window_mqa_bf16": Paged(
    _paged_case("fp8", "causal_window", "mqa", window=(_n(100), 0)),
    BF16,
    16,
    page_dtype="float8_e4m3fn",
    scales=("scalar", "token"),
  ),
  "spans_chunk_f32": Paged(_paged_case("spans_chunk"), F32, 8, chunk=_n(64), spans=True),
  # 8 kv heads: flat kv buffers (`tiling.flat_kv_pages`), bf16 heads read through 32-bit words, f32 strided.
  "flat_bf16": Paged(make_case("flat", "causal", "gqa", N=16, group=2, H=128), BF16, 16),
  "flat_window_cap_f32": Paged(
    make_case("flat_window_cap", "causal_window", "gqa", N=16, group=2, H=128, window=(_n(63), 0), soft_cap=5.0),
    F32,
    16,
  ),
  # The forward's window (`plans.window_rows`) where a token's rows straddle an 8-row tile (G = 3: 16-row
  # windows at dynamic offsets) and where 8 tokens share one (MHA).
  "group3_bf16": Paged(make_case("group3", "causal", "gqa", N=6, group=3, H=128), BF16, 16),
  "mha_f32": Paged(make_case("mha", "causal", "mha", N=4, H=128), F32, 8),
  # 8 kv heads of 256 (Gemma 2's): not flat, since Mosaic strides only 128-lane buffers (`tiling.flat_kv_pages`).
  "kv8_hd256_bf16": Paged(make_case("kv8_hd256", "causal", "gqa", N=16, group=2, H=256), BF16, 16),
  # Merged pages [P, page_size, K * H], the real layouts per chip of issue 55: head dim 64 with 7 q heads per kv
  # head (Qwen2.5-0.5B's 14 / 2: one 128-lane group of two kv heads, 14 rows a token), one kv head of 128 (Llama-3-70B
  # over 8 chips) with a window and a soft cap, one kv head of 256 (Gemma-2B), and 7 q heads per kv head (Qwen2.5-7B).
  "merged_hd64_g7_bf16": Paged(make_case("m64", "causal", "gqa", N=14, group=7, H=64), BF16, 16, merged=True),
  "merged_kv1_window_cap_bf16": Paged(
    make_case("m1", "causal_window", "mqa", N=8, H=128, window=(_n(63), 0), soft_cap=5.0), BF16, 16, merged=True
  ),
  "merged_kv1_hd256_bf16": Paged(make_case("m256", "causal", "mqa", N=8, H=256), BF16, 16, merged=True),
  "merged_g7_bf16": Paged(make_case("m7", "causal", "gqa", N=14, group=7, H=128), BF16, 16, merged=True),
  # kv pages [P, 2, page_size, K * H] (one copy per page, its K and V): Qwen2.5-0.5B's 14 / 2 / 64, and one kv head
  # of 128 with a window and a soft cap.
  "kvpages_hd64_g7_bf16": Paged(make_case("kv64", "causal", "gqa", N=14, group=7, H=64), BF16, 16, merged="kv"),
  # ... on pages of 64 tokens: `benchmarks/real_models.py`'s serving default (2.1x pages of 16 on the chip).
  "kvpages_hd64_g7_page64_bf16": Paged(
    make_case("kv64p64", "causal", "gqa", N=14, group=7, H=64), BF16, 64, merged="kv"
  ),
  "kvpages_kv1_window_cap_bf16": Paged(
    make_case("kv1", "causal_window", "mqa", N=8, H=128, window=(_n(63), 0), soft_cap=5.0), BF16, 16, merged="kv"
  ),
}


def _span_ids(b):
  """[T] bidirectional ids: the middle half of each sequence's new tokens (4 or more) is one span, across pages
  and q blocks; a lone new token has an id of its own (it sees only itself)."""
  ids = np.zeros(b.q.shape[0], np.int32)
  cu = np.asarray(b.cu_q_lens)
  for i, (q_len, _) in enumerate(b.seqs):
    if q_len >= 4:
      ids[cu[i] + q_len // 4 : cu[i] + 3 * q_len // 4] = i + 1
    elif q_len:
      ids[cu[i]] = 100 + i
  return jnp.asarray(ids)


def _paged_run(run: Paged, implementation: str):
  """paged_attention's output and cotangents (dq, dk_pages, dv_pages[, dsinks]): a function of (args, do, k_scale,
  v_scale, sinks, ids)."""
  kw = dict(run.options(), implementation=implementation, **(INTERPRET if implementation != "xla" else {}))

  def vjp(args, do, k_scale, v_scale, sinks, ids):
    scales = dict(k_scale=k_scale, v_scale=v_scale, bidirectional_ids=ids)
    return paged_vjp(fr.paged_attention, args, do, sinks, **scales, **kw)

  return vjp


def _paged_named(run: Paged, out, grads):
  """{"out", "dq", "dk_pages", "dv_pages"[, "dsinks"]}; no page gradients for stored int8 / fp8 (not float data)."""
  named = {"out": out, **dict(zip(("dq", "dk_pages", "dv_pages", "dsinks"), grads, strict=False))}
  if named.get("dv_pages", 0) is None:  # kv pages: dk_pages holds both
    del named["dv_pages"]
  if run.quantized:
    del named["dk_pages"], named["dv_pages"]
  return named


@pytest.mark.parametrize("name", list(PAGED))
def test_paged_kernel(name):
  """Forward and gradients of the ragged paged kernels (one program: forward and backward) over every batch mix,
  foreign pages and tails NaN-poisoned (int8: -128): outputs and gradients match the oracle, padding rows are
  exactly 0 and no page slot that no sequence reads receives a gradient."""
  run = PAGED[name]
  rng = np.random.default_rng(list(PAGED).index(name))
  program = None
  for mix in MIXES:
    b4, ids = run.batch(rng, mix)
    b = merged(b4) if run.merged else b4  # the kernel's pages; the oracle reads b4's
    do = jnp.asarray(rng.normal(size=b.out_shape), run.dtype)
    fill = np.nan if jnp.issubdtype(b.k_pages.dtype, jnp.floating) else -128
    kv = run.merged == "kv"
    as_given = kv_pages_args if kv else (lambda a: a)  # noqa: E731
    args = (as_given(poison(b, fill).args), do, b.k_scale, b.v_scale, b.sinks, ids)
    if program is None:  # one program for every mix
      program = _compiled(_paged_run(run, "pallas_tpu"), *args, kernels=2)
    out, grads = program(*args)
    want_out, want_grads = paged_oracle(*b4.args, **b4.operands, do=do, bidirectional_ids=ids, **run.options())
    page_grads = [g.reshape(p.shape) for g, p in zip(want_grads[1:3], b.args[1:3], strict=True)]
    if kv:
      page_grads = [jnp.stack(page_grads, axis=1), None]
    want_grads = (want_grads[0], *page_grads, *want_grads[3:])
    clean = (as_given(b.args), *args[1:])
    xla = lambda clean=clean: _paged_named(run, *jax.jit(_paged_run(run, "xla"))(*clean))  # noqa: E731
    _compare(_paged_named(run, out, grads), _paged_named(run, want_out, want_grads), run.dtype, xla)
    np.testing.assert_array_equal(np.asarray(out[b.total :], np.float32), 0.0, err_msg=f"{mix}: padding rows")
    np.testing.assert_array_equal(np.asarray(grads[0][b.total :], np.float32), 0.0, err_msg=f"{mix}: padding dq")
    if not run.quantized:
      unread = slot_mask(b, ~b.read_mask())
      unread = unread[:, None] if kv else unread  # kv pages [P, 2, ps, K * H]
      for g in grads[1 : 3 - kv]:
        assert not np.asarray(jnp.where(unread, g, 0)).any(), f"{mix}: a slot nobody reads got a gradient"


# The fused cache write (serving: forward only, bfloat16 rows): bf16 pages with sinks and a window; int8 pages with
# per-token scales (written with the tokens) at MLA head dims.
FUSED = {
  "bf16_window_sinks": Paged(_paged_case("fused", "causal_window", window=(_n(127), 0), sinks=True), BF16, 16),
  "int8_token_scales_mla": Paged(
    _paged_case("fused_int8", H=192, Hv=128), BF16, 16, page_dtype="int8", scales=("token", "token")
  ),
  "bf16_flat": Paged(make_case("fused_flat", "causal", "gqa", N=16, group=2, H=128), BF16, 16),
}


def _fused_run(run: Paged):
  def write(q, k_new, v_new, k_pages, v_pages, metadata, scales, new_scales, sinks):
    opts = dict(run.options(), k_scale=scales[0], v_scale=scales[1], implementation="pallas_tpu", **INTERPRET)
    call = paged_ops.plan_call(q, k_pages, v_pages, *metadata, **opts)
    assert call.fuses_cache_write
    return call.attend_and_write(
      q, k_new, v_new, k_pages, v_pages, k_new_scale=new_scales[0], v_new_scale=new_scales[1], sinks=sinks
    )

  return write


def _new_tokens(rng, b, run: Paged):
  """The new rows' K/V as the pages store them [T, K, H] / [T, K, Hv], with their per-token scales [T, K] (or
  None)."""
  T, K = b.q.shape[0], b.k_pages.shape[2]
  if run.quantized:
    kv = [jnp.asarray(rng.integers(-127, 128, size=(T, K, p.shape[3])), jnp.int8) for p in (b.k_pages, b.v_pages)]
    return kv, [jnp.asarray(rng.uniform(0.005, 0.03, size=(T, K)), F32) for _ in range(2)]
  return [jnp.asarray(rng.normal(size=(T, K, p.shape[3])), p.dtype) for p in (b.k_pages, b.v_pages)], [None, None]


def _written(b, rows: list):
  """numpy copies of (k_pages, v_pages, k_scale, v_scale) with row r of each of `rows` ([T, K, ...] arrays: the new
  K, V and their scales) stored at its token's slot: (page, slot) of position kv_len - q_len + j of sequence i."""
  stores = [np.asarray(x).copy() if x is not None else None for x in (b.k_pages, b.v_pages, b.k_scale, b.v_scale)]
  table, cu, ps = np.asarray(b.page_indices), np.asarray(b.cu_q_lens), b.k_pages.shape[1]
  for i, (q_len, kv_len) in enumerate(b.seqs):
    for j in range(q_len):
      pos, row = kv_len - q_len + j, cu[i] + j
      for store, new in zip(stores, rows, strict=True):
        if store is not None:
          store[table[i, pos // ps], pos % ps] = np.asarray(new[row])
  return stores


@pytest.mark.parametrize("name", list(FUSED))
def test_paged_fused_cache_write(name):
  """attend_and_write on every batch mix: the pages (and per-token scales) come back with exactly the new rows
  stored and nothing else changed (NaN-poisoned slots included), the output matches the oracle over the written
  pages."""
  run = FUSED[name]
  rng = np.random.default_rng(10 + list(FUSED).index(name))
  program = None
  for mix in MIXES:
    b, _ = run.batch(rng, mix)
    (k_new, v_new), new_scales = _new_tokens(rng, b, run)
    b = poison(b, -128 if run.quantized else np.nan)
    bk = merged(b) if run.merged else b  # the kernel's pages; `_written` and the oracle read b's
    args = (b.q, k_new, v_new, bk.k_pages, bk.v_pages, b.args[3:], (b.k_scale, b.v_scale), new_scales, b.sinks)
    if program is None:
      program = _compiled(_fused_run(run), *args, kernels=1)
    out, *cache = program(*args)
    want = _written(b, [k_new, v_new, *new_scales])
    for label, got, exp in zip(("k_pages", "v_pages", "k_scale", "v_scale"), cache, want, strict=True):
      if exp is not None:
        # (in float32: numpy's NaN-aware equality does not know bfloat16; the widening is exact)
        got = np.asarray(got, np.float32).reshape(exp.shape)
        np.testing.assert_array_equal(got, exp.astype(np.float32), err_msg=f"{mix}: {label}")
    written = b.replace(**dict(zip(("k_pages", "v_pages", "k_scale", "v_scale"), map(_array, want), strict=True)))
    want_out, _ = paged_oracle(*written.args, **written.operands, **run.options())
    _compare({"out": out}, {"out": want_out}, run.dtype)
    np.testing.assert_array_equal(np.asarray(out[b.total :], np.float32), 0.0, err_msg=f"{mix}: padding rows")


def _array(x):
  return None if x is None else jnp.asarray(x)
