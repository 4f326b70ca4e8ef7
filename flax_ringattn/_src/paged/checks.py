"""Value checks of a ragged batch's metadata: eager `ValueError`s on concrete arrays, `checkify` checks under jit.

Every message names the operand, the slot or position and the value; the op, the cache (`cache.py`) and the
cache's argument contracts (`contracts.py`) share them, and `enforce` runs any list of them.
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from flax_ringattn._src import validation

i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731


_state = threading.local()


@contextlib.contextmanager
def all_checked():
  """While active, every traced contract check is a checkify check whatever `checked` says (`eager.py` traces a
  cache method's eager program so: a failed check sends the call back to the plain, raising path)."""
  _state.depth = getattr(_state, "depth", 0) + 1
  try:
    yield
  finally:
    _state.depth -= 1


def checking(checked: bool) -> bool:
  """`checked`, or True inside `all_checked`."""
  return checked or getattr(_state, "depth", 0) > 0


def first(m):
  """The flat index of the first True of `m` (0 when none)."""
  return jnp.argmax(m.reshape(-1)).astype(jnp.int32)


def ragged_problems(cu_q_lens, num_seqs, S: int, T: int, rows: str = "q.shape[0]"):
  """The checks of a ragged batch's layout alone: num_seqs in range, cu_q_lens from 0, non-decreasing over its
  first num_seqs + 1 entries, and at most T (`rows`, the operand whose rows the batch packs) tokens in all."""
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
      "the batch has {total} new tokens (cu_q_lens[num_seqs={n}]), more than max_num_batched_tokens={T} "
      f"({rows})",
      dict(total=total, n=n, T=i32(T)),
    )
  )
  return problems


def _metadata_problems(kv_lens, page_indices, cu_q_lens, num_seqs, T, P, ps):
  """The value checks of the ragged batch's metadata: [(bad, message, values)], each `bad` a bool scalar and
  `values` the scalars its message names (the first offending slot or position).  Only live entries count:
  the first num_seqs + 1 of cu_q_lens, the first num_seqs slots, the pages a slot's kv_lens uses."""
  S, pps = page_indices.shape
  live = jnp.arange(S) < num_seqs[0]
  problems = ragged_problems(cu_q_lens, num_seqs, S, T)
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


def enforce(make_problems, operands, *, where: str, checked: bool, need_ok: bool = False):
  """Runs the checks `make_problems()` returns ([(bad, message, values)]): when every one of `operands` is
  concrete, eagerly (the first bad one raises `ValueError`, "{where}: message" with its values); under a trace,
  as `checkify` checks when `checked`.

  Returns whether every check passed: True once the eager checks passed; under a trace a bool scalar when
  `checked` or `need_ok` (for a method that makes a refused call a no-op), else True without tracing the checks.
  """
  if validation.all_concrete(*operands):
    # Concrete arrays closed over by a jitted function are still values: evaluate the checks now, not as traced
    # operations of the enclosing jit.
    with jax.ensure_compile_time_eval():
      for bad, message, values in make_problems():
        if bool(bad):
          raise ValueError(f"{where}: " + message.format(**{k: int(v) for k, v in values.items()}))
    return True
  checked = checking(checked)
  if not checked and not need_ok:
    return True
  problems = make_problems()
  if checked:
    for bad, message, values in problems:
      # checkify formats only the names the message uses.
      used = {k: v for k, v in values.items() if "{" + k + "}" in message}
      checkify.check(~bad, f"{where}: " + message, **used)
  return ~jnp.any(jnp.stack([jnp.asarray(bad, bool) for bad, _, _ in problems]))


def check_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, T, P, ps, *, checked: bool):
  """Validates the metadata's values: eagerly (ValueError) when every array is concrete, which costs jitted
  calls nothing; under a trace, as `checkify` checks when `checked`."""
  arrays = (kv_lens, page_indices, cu_q_lens, num_seqs)
  enforce(lambda: _metadata_problems(*arrays, T, P, ps), arrays, where="paged_attention", checked=checked)


def check_ragged(cu_q_lens, num_seqs, S: int, T: int, *, where: str, rows: str, checked: bool):
  """`check_metadata`'s checks of the batch's layout alone (no cache yet: `PagedKVCache.append`)."""
  arrays = (cu_q_lens, num_seqs)
  enforce(lambda: ragged_problems(cu_q_lens, num_seqs, S, T, rows), arrays, where=where, checked=checked)
