"""A small decoder-only Transformer in plain Flax NNX whose attention layer is pluggable.

Shared by the examples: `train_long_context.py` trains it with ring attention,
and other examples can rebuild it from the `config.json` written next to the
checkpoint (`load_model`) with whatever attention they need (`dense_attention`
for one device, or their own factory).  The parameter tree does not depend on
the attention: `RingMultiHeadAttention`, `nnx.MultiHeadAttention` with a ring
`attention_fn` and plain `nnx.MultiHeadAttention` all hold the same
query/key/value/out parameters, so a checkpoint trained with one loads into
the others.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import flax_ringattn

CONFIG_NAME = "config.json"
CHECKPOINT_NAME = "checkpoint"

# attention(config, rngs) -> a module called as attn(x, is_causal=True).
AttentionFactory = Callable[["ModelConfig", nnx.Rngs], nnx.Module]

# Residual branches (attention and MLP output projections) start at zero, so that
# every block starts as the identity; with it the key-value lookup of the
# example is learned in a few dozen steps instead of a long plateau.
zero_init = nnx.initializers.zeros_init()


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of `Transformer` (everything needed to rebuild it)."""

  vocab_size: int
  d_model: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  mlp_ratio: int = 4
  # Add an embedding of the previous token (in natural order) to each position.
  token_shift: bool = True

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  def __post_init__(self):
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model={self.d_model} must be a multiple of num_heads={self.num_heads}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    if self.d_model % 2:
      raise ValueError(f"d_model={self.d_model} must be even (sinusoidal position encoding)")

  def save(self, path) -> None:
    pathlib.Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

  @classmethod
  def load(cls, path) -> ModelConfig:
    return cls(**json.loads(pathlib.Path(path).read_text()))


# ------------------------------------------------------------------------------------------
# Attention factories: the two ways to swap ring attention into a model, and the plain layer.


def ring_attention_layer(
  *, mesh, seq_axis="sp", head_axis=None, load_balance=True, block_sizes=None
) -> AttentionFactory:
  """Swap style 1: `flax_ringattn.RingMultiHeadAttention` in place of `nnx.MultiHeadAttention`."""

  def make(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return flax_ringattn.RingMultiHeadAttention(
      config.num_heads,
      config.d_model,
      num_kv_heads=config.num_kv_heads,
      mesh=mesh,
      seq_axis=seq_axis,
      head_axis=head_axis,
      load_balance=load_balance,
      block_sizes=block_sizes,
      out_kernel_init=zero_init,
      rngs=rngs,
    )

  make.takes_positions = True  # the layer evaluates its mask on the tokens' positions (`positions=`)
  return make


def ring_attention_fn(*, mesh, seq_axis="sp", head_axis=None, load_balance=True, block_sizes=None) -> AttentionFactory:
  """Swap style 2: the stock `nnx.MultiHeadAttention` with a ring `attention_fn`."""
  attention_fn = flax_ringattn.make_ring_attention_fn(
    mesh=mesh, seq_axis=seq_axis, head_axis=head_axis, load_balance=load_balance, block_sizes=block_sizes
  )
  if head_axis is not None:
    # The layer style does this itself: shard the projections' heads over `head_axis`.
    kernel = {"out_sharding": (None, head_axis, None), "mesh": mesh}
    bias = {"out_sharding": (head_axis, None), "mesh": mesh}
    extra = dict(
      kernel_metadata=kernel,
      bias_metadata=bias,
      out_kernel_metadata={"out_sharding": (head_axis, None, None), "mesh": mesh},
      out_bias_metadata={"out_sharding": (None,), "mesh": mesh},
    )
  else:
    extra = {}

  def make(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    return nnx.MultiHeadAttention(
      config.num_heads,
      config.d_model,
      num_kv_heads=config.num_kv_heads,
      attention_fn=attention_fn,
      decode=False,
      out_kernel_init=zero_init,
      rngs=rngs,
      **extra,
    )

  return make


def dense_attention(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
  """The plain `nnx.MultiHeadAttention` (one device; same parameters as the ring layers)."""
  return nnx.MultiHeadAttention(
    config.num_heads,
    config.d_model,
    num_kv_heads=config.num_kv_heads,
    decode=False,
    out_kernel_init=zero_init,
    rngs=rngs,
  )


# ------------------------------------------------------------------------------------------
# The model.


def sinusoidal_encoding(positions, d_model: int):
  """[..., T] int positions -> [..., T, d_model] sin/cos encodings (any position, any order).

  Scaled to unit norm, like a freshly initialised token embedding, so that
  positions do not drown out token identity in the residual stream.
  """
  half = d_model // 2
  freqs = jnp.exp(-math.log(10_000.0) * jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[..., None] * freqs
  return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1) / math.sqrt(half)


class Block(nnx.Module):
  """Pre-norm attention + MLP."""

  def __init__(self, config: ModelConfig, attention: AttentionFactory, rngs: nnx.Rngs):
    d = config.d_model
    self.norm1 = nnx.LayerNorm(d, rngs=rngs)
    self.attn = attention(config, rngs)
    self.norm2 = nnx.LayerNorm(d, rngs=rngs)
    self.mlp_in = nnx.Linear(d, config.mlp_ratio * d, rngs=rngs)
    self.mlp_out = nnx.Linear(config.mlp_ratio * d, d, kernel_init=zero_init, rngs=rngs)

  def __call__(self, x, **mask):
    x = x + self.attn(self.norm1(x), is_causal=True, **mask)
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))


class Transformer(nnx.Module):
  """Decoder-only Transformer: token (+ previous-token) embedding, sinusoidal positions, blocks, head.

  `attention` builds each block's attention layer (see the factories above);
  it must accept `is_causal=True`.  `__call__(tokens, positions,
  prev_tokens)` takes the tokens in whatever order the attention expects
  (zigzag order for load-balanced ring attention) with their natural
  positions and, when `config.token_shift`, the token that precedes each one
  in natural order (`previous_tokens`, applied in the data pipeline before
  any reordering; when decoding, the previously generated token).  The shift
  puts "which key came before me" into every value token, so one attention
  layer can look up "the token after key k" directly.  A packed batch also
  passes `segment_ids` (the documents) to the attention.  The ring layer
  (`ring_attention_layer`) also gets the positions and evaluates its mask on
  them, so any token order is exact (packed rows need it).
  """

  def __init__(self, config: ModelConfig, attention: AttentionFactory, *, rngs: nnx.Rngs):
    self.config = config
    self.positions_to_attention = getattr(attention, "takes_positions", False)
    d = config.d_model
    self.embed = nnx.Embed(config.vocab_size, d, rngs=rngs)
    # Token shift: the previous token's embedding, through its own projection.
    self.shift = nnx.Linear(d, d, use_bias=False, rngs=rngs) if config.token_shift else None
    self.blocks = nnx.List([Block(config, attention, rngs) for _ in range(config.num_layers)])
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, config.vocab_size, rngs=rngs)

  def __call__(self, tokens, positions, prev_tokens=None, *, segment_ids=None):
    x = self.embed(tokens) + sinusoidal_encoding(positions, self.config.d_model)
    mask = {} if segment_ids is None else dict(segment_ids=segment_ids)
    if self.positions_to_attention:
      mask["positions"] = positions  # the zigzag (or any) order is then exact, not taken on trust
    if self.shift is not None:
      if prev_tokens is None:
        raise ValueError("this model was configured with token_shift=True: pass prev_tokens=...")
      x = x + self.shift(self.embed(prev_tokens))
    for block in self.blocks:
      x = block(x, **mask)
    return self.head(self.norm(x))


def previous_tokens(tokens: np.ndarray, bos: int = 0) -> np.ndarray:
  """[B, T] tokens in natural order -> the token before each one (`bos` at position 0)."""
  prev = np.roll(tokens, 1, axis=-1)
  prev[..., 0] = bos
  return prev


# ------------------------------------------------------------------------------------------
# Saving and loading.


def save_config(config: ModelConfig, run_dir) -> pathlib.Path:
  path = pathlib.Path(run_dir) / CONFIG_NAME
  config.save(path)
  return path


def load_model(run_dir, attention: AttentionFactory = dense_attention, *, sharding=None, restore: bool = True):
  """Rebuilds the `Transformer` saved in `run_dir` (config.json + orbax `checkpoint/`).

  `attention` picks the attention layer (default: plain `nnx.MultiHeadAttention`
  on one device).  Every parameter is restored onto `sharding` (default: the
  first device); `restore=False` returns the freshly initialised model.
  """
  import orbax.checkpoint as ocp

  run_dir = pathlib.Path(run_dir).resolve()
  config = ModelConfig.load(run_dir / CONFIG_NAME)
  model = Transformer(config, attention, rngs=nnx.Rngs(0))
  if not restore:
    return model
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), nnx.state(model, nnx.Param)
  )
  checkpointer = ocp.StandardCheckpointer()
  try:
    state = checkpointer.restore(run_dir / CHECKPOINT_NAME, target)
  finally:
    checkpointer.close()
  nnx.update(model, state)
  return model
