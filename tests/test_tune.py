"""Tuned tile tables (`planners/tuned.py`) and the tuner (`flax_ringattn.tune`): the planners take a table's
tiles only where their own rules accept them, a table changes tiles and never results, and the tuner writes
entries under the keys the planners look up.  Interpret mode on CPU: the timings mean nothing here."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn import tune
from flax_ringattn._src.backends.pallas_tpu import planners
from flax_ringattn._src.options import ProblemShape
from flax_ringattn._src.paged.implementations import PagedPallasTpu
from flax_ringattn._src.testing.interpret import interpret_params, no_races

F32 = jnp.float32
GEN = "v5e"
SHAPE = ProblemShape(q_len=512, kv_len=512, num_heads=4, num_kv_heads=2, head_dim=128, dtype=F32)


def _table(entry, key=None, generation=GEN):
  return {"generation": generation, "entries": {key or planners.tuned.block_key(SHAPE): entry}}


def test_planner_takes_an_accepted_entry_and_ignores_others():
  model = planners.plan_block_sizes_for(SHAPE, generation=GEN)
  entry = dict(block_q=128, block_kv=256, block_q_bwd=256, block_kv_bwd=128)
  assert (model.block_q, model.block_kv, *model.bwd) != tuple(entry.values())
  with tune.using(_table(entry)):
    assert planners.plan_block_sizes_for(SHAPE, generation=GEN) == fr.BlockSizes(**entry)
    assert planners.plan_block_sizes_for(SHAPE, generation="v6e") == planners.plan_block_sizes_for(
      SHAPE, generation="v6e"
    )  # another generation's plan is the model's
  assert planners.plan_block_sizes_for(SHAPE, generation=GEN) == model  # unregistered: the model again
  for bad in (dict(entry, block_q=100), dict(entry, block_kv=384), dict(entry, block_q_bwd=4096)):
    with tune.using(_table(bad)):  # not a legal tile of 512 tokens, or not within VMEM: the model plans
      assert planners.plan_block_sizes_for(SHAPE, generation=GEN) == model, bad


@pytest.mark.parametrize("fused", [True, False])
def test_tuned_backward_kernel_choice_is_taken_where_it_fits(fused, monkeypatch):
  """A table entry's `fused_bwd` (the tuner times each backward tile both ways) reaches the plan; where that
  kernel's footprint would not fit VMEM at the entry's tiles the model plans instead.  `tune._accepted` agrees."""
  from flax_ringattn._src.backends.pallas_tpu.planners import block as block_planner

  entry = dict(block_q=128, block_kv=256, block_q_bwd=256, block_kv_bwd=128, fused_bwd=fused)
  with tune.using(_table(entry)):
    assert planners.plan_block_sizes_for(SHAPE, generation=GEN) == fr.BlockSizes(**entry)
  assert tune._accepted(SHAPE, GEN, (128, 256), (256, 128), fused)
  kernels = ("dkv_fused",) if fused else ("dq", "dkv")
  dims = dict(bq=256, bk=128, dtype=F32, **SHAPE.heads)
  need = max(planners.footprint(k, **dims).total for k in kernels)
  fwd = planners.footprint("fwd", bq=128, bk=256, dtype=F32, **SHAPE.heads).total
  assert fwd < need  # a budget just below the backward's need still takes the forward's tiles
  monkeypatch.setattr(block_planner, "budget_bytes", lambda generation: need - 1)
  with tune.using(_table(entry)):
    assert planners.plan_block_sizes_for(SHAPE, generation=GEN) != fr.BlockSizes(**entry)
  assert not tune._accepted(SHAPE, GEN, (128, 256), (256, 128), fused)
  with pytest.raises(ValueError, match="fused_bwd must be true, false or null, got 1"):
    planners.tuned.check_table(_table(dict(entry, fused_bwd=1)))


def test_table_form_is_checked():
  with pytest.raises(ValueError, match="'generation' string"):
    planners.tuned.check_table({"entries": {}})
  with pytest.raises(ValueError, match="needs int block_q and block_kv"):
    planners.tuned.check_table(_table({"block_q": "128"}))


@pytest.mark.interpret
def test_tuned_tiles_never_change_results(monkeypatch):
  """ring_attention under a table whose tiles differ from the model's (the kernels plan exactly those): forward
  and gradients equal the dense reference at the float32 tolerance, as with the model's tiles."""
  planned = []
  real = planners.plan_block_sizes_for
  monkeypatch.setattr(planners, "plan_block_sizes_for", lambda *a, **kw: planned.append(real(*a, **kw)) or planned[-1])
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 512, 4, 128)), F32)
  k, v = (jnp.asarray(rng.normal(size=(1, 512, 2, 128)), F32) for _ in range(2))

  def run(q, k, v):
    f = lambda q, k, v: fr.ring_attention(  # noqa: E731
      q, k, v, is_causal=True, implementation="pallas_tpu", interpret=interpret_params()
    )
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(jnp.ones_like(out))

  want = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), q, k, v)
  want = (want[0], want[1](jnp.ones_like(want[0])))
  gen = planners.current_generation()
  entry = dict(block_q=128, block_kv=256, block_q_bwd=256, block_kv_bwd=128)
  with tune.using(_table(entry, generation=gen)):
    assert planners.plan_block_sizes_for(SHAPE, generation=gen) == fr.BlockSizes(**entry)
    with no_races():
      got = jax.jit(run)(q, k, v)
  assert planned and all(b == fr.BlockSizes(**entry) for b in planned), planned
  assert_close(got[0], want[0], F32)
  assert_close(got[1], want[1], F32, "grad")


@pytest.mark.interpret
@pytest.mark.races_not_read("the tuner's timing runs; the kernels' own tests read the race detector")
def test_tuner_cli_writes_what_the_paged_planner_reads(tmp_path):
  """`python -m flax_ringattn.tune paged` on a tiny decode batch of kv pages writes an entry the planner then takes
  for them (registered from the file: kv pages are planned under merged pages' key)."""
  path = tmp_path / "table.json"
  argv = ["paged", "--decode", "4x64", "--heads", "4,2,64", "--page-size", "8", "--dtype", "float32", "--kv-pages"]
  assert tune.main([*argv, "--interpret", "--repeats", "1", "--out", str(path)]) == 0
  table = json.loads(path.read_text())
  ((key, entry),) = table["entries"].items()
  assert "merged=1" in key and "K=1 H=128" in key, key  # head dim 64 planned as one 128-lane group
  with tune.using(str(path)):
    got = planners.plan_paged_block_sizes(4, 8, 8, 4, 1, 128, F32, merged=True, generation=table["generation"])
  assert (got.block_q, got.block_kv) == (entry["block_q"], entry["block_kv"])
  # The op's own plan for a kv-pages call (v_pages None) reads that key: an entry other than the model's choice
  # (kv blocks of 2 pages, not all 8) is taken.
  q = jax.ShapeDtypeStruct((4, 4, 64), F32)
  kv = jax.ShapeDtypeStruct((32, 2, 8, 2 * 64), F32)
  call = dict(q=q, k_pages=kv, v_pages=None, block_sizes=None, k_scale=None, v_scale=None, pages_per_seq=8)
  plan = lambda: PagedPallasTpu(interpret=True).blocks(**call, logits_soft_cap=None)  # noqa: E731
  assert plan().block_kv == 64
  hand = dict(table, entries={key: dict(block_q=entry["block_q"], block_kv=16)})
  with tune.using(hand):
    assert (plan().block_q, plan().block_kv) == (entry["block_q"], 16)
  with pytest.raises(SystemExit):
    tune.main(["block", "--out", str(path)])  # no --shape
