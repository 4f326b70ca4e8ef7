"""Packed batches on a ring of 8: the contiguous, zigzag and balanced layouts side by side.

What it measures
----------------
A packed row of documents (default: the skewed pack 600, 200, 100, 50, 40, 34 tokens, scaled by ``--scale``),
causal attention inside each document (segment ids), on 8 simulated CPU devices, XLA block backend, for three
layouts of the same tokens:

* ``contiguous``: the natural order, shard r holds tokens [r T / 8, (r + 1) T / 8);
* ``zigzag``: `zigzag_order` over the whole row, `load_balance=True` (balances one causal sequence, not a pack);
* ``balanced``: `balanced_layout` (per-document zigzag plus token swaps), tokens reordered with `apply_layout`,
  the positions passed as `q_positions`;
* ``balanced_tiles``: `balanced_layout(tile=...)`: whole blocks of ``--tile`` tokens dealt to balance the tiles
  the kernels compute (the non-empty tile pairs), positions passed the same way.

Every layout runs the XLA kernel with ``--tile`` x ``--tile`` tiles (``BlockSizes``), so its tile skipping works
at the granularity the ``tiles`` column counts.

Columns:

* imbalance: max over shards of the visible (query, key) pairs / the mean (1.0 is perfect; the ring's step takes
  as long as its busiest device);
* tiles (max, total): the XLA kernel's non-empty tiles per device over every hop (what it computes; skipping
  works on per-tile position and segment summaries): the busiest device's, and all devices' together;
* time: median wall time of the forward + backward (gradients of q, k, v), layouts interleaved.

Before anything is timed each layout's output and gradients, put back in the natural order, are checked
against `reference_attention`: a wrong result exits 1.  The simulated devices share the host's cores, so the
wall time follows the *total* work of the 8 devices, not the busiest one's: it shows that the balanced layout
costs nothing extra, and the imbalance and tile columns show what a real ring (one chip per shard) would gain.

Run it::

  python benchmarks/packed_layouts.py --quick        # the pack at T = 1024, 2 repeats
  python benchmarks/packed_layouts.py --scale 8      # T = 8192
"""

# ruff: noqa: E402 -- XLA_FLAGS must be set before jax is imported.
from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import flax_ringattn as fr
from flax_ringattn import benchmarking as bench
from flax_ringattn._src import masks

N_DEVICES = 8
AXIS = "sp"
SKEWED = (600, 200, 100, 50, 40, 34)
CHECK_TOL = 1e-4  # f32: max |a - b| / max |b|
TARGET = 1.05


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
    "--docs", default=",".join(map(str, SKEWED)), help="document lengths of the pack (default: %(default)s)"
  )
  p.add_argument("--scale", type=int, default=1, help="multiply every document length (default: %(default)s)")
  p.add_argument("--heads", type=int, default=4, help="q and kv heads (default: %(default)s)")
  p.add_argument("--head-dim", type=int, default=64, help="head dim (default: %(default)s)")
  p.add_argument("--tile", type=int, default=32, help="the kernel's q and kv tile (default: %(default)s)")
  p.add_argument("--repeats", type=int, default=5, help="timed rounds (default: %(default)s)")
  p.add_argument("--quick", action="store_true", help="2 repeats")
  bench.add_report_args(p)
  args = p.parse_args(argv)
  if args.quick:
    args.repeats = 2
  return args


def pack(args):
  """[1, T] segment ids of the pack, T a multiple of 2 * 8 (the last document padded out)."""
  lengths = [int(x) * args.scale for x in args.docs.split(",")]
  seg = np.concatenate([np.full(L, i) for i, L in enumerate(lengths)])
  extra = -len(seg) % (2 * N_DEVICES)
  seg = np.concatenate([seg, np.full(extra, len(lengths) - 1)])
  return seg[None].astype(np.int32)


def layouts(seg, tile):
  """name -> (order [1, T], ring keywords): the four layouts of the same tokens."""
  T = seg.shape[1]
  balanced = fr.balanced_layout(seg, N_DEVICES)
  tiled = fr.balanced_layout(seg, N_DEVICES, tile=tile)
  return {
    "contiguous": (np.arange(T, dtype=np.int32)[None], {}),
    "zigzag": (fr.zigzag_positions(T, N_DEVICES)[None], dict(load_balance=True)),
    "balanced": (balanced.order, dict(q_positions=jnp.asarray(balanced.order))),
    "balanced_tiles": (tiled.order, dict(q_positions=jnp.asarray(tiled.order))),
  }


def tiles_per_device(seg, order, tile):
  """Non-empty XLA tiles of every device over every hop: [8]."""
  T = seg.shape[1]
  L = T // N_DEVICES
  spec = masks.MaskSpec(is_causal=True, has_segments=True, has_positions=True)
  pos, ids = order, np.take_along_axis(seg, order, axis=1)
  tok = [masks.Tokens(pos[:, r * L : (r + 1) * L], ids[:, r * L : (r + 1) * L]) for r in range(N_DEVICES)]
  bq = bk = min(tile, L)
  return np.array(
    [
      sum(int((masks.tile_kinds(spec, tok[r], tok[s], bq, bk) != masks.EMPTY).sum()) for s in range(N_DEVICES))
      for r in range(N_DEVICES)
    ]
  )


def ring_fn(mesh, seg_ordered, kw, tile):
  blocks = fr.BlockSizes(block_q=tile, block_kv=tile)

  def attention(q, k, v):
    return fr.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      axis_name=AXIS,
      is_causal=True,
      segment_ids=seg_ordered,
      implementation="xla",
      block_sizes=blocks,
      **kw,
    )

  return bench.fwd_bwd(attention)


def main(argv=None):
  args = parse_args(argv)
  seg = pack(args)
  T = seg.shape[1]
  mesh = jax.make_mesh(
    (N_DEVICES,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:N_DEVICES]
  )
  report = bench.Report(
    "Packed layouts on a ring of 8",
    json=args.json,
    meta=dict(machine=bench.machine(), T=T, docs=args.docs, scale=args.scale, heads=args.heads, head_dim=args.head_dim),
  )
  ks = jax.random.split(jax.random.key(0), 4)
  shape = (1, T, args.heads, args.head_dim)
  q, k, v, do = (jax.random.normal(x, shape, jnp.float32) for x in ks)
  want = bench.fwd_bwd(lambda q, k, v: fr.reference_attention(q, k, v, is_causal=True, segment_ids=jnp.asarray(seg)))(
    q, k, v, do
  )
  runs, checks, stats = {}, [], {}
  for name, (order, kw) in layouts(seg, args.tile).items():
    lay = fr.Layout(order=order, num_shards=N_DEVICES)
    inputs = [jnp.asarray(fr.apply_layout(np.asarray(x), lay)) for x in (q, k, v, do)]
    fn = ring_fn(mesh, jnp.asarray(fr.apply_layout(seg, lay)), kw, args.tile)
    out, grads = fn(*inputs)
    back = (fr.undo_layout(np.asarray(out), lay), tuple(fr.undo_layout(np.asarray(g), lay) for g in grads))
    checks.append(bench.compare(name, back, want, tol=CHECK_TOL, metric="rel_max"))
    runs[name] = lambda fn=fn, inputs=inputs: fn(*inputs)
    tiles = tiles_per_device(seg, order, args.tile)
    stats[name] = (fr.layout_imbalance(seg, order, N_DEVICES), tiles.max(), tiles.sum())
  report.require(checks)
  report.progress(f"timing {len(runs)} layouts x {args.repeats} rounds at T={T}")
  times = bench.time_interleaved(runs, args.repeats)
  base = bench.median(times["zigzag"])
  rows = [[name, *stats[name], bench.median(times[name]) * 1e3, bench.median(times[name]) / base] for name in runs]
  report.table(
    f"causal pack, T = {T}, tiles {args.tile} x {args.tile}",
    ("layout", "imbalance (pairs)", "tiles (busiest)", "tiles (all)", "time (ms)", "time / zigzag"),
    rows,
    formats={"imbalance (pairs)": ".3f", "time / zigzag": ".2f"},
    notes=("Simulated devices share the host's cores: time follows the total work, not the busiest device.",),
  )
  report.target("balanced imbalance", stats["balanced"][0], f"<= {TARGET}", stats["balanced"][0] <= TARGET)
  tiled, zig = stats["balanced_tiles"][1], stats["zigzag"][1]
  report.target("balanced_tiles: busiest device's tiles / zigzag's", tiled / zig, "< 1", tiled < zig)
  return report.finish()


if __name__ == "__main__":
  sys.exit(main())
