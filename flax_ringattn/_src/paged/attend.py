"""One serving step of one paged attention: write the new tokens' K/V into a `PagedKVCache`, attend over it.

Shared by `PagedMultiHeadAttention` and the hand-written sites `convert(to="paged")` serves, so both write,
attend, refuse and ring-prefill the same way.  Returns the new cache rather than storing it: the caller assigns
it only once the step has succeeded, so a step that raises leaves its cache as it was.
"""

from __future__ import annotations

import dataclasses

from flax_ringattn._src.paged import step as paged_step
from flax_ringattn._src.paged.op import paged_attention, plan_call
from flax_ringattn._src.paged.ring_prefill import paged_ring_prefill


def ragged(
  cache, q, k, v, cu_q_lens, num_seqs, *, sinks=None, mesh=None, seq_axis=None, head_axis=None, checked=False,
  **options,
):  # fmt: skip
  """(out [T, N, Hv], cache): the ragged batch's k [T, K, H] / v [T, K, Hv] stored (refused whole per slot when
  they do not fit: `overflowed`) and q [T, N, H] attending over each slot's cache.

  Where the call's backend fuses the write (pallas_tpu, heads not split), pages are reserved (copy-on-write
  included) in XLA and the kernel writes the new rows and attends in one launch; elsewhere the tokens are
  appended, then attended.  Called with the ragged batch of the `ServingEngine` step under way (the same
  cu_q_lens and num_seqs objects), the cache applies the step's page allocation, which the engine made once for
  every layer (`PagedKVCache.reservation`), instead of allocating its own."""
  reservation = _step_reservation(cu_q_lens, num_seqs)
  if q.shape[0] > 0:  # an empty step stores nothing
    if mesh is None or head_axis is None:
      call = plan_call(
        q, cache.k_pages, cache.v_pages, cache.kv_lens, cache.page_indices, cu_q_lens, num_seqs,
        k_scale=cache.k_scale, v_scale=cache.v_scale, **options,
      )  # fmt: skip
      if call.fuses_cache_write:
        if reservation is None:
          cache, k_new, v_new, k_sc, v_sc = cache.reserve_append(k, v, cu_q_lens, num_seqs, checked=checked)
        else:
          cache, k_new, v_new, k_sc, v_sc = cache._reserve_append(k, v, cu_q_lens, num_seqs, checked, reservation)
        call = call.with_cache(cache.k_scale, cache.v_scale, *cache.attention_view())
        out, k_pages, v_pages, k_scale, v_scale = call.attend_and_write(
          q, k_new, v_new, cache.k_pages, cache.v_pages, k_new_scale=k_sc, v_new_scale=v_sc, sinks=sinks,
          checked=checked, **({} if seq_axis is None else dict(mesh=mesh, seq_axis=seq_axis)),
        )  # fmt: skip
        return out, dataclasses.replace(cache, k_pages=k_pages, v_pages=v_pages, k_scale=k_scale, v_scale=v_scale)
    if reservation is None:
      cache = cache.append(k, v, cu_q_lens, num_seqs, checked=checked)
    else:
      cache = cache._append(k, v, cu_q_lens, num_seqs, checked, reservation)
  kv_lens, table = cache.attention_view()
  split = mesh is not None and (head_axis is not None or seq_axis is not None)
  layout = dict(mesh=mesh, seq_axis=seq_axis, head_axis=head_axis) if split else {}
  out = paged_attention(
    q,
    cache.k_pages,
    cache.v_pages,
    kv_lens,
    table,
    cu_q_lens,
    num_seqs,
    k_scale=cache.k_scale,
    v_scale=cache.v_scale,
    sinks=sinks,
    checked=checked,
    **layout,
    **options,
  )
  return out, cache


def ring_prefill(
  cache, q, k, v, slot, num_tokens, *, sinks=None, mesh=None, seq_axis=None, head_axis=None, checked=False, **options
):
  """(out [Tp, N, Hv], cache): one prompt's K/V reserved and written into slot `slot` by the ring prefill
  (`paged_ring_prefill`, rows in its zigzag layout over `seq_axis`), its attention out."""
  cache = cache.reserve_prefill(slot, num_tokens, padded_len=q.shape[0], checked=checked)
  kv_lens, table = cache.attention_view()
  out, k_pages, v_pages, k_scale, v_scale = paged_ring_prefill(
    q,
    k,
    v,
    cache.k_pages,
    cache.v_pages,
    kv_lens,
    table,
    slot=slot,
    num_tokens=num_tokens,
    k_scale=cache.k_scale,
    v_scale=cache.v_scale,
    sinks=sinks,
    checked=checked,
    mesh=mesh,
    seq_axis=seq_axis,
    head_axis=head_axis,
    **options,
  )
  return out, dataclasses.replace(cache, k_pages=k_pages, v_pages=v_pages, k_scale=k_scale, v_scale=v_scale)


def in_step(cache, q, k, v, current: paged_step.Step, **kwargs):
  """`ragged` or `ring_prefill`, as the current serving step says."""
  if current.kind == "ring_prefill":
    return ring_prefill(cache, q, k, v, current.slot, current.num_tokens, **kwargs)
  return ragged(cache, q, k, v, current.cu_q_lens, current.num_seqs, **kwargs)


def _step_reservation(cu_q_lens, num_seqs):
  """The current serving step's page allocation when this is its ragged batch (the very objects), else None."""
  current = paged_step.current()
  if current is None or current.kind != "ragged" or current.reservation is None:
    return None
  return current.reservation if cu_q_lens is current.cu_q_lens and num_seqs is current.num_seqs else None
