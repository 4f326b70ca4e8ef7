"""One selection rule per op (`backends/registry.py`), one options object forwarded whole (`ring/options.py`),
and the one flash custom_vjp (`flash.py`)."""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src import flash, validation
from flax_ringattn._src.backends.registry import Registry
from flax_ringattn._src.ring.options import RingOptions


def test_available_implementations_per_op():
  assert fr.available_implementations() == ("pallas_tpu_ring", "pallas_tpu", "pallas_gpu", "xla")
  assert fr.available_implementations(op="ring") == fr.available_implementations()
  assert fr.available_implementations(op="paged") == ("pallas_tpu", "xla")
  with pytest.raises(ValueError, match=r"unknown op='dense'; choose one of \('ring', 'paged'\)"):
    fr.available_implementations(op="dense")


@dataclasses.dataclass(frozen=True)
class _Impl:
  name: str
  supports: bool = True
  interpret: object = None
  label: str = dataclasses.field(default="", compare=False)

  def check_supported(self, **call):
    if not self.supports:
      raise NotImplementedError(f"{self.label or self.name} cannot run {call}")

  def with_interpret(self, interpret):
    return dataclasses.replace(self, interpret=interpret)


def _registry():
  return Registry(
    "toy",
    (_Impl("fast", supports=False), _Impl("slow")),
    preference=("fast", "slow"),
    aliases={"fast_fused": ("fast", {"fused": True})},
    interpret_default="fast",
    interpret_error="interpret=... does not apply to implementation={implementation!r}",
  )


def test_registry_rules():
  reg = _registry()
  assert reg.names() == ("fast_fused", "fast", "slow")
  choice = reg.select(None, x=1)  # "fast" raises NotImplementedError: the next one runs
  assert choice.backend.name == "slow" and choice.requested is None and choice.option("fused") is None
  with pytest.raises(NotImplementedError, match=r"fast cannot run \{'x': 1\}"):
    reg.select("fast", x=1)  # named: never replaced
  with pytest.raises(NotImplementedError, match=r"fast_fused cannot run"):
    reg.select("fast_fused", x=1)  # an alias reports under its own name
  with pytest.raises(ValueError, match=r"unknown implementation='quick'; available implementations: \("):
    reg.select("quick")
  with pytest.raises(TypeError, match="implementation must be a string or None"):
    reg.select(3)
  assert reg.select("slow", interpret=True).backend.interpret is True


def test_alias_carries_its_options():
  reg = Registry("toy", (_Impl("fast"),), preference=("fast",), aliases={"fast_fused": ("fast", {"fused": True})})
  choice = reg.select("fast_fused")
  assert choice.backend.name == "fast" and choice.requested == "fast_fused" and choice.option("fused") is True


def test_interpret_without_implementation_warns_once_and_picks_the_default():
  reg = Registry("toy2", (_Impl("fast"), _Impl("slow")), preference=("slow", "fast"), interpret_default="fast")
  with pytest.warns(DeprecationWarning, match=r"toy2: interpret=... without implementation= picks"):
    choice = reg.select(None, interpret=True)
  assert choice.backend.name == "fast" and choice.backend.interpret is True
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # once per process: the second call is silent
    assert reg.select(None, interpret=True).backend.name == "fast"
  assert reg.select(None).backend.name == "slow"  # without interpret, the preference order


def test_interpret_on_a_non_pallas_implementation_raises():
  q = jnp.zeros((1, 8, 2, 4))
  with pytest.raises(ValueError, match=r"interpret=... applies to implementation='pallas_tpu' only"):
    fr.ring_attention(q, q, q, implementation="xla", interpret=True)


def test_ring_options_fields_are_ring_attention_keywords():
  """A new keyword of `ring_attention` reaches every layer through one RingOptions field of the same name."""
  op = inspect.signature(fr.ring_attention).parameters
  for field in dataclasses.fields(RingOptions):
    if field.name == "check_mask":
      continue
    assert field.name in op, field.name
    assert op[field.name].kind is inspect.Parameter.KEYWORD_ONLY
    assert op[field.name].default == field.default, field.name
  kwargs = RingOptions(scale=0.5, is_causal=True).ring_kwargs()
  assert "check_mask" not in kwargs and kwargs["scale"] == 0.5 and kwargs["is_causal"]


@dataclasses.dataclass(frozen=True)
class _Softmax:
  """A one-block dense attention as a FlashKernel: checks the wrapper's contract on its own."""

  rows_to_lse = staticmethod(flash.heads_before_rows)
  lse_to_rows = staticmethod(flash.heads_before_rows)

  def forward(self, q, k, v):
    s = jnp.einsum("btnh,bsnh->bnts", q, k)
    lse = jax.nn.logsumexp(s, axis=-1)
    o = jnp.einsum("bnts,bsnh->btnh", jnp.exp(s - lse[..., None]), v)
    return o, lse

  def backward(self, operands, lse, do, delta):
    q, k, v = operands
    s = jnp.einsum("btnh,bsnh->bnts", q, k)
    p = jnp.exp(s - lse[..., None])
    dv = jnp.einsum("bnts,btnh->bsnh", p, do)
    dp = jnp.einsum("btnh,bsnh->bnts", do, v)
    ds = p * (dp - delta[..., None])
    return jnp.einsum("bnts,bsnh->btnh", ds, k), jnp.einsum("bnts,btnh->bsnh", ds, q), dv


def test_flash_wrapper_matches_autodiff():
  rng = np.random.default_rng(0)
  q, k, v, do = (jnp.asarray(rng.standard_normal((2, 8, 2, 4)), jnp.float32) for _ in range(4))

  def dense(q, k, v):
    p = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, v)

  out, vjp = jax.vjp(lambda *a: flash.flash(_Softmax(), None, *a), q, k, v)
  ref, ref_vjp = jax.vjp(dense, q, k, v)
  assert_close(out, ref, jnp.float32)
  for got, want in zip(vjp(do), ref_vjp(do), strict=True):
    assert_close(got, want, jnp.float32, "grad")


def test_flash_wrapper_sinks_match_autodiff_of_a_sink_column():
  """The sinks, applied by the wrapper around a kernel that knows nothing of them, against autodiff of the usual
  hand-written form: a per-head logit column concatenated to the scores, softmax, the column dropped."""
  rng = np.random.default_rng(1)
  q, k, v, do = (jnp.asarray(rng.standard_normal((2, 8, 2, 4)), jnp.float32) for _ in range(4))
  sinks = jnp.asarray(rng.standard_normal(2) + 2.0, jnp.float32)

  def dense(q, k, v, sinks):
    s = jnp.einsum("btnh,bsnh->bnts", q, k)
    column = jnp.broadcast_to(sinks[None, :, None, None], (*s.shape[:3], 1))
    p = jax.nn.softmax(jnp.concatenate([s, column], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bnts,bsnh->btnh", p, v)

  out, vjp = jax.vjp(lambda s, *a: flash.flash(_Softmax(), s, *a), sinks, q, k, v)
  ref, ref_vjp = jax.vjp(dense, q, k, v, sinks)
  assert_close(out, ref, jnp.float32)
  dsinks, *grads = vjp(do)
  *ref_grads, ref_dsinks = ref_vjp(do)
  assert_close(dsinks, ref_dsinks, jnp.float32, "grad")
  for got, want in zip(grads, ref_grads, strict=True):
    assert_close(got, want, jnp.float32, "grad")


def test_deprecation_warnings_point_at_the_callers_line():
  """Python shows a DeprecationWarning by default only when it is attributed to the user's code, not the library's
  (or Flax's, when a layer is built through nnx's metaclass)."""
  validation._warned.discard(("paged", "sliding_window"))
  validation._warned.discard(("ring_attention", "interpret"))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fr.PagedMultiHeadAttention(2, 8, rngs=nnx.Rngs(0), sliding_window=3)
    q = jnp.zeros((1, 8, 2, 8))
    fr.ring_attention(q, q, q, interpret=True)
  assert [w.category for w in caught] == [DeprecationWarning, DeprecationWarning]
  assert {w.filename for w in caught} == {__file__}


def test_a_bad_interpret_value_raises_before_the_deprecation_warning():
  validation._warned.discard(("ring_attention", "interpret"))
  q = jnp.zeros((1, 8, 2, 8))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with pytest.raises(TypeError, match="interpret must be a bool, None or"):
      fr.ring_attention(q, q, q, interpret="yes")
  with pytest.warns(DeprecationWarning):  # the once-key was not spent on the bad value
    fr.ring_attention(q, q, q, interpret=True)


def test_paged_interpret_false_is_not_interpreting():
  """interpret=False means compile for the chip, as for the ring: with implementation=None the TPU kernel is then
  skipped off TPU (XLA runs), and named it raises NotImplementedError."""
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((4, 2, 8)), jnp.float32)
  kp = jnp.asarray(rng.standard_normal((4, 4, 2, 8)), jnp.float32)
  meta = (jnp.array([3, 1]), jnp.array([[0, 1], [2, 3]]), jnp.array([0, 3, 4]), jnp.array([2]))
  ref = fr.paged_reference_attention(q, kp, kp, *meta)
  assert_close(fr.paged_attention(q, kp, kp, *meta, interpret=False), ref, jnp.float32)
  if jax.default_backend() != "tpu":
    with pytest.raises(NotImplementedError, match="pallas_tpu needs a TPU"):
      fr.paged_attention(q, kp, kp, *meta, implementation="pallas_tpu", interpret=False)


def test_paged_interpret_alone_still_selects_the_tpu_kernel():
  """Deprecated but kept: interpret= without an implementation is pallas_tpu, which then raises for a call it
  cannot run rather than falling through to XLA."""
  validation._warned.discard(("paged_attention", "interpret"))
  q = jnp.zeros((4, 2, 8), jnp.float32)
  kp = jnp.zeros((4, 4, 2, 8), jnp.float32)  # page_size 4: below the f32 kernel's 8-row tile
  meta = (jnp.array([3, 1]), jnp.array([[0, 1], [2, 3]]), jnp.array([0, 3, 4]), jnp.array([2]))
  with pytest.warns(DeprecationWarning, match="paged_attention: interpret=... without implementation="):
    with pytest.raises(NotImplementedError):
      fr.paged_attention(q, kp, kp, *meta, interpret=True)
  fr.paged_attention(q, kp, kp, *meta)  # implementation=None without interpret: XLA runs it
