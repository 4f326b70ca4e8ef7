"""Value checks of a ragged batch's metadata: eager `ValueError`s on concrete arrays, `checkify` checks under jit.

Every message names the operand, the slot or position and the value; the cache (`cache.py`) and the op share
them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from flax_ringattn._src import validation


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
  if concrete:
    # Concrete arrays closed over by a jitted function are still values: evaluate the checks now, not as traced
    # operations of the enclosing jit.
    with jax.ensure_compile_time_eval():
      for bad, message, values in _metadata_problems(*arrays, T, P, ps):
        if bool(bad):
          raise ValueError("paged_attention: " + message.format(**{k: int(v) for k, v in values.items()}))
    return
  for bad, message, values in _metadata_problems(*arrays, T, P, ps):
    checkify.check(~bad, "paged_attention: " + message, **values)
