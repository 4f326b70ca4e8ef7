"""`ServingEngine`: serve a model converted with `convert(model, to="paged")`, its own forward unedited.

The engine sits on top of the layers: it never reaches into one.  Each step it lays the new tokens of every
running sequence out as one flat ragged batch (`tokens`, `positions` [1, T]), enters a serving step
(`paged.step`) that tells every paged attention the model reaches where each sequence's rows are, runs the
user's `call(model, tokens, positions)` under one `jax.jit`, and chooses the next tokens from the logits
(`sampling.py`).  The host side (`scheduler.py`) decides what runs: admission and eviction, chunked prefill,
prefix reuse and speculative drafts.

State: the caches are the model's `nnx.Cache` variables (each converted layer's, each hand-written site's),
split off once per `generate` and donated to every step; the model holds them again when `generate` returns.
"""

from __future__ import annotations

import contextlib
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flax_ringattn._src import layout, ragged
from flax_ringattn._src.nnx import handwritten_paged
from flax_ringattn._src.nnx.handwritten_paged import PagedSiteOptions
from flax_ringattn._src.nnx.paged_mha import PagedMultiHeadAttention
from flax_ringattn._src.paged.step import Step, serving_step
from flax_ringattn._src.serving import sampling, scheduler
from flax_ringattn._src.serving.caches import (
  check_one_page_table,
  committed_beside,
  first_cache,
  map_caches,
  on_leaves,
  pages_taken,
)
from flax_ringattn._src.serving.stats import EngineStats


def _positive(name: str, value) -> int:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise ValueError(f"ServingEngine: {name} must be a positive int, got {name}={value!r}")
  return int(value)


def default_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
  """Powers of two from 16 below `max_num_batched_tokens`, then `max_num_batched_tokens`: a step pads its rows
  to at most twice its tokens (16 at least), and compiles for at most log2(max / 8) row counts."""
  out, t = [], 16
  while t < max_num_batched_tokens:
    out.append(t)
    t *= 2
  return (*out, max_num_batched_tokens)


def _token_buckets(buckets, max_num_batched_tokens: int) -> tuple[int, ...]:
  if buckets is None:
    return default_token_buckets(max_num_batched_tokens)
  try:
    given = list(buckets)
  except TypeError:
    given = [buckets]
  is_int = lambda b: isinstance(b, (int, np.integer)) and not isinstance(b, bool)  # noqa: E731
  bad = [b for b in given if not (is_int(b) and 0 < b <= max_num_batched_tokens)]
  if bad or not given:
    raise ValueError(
      "ServingEngine: token_buckets must be row counts from 1 to max_num_batched_tokens="
      f"{max_num_batched_tokens}, got token_buckets={buckets!r}" + (f" ({bad!r} not)" if bad else "")
    )
  return tuple(sorted({int(b) for b in given} | {max_num_batched_tokens}))


def _sampling_args(options) -> tuple:
  """(seed, temperature, top_k, top_p) as a step takes them, from `sampling.check`'s (temperature, top_k, top_p,
  seed)."""
  return (jnp.int32(options[3]), jnp.float32(options[0]), options[1], options[2])


class _Running:
  """A step `ServingEngine.start_step` dispatched: its device outputs (`result`: chosen, overflowed, utilization,
  free pages), when its dispatch began (`t0`), its decode count, the running step it followed (`after`), and,
  once `finish_step` read it, when that read ended (`read_end`)."""

  def __init__(self, result, t0: float, decodes: int, after):
    self.result, self.t0, self.decodes, self.after = result, t0, decodes, after
    self.read_end = None

  @property
  def chosen(self):
    return self.result[0]


class ServingEngine:
  """Continuous-batching generation from a model converted to paged attention, through its own forward.

  Args:
    model: an `nnx.Module` after `convert(model, to="paged")`: its `PagedMultiHeadAttention` layers and the
      hand-written attention sites the conversion found each get a paged cache here.
    call: `call(model, tokens, positions) -> logits`: the model's own forward on a flat ragged batch (`tokens`,
      `positions` [1, T] int32, T one of `token_buckets`; positions are each token's index in its own sequence)
      returning [1, T, V].  A mask the forward builds or takes does not decide attention.
    num_pages, page_size, max_num_seqs, pages_per_seq: the caches' geometry (`PagedKVCache.create`);
      max_num_seqs is the number of sequences decoded together (slots).
    max_num_batched_tokens: the most rows of one step: prompts are prefilled in chunks that fit beside the
      decoding sequences.
    token_buckets: the row counts T a step is compiled for; each step runs at the least one that holds its tokens
      (padding rows cost the model's matmuls and the logits: a decode step of 64 sequences in a step of 1024 rows
      would do 16 times its work).  Default (`default_token_buckets`): powers of two from 16 below
      max_num_batched_tokens, and max_num_batched_tokens; `(max_num_batched_tokens,)` compiles one step program.
    mesh, seq_axis: context parallelism, as the conversion was given them (the caches' pages spread over
      `seq_axis`): a prompt of at least `ring_prefill_min_tokens` new tokens (default: max_num_batched_tokens)
      is then prefilled by the ring, sequence-parallel, in a step of its own.
    cache_dtype: the pages' dtype (default: each layer's, each site's q dtype; int8 / float8 quantize).
    merged_pages: the caches' page layout (`PagedKVCache.create(merged=...)`).  "auto" (default): per cache, kv
      pages [P, 2, page_size, K * H] (a page's K and V in one array: one copy per page in the TPU kernel), merged
      pages for MLA, [P, page_size, K, H] ones context-parallel or where a page is a partial sublane tile (int8
      pages of 16 tokens); True: merged [P, page_size, K * H]; "kv": kv pages; False: [P, page_size, K, H].
    overlap: True (default): a decode step whose successor is certain (the same sequences, all still decoding,
      their pages surely free, no draft, nothing waiting for a free slot) dispatches that successor, its tokens
      taken on the device, before the host reads the step's tokens, so the host's work per step (reading and
      emitting tokens, the next step's inputs, the dispatch) runs beside the device instead of between its steps.
      The output is the same (every token's choice depends on its own row only); a sequence that stops on a stop
      token has its extra row discarded.  False: each step is read before the next is planned.

  `generate` / `stream` serve prompts; `stats` counts over the engine's lifetime.  The step is compiled once per
  token bucket it runs at: prompts of other lengths, another `generate`, a draft compile nothing new (a new
  top_k / top_p setting compiles once per bucket).
  """

  def __init__(
    self,
    model,
    *,
    call,
    num_pages: int,
    page_size: int,
    max_num_seqs: int,
    pages_per_seq: int,
    max_num_batched_tokens: int,
    mesh=None,
    seq_axis=None,
    ring_prefill_min_tokens: int | None = None,
    cache_dtype=None,
    merged_pages: bool | str = "auto",
    token_buckets=None,
    overlap: bool = True,
  ):
    if not isinstance(model, nnx.Module):
      raise TypeError(f"ServingEngine: model must be a flax.nnx.Module, got {type(model).__name__}")
    if not callable(call):
      raise TypeError(f"ServingEngine: call must be call(model, tokens, positions) -> logits, got {call!r}")
    self.model, self.call = model, call
    self.num_pages = _positive("num_pages", num_pages)
    self.page_size = _positive("page_size", page_size)
    self.max_num_seqs = _positive("max_num_seqs", max_num_seqs)
    self.pages_per_seq = _positive("pages_per_seq", pages_per_seq)
    self.max_num_batched_tokens = _positive("max_num_batched_tokens", max_num_batched_tokens)
    self.token_buckets = _token_buckets(token_buckets, self.max_num_batched_tokens)
    if not isinstance(overlap, bool):
      raise TypeError(f"ServingEngine: overlap must be a bool, got overlap={overlap!r}")
    self.overlap = overlap
    self._free_pages = None  # each owner's least free pages after the last step (`surely_fit`); None: unknown
    # [S] bool: slots whose last, partly filled page may be shared with another slot, so that their next write
    # copies it (`surely_fit`); set by a share of a partial page and a rollback, cleared when the slot is freed
    self._shared_tail = None
    self._tokens_sharding = None  # where host tokens go before a step (`_take_caches`)
    self._to_free = None  # [S] bool: slots released since the caches were last read (`_leaves`)
    if (seq_axis is None) != (mesh is None):
      raise ValueError(
        f"ServingEngine: mesh= and seq_axis= go together (context parallelism), got mesh={mesh!r}, "
        f"seq_axis={seq_axis!r}"
      )
    self.mesh, self.seq_axis = mesh, seq_axis
    if not isinstance(merged_pages, bool) and merged_pages not in ("kv", "auto"):
      raise TypeError(f"ServingEngine: merged_pages must be a bool, 'kv' or 'auto', got merged_pages={merged_pages!r}")
    if merged_pages and merged_pages != "auto" and seq_axis is not None:
      raise NotImplementedError(
        f"ServingEngine: merged_pages={merged_pages!r} with seq_axis={seq_axis!r}: the ring prefill of a cache "
        "spread over a mesh axis writes [P, page_size, K, H] pages; serve context-parallel with merged_pages=False"
      )
    self.ring_prefill_min_tokens = (
      self.max_num_batched_tokens
      if ring_prefill_min_tokens is None
      else _positive("ring_prefill_min_tokens", ring_prefill_min_tokens)
    )
    self.stats = EngineStats()
    geometry = dict(
      num_pages=self.num_pages,
      page_size=self.page_size,
      max_num_seqs=self.max_num_seqs,
      pages_per_seq=self.pages_per_seq,
    )
    layers = [node for _, node in nnx.iter_graph(model) if isinstance(node, PagedMultiHeadAttention)]
    sites = {
      ".".join(map(str, path)) or "<root>": node
      for path, node in nnx.iter_graph(model)
      if isinstance(getattr(type(node), "_fr_options", None), PagedSiteOptions)
    }
    if not layers and not sites:
      raise ValueError(
        "ServingEngine: the model has no paged attention: convert it first (fr.convert(model, to='paged')), "
        "which swaps nnx.MultiHeadAttention layers and watches attention written by hand"
      )
    for layer in layers:
      if (layer.seq_axis is None) != (seq_axis is None) or (seq_axis is not None and layer.seq_axis != seq_axis):
        raise ValueError(
          f"ServingEngine: seq_axis={seq_axis!r}, but the model's paged layers spread their caches over "
          f"seq_axis={layer.seq_axis!r}: pass the mesh and seq_axis given to convert(model, to='paged', ...)"
        )
      layer.init_cache(**geometry, dtype=cache_dtype, merged=merged_pages)
    needs, self.vocab_size = self._discover()
    by_module: dict = {}
    for path, index, need in needs:
      by_module.setdefault(path, []).append((index, need))
    for path, found in by_module.items():
      handwritten_paged.init_site_caches(
        sites[path], found, **geometry, mesh=mesh, seq_axis=seq_axis, dtype=cache_dtype, merged=merged_pages
      )
    if not layers and not needs:
      raise ValueError(
        "ServingEngine: convert(model, to='paged') found no attention the model's call runs (see its report): "
        "nothing would be served from a paged cache"
      )
    static = ("cache_def", "rest_def", "top_k", "top_p")
    self._step = jax.jit(on_leaves(self._step_fn), static_argnames=static, donate_argnums=(0,))
    self._prefill = jax.jit(on_leaves(self._prefill_fn), static_argnames=static, donate_argnums=(0,))
    self._free = jax.jit(
      self._counted(lambda caches, slots: map_caches(lambda c: c.free(slots), caches)), donate_argnums=(0,)
    )
    self._share = jax.jit(
      self._counted(lambda caches, src, dst, n: map_caches(lambda c: c.share_prefix(src, dst, n), caches)),
      donate_argnums=(0,),
    )
    self._rollback = jax.jit(
      self._counted(lambda caches, drop: map_caches(lambda c: c.rollback(drop), caches)), donate_argnums=(0,)
    )

  # -- programs -----------------------------------------------------------------------------------------
  @contextlib.contextmanager
  def _compile_clock(self):
    """Adds the wall time of the enclosed host call to `stats.compile_seconds` when it traced a program."""
    before, start = self.stats.compiles, time.perf_counter()
    try:
      yield
    finally:
      if self.stats.compiles > before:
        self.stats.compile_seconds += time.perf_counter() - start

  def _counted(self, fn):
    def traced(*args):
      self.stats.compiles += 1
      return fn(*args)

    return traced

  def _discover(self):
    """Runs the model's call abstractly once: the hand-written sites record the caches they need, and the
    call's output shape is checked.  Returns ([(module path, site index, CacheNeed)], vocab size)."""
    T = self.max_num_batched_tokens
    graphdef, state = nnx.split(self.model)
    found = Step("discover")

    def probe(state, tokens, positions):
      with serving_step(found):
        return self.call(nnx.merge(graphdef, state), tokens, positions)

    spec = jax.ShapeDtypeStruct((1, T), jnp.int32)
    out = jax.eval_shape(probe, state, spec, spec)
    shape = tuple(getattr(out, "shape", ()))
    if len(shape) != 3 or shape[:2] != (1, T):
      raise ValueError(
        f"ServingEngine: call(model, tokens, positions) must return logits [1, T, V] = [1, {T}, V] for tokens "
        f"[1, {T}], got {getattr(out, 'shape', type(out).__name__)}"
      )
    return found.needs, shape[2]

  def _run_model(self, caches, rest, tokens, positions, current: Step):
    model = nnx.merge(self._graphdef, caches, rest)
    with serving_step(current):
      logits = self.call(model, tokens[None], positions[None])
    return logits[0], nnx.state(model, nnx.Cache)

  def _step_fn(self, caches, rest, tokens, positions, cu_q_lens, row_ids, seed, temperature, *, top_k, top_p):
    self.stats.compiles += 1
    num_seqs = jnp.full((1,), self.max_num_seqs, jnp.int32)
    # Every layer's cache has the same page table (`_take_caches` checks it): the step's page allocation is made
    # once here, and each layer applies it to its own pages (allocated per layer, it was a few dozen small
    # scatters over the page counts in every layer of every step).
    reservation = first_cache(caches).reservation(ragged.seq_q_lens(cu_q_lens, num_seqs))
    current = Step("ragged", cu_q_lens, num_seqs, reservation=reservation)
    logits, caches = self._run_model(caches, rest, tokens, positions, current)
    chosen = sampling.choose(logits, row_ids, seed, temperature, top_k=top_k, top_p=top_p)
    first = first_cache(caches)  # every cache has the same page table: one reports for all
    flags = jnp.zeros((self.max_num_seqs,), bool) if first.overflowed is None else first.overflowed
    free = jnp.min(first.num_free_pages_per_owner())  # for `surely_fit`: the next step's check on the host
    return (chosen, flags, first.utilization(), free), caches

  def _prefill_fn(
    self, caches, rest, tokens, positions, slot, num_tokens, last_row, row_id, seed, temperature, *, top_k, top_p
  ):
    self.stats.compiles += 1
    current = Step("ring_prefill", slot=slot, num_tokens=num_tokens)
    logits, caches = self._run_model(caches, rest, tokens, positions, current)
    row = jax.lax.dynamic_slice_in_dim(logits, last_row, 1, axis=0)
    return sampling.choose(row, row_id[None], seed, temperature, top_k=top_k, top_p=top_p)[0], caches

  # -- the caches, held as leaves ---------------------------------------------------------------------------
  # The steps take and return the caches and the weights as flat lists of arrays: flattening the nnx states'
  # Variables in Python at every call cost a 24-block decoder's step about 2 ms of dispatch on this project's CPU.
  # Released slots are freed lazily, all of a step's at once, before anything reads the caches next: a batch
  # whose sequences end together ran one release program per sequence.
  @property
  def _caches(self):
    return jax.tree.unflatten(self._cache_def, self._leaves())

  @_caches.setter
  def _caches(self, caches):
    self._cache_leaves, self._cache_def = jax.tree.flatten(caches)

  def _leaves(self):
    """The caches' leaves, the released slots freed first."""
    if self._to_free is not None:
      with self._compile_clock():
        caches = jax.tree.unflatten(self._cache_def, self._cache_leaves)
        self._caches = self._free(caches, jnp.asarray(self._to_free, bool))
      self._to_free = None  # (after: a release that raised stays pending, and says so at the next read)
    return self._cache_leaves

  # -- the host's calls -----------------------------------------------------------------------------------
  def rows_for(self, tokens: int) -> int:
    """The rows of a step of `tokens` new tokens: the least of `token_buckets` that holds them."""
    return next(b for b in self.token_buckets if b >= tokens)

  def ragged_step(self, tokens, positions, cu_q_lens, row_ids, options, *, decodes: int = 0):
    """One step of the model over a flat ragged batch; returns (chosen tokens, overflowed flags, utilization).
    `decodes`: the step's sequences when it is a pure decode step (each one new token, after its prompt), else 0
    (for `stats.decode_*`)."""
    return self.finish_step(self.start_step(tokens, positions, cu_q_lens, row_ids, options, decodes=decodes))

  def start_step(self, tokens, positions, cu_q_lens, row_ids, options, *, decodes: int = 0, after=None):
    """Dispatches one step (`ragged_step`'s arguments) without waiting for it; `finish_step` reads its outputs.
    `tokens` may be a running step's `chosen` (a device array: the tokens it is choosing), so a decode step goes
    to the device before the host has read the step before it.  `after`: that running step, whose read ends
    where this step's wall time starts (its host work then overlaps the device's run)."""
    leaves = self._leaves()  # (before the clock: a release that compiles is timed once, by its own)
    t0 = time.perf_counter()
    if self._tokens_sharding is not None and not isinstance(tokens, jax.Array):
      tokens = jax.device_put(tokens, self._tokens_sharding)
    with self._compile_clock():
      result, self._cache_leaves = self._step(
        leaves, self._rest_leaves, tokens, positions, cu_q_lens, row_ids, *options[:2],
        cache_def=self._cache_def, rest_def=self._rest_def, top_k=options[2], top_p=options[3],
      )  # fmt: skip
    return _Running(result, t0, decodes, after)

  def finish_step(self, step: _Running):
    """Waits for a step `start_step` dispatched; returns (chosen tokens, overflowed flags, utilization).  Its wall
    time: from its dispatch to this read, or for a step started before the previous one was read, from that read's
    end (its own dispatch ran inside the previous step's time, and the host's work after that read ran beside the
    device, which had this step queued): each second of wall time is counted once."""
    out, overflowed, utilization, free = jax.device_get(step.result)  # one transfer, not one per value
    end = time.perf_counter()
    if step.after is None:
      elapsed = end - step.t0
    else:
      elapsed = end - step.after.read_end  # (its dispatch ran inside the previous step's time)
      self.stats.overlapped_steps += 1
    step.read_end = end
    self.stats.step_seconds += elapsed
    if step.decodes:
      self.stats.decode_steps += 1
      self.stats.decode_tokens += step.decodes
      self.stats.decode_seconds += elapsed
    self._free_pages = int(free)
    self.stats.steps += 1
    return np.asarray(out), np.asarray(overflowed), float(utilization)

  def ring_prefill(self, slot: int, prompt, start: int, row_id, options) -> int:
    """Prefills `prompt` (the slot's tokens from `start`, a multiple of page_size) by the ring; returns the
    token chosen after its last token."""
    n = math.prod(self.mesh.shape[a] for a in (self.seq_axis if isinstance(self.seq_axis, tuple) else (self.seq_axis,)))
    count = len(prompt)
    unit = 2 * n * self.page_size
    padded = unit * 2 ** math.ceil(math.log2(-(-count // unit)))  # a few buckets: a few compiles
    tokens = np.zeros(padded, np.int32)
    tokens[:count] = prompt
    rows = NamedSharding(self.mesh, P(self.seq_axis))
    order = layout.zigzag_order(np.arange(padded), n, axis=0)
    tokens = jax.device_put(layout.zigzag_order(tokens, n, axis=0), rows)
    positions = jax.device_put((start + layout.zigzag_positions(padded, n)).astype(np.int32), rows)
    last_row = int(np.nonzero(order == count - 1)[0][0])
    self._free_pages = None  # the prefill takes pages: the host's count is stale until the next step
    leaves = self._leaves()
    t0 = time.perf_counter()
    with self._compile_clock():
      token, self._cache_leaves = self._prefill(
        leaves,
        self._rest_leaves,
        tokens,
        positions,
        jnp.int32(slot),
        jnp.int32(count),
        jnp.int32(last_row),
        jnp.asarray(row_id, jnp.int32),
        *options[:2],
        cache_def=self._cache_def,
        rest_def=self._rest_def,
        top_k=options[2],
        top_p=options[3],
      )
      token = int(token)
    self.stats.step_seconds += time.perf_counter() - t0
    self.stats.ring_prefills += 1
    return token

  def free(self, slots):
    """Releases the slots `slots` ([S] bool) marks: their pages are freed before the caches are next read."""
    slots = np.asarray(slots, bool)
    self._to_free = slots.copy() if self._to_free is None else self._to_free | slots
    if self._shared_tail is not None:
      self._shared_tail &= ~slots

  def share(self, src: int, dst: int, num_tokens: int):
    # (no new page: dst references src's pages; a copy-on-write comes with a step, whose bound counts it)
    caches = self._caches  # (released slots freed first, outside this call's clock)
    with self._compile_clock():
      self._caches = self._share(caches, jnp.int32(src), jnp.int32(dst), jnp.int32(num_tokens))
    if num_tokens % self.page_size:  # the page holding the last shared token is partly filled, and now shared
      self._mark_shared_tail([src, dst])

  def rollback(self, drop):
    caches = self._caches
    with self._compile_clock():
      self._caches = self._rollback(caches, jnp.asarray(drop, jnp.int32))
    self._mark_shared_tail(np.nonzero(np.asarray(drop) > 0)[0])  # a slot cut back may end inside a shared page

  def _mark_shared_tail(self, slots):  # (`caches.pages_taken`)
    if self._shared_tail is None:
      self._shared_tail = np.ones(self.max_num_seqs, bool)
    self._shared_tail[np.asarray(slots, np.int64)] = True

  def fits(self, new_lens) -> np.ndarray:
    return np.asarray(first_cache(self._caches).fits(jnp.asarray(new_lens, jnp.int32)))

  def surely_fit(self, new_lens, kv_lens) -> bool:
    """Whether every slot's `new_lens` more tokens certainly fit the cache, decided on the host from the free pages
    the last step reported (each owner's least) and the slots' `kv_lens` (the scheduler's count of their tokens;
    `caches.pages_taken`).  False only means "ask the device" (`fits`): a decode step then skips that round trip.
    (Were the bound ever wrong, the step's admission still flags the slot `overflowed`; the scheduler evicts it.)"""
    if self._free_pages is None or self._shared_tail is None:
      return False
    taken = pages_taken(new_lens, kv_lens, self.page_size, self.pages_per_seq, self._shared_tail)
    return taken is not None and taken <= self._free_pages

  def overflowed(self) -> np.ndarray:
    flags = first_cache(self._caches).overflowed
    return np.zeros(self.max_num_seqs, bool) if flags is None else np.asarray(flags)

  # -- the public calls -------------------------------------------------------------------------------
  def stream(
    self,
    prompts,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens=(),
    seed: int = 0,
    draft=None,
  ):
    """Yields `(prompt_index, token)` as the tokens are produced (see `generate` for the arguments)."""
    options = sampling.check(temperature, top_k, top_p, seed)
    seqs = scheduler.make_sequences(self, prompts, max_new_tokens, stop_tokens)
    if draft is not None and not callable(getattr(draft, "propose", None)):
      raise TypeError(f"draft must have propose(contexts, max_tokens) (e.g. fr.NGramDraft()), got {draft!r}")
    sampling_args = _sampling_args(options)
    self._take_caches()
    first = first_cache(self._caches)
    if (first.num_pages, first.max_num_seqs, first.pages_per_seq) != (
      self.num_pages,
      self.max_num_seqs,
      self.pages_per_seq,
    ):
      raise ValueError(
        f"ServingEngine: the model's caches hold {first.num_pages} pages for {first.max_num_seqs} slots, not this "
        f"engine's {self.num_pages} for {self.max_num_seqs}: another engine (or init_cache) re-created them; serve a "
        "model with one engine at a time"
      )
    start = time.perf_counter()
    try:
      yield from scheduler.Scheduler(self, seqs, sampling_args, draft).run()
    finally:
      # Every slot is released, also when a step raised or the caller stopped reading the stream: the next call
      # (and the model) finds the caches empty, no page leaked.
      try:
        self.free(np.ones(self.max_num_seqs, bool))
        self._leaves()  # the release runs now, inside the call's time
      finally:
        self.stats.seconds += time.perf_counter() - start
        nnx.update(self.model, self._caches)

  def _take_caches(self):
    """Splits the model into (graphdef, caches, the rest) for the steps; `nnx.update(self.model, self._caches)`
    gives the caches back."""
    self._graphdef, caches, rest = nnx.split(self.model, nnx.Cache, ...)
    self._to_free = None  # (none pending: the last call's caches were read back into the model)
    self._rest_leaves, self._rest_def = jax.tree.flatten(rest)
    self._caches = committed_beside(caches, rest)
    check_one_page_table(self._cache_leaves, self._cache_def)
    # Host tokens go where a step's chosen tokens come back (committed beside the caches, when the caches are
    # committed to one device): a step fed another's choices (`overlap`) then runs the same program, not one
    # compiled for a committed argument of its own.  The caches keep their placement from step to step.
    leaf = self._cache_leaves[0]
    self._tokens_sharding = leaf.sharding if leaf.committed and len(leaf.devices()) == 1 else None
    self._free_pages = None  # the model's caches, as the caller may have changed them: not yet counted
    # Slots that hold tokens as the stream starts (the caller's doing) may share pages; empty ones share none.
    self._shared_tail = np.asarray(first_cache(self._caches).kv_lens) > 0

  def warmup(self, *, top_k: int | None = None, top_p: float | None = None, buckets=None) -> int:
    """Compiles the step program of every token bucket now (and the cache's admission and release programs), so
    that no later step waits for one; returns how many were compiled (0 when every one already was).
    `buckets`: only these of `token_buckets` (a serving loop that knows its step sizes, e.g. decodes of its batch
    and full prefill chunks, compiles only those: a real-size model's step program takes tens of seconds).

    A step compiles when it first needs its bucket (`token_buckets`), which a serving loop meets one by one, mid
    stream: a mixed prefill + decode step of an odd size, a long prompt's first chunk.  Each warm-up step holds
    no token (every row is padding), so the caches are unchanged.  `top_k` and `top_p` are part of the program:
    pass the ones `generate` will get (the temperature and seed are not).  With JAX's persistent compilation
    cache on, a second start reads the programs back instead of compiling them.
    """
    args = _sampling_args(sampling.check(0.0, top_k, top_p, 0))
    if buckets is None:
      buckets = self.token_buckets
    else:
      buckets = tuple(buckets)
      bad = [b for b in buckets if b not in self.token_buckets]
      if bad:
        raise ValueError(
          f"ServingEngine.warmup: buckets must be among token_buckets={self.token_buckets}, got {bad!r} (a step "
          "runs at the least bucket that holds its tokens: `rows_for(tokens)`)"
        )
    S, before, steps, step_seconds = self.max_num_seqs, self.stats.compiles, self.stats.steps, self.stats.step_seconds
    self._take_caches()
    try:
      for rows in sorted(set(buckets)):
        zeros = np.zeros(rows, np.int32)
        self.ragged_step(zeros, zeros, np.zeros(S + 1, np.int32), np.zeros((rows, 2), np.int32), args)
      self.fits(np.zeros(S, np.int32))  # the admission check and the release each step and stream run
      self.free(np.zeros(S, bool))  # (no slot)
    finally:
      self.stats.steps, self.stats.step_seconds = steps, step_seconds  # no step of a prompt ran
      nnx.update(self.model, self._caches)
    return self.stats.compiles - before

  def generate(
    self,
    prompts,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens=(),
    seed: int = 0,
    draft=None,
  ) -> list[list[int]]:
    """The generated tokens of each prompt (without the prompt), in the prompts' order.

    Args:
      prompts: a sequence of prompts, each a non-empty sequence of token ids.
      max_new_tokens: tokens generated per prompt at most.
      temperature: 0 (default) for greedy decoding; > 0 samples, reproducibly for a `seed` (each token from its
        own key: the output does not depend on the batching, the other prompts, or a draft).
      top_k, top_p: keep the k most likely tokens / the smallest set of mass top_p before sampling.
      stop_tokens: a prompt stops right after it emits one of these (that token included).
      draft: a speculative draft (`fr.NGramDraft(n, k)`, or any object with `propose`): its proposals are
        verified in one step and the output is exactly the model's.

    Raises `CacheOverflowError` (naming the prompt's index) before any step when a prompt and its new tokens
    can never fit one slot or the cache, and `ValueError` for an empty prompt.
    """
    prompts = list(prompts)
    out = [[] for _ in prompts]
    for index, token in self.stream(
      prompts,
      max_new_tokens=max_new_tokens,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
      stop_tokens=stop_tokens,
      seed=seed,
      draft=draft,
    ):
      out[index].append(token)
    return out
