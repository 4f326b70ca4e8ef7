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
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src import flash
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

  out, vjp = jax.vjp(lambda *a: flash.flash(_Softmax(), *a), q, k, v)
  ref, ref_vjp = jax.vjp(dense, q, k, v)
  assert_close(out, ref, jnp.float32)
  for got, want in zip(vjp(do), ref_vjp(do), strict=True):
    assert_close(got, want, jnp.float32, "grad")
