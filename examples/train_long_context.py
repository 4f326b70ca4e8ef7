"""Train a small decoder-only Transformer on 8k-token sequences with ring attention.

What it shows
-------------
* A plain Flax NNX Transformer (`examples/_model.py`) whose attention is ring
  attention, swapped in either way the library supports (`--attention`):

  - `layer`: `flax_ringattn.RingMultiHeadAttention(..., mesh=mesh)` in place of
    `nnx.MultiHeadAttention` (the default);
  - `attention_fn`: the stock `nnx.MultiHeadAttention(...,
    attention_fn=flax_ringattn.make_ring_attention_fn(mesh=mesh, ...))`.

  There is no `shard_map` and no kernel code here: the sequence is sharded over
  the mesh axis "sp" and the layers do the rest (`mesh=`).  With
  `--mesh-shape 4,2` the second axis "tp" shards the attention heads
  (`head_axis="tp"`).
* Causal load balancing: the data pipeline reorders every batch once with
  `flax_ringattn.zigzag_order` (tokens, previous tokens, targets and loss mask
  alike) and feeds the position encoding `flax_ringattn.zigzag_positions`; the
  layers get `load_balance=True`.  `--no-load-balance` keeps natural order.
* Packed batches (`--pack`): every row packs several task sequences of
  skewed lengths (documents, told apart by segment ids, positions restarting
  in each).  Zigzag does not balance such a row, so the pipeline reorders it
  with `flax_ringattn.balanced_layout` / `apply_layout` instead, and the
  layers get the reordered positions and segment ids: the mask is evaluated
  on the positions, so the new order is exact.  The imbalance of both
  layouts is printed per stage.
* A synthetic long-range key-value retrieval task, generated on the fly with
  numpy (`KVRetrievalTask`): each sequence draws a fresh table of
  `--num-keys` keys -> values, shows it as (key, value) pairs in at most its
  first quarter, and then asks: the rest of the context is keys whose targets
  are their values, which are not shown again (the last few in (key, value)
  form, the way `serve_paged.py` decodes them).  The loss is on answers only.
  A question d tokens after the last pair (d up to ~8k at 8192) needs more
  than d tokens of context; with less, chance (1 / num_values) is the best.
  `--data-file PATH` trains a byte-level language model on a text file instead.
* A sequence-length curriculum (`--curriculum`; by default 60 steps of
  64 x 128 tokens, 40 of 8 x 1024, then `--steps` 40 of 1 x 8192: the same
  8192 tokens every step).  Many short sequences teach the lookup within a
  few dozen steps; the ring layers then run it unchanged over 8k tokens,
  where it answers questions 4k+ tokens away from their pairs.  Straight at
  1 x 8192 (`--curriculum none`) the answers stay near chance for 60 steps.
* The model (`_model.py`): token embedding plus a projection of the previous
  token's (token shift), sinusoidal positions, pre-norm blocks with
  zero-initialised residual outputs, GQA (4 heads, 2 kv heads, head_dim 16).
* optax AdamW, a tqdm bar with loss and tokens/s, an orbax checkpoint plus the
  `config.json` that `_model.load_model` rebuilds the model from, and a
  loss-curve PNG, all under `--out-dir`.

Run it
------
::

  python examples/train_long_context.py                      # 8 simulated CPU devices, 8192 tokens
  python examples/train_long_context.py --attention attention_fn --mesh-shape 4,2
  python examples/train_long_context.py --data-file some_text_file.txt --curriculum none
  python examples/train_long_context.py --num-processes 2  # 2 JAX processes x 4 CPU devices (gloo)

Without an accelerator (or with `JAX_PLATFORMS=cpu`) the script asks XLA for
8 host devices (or as many as `--mesh-shape` needs) unless `XLA_FLAGS` already
sets `--xla_force_host_platform_device_count`; on GPU/TPU it uses all real
devices.  The default run takes 2-3 minutes on a 2-core CPU.
"""

# ruff: noqa: E402 -- XLA_FLAGS must be set before jax is imported.
from __future__ import annotations

import argparse
import math
import os
import sys


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawTextHelpFormatter):
  """Every option's default in --help; help texts keep their own line breaks."""


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
  p.add_argument(
    "--mesh-shape",
    default=None,
    help="mesh shape: 'n' for ('sp',) or 'n,m' for ('sp', 'tp') with heads on 'tp'; None: all devices on 'sp'",
  )
  p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (default: %(default)s)")
  p.add_argument("--batch-size", type=int, default=1, help="sequences per step (default: %(default)s)")
  p.add_argument("--steps", type=int, default=40, help="training steps at --seq-len (default: %(default)s)")
  p.add_argument("--d-model", type=int, default=64, help="model width (features per token)")
  p.add_argument("--num-layers", type=int, default=2, help="transformer blocks")
  p.add_argument("--num-heads", type=int, default=4, help="query heads per attention layer")
  p.add_argument("--num-kv-heads", type=int, default=2, help="< num-heads: grouped-query attention")
  p.add_argument("--lr", type=float, default=2e-2, help="peak AdamW learning rate (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0, help="weights and training data")
  p.add_argument("--data-file", default=None, help="train a byte-level LM on this text file instead of the KV task")
  p.add_argument(
    "--out-dir", default="runs/train_long_context", help="where the checkpoint, config and loss curve are written"
  )
  p.add_argument("--attention", choices=("layer", "attention_fn"), default="layer", help="swap style")
  p.add_argument("--no-load-balance", action="store_true", help="natural token order instead of zigzag")
  p.add_argument(
    "--pack",
    action="store_true",
    help="pack documents of skewed lengths per row, reordered by balanced_layout (KV task, --attention layer)",
  )
  p.add_argument("--block-q", type=int, default=None, help="query tile of the block kernels; None: the backend's")
  p.add_argument("--block-kv", type=int, default=None, help="key/value tile of the block kernels; None: the backend's")
  p.add_argument(
    "--curriculum",
    default="128:60,1024:40",
    help="warm-up stages 'length:steps,...' run before --steps at --seq-len, at the same tokens per step\n"
    "(short sequences teach the lookup in a few steps); 'none' trains at --seq-len only (default: %(default)s)",
  )
  p.add_argument("--num-keys", type=int, default=8, help="KV task: keys per table (default: %(default)s)")
  p.add_argument("--num-values", type=int, default=64, help="KV task: value vocabulary (default: %(default)s)")
  p.add_argument(
    "--num-processes",
    type=int,
    default=1,
    help="run as N local JAX processes (CPU devices split between them, gloo collectives; see\n"
    "flax_ringattn.launch); on a TPU slice or GPU cluster start one copy per host instead",
  )
  # benchmarking.add_compilation_cache_args's flags, spelled here: parsing runs before JAX may be imported
  p.add_argument("--compilation-cache", default="~/.cache/flax_ringattn/jax-compilation-cache", metavar="DIR",
                 help="JAX's persistent compilation cache: a second start reads compiled programs back")  # fmt: skip
  p.add_argument("--no-compilation-cache", action="store_true", help="compile everything anew, cache nothing")
  args = p.parse_args(argv)
  args.mesh_shape = _parse_mesh_shape(p, args.mesh_shape)
  args.curriculum = _parse_curriculum(p, args.curriculum)
  return args


def _parse_mesh_shape(parser, text):
  if text is None:
    return None
  try:
    shape = tuple(int(s) for s in text.split(","))
  except ValueError:
    parser.error(f"--mesh-shape must be 'n' or 'n,m', got {text!r}")
  if not 1 <= len(shape) <= 2 or min(shape) < 1:
    parser.error(f"--mesh-shape must be 'n' or 'n,m' with positive sizes, got {text!r}")
  return shape


def _parse_curriculum(parser, text):
  if text.strip().lower() in ("", "none"):
    return ()
  try:
    stages = tuple(tuple(int(x) for x in item.split(":")) for item in text.split(","))
  except ValueError:
    parser.error(f"--curriculum must look like '128:30,1024:15' (length:steps,...), got {text!r}")
  if any(len(st) != 2 or min(st) < 0 for st in stages):
    parser.error(f"--curriculum must look like '128:30,1024:15' (length:steps,...), got {text!r}")
  return stages


def request_host_devices(mesh_shape) -> None:
  """Simulate devices on the host CPU; must run before jax is imported.

  Skipped when the user already chose a device count in XLA_FLAGS or asked for
  a non-CPU platform in JAX_PLATFORMS.  (On a GPU/TPU machine with
  JAX_PLATFORMS unset the flag is harmless: it only shapes the CPU backend.)
  """
  flags = os.environ.get("XLA_FLAGS", "")
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if "xla_force_host_platform_device_count" in flags:
    return
  if platforms and "cpu" not in platforms.lower().split(","):
    return
  n = max(8, math.prod(mesh_shape)) if mesh_shape else 8
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def relaunch(args, argv) -> int:
  """--num-processes N: this script again as N processes, each with its share of the CPU devices."""
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from flax_ringattn import launch

  n = math.prod(args.mesh_shape) if args.mesh_shape else 8
  if n % args.num_processes:
    raise SystemExit(f"--num-processes {args.num_processes} must divide the {n} devices of the mesh")
  rest, skip = [], False
  for a in argv:  # drop --num-processes so that the children run the training
    if skip or a.startswith("--num-processes"):
      skip = a == "--num-processes"
      continue
    rest.append(a)
  procs = launch.spawn([sys.executable, os.path.abspath(__file__), *rest], args.num_processes,
                       devices_per_process=n // args.num_processes)  # fmt: skip
  codes = launch.wait_all(procs)
  return next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
  ARGS = parse_args()
  if ARGS.num_processes > 1:
    sys.exit(relaunch(ARGS, sys.argv[1:]))
  request_host_devices(ARGS.mesh_shape)

import dataclasses
import json
import pathlib
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

try:
  import flax_ringattn
except ImportError:  # running from a source checkout without `pip install -e .`
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  import flax_ringattn
from flax_ringattn import benchmarking

if str(pathlib.Path(__file__).resolve().parent) not in sys.path:
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _model

SEQ_AXIS, HEAD_AXIS = "sp", "tp"

# A process started by `--num-processes` / `python -m flax_ringattn.launch` joins the others here (no-op otherwise).
from flax_ringattn.launch import initialize_from_env

if __name__ == "__main__":
  initialize_from_env()
MAIN = jax.process_index() == 0 if __name__ == "__main__" else True


# ------------------------------------------------------------------------------------------
# Data: every task returns numpy [B, T] arrays in natural order.


@dataclasses.dataclass(frozen=True)
class KVRetrievalTask:
  """Long-range key-value retrieval, generated on the fly.

  Token ids: 0 BOS, then `num_keys` keys and `num_values` values.  Each
  sequence (T + 1 tokens; `tokens` are the first T) draws a fresh key -> value
  table and lays out

      BOS k3 v7 k1 v4 k6 v2 ... k1 v4 | k6 k3 k3 k1 ... k6 k1 | k2 v5 k6 v2 ... k3 v7
      |--- pairs: the table ------| |--- questions -------| |--- last questions ---|

  * `num_pairs` (key, value) pairs, every key at least once (default: a
    different number for every sequence, log-uniform from 2 * num_keys to
    T / 8, i.e. at most the first quarter of the tokens);
  * questions: key tokens whose target is their value, which is not shown;
  * `num_queries` last questions (distinct keys) in (key, value) form, as a
    server decodes them (`serve_paged.py` feeds each answer back before the
    next key); `mask` marks these keys.

  The loss (`weights`) is on every key whose value was shown before: the
  table's repeated keys, the questions and the last questions.  A question d
  tokens after the last pair (d up to ~8k at T = 8192) needs more than d
  tokens of context: with less, chance (1 / num_values) is the best.  `probe` marks the questions
  more than T / 2 tokens after the last pair, whose accuracy is reported.
  """

  seq_len: int
  num_keys: int = 8
  num_values: int = 64
  num_pairs: int | None = None
  num_queries: int = 8

  BOS = 0

  @property
  def vocab_size(self) -> int:
    return 1 + self.num_keys + self.num_values

  @property
  def max_pairs(self) -> int:
    return self.num_pairs if self.num_pairs is not None else max(2 * self.num_keys, self.seq_len // 8)

  def __post_init__(self):
    if not 1 <= self.num_queries <= self.num_keys:
      raise ValueError(f"need 1 <= num_queries={self.num_queries} <= num_keys={self.num_keys}")
    if self.max_pairs < self.num_keys:
      raise ValueError(f"num_pairs={self.num_pairs} must be >= num_keys={self.num_keys} (every key shown)")
    if 1 + 2 * self.max_pairs + 2 * self.num_queries > self.seq_len:
      raise ValueError(f"seq_len={self.seq_len} is too short for {self.max_pairs} pairs and {self.num_queries} queries")

  def sample(self, rng: np.random.Generator, batch: int) -> dict[str, np.ndarray]:
    T, K, Q = self.seq_len, self.num_keys, self.num_queries
    out = {k: np.zeros((batch, T), np.float32) for k in ("weights", "probe", "mask")}
    seq = np.zeros((batch, T + 1), np.int64)
    targets = np.zeros((batch, T), np.int64)
    for b in range(batch):
      if self.num_pairs is None:
        D = int(np.exp(rng.uniform(np.log(2 * K), np.log(self.max_pairs))))
      else:
        D = self.num_pairs
      q0, q1 = 1 + 2 * D, T + 1 - 2 * Q  # first question, first of the last questions
      table = 1 + K + rng.integers(0, self.num_values, size=K)
      # Every key at least once: concatenated random permutations of the keys.
      keys = np.concatenate([rng.permutation(K) for _ in range(-(-D // K))])[:D]
      seq[b, 1:q0:2], seq[b, 2:q0:2] = 1 + keys, table[keys]
      asked = rng.integers(0, K, size=q1 - q0)
      seq[b, q0:q1] = 1 + asked
      last = rng.choice(K, size=Q, replace=False)
      seq[b, q1::2], seq[b, q1 + 1 :: 2] = 1 + last, table[last]
      targets[b] = seq[b, 1:]  # next tokens, except for the questions:
      targets[b, q0:q1] = table[asked]
      # Loss on every key whose value is known by then: the keys of the table
      # after their first pair, the questions and the last questions.
      answers = np.zeros(T, np.float32)
      answers[1 + 2 * K : q0 : 2] = answers[q0:q1] = answers[q1::2] = 1.0
      out["weights"][b] = answers / answers.sum()
      out["probe"][b, q0 + T // 2 :] = answers[q0 + T // 2 :]
      out["mask"][b, q1::2] = 1.0
    return {"tokens": seq[:, :-1], "targets": targets, **out}


@dataclasses.dataclass(frozen=True)
class TextFileTask:
  """Byte-level next-token prediction on random windows of a text file."""

  seq_len: int
  data: np.ndarray  # uint8 bytes of the file

  vocab_size = 256
  BOS = 0

  @classmethod
  def from_file(cls, path, seq_len: int) -> TextFileTask:
    data = np.frombuffer(pathlib.Path(path).read_bytes(), np.uint8)
    if data.size < seq_len + 1:
      raise SystemExit(f"--data-file {path} has {data.size} bytes; --seq-len {seq_len} needs at least {seq_len + 1}")
    return cls(seq_len, data)

  def sample(self, rng: np.random.Generator, batch: int) -> dict[str, np.ndarray]:
    T = self.seq_len
    starts = rng.integers(0, self.data.size - T, size=batch)
    seq = np.stack([self.data[s : s + T + 1] for s in starts]).astype(np.int32)
    ones = np.ones((batch, T), np.float32)
    return {"tokens": seq[:, :-1], "targets": seq[:, 1:], "weights": ones / T, "probe": ones}


def pack_lengths(rng, T: int, granule: int = 16, shortest: int = 64) -> list[int]:
  """Skewed document lengths that fill T: a long one, then ever shorter ones (multiples of `granule`)."""
  lengths, left = [], T
  while left >= 2 * shortest:
    L = int(rng.uniform(0.3, 0.7) * left) // granule * granule
    L = max(shortest, min(L, left - shortest))
    lengths.append(L)
    left -= L
  return [*lengths, left]


def make_packed_batch(task, rng, batch_size: int, num_shards: int) -> tuple[dict[str, np.ndarray], object]:
  """Rows of packed documents (positions restart in each), reordered by `balanced_layout`; also the layout."""
  T = task.seq_len
  rows = []
  for _ in range(batch_size):
    docs = []
    for i, L in enumerate(pack_lengths(rng, T)):
      doc = {k: v[0] for k, v in dataclasses.replace(task, seq_len=L).sample(rng, 1).items()}
      doc["prev_tokens"] = _model.previous_tokens(doc["tokens"][None], bos=task.BOS)[0]
      doc["positions"] = np.arange(L)
      doc["segment_ids"] = np.full(L, i)
      docs.append(doc)
    rows.append({k: np.concatenate([d[k] for d in docs]) for k in docs[0]})
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  batch["weights"] = batch["weights"] / batch_size  # each document's answers weigh the same
  layout = flax_ringattn.balanced_layout(batch["segment_ids"].astype(np.int32), num_shards)
  batch = {k: flax_ringattn.apply_layout(v, layout) for k, v in batch.items()}
  floats = ("weights", "probe", "mask")
  return {k: np.asarray(v, np.float32 if k in floats else np.int32) for k, v in batch.items()}, layout


def make_batch(task, rng, batch_size: int, num_shards: int, load_balance: bool) -> dict[str, np.ndarray]:
  """A task batch plus previous tokens and positions, in zigzag order when load balancing."""
  batch = task.sample(rng, batch_size)
  batch["prev_tokens"] = _model.previous_tokens(batch["tokens"], bos=task.BOS)
  T = task.seq_len
  if load_balance:
    # Reorder once, on the host: every [B, T] array moves the same way, and the
    # positions say where each token really sits.
    batch = {k: flax_ringattn.zigzag_order(v, num_shards, axis=1) for k, v in batch.items()}
    positions = flax_ringattn.zigzag_positions(T, num_shards)
  else:
    positions = np.arange(T, dtype=np.int32)
  batch["positions"] = np.broadcast_to(positions, (batch_size, T))
  floats = ("weights", "probe", "mask")
  return {k: np.asarray(v, np.float32 if k in floats else np.int32) for k, v in batch.items()}


def schedule_stages(args, granule: int) -> list[tuple[int, int, int]]:
  """(seq_len, batch_size, steps) per stage: the `--curriculum` warm-up, then `--steps` at `--seq-len`.

  Shorter stages keep the tokens per step: batch_size * seq_len / length sequences.
  """
  stages = []
  tokens = args.batch_size * args.seq_len
  for length, steps in args.curriculum:
    if length >= args.seq_len or steps == 0:
      continue
    if length % granule:
      raise SystemExit(f"--curriculum length {length} must be a multiple of {granule} on this mesh")
    stages.append((length, max(1, tokens // length), steps))
  stages.append((args.seq_len, args.batch_size, args.steps))
  return stages


# ------------------------------------------------------------------------------------------
# Mesh, model, training step.


def make_mesh(mesh_shape):
  devices = jax.devices()
  if mesh_shape is None:
    mesh_shape = (len(devices),)
  if math.prod(mesh_shape) > len(devices):
    raise SystemExit(f"--mesh-shape {mesh_shape} needs {math.prod(mesh_shape)} devices, have {len(devices)}")
  names = (SEQ_AXIS, HEAD_AXIS)[: len(mesh_shape)]
  # Auto axes: shardings are hints that XLA propagates; nothing to annotate in a training script.
  auto = (jax.sharding.AxisType.Auto,) * len(mesh_shape)
  return jax.make_mesh(mesh_shape, names, axis_types=auto, devices=devices[: math.prod(mesh_shape)])


def to_mesh(x, sharding):
  """`x` (the same value on every process) on `sharding`, which may span processes."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return jax.device_put(x, sharding)
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def place_on_mesh(tree, mesh):
  """Puts an nnx state on the mesh: heads on 'tp' where the metadata says so, the rest replicated."""
  specs = nnx.get_partition_spec(tree)
  return jax.tree.map(lambda x, s: to_mesh(x, NamedSharding(mesh, s)), tree, specs)


@nnx.jit
def train_step(model, optimizer, batch):
  def loss_fn(model):
    mask = {"segment_ids": batch["segment_ids"]} if "segment_ids" in batch else {}
    logits = model(batch["tokens"], batch["positions"], batch["prev_tokens"], **mask).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    loss = (ce * batch["weights"]).sum() / batch["weights"].sum()
    hit = logits.argmax(-1) == batch["targets"]
    probe = batch["probe"]
    return loss, (hit * probe).sum() / jnp.maximum(probe.sum(), 1.0)

  (loss, accuracy), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return loss, accuracy


def save_loss_curve(path, history, stages, chance, accuracy_label):
  """Loss (log scale) and probe accuracy per step; the curriculum stages are shaded and labelled."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = np.arange(1, len(history["loss"]) + 1)
  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 3.8))
  ax_loss.plot(steps, history["loss"])
  ax_loss.set(xlabel="step", ylabel="cross-entropy", title="training loss", yscale="log")
  ax_acc.plot(steps, history["accuracy"])
  if chance is not None:
    ax_acc.axhline(chance, color="gray", ls="--", label="chance")
    ax_acc.legend(loc="center right")
  ax_acc.set(xlabel="step", ylabel="accuracy", title=accuracy_label, ylim=(0, 1.05))
  first = 0
  for i, (length, batch, n) in enumerate(stages):
    for ax in (ax_loss, ax_acc):
      ax.axvspan(first + 0.5, first + n + 0.5, alpha=0.06 + 0.06 * (i % 2), color="C1", lw=0)
      ax.annotate(f"{batch}x{length}", (first + 1.5, 0.02), xycoords=("data", "axes fraction"), fontsize=8)
    first += n
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def main(args: argparse.Namespace) -> dict:
  cache = benchmarking.compilation_cache_from_args(args)  # a second start reads compiled programs
  metrics = _train(args)
  if cache is not None and MAIN:
    print(cache.summary())
  return metrics


def _train(args: argparse.Namespace) -> dict:
  out_dir = pathlib.Path(args.out_dir).resolve()
  out_dir.mkdir(parents=True, exist_ok=True)
  mesh = make_mesh(args.mesh_shape)
  num_shards = mesh.shape[SEQ_AXIS]
  head_axis = HEAD_AXIS if HEAD_AXIS in mesh.axis_names else None
  load_balance = not args.no_load_balance
  granule = 2 * num_shards if load_balance else num_shards
  if args.seq_len % granule:
    raise SystemExit(f"--seq-len {args.seq_len} must be a multiple of {granule} on a ring of {num_shards}")
  stages = schedule_stages(args, granule)

  if args.pack and (args.data_file or args.attention != "layer"):
    raise SystemExit(
      "--pack packs KV-task documents and passes their positions to the ring layer: use it without "
      "--data-file, with --attention layer"
    )
  if args.data_file:
    task = TextFileTask.from_file(args.data_file, args.seq_len)
    chance, accuracy_label = None, "next-byte accuracy"
  else:
    task = KVRetrievalTask(args.seq_len, num_keys=args.num_keys, num_values=args.num_values)
    chance, accuracy_label = 1 / task.num_values, "retrieval accuracy, answers > T/2 from their pairs"

  config = _model.ModelConfig(
    vocab_size=task.vocab_size,
    d_model=args.d_model,
    num_layers=args.num_layers,
    num_heads=args.num_heads,
    num_kv_heads=args.num_kv_heads,
  )
  tiles = {k: v for k, v in (("block_q", args.block_q), ("block_kv", args.block_kv)) if v is not None}
  block_sizes = flax_ringattn.BlockSizes(**tiles) if tiles else None  # None: the backend picks
  ring = dict(
    mesh=mesh,
    seq_axis=SEQ_AXIS,
    head_axis=head_axis,
    load_balance=load_balance,
    block_sizes=block_sizes,
  )
  if args.attention == "layer":
    attention = _model.ring_attention_layer(**ring)
  else:
    attention = _model.ring_attention_fn(**ring)
  model = _model.Transformer(config, attention, rngs=nnx.Rngs(args.seed))
  nnx.update(model, place_on_mesh(nnx.state(model), mesh))
  total_steps = sum(n for _, _, n in stages)
  warmup = min(5, total_steps // 2)
  lr = optax.warmup_cosine_decay_schedule(args.lr / 10, args.lr, warmup, max(total_steps, warmup + 1), args.lr / 10)
  optimizer = nnx.Optimizer(model, optax.adamw(lr, b1=0.8, b2=0.98, weight_decay=0.01), wrt=nnx.Param)
  nnx.update(optimizer, place_on_mesh(nnx.state(optimizer), mesh))
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  say = print if MAIN else (lambda *a, **k: None)

  say(
    f"devices: {mesh.devices.size} x {mesh.devices.flat[0].platform}, mesh {dict(mesh.shape)}, "
    f"attention={args.attention}, load_balance={load_balance}"
  )
  say(
    f"task: {f'byte LM on {args.data_file}' if args.data_file else 'key-value retrieval'}; model: {n_params:,} params"
  )
  plan = " -> ".join(f"{n} steps of {b}x{length}" for length, b, n in stages)
  say(f"schedule: {plan} ({args.seq_len // num_shards} tokens per device at {args.seq_len})")

  from tqdm import tqdm

  rng = np.random.default_rng(args.seed)
  data_sharding = NamedSharding(mesh, P(None, SEQ_AXIS))
  history = {"loss": [], "accuracy": [], "seq_len": [], "seconds": []}
  start = time.perf_counter()
  bar = tqdm(total=total_steps, desc="train", unit="step", dynamic_ncols=True, disable=not MAIN)
  for length, batch_size, steps in stages:
    stage_task = dataclasses.replace(task, seq_len=length)
    for step in range(steps):
      if args.pack:
        batch, layout = make_packed_batch(stage_task, rng, batch_size, num_shards)
        if step == 0:
          segments = flax_ringattn.undo_layout(batch["segment_ids"], layout)
          zigzag = flax_ringattn.layout_imbalance(
            segments, flax_ringattn.zigzag_positions(length, num_shards), num_shards
          )
          say(f"packed {batch_size}x{length}: balanced layout imbalance {layout.imbalance:.3f} (zigzag {zigzag:.3f})")
      else:
        batch = make_batch(stage_task, rng, batch_size, num_shards, load_balance)
      batch = {k: to_mesh(v, data_sharding) for k, v in batch.items()}
      t0 = time.perf_counter()
      loss, accuracy = train_step(model, optimizer, batch)
      loss, accuracy = float(loss), float(accuracy)
      dt = time.perf_counter() - t0
      for k, v in (("loss", loss), ("accuracy", accuracy), ("seq_len", length), ("seconds", dt)):
        history[k].append(v)
      bar.set_postfix(
        {"len": length, "loss": f"{loss:.3f}", "acc": f"{accuracy:.2f}", "tok/s": f"{batch_size * length / dt:,.0f}"}
      )
      bar.update()
  bar.close()
  total = time.perf_counter() - start

  # Throughput at the target length, without each length's first (compiling) step.
  final = [dt for dt, length in zip(history["seconds"], history["seq_len"], strict=True) if length == args.seq_len]
  timed = final[1:] or final
  tokens_per_second = args.batch_size * args.seq_len * len(timed) / sum(timed)

  # Checkpoint (orbax wants an absolute path; a rerun replaces it), config next to it, loss curve.
  import orbax.checkpoint as ocp

  ckpt_dir = out_dir / _model.CHECKPOINT_NAME
  if ckpt_dir.exists():
    shutil.rmtree(ckpt_dir)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(ckpt_dir, nnx.state(model, nnx.Param))
  checkpointer.wait_until_finished()
  checkpointer.close()
  config_path = out_dir / _model.CONFIG_NAME
  png = out_dir / "loss.png"
  metrics = {**history, "chance_accuracy": chance, "total_seconds": total, "tokens_per_second": tokens_per_second}
  metrics["args"] = {k: v for k, v in vars(args).items()}
  if not MAIN:  # every process trained and checkpointed its shards; one writes the files and reports
    return metrics
  _model.save_config(config, out_dir)
  save_loss_curve(png, history, stages, chance, accuracy_label)
  (out_dir / "metrics.json").write_text(json.dumps(metrics) + "\n")

  loss, acc = history["loss"], history["accuracy"]
  k = min(5, args.steps)
  print(f"first loss: {loss[0]:.4f}")
  print(f"last loss: {loss[-1]:.4f} (mean of the last {k} steps: {np.mean(loss[-k:]):.4f})")
  chance_note = f", chance {chance:.3f}" if chance is not None else ""
  print(
    f"{accuracy_label}: {acc[0]:.3f} -> {acc[-1]:.3f} (mean of the last {k} steps: {np.mean(acc[-k:]):.3f}{chance_note})"
  )
  print(
    f"wall time: {total_steps} steps in {total:.1f}s; {tokens_per_second:,.0f} tokens/s at {args.batch_size}x{args.seq_len}"
  )
  print(f"checkpoint: {ckpt_dir}")
  print(f"config: {config_path}")
  print(f"loss curve: {png}")
  return metrics


if __name__ == "__main__":
  main(ARGS)
