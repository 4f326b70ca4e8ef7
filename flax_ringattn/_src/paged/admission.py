"""Admission of a `PagedKVCache` write (`cache.py`): which slots' new tokens fit, served in slot order, and the
errors for those that do not (`CacheOverflowError` eagerly, `checkify` checks under jit)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from flax_ringattn._src.paged import allocator, checks
from flax_ringattn._src.validation import all_concrete


class CacheOverflowError(ValueError):
  """A write to a `PagedKVCache` slot does not fit: past its pages, or more pages than are free (on some owner,
  for a cache spread over a mesh axis).

  A `ValueError`, raised by eager (concrete) writes: `PagedKVCache.append` / `reserve` and the paged layer's call
  (the message names the slot, the tokens asked for and the capacity; under `jit` the slot is flagged in
  `overflowed` instead), and by `ServingEngine` for a prompt that can never fit the cache.
  """


@dataclasses.dataclass(frozen=True)
class Admission:
  """Per slot [S], for a write of `new_lens` tokens: whether it fits, and why not."""

  new_lens: jax.Array
  wants: jax.Array  # new_lens > 0
  within: jax.Array  # kv_lens + new_lens <= pages_per_seq * page_size
  extra: jax.Array  # [S, n] pages it needs on each owner beyond those it holds (copy-on-write included)
  free_before: jax.Array  # [S, n] each owner's free pages left after the slots before it were served
  accepted: jax.Array  # served (wants, within, not overflowed, enough pages on every owner)


def admit(cache, new_lens, owners=None) -> Admission:
  """Which slots' writes of `new_lens` [S] tokens fit, served greedily in slot order (all or nothing each, on
  every owner at once)."""
  ps, pps = cache.page_size, cache.pages_per_seq
  new_lens = jnp.asarray(new_lens, jnp.int32)
  wants = new_lens > 0
  within = cache.kv_lens + new_lens <= pps * ps
  refs = allocator.replicated(cache.ref_counts)
  extra = cache._extra(new_lens, refs, owners)[0]
  free = allocator.free_per_owner(refs, cache.num_shards)
  candidate = wants & within & ~cache._overflowed()
  accepted, free_before = allocator.serve(extra, candidate, free)
  return Admission(new_lens, wants, within, extra, free_before, accepted)


def _overflow_problems(cache, a: Admission):
  """[(slots [S] bool, message, values(slot) -> dict)] of the writes `admit` refused, one per reason; the
  same message serves the eager error and the `checkify` check."""
  refused = a.wants & ~a.accepted
  was = cache._overflowed()
  i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
  pps, ps = cache.pages_per_seq, cache.page_size
  # The first owner short of pages for slot s (the only one when n = 1).
  short = lambda s: jnp.argmax(a.extra[s] > a.free_before[s]).astype(jnp.int32)  # noqa: E731
  if cache.num_shards == 1:
    no_pages = (
      "PagedKVCache: slot {s} needs {need} more pages for {n} new tokens (it holds {kv}), but only {free} of "
      "num_pages={P} are free after the slots before it (free finished slots, or refuse the work: check "
      "fits(new_lens) before the step)"
    )
  else:
    no_pages = (
      "PagedKVCache: slot {s} needs {need} more pages on owner {d} (device {d} of the n={nd} along seq_axis, "
      "page ids {lo} .. {hi}; page j of slot s lives on device (s + j) % n) for {n} new tokens (it holds {kv}), but "
      "only {free} of that device's {q} pages are free after the slots before it (free finished slots, create "
      "the cache with more pages, or refuse the work: check fits(new_lens) before the step)"
    )
  q = cache.pages_per_owner

  def no_pages_values(s):
    d = short(s)
    return dict(
      s=s,
      need=a.extra[s, d],
      n=a.new_lens[s],
      kv=cache.kv_lens[s],
      free=a.free_before[s, d],
      P=i32(cache.num_pages),
      d=d,
      nd=i32(cache.num_shards),
      lo=d * q,
      hi=d * q + q - 1,
      q=i32(q),
    )

  return [
    (
      refused & ~a.within & ~was,
      "PagedKVCache: slot {s} cannot take {n} more tokens: it holds {kv} and a slot holds at most "
      "pages_per_seq * page_size = {pps} * {ps} = {cap} tokens (create the cache with more pages_per_seq, or "
      "split the request)",
      lambda s: dict(s=s, n=a.new_lens[s], kv=cache.kv_lens[s], pps=i32(pps), ps=i32(ps), cap=i32(pps * ps)),
    ),
    (refused & a.within & ~was, no_pages, no_pages_values),
    (
      refused & was,
      "PagedKVCache: slot {s} overflowed in an earlier step and stores nothing more ({n} new tokens refused): "
      "free it (free(slots)) and re-admit its request",
      lambda s: dict(s=s, n=a.new_lens[s]),
    ),
  ]


def check(cache, a: Admission, checked: bool):
  """Raises `CacheOverflowError` for a refused write on concrete arrays; adds checkify checks when `checked`."""
  concrete = all_concrete(a.accepted, cache.kv_lens, a.new_lens)
  checked = checks.checking(checked)
  if not concrete and not checked:
    return
  for slots, message, values in _overflow_problems(cache, a):
    s = jnp.argmax(slots).astype(jnp.int32)
    if concrete:
      if bool(jnp.any(slots)):
        raise CacheOverflowError(message.format(**{k: int(v) for k, v in values(s).items()}))
    else:
      # checkify formats only the names the message uses.
      used = {k: v for k, v in values(s).items() if "{" + k + "}" in message}
      checkify.check(~jnp.any(slots), message, **used)
