"""`paged_attention`: ragged mixed prefill + decode attention over a paged KV cache.

Public front end (validation, backend choice, opt-in dynamic checks) and the
private differentiable core `_paged_attention` (custom_vjp).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import checkify
from jax.sharding import AxisType, PartitionSpec

from flax_ringattn._src import backends, validation
from flax_ringattn._src import paged_common as common
from flax_ringattn._src.backends.pallas_tpu import paged as pallas_paged
from flax_ringattn._src.backends.pallas_tpu import planner
from flax_ringattn._src.backends.xla import paged as xla_paged
from flax_ringattn._src.block_sizes import BlockSizes

_IMPLEMENTATIONS = ("pallas_tpu", "xla")
DEFAULT_PAGED_BLOCKS = BlockSizes(block_q=16, block_kv=128)


def paged_attention(
  q,
  k_pages,
  v_pages,
  kv_lens,
  page_indices,
  cu_q_lens,
  num_seqs,
  *,
  sliding_window: int | None = None,
  logits_soft_cap: float | None = None,
  scale: float | None = None,
  k_scale=None,
  v_scale=None,
  implementation: str | None = None,
  block_sizes: BlockSizes | None = None,
  checked: bool = False,
  interpret=None,
):
  """Attention of a ragged batch of new tokens over their sequences' paged KV cache.

  Args:
    q: [T, N, H] new tokens of all sequences back to back (T =
      max_num_batched_tokens; rows past cu_q_lens[num_seqs] are padding and
      return 0).  Heads stay in the second-minor dimension, as projected.
    k_pages, v_pages: [P, page_size, K, H] page-major caches (N % K == 0); float,
      or int8 / float8 with `k_scale` / `v_scale`.
    kv_lens: [S] tokens of each sequence in the cache, new tokens included.
    page_indices: [S, pages_per_seq] page ids of each sequence, in order.
    cu_q_lens: [S + 1] sequence i owns rows cu_q_lens[i] .. cu_q_lens[i+1]-1.
    num_seqs: [1] sequences in use (dynamic: no recompilation).
    sliding_window: each token sees at most this many tokens, itself included.
    logits_soft_cap: c > 0: logits become c * tanh(logits / c).
    scale: logit scale, default H ** -0.5.
    k_scale, v_scale: Python floats, or float arrays of shape () or [P, K] (per
      page and kv head) or [P, page_size, K] (per token); dequantised value =
      stored * scale.  A float is converted to an array inside but is a constant
      of the enclosing jit (a new value retraces); pass an array to change the
      value without recompiling.
    implementation: "pallas_tpu" (the ragged paged Pallas TPU kernel,
      `_src/backends/pallas_tpu/paged.py`), "xla" (portable), or None: the
      TPU kernel on a TPU when it supports the call, else XLA.
    block_sizes: `BlockSizes(block_q=rows per chunk, block_kv=kv tokens per
      step, a multiple of page_size)`.  None: (16, 128) on XLA; on pallas_tpu
      `plan_paged_block_sizes`, which fits both kernels in the chip's VMEM.
    checked: under `jit`, add `checkify` checks of the metadata's values
      (num_seqs in range, cu_q_lens starting at 0 and non-decreasing, at most T
      new tokens, q_len <= kv_len, kv_lens within pages_per_seq * page_size,
      page ids in [0, P) for the pages a sequence uses); run the call under
      `jax.experimental.checkify.checkify`.  Called on concrete arrays, the
      same checks always run and raise `ValueError` (naming the operand, the
      slot or position, and the value), whatever `checked` says.  Unchecked
      under `jit`, bad metadata can still never make a sequence read outside
      its own pages: such slots are masked.
    interpret: run the pallas_tpu kernel in Pallas TPU interpret mode (on CPU):
      True or a `jax.experimental.pallas.tpu.InterpretParams`.  Implies
      implementation="pallas_tpu" when implementation is None.

  Returns:
    [T, N, H] in q.dtype.  Differentiable in q, k_pages and v_pages (gradients
    are scatter-added into the pages each sequence reads).
  """
  spec, k_scale, v_scale = _spec_for(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    k_scale,
    v_scale,
    sliding_window=sliding_window,
    logits_soft_cap=logits_soft_cap,
    scale=scale,
    implementation=implementation,
    block_sizes=block_sizes,
    checked=checked,
    interpret=interpret,
  )
  T, P, ps = q.shape[0], k_pages.shape[0], k_pages.shape[1]
  kv_lens, page_indices, cu_q_lens, num_seqs = (
    jnp.asarray(x, jnp.int32) for x in (kv_lens, page_indices, cu_q_lens, num_seqs)
  )
  check_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, T, P, ps, checked=checked)
  args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
  mesh = _explicit_mesh(args)
  if mesh is None:
    return _paged_attention(*args, spec)
  # Arrays typed on an Explicit mesh (e.g. replicated parameters' outputs): the
  # op works per device, so run it as a replicated shard_map over that mesh.
  return jax.shard_map(
    lambda *a: _paged_attention(*a, spec),
    mesh=mesh,
    in_specs=PartitionSpec(),
    out_specs=PartitionSpec(),
    check_vma=False,
  )(*args)


def _spec_for(
  q,
  k_pages,
  v_pages,
  kv_lens,
  page_indices,
  cu_q_lens,
  num_seqs,
  k_scale,
  v_scale,
  *,
  sliding_window,
  logits_soft_cap,
  scale,
  implementation,
  block_sizes,
  checked,
  interpret,
):
  """Static validation and backend choice: (PagedSpec, k_scale, v_scale as arrays)."""
  k_scale, v_scale = common.normalize_scales(k_scale, v_scale)
  T, N, H, P, ps, K, S, pps = common.check_paged_inputs(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale
  )
  if implementation is not None and implementation not in _IMPLEMENTATIONS:
    raise ValueError(f"unknown {implementation=} for paged_attention; available: {_IMPLEMENTATIONS}")
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a flax_ringattn.BlockSizes, got {type(block_sizes).__name__}")
  if block_sizes is not None and block_sizes.block_kv % ps and ps % block_sizes.block_kv:
    raise ValueError(f"block_sizes.block_kv={block_sizes.block_kv} must be a multiple of page_size={ps}")
  implementation, interpret, blocks = _choose_backend(
    implementation, interpret, block_sizes, q, k_pages, k_scale, v_scale, pps, logits_soft_cap
  )
  spec = common.PagedSpec(
    scale=validation.check_scale(scale, H),
    logits_soft_cap=validation.check_soft_cap(logits_soft_cap),
    sliding_window=common.check_sliding_window(sliding_window),
    block_q=min(blocks.block_q, T),
    pages_per_block=max(1, min(blocks.block_kv // ps, pps)),
    checked=validation.check_bool("checked", checked),
    implementation=implementation,
    interpret=interpret,
  )
  return spec, k_scale, v_scale


def uses_fused_cache_write(
  q,
  k_pages,
  v_pages,
  kv_lens,
  page_indices,
  cu_q_lens,
  num_seqs,
  *,
  k_scale=None,
  v_scale=None,
  sliding_window=None,
  logits_soft_cap=None,
  scale=None,
  implementation=None,
  block_sizes=None,
  interpret=None,
):
  """Whether `paged_attention_with_cache_write` runs for these arguments (pallas_tpu, per-token scales)."""
  spec, k_scale, v_scale = _spec_for(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    k_scale,
    v_scale,
    sliding_window=sliding_window,
    logits_soft_cap=logits_soft_cap,
    scale=scale,
    implementation=implementation,
    block_sizes=block_sizes,
    checked=False,
    interpret=interpret,
  )
  return _fused_write_runs(spec, k_scale, v_scale)


def _fused_write_runs(spec, k_scale, v_scale) -> bool:
  """The fused write needs the pallas_tpu kernel and per-token ([P, page_size, K]) scales, or none."""
  return spec.implementation == "pallas_tpu" and all(x is None or x.ndim == 3 for x in (k_scale, v_scale))


def paged_attention_with_cache_write(
  q,
  k_new,
  v_new,
  k_pages,
  v_pages,
  kv_lens,
  page_indices,
  cu_q_lens,
  num_seqs,
  *,
  k_scale=None,
  v_scale=None,
  k_new_scale=None,
  v_new_scale=None,
  sliding_window=None,
  logits_soft_cap=None,
  scale=None,
  implementation=None,
  block_sizes=None,
  checked: bool = False,
  interpret=None,
):
  """Attention with the fused cache write, when the call runs on pallas_tpu; else None (append separately).

  k_new, v_new: [T, K, H] the new tokens' K/V as the pages store them, with per-token scales [T, K] for a
  scaled cache; k_pages .. v_scale: the cache after `PagedKVCache.reserve_append` (pages reserved,
  copy-on-write done, kv_lens grown).  Returns (out [T, N, H], k_pages, v_pages, k_scale, v_scale), the pages
  with the new tokens written in the same launch (buffers aliased: donate them to update in place).  Serving
  only: not differentiable.  `checked` as for `paged_attention`.
  """
  spec, k_scale, v_scale = _spec_for(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    k_scale,
    v_scale,
    sliding_window=sliding_window,
    logits_soft_cap=logits_soft_cap,
    scale=scale,
    implementation=implementation,
    block_sizes=block_sizes,
    checked=False,
    interpret=interpret,
  )
  if not _fused_write_runs(spec, k_scale, v_scale):
    return None
  kv_lens, page_indices, cu_q_lens, num_seqs = (
    jnp.asarray(x, jnp.int32) for x in (kv_lens, page_indices, cu_q_lens, num_seqs)
  )
  check_metadata(
    kv_lens, page_indices, cu_q_lens, num_seqs, q.shape[0], k_pages.shape[0], k_pages.shape[1], checked=checked
  )
  return pallas_paged.paged_fwd_write(
    q,
    k_new,
    v_new,
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    k_scale,
    v_scale,
    k_new_scale,
    v_new_scale,
    spec=spec,
    interpret=spec.interpret,
  )


def _choose_backend(implementation, interpret, block_sizes, q, k_pages, k_scale, v_scale, pps, soft_cap):
  """(implementation, interpret, blocks) with the ring's rules: `interpret` implies pallas_tpu; pallas_tpu off
  TPU without `interpret` raises NotImplementedError; None picks pallas_tpu on a TPU when it supports the call.

  Blocks: `block_sizes`, else the planner's choice for the TPU kernel, else DEFAULT_PAGED_BLOCKS.
  """
  # The block backends' registry applies those rules (and their errors) once for both ops.
  backend = backends.get_backend(
    implementation, dtype=q.dtype, spec=None, shapes=None, interpret=interpret, preference=_IMPLEMENTATIONS
  )
  if backend.name != "pallas_tpu":
    return backend.name, None, DEFAULT_PAGED_BLOCKS if block_sizes is None else block_sizes
  T, N, H = q.shape
  _, ps, K, _ = k_pages.shape
  try:
    blocks = block_sizes
    if blocks is None:
      rows = tuple(0 if x is None else (1 if x.ndim < 3 else ps) for x in (k_scale, v_scale))
      try:
        blocks = planner.plan_paged_block_sizes(
          T, ps, pps, N, K, H, q.dtype, k_pages.dtype, scale_rows=rows, soft_cap=soft_cap is not None
        )
      except ValueError as e:
        raise NotImplementedError(str(e)) from None
    pallas_paged.check_supported(q, k_pages, block_q=blocks.block_q, pages_per_block=max(1, blocks.block_kv // ps))
  except NotImplementedError:
    if implementation is None and interpret is None:  # chosen automatically: the portable backend instead
      return "xla", None, DEFAULT_PAGED_BLOCKS if block_sizes is None else block_sizes
    raise
  return "pallas_tpu", backend.interpret, blocks


def _explicit_mesh(args):
  mesh = None
  for x in args:
    if x is None:
      continue
    sharding = getattr(jax.typeof(x), "sharding", None)
    m = getattr(sharding, "mesh", None)
    if m is None or not m.axis_names or not any(t == AxisType.Explicit for t in m.axis_types):
      continue
    if any(e is not None for e in sharding.spec):
      raise ValueError(
        f"paged_attention works per device: an input sharded as {sharding.spec} over Explicit mesh axes must be "
        "split with jax.shard_map first (PagedMultiHeadAttention does this for kv heads with head_axis=...)"
      )
    mesh = m
  return mesh


def _metadata_problems(kv_lens, page_indices, cu_q_lens, num_seqs, T, P, ps):
  """The value checks of the ragged batch's metadata: [(bad, message, values)], each `bad` a bool scalar and
  `values` the scalars its message names (the first offending slot or position).  Only live entries count:
  the first num_seqs + 1 of cu_q_lens, the first num_seqs slots, the pages a slot's kv_lens uses."""
  S, pps = page_indices.shape
  i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
  first = lambda m: jnp.argmax(m.reshape(-1)).astype(jnp.int32)  # noqa: E731
  n = num_seqs[0]
  live = jnp.arange(S) < n
  problems = [
    (
      (n < 0) | (n > S),
      "num_seqs={n} must be in [0, max_num_seqs={S}] (page_indices.shape[0])",
      dict(n=n, S=i32(S)),
    ),
    (cu_q_lens[0] != 0, "cu_q_lens[0]={c0} must be 0 (the first sequence starts at row 0)", dict(c0=cu_q_lens[0])),
  ]
  down = live & (cu_q_lens[1:] < cu_q_lens[:-1])
  i = first(down)
  problems.append(
    (
      jnp.any(down),
      "cu_q_lens must be non-decreasing over its first num_seqs + 1 entries: cu_q_lens[{i}]={a} > cu_q_lens[{j}]={b}",
      dict(i=i, a=cu_q_lens[i], j=i + 1, b=cu_q_lens[i + 1]),
    )
  )
  total = cu_q_lens[jnp.clip(n, 0, S)]
  problems.append(
    (
      total > T,
      "the batch has {total} new tokens (cu_q_lens[num_seqs={n}]), more than max_num_batched_tokens={T} (q.shape[0])",
      dict(total=total, n=n, T=i32(T)),
    )
  )
  negative = live & (kv_lens < 0)
  s = first(negative)
  problems.append((jnp.any(negative), "kv_lens[{s}]={kv} must be >= 0", dict(s=s, kv=kv_lens[s])))
  q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
  over = live & (q_lens > kv_lens)
  s = first(over)
  problems.append(
    (
      jnp.any(over),
      "slot {s} has {q} new tokens (cu_q_lens[{s1}] - cu_q_lens[{s}]) but kv_lens[{s}]={kv}: kv_lens must count "
      "the new tokens too",
      dict(s=s, q=q_lens[s], s1=s + 1, kv=kv_lens[s]),
    )
  )
  long = live & (kv_lens > pps * ps)
  s = first(long)
  problems.append(
    (
      jnp.any(long),
      "kv_lens[{s}]={kv} exceeds the slot's pages: pages_per_seq * page_size = {pps} * {ps} = {cap}",
      dict(s=s, kv=kv_lens[s], pps=i32(pps), ps=i32(ps), cap=i32(pps * ps)),
    )
  )
  used = (jnp.arange(pps)[None] * ps < kv_lens[:, None]) & live[:, None]
  bad = used & ((page_indices < 0) | (page_indices >= P))
  k = first(bad)
  s, j = k // pps, k % pps
  problems.append(
    (
      jnp.any(bad),
      "page_indices[{s}, {j}]={p} is out of range [0, {P}) (k_pages.shape[0]); slot {s} uses its first {u} "
      "pages (kv_lens[{s}]={kv}, page_size={ps})",
      dict(s=s, j=j, p=page_indices[s, j], P=i32(P), u=(kv_lens[s] + ps - 1) // ps, kv=kv_lens[s], ps=i32(ps)),
    )
  )
  return problems


def check_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, T, P, ps, *, checked: bool):
  """Validates the metadata's values: eagerly (ValueError) when every array is concrete, which costs jitted
  calls nothing; under a trace, as `checkify` checks when `checked`."""
  arrays = (kv_lens, page_indices, cu_q_lens, num_seqs)
  concrete = validation.all_concrete(*arrays)
  if not concrete and not checked:
    return
  for bad, message, values in _metadata_problems(*arrays, T, P, ps):
    if concrete:
      if bool(bad):
        raise ValueError("paged_attention: " + message.format(**{k: int(v) for k, v in values.items()}))
    else:
      checkify.check(~bad, "paged_attention: " + message, **values)


def _backend_fwd(*args, spec):
  if spec.implementation == "pallas_tpu":
    return pallas_paged.paged_fwd(*args, spec=spec, interpret=spec.interpret)
  return xla_paged.paged_fwd(*args, spec=spec)


def _backend_bwd(*args, spec):
  if spec.implementation == "pallas_tpu":
    return pallas_paged.paged_bwd(*args, spec=spec, interpret=spec.interpret)
  return xla_paged.paged_bwd(*args, spec=spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, spec):
  out, _ = _backend_fwd(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, spec=spec)
  return out


def _paged_attention_fwd(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, spec):
  out, lse = _backend_fwd(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, spec=spec)
  return out, (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, out, lse)


def _zero_cotangent(x):
  if x is None:
    return None
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return jnp.zeros(x.shape, jax.dtypes.float0)


def _paged_attention_bwd(spec, res, do):
  q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, out, lse = res
  dq, dk, dv = _backend_bwd(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, out, lse, do, spec=spec
  )

  def page_cotangent(g, pages):
    if jnp.issubdtype(pages.dtype, jnp.floating):
      return g.astype(pages.dtype)
    return jnp.zeros(pages.shape, jax.dtypes.float0)  # int8 pages: not differentiable

  return (
    dq.astype(q.dtype),
    page_cotangent(dk, k_pages),
    page_cotangent(dv, v_pages),
    None,
    None,
    None,
    None,
    _zero_cotangent(k_scale),
    _zero_cotangent(v_scale),
  )


_paged_attention.defvjp(_paged_attention_fwd, _paged_attention_bwd)
