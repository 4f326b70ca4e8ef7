"""Real-size decoders end to end: train them three ways, serve them from a paged cache, on one chip.

The models are examples/_decoders.py's (Qwen2.5-0.5B and Llama-3.2-1B shapes, attention written by hand,
random weights, bf16).  Two tables:

* **train**: AdamW steps on next-token loss at each `--seq-lens`, with the attention of every block
  (a) converted by `fr.convert(model, example=...)` with the library's default choices ("library"),
  (b) swapped by hand for splash attention (`make_splash_mha_single_device`, causal, GQA native, q pre-scaled,
      vmapped over the batch: "splash"), and
  (c) `jax.nn.dot_product_attention(..., is_causal=True)` ("xla").
  Each row: median step time, tokens/s, MFU (model FLOPs, causal attention counted as half, over the chip's bf16
  peak), and the peak memory the device reports.  `--remat` recomputes each block in the backward.
* **serve**: `ServingEngine` over the model converted to paged attention, batches of
  `--batches` sequences with `--contexts` tokens of prompt each: decode tokens/s over the engine's pure decode
  steps of the whole batch (`EngineStats.decode_*`) and its share of the HBM roofline (weights plus the KV bytes
  one step reads, over the chip's bandwidth), time to the first token, and prefill tokens/s.
* **longest** (`--tables longest`): for each way, the longest sequence that trains one step, doubling from
  `--longest-from` up to `--longest-cap`, and the first length that fails, with its error.

Off a TPU the kernels run in interpret mode: `--smoke` (tiny model, two steps, tiny batches) is what `make test`
runs; its times mean nothing.  The persistent compilation cache is on (`--no-compilation-cache` to turn it off).

  python benchmarks/real_models.py --model qwen --seq-lens 8192,32768 --tables train
  python benchmarks/real_models.py --model llama --tables serve --batches 1,8,32,64 --contexts 2048,8192
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

try:
  import flax_ringattn as fr
except ImportError:  # a source checkout without `pip install -e .`
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  import flax_ringattn as fr
from flax_ringattn import benchmarking as bench
from flax_ringattn.benchmarking import hardware, median

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import _decoders as decoders  # noqa: E402

MODELS = {"qwen": decoders.QWEN2_5_0_5B, "llama": decoders.LLAMA3_2_1B}
WAYS = ("library", "splash", "xla")


# -- the three attentions ----------------------------------------------------------------------------------


class SwappedAttention(decoders.Attention):
  """decoders.Attention with its softmax(q k^T) v replaced by a kernel `core(q, k, v)` on [B, T, N | K, H]."""

  def __init__(self, c, core, *, rngs):
    super().__init__(c, rngs=rngs)
    self.core = core

  def __call__(self, x, positions, mask):
    del mask  # causal, as the model's own mask
    c = self.c
    B, T, _ = x.shape
    q = decoders.rope(self.q(x).reshape(B, T, c.heads, c.head_dim), positions, c.rope_base)
    k = decoders.rope(self.k(x).reshape(B, T, c.kv_heads, c.head_dim), positions, c.rope_base)
    v = self.v(x).reshape(B, T, c.kv_heads, c.head_dim)
    return self.o(self.core(q, k, v).reshape(B, T, -1))


def splash_core(c: decoders.DecoderConfig, T: int, interpret: bool, block: int = 512):
  """Splash as a model with [B, T, N, H] activations calls it: heads-major, q pre-scaled, vmapped over B."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  b = min(block, T)
  sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                            block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)  # fmt: skip
  mask = masks.MultiHeadMask([masks.CausalMask((T, T))] * c.heads)
  kernel = splash.make_splash_mha_single_device(mask, block_sizes=sizes, interpret=interpret)
  heads = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731

  def core(q, k, v):
    q = (q.astype(jnp.float32) * c.head_dim**-0.5).astype(q.dtype)
    return heads(jax.vmap(kernel)(heads(q), heads(k), heads(v)))

  return core


def xla_core(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def build(way: str, c: decoders.DecoderConfig, T: int, tokens, positions, interpret):
  """The model (same weights every way) with its attention done `way`."""
  model = decoders.Decoder(c, rngs=nnx.Rngs(0))
  if way == "library":
    fr.convert(model, example=lambda m: decoders.call(m, tokens, positions), **_kernels(interpret))
    return model
  core = splash_core(c, T, bool(interpret)) if way == "splash" else xla_core
  for block in model.blocks:
    swapped = SwappedAttention(c, core, rngs=nnx.Rngs(0))
    nnx.update(swapped, nnx.state(block.attn, nnx.Param))
    block.attn = swapped
  return model


# -- training --------------------------------------------------------------------------------------------


REMAT_POLICIES = {"none": None, "attention": fr.save_attention_residuals, "mask": fr.save_mask_structure}


def forward(model, tokens, positions, remat: bool, policy: str = "none", *, hidden: bool = False):
  """The model's forward, each block rematerialised in the backward with `remat`, saving what `policy`
  (REMAT_POLICIES) names: 'attention', this library's attention output and lse (no other way has them); 'mask', the
  structure recovered from the model's dense mask alone (the backward neither reads nor keeps the mask).
  `hidden`: the final normed hidden states [B, T, d_model], not the logits."""
  if not remat and not hidden:
    return model(tokens, positions)
  T = tokens.shape[1]
  mask = jnp.tril(jnp.ones((1, T, T), bool))
  x = model.embed(tokens)
  run = nnx.remat(lambda block, x: block(x, positions, mask), policy=REMAT_POLICIES[policy])
  for block in model.blocks:
    x = run(block, x) if remat else block(x, positions, mask)
  x = model.norm(x)
  return x if hidden else model.embed.attend(x)


def loss(model, tokens, positions, remat: bool, policy: str = "none", loss_chunk: int = 0):
  """Mean next-token cross-entropy of the training step (every way the same).  `loss_chunk` > 0: over chunks of
  that many positions, each chunk's float32 logits [B, chunk, vocab] recomputed in the backward (a scan of
  checkpointed chunks), so the whole sequence's logits (5 GiB in float32 at 40,960 tokens of a 32,768 vocabulary)
  never live at once; 0: the logits of every position at once."""
  if loss_chunk <= 0:
    logits = forward(model, tokens, positions, remat, policy)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1].astype(jnp.float32), tokens[:, 1:]).mean()
  h = forward(model, tokens, positions, remat, policy, hidden=True)[:, :-1]  # [B, T - 1, D]
  labels = tokens[:, 1:]
  B, n, D = h.shape
  pad = -n % loss_chunk
  h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(B, -1, loss_chunk, D).swapaxes(0, 1)
  labels = jnp.pad(labels, ((0, 0), (0, pad))).reshape(B, -1, loss_chunk).swapaxes(0, 1)
  valid = (jnp.arange(n + pad) < n).reshape(-1, loss_chunk)
  table = model.embed.embedding[...]  # the tied output projection, as `embed.attend` applies it

  @jax.checkpoint
  def chunk(total, xs):
    hc, lc, vc = xs
    logits = jnp.einsum("bcd,vd->bcv", hc, table, preferred_element_type=jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, lc)
    return total + jnp.sum(jnp.where(vc[None], ce, 0.0)), None

  total, _ = jax.lax.scan(chunk, jnp.zeros((), jnp.float32), (h, labels, valid))
  return total / (B * n)


def peak_memory() -> float | None:
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  return None if peak is None else peak / 2**30


def train_inputs(c, batch: int, T: int):
  """(tokens, positions) [batch, T] of a training step: random tokens (seed 0), positions 0 .. T - 1."""
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, c.vocab, (batch, T)), jnp.int32)
  return tokens, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (batch, T))


def trainee(way: str, c, tokens, positions, interpret):
  """(model, AdamW optimizer) of one way, built for these inputs."""
  model = build(way, c, tokens.shape[1], tokens, positions, interpret)
  return model, nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)


def train_table(report, c, args, chip) -> None:
  rows = []
  peak = chip.peak_flops("bfloat16") if chip else None
  for T in args.seq_lens:
    tokens, positions = train_inputs(c, args.batch, T)
    for way in args.ways:
      row = [T, way]
      try:
        model, optimizer = trainee(way, c, tokens, positions, args.interpret)
        run = _train_runner(args.remat, args.remat_policy, args.loss_chunk)
        times, losses = [], []
        for _ in range(args.warmup + args.steps):
          t0 = time.perf_counter()
          loss = run(model, optimizer, tokens, positions)
          losses.append(float(jax.block_until_ready(loss)))
          times.append(time.perf_counter() - t0)
        t = median(times[args.warmup :])
        tok_s = args.batch * T / t
        mfu = c.flops_per_token(T) * tok_s / peak * 100 if peak else None
        row += [t * 1e3, tok_s, mfu, peak_memory(), losses[-1], times[0], ""]
      except Exception as e:  # noqa: BLE001 (an out-of-memory length is a result: the row says so)
        row += [None, None, None, None, None, None, _error(e)]
      rows.append(row)
      report.progress(f"train T={T} {way}: {row[2:]}")
  report.table(
    f"Training {c.name} ({c.params() / 1e6:.0f}M parameters), batch {args.batch}, AdamW, bf16"
    + (f", remat per block (policy: {args.remat_policy})" if args.remat else ""),
    ["T", "attention", "step ms", "tokens/s", "MFU %", "peak GiB", "last loss", "first step s", "notes"],
    rows,
    formats={"step ms": ".1f", "tokens/s": ",.0f", "MFU %": ".1f", "peak GiB": ".2f", "last loss": ".3f"}
    | {"first step s": ".1f"},
    notes=[
      "library: fr.convert(model, example=...) with default choices; splash: make_splash_mha_single_device "
      "(causal, GQA native, blocks of 512, q pre-scaled, vmapped over B) swapped in by hand; xla: "
      "jax.nn.dot_product_attention(is_causal=True).  Step: median of --steps after --warmup.  MFU: "
      "DecoderConfig.flops_per_token (6 x matmul parameters + causal attention as half) x tokens/s over the "
      "chip's bf16 peak.  first step s: the first step's wall time, its compile included (with the persistent "
      "compilation cache on, a second start reads it back).  remat policy 'attention': fr.save_attention_residuals "
      "(the library's attention output and lse saved; the other ways have no such residuals, so it saves nothing "
      "there).",
    ],
  )


def longest_table(report, c, args) -> None:
  """For each way, the longest sequence (doubling from --longest-from up to --longest-cap) that trains one step on
  the chip, and the first that does not, with its error (out of memory, as a rule)."""
  rows = []
  for way in args.ways:
    T, best, failed = args.longest_from, None, ""
    while T <= args.longest_cap:
      tokens, positions = train_inputs(c, args.batch, T)
      try:
        model, optimizer = trainee(way, c, tokens, positions, args.interpret)
        jax.block_until_ready(
          _train_runner(args.remat, args.remat_policy, args.loss_chunk)(model, optimizer, tokens, positions)
        )
        best = T
      except Exception as e:  # noqa: BLE001 (the first length that fails is the result)
        failed = f"T={T}: {_error(e)}"
        break
      finally:
        model = optimizer = None
      report.progress(f"longest {way}: T={T} trained")
      T *= 2
    rows.append([way, best, failed or f"none up to {args.longest_cap}"])
  report.table(
    f"Longest trainable sequence, {c.name}, batch {args.batch}" + (", remat per block" if args.remat else ""),
    ["attention", "longest T", "first failure"],
    rows,
    notes=[f"One AdamW step at T = {args.longest_from}, doubling, up to {args.longest_cap}, each way as in training."],
  )


@functools.cache
def _train_runner(remat: bool, policy: str = "none", loss_chunk: int = 0):
  def loss_fn(model, tokens, positions):
    return loss(model, tokens, positions, remat, policy, loss_chunk)

  @nnx.jit
  def step(model, optimizer, tokens, positions):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, positions)
    optimizer.update(model, grads)
    return loss

  return step


# -- serving ---------------------------------------------------------------------------------------------


def decode_run_tokens(ctx: int, batch: int, rows: int, new_tokens: int) -> int:
  """max_new_tokens of a row's decode run: the prefill's token, then as many as the steps the batch's prefill spans,
  then `new_tokens` (M).  Under continuous batching the first prompts decode while the last ones still prefill (a
  step takes the decodes first and fills its other rows with prompt chunks: at least rows - batch of them), so the
  whole batch decodes together from the last prompt's first token to the first prompt's last: about M steps."""
  span = -(-batch * ctx // max(rows - batch, rows // 2)) + 1
  return 1 + span + new_tokens


def decode_window(engine, prompts, max_new_tokens: int):
  """Streams `prompts` to `max_new_tokens` new tokens each; returns (steps, tokens, seconds, overlapped, generated):
  the engine's pure decode steps (`EngineStats.decode_*`) in which every prompt decoded, from the last prompt's
  first token to the first prompt's last, how many steps the engine dispatched ahead meanwhile
  (`EngineStats.overlapped_steps`), and the mean of the tokens each sequence had generated in them.  Without such a
  step (`max_new_tokens` too few for the batch's prefill), every pure decode step of the run, however many it held."""
  stats, count = engine.stats, [0] * len(prompts)
  counters = lambda: np.array(  # noqa: E731
    [stats.decode_steps, stats.decode_tokens, stats.decode_seconds, stats.overlapped_steps]
  )
  run = start = end = (counters(), 0)  # (the counters, the tokens generated so far)
  for index, _ in engine.stream(prompts, max_new_tokens=max_new_tokens):
    count[index] += 1
    if count[index] == 1 and all(count):  # the last prompt's first token: the next step decodes them all
      start = (counters(), sum(count))
    if count[index] == max_new_tokens and end is run:  # the first prompt's last: its step decoded them all
      end = (counters(), sum(count))
  if end[0][0] - start[0][0] < 1:  # no step of the whole batch: the run's own
    start, end = run, (counters(), max_new_tokens * len(prompts))
  steps, tokens, seconds, overlapped = end[0] - start[0]
  return int(steps), int(tokens), float(seconds), int(overlapped), (start[1] + end[1]) / 2 / len(prompts)


def profile_decode(engine, prompts, max_new_tokens: int, steps: int, trace_dir: str):
  """Traces `steps` pure decode steps of the whole batch (`jax.profiler`, from the step after the last prompt's
  first token); returns (steps traced, their step-call wall seconds, `bench.DeviceTime`).  None for the time
  when the run had no such step."""
  stats, count, start, traced = engine.stats, [0] * len(prompts), None, None
  for index, _ in engine.stream(prompts, max_new_tokens=max_new_tokens):
    count[index] += 1
    if start is None and all(count):
      jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
      start = (stats.decode_steps, stats.decode_seconds)
    if start is not None and traced is None and stats.decode_steps - start[0] >= steps:
      jax.profiler.stop_trace()
      traced = (stats.decode_steps - start[0], stats.decode_seconds - start[1])
  if start is not None and traced is None:  # the run ended first
    jax.profiler.stop_trace()
    traced = (stats.decode_steps - start[0], stats.decode_seconds - start[1])
  if not traced or traced[0] < 1:
    return 0, 0.0, None
  return traced[0], traced[1], bench.device_time(trace_dir)


def profile_table(report, engine, c, ctx, batch, args) -> None:
  """--profile-decode N: where a decode step of the largest batch goes, by device op."""
  rng = np.random.default_rng(ctx * batch)
  prompts = [list(rng.integers(1, c.vocab, ctx)) for _ in range(batch)]
  trace_dir = tempfile.mkdtemp(prefix="real_models_trace_")
  max_new = decode_run_tokens(ctx, batch, max(args.prefill_rows, batch), args.profile_decode + 2)
  steps, seconds, found = profile_decode(engine, prompts, max_new, args.profile_decode, trace_dir)
  title = f"Device time of a decode step: {c.name}, batch {batch}, context {ctx}, page {args.page_size}"
  if found is None or not found.programs:
    report.note(f"{title}: no device trace ({steps} decode steps traced on {jax.default_backend()})")
    return
  per = lambda us: us / steps / 1e3  # noqa: E731  ms a step
  rows = [["(all programs)", per(found.program_us), None, seconds / steps * 1e3]]
  rows += [[name, per(us), runs / steps, None] for name, us, runs in found.top(args.profile_top)]
  report.table(
    title,
    ["op", "device ms a step", "runs a step", "step-call wall ms"],
    rows,
    formats={"device ms a step": ".3f", "runs a step": ".1f", "step-call wall ms": ".2f"},
    notes=[
      f"{steps} pure decode steps of the whole batch traced (jax.profiler; benchmarking.device_time sums the",
      "trace's device ops by name).  The first row: the step programs' device time against the step calls' wall",
      "time (dispatch, input transfers and the read back of the chosen tokens are the difference).",
    ],
  )


# --pages: ServingEngine's merged_pages for each name.
PAGE_LAYOUTS = {"auto": "auto", "kv": "kv", "merged": True, "heads": False}


def serve_table(report, c, args, chip) -> None:
  rows = []
  bw = chip.memory_bandwidth if chip else None
  weight_bytes = c.params() * 2
  kv_token_bytes = c.layers * 2 * c.kv_heads * c.head_dim * 2  # bf16 K and V of one token
  # One engine serves every row: sized for the largest batch and context, its step programs depend on the token
  # bucket alone, so the rows share them (a real-size model's step program takes tens of seconds to compile).
  batch_max, page = max(args.batches), args.page_size
  step_rows = max(args.prefill_rows, batch_max)
  run_tokens = {
    (ctx, b): decode_run_tokens(ctx, b, step_rows, args.new_tokens) for ctx in args.contexts for b in args.batches
  }
  pages_per_seq = max(-(-(ctx + n) // page) for (ctx, _), n in run_tokens.items())
  try:
    model = decoders.Decoder(c, rngs=nnx.Rngs(0))
    probe = jnp.zeros((1, 8), jnp.int32)
    fr.convert(model, to="paged", example=lambda m: decoders.call(m, probe, probe), **_kernels(args.interpret))
    engine = fr.ServingEngine(
      model,
      call=decoders.call,
      num_pages=batch_max * pages_per_seq,
      page_size=page,
      max_num_seqs=batch_max,
      pages_per_seq=pages_per_seq,
      max_num_batched_tokens=step_rows,
      merged_pages=PAGE_LAYOUTS[args.pages],
      overlap=not args.no_overlap,
    )
    # Every bucket by default: a step that mixes decodes and a prompt chunk can land on any of them.
    buckets = engine.token_buckets
    if args.warm_buckets:
      buckets = sorted({engine.rows_for(min(n, step_rows)) for n in args.warm_buckets})
    t0 = time.perf_counter()
    compiled = engine.warmup(buckets=buckets)
    report.progress(f"serve: {compiled} programs compiled in {time.perf_counter() - t0:.1f} s (buckets {buckets})")
  except Exception as e:  # noqa: BLE001
    engine, failed = None, _error(e)
  for ctx in args.contexts:
    for batch in args.batches:
      row = [ctx, batch]
      if engine is None:
        rows.append(row + [None] * 9 + [failed])
        continue
      try:
        rng = np.random.default_rng(ctx + batch)
        fresh = lambda n, rng=rng, ctx=ctx: [list(rng.integers(1, c.vocab, ctx)) for _ in range(n)]  # noqa: E731
        if args.warm_buckets:
          engine.generate(fresh(batch), max_new_tokens=2)  # a bucket the warm-up left out, before any timing
        compiled = engine.stats.compiles
        t0, first = time.perf_counter(), None
        for _ in engine.stream(fresh(1), max_new_tokens=1):
          first = time.perf_counter() - t0 if first is None else first
        t0 = time.perf_counter()
        engine.generate(fresh(batch), max_new_tokens=1)
        short = time.perf_counter() - t0
        stats = engine.stats
        steps0, seconds0, inside0 = stats.steps, stats.seconds, stats.step_seconds
        # Decode: the engine's own count of its pure decode steps (fresh prompts: no pages shared across runs).
        steps, tokens, seconds, overlapped, generated = decode_window(engine, fresh(batch), run_tokens[ctx, batch])
        step = seconds / max(steps, 1)
        decoded = tokens / max(steps, 1)  # sequences a step: the batch, unless the run was too short for it
        # The engine's own work between step calls, per step of that run: the device waits through it.
        host = ((stats.seconds - seconds0) - (stats.step_seconds - inside0)) / max(stats.steps - steps0, 1)
        kv_bytes = decoded * (ctx + generated) * kv_token_bytes
        roofline = (weight_bytes + kv_bytes) / bw if bw else None
        share = roofline / step * 100 if roofline and steps else None
        late = engine.stats.compiles - compiled  # a timed run that compiled: its times are not steady state
        row += [
          decoded,
          tokens / seconds if seconds > 0 else None,
          step * 1e3 if steps else None,
          host * 1e3,
          min(overlapped, steps) / steps * 100 if steps else None,
          share,
          first * 1e3,
          batch * ctx / short,
          f"{late} compiles timed" * bool(late),
        ]
      except Exception as e:  # noqa: BLE001
        row += [None] * 9 + [_error(e)]
      rows.append(row)
      report.progress(f"serve ctx={ctx} batch={batch}: {row[2:]}")
  report.table(
    f"Serving {c.name} with ServingEngine (converted to paged attention"
    f", {args.pages} pages{', overlap off' * args.no_overlap}), "
    f"page {args.page_size}, decode timed over M = {args.new_tokens} steps of the whole batch",
    ["context", "batch", "decode batch", "decode tokens/s", "decode step ms", "host ms/step", "% overlapped"]
    + ["% HBM roofline", "TTFT ms", "prefill tokens/s", "notes"],
    rows,
    formats={"decode batch": ".1f", "decode tokens/s": ",.0f", "decode step ms": ".2f", "host ms/step": ".2f"}
    | {"% overlapped": ".0f"}
    | {"% HBM roofline": ".1f", "TTFT ms": ".1f", "prefill tokens/s": ",.0f"},
    notes=[
      "decode: the engine's pure decode steps (EngineStats.decode_steps / decode_tokens / decode_seconds: steps whose",
      "every row is one new token of a sequence past its prompt; their step-call wall time) of one generate of the",
      "batch's prompts (fresh: no pages shared), counted from the last prompt's first token to the first prompt's",
      "last.  Continuous batching decodes the first prompts beside the later ones' prefill, so the run generates",
      "M + the steps the batch's prefill spans; in those counted steps the whole batch decodes.  decode batch:",
      "decode tokens / decode steps (the batch, unless the run was too short; then every pure decode step counts).",
      "decode tokens/s: decode tokens / decode seconds; decode step ms: decode seconds / decode steps (a step that",
      "overlapped the one before it, `ServingEngine(overlap=True)`, runs from that one's read to its own: the host's",
      "work between them is inside, and host ms/step counts only what is left outside).  % overlapped: the share of",
      "those steps dispatched before the step ahead of them was read (0 with --no-overlap, or where the host could",
      "not vouch for the next step's pages).  % HBM",
      "roofline: the bytes one decode step reads (bf16 weights + the K/V of decode batch sequences at their mean",
      "length) over the chip's bandwidth, against the step.  TTFT: one prompt of `context` tokens to its first token.",
      "prefill tokens/s: batch x context over a run to 1 new token.  host ms/step: the engine's wall time outside its",
      "step calls (scheduling, admission, releases; `EngineStats.seconds - step_seconds`) over the steps of the decode",
      "run: the device waits through it.  One engine serves every row, sized for the largest batch and context (its",
      "step programs depend on the token bucket alone); its warm-up compiles every token bucket (`--warm-buckets`:",
      "only those named, and an untimed run of each batch first).",
    ],  # fmt: skip
  )
  for ctx in args.contexts if engine is not None and args.profile_decode else ():
    profile_table(report, engine, c, ctx, batch_max, args)


def _kernels(interpret: bool) -> dict:
  """convert's options: the library's default choices on a TPU; off one, its Pallas TPU kernels in interpret
  mode (named: interpret= alone is deprecated)."""
  return dict(implementation="pallas_tpu", interpret=True) if interpret else {}


def _error(e: Exception) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}"[:160]


# -- main ------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="qwen", choices=sorted(MODELS))
  p.add_argument("--smoke", action="store_true", help="a tiny model, two steps, tiny batches (CPU)")
  p.add_argument("--tables", default="train,serve", help="of train,serve,longest (the longest trainable sequence)")
  p.add_argument("--ways", default=",".join(WAYS), help="train: of library,splash,xla")
  p.add_argument("--seq-lens", default="8192,32768", help="train: tokens per sequence")
  p.add_argument("--batch", type=int, default=1, help="train: sequences per step")
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--remat", action="store_true", help="train: recompute each block in the backward")
  p.add_argument(
    "--remat-policy",
    default="none",
    choices=sorted(REMAT_POLICIES),
    help="train: what --remat saves (attention: fr.save_attention_residuals; mask: fr.save_mask_structure)",
  )
  p.add_argument(
    "--loss-chunk",
    type=int,
    default=0,
    help="train, longest: the cross-entropy over chunks of this many positions, each chunk's logits recomputed in "
    "the backward (0: all positions' logits at once; at long sequences they, not attention, fill the chip)",
  )
  p.add_argument("--longest-from", type=int, default=8192, help="longest: the first sequence length tried")
  p.add_argument("--longest-cap", type=int, default=131072, help="longest: the last sequence length tried")
  p.add_argument("--layers", type=int, help="the model cut to its first N blocks (check a path before a full run)")
  p.add_argument("--batches", default="1,8,32,64", help="serve: sequences served at once")
  p.add_argument("--contexts", default="2048,8192", help="serve: prompt tokens per sequence")
  p.add_argument(
    "--new-tokens",
    type=int,
    default=64,
    help="serve: M, the decode steps timed with the whole batch (a row's run generates M + the steps its batch's "
    "prefill spans, since its first prompts start decoding that much earlier than its last)",
  )
  p.add_argument(
    "--page-size",
    type=int,
    default=64,
    help="serve: tokens per page (64: on a v5e the 24-block Qwen2.5-0.5B decode step of 64 x 2k ran 9.5 ms on kv "
    "pages of 64 against 15.3 ms on pages of 16, the paged kernel 218 against 451 us a layer)",
  )
  p.add_argument("--prefill-rows", type=int, default=1024, help="serve: max_num_batched_tokens")
  p.add_argument(
    "--warm-buckets",
    default="",
    help="serve: warm only the token buckets that hold these step sizes (e.g. the batches and --prefill-rows) "
    "instead of every bucket: fewer step programs to compile (tens of seconds each at a real size), but a mixed "
    "prefill + decode step at a bucket left out compiles inside a timed run (its notes then say so)",
  )
  p.add_argument(
    "--pages",
    default="auto",
    choices=sorted(PAGE_LAYOUTS),
    help="serve: the caches' page layout (ServingEngine's merged_pages): auto (the library's choice, default), kv "
    "[P, 2, page, K * H], merged [P, page, K * H], heads [P, page, K, H]",
  )
  p.add_argument(
    "--profile-decode",
    type=int,
    default=0,
    metavar="N",
    help="serve: after each context's rows, trace N decode steps of the largest batch and print their device time "
    "by op (jax.profiler)",
  )
  p.add_argument("--profile-top", type=int, default=20, help="serve, --profile-decode: the ops listed")
  p.add_argument(
    "--no-overlap",
    action="store_true",
    help="serve: ServingEngine(overlap=False): each decode step read before the next is dispatched",
  )
  p.add_argument(
    "--paged-fwd-slots",
    type=int,
    default=None,
    metavar="N",
    help="serve: the paged forward's kv slots, N - 1 kv blocks in flight (default: the library's)",
  )
  p.add_argument("--interpret", action="store_true", help="kernels in interpret mode (default off a TPU)")
  bench.add_compilation_cache_args(p)
  bench.add_report_args(p)
  args = p.parse_args(argv)
  ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
  args.seq_lens, args.batches, args.contexts = ints(args.seq_lens), ints(args.batches), ints(args.contexts)
  args.warm_buckets = ints(args.warm_buckets)
  args.ways, args.tables = args.ways.split(","), args.tables.split(",")
  if jax.default_backend() != "tpu":
    args.interpret = True
  if args.smoke:
    args.seq_lens, args.steps, args.warmup = [128], 1, 1  # splash's kv tiles are 128 at least
    args.batches, args.contexts, args.new_tokens, args.prefill_rows = [2], [16], 2, 32
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  cache = bench.compilation_cache_from_args(args)
  if args.paged_fwd_slots is not None:  # an A/B of the paged forward's kv slots (this process only)
    from flax_ringattn._src.backends.pallas_tpu import tiling

    tiling.PAGED_FWD_SLOTS = args.paged_fwd_slots
  c = MODELS[args.model]
  if args.smoke:
    c = decoders.tiny(c, dtype="bfloat16")
  if args.layers:
    c = dataclasses.replace(c, name=f"{c.name}, first {args.layers} blocks", layers=min(args.layers, c.layers))
  report = bench.Report(f"real_models: {c.name} trained and served", json=args.json)
  chip = None
  if jax.default_backend() == "tpu":
    from flax_ringattn._src.backends.pallas_tpu import planners

    gen = planners.current_generation()
    chip = hardware.tpu(gen if gen in hardware.TPU_GENERATIONS else "v5e")
  report.note(f"- machine: {bench.machine()}")
  if "train" in args.tables:
    train_table(report, c, args, chip)
  if "longest" in args.tables:
    longest_table(report, c, args)
  if "serve" in args.tables:
    serve_table(report, c, args, chip)
  if cache is not None:
    report.note(cache.summary())
  return report.finish()


if __name__ == "__main__":
  sys.exit(main())
