"""One process of the multi-process tests (tests/test_multiprocess.py starts 2 of them via `flax_ringattn.launch`).

    python tests/multiprocess_worker.py strategies   # every strategy: fwd + grads vs the reference, own shards
    python tests/multiprocess_worker.py train        # 5 demo-model steps vs the single-process run
    python tests/multiprocess_worker.py paged_cp     # a paged cache spread over 8 devices vs one device
    python tests/multiprocess_worker.py die SECONDS  # loop on collectives until a peer dies (heartbeat SECONDS)

Each process computes the single-process reference itself, on one of its own
devices, from the same seeded inputs, and checks the shards it holds.  Any
failure prints `WORKER FAILED` with the reason and exits 1.
"""

# ruff: noqa: E402 -- the runtime must be initialised before JAX's devices are used.
from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

from flax_ringattn.launch import initialize_from_env

MODE = sys.argv[1]
HEARTBEAT = int(sys.argv[2]) if MODE == "die" else None
assert initialize_from_env(heartbeat_timeout_seconds=HEARTBEAT), "start me with flax_ringattn.launch"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ringattn as fr

PID = jax.process_index()
LOCAL = jax.local_devices()[0]


def log(*a):
  print(f"[process {PID}]", *a, flush=True)


def global_mesh(shape, names, explicit=True):
  """Devices ordered by process: the first axis is the one that crosses processes."""
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  kind = AxisType.Explicit if explicit else AxisType.Auto
  return Mesh(np.array(devices).reshape(shape), names, axis_types=(kind,) * len(shape))


def to_global(x, mesh, spec):
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


def check_shards(name, got, want, atol):
  """Compares the shards this process holds with the same slices of the reference."""
  want = np.asarray(want, np.float32)
  assert got.shape == want.shape, (name, got.shape, want.shape)
  for shard in got.addressable_shards:
    np.testing.assert_allclose(
      np.asarray(shard.data, np.float32), want[shard.index], atol=atol, rtol=atol, err_msg=name
    )


# (strategy, mesh shape, mesh names, axis_name, batch_axis): the ring and all_gather across all 8 devices,
# ulysses across all 8 and ulysses within a process (data parallel across processes), ulysses_ring with the ring
# across processes and the all-to-all within (the hierarchical placement the README recommends).
LAYOUTS = [
  ("ring", (8,), ("sp",), "sp", None),
  ("all_gather", (8,), ("sp",), "sp", None),
  ("ulysses", (8,), ("sp",), "sp", None),
  ("ulysses", (2, 4), ("dp", "sp"), "sp", "dp"),
  ("ulysses_ring", (2, 4), ("ring", "uly"), ("ring", "uly"), None),
]


def run_strategies():
  B, T, N, K, H = 2, 64, 8, 2, 16
  rng = np.random.default_rng(0)
  q = rng.standard_normal((B, T, N, H), np.float32)
  k, v = (rng.standard_normal((B, T, K, H), np.float32) for _ in range(2))
  do = rng.standard_normal((B, T, N, H), np.float32)
  cuts = np.sort(rng.integers(1, T, (B, 3)), axis=1)
  seg = (np.arange(T)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)
  opts = dict(is_causal=True, local_window_size=(40, 0), logits_soft_cap=5.0)

  def reference(n):
    """Inputs in the zigzag order of n shards and the reference on one device of this process."""
    zz = lambda x: fr.zigzag_order(x, n, axis=1)  # noqa: E731
    pos = fr.zigzag_positions(T, n)
    qz, kz, vz, doz, segz = zz(q), zz(k), zz(v), zz(do), zz(seg)

    def fwd(q, k, v):
      return fr.reference_attention(q, k, v, segment_ids=segz, q_positions=pos, kv_positions=pos, **opts)

    @jax.jit
    def run(q, k, v, do):
      out, vjp = jax.vjp(fwd, q, k, v)
      return (out, *vjp(do))

    return (qz, kz, vz, doz, segz), jax.device_get(run(*(jax.device_put(x, LOCAL) for x in (qz, kz, vz, doz))))

  for strategy, shape, names, axis_name, batch_axis in LAYOUTS:
    mesh = global_mesh(shape, names)
    n_seq = int(np.prod([s for s, a in zip(shape, names, strict=True) if a != batch_axis]))
    (qz, kz, vz, doz, segz), want = reference(n_seq)
    spec, seg_spec = P(batch_axis, axis_name, None, None), P(batch_axis, axis_name)
    args = [to_global(x, mesh, spec) for x in (qz, kz, vz)]
    g_seg, g_do = to_global(segz, mesh, seg_spec), to_global(doz, mesh, spec)

    def f(q, k, v, seg, strategy=strategy, mesh=mesh, axis_name=axis_name, batch_axis=batch_axis):
      return fr.ring_attention(
        q,
        k,
        v,
        mesh=mesh,
        axis_name=axis_name,
        batch_axis=batch_axis,
        strategy=strategy,
        segment_ids=seg,
        load_balance=True,
        implementation="xla",
        **opts,
      )

    @jax.jit
    def step(q, k, v, seg, do, f=f):
      out, vjp = jax.vjp(lambda q, k, v: f(q, k, v, seg), q, k, v)
      return (out, *vjp(do))

    got = step(*args, g_seg, g_do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
      check_shards(f"{strategy} {shape} {name}", g, w, 1e-5)
    log(f"OK {strategy} mesh {dict(zip(names, shape, strict=True))}: fwd and grads match on my shards")


def run_train(steps=5):
  import optax
  from _model import ModelConfig, Transformer, dense_attention, ring_attention_layer
  from flax import nnx

  B, T = 2, 64
  config = ModelConfig(vocab_size=32, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2)
  rng = np.random.default_rng(0)
  data = rng.integers(0, config.vocab_size, (B, T + 1))
  tokens, targets = data[:, :-1], data[:, 1:]
  prev = np.concatenate([np.zeros((B, 1), data.dtype), tokens[:, :-1]], axis=1)
  positions = np.broadcast_to(np.arange(T), (B, T))

  def train(model, batch):
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, tokens, targets, positions, prev):
      def loss_fn(model):
        logits = model(tokens, positions, prev)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

      loss, grads = nnx.value_and_grad(loss_fn)(model)
      opt.update(model, grads)
      return loss

    return [float(step(model, opt, *batch)) for _ in range(steps)]

  with jax.default_device(LOCAL):
    reference = Transformer(config, dense_attention, rngs=nnx.Rngs(0))
    ref_losses = train(reference, [jnp.asarray(x) for x in (tokens, targets, positions, prev)])

  n = 8
  mesh = global_mesh((n,), ("sp",), explicit=False)
  with jax.default_device(LOCAL):
    model = Transformer(config, ring_attention_layer(mesh=mesh, load_balance=True), rngs=nnx.Rngs(0))
  # The same initial parameters on every process, replicated over the global mesh.
  state = nnx.state(model)
  nnx.update(model, jax.tree.map(lambda x: to_global(x, mesh, P()), state))
  zz = lambda x: fr.zigzag_order(np.asarray(x), n, axis=1)  # noqa: E731
  batch = [to_global(zz(x), mesh, P(None, "sp")) for x in (tokens, targets, positions, prev)]
  losses = train(model, batch)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-5)
  assert losses[-1] < losses[0], losses  # it trained
  log(f"OK train: {steps} steps, losses {np.round(losses, 5).tolist()} match the single-process run")


def run_paged_cp():
  """A paged KV cache spread over the 8 devices of both processes (seq_axis), two ragged steps (prefill, then
  decode and chunked prefill mixed) appended and attended with the partials merged across processes, against
  the same steps on one device of this process with an unspread cache."""
  from flax_ringattn._src.paged.cache import PagedKVCache

  n, N, K, H, ps = 8, 4, 2, 16, 4
  shape = dict(num_pages=4 * n, page_size=ps, max_num_seqs=4, pages_per_seq=8, num_kv_heads=K, head_dim=H)
  steps = [(11, 3, 0, 6), (1, 5, 1, 2)]  # new tokens per slot; slot 2 joins at the second step
  T = max(sum(q) for q in steps)
  rng = np.random.default_rng(0)
  batches = []
  for q_lens in steps:
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q, k, v = (rng.standard_normal((T, h, H), np.float32) for h in (N, K, K))
    batches.append((q, k, v, cu, np.array([len(q_lens)], np.int32)))

  def step(cache, q, k, v, cu, num_seqs, **layout):
    cache = cache.append(k, v, cu, num_seqs)
    kv_lens, table = cache.attention_view()
    out = fr.paged_attention(
      q, cache.k_pages, cache.v_pages, kv_lens, table, cu, num_seqs, implementation="xla", **layout
    )
    return cache, out

  with jax.default_device(LOCAL):
    ref_cache = jax.jit(lambda: PagedKVCache.create(**shape))()
    want = []
    for batch in batches:
      ref_cache, out = jax.jit(step)(ref_cache, *(jax.device_put(x, LOCAL) for x in batch))
      want.append(jax.device_get(out))

  mesh = global_mesh((n,), ("sp",))
  cache = PagedKVCache.create(**shape, mesh=mesh, seq_axis="sp")  # eager: jit would drop the placement
  assert cache.num_shards == n and cache.k_pages.sharding.spec[0] == "sp", (cache.num_shards, cache.k_pages.sharding)
  spread = jax.jit(functools.partial(step, mesh=mesh, seq_axis="sp"))
  for i, batch in enumerate(batches):
    cache, out = spread(cache, *(to_global(x, mesh, P()) for x in batch))
    check_shards(f"paged step {i} out", out, want[i], 1e-5)

  # Each of my page shards holds the page ids its device owns: device d (position along 'sp') pages
  # [d P/n, (d+1) P/n), and in them the k rows of exactly the tokens whose table entries point there.
  q_per = shape["num_pages"] // n
  table = np.asarray(cache.page_indices.addressable_shards[0].data)  # replicated
  kv_lens = np.asarray(cache.kv_lens.addressable_shards[0].data)
  np.testing.assert_array_equal(kv_lens, np.sum(steps, axis=0))
  tokens = [np.concatenate([b[1][b[3][s] : b[3][s + 1]] for b in batches]) for s in range(len(steps[0]))]
  position = {d: i for i, d in enumerate(mesh.devices.flat)}
  mine = 0
  for shard in cache.k_pages.addressable_shards:
    d = position[shard.device]
    ids = range(shard.index[0].start or 0, shard.index[0].stop or shape["num_pages"])
    assert ids == range(d * q_per, (d + 1) * q_per), (d, ids)
    data = np.asarray(shard.data)
    for s, k_s in enumerate(tokens):
      for j in range(-(-len(k_s) // ps)):
        page = int(table[s, j])
        assert page // q_per == (s + j) % n, f"slot {s} page {j} = id {page}: owner {page // q_per}, want {(s + j) % n}"
        if page in ids:
          rows = k_s[j * ps : (j + 1) * ps]
          np.testing.assert_allclose(data[page - ids.start, : len(rows)], rows, err_msg=f"slot {s} page {j}")
          mine += 1
  assert mine > 0, "none of the written pages is on this process"

  # Ring prefill: a 20-token prompt for slot 3 (8 tokens held: a page boundary), q / k / v sharded over the 8
  # devices of both processes in the ring prefill layout, q passed around the ring across the process boundary.
  Tp, Tr = 2 * n * ps, 20
  qr, kr, vr = (rng.standard_normal((Tr, h, H), np.float32) for h in (N, K, K))
  prompt = (qr, kr, vr, np.array([0, 0, 0, 0, Tr], np.int32), np.array([4], np.int32))
  with jax.default_device(LOCAL):
    ref_cache, ref_out = jax.jit(step)(ref_cache, *(jax.device_put(x, LOCAL) for x in prompt))

  def layout(x):
    return fr.zigzag_order(np.concatenate([x, np.zeros((Tp - Tr, *x.shape[1:]), np.float32)]), n, axis=0)

  def ring(cache, q, k, v):
    cache = cache.reserve_prefill(3, Tr, padded_len=Tp)
    kv_lens, table = cache.attention_view()
    out, k_pages, v_pages, _, _ = fr.paged_ring_prefill(
      q,
      k,
      v,
      cache.k_pages,
      cache.v_pages,
      kv_lens,
      table,
      slot=3,
      num_tokens=Tr,
      mesh=mesh,
      seq_axis="sp",
      implementation="xla",
    )
    return dataclasses.replace(cache, k_pages=k_pages, v_pages=v_pages), out

  cache, out = jax.jit(ring)(cache, *(to_global(layout(x), mesh, P("sp")) for x in (qr, kr, vr)))
  check_shards("ring prefill out", out, layout(np.asarray(jax.device_get(ref_out))), 1e-5)
  log(
    f"OK paged cp: 2 ragged steps match the single-process run; my {mine} written pages sit on their owners; "
    "the ring prefill matches too"
  )


def run_die():
  mesh = global_mesh((8,), ("sp",))
  x = to_global(np.ones((1, 64, 4, 8), np.float32), mesh, P(None, "sp"))
  f = jax.jit(lambda x: fr.ring_attention(x, x, x, mesh=mesh, is_causal=True, implementation="xla"))
  jax.block_until_ready(f(x))
  log("READY")
  start = time.monotonic()
  while True:  # collectives until a peer is gone; the runtime must turn that into an error, not a hang
    jax.block_until_ready(f(x))
    time.sleep(0.05)
    if time.monotonic() - start > 600:
      raise AssertionError("still running 600 s after READY")


if __name__ == "__main__":
  try:
    {"strategies": run_strategies, "train": run_train, "paged_cp": run_paged_cp, "die": run_die}[MODE]()
  except BaseException as e:  # noqa: BLE001 -- report everything, exit non-zero
    traceback.print_exc()
    log(f"WORKER FAILED: {type(e).__name__}: {e}")
    sys.exit(1)
  log("DONE")
