"""The real-size decoders of examples/_decoders.py (Qwen2.5-0.5B and Llama-3.2-1B shapes): their sizes, and their
hand-written attention converted by `fr.convert` exactly, forward and gradients, at a tiny size with the same head
layout."""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import assert_close

import flax_ringattn as fr

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import _decoders as decoders  # noqa: E402


def test_real_sizes():
  """Parameter counts of the two shapes (random weights, a 32,768-token vocabulary, tied embeddings)."""
  assert round(decoders.QWEN2_5_0_5B.params() / 1e6) == 387  # the real 494M has a 151,936-token vocabulary
  assert round(decoders.LLAMA3_2_1B.params() / 1e6) == 1040  # the real 1.24B has 128,256
  assert decoders.QWEN2_5_0_5B.flops_per_token(8192) > 6 * 387e6


@pytest.mark.parametrize("config", list(decoders.CONFIGS.values()), ids=list(decoders.CONFIGS))
def test_convert_is_exact(config):
  """convert(model, example=...) finds every block's attention (the model's own code, unedited) and the ring
  version computes the same logits and gradients as the original (XLA, one device)."""
  c = decoders.tiny(config)
  model = decoders.Decoder(c, rngs=nnx.Rngs(0))
  original = nnx.clone(model)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, c.vocab, (2, 64)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(64), (2, 64))
  report = fr.convert(model, example=lambda m: decoders.call(m, tokens, positions), implementation="xla")
  assert f"hand-written attention: {c.layers} converted, 0 left alone" in str(report), report

  def loss(m):
    return jnp.mean(decoders.call(m, tokens, positions).astype(jnp.float32) ** 2)

  want, want_grads = nnx.value_and_grad(loss)(original)
  got, got_grads = nnx.value_and_grad(loss)(model)
  assert_close(got, want, jnp.float32)
  assert_close(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), jnp.float32, "grad")
