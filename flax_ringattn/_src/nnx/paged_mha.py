"""`PagedMultiHeadAttention`: nnx.MultiHeadAttention serving a ragged batch from a paged KV cache."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from flax_ringattn._src import sharding, validation
from flax_ringattn._src.nnx.common import (
  build_head_options,
  check_keywords,
  check_layer_arguments,
  head_sharding_metadata,
  place_params,
)
from flax_ringattn._src.paged import attend, contracts
from flax_ringattn._src.paged import common as paged_common
from flax_ringattn._src.paged import step as paged_step
from flax_ringattn._src.paged.cache import PagedKVCache
from flax_ringattn._src.paged.implementations import check_implementation


class PagedMultiHeadAttention(nnx.MultiHeadAttention):
  """`nnx.MultiHeadAttention` for sampling: one call serves a mixed prefill/decode batch.

  Same constructor and parameter tree as `nnx.MultiHeadAttention` (weights of an
  existing layer or of a `RingMultiHeadAttention` load with `nnx.update`), plus
  keyword-only `mesh` / `head_axis` (kv heads sharded over a tensor axis: the op
  then runs under `shard_map` over it) / `seq_axis` (context parallelism: the
  cache's pages spread over that mesh axis, each device holding 1/n of every
  long sequence, the partials merged exactly; combines with `head_axis`; see
  `paged_attention`), `local_window_size` (jax.nn's meaning, as
  for `RingMultiHeadAttention`; the deprecated `sliding_window=w` is converted to
  `(w - 1, 0)`), `chunk_size` (as for `paged_attention`), `logits_soft_cap`, `implementation`, `block_sizes` and
  `interpret` (as for `paged_attention`), `checked`, and `use_sinks` / `v_head_dim` (a learnable `sinks` parameter
  [N], and a value head dim Hv other than the q/k one for MLA: the same parameters as `RingMultiHeadAttention`
  with these options, whose weights load with `nnx.update`; the cache then keeps v pages of Hv).  `decode` may be
  left out or True (the layer always samples from its paged cache); decode=False raises.

  A step whose new tokens do not fit a sequence's cache slot (past
  `pages_per_seq * page_size` tokens, or no free pages left) is never cut
  short: called eagerly it raises `CacheOverflowError` naming the slot; under
  `jit` the slot stores none of its tokens, its rows return 0, and
  `layer.overflowed()` ([max_num_seqs] bool) flags it until `free`: check it
  after each step (refuse or evict the request; see the README).  With
  `checked=True` the step instead raises under
  `jax.experimental.checkify.checkify`, and `paged_attention`'s metadata checks
  run too.

  On pallas_tpu (a TPU with implementation=None, or interpret=...), without
  `head_axis` (with or without `seq_axis`), a step writes the new tokens' K/V into their pages inside the
  attention kernel (fused cache write; the page buffers are aliased to its
  results) after reserving pages (copy-on-write included) in XLA; sinks
  rescale its finished rows.

  Usage::

      layer.init_cache(num_pages=..., page_size=16, max_num_seqs=8, pages_per_seq=64)
      y = layer(x, cu_q_lens=cu_q_lens, num_seqs=num_seqs)   # x: [T, features]
      layer.free(done)                                        # done: [max_num_seqs] bool

  `x` holds the new tokens of every sequence back to back (slot i owns rows
  cu_q_lens[i] .. cu_q_lens[i + 1] - 1), so prefill, chunked prefill, decode and
  speculative verification mix freely in one call.  Every layer keeps its own
  pages and an identical page table (allocation is deterministic).
  """

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    qkv_features: int | None = None,
    out_features: int | None = None,
    num_kv_heads: int | None = None,
    in_kv_features: int | None = None,
    *,
    mesh=None,
    head_axis=None,
    seq_axis=None,
    local_window_size=None,
    chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    implementation: str | None = None,
    block_sizes=None,
    interpret=None,
    checked: bool = False,
    use_sinks: bool = False,
    v_head_dim: int | None = None,
    dropout_rate: float = 0.0,
    kernel_metadata: Mapping = MappingProxyType({}),
    out_kernel_metadata: Mapping = MappingProxyType({}),
    bias_metadata: Mapping = MappingProxyType({}),
    out_bias_metadata: Mapping = MappingProxyType({}),
    sliding_window: int | None = None,
    **kwargs,
  ):
    check_keywords(type(self), kwargs)
    check_layer_arguments(
      type(self).__name__,
      num_heads=num_heads,
      in_features=in_features,
      qkv_features=qkv_features,
      out_features=out_features,
      num_kv_heads=num_kv_heads,
      in_kv_features=in_kv_features,
    )
    # The op's options are checked here, as the op checks them: a bad one fails at construction, not at the first
    # step.
    local_window_size = paged_common.paged_window(local_window_size, sliding_window)
    chunk_size = validation.check_chunk_size(chunk_size)
    logits_soft_cap = validation.check_soft_cap(logits_soft_cap)
    implementation = check_implementation(implementation)
    paged_common.check_block_sizes(block_sizes)
    if kwargs.pop("decode", None) is False:
      raise ValueError(
        "PagedMultiHeadAttention always samples from its paged cache (init_cache(...)); decode=False asks for a "
        "layer without a cache: use nnx.MultiHeadAttention or RingMultiHeadAttention (or leave decode out)"
      )
    if dropout_rate:
      raise NotImplementedError(f"PagedMultiHeadAttention does not implement dropout ({dropout_rate=})")
    if seq_axis is not None and mesh is None:
      raise ValueError(f"{type(self).__name__}: seq_axis={seq_axis!r} needs mesh=... (the mesh the pages spread over)")
    if isinstance(seq_axis, list):
      seq_axis = tuple(seq_axis)
    sharding.check_mesh_axes(mesh, where=type(self).__name__, head_axis=head_axis, seq_axis=seq_axis)
    if head_axis is not None and head_axis in (seq_axis if isinstance(seq_axis, tuple) else (seq_axis,)):
      raise ValueError(f"{type(self).__name__}: seq_axis={seq_axis!r} and head_axis={head_axis!r} must differ")
    metadata = head_sharding_metadata(
      head_axis,
      mesh,
      kernel_metadata=kernel_metadata,
      bias_metadata=bias_metadata,
      out_kernel_metadata=out_kernel_metadata,
      out_bias_metadata=out_bias_metadata,
    )
    if mesh is not None and head_axis is not None:
      size = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)).get(head_axis)
      kv = num_kv_heads if num_kv_heads is not None else num_heads
      if kv % size:
        raise ValueError(f"num_kv_heads={kv} must be a multiple of the {head_axis!r} axis size {size}")
    super().__init__(
      num_heads,
      in_features,
      qkv_features,
      out_features,
      num_kv_heads,
      in_kv_features,
      dropout_rate=0.0,
      decode=False,  # flax's own single-index cache stays off: the paged cache replaces it
      **metadata,
      **kwargs,
    )
    build_head_options(
      self, use_sinks=use_sinks, v_head_dim=v_head_dim, kwargs=kwargs, metadata=metadata, mesh=mesh, head_axis=head_axis
    )
    self.mesh = mesh
    self.head_axis = head_axis
    self.seq_axis = seq_axis
    self.local_window_size = local_window_size  # (left, right) or None
    self.chunk_size = chunk_size  # Llama 4's attention chunk, or None
    self.logits_soft_cap = logits_soft_cap
    self.implementation = implementation
    self.block_sizes = block_sizes
    self.interpret = interpret
    self.checked = validation.check_bool("checked", checked)
    self.kv_cache: nnx.Cache | None = nnx.data(None)

  def init_cache(  # type: ignore[override]
    self, *, num_pages: int, page_size: int, max_num_seqs: int, pages_per_seq: int, dtype=None, merged=False
  ):
    """Creates the paged cache (`nnx.Cache` state); int8/float8 dtypes quantize per token.  v pages have the
    layer's `v_head_dim`; with `seq_axis` the pages spread over it (num_pages a multiple of its size).
    `merged`: pages [P, page_size, K * H], "kv": kv pages [P, 2, page_size, K * H], or "auto" (the layout
    `ServingEngine` picks by default)
    (`PagedKVCache.create`).  With a
    mesh, the parameters are placed on it too (weights loaded with `nnx.update` before this call then need no
    move, and no second compile, at the first step)."""
    cache = PagedKVCache.create(
      num_pages=num_pages,
      page_size=page_size,
      max_num_seqs=max_num_seqs,
      pages_per_seq=pages_per_seq,
      num_kv_heads=self.num_kv_heads,
      head_dim=self.head_dim,
      v_head_dim=self.v_head_dim,
      dtype=dtype if dtype is not None else (self.dtype or self.param_dtype),
      merged=merged,
      **({} if self.seq_axis is None else dict(mesh=self.mesh, seq_axis=self.seq_axis)),
    )
    if self.mesh is not None and (self.head_axis is not None or self.seq_axis is None):
      # Pages split over the kv-head axis (and the page dimension over seq_axis), the page table replicated:
      # placed once here so the first jitted step does not see them move (and recompile).
      h, s = self.head_axis, self.seq_axis

      def place(path, x):
        if x is None:
          return None
        name = path[0].name
        if name in ("k_pages", "v_pages"):
          spec = P(s, None, h, *(None,) * (x.ndim - 3))  # merged [P, ps, K * H]: a device's heads' lanes
          if cache.kv_together:  # kv pages [P, 2, ps, K * H]
            spec = P(s, None, None, h)
        elif "scale" in name:
          spec = P(s, None, h)
        else:
          spec = P(s) if name == "ref_counts" else P()
        return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, spec))

      cache = jax.tree_util.tree_map_with_path(place, cache)
    place_params(self, self.mesh, self.head_axis)
    self.kv_cache = nnx.Cache(cache)

  def free(self, slots):
    """Releases the pages of finished sequences (`slots` [max_num_seqs] bool: True frees the slot; an int array
    raises `TypeError`); freed pages are zeroed."""
    cache = self._cache()
    slots = contracts.slot_mask(slots, cache.max_num_seqs, f"{type(self).__name__}.free")
    self.kv_cache.set_value(cache.free(slots))

  def overflowed(self):
    """[max_num_seqs] bool: slots whose write did not fit; they store nothing more until `free` (see the class)."""
    return self._cache().overflowed

  @property
  def sliding_window(self) -> int | None:
    """Deprecated: the window as a count that includes the token itself (`local_window_size[0] + 1`)."""
    return None if self.local_window_size is None else self.local_window_size[0] + 1

  def _cache(self) -> PagedKVCache:
    if self.kv_cache is None:
      raise ValueError("the paged cache is not initialised: call init_cache(...) first")
    return self.kv_cache.get_value()

  def _project(self, inputs, rows: str):
    """(q [T, N, H], k [T, K, H], v [T, K, Hv]) of `inputs` [T, features]."""
    if inputs.ndim != 2:
      raise ValueError(f"inputs must be [{rows}, features] (rank 2), got shape {tuple(inputs.shape)}")
    if inputs.shape[-1] != self.in_features:
      raise ValueError(f"inputs has {inputs.shape[-1]} features but the layer expects in_features={self.in_features}")
    query, key, value = self.query(inputs), self.key(inputs), self.value(inputs)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)
    return query, key, value

  def _layout(self) -> dict:
    """Sinks, and where the heads and pages are (the op's own shard_map over head_axis and / or seq_axis)."""
    split = self.mesh is not None and (self.head_axis is not None or self.seq_axis is not None)
    layout = dict(mesh=self.mesh, seq_axis=self.seq_axis, head_axis=self.head_axis) if split else {}
    return layout | {"sinks": None if self.sinks is None else self.sinks[...]}

  def _options(self) -> dict:
    options = dict(
      local_window_size=self.local_window_size,
      logits_soft_cap=self.logits_soft_cap,
      implementation=self.implementation,
      block_sizes=self.block_sizes,
      interpret=self.interpret,
    )
    return options | ({} if self.chunk_size is None else {"chunk_size": self.chunk_size})

  def prefill(self, inputs, *, slot, num_tokens):
    """Ring prefill of one long prompt into slot `slot`, sequence-parallel over `seq_axis` (`paged_ring_prefill`).

    `inputs` [Tp, features]: the prompt padded to Tp = `layer.kv_cache.get_value().ring_prefill_len(T)` tokens
    and laid out with `zigzag_order(x, n, axis=0)`, sharded over `seq_axis` (so every layer of the model,
    its MLP included, runs on Tp / n rows a device); num_tokens = T real tokens.  The slot's length must be a
    multiple of page_size (a new slot, or earlier prefill chunks of whole pages).  Returns [Tp, out_features] in
    the same layout; the prompt's K/V are in the cache and decoding continues with `__call__`.  A prompt that
    does not fit is refused as in `__call__` (`overflowed`).
    """
    if self.seq_axis is None:
      raise ValueError(
        f"{type(self).__name__}.prefill is the ring prefill over a sequence axis: construct the layer with mesh=... "
        "and seq_axis=... (a one-device cache prefills with __call__)"
      )
    cache = self._cache()
    contracts.slot("slot", slot, cache.max_num_seqs, f"{type(self).__name__}.prefill")
    query, key, value = self._project(inputs, "Tp")
    out, cache = attend.ring_prefill(
      cache,
      query,
      key,
      value,
      slot,
      num_tokens,
      sinks=None if self.sinks is None else self.sinks[...],
      mesh=self.mesh,
      seq_axis=self.seq_axis,
      head_axis=self.head_axis,
      checked=self.checked,
      **self._options(),
    )
    out_sharding = None
    if self.head_axis is not None and sharding.has_explicit_axes(self.mesh, P(self.head_axis)):
      out_sharding = sharding.named(self.mesh, P(self.seq_axis))  # the out projection sums the sharded heads
    y = self.out(out, out_sharding=out_sharding)
    # Assigned last: a prefill that raises leaves the layer's cache as it was.
    self.kv_cache.set_value(cache)
    return y

  def __call__(  # type: ignore[override]
    self,
    inputs,
    inputs_k=None,
    inputs_v=None,
    *,
    cu_q_lens=None,
    num_seqs=None,
    bidirectional_ids=None,
    mask=None,
    is_causal: bool | None = None,
    deterministic: bool | None = None,
    rngs=None,
    sow_weights: bool = False,
    decode: bool | None = None,
  ):
    """One serving step: `inputs` [T, features], the new tokens of every slot back to back (see the class).

    `bidirectional_ids` [T] int (one per row of `inputs`; 0: none): a prompt's tokens with the same nonzero id
    see each other in both directions (Gemma 3's image tokens, a prefix-LM prefix), as in `paged_attention`; a
    span must lie whole in one step (its keys are written in it).  Such a step appends its K/V, then attends
    (no fused cache write).

    `deterministic` and `rngs` are accepted for `nnx.MultiHeadAttention` call compatibility and unused (no
    dropout); `mask`, `sow_weights` and decode=False raise.  `is_causal=True` (the ring layers' keyword) is
    accepted, so a model written for `RingMultiHeadAttention` converts unedited; `is_causal=False` raises (each
    sequence attends causally over its cache).

    Called as a model calls `nnx.MultiHeadAttention` (`layer(x)` with `x` [1, T, features], `mask=` optional),
    without cu_q_lens, the layer serves the current `ServingEngine` step: the engine's ragged batch (or ring
    prefill) decides what each token sees; `mask` and `decode` are ignored (each sequence is causal over its own
    cache, whatever flag the model passes for its own cache).
    Outside a step such a call raises `TypeError`.
    """
    del deterministic, rngs
    if is_causal is not None and not is_causal:
      raise NotImplementedError(
        f"{type(self).__name__} serves causal attention over each sequence's cache: is_causal={is_causal!r} is "
        "not supported (pass is_causal=True or leave it out)"
      )
    if cu_q_lens is None and num_seqs is None:
      return self._model_call(inputs, inputs_k, inputs_v, sow_weights=sow_weights, decode=decode)
    if cu_q_lens is None or num_seqs is None:
      missing = "cu_q_lens" if cu_q_lens is None else "num_seqs"
      raise TypeError(
        f"{type(self).__name__}: pass both cu_q_lens= and num_seqs= (the ragged batch), {missing} is None"
      )
    if inputs_k is not None or inputs_v is not None:
      raise NotImplementedError(f"{type(self).__name__} is self-attention: inputs_k / inputs_v must be None")
    if sow_weights:
      raise NotImplementedError("sow_weights=True is not supported by PagedMultiHeadAttention")
    if mask is not None:
      raise NotImplementedError("PagedMultiHeadAttention takes no dense mask: causality comes from the cache positions")
    if decode is False:
      raise ValueError("PagedMultiHeadAttention always decodes from its paged cache: decode=False is not supported")
    query, key, value = self._project(inputs, "max_num_batched_tokens")
    options = self._options()
    if bidirectional_ids is not None:
      options["bidirectional_ids"] = bidirectional_ids
    # The layer's cache is assigned only once the step has succeeded: a step that raises (bad metadata, a full
    # cache, a bad option) leaves it exactly as it was.  The cache methods check the metadata before they write.
    x, cache = attend.ragged(
      self._cache(), query, key, value, cu_q_lens, num_seqs, **self._layout(), checked=self.checked, **options
    )
    out_sharding = None
    if (
      self.mesh is not None and self.head_axis is not None and sharding.has_explicit_axes(self.mesh, P(self.head_axis))
    ):
      # The out projection contracts the sharded heads: say where the sum lives.
      out_sharding = sharding.named(self.mesh, P())
    y = self.out(x, out_sharding=out_sharding)
    self.kv_cache.set_value(cache)
    return y

  def _model_call(self, inputs, inputs_k, inputs_v, *, sow_weights, decode):
    """The model's own call (`x` [1, T, features], `mask=` ignored) inside a `ServingEngine` step: the step's
    ragged batch (or its ring prefill) comes from `paged.step`, not from the arguments."""
    name = type(self).__name__
    current = paged_step.current()
    if current is None:
      raise TypeError(
        f"{name}: called without cu_q_lens= and num_seqs= outside a serving step: pass the ragged batch "
        "(layer(x, cu_q_lens=..., num_seqs=...), x [T, features]), or serve the model with fr.ServingEngine, "
        "which runs the model's own call and gives every converted layer its step"
      )
    for arg, other in (("inputs_k", inputs_k), ("inputs_v", inputs_v)):
      if other is not None and other is not inputs:
        raise NotImplementedError(f"{name} serves self-attention: {arg} must be None or the query input")
    shape = tuple(inputs.shape)
    if current.kind == "discover":  # caches are being sized (the engine, or convert's example=): nothing runs
      return jnp.zeros((*shape[:-1], self.out_features), self.dtype or inputs.dtype)
    if len(shape) != 3 or shape[0] != 1:
      raise ValueError(
        f"{name}: inside a serving step the model's input must be [1, T, features] (the engine's flat ragged "
        f"batch), got shape {shape}"
      )
    if current.kind == "ring_prefill":
      return self.prefill(inputs[0], slot=current.slot, num_tokens=current.num_tokens)[None]
    del decode  # the model's own decode flag (True, or False for its full forward) does not apply: the step decides
    out = self(inputs[0], cu_q_lens=current.cu_q_lens, num_seqs=current.num_seqs, sow_weights=sow_weights)
    return out[None]
