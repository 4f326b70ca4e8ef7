"""`PagedMultiHeadAttention(mesh=, seq_axis=)`: the cache spread over a sequence axis serves the single-device
answers.

The layer's pages spread over 'sp' (and its kv heads over 'tp' at once), ragged steps of prefill, chunked prefill
and decode against whole sequences through `nnx.MultiHeadAttention` with the same weights; every device holds its
1/n of each sequence's pages; one compile across the steps.  The serving loop and the fixtures are
test_paged_layer.py's.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx
from test_paged_layer import CACHE, _dense, _inputs, _mha, _paged, _ragged_plan, serve
from tolerances import assert_close

from flax_ringattn._src.paged import attend as paged_attend

F32 = np.float32


@pytest.mark.parametrize(
  "shape,names,axes",
  [
    ((8,), ("sp",), dict(seq_axis="sp")),
    ((4, 2), ("sp", "tp"), dict(seq_axis="sp", head_axis="tp")),
  ],
  ids=["sp8", "sp4-tp2"],
)
@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
def test_spread_cache_serves_the_single_device_answers(shape, names, axes, explicit):
  mesh = make_mesh(shape, names, explicit=explicit)
  mha = _mha(seed=6)
  layer = _paged(cache=False, mesh=mesh, **axes)
  nnx.update(layer, nnx.state(mha, nnx.Param))
  layer.init_cache(**CACHE)  # after loading: the weights are placed on the mesh with the pages
  cache = layer.kv_cache.get_value()
  assert cache.num_shards == shape[0]
  spec = tuple(cache.k_pages.sharding.spec) + (None,) * 4
  assert spec[:3] == ("sp", None, axes.get("head_axis")), spec
  lengths, chunk, start = _ragged_plan()
  xs = _inputs(lengths, seed=6)
  traces = []
  real = paged_attend.paged_attention
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(paged_attend, "paged_attention", lambda *a, **k: traces.append(1) or real(*a, **k))
    outs = serve(layer, xs, lengths, chunk, start)
  assert len(traces) == 1  # one trace (one compile) for every step of the plan
  expected = np.asarray(_dense(mha, xs))
  for b, n in enumerate(lengths):
    assert_close(outs[b], expected[b, :n], F32)
  cache = layer.kv_cache.get_value()
  assert tuple(cache.k_pages.sharding.spec)[0] == "sp"  # still spread after the steps
  # Every slot's pages: 1/n of them on each device, plus at most one.
  n, q = cache.num_shards, cache.pages_per_owner
  table, kv = np.asarray(cache.page_indices), np.asarray(cache.kv_lens)
  for s in range(CACHE["max_num_seqs"]):
    m = -(-int(kv[s]) // CACHE["page_size"])
    owners = np.bincount(table[s, :m] // q, minlength=n)
    assert owners.max() - owners.min() <= 1, (s, owners)


def test_seq_axis_needs_a_mesh_and_a_page_count_it_divides():
  with pytest.raises(ValueError, match=r"seq_axis='sp' needs mesh=\.\.\."):
    _paged(cache=False, seq_axis="sp")
  with pytest.raises(ValueError, match=r"seq_axis='sp' and head_axis='sp' must differ"):
    _paged(cache=False, mesh=make_mesh((2,), ("sp",)), seq_axis="sp", head_axis="sp")
  layer = _paged(cache=False, mesh=make_mesh((3,), ("sp",)), seq_axis="sp")
  with pytest.raises(ValueError, match=r"num_pages=32 must be a multiple of the 3 devices"):
    layer.init_cache(**CACHE)
