"""Dense masks into ring attention: recover the structure of a model's own mask, and the one-call port.

Models hand attention a dense boolean mask (flax's `make_attention_mask`, or the
`[B, T, S]` key masks of hand-written decoders) or an additive 0 / -inf bias.
Ring attention never passes an O(T * S) mask to a kernel: it recovers the
structure the mask encodes, `[causal] & [window] & (q_ids[i] == kv_ids[j])`
(`dense_masks.structure_from_dense_mask`), verifies the recovery entry by entry, and
runs on `is_causal` + `segment_ids` (+ the declared window).  Used by the NNX
layers (`mask=`), `convert` and `dot_product_attention` below; no flax import.
"""

from __future__ import annotations

import functools
import logging
import sys

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from flax_ringattn._src import dense_masks, flash, masks, sharding, validation
from flax_ringattn._src.ring.op import ring_attention
from flax_ringattn._src.ring.options import RingOptions

_MASK_ALTERNATIVES = (
  "ring attention never passes a dense [B, N, T, S] mask to its kernels (it would cost O(T * S) memory on every "
  "device); express the mask with is_causal=True, segment_ids=... (packed documents; padding: see "
  "flax_ringattn.padded_segment_ids), local_window_size=... (sliding window), or a combination, or keep "
  "the model's own attention for this layer"
)


def _inexact_message() -> str:
  return (
    "the dense mask=... is not of the family ring attention recovers exactly (([causal] & [window] | "
    "same bidirectional span) & (q_ids[i] == kv_ids[j]): causal or not, packed segments, padding of queries and "
    "keys or of keys only, a sliding window declared with local_window_size=..., and in a causal mask spans of "
    "tokens that see each other (image tokens, a prefix-LM prefix); a bias must be 0 or <= "
    f"{masks.BIAS_MASKED:g}); {_MASK_ALTERNATIVES}"
  )


def _raise_if_inexact(exact):
  if not bool(exact):
    raise ValueError(_inexact_message())


def _report_if_inexact(exact):
  # Under jit the check runs in a host callback.  Raising there would stop one device's thread while the
  # others wait in the ring's collectives (a hang, then an abort), so it reports and the output is NaN.
  # Once: through `logging` where the program has configured it, else on stderr (logging's own fallback would
  # print it a second time).
  if not bool(exact):
    logger = logging.getLogger("flax_ringattn")
    if logger.hasHandlers():
      logger.error("attention output set to NaN: %s", _inexact_message())
    else:
      print(f"flax_ringattn: attention output set to NaN: {_inexact_message()}", file=sys.stderr, flush=True)


def dense_mask_options(
  mask, *, B, N, T, S, is_causal, segment_ids, checked: bool, local_window_size=None, also_exact=None, fused=False
):
  """Turns a dense mask into (is_causal, segment_ids, bidirectional_ids, exact) for `ring_attention`.

  is_causal comes back as a Python bool when the mask is concrete (or has no
  causal question left because is_causal=True), else as a traced bool (the
  caller then branches with `lax.cond`).  bidirectional_ids are None for a
  concrete mask without spans, else [B, T] (zeros
  where there is none: a traced mask may or may not hold spans, and one
  program serves both).  The recovery is verified: a concrete mask raises
  `ValueError` at once.  For a traced one (under jit), when `checked` (True,
  the default, or "report"), `exact` (a traced bool, else None) tells the
  caller to poison its output with NaN (`poison_unless`): raising inside a
  multi-device program would hang it.  "report" also says why on stderr, in a
  host callback (which keeps the program out of the persistent compilation
  cache).  See
  `dense_masks.structure_from_dense_mask` (`fused`: its gather-free passes).  `also_exact` (a bool scalar) joins
  that verdict (e.g. "the bias was 0 / -inf").
  """
  if segment_ids is not None:
    raise ValueError("pass either mask=... or segment_ids=..., not both (segment_ids already describe the mask)")
  if T != S:
    raise NotImplementedError(
      f"a dense mask=... is recovered for self attention only (T == S), got T={T}, S={S}; for cross attention "
      "pass segment_ids=(q_ids, kv_ids) instead"
    )
  mask = dense_masks.dense_mask_4d(mask, B, N, T, S)
  if mask.dtype != jnp.bool_:
    mask = mask != 0
  if is_causal:
    mask = mask & jnp.tril(jnp.ones((T, S), bool))
  causal, q_ids, kv_ids, exact, bid = dense_masks.structure_from_dense_mask(
    mask, local_window_size=local_window_size, fused=fused
  )
  if also_exact is not None:
    exact = exact & also_exact
  if q_ids.shape[0] != B:
    q_ids, kv_ids = (jnp.broadcast_to(x, (B, T)) for x in (q_ids, kv_ids))
    bid = None if bid is None else jnp.broadcast_to(bid, (B, T))
  verdict = None
  if validation.all_concrete(exact):
    _raise_if_inexact(exact)
    causal = bool(causal)
    if bid is not None and not bool(jnp.any(bid != 0)):
      bid = None
  elif checked:
    # The NaN alone by default: a host callback keeps the whole program out of JAX's persistent compilation
    # cache (JAX writes no entry for a program with one), so every start would compile it again.
    if checked == "report":
      jax.debug.callback(_report_if_inexact, exact)
    verdict = exact
  if is_causal:
    causal = True
  return causal, (q_ids, kv_ids), bid, verdict


def poison_unless(exact, out):
  """out, or NaN everywhere when a traced mask was not recovered exactly (`exact` False; None: nothing)."""
  if exact is None:
    return out
  return jnp.where(exact, out, jnp.asarray(jnp.nan, out.dtype))


def call_with_mask_structure(fn, causal):
  """fn(is_causal) with a static flag: directly, or through `lax.cond` on a traced one."""
  if isinstance(causal, bool):
    return fn(causal)
  return jax.lax.cond(causal, lambda: fn(True), lambda: fn(False))


def _batch_and_heads(q) -> dict:
  """B and N of a [B, T, N, H] q (None when q is not 4-D: the op's own checks then name it)."""
  shape = tuple(getattr(q, "shape", ()))
  return dict(B=shape[0], N=shape[2]) if len(shape) == 4 else dict(B=None, N=None)


def as_four_dims(x, name: str, *, B: int | None, N: int | None):
  """A mask or bias of shape [T, S], [B, T, S] or [B | 1, N | 1, T, S] as 4-D.  A 3-D one whose first axis is
  both B and N (> 1) is refused: jax.nn.dot_product_attention reads 3-D as [N, T, S], this function as
  [B, T, S], and the wrong reading of a per-head mask would be a per-row one, silently."""
  shape = tuple(getattr(x, "shape", ()))
  if len(shape) == 2:
    return x[None, None]
  if len(shape) == 3:
    if B is not None and shape[0] == B == N > 1:
      raise ValueError(
        f"{name}.shape={shape} is ambiguous with batch {B} and {N} heads: this function reads a 3-D {name} as "
        f"[B, T, S] (hand-written decoders' layout), jax.nn.dot_product_attention as [N, T, S]; pass it 4-D: "
        f"{name}[:, None] ([B, 1, T, S]) or {name}[None] ([1, N, T, S])"
      )
    return x[:, None]
  if len(shape) == 4:
    return x
  raise ValueError(f"{name} must be [T, S], [B, T, S] or [B | 1, N | 1, T, S], got {name}.shape={shape}")


def bias_as_mask(bias):
  """(visible mask, exact) of an additive bias: 0 is visible, <= BIAS_MASKED hidden, anything else inexact."""
  b = jnp.asarray(bias)
  visible = b == 0
  return visible, jnp.all(visible | (b <= masks.BIAS_MASKED))


def context_mesh(mesh, axis_name):
  """`mesh`, else the mesh of `jax.set_mesh` (unless `axis_name` is already bound by the caller's shard_map)."""
  if mesh is not None:
    return mesh
  if axis_name is not None and all(sharding.axis_is_bound(a) for a in _axes(axis_name)):
    return None
  try:
    concrete = jax.sharding.get_mesh()
  except ValueError:  # under jax.jit only the abstract mesh of `jax.set_mesh` can be read
    concrete = None
  for current in (concrete, jax.sharding.get_abstract_mesh()):
    if current is not None and current.axis_names:
      return current  # the concrete mesh when there is one: eager calls place their arrays on it
  return None


def _axes(axis_name):
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def dot_product_attention(
  q,
  k,
  v,
  *,
  mask=None,
  bias=None,
  is_causal: bool = False,
  segment_ids=None,
  scale: float | None = None,
  logits_soft_cap: float | None = None,
  local_window_size=None,
  mesh=None,
  axis_name=None,
  load_balance: bool = False,
  strategy: str = "ring",
  implementation: str | None = None,
  block_sizes=None,
  batch_axis=None,
  head_axis=None,
  precision=None,
  interpret=None,
  check_mask: bool | str = True,
  sinks=None,
  q_positions=None,
  kv_positions=None,
  chunk_size: int | None = None,
  bidirectional_ids=None,
):
  """`jax.nn.dot_product_attention`'s call, run as ring attention over a mesh axis.

  One call replaces the hand-written einsum -> mask -> softmax -> einsum block
  of a model (Gemma, Llama and Qwen styles): pass the model's q, k, v, its own
  mask or bias, its scale, soft cap and window.

  Args:
    q: [B, T, N, H]; k: [B, S, K, H]; v: [B, S, K, Hv] (N % K == 0; only the
      K kv heads travel; Hv may differ from H, as in MLA).  Global arrays with
      a mesh, local shards inside your shard_map.
    mask: a `flax_ringattn.Mask` (the mask's terms as one object, as in
      `ring_attention`), or the model's boolean mask, True = visible: [T, S], [B, T, S] (the key
      masks of hand-written decoders, padding queries may see keys; unlike
      `jax.nn.dot_product_attention`'s [N, T, S], so a 3-D mask with B == N > 1
      is refused as ambiguous) or [B | 1, N | 1, T, S].  Its structure `[causal] & [window] & (q_ids[i] ==
      kv_ids[j])` is recovered and verified: a concrete mask raises at once
      when it is not of that family; under jit the output is NaN
      (check_mask="report" also says why on stderr, in a host callback;
      check_mask=False turns the check off).  No
      O(T * S) array reaches a kernel.
    bias: instead of a mask, an additive bias of 0 (visible) and large
      negatives (<= -1e6 or -inf, hidden), in the same layouts.
    is_causal, segment_ids, local_window_size, logits_soft_cap: as in
      `ring_attention`.  A window the model builds into its mask must be
      declared here (it is part of the verified structure).
    scale: the logit scale (default H ** -0.5); pass 1.0 when q is pre-scaled.
    mesh: the mesh to run on; default: the mesh of `jax.set_mesh`, if any.
    axis_name: the sequence axis (default: the mesh's only axis).
    load_balance, strategy, implementation, block_sizes, batch_axis, head_axis, precision, interpret, sinks:
      as in `ring_attention` (sinks:
      the [N] attention-sink logits of a gpt-oss-style model, the column it
      concatenates to its logits before the softmax).
    q_positions, kv_positions, chunk_size, bidirectional_ids: as in
      `ring_attention` (the mask on the tokens' own positions; not with a
      dense mask or bias, which is read on the index in the sequence).

  Returns:
    [B, T, N, Hv] in q.dtype.  Rows with no visible key are 0 (a hand-written
    softmax over only masked logits gives their mean instead).
  """
  if mask is not None and bias is not None:
    raise ValueError("pass either mask=... or bias=..., not both")
  structure = mask if isinstance(mask, masks.Mask) else None
  mask = None if structure is not None else mask
  validation.check_bool("is_causal", is_causal)
  also_exact = None
  if bias is not None:
    mask, also_exact = bias_as_mask(as_four_dims(bias, "bias", **_batch_and_heads(q)))
  mesh = context_mesh(mesh, axis_name)
  options = RingOptions(
    axis_name=axis_name,
    mesh=mesh,
    is_causal=is_causal,
    local_window_size=local_window_size,
    chunk_size=chunk_size,
    logits_soft_cap=logits_soft_cap,
    scale=scale,
    load_balance=load_balance,
    strategy=strategy,
    implementation=implementation,
    block_sizes=block_sizes,
    batch_axis=batch_axis,
    head_axis=head_axis,
    precision=precision,
    interpret=interpret,
    check_mask=check_mask,
  )
  mask = structure if mask is None else as_four_dims(mask, "mask", **_batch_and_heads(q))
  tokens = dict(q_positions=q_positions, kv_positions=kv_positions, bidirectional_ids=bidirectional_ids)
  return masked_ring_attention(
    q, k, v, options, mask=mask, also_exact=also_exact, segment_ids=segment_ids, sinks=sinks, **tokens
  )


def masked_ring_attention(
  q,
  k,
  v,
  options: RingOptions,
  *,
  mask,
  also_exact=None,
  segment_ids=None,
  dropout_rng=None,
  sinks=None,
  q_positions=None,
  kv_positions=None,
  bidirectional_ids=None,
):
  """`ring_attention` with `options`, and a `masks.Mask` (passed on as is), or a dense 4-D boolean mask (or None)
  recovered into its structure (see
  `dense_mask_options`; the recovery must also satisfy `also_exact`), the output poisoned with NaN when a
  traced mask is outside the family.  The one path of the layers, `make_ring_attention_fn`, `convert`'s
  hand-written sites and `dot_product_attention`; `sinks`: the [N] attention-sink logits, or None; positions and
  bidirectional ids: as in `ring_attention` (not with a dense mask)."""
  axis_name = sharding.sequence_axis(options.mesh, options.axis_name, arg="axis_name")
  options = options.replace(axis_name=axis_name)
  causal, exact = options.is_causal, None
  tokens = dict(q_positions=q_positions, kv_positions=kv_positions, bidirectional_ids=bidirectional_ids)
  structure = None
  if isinstance(mask, masks.Mask):
    structure, mask = mask, None
  if mask is not None:
    given = [name for name, x in (*tokens.items(), ("chunk_size", options.chunk_size)) if x is not None]
    if given:
      raise NotImplementedError(
        f"a dense mask=... (or bias) is read on the tokens' index in the sequence as causal, window and "
        f"segments; with {', '.join(given)} pass the mask's structure (is_causal, segment_ids, "
        "local_window_size, chunk_size, bidirectional_ids) instead of a dense mask"
      )
    B, T, N = q.shape[0], q.shape[1], q.shape[2]
    shared = dict(B=B, N=N, T=T, is_causal=options.is_causal, checked=options.check_mask)
    if segment_ids is None and T == k.shape[1] and not validation.all_concrete(mask):
      # A traced mask that is exactly causal (within the declared window), as decoders build it and hand it down,
      # is told apart by one compare and reduction: its recovery's passes and host check then do not run, and
      # the kernels see zero ids (a tile's ids then classify it as causal alone: `masks.classify`).
      plain = plain_causal(mask, B=B, N=N, T=T, is_causal=options.is_causal, window=options.local_window_size)
      if also_exact is not None:
        plain = plain & also_exact
      # Without a window, a non-causal structure is given as a causal one whose bidirectional ids are the segments
      # (`_as_causal`); a window that ends at the query (right == 0, Gemma's and Mistral's) is causal already.
      # Either way `causal` is static and the kernels are traced once, not once per branch of a cond on it: half
      # the kernels of every converted decoder layer to compile.
      window = validation.normalize_window(options.local_window_size)  # (left, right); an int w is (w, w)
      one_set = options.is_causal or window is None or window[1] == 0
      # The recovery behind one jit per (mask shape, options): a decoder's layers trace it once, not once each.
      fused = fused_recovery()
      recovered = functools.partial(_recovered, mask, also_exact, local_window_size=window, fused=fused, **shared)
      if fused:
        # On a TPU the recovery runs whatever `plain` says and is selected after: a `lax.cond`'s operand is
        # written to memory whole, and a model's [T, T] mask, built from iota, otherwise fuses into every pass
        # that reads it.  Compiled for a v5e (Qwen2.5-0.5B, 24 blocks, remat saving the structure, a chunked
        # loss), the cond held the mask in a T x T slot and the longest sequence was 81,920 tokens to splash's
        # 90,112; selected after, 90,112 too, XLA merging the layers' identical recoveries into 11 passes a step.
        found = jax.tree.map(lambda a, b: jnp.where(plain, a, b), _plain_structure(B, T)(), recovered())
      else:
        found = jax.lax.cond(plain, _plain_structure(B, T), recovered)
      # Named for `save_attention_residuals`: saved, a remat's backward does not read the mask again.
      found = jax.tree.map(lambda x: checkpoint_name(x, flash.MASK_STRUCTURE_NAME), found)
      causal, segment_ids, bidirectional_ids, exact = found
      causal = True if one_set else causal
      exact = exact if options.check_mask else None
    else:
      causal, segment_ids, bidirectional_ids, exact = dense_mask_options(
        mask,
        S=k.shape[1],
        segment_ids=segment_ids,
        local_window_size=options.local_window_size,
        also_exact=also_exact,
        **shared,
      )
    tokens["bidirectional_ids"] = bidirectional_ids

  def attend(is_causal):
    kwargs = options.replace(is_causal=is_causal).ring_kwargs()
    return ring_attention(
      q, k, v, segment_ids=segment_ids, dropout_rng=dropout_rng, sinks=sinks, mask=structure, **tokens, **kwargs
    )

  return poison_unless(exact, call_with_mask_structure(attend, causal))


def _plain_structure(B: int, T: int):
  """The structure `dense_mask_options` recovers from a causal mask, as `_traced` returns it."""

  def structure():
    zeros = jnp.zeros((B, T), jnp.int32)
    return jnp.asarray(True), (zeros, zeros), (zeros, zeros), jnp.asarray(True)

  return structure


# Whether a traced dense mask's recovery runs unconditionally with gather-free passes (`fused_recovery`): None
# (default) on a TPU; True or False forces it (`benchmarks/tpu_compile.py` compiles for a TPU from a CPU host).
FUSED_RECOVERY: bool | None = None


def fused_recovery() -> bool:
  """Whether masked attention recovers a traced mask unconditionally, by fused passes (`FUSED_RECOVERY`)."""
  return jax.default_backend() == "tpu" if FUSED_RECOVERY is None else bool(FUSED_RECOVERY)


@functools.partial(jax.jit, static_argnames=("B", "N", "T", "is_causal", "checked", "local_window_size", "fused"))
def _recovered(mask, also_exact, *, B, N, T, is_causal, checked, local_window_size, fused=False):
  """`_traced` of `dense_mask_options` on a traced self-attention mask (a `lax.cond` branch); `local_window_size`
  normalized ((left, right) or None: then a non-causal structure comes back as its causal equal)."""
  shape = dict(B=B, N=N, T=T, S=T, is_causal=is_causal, checked=checked)
  recover = functools.partial(
    dense_mask_options, mask, segment_ids=None, local_window_size=local_window_size, also_exact=also_exact,
    fused=fused, **shape,
  )  # fmt: skip
  return _traced(recover, as_causal=local_window_size is None)()


def _traced(recover, *, as_causal: bool):
  """`recover()` (`dense_mask_options` on a traced mask) with every result an array, for a `lax.cond` branch;
  bidirectional ids as a (q, kv) pair.  `as_causal` (no window): a non-causal structure as its causal equal."""

  def structure():
    causal, (q_ids, kv_ids), bid, exact = recover()
    bid = (bid, bid)
    if as_causal:
      causal, bid = _as_causal(causal, q_ids, kv_ids, bid)
    return jnp.asarray(causal), (q_ids, kv_ids), bid, jnp.asarray(True) if exact is None else exact

  return structure


def _as_causal(causal, q_ids, kv_ids, bid):
  """(True, bidirectional ids) with the same visibility as a recovered (causal, segment ids, bid) without window.

  Non-causal, a query sees exactly the keys of its segment (q_ids == kv_ids, padding never matches).  Causal with
  bidirectional ids equal to the segment ids + 1 (0 for padding: no span) sees the earlier keys of its segment and,
  through the span term, its later ones: the same set (`masks.pair_visible`: (causal | span) & segment)."""
  span = lambda ids: jnp.where(ids >= 0, ids + 1, 0)  # noqa: E731 (labels are 0 .. S - 1, padding negative)
  bid = tuple(jnp.where(causal, b, span(ids)) for b, ids in zip(bid, (q_ids, kv_ids), strict=True))
  return jnp.asarray(True), bid


def plain_causal(mask, *, B, N, T, is_causal=False, window=None):
  """Traced bool: the dense self-attention mask is exactly causal (within `window`), for every batch row and
  head.  One elementwise compare and reduction, fused with the mask's own construction where XLA can."""
  m = dense_masks.dense_mask_4d(mask, B, N, T, T)
  m = m if m.dtype == jnp.bool_ else m != 0
  zeros = jnp.zeros((1, T), jnp.int32)
  want = dense_masks.dense_mask_from_structure(True, zeros, zeros, local_window_size=window)  # [1, 1, T, T]
  if is_causal:  # is_causal=True with a mask: their AND (`dense_mask_options`)
    m = m & jnp.tril(jnp.ones((T, T), jnp.bool_))
  return jnp.all(m == want)
