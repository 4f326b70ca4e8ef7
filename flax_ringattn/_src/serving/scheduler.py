"""The host side of `ServingEngine`: which tokens of which sequence run in the next step.

Every sequence feeds `tokens[fed:]` (its prompt, then its last generated token) into its slot; the step whose
rows reach the end of `tokens` chooses the next token there, so prefill, chunked prefill and decode are one
rule.  Per step:

1. admission: a waiting prompt takes a free slot when the pages of its whole sequence (prompt and new tokens),
   less the pages it shares, are not promised to the running ones; its first whole pages are taken from a
   running sequence with the same prompt head when there is one (`share_prefix`: no recompute), waiting for
   them while that sequence still computes them;
2. the batch: decoding sequences first (their last token, plus a draft's proposals), then prompt chunks, in at
   most T rows; the cache's `fits` refuses a slot whose tokens would not fit, which is evicted (freed and
   re-queued, its output so far kept) rather than cut short;
3. the step; then each sequence keeps the longest prefix of its proposals the model agrees with, the rejected
   tokens' K/V are rolled back out of the cache, and a slot the cache flagged `overflowed` is evicted;
4. a sequence that emitted a stop token or reached max_new_tokens frees its slot.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from flax_ringattn._src.paged.admission import CacheOverflowError


@dataclasses.dataclass(eq=False)
class Sequence:
  index: int  # the prompt's index in the call
  prompt: list
  max_new: int
  stop: frozenset
  generated: list = dataclasses.field(default_factory=list)
  slot: int | None = None
  fed: int = 0  # tokens whose K/V are in the slot
  shared: int = 0  # of them, taken from another sequence's pages
  wait: tuple | None = None  # (source Sequence, tokens): shares them once the source has computed them
  done: bool = False
  hashes: list = dataclasses.field(default_factory=list)  # chained hash of each whole page of the prompt

  @property
  def tokens(self):
    return self.prompt + self.generated

  # The host's per-step reads go through these, not `tokens`: a new list of the whole sequence per read cost a
  # decode step of 64 sequences of 2k about 0.9 ms per pass over them (three passes a step).
  @property
  def length(self) -> int:
    """len(tokens)."""
    return len(self.prompt) + len(self.generated)

  def last(self) -> int:
    """tokens[-1]."""
    return self.generated[-1] if self.generated else self.prompt[-1]

  def span(self, start: int, stop: int) -> list:
    """tokens[start:stop] (0 <= start), without building `tokens`."""
    n = len(self.prompt)
    if stop <= n:
      return self.prompt[start:stop]
    return self.prompt[start:] + self.generated[max(start - n, 0) : stop - n]

  def pages(self, page_size: int) -> int:
    """Pages the whole sequence needs: every prompt token and every new token but the last (never fed)."""
    return -(-(len(self.prompt) + self.max_new - 1) // page_size)


def make_sequences(engine, prompts, max_new_tokens, stop_tokens):
  """The prompts as `Sequence`s, every one checked before any step runs."""
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got max_new_tokens={max_new_tokens!r}")
  stop = frozenset(int(t) for t in stop_tokens)
  ps, cap, V = engine.page_size, engine.pages_per_seq * engine.page_size, engine.vocab_size
  seqs = []
  for i, prompt in enumerate(prompts):
    tokens = np.asarray(prompt)
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
      raise TypeError(f"prompt {i} must be a 1-D sequence of int token ids, got {np.shape(prompt)} {tokens.dtype}")
    if tokens.size == 0:
      raise ValueError(f"prompt {i} is empty: a prompt needs at least one token to generate from")
    if tokens.min() < 0 or tokens.max() >= V:
      raise ValueError(f"prompt {i} holds token ids outside [0, {V}) (the model's logits have V={V})")
    seq = Sequence(i, [int(t) for t in tokens], int(max_new_tokens), stop)
    need = len(seq.prompt) + seq.max_new - 1
    if need > cap:
      raise CacheOverflowError(
        f"prompt {i} can never fit a slot: its {len(seq.prompt)} tokens and max_new_tokens={seq.max_new} need "
        f"{need} cached tokens, and a slot holds pages_per_seq * page_size = {engine.pages_per_seq} * {ps} = {cap}"
      )
    if seq.pages(ps) > engine.num_pages:
      raise CacheOverflowError(
        f"prompt {i} can never fit the cache: its {len(seq.prompt)} tokens and max_new_tokens={seq.max_new} need "
        f"{seq.pages(ps)} pages of {ps} tokens, and the cache has num_pages={engine.num_pages}"
      )
    h = 0
    for j in range(len(seq.prompt) // ps):
      h = hash((h, tuple(seq.prompt[j * ps : (j + 1) * ps])))
      seq.hashes.append(h)
    seqs.append(seq)
  return seqs


class Scheduler:
  def __init__(self, engine, seqs, sampling_args, draft):
    self.engine, self.draft, self.sampling = engine, draft, sampling_args
    self.queue = collections.deque(seqs)
    self.slots: list[Sequence | None] = [None] * engine.max_num_seqs
    self.by_page: dict = {}  # page hash -> running sequences whose prompt has that page
    self.utils = []
    engine.stats.prompt_tokens += sum(len(s.prompt) for s in seqs)

  # -- admission and prefix reuse -----------------------------------------------------------------------
  def running(self):
    return [s for s in self.slots if s is not None]

  def source(self, seq: Sequence):
    """(running sequence, tokens) whose first pages seq can share, the longest match; None without one."""
    ps = self.engine.page_size
    usable = min(len(seq.hashes), (len(seq.prompt) - 1) // ps)  # one prompt token is always computed
    for j in range(usable - 1, -1, -1):
      owners = [s for s in self.by_page.get(seq.hashes[j], ()) if s is not seq and s.slot is not None]
      owners = [s for s in owners if s.prompt[: (j + 1) * ps] == seq.prompt[: (j + 1) * ps]]
      if owners:
        return max(owners, key=lambda s: s.fed), (j + 1) * ps
    return None

  def admit(self):
    ps = self.engine.page_size
    for i in range(len(self.slots)):
      if self.slots[i] is not None or not self.queue:
        continue
      seq = self.queue[0]
      match = self.source(seq) if not seq.generated else None
      shared_pages = 0 if match is None else match[1] // ps
      promised = sum(s.pages(ps) - s.shared // ps for s in self.running())
      if promised + seq.pages(ps) - shared_pages > self.engine.num_pages:
        return  # its pages are promised to running sequences: it waits, in order
      self.queue.popleft()
      seq.slot, seq.fed, seq.shared, seq.wait = i, 0, 0, match
      self.slots[i] = seq
      for h in seq.hashes:
        self.by_page.setdefault(h, []).append(seq)

  def take_shared_pages(self):
    """Sequences waiting for another's pages share them once computed (or look again if it left)."""
    for seq in self.running():
      if seq.wait is None:
        continue
      src, count = seq.wait
      if src.slot is None:
        seq.wait = self.source(seq)
        continue
      if src.fed >= count:
        self.engine.share(src.slot, seq.slot, count)
        seq.fed = seq.shared = count
        seq.wait = None
        self.engine.stats.shared_prefix_tokens += count

  def release(self, seq: Sequence, *, requeue: bool = False):
    mask = np.zeros(len(self.slots), bool)
    mask[seq.slot] = True
    self.engine.free(mask)
    self.slots[seq.slot] = None
    seq.slot, seq.fed, seq.shared, seq.wait = None, 0, 0, None
    for h in seq.hashes:
      owners = self.by_page.get(h, [])
      if seq in owners:
        owners.remove(seq)
    if requeue:
      self.engine.stats.evictions += 1
      self.queue.appendleft(seq)

  # -- a step -----------------------------------------------------------------------------------------
  def ring_prefills(self):
    """Context parallel: fresh prompt tails of at least `ring_prefill_min_tokens` go through the ring, one step
    each; yields the tokens they produce."""
    engine = self.engine
    if engine.mesh is None:
      return
    for seq in self.running():
      rest = seq.length - seq.fed
      if seq.wait is not None or rest < engine.ring_prefill_min_tokens or seq.fed % engine.page_size:
        continue
      if not self.engine.fits(np.eye(len(self.slots), dtype=np.int32)[seq.slot] * rest)[seq.slot]:
        self.release(seq, requeue=True)
        continue
      row_id = (seq.index, len(seq.generated))
      token = engine.ring_prefill(seq.slot, seq.tokens[seq.fed :], seq.fed, row_id, self.sampling)
      engine.stats.prefill_tokens_computed += max(0, len(seq.prompt) - seq.fed)
      if engine.overflowed()[seq.slot]:
        self.release(seq, requeue=True)
        continue
      seq.fed = seq.length
      yield from self.emit(seq, [token])

  def plan(self):
    """{slot: (tokens fed, proposals among them)} of the next step, in at most T rows."""
    budget, feeds = self.engine.max_num_batched_tokens, {}
    decoding = [s for s in self.running() if s.wait is None and s.generated and s.length - s.fed == 1]
    proposals = {}
    if self.draft is not None and decoding:
      room = [s.max_new - len(s.generated) - 1 for s in decoding]
      drafted = self.draft.propose([s.tokens for s in decoding], room)
      proposals = {s.slot: [int(t) for t in d][: max(r, 0)] for s, d, r in zip(decoding, drafted, room, strict=True)}
    for seq in decoding:
      if budget < 1:
        break
      extra = proposals.get(seq.slot, [])[: budget - 1]
      feeds[seq.slot] = ([seq.last(), *extra], extra)
      budget -= 1 + len(extra)
    for seq in self.running():
      if seq.slot in feeds or seq.wait is not None or budget < 1:
        continue
      chunk = seq.span(seq.fed, seq.fed + budget)
      feeds[seq.slot] = (chunk, [])
      budget -= len(chunk)
    return feeds

  def step(self):
    engine, S = self.engine, len(self.slots)
    while True:
      feeds = self.plan()
      new_lens = np.zeros(S, np.int32)
      for slot, (feed, _) in feeds.items():
        new_lens[slot] = len(feed)
      fed = np.array([0 if seq is None else seq.fed for seq in self.slots], np.int32)
      if engine.surely_fit(new_lens, fed):  # on the host, from the last step's count: no device round trip
        break
      refused = np.nonzero(~engine.fits(new_lens))[0]
      if not len(refused):
        break
      for slot in refused:  # its tokens would not fit the free pages: evict it, never cut it short
        self.release(self.slots[slot], requeue=True)
    if not feeds:
      return
    tokens, positions, cu, row_ids = self._rows(feeds, new_lens)
    decodes = len(feeds) if self._decodes_only(feeds) else 0
    running = engine.start_step(tokens, positions, cu, row_ids, self.sampling, decodes=decodes)
    owners = {slot: self.slots[slot] for slot in feeds}
    while True:
      following = self._follow(feeds, owners, positions, cu, row_ids, running) if decodes else None
      out, overflowed, utilization = engine.finish_step(running)
      yield from self._take(feeds, owners, cu, out, overflowed, utilization)
      if following is None:
        return
      running, positions, row_ids = following

  def _follow(self, feeds, owners, positions, cu, row_ids, running):
    """The next decode step of the same sequences, dispatched before the host reads `running` (a pure decode
    step), its tokens `running`'s own choices on the device: (the step, its positions, its row ids), or None.

    Only where the host's next plan would be that very step whatever `running` chooses, bar a stop token:
    `overlap` on, no draft, no mesh (ring prefills), every running sequence in it and still decoding after it,
    nothing waiting that a free slot could admit, and both steps' pages surely free on the host's count
    (`surely_fit`: no `fits` round trip, so no overflow).  A sequence that stops at `running` has its row of the
    next step discarded (`_take`: its slot is released by then, and freed with what that row wrote)."""
    engine = self.engine
    if not engine.overlap or self.draft is not None or engine.mesh is not None:
      return None
    running_seqs = self.running()
    if len(running_seqs) != len(feeds) or (self.queue and len(running_seqs) < len(self.slots)):
      return None
    S = len(self.slots)
    new_lens, fed = np.zeros(S, np.int32), np.zeros(S, np.int32)
    for slot in feeds:
      seq = owners[slot]
      # one step (`running`) is not yet taken: after it, the sequence must still owe at least one token
      if self.slots[slot] is not seq or len(seq.generated) + 2 > seq.max_new:
        return None
      new_lens[slot], fed[slot] = 2, seq.fed  # `running`'s token and the next one's
    if not engine.surely_fit(new_lens, fed):
      return None
    live = (np.arange(len(positions)) < cu[-1]).astype(np.int32)
    positions = positions + live
    row_ids = row_ids + np.stack([np.zeros_like(live), live], axis=1)
    step = engine.start_step(running.chosen, positions, cu, row_ids, self.sampling, decodes=len(feeds), after=running)
    return step, positions, row_ids

  def _take(self, feeds, owners, cu, out, overflowed, utilization):
    """A step's outputs taken: overflowed slots evicted, accepted tokens emitted, rejected proposals rolled back.
    A slot released after the step was dispatched (a stop token in the step before it) is skipped."""
    engine, S = self.engine, len(self.slots)
    self.utils.append(utilization)
    engine.stats.cache_utilization = float(np.mean(self.utils))
    drop = np.zeros(S, np.int32)
    emitted = []
    for slot, (feed, proposed) in feeds.items():
      seq = self.slots[slot]
      if seq is None or seq is not owners[slot]:
        continue
      if overflowed[slot]:
        self.release(seq, requeue=True)
        continue
      seq.fed += len(feed)
      if seq.fed < seq.length + len(proposed):
        continue  # a prompt chunk that does not reach its end yet
      rows = out[cu[slot] : cu[slot + 1]][len(feed) - len(proposed) - 1 :]
      accepted = [int(rows[0])]
      for d, prev, nxt in zip(proposed, rows[:-1], rows[1:], strict=False):
        if d != int(prev):
          break
        accepted.append(int(nxt))
      drop[slot] = len(proposed) - (len(accepted) - 1)
      seq.fed -= int(drop[slot])
      engine.stats.draft_proposed += len(proposed)
      engine.stats.draft_accepted += len(accepted) - 1
      emitted.append((seq, accepted))
    if drop.any():
      engine.rollback(drop)
    for seq, accepted in emitted:
      yield from self.emit(seq, accepted)

  def _decodes_only(self, feeds) -> bool:
    """Whether every feed is one new token of a sequence whose prompt and output so far are in its slot (a pure
    decode step): a prompt's last token alone, or a resumed sequence's re-fed output, is not one."""
    for slot, (feed, _) in feeds.items():
      seq = self.slots[slot]
      if len(feed) != 1 or not seq.generated or len(seq.prompt) + len(seq.generated) - seq.fed != 1:
        return False
    return True

  def _rows(self, feeds, new_lens):
    """The step's inputs: tokens, positions, cu_q_lens and row ids ([T, 2]: the prompt's index, the row's place
    after the prompt's end), the slots' feeds in slot order, padded to the step's token bucket.  Built with a few
    whole-batch numpy calls: per-slot ones cost a decode step of 64 sequences about 2 ms of host time, in which the
    device waits."""
    engine, S = self.engine, len(self.slots)
    n = int(new_lens.sum())
    T = engine.rows_for(n)  # padding rows cost the whole model
    tokens, positions = np.zeros(T, np.int32), np.zeros(T, np.int32)
    row_ids, cu = np.zeros((T, 2), np.int32), np.zeros(S + 1, np.int32)
    np.cumsum(new_lens, out=cu[1:])
    order = np.nonzero(new_lens)[0]
    lens = new_lens[order]
    seqs = [self.slots[slot] for slot in order]
    fed = np.array([q.fed for q in seqs], np.int32)
    index = np.array([q.index for q in seqs], np.int32)
    prompt = np.array([len(q.prompt) for q in seqs], np.int32)
    # A row's position: its sequence's fed count plus its place in the feed (rows run in slot order).
    pos = np.repeat(fed - cu[order], lens) + np.arange(n, dtype=np.int32)
    tokens[:n] = np.fromiter((t for slot in order for t in feeds[slot][0]), np.int32, count=n)
    positions[:n] = pos
    row_ids[:n, 0] = np.repeat(index, lens)
    row_ids[:n, 1] = pos + 1 - np.repeat(prompt, lens)
    engine.stats.prefill_tokens_computed += int(np.sum(row_ids[:n, 1] <= 0))
    return tokens, positions, cu, row_ids

  def emit(self, seq: Sequence, tokens):
    for token in tokens:
      seq.generated.append(token)
      self.engine.stats.generated_tokens += 1
      yield seq.index, token
      if token in seq.stop or len(seq.generated) >= seq.max_new:
        seq.done = True
        self.release(seq)
        return

  def run(self):
    while self.queue or any(s is not None for s in self.slots):
      self.admit()
      self.take_shared_pages()
      yield from self.ring_prefills()
      if not any(s is not None for s in self.slots):
        if self.queue:  # nothing running and the head still does not fit: cannot happen after make_sequences
          raise CacheOverflowError(f"prompt {self.queue[0].index} does not fit the empty cache")
        break
      yield from self.step()
