"""Stateful fuzzing of `PagedKVCache` (issue 30, item 7): random sequences of append, reserve, free, share_prefix
(copy-on-write writes into shared pages included) and invalid calls, checked after every step against a model.

The model keeps, per slot, the ids of the tokens it holds (every appended token gets a new id; its K / V are row
`id` of fixed random tables, id 0 is the padding rows' poison), the tokens it has reserved pages for, and its
`overflowed` flag.  After every step:

* ref_counts[p] is the number of page-table references to page p; free pages (ref 0) plus used pages are
  num_pages, and free pages hold zeros;
* each slot's row is its pages then -1, no page twice, as many pages as its tokens (or its reservation) need,
  kv_lens is the model's, and so is `overflowed`;
* every token of every slot reads back through page_indices as the model's (no slot sees another's data, a
  copy-on-write never touches the other sharer), and `paged_attention` of one query per slot equals the dense
  float64 oracle over that slot's own tokens only.

Valid steps run jitted (one compile per method); a write the model says does not fit runs eagerly (it must raise
`CacheOverflowError` and leave the cache unchanged) or jitted (the refused slots are flagged and store nothing).
Invalid calls run eagerly: they must raise the library's error naming the argument and leave every leaf of the
cache unchanged.  The same invalid calls are also fuzzed one kind at a time on fixed cache states
(`test_cache_rejects_invalid`), so a failure names its kind.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dense_oracle import dense_oracle
from fuzz_strategies import assert_unchanged, bounded_shrinking, expect_library_error, fuzz_settings, snapshot
from hypothesis import event as _hypothesis_event
from hypothesis import given
from hypothesis import note as _hypothesis_note
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tolerances import assert_close

import flax_ringattn as fr

# Geometry: P pages of PS tokens, S slots of PPS pages each (CAP tokens), K kv heads of H (v: HV), T rows a step.
# Fewer pages than the slots could hold (6 < 3 * 4), so writes run out of pages as well as of slot capacity.
P, PS, S, PPS, K, H, HV, N, T = 6, 2, 3, 4, 1, 2, 3, 2, 6
CAP = PPS * PS
F32 = jnp.float32

_rng = np.random.default_rng(2024)
MAX_IDS = 4096
TOKEN_K = _rng.standard_normal((MAX_IDS, K, H)).astype(np.float32)
TOKEN_V = _rng.standard_normal((MAX_IDS, K, HV)).astype(np.float32)
QUERIES = _rng.standard_normal((S, N, H)).astype(np.float32)


@pytest.fixture(autouse=True)
def _bounded_shrinking():
  with bounded_shrinking():
    yield


def note(message: str):
  """hypothesis' `note` inside a test; nothing in the scripted scenarios, which call the rules directly."""
  try:
    _hypothesis_note(message)
  except InvalidArgument:
    pass


def event(name: str):
  """hypothesis' `event` (what the steps exercised: pytest --hypothesis-show-statistics); nothing outside a test."""
  try:
    _hypothesis_event(name)
  except InvalidArgument:
    pass


def _create():
  return fr.PagedKVCache.create(
    num_pages=P, page_size=PS, max_num_seqs=S, pages_per_seq=PPS, num_kv_heads=K, head_dim=H, v_head_dim=HV
  )


def _ceil(a, b):
  return -(-a // b)


def _cu(q_lens, num_seqs=S, garbage=None):
  """cu_q_lens [S + 1] for the first num_seqs slots' q_lens; entries past num_seqs repeat the total, or hold
  `garbage` (only the first num_seqs + 1 entries count)."""
  cu = np.zeros(S + 1, np.int32)
  cu[1 : num_seqs + 1] = np.cumsum(q_lens[:num_seqs])
  cu[num_seqs + 1 :] = cu[num_seqs] if garbage is None else garbage[: S - num_seqs]
  return cu


# -- jitted valid steps: one compile each ----------------------------------------------------------------------------

_append = jax.jit(lambda c, k, v, cu, ns: c.append(k, v, cu, ns))
_reserve = jax.jit(lambda c, lens: c.reserve(lens))
_free = jax.jit(lambda c, slots: c.free(slots))
_share = jax.jit(lambda c, src, dst, n: c.share_prefix(src, dst, n))
_fits = jax.jit(lambda c, lens: c.fits(lens))


@jax.jit
def _attend(q, c, cu, ns):
  kv_lens, table = c.attention_view()
  return fr.paged_attention(q, c.k_pages, c.v_pages, kv_lens, table, cu, ns, implementation="xla")


class Model:
  """What each slot should hold: token ids, the tokens it has pages for, its overflow flag."""

  def __init__(self):
    self.tokens = [[] for _ in range(S)]
    self.reserved = [0] * S
    self.overflowed = [False] * S
    self.next_id = 1

  def held(self, s):
    """The pages slot s holds: its tokens' and its reservation's."""
    return _ceil(max(len(self.tokens[s]), self.reserved[s]), PS)

  def empty(self, s):
    return not self.tokens[s] and self.reserved[s] == 0 and not self.overflowed[s]

  def admission(self, cache, new_lens):
    """(accepted, refused) [S] bools of a write of new_lens tokens: all or nothing per slot, served in slot order
    from the pages free before the step; a write into a shared partial page needs one more (the copy)."""
    refs, table = np.asarray(cache.ref_counts), np.asarray(cache.page_indices)
    free = int((refs == 0).sum())
    accepted, refused = [False] * S, [False] * S
    for s, n in enumerate(new_lens):
      if n == 0:
        continue
      kv = len(self.tokens[s])
      if self.overflowed[s] or kv + n > CAP:
        refused[s] = True
        continue
      extra = max(0, _ceil(kv + n, PS) - self.held(s))
      if kv % PS and refs[table[s, kv // PS]] > 1:
        extra += 1  # copy-on-write of the shared partial page
        event("a write copies a shared partial page")
      if extra <= free:
        accepted[s], free = True, free - extra
      else:
        refused[s] = True
    return accepted, refused


def _prefix_lens(n_tokens: int):
  """0 .. n_tokens, partial pages (the case copy-on-write is about) drawn as often as the rest."""
  partial = [n for n in range(1, n_tokens + 1) if n % PS]
  whole = st.integers(0, n_tokens)
  return st.one_of(st.sampled_from(partial), whole) if partial else whole


class CacheMachine(RuleBasedStateMachine):
  """Valid and invalid cache operations; every invariant of the module docstring after every step."""

  @initialize()
  def start(self):
    self.cache = _create()
    self.model = Model()

  # -- valid steps ---------------------------------------------------------------------------------------------

  def _batch(self, q_lens):
    """(k [T, K, H], v [T, K, HV], the ids of each slot's rows): new ids for the rows, 0 for the padding rows."""
    ids = np.zeros(T, np.int64)
    rows, r = [], 0
    for n in q_lens:
      ids[r : r + n] = np.arange(self.model.next_id, self.model.next_id + n)
      rows.append(list(ids[r : r + n]))
      self.model.next_id += n
      r += n
    assert self.model.next_id < MAX_IDS
    return TOKEN_K[ids], TOKEN_V[ids], rows

  def _check_fits(self, new_lens, accepted):
    fits = np.asarray(_fits(self.cache, jnp.asarray(new_lens, jnp.int32)))
    want = [a or n == 0 for a, n in zip(accepted, new_lens, strict=True)]
    assert list(fits) == want, f"fits({list(new_lens)}) = {list(fits)}, the model says {want}"

  @rule(
    q_lens=st.tuples(*[st.integers(0, 3)] * S),
    num_seqs=st.integers(0, S),
    garbage=st.one_of(st.none(), st.lists(st.integers(-2, T + 2), min_size=S, max_size=S)),
    eager=st.booleans(),
  )
  def append(self, q_lens, num_seqs, garbage, eager):
    q_lens = [n if s < num_seqs else 0 for s, n in enumerate(q_lens)]
    q_lens = [min(n, T - sum(q_lens[:s])) for s, n in enumerate(q_lens)]  # at most T rows
    accepted, refused = self.model.admission(self.cache, q_lens)
    self._check_fits(q_lens, accepted)
    k, v, rows = self._batch(q_lens)
    cu, ns = _cu(q_lens, num_seqs, garbage), np.array([num_seqs], np.int32)
    note(f"append q_lens={q_lens} cu_q_lens={list(cu)} accepted={accepted} refused={refused}")
    if any(refused):
      event(f"append refused ({'eager' if eager else 'jit'})")
    if any(refused) and eager:
      before = snapshot(self.cache)
      expect_library_error(lambda: self.cache.append(k, v, cu, ns), ("slot",), (fr.CacheOverflowError,))
      assert_unchanged(before, self.cache)
      return
    self.cache = _append(self.cache, k, v, cu, ns)
    for s in range(S):
      if accepted[s]:
        self.model.tokens[s] += rows[s]
        self.model.reserved[s] = max(self.model.reserved[s], len(self.model.tokens[s]))
      elif refused[s]:
        self.model.overflowed[s] = True

  @rule(new_lens=st.tuples(*[st.integers(0, 4)] * S), eager=st.booleans())
  def reserve(self, new_lens, eager):
    accepted, refused = self.model.admission(self.cache, new_lens)
    self._check_fits(new_lens, accepted)
    note(f"reserve new_lens={list(new_lens)} accepted={accepted} refused={refused}")
    lens = np.asarray(new_lens, np.int32)
    if any(refused):
      event(f"reserve refused ({'eager' if eager else 'jit'})")
    if any(refused) and eager:
      before = snapshot(self.cache)
      expect_library_error(lambda: self.cache.reserve(lens), ("slot",), (fr.CacheOverflowError,))
      assert_unchanged(before, self.cache)
      return
    self.cache = _reserve(self.cache, lens)
    for s in range(S):
      if accepted[s]:
        self.model.reserved[s] = max(self.model.reserved[s], len(self.model.tokens[s]) + new_lens[s])
      elif refused[s]:
        self.model.overflowed[s] = True

  @rule(slots=st.tuples(*[st.sampled_from([False, False, False, True])] * S))  # a slot in four: pages run out
  def free(self, slots):
    note(f"free {list(slots)}")
    self.cache = _free(self.cache, jnp.asarray(slots, bool))
    for s in range(S):
      if slots[s]:
        self.model.tokens[s], self.model.reserved[s], self.model.overflowed[s] = [], 0, False

  @precondition(lambda self: any(self.model.empty(s) for s in range(S)))
  @rule(data=st.data())
  def share_prefix(self, data):
    dst = data.draw(st.sampled_from([s for s in range(S) if self.model.empty(s)]), label="dst")
    src = data.draw(st.sampled_from([s for s in range(S) if s != dst]), label="src")
    self.share(src, dst, data.draw(_prefix_lens(len(self.model.tokens[src])), label="num_tokens"))

  @rule(data=st.data())
  def fork(self, data):
    """A finished slot is freed and reused for a fork of another slot's prefix (beam search, parallel sampling):
    free then share_prefix, so that shared pages (and their copy-on-write) are common."""
    holding = [s for s in range(S) if self.model.tokens[s]] or list(range(S))
    src = data.draw(st.sampled_from(holding), label="src")
    dst = data.draw(st.sampled_from([s for s in range(S) if s != src]), label="dst")
    self.free(tuple(s == dst for s in range(S)))
    self.share(src, dst, data.draw(_prefix_lens(len(self.model.tokens[src])), label="num_tokens"))

  def share(self, src, dst, n):
    note(f"share_prefix src={src} dst={dst} num_tokens={n}")
    assert self.model.empty(dst) and src != dst and 0 <= n <= len(self.model.tokens[src])
    event("share_prefix of a partial page" if n % PS else "share_prefix of whole pages")
    self.cache = _share(self.cache, jnp.int32(src), jnp.int32(dst), jnp.int32(n))
    self.model.tokens[dst] = list(self.model.tokens[src][:n])
    self.model.reserved[dst] = n

  # -- invalid calls: raise, name the argument, change nothing -----------------------------------------------------

  def _rejects(self, fn, names, kinds=(ValueError, TypeError)):
    before = snapshot(self.cache)
    expect_library_error(fn, names, kinds)
    assert_unchanged(before, self.cache)

  @rule(kind=st.sampled_from(["free", "share_prefix", "reserve", "append"]), data=st.data())
  def invalid_call(self, kind, data):
    """One invalid call of `kind` (one rule for all four, so that most steps change the cache)."""
    event(f"invalid {kind}")
    if kind == "free":
      slots = data.draw(invalid_free_slots(), label="slots")
      note(f"free({slots!r})")
      self._rejects(lambda: self.cache.free(slots), ("slots",))
    elif kind == "share_prefix":
      src, dst, n, names = data.draw(invalid_share_args(self.model), label="(src, dst, num_tokens, names)")
      note(f"share_prefix({src}, {dst}, {n})")
      self._rejects(lambda: self.cache.share_prefix(src, dst, n), names)
    elif kind == "reserve":
      lens = data.draw(invalid_new_lens(), label="new_lens")
      note(f"reserve({lens!r})")
      self._rejects(lambda: self.cache.reserve(lens), ("new_lens",))
    else:
      cu, ns, names = data.draw(invalid_append_metadata(), label="(cu_q_lens, num_seqs, names)")
      k, v, _ = self._batch([0] * S)
      note(f"append(cu_q_lens={list(cu)}, num_seqs={list(ns)})")
      self._rejects(lambda: self.cache.append(k, v, cu, ns), names)

  # -- the invariants --------------------------------------------------------------------------------------------

  @invariant()
  def consistent(self):
    check_cache(self.cache, self.model)


def check_cache(cache, model: Model):
  table, kv = np.asarray(cache.page_indices), np.asarray(cache.kv_lens)
  refs, kp, vp = np.asarray(cache.ref_counts), np.asarray(cache.k_pages), np.asarray(cache.v_pages)
  for s in range(S):
    row = table[s]
    held = int((row >= 0).sum())
    assert (row[:held] >= 0).all() and (row[held:] == -1).all(), f"slot {s}: row {row} is not its pages then -1"
    assert (row[:held] < P).all(), f"slot {s}: row {row} has a page id >= num_pages={P}"
    assert len(set(row[:held].tolist())) == held, f"slot {s}: row {row} names a page twice"
    assert kv[s] == len(model.tokens[s]), f"kv_lens[{s}]={kv[s]}, the model holds {len(model.tokens[s])} tokens"
    assert held == model.held(s), (
      f"slot {s} holds {held} pages (row {row}) for kv_lens={kv[s]}, reserved for {model.reserved[s]} tokens: "
      f"expected {model.held(s)}"
    )
  over = np.zeros(S, bool) if cache.overflowed is None else np.asarray(cache.overflowed)
  assert list(over) == model.overflowed, f"overflowed={list(over)}, the model says {model.overflowed}"
  counts = np.bincount(table[table >= 0], minlength=P)
  assert (refs == counts).all(), f"ref_counts={list(refs)} but the page table references {list(counts)} (table {table})"
  free = refs == 0
  assert free.sum() + (counts > 0).sum() == P
  assert int(cache.num_free_pages()) == free.sum()
  assert not kp[free].any() and not vp[free].any(), f"free pages {np.flatnonzero(free)} hold data"
  for s in range(S):
    for t, i in enumerate(model.tokens[s]):
      page, slot = table[s, t // PS], t % PS
      assert (kp[page, slot] == TOKEN_K[i]).all() and (vp[page, slot] == TOKEN_V[i]).all(), (
        f"slot {s} token {t} (page {page}, slot {slot}) does not read back as token id {i}"
      )
  _check_attention(cache, model, over)


def _check_attention(cache, model, over):
  """One query per slot at its last token: equal to the dense oracle over the slot's own tokens only."""
  live = [s for s in range(S) if model.tokens[s] and not over[s]]
  q_lens = [1 if s in live else 0 for s in range(S)]
  q = np.zeros((S, N, H), np.float32)
  q[: len(live)] = QUERIES[live]
  out = np.asarray(_attend(q, cache, _cu(q_lens), np.array([S], np.int32)))
  want = np.zeros((S, N, HV))
  for r, s in enumerate(live):
    ids = model.tokens[s]
    want[r] = dense_oracle(q[None, r : r + 1], TOKEN_K[ids][None], TOKEN_V[ids][None])[0][0, 0]
  assert_close(out, want, F32)


# -- invalid arguments -----------------------------------------------------------------------------------------------


@st.composite
def invalid_free_slots(draw):
  """An int array (not a bool mask), or a bool mask of the wrong length."""
  if draw(st.booleans()):
    dtype = draw(st.sampled_from([np.int32, np.int64, np.uint8]))
    return np.asarray(draw(st.lists(st.integers(0, 1), min_size=S, max_size=S)), dtype)
  length = draw(st.sampled_from([0, 1, S - 1, S + 1, 2 * S]))
  return np.asarray(draw(st.lists(st.booleans(), min_size=length, max_size=length)), bool)


@st.composite
def invalid_share_args(draw, model: Model):
  """(src, dst, num_tokens, names): dst not empty, a slot out of range, src == dst, or num_tokens < 0."""
  kinds = ["out_of_range", "same", "negative"]
  busy = [s for s in range(S) if model.tokens[s] or model.reserved[s]]
  if busy:
    kinds.append("non_empty")
  kind = draw(st.sampled_from(kinds))
  bad = st.sampled_from([-1, S, S + 3, -S - 1])
  if kind == "non_empty":
    dst = draw(st.sampled_from(busy))
    src = draw(st.sampled_from([s for s in range(S) if s != dst]))
    return src, dst, draw(st.integers(0, len(model.tokens[src]))), ("dst",)
  if kind == "same":
    s = draw(st.integers(0, S - 1))
    return s, s, draw(st.integers(0, len(model.tokens[s]))), ("src", "dst")
  if kind == "negative":
    src, dst = draw(st.permutations(range(S)))[:2]
    return src, dst, draw(st.integers(-5, -1)), ("num_tokens",)
  if draw(st.booleans()):
    return draw(bad), draw(st.integers(0, S - 1)), 1, ("src",)
  return draw(st.integers(0, S - 1)), draw(bad), 1, ("dst",)


@st.composite
def invalid_new_lens(draw):
  """new_lens with a negative count, or of the wrong length."""
  if draw(st.booleans()):
    lens = draw(st.lists(st.integers(0, 2), min_size=S, max_size=S))
    lens[draw(st.integers(0, S - 1))] = draw(st.integers(-4, -1))
    return np.asarray(lens, np.int32)
  length = draw(st.sampled_from([0, 1, S - 1, S + 1]))
  return np.asarray(draw(st.lists(st.integers(0, 2), min_size=length, max_size=length)), np.int32)


@st.composite
def invalid_append_metadata(draw):
  """(cu_q_lens, num_seqs, names): cu_q_lens not starting at 0 or decreasing over its live entries, or num_seqs
  out of [0, S]."""
  kind = draw(st.sampled_from(["start", "decreasing", "num_seqs"]))
  q_lens = draw(st.lists(st.integers(0, 2), min_size=S, max_size=S))
  if kind == "num_seqs":
    return _cu(q_lens), np.array([draw(st.sampled_from([-1, S + 1, 50]))], np.int32), ("num_seqs",)
  num_seqs = draw(st.integers(1, S))
  cu = _cu(q_lens, num_seqs)
  if kind == "start":
    cu[: num_seqs + 1] += draw(st.sampled_from([1, 2, -1]))
  else:
    i = draw(st.integers(1, num_seqs))
    cu[i] = cu[i - 1] - draw(st.integers(1, 2))
  return cu, np.array([num_seqs], np.int32), ("cu_q_lens",)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = fuzz_settings(40, stateful_step_count=25)


# -- the invalid calls one kind at a time, on fixed cache states -------------------------------------------------------


def _states():
  """(cache, model) pairs: empty; slots 0 and 1 prefilled (partial pages); slot 2 sharing 3 of slot 0's tokens;
  slot 0 with pages reserved beyond its tokens."""
  out = []
  cache, model = _create(), Model()
  out.append((cache, model))
  m = Model()
  c = _append(cache, TOKEN_K[1:7], TOKEN_V[1:7], _cu([3, 3, 0]), np.array([S], np.int32))
  m.tokens = [[1, 2, 3], [4, 5, 6], []]
  m.reserved, m.next_id = [3, 3, 0], 7
  out.append((c, m))
  m2 = Model()
  m2.tokens, m2.reserved, m2.next_id = [[1, 2, 3], [4, 5, 6], [1, 2, 3]], [3, 3, 3], 7
  out.append((_share(c, jnp.int32(0), jnp.int32(2), jnp.int32(3)), m2))
  m3 = Model()
  m3.tokens, m3.reserved, m3.next_id = [[1, 2, 3], [4, 5, 6], []], [6, 3, 0], 7
  out.append((_reserve(c, np.array([3, 0, 0], np.int32)), m3))
  return out


_STATES: list = []


def _state(i):
  if not _STATES:
    _STATES.extend(_states())
  return _STATES[i]


def test_fixed_states_are_consistent():
  """The states the invalid calls start from satisfy every invariant (so a failure below is the call's)."""
  for i in range(4):
    check_cache(*_state(i))


CACHE_INVALID = ("free", "share_prefix", "reserve", "append")


@pytest.mark.parametrize("kind", CACHE_INVALID)
def test_cache_rejects_invalid(kind):
  @fuzz_settings(10)
  @given(i=st.integers(0, 3), data=st.data())
  def check(i, data):
    cache, model = _state(i)
    k, v = TOKEN_K[:T], TOKEN_V[:T]
    if kind == "free":
      slots = data.draw(invalid_free_slots(), label="slots")
      fn, names = (lambda: cache.free(slots)), ("slots",)
    elif kind == "share_prefix":
      src, dst, n, names = data.draw(invalid_share_args(model), label="(src, dst, num_tokens, names)")
      fn = lambda: cache.share_prefix(src, dst, n)  # noqa: E731
    elif kind == "reserve":
      lens = data.draw(invalid_new_lens(), label="new_lens")
      fn, names = (lambda: cache.reserve(lens)), ("new_lens",)
    else:
      cu, ns, names = data.draw(invalid_append_metadata(), label="(cu_q_lens, num_seqs, names)")
      fn = lambda: cache.append(k, v, cu, ns)  # noqa: E731
    before = snapshot(cache)
    expect_library_error(fn, names)
    assert_unchanged(before, cache)

  check()


# -- scripted scenarios: the same machine, steps chosen by hand ---------------------------------------------------


def _run(steps):
  """Runs (rule, kwargs) steps on a fresh machine, checking every invariant after each."""
  m = CacheMachine()
  m.start()
  m.consistent()
  for name, kw in steps:
    getattr(m, name)(**kw)
    m.consistent()
  return m


def test_copy_on_write_of_a_shared_partial_page():
  """Slot 1 shares slot 0's 3 tokens (a partial second page); both then write into that page: each copies it,
  the original loses its last reference and is zeroed; neither sees the other's new token."""
  _run(
    [
      ("append", dict(q_lens=(2, 0, 0), num_seqs=3, garbage=None, eager=False)),
      ("append", dict(q_lens=(1, 0, 0), num_seqs=1, garbage=[5, -2, 0], eager=False)),
      ("share", dict(src=0, dst=1, n=3)),
      ("append", dict(q_lens=(1, 1, 0), num_seqs=2, garbage=None, eager=False)),
      ("free", dict(slots=(True, False, False))),
      ("append", dict(q_lens=(0, 2, 2), num_seqs=3, garbage=None, eager=False)),
      ("share", dict(src=1, dst=0, n=1)),
      ("append", dict(q_lens=(2, 0, 0), num_seqs=3, garbage=None, eager=False)),
    ]
  )


def test_reserve_then_append_uses_the_reserved_pages():
  """Pages reserved ahead (reserve, as before a fused write) are the ones the next write fills: none leaks."""
  _run(
    [
      ("append", dict(q_lens=(1, 0, 0), num_seqs=3, garbage=None, eager=False)),
      ("reserve", dict(new_lens=(3, 0, 1), eager=False)),
      ("reserve", dict(new_lens=(3, 0, 1), eager=False)),
      ("append", dict(q_lens=(2, 0, 1), num_seqs=3, garbage=None, eager=False)),
      ("free", dict(slots=(True, True, True))),
    ]
  )


def test_overflow_refuses_the_whole_write_and_free_clears_it():
  """The slots fill every page; a write needing one more is refused whole (eagerly: CacheOverflowError, nothing
  changes; under jit: the slot is flagged, stores nothing, its rows see nothing) until the slot is freed."""
  _run(
    [
      ("append", dict(q_lens=(3, 2, 0), num_seqs=3, garbage=None, eager=False)),
      ("append", dict(q_lens=(3, 3, 0), num_seqs=3, garbage=None, eager=False)),  # every page taken
      ("append", dict(q_lens=(1, 0, 0), num_seqs=3, garbage=None, eager=True)),
      ("append", dict(q_lens=(1, 1, 1), num_seqs=3, garbage=None, eager=False)),  # slot 1 fits its last page
      ("append", dict(q_lens=(0, 0, 1), num_seqs=3, garbage=None, eager=True)),
      ("free", dict(slots=(False, True, False))),
      ("append", dict(q_lens=(1, 0, 0), num_seqs=3, garbage=None, eager=True)),  # still flagged
      ("free", dict(slots=(True, False, True))),
      ("append", dict(q_lens=(2, 0, 2), num_seqs=3, garbage=None, eager=False)),
    ]
  )
