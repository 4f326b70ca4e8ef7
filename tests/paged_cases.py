"""Shared paged test cases: ragged batches, named batch mixes, the jitted op / reference / oracle entry points, and
the paged feature cases drawn from the registry (tests/cases.py).

Every batch is built by `make_batch`: random q_lens / kv_lens per sequence, the pages of each live sequence drawn
without repetition from a shuffled pool (the unused slots of a page-table row hold random page ids), padding rows
at the end of q, and often fewer live sequences than max_num_seqs.  `scenario(name, rng)` names the batch mixes
(`SCENARIOS`).  Shapes are shared by most tests so the jitted op and reference compile once per configuration.

Features: paged attention is causal by construction, so of the registry's axes it takes the causal window
(jax.nn's `local_window_size`, (left, right): a token at position i sees keys in [i - left, i]), the soft cap and
scale, the head layout (make_batch's num_heads / num_kv_heads; the default is GQA 8:2), attention sinks (an
operand: `Batch.sinks`, differentiated with q and the pages) and v's head dim (MLA: make_batch's v_head_dim).
`features(case)` turns a registry case into the op's keywords, `case_batch(case, ...)` into a batch with the
case's heads, v head dim and sinks.

A helper module, not a test module: test_paged*.py import from here, never from each other.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from cases import Case, make_case, make_sinks
from paged_oracle import paged_oracle

import flax_ringattn as fr
from flax_ringattn._src.paged import common as fr_common

# -- geometry and the jitted entry points (each compiles once per static configuration) -------------------------

# Shared geometry: P pages of PS tokens, K kv heads (GQA 8:2), S slots of PPS pages, T rows.
P, PS, K, N, H = 40, 4, 2, 8, 16
S, PPS, T = 6, 6, 32
CAP = PPS * PS
SMALL = fr.BlockSizes(block_q=4, block_kv=8)  # several chunks per prefill, 3 kv blocks per sequence
F32, BF16 = jnp.float32, jnp.bfloat16

# The feature keywords (static under jit) that the op, the reference and the oracle share, then the op's own.
FEATURE_KEYWORDS = ("local_window_size", "logits_soft_cap", "scale")
_STATIC = (*FEATURE_KEYWORDS, "block_sizes", "implementation")


@functools.partial(jax.jit, static_argnames=_STATIC)
def op_fn(
  q,
  kp,
  vp,
  kv_lens,
  pi,
  cu,
  ns,
  k_scale=None,
  v_scale=None,
  local_window_size=None,
  logits_soft_cap=None,
  scale=None,
  block_sizes=SMALL,
  implementation=None,
  sinks=None,
):
  return fr.paged_attention(
    q,
    kp,
    vp,
    kv_lens,
    pi,
    cu,
    ns,
    k_scale=k_scale,
    v_scale=v_scale,
    local_window_size=local_window_size,
    logits_soft_cap=logits_soft_cap,
    scale=scale,
    block_sizes=block_sizes,
    implementation=implementation,
    sinks=sinks,
  )


@functools.partial(jax.jit, static_argnames=FEATURE_KEYWORDS)
def ref_fn(
  q,
  kp,
  vp,
  kv_lens,
  pi,
  cu,
  ns,
  k_scale=None,
  v_scale=None,
  local_window_size=None,
  logits_soft_cap=None,
  scale=None,
  sinks=None,
):
  return fr.paged_reference_attention(
    q,
    kp,
    vp,
    kv_lens,
    pi,
    cu,
    ns,
    k_scale=k_scale,
    v_scale=v_scale,
    local_window_size=local_window_size,
    logits_soft_cap=logits_soft_cap,
    scale=scale,
    sinks=sinks,
  )


def paged_vjp(f, args, do, sinks=None, **kw):
  """f's output and its cotangents (dq, dk_pages, dv_pages), with dsinks appended when `sinks` is given."""
  if sinks is None:
    out, pullback = jax.vjp(lambda q, kp, vp: f(q, kp, vp, *args[3:], **kw), *args[:3])
  else:
    out, pullback = jax.vjp(lambda q, kp, vp, s: f(q, kp, vp, *args[3:], sinks=s, **kw), *args[:3], sinks)
  return out, pullback(do)


@functools.partial(jax.jit, static_argnames=_STATIC)
def op_vjp(
  args,
  do,
  k_scale=None,
  v_scale=None,
  local_window_size=None,
  logits_soft_cap=None,
  scale=None,
  block_sizes=SMALL,
  implementation=None,
  sinks=None,
):
  kw = dict(k_scale=k_scale, v_scale=v_scale, local_window_size=local_window_size, logits_soft_cap=logits_soft_cap)
  kw.update(scale=scale, block_sizes=block_sizes, implementation=implementation)
  return paged_vjp(fr.paged_attention, args, do, sinks, **kw)


@functools.partial(jax.jit, static_argnames=FEATURE_KEYWORDS)
def ref_vjp(args, do, k_scale=None, v_scale=None, local_window_size=None, logits_soft_cap=None, scale=None, sinks=None):
  kw = dict(k_scale=k_scale, v_scale=v_scale, local_window_size=local_window_size, logits_soft_cap=logits_soft_cap)
  return paged_vjp(fr.paged_reference_attention, args, do, sinks, scale=scale, **kw)


# -- batches ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Batch:
  q: jax.Array
  k_pages: jax.Array
  v_pages: jax.Array
  kv_lens: jax.Array
  page_indices: jax.Array
  cu_q_lens: jax.Array
  num_seqs: jax.Array
  seqs: list  # (q_len, kv_len) of the live sequences
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  sinks: jax.Array | None = None  # [N] attention-sink logits

  @property
  def args(self):
    return (self.q, self.k_pages, self.v_pages, self.kv_lens, self.page_indices, self.cu_q_lens, self.num_seqs)

  @property
  def scales(self):
    return dict(k_scale=self.k_scale, v_scale=self.v_scale)

  @property
  def operands(self):
    """The keyword operands: the scales and the sinks."""
    return dict(self.scales, sinks=self.sinks)

  @property
  def out_shape(self):
    """[T, N, Hv]: the output's (and dO's) shape."""
    return (*self.q.shape[:2], fr_common.page_dims(self.q, self.k_pages, self.v_pages)[4])

  @property
  def total(self):
    return sum(ql for ql, _ in self.seqs)

  def read_mask(self):
    """[P, page_size] bool: the page slots some live sequence reads."""
    num_pages, ps = self.k_pages.shape[:2]
    table = np.asarray(self.page_indices)
    mask = np.zeros((num_pages, ps), bool)
    for i, (_, kv) in enumerate(self.seqs):
      for t in range(kv):
        p = table[i, t // ps]
        if 0 <= p < num_pages:
          mask[p, t % ps] = True
    return mask

  def replace(self, **kw):
    return dataclasses.replace(self, **kw)


def make_batch(
  rng,
  seqs,
  *,
  max_num_seqs=S,
  pages_per_seq=PPS,
  num_pages=P,
  page_size=PS,
  num_tokens=T,
  num_kv_heads=K,
  num_heads=N,
  head_dim=H,
  v_head_dim=None,
  dtype=F32,
  page_dtype=None,
  scale_shape=None,
  share_prefix=False,
  exclude_pages=(),
  sinks=None,
):
  """A ragged batch whose live sequences are `seqs` = [(q_len, kv_len), ...]; v pages at `v_head_dim` (None:
  head_dim), and `sinks` ([num_heads] logits or None) carried along."""
  n = len(seqs)
  assert n <= max_num_seqs and sum(q for q, _ in seqs) <= num_tokens
  assert all(0 <= q <= kv <= pages_per_seq * page_size for q, kv in seqs)
  pool = [int(p) for p in rng.permutation(num_pages) if p not in exclude_pages]
  # Unused entries (past a sequence's pages, rows of dead slots) are random ids.
  table = rng.integers(0, num_pages, size=(max_num_seqs, pages_per_seq))
  for i, (_, kv) in enumerate(seqs):
    used = -(-kv // page_size)
    table[i, :used] = pool[:used]
    del pool[:used]
  if share_prefix and n >= 2:
    shared = min(-(-seqs[0][1] // page_size), -(-seqs[1][1] // page_size)) - 1
    table[1, :shared] = table[0, :shared]
  kv_lens = rng.integers(0, pages_per_seq * page_size + 1, size=max_num_seqs)  # garbage for dead slots
  kv_lens[:n] = [kv for _, kv in seqs]
  cu = np.zeros(max_num_seqs + 1, np.int64)
  cu[1 : n + 1] = np.cumsum([q for q, _ in seqs])
  cu[n + 1 :] = cu[n]
  v_head_dim = head_dim if v_head_dim is None else v_head_dim
  shapes = [(num_pages, page_size, num_kv_heads, h) for h in (head_dim, v_head_dim)]
  page_dtype = dtype if page_dtype is None else page_dtype
  if jnp.dtype(page_dtype) == jnp.int8:
    pages = [jnp.asarray(rng.integers(-127, 128, size=shape), jnp.int8) for shape in shapes]
  elif jnp.issubdtype(page_dtype, jnp.floating) and jnp.dtype(page_dtype).itemsize == 1:
    pages = [jnp.asarray(rng.normal(size=shape) * 40, F32).astype(page_dtype) for shape in shapes]
  else:
    pages = [jnp.asarray(rng.normal(size=shape), page_dtype) for shape in shapes]
  scales = [None, None]
  if scale_shape is not None:  # one name for both, or a (k, v) pair of names
    full = {"scalar": (), "page": (num_pages, num_kv_heads), "token": (num_pages, page_size, num_kv_heads)}
    names = (scale_shape, scale_shape) if isinstance(scale_shape, str) else scale_shape
    scales = [jnp.asarray(rng.uniform(0.005, 0.03, size=full[name]), F32) for name in names]
  return Batch(
    q=jnp.asarray(rng.normal(size=(num_tokens, num_heads, head_dim)), dtype),  # padding rows too
    k_pages=pages[0],
    v_pages=pages[1],
    kv_lens=jnp.asarray(kv_lens, jnp.int32),
    page_indices=jnp.asarray(table, jnp.int32),
    cu_q_lens=jnp.asarray(cu, jnp.int32),
    num_seqs=jnp.asarray([n], jnp.int32),
    seqs=list(seqs),
    k_scale=scales[0],
    v_scale=scales[1],
    sinks=None if sinks is None else jnp.asarray(sinks, F32),
  )


def random_seq(rng, kind, cap=CAP):
  if kind == "decode":
    return 1, int(rng.integers(1, cap + 1))
  if kind == "prefill":
    q = int(rng.integers(1, 6))
    return q, q
  if kind == "chunked":  # q_len < kv_len: a chunk of a prefill after a cached history
    q = int(rng.integers(2, 6))
    return q, int(rng.integers(q + 1, cap + 1))
  raise ValueError(kind)


def scenario(name, rng):
  """(q_len, kv_len) of the live sequences of a named batch mix."""
  if name == "decode":
    return [random_seq(rng, "decode") for _ in range(S)]
  if name == "prefill":  # long prompts: several q chunks and kv blocks each
    return [(q, q) for q in rng.integers(3, 11, size=3).tolist()]
  if name == "chunked":
    return [random_seq(rng, "chunked") for _ in range(S)]
  if name == "mixed":
    return [random_seq(rng, kind) for kind in rng.choice(["decode", "prefill", "chunked"], size=S)]
  if name == "edge":
    # q_len 0 with a history; an empty sequence; q_len 1 = kv_len 1; exactly full
    # pages; a partial last page; a sequence filling all its pages.
    return [(0, 7), (0, 0), (1, 1), (4, 8), (3, 10), (6, CAP)]
  if name == "few":  # num_seqs < max_num_seqs
    return [random_seq(rng, kind) for kind in rng.choice(["decode", "prefill", "chunked"], size=2)]
  if name == "none":  # num_seqs = 0: all rows are padding
    return []
  raise ValueError(name)


SCENARIOS = ["decode", "prefill", "chunked", "mixed", "edge", "few", "none"]


def numpy_oracle(b: Batch, **kw):
  """The independent float64 oracle's output (`paged_oracle.py`; gradients: test_paged_oracle.py)."""
  return paged_oracle(*b.args, **b.operands, **kw)[0]


def slot_mask(b: Batch, mask):
  """A [P, page_size] mask broadcast against the batch's pages ([P, page_size, K, h], or merged [P, page_size, K * h])."""
  return mask.reshape(mask.shape + (1,) * (b.k_pages.ndim - 2))


def merged(b: Batch) -> Batch:
  """The batch with its pages merged: [P, page_size, K * h], a token's kv heads side by side (the same values)."""
  return b.replace(**{n: getattr(b, n).reshape(*getattr(b, n).shape[:2], -1) for n in ("k_pages", "v_pages")})


def kv_pages_args(args: tuple) -> tuple:
  """A batch's `args` (q, k_pages, v_pages, ...) with merged K and V pages as kv pages: k_pages
  [P, 2, page_size, K * H] (a page's K, then its V), v_pages None (`PagedKVCache.create(merged="kv")`)."""
  q, k_pages, v_pages, *rest = args
  return (q, jnp.stack([k_pages, v_pages], axis=1), None, *rest)


def poison(b: Batch, value=np.nan):
  """The batch with every page slot no live sequence reads (foreign pages, tails past kv_lens) set to `value`."""
  unread = slot_mask(b, ~b.read_mask())
  fill = lambda x: jnp.where(unread, jnp.asarray(value, x.dtype), x)  # noqa: E731
  return b.replace(k_pages=fill(b.k_pages), v_pages=fill(b.v_pages))


# -- features ----------------------------------------------------------------------------------------------------


def features(case: Case) -> dict:
  """The paged keywords (`FEATURE_KEYWORDS`) of a registry case: its causal window, soft cap and scale (its sinks
  and v head dim are the batch's: `case_batch`).  A case the paged op cannot express (not causal, segments, cross
  lengths, dropout) is an error; zigzag (`load_balance`) is a ring layout with no paged meaning, so ignored."""
  if not case.is_causal or case.segments or case.S != case.T or case.dropout is not None:
    raise ValueError(f"paged attention is causal self attention without segments or dropout: {case}")
  return dict(local_window_size=case.window, logits_soft_cap=case.soft_cap, scale=case.scale)


def case_heads(case: Case) -> dict:
  """make_batch's head keywords of a registry case: N, K, H and v's head dim."""
  return dict(num_heads=case.N, num_kv_heads=case.K, head_dim=case.H, v_head_dim=case.Hv)


def case_batch(case: Case, rng, seqs, *, seed=0, **geometry) -> Batch:
  """A batch of `seqs` in `geometry` (make_batch's keywords) with the case's heads, v head dim and sinks
  (`make_sinks`, drawn with `seed`)."""
  return make_batch(rng, seqs, **{**geometry, **case_heads(case)}, sinks=make_sinks(case, seed))


# The paged suites' window + soft cap case (op, reference, numpy oracle and the Pallas kernel): a 5-token window
# (the token and the 4 before it) at a small scale.
WINDOW_CAP = make_case("window_cap", "causal_window", window=(4, 0), soft_cap=3.0, scale=0.5)
