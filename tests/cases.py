"""Shared test cases: one registry of attention feature axes, and the builders every matrix uses.

A `Case` is one point of the feature space.  Its axes, each defined once here:

* mask (`MASKS`): none, causal, a (left, right) window (jax.nn's `local_window_size`), causal + window,
  packed-document segments, cross attention (S != T), and fully-masked rows (q segment ids absent from kv);
* head layout (`HEADS`, `kv_heads`): MHA (K = N), GQA (N / K q heads per kv head), MQA (K = 1);
* dropout (`DROPOUT`): off, per head, or broadcast over heads (`Dropout`: rate and key seed);
* soft cap (`Case.soft_cap`, with `Case.scale`);
* dtype (`DTYPES`): each matrix chooses its dtypes per case, so a dtype is a matrix axis, not a `Case` field;
* attention sinks (`Case.sinks`): one learned logit per q head joins every row's softmax (gpt-oss), drawn by
  `make_sinks`; the op runs differentiated in them too (`with_sinks`), and the reference's dsinks is checked;
* v head dim (`Case.Hv`): v's head dim when it differs from q/k's `H` (MLA: qk 24, v 16 at test sizes).

The matrices pick the subsets they need: the ring backends suite runs `CASES` (test_ring_attention.py), the
strategies a subset of it (test_strategies.py), the dropout tests `DROPOUT` through
`assert_dropout_matches_reference` (test_dropout.py, test_pallas_gpu.py), the in-kernel ring its ring-size cases
built with `make_case` (test_pallas_tpu_ring.py), and the paged suite the causal masks, soft cap and head layouts
(paged_cases.py).  Test modules import from here (and paged_cases.py), never from each other.

This is a helper module, not a test module: pytest collects nothing from it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import flax_ringattn as fr

# -- the axes ------------------------------------------------------------------------------------------------

# Mask kinds: the `Case` fields each one sets.  Window sizes are the ring suite's (64-token sequences); a matrix
# with other lengths overrides `window` and keeps the kind.
MASKS = {
  "none": {},
  "causal": dict(is_causal=True),
  "window": dict(window=(6, 3)),  # two-sided, not causal
  "causal_window": dict(is_causal=True, window=(9, 0)),
  "segments": dict(is_causal=True, segments="self"),  # packed documents
  "cross": dict(S=32),  # cross attention: kv shorter than q
  "cross_causal": dict(S=32, is_causal=True),
  # q segment ids 0..3 against kv ids 0..2: queries of document 3 see no key (output and dq exactly 0).
  "empty_rows": dict(S=32, segments="cross", window=(4, 4)),
}

HEADS = ("mha", "gqa", "mqa")


def kv_heads(layout: str, N: int, group: int = 4) -> int:
  """K for N q heads in a head layout: MHA K = N, GQA `group` q heads per kv head, MQA K = 1."""
  if layout == "mha":
    return N
  if layout == "gqa":
    assert N % group == 0 and group > 1, (N, group)
    return N // group
  if layout == "mqa":
    return 1
  raise ValueError(f"unknown head layout {layout!r}; choose one of {HEADS}")


RATE = 0.25  # the dropout tests' rate


@dataclasses.dataclass(frozen=True)
class Dropout:
  """Attention dropout of a case: rate, one keep mask per head or one `broadcast` over heads, and the key's seed
  (`jax.random.key(seed)`, the same for the op and the reference)."""

  rate: float = RATE
  broadcast: bool = False
  seed: int = 0


DROPOUT = {"off": None, "per-head": Dropout(), "broadcast": Dropout(broadcast=True)}


def dropout(kind: str, seed: int = 0, *, rate: float = RATE) -> Dropout | None:
  """The `DROPOUT` axis value `kind` ("off", "per-head", "broadcast") with its key's seed (and a rate)."""
  d = DROPOUT[kind]
  return None if d is None else dataclasses.replace(d, seed=seed, rate=rate)


DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def dtype_id(dtype) -> str:
  """The dtype's part of a test id: "f32" or "bf16"."""
  return jnp.dtype(dtype).name.replace("float", "f")


# -- a case --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
  """One point of the feature space at a shape: q [B, T, N, H], k/v [B, S, K, H]."""

  name: str
  B: int = 2
  N: int = 4
  K: int = 4
  T: int = 64
  S: int = 64
  H: int = 16
  is_causal: bool = False
  load_balance: bool = False  # zigzag layout over the ring
  window: tuple[int, int] | None = None  # (left, right), jax.nn's local_window_size
  soft_cap: float | None = None
  segments: str | None = None  # None | "self" (packed docs) | "cross" (q ids absent from kv -> empty rows)
  scale: float | None = None
  dropout: Dropout | None = None
  sinks: bool = False  # attention sinks: `make_sinks` draws the [N] logits, differentiated with q, k and v
  Hv: int | None = None  # v's head dim when it differs from H (MLA); None: H

  @property
  def v_dim(self) -> int:
    """v's (and the output's) head dim."""
    return self.H if self.Hv is None else self.Hv

  @property
  def heads(self) -> str:
    """The head layout: "mha", "gqa" or "mqa"."""
    return "mha" if self.N == self.K else "mqa" if self.K == 1 else "gqa"

  @property
  def mask(self) -> str:
    """The mask kind (a key of `MASKS`) of the case's mask fields, whatever its window sizes and lengths."""
    if self.segments == "cross":
      return "empty_rows"
    if self.segments == "self":
      return "segments"
    if self.S != self.T:
      return "cross_causal" if self.is_causal else "cross"
    if self.window is not None:
      return "causal_window" if self.is_causal else "window"
    return "causal" if self.is_causal else "none"

  def options(self) -> dict:
    """The mask, scale and dropout keywords of `ring_attention` and `fr.reference_attention` for this case (the
    sinks are an operand: `make_sinks`)."""
    opts = dict(
      is_causal=self.is_causal, local_window_size=self.window, logits_soft_cap=self.soft_cap, scale=self.scale
    )
    if self.dropout is not None:
      opts.update(
        dropout_rate=self.dropout.rate,
        dropout_rng=jax.random.key(self.dropout.seed),
        broadcast_dropout=self.dropout.broadcast,
      )
    return opts


def make_case(name: str, mask: str = "none", heads: str = "mha", *, N: int = 4, group: int = 4, **fields) -> Case:
  """A `Case` from the axes: the mask kind's fields, N q heads in the head layout (GQA: `group` q heads per kv
  head), then `fields` (shape, window sizes, load_balance, soft cap, scale, dropout) on top.  A T without an S
  sets both, unless the mask kind is a cross-attention one."""
  base = {**MASKS[mask], "N": N, "K": kv_heads(heads, N, group)}
  if "T" in fields and "S" not in fields and "S" not in base:
    base["S"] = fields["T"]
  return Case(name, **{**base, **fields})


# -- named cases ---------------------------------------------------------------------------------------------

# The ring backends suite (test_ring_attention.py): every backend runs these (or the subset it names); the
# strategies' matrix is a subset (test_strategies.py).  Names are test ids: keep them.
CASES = [
  make_case("plain"),
  make_case("causal", "causal"),
  make_case("causal_lb", "causal", load_balance=True),
  make_case("gqa", "causal", "gqa", N=8),
  make_case("mqa", "causal", "mqa", N=8, load_balance=True),
  make_case("segments", "segments"),
  make_case("segments_lb", "segments", load_balance=True),
  make_case("window", "window"),
  make_case("causal_window_lb", "causal_window", load_balance=True),
  make_case("soft_cap", "causal", soft_cap=2.0, scale=1.0),
  make_case("cross", "cross", "gqa", N=8),
  make_case("cross_causal_lb", "cross_causal", load_balance=True),
  make_case("empty_rows", "empty_rows"),
  # Attention sinks (gpt-oss: windowed layers alternate with full ones, GQA) and MLA head shapes (DeepSeek: qk
  # 192, v 128; 24 and 16 here).
  make_case("sinks_causal", "causal", sinks=True),
  make_case("sinks_window_cap", "causal_window", sinks=True, soft_cap=2.0, scale=1.0),
  make_case("sinks_segments_lb", "segments", sinks=True, load_balance=True),
  make_case("sinks_gqa", "causal", "gqa", N=8, sinks=True, load_balance=True),
  make_case("sinks_empty_rows", "empty_rows", sinks=True),
  make_case("mla_gqa", "causal", "gqa", N=8, H=24, Hv=16, load_balance=True),
  make_case("mla_mha", "window", H=24, Hv=16),
  make_case("mla_sinks", "causal_window", "gqa", N=8, H=24, Hv=16, sinks=True),
]
SINKS = tuple(c.name for c in CASES if c.sinks)
MLA = tuple(c.name for c in CASES if c.Hv is not None)
CASE_NAMES = tuple(c.name for c in CASES)


def case_names(*selected: str) -> frozenset[str]:
  """A set of `CASES` names for a matrix to select by; a name not in the registry is an error (a typo must not
  silently drop a case from a matrix)."""
  unknown = set(selected) - set(CASE_NAMES)
  if unknown:
    raise KeyError(f"no case named {sorted(unknown)} in tests/cases.py (CASES: {CASE_NAMES})")
  return frozenset(selected)


def pick(*selected: str) -> list[Case]:
  """The `CASES` of these names, in registry order."""
  chosen = case_names(*selected)
  return [c for c in CASES if c.name in chosen]


# Single cases several modules run (the ring op and every strategy): GQA 4:1 with one mask feature each.
GQA_SEGMENTS = make_case("sm", "segments", "gqa", N=8)  # inside a user's shard_map
GQA_SEGMENTS_LB = make_case("det", "segments", "gqa", N=8, load_balance=True)  # determinism, bf16 strategies
GQA_CAUSAL_LB = make_case("3d", "causal", "gqa", N=8, load_balance=True)  # batch, sequence and head axes at once
GQA_CAUSAL_WINDOW = make_case("one", "causal_window", "gqa", N=8, window=(7, 0))  # one device, no mesh


# -- builders ------------------------------------------------------------------------------------------------


def make_inputs(case: Case, dtype, seed=0):
  """(q, k, v, do, segment_ids) for a case, normal in float32 then cast to dtype; segment_ids None, [B, T]
  (packed documents of random lengths) or a (q_ids [B, T], kv_ids [B, S]) pair (rows left empty).  v and do
  have the case's v head dim; the sinks come from `make_sinks`."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 6)
  B, H = case.B, case.H
  q = jax.random.normal(keys[0], (B, case.T, case.N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (B, case.S, case.K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (B, case.S, case.K, case.v_dim), jnp.float32).astype(dtype)
  do = jax.random.normal(keys[3], (B, case.T, case.N, case.v_dim), jnp.float32).astype(dtype)
  seg = None
  if case.segments == "self":
    # Packed documents of random lengths: sorted ids, so whole tiles and hops skip.
    cuts = jnp.sort(jax.random.randint(keys[4], (B, 3), 1, case.T), axis=1)
    seg = (jnp.arange(case.T)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(jnp.int32)
  elif case.segments == "cross":
    # q ids 0..3, kv ids 0..2: queries of document 3 see no key at all.
    q_ids = jax.random.randint(keys[4], (B, case.T), 0, 4)
    kv_ids = jax.random.randint(keys[5], (B, case.S), 0, 3)
    seg = (q_ids, kv_ids)
  return q, k, v, do, seg


def make_sinks(case: Case, seed: int = 0):
  """The case's [N] float32 sink logits, or None without sinks.  Centred near a row's log-sum-exp at these
  sizes (about 3 to 5), so a sink takes a real share of each row: a sink applied twice, or not at all, moves
  every output well past the tolerances."""
  if not case.sinks:
    return None
  return 3.0 + jax.random.normal(jax.random.PRNGKey(1000 + seed), (case.N,), jnp.float32)


def with_sinks(f, sinks):
  """`f(q, k, v, sinks=...)` as a function of (q, k, v) or, with sinks, of (q, k, v, sinks): what a matrix
  hands `jax.vjp` so that dsinks is checked with the other gradients."""
  if sinks is None:
    return f, ()
  return (lambda q, k, v, s: f(q, k, v, sinks=s)), (sinks,)


@functools.partial(jax.jit, static_argnames="options")  # compiled once per shape and options in a worker
def _reference_run(q, k, v, do, seg, dropout_rng, sinks, options):
  f = lambda q, k, v, sinks=None: fr.reference_attention(  # noqa: E731
    q, k, v, segment_ids=seg, dropout_rng=dropout_rng, sinks=sinks, **dict(options)
  )
  f, extra = with_sinks(f, sinks)
  out, vjp = jax.vjp(f, q, k, v, *extra)
  return out, vjp(do)


def reference_with_grads(case: Case, q, k, v, do, seg, sinks=None):
  """`fr.reference_attention` of the case on natural-order inputs: (out, (dq, dk, dv)), with dsinks appended
  when `sinks` is given."""
  opts = case.options()
  rng = opts.pop("dropout_rng", None)
  return _reference_run(q, k, v, do, seg, rng, sinks, tuple(sorted(opts.items())))


def oracle_with_grads(case: Case, q, k, v, do, seg, sinks=None):
  """The float64 numpy oracle (tests/dense_oracle.py, no library code) of the case on natural-order inputs:
  (out, (dq, dk, dv[, dsinks])) as float64 numpy arrays.  No dropout."""
  from dense_oracle import dense_oracle

  assert case.dropout is None, case
  return dense_oracle(
    q,
    k,
    v,
    do=do,
    is_causal=case.is_causal,
    local_window_size=case.window,
    segment_ids=seg,
    logits_soft_cap=case.soft_cap,
    scale=case.scale,
    sinks=sinks,
  )


def assert_dropout_matches_reference(mesh, axis_name, n, case: Case, *, doc_len: int, seed: int = 0, **opts):
  """The case (causal, with dropout, self attention) over two packed documents of doc_len and T - doc_len tokens,
  through `ring_attention(**opts)` on `mesh` (zigzag over the n sequence shards with `case.load_balance`):
  forward and q/k/v gradients against the reference with the same dropout key.

  Inputs are this builder's own (`jax.random.key(seed)`, q/k/v only; the cotangent is assert_matches_reference's),
  not `make_inputs`'s."""
  from flax_ringattn.testing import assert_matches_reference

  assert case.dropout is not None and case.is_causal and case.S == case.T and case.segments == "self", case
  B, T, N, K, H = case.B, case.T, case.N, case.K, case.H
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (B, T, N, H))
  k, v = (jax.random.normal(x, (B, T, K, H)) for x in ks[1:])
  seg = jnp.concatenate([jnp.zeros((B, doc_len), jnp.int32), jnp.ones((B, T - doc_len), jnp.int32)], axis=1)
  kw = case.options()
  ref_kw = {}
  if case.load_balance:
    q, k, v, seg = (fr.zigzag_order(x, n, axis=1) for x in (q, k, v, seg))
    pos = fr.zigzag_positions(T, n)
    ref_kw = dict(q_positions=pos, kv_positions=pos)

  def attn(q, k, v):
    return fr.ring_attention(
      q, k, v, mesh=mesh, axis_name=axis_name, segment_ids=seg, load_balance=case.load_balance, **opts, **kw
    )

  assert_matches_reference(jax.jit(attn), q, k, v, segment_ids=seg, **ref_kw, **kw)


# -- the Pallas TPU block forward's output dtype ---------------------------------------------------------------


def assert_block_output_is_the_cast(*, interpret, T: int = 256):
  """The Pallas TPU block forward asked for a bfloat16 o (the block contract's `out_dtype`, as a ring of one
  asks) gives bit for bit its float32 o cast to bfloat16, token-major (N = 8, heads of 128; compiled, o is stored
  through 32-bit words, two heads per word: with 4 heads per kv head both halves at one grid step, with 1 each
  half at its own) and heads-major (N = 4), causal over 2 x 2 tiles.  `interpret`: None compiled (the chip tier),
  else the interpret mode, which stores directly (the 32-bit-word path runs compiled only)."""
  from flax_ringattn._src import masks
  from flax_ringattn._src.backends.base import AttentionSpec
  from flax_ringattn._src.backends.pallas_tpu import common
  from flax_ringattn._src.backends.pallas_tpu.block.forward import block_fwd

  spec = AttentionSpec(
    mask=masks.MaskSpec(is_causal=True), scale=0.125, block_sizes=fr.BlockSizes(block_q=T // 2, block_kv=T // 2)
  )
  tok = masks.Tokens(jnp.arange(T, dtype=jnp.int32))
  for N, K, token_major in ((8, 2, True), (8, 8, True), (4, 4, False)):
    assert common.token_major_forward(N, T // 2, (128, 128)) == token_major, (N, K)
    keys = jax.random.split(jax.random.key(N), 3)
    q, k, v = (jax.random.normal(key, (2, T, n, 128), jnp.bfloat16) for key, n in zip(keys, (N, K, K), strict=True))
    fwd = jax.jit(
      lambda q, k, v, dtype: block_fwd(q, k, v, tok, tok, spec=spec, interpret=interpret, out_dtype=dtype),
      static_argnums=3,
    )
    (o32, lse32), (o16, lse16) = fwd(q, k, v, None), fwd(q, k, v, jnp.bfloat16)
    assert o32.dtype == jnp.float32 and o16.dtype == jnp.bfloat16, (o32.dtype, o16.dtype)
    np.testing.assert_array_equal(np.asarray(o16.astype(jnp.float32)), np.asarray(o32.astype(jnp.bfloat16), np.float32))
    np.testing.assert_array_equal(np.asarray(lse16), np.asarray(lse32))
