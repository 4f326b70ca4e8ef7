"""`fr.ServingEngine` over `convert(model, to="paged")`: unedited models served from paged caches, equal to their
own greedy decoding by full recompute.

Look-alike decoders (`serving_models.py`): Gemma style (hand-written, window from constant bands, soft cap,
qk-norm), Llama/Qwen style (hand-written, the model's mask), and `nnx.MultiHeadAttention` blocks.  The engines
are built once per module (each compiles its step once) and the tests read the lifetime stats as differences.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import serving_models as sm
from conftest import make_mesh
from flax import nnx

import flax_ringattn as fr
from flax_ringattn._src.serving.scheduler import Sequence

GEOMETRY = dict(num_pages=16, page_size=4, max_num_seqs=2, pages_per_seq=8, max_num_batched_tokens=12)
MAX_NEW = 6


def _prompts(seed, lens):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(1, sm.VOCAB, n)] for n in lens]


# More prompts than the 2 slots; 14 and 17 tokens do not fit one step of 12 rows: chunked prefill.
PROMPTS = _prompts(0, (5, 14, 9, 3, 17))


class Served:
  def __init__(self, family):
    self.reference = sm.FAMILIES[family]()
    self.model = sm.FAMILIES[family]()
    self.report = fr.convert(self.model, to="paged")
    self.engine = fr.ServingEngine(self.model, call=sm.engine_call, **GEOMETRY)

  def want(self, prompts, max_new=MAX_NEW):
    return _want(self.reference, prompts, max_new)


def _want(reference, prompts, max_new):
  """The reference's greedy outputs, with no near tie on the way (else the comparison could flip on rounding)."""
  outs = [sm.greedy(reference, p, max_new) for p in prompts]
  margins = [m for _, ms in outs for m in ms]
  assert min(margins) > 1e-4, f"a near tie in the reference decoding (margin {min(margins):.2e}): pick other prompts"
  return [o for o, _ in outs]


@pytest.fixture(scope="module", params=sorted(sm.FAMILIES))
def served(request):
  return Served(request.param)


@pytest.fixture(scope="module")
def llama():
  return Served("llama")


def test_engine_equals_full_recompute(served):
  steps = served.engine.stats.steps
  got = served.engine.generate(PROMPTS, max_new_tokens=MAX_NEW)
  assert got == served.want(PROMPTS)
  # Chunked prefill and continuous batching: 5 prompts through 2 slots, at most 12 rows a step.
  assert served.engine.stats.steps - steps > MAX_NEW * len(PROMPTS) / GEOMETRY["max_num_seqs"]
  kinds = {s.details.get("paged") for s in served.report.converted}
  assert served.report.replaced or kinds == {True}


def test_report_lists_the_paged_sites_and_says_the_mask_is_not_used(llama):
  text = str(llama.report)
  assert len(llama.report.converted) == 2
  assert "not used: each sequence causal over its own paged cache" in text


def test_window_band_from_constants_keeps_its_causal_side():
  served = Served("gemma")
  site = served.report.converted[0]
  assert site.details["window"] == (5, 5) and site.details["soft_cap"] == 5.0
  assert "its causal side in serving" in str(site)


def test_a_second_generate_compiles_nothing_new(llama):
  llama.engine.generate(PROMPTS[:2], max_new_tokens=2)
  compiles, stats = llama.engine.stats.compiles, llama.engine.stats
  generated, compile_seconds, seconds = stats.generated_tokens, stats.compile_seconds, stats.seconds
  assert 0 < compile_seconds < seconds  # the first steps compiled (inside generate's wall time)
  got = llama.engine.generate(_prompts(1, (7, 2, 11)), max_new_tokens=3)
  assert stats.compiles == compiles
  assert stats.compile_seconds == compile_seconds and stats.seconds > seconds  # no compile: no compile time
  assert stats.generated_tokens - generated == sum(map(len, got)) == 9
  assert 0 < stats.step_seconds < stats.seconds  # the step calls, inside generate; the rest is the host's


def test_the_step_program_compiles_once(caplog):
  """A fresh engine's step program compiles once in its first generate and never again, for a model whose weights
  are committed to a device (as a restored checkpoint's are): the caches are committed before the first step, as
  that step's outputs are.  Fresh caches were uncommitted, so the second step compiled the program again, with no
  new trace, and `stats.compiles` did not count it."""
  served = Served("mha")  # converted nnx.MultiHeadAttention layers: `init_cache` makes uncommitted arrays
  weights = nnx.state(served.model, nnx.Param)
  nnx.update(served.model, jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]), weights))
  engine = served.engine

  def step_compiles(prompts, max_new):
    caplog.clear()
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
      engine.generate(prompts, max_new_tokens=max_new)
    return sum("Compiling jit(_step_fn)" in r.getMessage() for r in caplog.records)

  assert step_compiles(PROMPTS[:3], 3) == 1  # several steps: prefill chunks, then decodes
  assert engine.stats.steps > 3
  assert step_compiles(PROMPTS[3:], 2) == 0


def test_stream_yields_tokens_as_produced(llama):
  pairs = list(llama.engine.stream(PROMPTS[:3], max_new_tokens=3))
  by_prompt = [[t for i, t in pairs if i == k] for k in range(3)]
  assert by_prompt == llama.engine.generate(PROMPTS[:3], max_new_tokens=3)


def test_sampling_is_reproducible_and_top_k_1_is_greedy(llama):
  engine = llama.engine
  a = engine.generate(PROMPTS, max_new_tokens=4, temperature=1.0, seed=3)
  assert engine.generate(PROMPTS, max_new_tokens=4, temperature=1.0, seed=3) == a
  assert engine.generate(PROMPTS, max_new_tokens=4, temperature=1.0, seed=4) != a
  # Each token draws from its own key (seed, prompt index, token index): the same output whatever shares the
  # step, and with a draft (speculative sampling verifies each row against the token its key draws).
  assert engine.generate(PROMPTS[:3], max_new_tokens=4, temperature=1.0, seed=3) == a[:3]
  assert engine.generate(PROMPTS, max_new_tokens=4, temperature=1.0, seed=3, draft=fr.NGramDraft(1, 3)) == a
  greedy = engine.generate(PROMPTS, max_new_tokens=4)
  assert engine.generate(PROMPTS, max_new_tokens=4, temperature=1.0, top_k=1, seed=9) == greedy
  assert engine.generate(PROMPTS, max_new_tokens=4, temperature=0.7, top_p=1e-6, seed=9) == greedy


def test_stop_tokens_end_a_prompt_after_the_token(llama):
  full = llama.engine.generate(PROMPTS, max_new_tokens=MAX_NEW)
  stop = full[0][2]
  got = llama.engine.generate(PROMPTS, max_new_tokens=MAX_NEW, stop_tokens=(stop,))
  for g, f in zip(got, full, strict=True):
    cut = f.index(stop) + 1 if stop in f else len(f)
    assert g == f[:cut]


def test_prefix_reuse_shares_whole_pages_of_prompts_admitted_together():
  served = Served("llama")
  engine = fr.ServingEngine(served.model, call=sm.engine_call, **(GEOMETRY | dict(max_num_seqs=3, num_pages=24)))
  head = _prompts(5, (9,))[0]  # two whole pages of 4 and one token
  tails = _prompts(6, (3, 5, 2))
  prompts = [head + t for t in tails]
  before = engine.stats.prefill_tokens_computed
  got = engine.generate(prompts, max_new_tokens=4)
  assert got == served.want(prompts, 4)
  stats = engine.stats
  # The first computes the 8 shared tokens; the other two wait for them and share (no recompute).
  assert stats.shared_prefix_tokens == 16
  assert stats.prefill_tokens_computed - before == sum(map(len, prompts)) - 16
  assert stats.prompt_tokens == sum(map(len, prompts))


class _WrongDraft:
  """Proposes tokens the model never chooses first: every proposal is rejected and rolled back."""

  def propose(self, contexts, max_tokens):
    return [[(c[-1] + 1) % sm.VOCAB] * min(3, m) for c, m in zip(contexts, max_tokens, strict=True)]


def test_speculative_decoding_is_exact_and_takes_fewer_steps(llama):
  engine, stats = llama.engine, llama.engine.stats
  repetitive = [[3, 4, 5, 3, 4, 5, 3, 4], [7, 1, 7, 1, 7, 1], PROMPTS[0]]
  steps = stats.steps
  want = engine.generate(repetitive, max_new_tokens=8)
  plain = stats.steps - steps
  steps, accepted = stats.steps, stats.draft_accepted
  assert engine.generate(repetitive, max_new_tokens=8, draft=fr.NGramDraft(n=2, k=4)) == want
  assert stats.draft_accepted > accepted and stats.steps - steps < plain
  # Rejected proposals: their K/V are rolled back out of the cache, the output unchanged.
  proposed, accepted = stats.draft_proposed, stats.draft_accepted
  assert engine.generate(repetitive, max_new_tokens=8, draft=_WrongDraft()) == want
  assert stats.draft_proposed - proposed > stats.draft_accepted - accepted
  assert want == llama.want(repetitive, 8)


def test_decode_stats_count_the_pure_decode_steps_alone(llama, monkeypatch):
  """`stats.decode_*` count the steps whose every row is one new token of a sequence past its prompt.  Prompts of 5
  and 14 tokens through steps of 12 rows: a prefill step (5 + 7 tokens), a mixed one (the first prompt's decode
  beside the second's last 7), then decodes of both and, last, of the second alone.  A run to one new token decodes
  nothing, nor does a step with a draft's proposals."""
  engine, stats = llama.engine, llama.engine.stats
  seen = []  # each step's (decodes, sequences, rows)
  step = engine.start_step

  def spy(tokens, positions, cu_q_lens, row_ids, options, *, decodes=0, after=None):
    lens = np.diff(cu_q_lens)
    seen.append((decodes, int(np.count_nonzero(lens)), int(lens.sum())))
    return step(tokens, positions, cu_q_lens, row_ids, options, decodes=decodes, after=after)

  monkeypatch.setattr(engine, "start_step", spy)
  counters = lambda: (stats.decode_steps, stats.decode_tokens, stats.decode_seconds)  # noqa: E731
  before = counters()
  engine.generate(PROMPTS[:2], max_new_tokens=1)
  assert counters() == before and len(seen) == 2 and not any(d for d, _, _ in seen)
  seen.clear()
  engine.generate(PROMPTS[:2], max_new_tokens=MAX_NEW)
  assert [d for d, _, _ in seen] == [0, 0, 2, 2, 2, 2, 1], seen
  assert all(rows == n for d, n, rows in seen if d), seen  # one row per sequence
  steps, tokens, seconds = (a - b for a, b in zip(counters(), before, strict=True))
  assert (steps, tokens) == (5, sum(d for d, _, _ in seen)) and tokens / steps <= 2 and seconds > 0
  assert (
    stats.as_dict()["decode_tokens_per_s"] == stats.decode_tokens_per_s == stats.decode_tokens / stats.decode_seconds
  )
  seen.clear()
  engine.generate(PROMPTS[:2], max_new_tokens=MAX_NEW, draft=_WrongDraft())
  assert any(rows > n for _, n, rows in seen) and not any(d for d, n, rows in seen if rows > n), seen


def test_a_prompt_that_cannot_fit_raises_before_any_step(llama):
  steps = llama.engine.stats.steps
  with pytest.raises(fr.CacheOverflowError, match=r"prompt 1 can never fit a slot: its 30 tokens"):
    llama.engine.generate([[1, 2], [1] * 30], max_new_tokens=4)
  with pytest.raises(ValueError, match=r"prompt 0 is empty"):
    llama.engine.generate([[], [1]], max_new_tokens=4)
  with pytest.raises(ValueError, match=r"token ids outside \[0, 32\)"):
    llama.engine.generate([[1, 99]], max_new_tokens=4)
  assert llama.engine.stats.steps == steps


def test_engine_needs_a_converted_model_and_layers_need_a_step():
  with pytest.raises(ValueError, match=r"no paged attention: convert it first"):
    fr.ServingEngine(sm.llama_style(), call=sm.engine_call, **GEOMETRY)
  model = sm.mha_style()
  fr.convert(model, to="paged")
  with pytest.raises(TypeError, match=r"outside a serving step"):
    model(*[np.zeros((1, 4), np.int32)] * 2, sm.causal(4))
  with pytest.raises(ValueError, match=r"must return logits \[1, T, V\]"):
    fr.ServingEngine(model, call=lambda m, t, p: m(t, p, sm.causal(t.shape[1]))[0], **GEOMETRY)


def test_converted_layer_keeps_its_ragged_api():
  model = sm.mha_style()
  fr.convert(model, to="paged")
  layer = model.blocks[0].attn
  layer.init_cache(num_pages=4, page_size=4, max_num_seqs=1, pages_per_seq=4)
  x = np.ones((3, sm.D), np.float32)
  y = layer(x, cu_q_lens=np.array([0, 3], np.int32), num_seqs=np.array([1], np.int32))
  assert y.shape == (3, sm.D)
  with pytest.raises(TypeError, match=r"pass both cu_q_lens= and num_seqs="):
    layer(x, cu_q_lens=np.array([0, 3], np.int32))
  assert isinstance(nnx.state(layer, nnx.Cache), nnx.State)


def test_a_stream_closed_early_leaves_the_caches_empty(llama):
  stream = llama.engine.stream(PROMPTS, max_new_tokens=MAX_NEW)
  next(stream)
  stream.close()
  caches = [v.get_value() for _, v in nnx.iter_graph(llama.model) if isinstance(v, nnx.Cache)]
  caches = [c for c in caches if isinstance(c, fr.PagedKVCache)]
  assert len(caches) == 2
  for cache in caches:
    assert int(cache.num_free_pages()) == cache.num_pages and not np.asarray(cache.kv_lens).any()
  assert llama.engine.generate(PROMPTS[:2], max_new_tokens=3) == [w[:3] for w in llama.want(PROMPTS[:2], 3)]


def test_overlapped_decode_steps_change_no_token_and_leak_no_page(llama):
  """overlap=True dispatches a decode step before the host reads the one before it, its tokens taken on the
  device.  The tokens are those of overlap=False, also when a sequence stops on a stop token while the next step
  already runs for it (its extra row is discarded); the steps compile nothing new; a stream closed with a step
  in flight leaves every page free.  (Mutation: feeding the next step its host tokens of the step before breaks
  the equality.)"""
  engine, stats = llama.engine, llama.engine.stats
  want = llama.want(PROMPTS)
  stop = want[1][2]  # the second prompt stops at its third token at the latest
  cut = [w[: w.index(stop) + 1] if stop in w else w for w in want]
  assert any(len(c) < len(w) for c, w in zip(cut, want, strict=True))
  engine.generate(PROMPTS[:1], max_new_tokens=2)  # (every program compiled before the counts below)
  got, compiles = {}, stats.compiles
  for overlap in (False, True):
    engine.overlap = overlap
    before = stats.overlapped_steps
    got[overlap] = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, stop_tokens=[stop])
    assert (stats.overlapped_steps > before) == overlap, (overlap, stats.overlapped_steps, before)
  assert got[True] == got[False] == cut
  sampled = {}
  for overlap in (False, True):  # each token's key is its own row's (prompt index, token index)
    engine.overlap = overlap
    sampled[overlap] = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=1.5, seed=3)
  assert sampled[True] == sampled[False] != want
  assert stats.compiles == compiles
  before = stats.overlapped_steps
  stream = engine.stream(PROMPTS, max_new_tokens=MAX_NEW)
  while stats.overlapped_steps == before:
    next(stream)
  stream.close()
  caches = [v.get_value() for _, v in nnx.iter_graph(llama.model) if isinstance(v, nnx.Cache)]
  for cache in (c for c in caches if isinstance(c, fr.PagedKVCache)):
    assert int(cache.num_free_pages()) == cache.num_pages and not np.asarray(cache.kv_lens).any()
  assert engine.generate(PROMPTS, max_new_tokens=MAX_NEW) == want
  with pytest.raises(TypeError, match=r"overlap must be a bool, got overlap='yes'"):
    fr.ServingEngine(sm.mha_style(), call=sm.engine_call, overlap="yes", **GEOMETRY)


def test_decode_steps_overlap_in_a_full_cache():
  """A cache with no free page: decode tokens that go into each sequence's own partly filled page take none, so the
  host vouches for the next step and dispatches it early (`surely_fit`'s exact count; a bound that reserved a
  page per sequence and step would never overlap here).  The tokens are the reference's."""
  reference, model = sm.llama_style(), sm.llama_style()
  fr.convert(model, to="paged")
  prompts = _prompts(3, (9, 9))  # 9 tokens and 3 fed new ones: the 12 that 3 pages of 4 hold
  tight = dict(num_pages=6, page_size=4, max_num_seqs=2, pages_per_seq=3, max_num_batched_tokens=20)
  engine = fr.ServingEngine(model, call=sm.engine_call, **tight)
  assert engine.generate(prompts, max_new_tokens=4) == _want(reference, prompts, 4)
  assert engine.stats.overlapped_steps > 0


def test_context_parallel_engine_equals_one_device():
  """The caches spread over 2 devices; prompts of 8 new tokens or more are prefilled by the ring (zigzag layout,
  sequence-sharded through the whole model), the rest chunked; the outputs are the one-device ones."""
  mesh = make_mesh((2,), ("sp",), explicit=False)
  reference, model = sm.llama_style(), sm.llama_style()
  fr.convert(model, to="paged", mesh=mesh, seq_axis="sp")
  engine = fr.ServingEngine(model, call=sm.engine_call, **GEOMETRY, mesh=mesh, seq_axis="sp", ring_prefill_min_tokens=8)
  prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[4]]
  got = engine.generate(prompts, max_new_tokens=4)
  assert engine.stats.ring_prefills == 2
  assert got == _want(reference, prompts, 4)


def test_convert_paged_with_an_example_lists_the_sites_at_once():
  model = sm.gemma_style()
  tokens = np.zeros((2, 8), np.int32)
  report = fr.convert(model, to="paged", example=lambda m: m(tokens, tokens, sm.causal(8)))
  assert [s.path for s in report.converted] == ["blocks.0.attn", "blocks.1.attn"]
  assert not hasattr(model.blocks[0].attn, "paged_kv_caches")  # the engine creates them


def test_admission_waits_for_pages_and_an_evicted_sequence_resumes(llama, monkeypatch):
  want = llama.engine.generate(PROMPTS, max_new_tokens=MAX_NEW)
  # The cache's fits refuses slot 1 twice (as when another owner's pages run out): the sequence there is freed
  # and re-queued with its output so far, then recomputed; the outputs do not change.
  engine, refusals = llama.engine, iter([1, 1])
  real_fits = type(engine).fits

  def fits(self, new_lens):
    ok = real_fits(self, new_lens)
    slot = next(refusals, None) if new_lens[1] else None
    if slot is not None:
      ok = ok.copy()
      ok[slot] = False
    return ok

  monkeypatch.setattr(type(engine), "fits", fits)
  monkeypatch.setattr(type(engine), "surely_fit", lambda self, new_lens, kv_lens: False)  # always ask `fits`
  evictions = engine.stats.evictions
  assert engine.generate(PROMPTS, max_new_tokens=MAX_NEW) == want
  assert engine.stats.evictions - evictions == 2
  monkeypatch.undo()
  # 6 pages: the longest sequence (17 + 5 tokens) needs them all, so it runs alone.
  model = sm.llama_style()
  fr.convert(model, to="paged")
  tight = fr.ServingEngine(model, call=sm.engine_call, **(GEOMETRY | dict(num_pages=6)))
  assert tight.generate(PROMPTS, max_new_tokens=MAX_NEW) == want


def test_steps_that_surely_fit_skip_the_device_check(llama, monkeypatch):
  """The host decides from the last step's free pages whether a step surely fits (`surely_fit`): decode steps of a
  roomy cache then ask the device nothing before they run, the outputs do not change, and a step the bound cannot
  vouch for (too few free pages, a slot past its capacity, or no count yet) still asks `fits`."""
  engine = llama.engine
  want = engine.generate(PROMPTS, max_new_tokens=MAX_NEW)
  calls = []
  real_fits = type(engine).fits
  monkeypatch.setattr(type(engine), "fits", lambda self, new_lens: calls.append(1) or real_fits(self, new_lens))
  steps = engine.stats.steps
  assert engine.generate(PROMPTS, max_new_tokens=MAX_NEW) == want
  steps = engine.stats.steps - steps
  assert 1 <= len(calls) < steps, (len(calls), steps)  # the first step of a call asks (no count yet); most do not
  S, page, cap = engine.max_num_seqs, engine.page_size, engine.pages_per_seq * engine.page_size
  engine._free_pages = 3
  one = np.zeros(S, np.int32)
  one[0] = 1
  assert engine.surely_fit(one * 1, np.zeros(S, np.int32))  # 1 page
  assert engine.surely_fit(one * 3 * page, np.zeros(S, np.int32))  # 3 new pages
  assert not engine.surely_fit(one * (3 * page + 1), np.zeros(S, np.int32))  # 4
  assert engine.surely_fit(one * 3 * page, one * (page + 1))  # the slot's own last page, then 3 new ones
  assert not engine.surely_fit(one * (3 * page + page), one * (page + 1))  # 4 new ones
  assert not engine.surely_fit(one, one * cap)  # past the slot's capacity
  engine._free_pages = 0
  assert engine.surely_fit(one, one)  # a token into the slot's own partly filled page takes none
  assert not engine.surely_fit(one, one * page)  # a token past a full page takes one
  # A share of a partial page: both slots' last pages may be shared, so a write may copy each page it touches
  # (1 + (new - 1) / page_size); a release of the slot clears that.
  engine._mark_shared_tail([0])
  assert not engine.surely_fit(one, one)
  engine._free_pages = 3
  assert engine.surely_fit(one * (2 * page + 1), one)  # touches 3: each may be a copy
  assert not engine.surely_fit(one * (2 * page + 2), one)  # may touch 4
  engine.free(one.astype(bool))
  engine._free_pages = 0
  assert engine.surely_fit(one, one)
  engine._free_pages = None
  assert not engine.surely_fit(one, np.zeros(S, np.int32))
  engine._to_free = None  # (nothing was taken: the next call's release would free an empty slot)


@pytest.mark.parametrize("family", ["llama", "mha"])
@pytest.mark.parametrize("merged", [True, "kv"])
def test_merged_pages_serve_the_same_tokens(family, merged):
  """ServingEngine(merged_pages=True): every cache (a hand-written site's, a paged layer's) stores its pages
  merged, [P, page_size, K * H] ("kv": one [P, 2, page_size, K * H] array, a page's K and V), appends and then
  attends, and the engine's tokens equal greedy decoding by full recompute."""
  reference, model = sm.FAMILIES[family](), sm.FAMILIES[family]()
  fr.convert(model, to="paged")
  engine = fr.ServingEngine(model, call=sm.engine_call, merged_pages=merged, **GEOMETRY)
  caches = [x for x in jax.tree.leaves(nnx.state(model, nnx.Cache), is_leaf=lambda x: hasattr(x, "k_pages"))]
  caches = [x for x in caches if hasattr(x, "k_pages")]
  rank = 4 if merged == "kv" else 3
  assert caches and all(c.k_pages.ndim == rank and c.merged_kv_heads > 0 for c in caches)
  assert all((c.v_pages is None) == (merged == "kv") for c in caches)
  prompts = PROMPTS[:3]
  assert engine.generate(prompts, max_new_tokens=4) == _want(reference, prompts, 4)
  with pytest.raises(NotImplementedError, match=f"merged_pages={merged!r} with seq_axis"):
    fr.ServingEngine(model, call=sm.engine_call, merged_pages=merged, mesh=make_mesh((1,), ("sp",)), seq_axis="sp",
                     **GEOMETRY)  # fmt: skip
  with pytest.raises(TypeError, match="merged_pages must be a bool, 'kv' or 'auto'"):
    fr.ServingEngine(model, call=sm.engine_call, merged_pages="KV", **GEOMETRY)


def test_default_pages_are_the_librarys_choice():
  """merged_pages="auto" (the engine's default): kv pages where a page is whole sublane tiles of its dtype and K and
  V have one head dim, merged pages for MLA, 4-D pages spread over a mesh (the ring prefill writes them) or where a
  page is a partial tile; the engine's default caches are kv pages."""
  from flax_ringattn._src.paged import contracts

  mesh = make_mesh((1,), ("sp",))
  for args, want in (
    ((16, jnp.bfloat16, 64, 64, None), ("kv", True)),
    ((8, jnp.float32, 128, 128, None), ("kv", True)),
    ((8, jnp.bfloat16, 128, 128, None), (False, False)),  # half a bf16 tile
    ((16, jnp.int8, 128, 128, None), (False, False)),  # half an int8 tile
    ((32, jnp.int8, 128, 128, None), ("kv", True)),
    ((16, jnp.bfloat16, 192, 128, None), (True, False)),  # MLA
    ((16, jnp.bfloat16, 64, 64, mesh), (False, False)),
  ):
    assert contracts.pages("auto", *args) == want, args
  assert contracts.pages(False, 16, jnp.bfloat16, 64, 64, None) == (False, False)  # asked for: kept
  model = sm.FAMILIES["llama"]()
  fr.convert(model, to="paged")
  fr.ServingEngine(model, call=sm.engine_call, **dict(GEOMETRY, page_size=8))  # whole f32 tiles
  caches = [x for x in jax.tree.leaves(nnx.state(model, nnx.Cache), is_leaf=lambda x: hasattr(x, "k_pages"))]
  caches = [x for x in caches if hasattr(x, "k_pages")]
  assert caches and all(c.kv_together for c in caches)


def test_steps_run_at_the_least_token_bucket_that_holds_them(caplog):
  """A step pads its tokens to the least of `token_buckets`, not to max_num_batched_tokens: decode steps of 2
  sequences run 16 rows, prompt chunks up to 40; each bucket compiles once, and the tokens equal the reference's."""
  served = Served("llama")
  engine = fr.ServingEngine(served.model, call=sm.engine_call, **(GEOMETRY | dict(max_num_batched_tokens=40)))
  assert engine.token_buckets == (16, 32, 40)
  seen = []
  call = engine.call
  engine.call = lambda model, tokens, positions: seen.append(tokens.shape[1]) or call(model, tokens, positions)
  prompts = _prompts(2, (26, 8))
  with jax.log_compiles(), caplog.at_level(logging.WARNING):
    got = engine.generate(prompts, max_new_tokens=4)
  assert got == served.want(prompts, max_new=4)
  assert sorted(set(seen)) == [16, 40], seen  # traced once per bucket used: the 34-token prefill, then decodes
  assert sum("Compiling jit(_step_fn)" in r.getMessage() for r in caplog.records) == 2
  assert fr.ServingEngine(served.model, call=sm.engine_call, **GEOMETRY, token_buckets=(4,)).token_buckets == (4, 12)
  for bad in ((0,), (13,), (), "x"):
    with pytest.raises(ValueError, match="token_buckets must be row counts from 1 to max_num_batched_tokens=12"):
      fr.ServingEngine(served.model, call=sm.engine_call, **GEOMETRY, token_buckets=bad)


def test_warmup_compiles_every_bucket_and_changes_nothing():
  """`warmup()` compiles one step program per token bucket (a step of padding rows only) and the release, so
  generate compiles none; the tokens equal the reference's, the step count is untouched, and a second warmup
  compiles nothing."""
  served = Served("llama")
  engine = fr.ServingEngine(served.model, call=sm.engine_call, **(GEOMETRY | dict(max_num_batched_tokens=40)))
  assert engine.warmup() == len(engine.token_buckets) + 1 == 4  # and the release program
  assert engine.stats.steps == 0 and engine.warmup() == 0
  compiled = engine.stats.compiles
  prompts = _prompts(3, (26, 8))
  assert engine.generate(prompts, max_new_tokens=4) == served.want(prompts, max_new=4)
  assert engine.stats.compiles == compiled and engine.stats.steps > 0


def test_warmup_of_some_buckets_compiles_those_alone():
  """`warmup(buckets=...)` compiles the step programs of the named buckets only (and the release); the others
  compile when a step first needs them, and a bucket that is not one of `token_buckets` is refused by name."""
  served = Served("llama")
  engine = fr.ServingEngine(served.model, call=sm.engine_call, **(GEOMETRY | dict(max_num_batched_tokens=40)))
  assert engine.token_buckets == (16, 32, 40)
  assert engine.warmup(buckets=(16,)) == 2  # bucket 16 and the release program
  assert engine.warmup(buckets=(16,)) == 0 and engine.warmup(buckets=(32, 40)) == 2
  with pytest.raises(ValueError, match=r"buckets must be among token_buckets=\(16, 32, 40\), got \[24\]"):
    engine.warmup(buckets=(24, 32))


@pytest.mark.parametrize("family", ["llama", "mha"])
def test_a_step_allocates_pages_once_for_every_layer(family, monkeypatch):
  """Every layer's cache shares one page table: a step program makes the page allocation once and each layer
  applies it to its own pages (per layer, it repeated a few dozen scatters over the page counts in every layer),
  for hand-written sites and for `nnx.MultiHeadAttention` layers replaced by `PagedMultiHeadAttention` (their own
  call path); the tokens still equal the reference's."""
  served = Served(family)
  calls = []
  reservation = fr.PagedKVCache.reservation
  monkeypatch.setattr(
    fr.PagedKVCache, "reservation", lambda self, *a, **k: calls.append(1) or reservation(self, *a, **k)
  )
  engine = fr.ServingEngine(served.model, call=sm.engine_call, **GEOMETRY)
  sites = len(served.report.converted) + len(served.report.replaced)
  assert engine.warmup() == 2 and sites >= 2  # one step program (bucket 12), two layers or more
  assert len(calls) == 1
  prompts = _prompts(4, (9, 6))
  assert engine.generate(prompts, max_new_tokens=4) == served.want(prompts, max_new=4)


def test_caches_with_different_page_tables_are_refused(llama):
  """A step allocates once for all the caches, so the engine refuses caches whose page tables differ (one
  written by hand between calls) by name, before any step."""
  llama.engine.generate(PROMPTS[:1], max_new_tokens=2)
  caches = [v for _, v in nnx.iter_graph(llama.model) if isinstance(v, nnx.Cache)]
  caches = [v for v in caches if isinstance(v.get_value(), fr.PagedKVCache)]
  first = caches[0].get_value()
  caches[0].set_value(first.reserve(jnp.asarray([3, 0], jnp.int32)))
  with pytest.raises(ValueError, match=r"share one page table, but cache 1's page_indices differs from cache 0's"):
    llama.engine.generate(PROMPTS[:1], max_new_tokens=2)
  caches[0].set_value(first)
  assert llama.engine.generate(PROMPTS[:1], max_new_tokens=2) == [llama.want(PROMPTS[:1], 2)[0]]


def test_a_sequences_host_reads_equal_its_tokens():
  """The scheduler reads a sequence per step through `length`, `last` and `span` (building `tokens`, the whole
  prompt and output, three times a step cost a 64 x 2k decode step about 2 ms of host time): they equal it."""
  for prompt_len, generated in [(5, 0), (5, 3), (1, 4), (3, 1)]:
    seq = Sequence(0, list(range(100, 100 + prompt_len)), 9, frozenset(), generated=list(range(generated)))
    tokens = seq.tokens
    assert seq.length == len(tokens) and seq.last() == tokens[-1]
    for start in range(len(tokens) + 1):
      for stop in range(start, len(tokens) + 3):
        assert seq.span(start, stop) == tokens[start:stop], (prompt_len, generated, start, stop)
