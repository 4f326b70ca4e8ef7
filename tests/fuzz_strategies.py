"""Hypothesis strategies and checks shared by the fuzz suites (test_fuzz_ops.py, test_fuzz_cache.py).

Draws are small frozen dataclasses (their repr is the falsifying example hypothesis prints); arrays are built
from a drawn seed.  Shapes come from small sets so jitted programs are reused, and `fuzz_settings` fixes the
seeds (derandomize) and turns off deadlines: every new shape compiles.

The error contract every invalid draw is held to (`expect_library_error`): the library raises its own error (a
ValueError / TypeError, or `CacheOverflowError`, defined in builtins or in flax_ringattn, not an IndexError, a
ZeroDivisionError or a JAX internal error) and the message names the offending argument.

A helper module, not a test module: pytest collects nothing from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

import jax
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# -- settings ----------------------------------------------------------------------------------------------------


# FLAX_RINGATTN_FUZZ_SCALE=k runs k times the examples (a deeper local search; still deterministic).
SCALE = max(1, int(os.environ.get("FLAX_RINGATTN_FUZZ_SCALE", "1")))


def fuzz_settings(max_examples: int, **kw):
  """Fixed seeds, no deadline (compiles), no example database: the same examples on every run."""
  return settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=max_examples * SCALE,
    suppress_health_check=[
      HealthCheck.too_slow,
      HealthCheck.data_too_large,
      HealthCheck.filter_too_much,
      HealthCheck.large_base_example,
    ],
    **kw,
  )


# Seconds hypothesis may spend shrinking one failing property (FLAX_RINGATTN_FUZZ_SHRINK_S; its own default is 300).
SHRINK_SECONDS = int(os.environ.get("FLAX_RINGATTN_FUZZ_SHRINK_S", "30"))


@contextlib.contextmanager
def bounded_shrinking(seconds: int = SHRINK_SECONDS):
  """Caps the time hypothesis spends shrinking a failure (its default is 5 minutes a test: a failing property
  would hold the suite that long).  Hypothesis has no setting for it, so this sets its engine's constant for the
  duration of one test, when it exists."""
  try:
    from hypothesis.internal.conjecture import engine
  except ImportError:  # pragma: no cover
    yield
    return
  old = getattr(engine, "MAX_SHRINKING_SECONDS", None)
  if old is None:  # pragma: no cover
    yield
    return
  engine.MAX_SHRINKING_SECONDS = seconds
  try:
    yield
  finally:
    engine.MAX_SHRINKING_SECONDS = old


# -- the error contract --------------------------------------------------------------------------------------------


def _names_one_of(message: str, names) -> bool:
  return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


def check_library_error(err: BaseException, names, kinds=(ValueError, TypeError)):
  """`err` is the library's error of one of `kinds` and its message names one of `names`."""
  cls = type(err)
  where = f"{cls.__module__}.{cls.__qualname__}: {err}"
  assert isinstance(err, tuple(kinds)), f"expected one of {[k.__name__ for k in kinds]}, got {where}"
  assert cls.__module__ == "builtins" or cls.__module__.startswith("flax_ringattn"), f"not the library's error: {where}"
  assert _names_one_of(str(err), names), f"the message names none of {list(names)}: {where}"


def expect_library_error(fn, names, kinds=(ValueError, TypeError)):
  """Calls fn(); it must raise the library's error naming one of `names` (see `check_library_error`)."""
  try:
    out = fn()
  except Exception as err:  # noqa: BLE001 -- any other exception is the failure being reported
    check_library_error(err, names, kinds)
    return err
  shape = getattr(out, "shape", None)
  raise AssertionError(f"no error raised (expected one naming {list(names)}); returned {type(out).__name__} {shape}")


def snapshot(tree):
  """(treedef, numpy copies of every leaf): compare with `assert_unchanged` after a call that must not change it."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [np.array(x, copy=True) for x in leaves]


def assert_unchanged(before, tree, what="cache"):
  treedef, leaves = before
  now, now_def = jax.tree.flatten(tree)
  assert now_def == treedef, f"the {what}'s structure changed: {treedef} -> {now_def}"
  for i, (a, b) in enumerate(zip(leaves, now, strict=True)):
    b = np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what} leaf {i}: {a.shape} {a.dtype} -> {b.shape} {b.dtype}"
    np.testing.assert_array_equal(b, a, err_msg=f"{what} leaf {i} changed")


# -- option strategies -----------------------------------------------------------------------------------------------

HUGE_WINDOWS = (2**31 - 1, 10**12)
window_sides = st.sampled_from([0, 1, 2, 3, 5, *HUGE_WINDOWS])
windows = st.one_of(st.none(), window_sides, st.tuples(window_sides, window_sides))
soft_caps = st.one_of(st.none(), st.sampled_from([0.5, 2.0, 30.0]), st.floats(0.25, 50.0))
scales = st.one_of(st.none(), st.floats(0.05, 2.0))
seeds = st.integers(0, 2**16)

# (N, K): MHA, GQA and MQA.
HEAD_LAYOUTS = ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4))

# Invalid windows: (the value, the error type).
BAD_WINDOWS = (
  (-1, ValueError),
  ((-1, 2), ValueError),
  ((2, -3), ValueError),
  (2.5, TypeError),
  ((1.5, 2), TypeError),
  ("3", TypeError),
  ((1,), TypeError),
  ((1, 2, 3), TypeError),
  (True, TypeError),
)
BAD_SOFT_CAPS = (0.0, -1.0, float("inf"), float("nan"), "2.0", True)


# -- dense draws -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DenseDraw:
  """One dense attention problem: q [B, T, N, H], k [B, S, K, H], v [B, S, K, Hv] and its options."""

  B: int = 1
  T: int = 4
  S: int = 4
  N: int = 2
  K: int = 1
  H: int = 4
  Hv: int = 4
  is_causal: bool = False
  window: object = None
  soft_cap: float | None = None
  scale: float | None = None
  segments: str = "none"  # "none", "self" ([B, T], needs T == S) or "pair" ((q_ids [B, T], kv_ids [B, S]))
  sinks: bool = False
  seed: int = 0

  @property
  def options(self) -> dict:
    return dict(
      is_causal=self.is_causal, local_window_size=self.window, logits_soft_cap=self.soft_cap, scale=self.scale
    )

  def arrays(self):
    """(q, k, v, segment_ids or None, sinks or None) as numpy float32 / int32."""
    rng = np.random.default_rng(self.seed)
    q = rng.standard_normal((self.B, self.T, self.N, self.H)).astype(np.float32)
    k = rng.standard_normal((self.B, self.S, self.K, self.H)).astype(np.float32)
    v = rng.standard_normal((self.B, self.S, self.K, self.Hv)).astype(np.float32)
    seg = None
    if self.segments == "self":
      seg = rng.integers(0, 3, (self.B, self.T)).astype(np.int32)
    elif self.segments == "pair":
      seg = (
        rng.integers(0, 3, (self.B, self.T)).astype(np.int32),
        rng.integers(0, 3, (self.B, self.S)).astype(np.int32),
      )
    sinks = (1.0 + rng.standard_normal(self.N)).astype(np.float32) if self.sinks else None
    return q, k, v, seg, sinks

  def cotangent(self):
    rng = np.random.default_rng(self.seed + 1)
    return rng.standard_normal((self.B, self.T, self.N, self.Hv)).astype(np.float32)


@st.composite
def dense_draws(draw, *, lengths=(1, 3, 4, 8), multiple: int = 1, heads=HEAD_LAYOUTS, batch=(1, 2)):
  """Valid dense problems; T and S from `lengths` (only multiples of `multiple`)."""
  lens = [L for L in lengths if L % multiple == 0]
  T = draw(st.sampled_from(lens))
  S = draw(st.sampled_from(lens))
  N, K = draw(st.sampled_from(heads))
  H = draw(st.sampled_from([2, 4]))
  Hv = draw(st.sampled_from([H, H + 1]))
  kinds = ["none", "pair"] + (["self"] if T == S else [])
  return DenseDraw(
    B=draw(st.sampled_from(batch)),
    T=T,
    S=S,
    N=N,
    K=K,
    H=H,
    Hv=Hv,
    is_causal=draw(st.booleans()),
    window=draw(windows),
    soft_cap=draw(soft_caps),
    scale=draw(scales),
    segments=draw(st.sampled_from(kinds)),
    sinks=draw(st.booleans()),
    seed=draw(seeds),
  )


def dense_expected(d: DenseDraw, q, k, v, seg, sinks, do=None):
  """The float64 oracle (tests/dense_oracle.py) of a draw."""
  from dense_oracle import dense_oracle

  return dense_oracle(
    q,
    k,
    v,
    do=do,
    is_causal=d.is_causal,
    local_window_size=d.window,
    segment_ids=seg,
    logits_soft_cap=d.soft_cap,
    scale=d.scale,
    sinks=sinks,
  )


# -- paged draws -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PagedGeometry:
  num_pages: int
  page_size: int
  max_num_seqs: int
  pages_per_seq: int
  num_tokens: int  # T: rows of q

  @property
  def capacity(self) -> int:
    return self.pages_per_seq * self.page_size


# num_pages covers every slot at capacity, so a batch never runs out of distinct pages.
PAGED_GEOMETRIES = (
  PagedGeometry(num_pages=14, page_size=2, max_num_seqs=3, pages_per_seq=4, num_tokens=8),
  PagedGeometry(num_pages=10, page_size=4, max_num_seqs=2, pages_per_seq=3, num_tokens=8),
  PagedGeometry(num_pages=9, page_size=1, max_num_seqs=2, pages_per_seq=4, num_tokens=4),
)


@dataclasses.dataclass(frozen=True)
class PagedDraw:
  """Ragged batches of one geometry and one set of options (one compile): `batches` holds, per batch, the
  (q_len, kv_len) of its live slots (num_seqs of them)."""

  geometry: PagedGeometry = PAGED_GEOMETRIES[0]
  batches: tuple = (((1, 3),),)
  N: int = 2
  K: int = 1
  H: int = 4
  Hv: int = 4
  window: object = None
  soft_cap: float | None = None
  scale: float | None = None
  sinks: bool = False
  block: tuple | None = None  # (block_q, pages per kv block) or None: the backend's choice
  garbage: bool = False  # dead entries of cu_q_lens past num_seqs hold garbage (only the live ones count)
  seed: int = 0

  @property
  def options(self) -> dict:
    return dict(local_window_size=self.window, logits_soft_cap=self.soft_cap, scale=self.scale)

  @property
  def block_sizes(self):
    import flax_ringattn as fr

    if self.block is None:
      return None
    block_q, pages = self.block
    return fr.BlockSizes(block_q=block_q, block_kv=pages * self.geometry.page_size)

  def batch(self, i: int = 0):
    """paged_cases.make_batch's `Batch` of batch i (random pages, random ids in unused table entries)."""
    from paged_cases import make_batch

    g = self.geometry
    seqs = self.batches[i]
    rng = np.random.default_rng(self.seed + 1000 * i)
    b = make_batch(
      rng,
      list(seqs),
      max_num_seqs=g.max_num_seqs,
      pages_per_seq=g.pages_per_seq,
      num_pages=g.num_pages,
      page_size=g.page_size,
      num_tokens=g.num_tokens,
      num_kv_heads=self.K,
      num_heads=self.N,
      head_dim=self.H,
      v_head_dim=self.Hv,
      sinks=(1.0 + rng.standard_normal(self.N)) if self.sinks else None,
    )
    if self.garbage and len(seqs) < g.max_num_seqs:
      cu = np.asarray(b.cu_q_lens).copy()
      n = len(seqs)
      cu[n + 1 :] = rng.integers(-3, g.num_tokens + 4, size=g.max_num_seqs - n)
      b = b.replace(cu_q_lens=np.asarray(cu, np.int32))
    return b

  def cotangent(self):
    rng = np.random.default_rng(self.seed + 1)
    return rng.standard_normal((self.geometry.num_tokens, self.N, self.Hv)).astype(np.float32)


@st.composite
def paged_seqs(draw, g: PagedGeometry, *, min_seqs: int = 0, nonempty: bool = False):
  """[(q_len, kv_len)] of up to max_num_seqs live slots with 0 <= q_len <= kv_len <= capacity, sum q_len <= T.

  `nonempty`: the first slot has a query row (hypothesis' first, simplest draw then still attends to something).
  """
  n = draw(st.integers(max(min_seqs, int(nonempty)), g.max_num_seqs))
  seqs, left = [], g.num_tokens
  for i in range(n):
    first = nonempty and i == 0
    kv = draw(st.integers(int(first), g.capacity))
    q = draw(st.integers(int(first), min(kv, left)))
    left -= q
    seqs.append((q, kv))
  return tuple(seqs)


@st.composite
def paged_draws(draw, *, geometries=PAGED_GEOMETRIES, batches=3, nonempty=False):
  g = draw(st.sampled_from(geometries))
  N, K = draw(st.sampled_from(HEAD_LAYOUTS))
  H = draw(st.sampled_from([2, 4]))
  block = draw(st.one_of(st.none(), st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2]))))
  return PagedDraw(
    geometry=g,
    batches=tuple(draw(paged_seqs(g, nonempty=nonempty)) for _ in range(batches)),
    N=N,
    K=K,
    H=H,
    Hv=draw(st.sampled_from([H, H + 1])),
    window=draw(windows),
    soft_cap=draw(soft_caps),
    scale=draw(scales),
    sinks=draw(st.booleans()),
    block=block,
    garbage=draw(st.booleans()),
    seed=draw(seeds),
  )
