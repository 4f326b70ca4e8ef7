"""Sequence-length scaling of ring attention vs. two alternatives, on simulated CPU devices.

What it measures
----------------
For every sequence length T (default 2k..32k) and for causal and non-causal
attention, the forward+backward pass ``jax.grad(sum(attn(q, k, v) * g))`` with
respect to q, k and v, with B=1, 4 heads, head_dim 64, float32, on 8 simulated
host devices (``--xla_force_host_platform_device_count=8``), q/k/v sharded
along the sequence axis of a 1-D mesh ``("sp",)``.  Implementations, timed side
by side in the same run (repeats outer loop, implementations inner loop):

* ``ring``      -- ``flax_ringattn.ring_attention(..., mesh=mesh, axis_name="sp")``
* ``ring+lb``   -- the same with ``load_balance=True`` (causal only; inputs are
                   treated as already zigzag-ordered, which does not matter for
                   timing)
* ``allgather`` -- ``jax.nn.dot_product_attention`` under ``jax.jit`` on the
                   sharded inputs; XLA all-gathers K/V and materialises the
                   ``[T/8, T]`` scores on every device
* ``haoliu``    -- ``ringattention_jax`` from haoliu's ``ringattention==0.1.2``
                   (the pure-JAX blockwise ring used on CPU), inside
                   ``jax.shard_map``, query/key chunks of 256.  Optional: install
                   it outside the project, e.g.
                   ``pip install --no-deps --target /tmp/haoliu_pkg ringattention==0.1.2``
                   and pass ``--haoliu-path /tmp/haoliu_pkg``.  Its ``__init__``
                   calls ``jax.lib.xla_bridge``, gone from current JAX; the
                   script restores that alias before importing it.

Columns: per-device temp memory (``compiled.memory_analysis()``), median wall
time (compile and a warm-up call excluded), achieved GFLOP/s and the fraction
of this machine's f32 matmul rate (measured first, one device, 2048^3), and the
bytes each device sends, read from the compiled HLO (collectives inside while
loops are multiplied by XLA's ``known_trip_count``).  A second table checks the
project's performance targets.  Configurations whose estimated host memory
(8 x per-device footprint) exceeds ``--mem-limit-gib`` are reported as
``OOM-skip``; a failing row is reported and does not stop the table.

Run it::

  python benchmarks/ring_scaling.py --quick            # smoke run, T=512,1024
  python benchmarks/ring_scaling.py                    # full table (slow on CPU)
  python benchmarks/ring_scaling.py --seq-lens 2048,8192 --impls allgather,haoliu \
      --haoliu-path /tmp/haoliu_pkg

The simulated devices share the host's cores, so absolute times say little
about accelerators; the ratios between implementations, memory and
communication volume are the point.
"""

# ruff: noqa: E402 -- XLA_FLAGS must be set before jax is imported.
from __future__ import annotations

import os

NUM_DEVICES = 8


def _force_host_devices(num_devices: int) -> None:
  """Ask XLA for `num_devices` host devices; must run before jax is imported."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    flag = f"--xla_force_host_platform_device_count={num_devices}"
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


_force_host_devices(NUM_DEVICES)

import argparse
import dataclasses
import functools
import importlib
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "sp"
BATCH = 1
HEADS = 4
HEAD_DIM = 64
DTYPE = jnp.float32
ITEMSIZE = 4
DEFAULT_SEQ_LENS = (2048, 4096, 8192, 16384, 32768)
QUICK_SEQ_LENS = (512, 1024)
ALL_IMPLS = ("ring", "ring+lb", "allgather", "haoliu")
MATMUL_N = 2048
MIB = 2**20
GIB = 2**30
# FLOP model, identical for every implementation: forward 4*B*N*T*S*H (QK^T and
# PV), backward 10*B*N*T*S*H (2.5x forward: recompute QK^T, dV, dP, dQ, dK);
# causal counts half (useful FLOPs only).
FWD_FLOP_FACTOR = 4
BWD_FLOP_FACTOR = 10
HAOLIU_INSTALL = "pip install --no-deps --target /tmp/haoliu_pkg ringattention==0.1.2"

# Exit status: 0 = outputs correct and every measured target met (with --quick: outputs correct); 1 = an output
# differs from the reference (nothing is timed); 3 = a target was missed.  (2 is argparse's usage error.)
EXIT_WRONG_RESULT = 1
EXIT_TARGET_MISSED = 3

Attention = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass
class Row:
  """One (implementation, T, causal) configuration and what was measured."""

  impl: str
  seq_len: int
  causal: bool
  compiled: Any = None
  temp_bytes: int | None = None
  footprint_bytes: int | None = None
  sent: CommVolume | None = None
  times: list[float] = dataclasses.field(default_factory=list)
  status: str = ""  # Non-empty: "OOM-skip", "error: ..."; the row is not timed.


@dataclasses.dataclass
class CommVolume:
  """Bytes one device sends during one call, summed over collectives."""

  total: float = 0.0
  estimated: bool = False  # Contains a ring estimate (all-reduce, reduce-scatter, all-to-all).
  unknown_trips: bool = False  # A while loop without known_trip_count was counted once.

  def add(self, other: CommVolume, times: float = 1.0) -> None:
    self.total += times * other.total
    self.estimated |= other.estimated
    self.unknown_trips |= other.unknown_trips


# ------------------------------------------------------------------------------------------
# FLOP and communication models.


def attention_flops(seq_len: int, causal: bool) -> float:
  """Useful fwd+bwd FLOPs of global attention (the same model for every implementation)."""
  flops = (FWD_FLOP_FACTOR + BWD_FLOP_FACTOR) * BATCH * HEADS * seq_len * seq_len * HEAD_DIM
  return flops / 2 if causal else flops


def ideal_ring_bytes(seq_len: int, num_devices: int = NUM_DEVICES) -> tuple[float, float]:
  """Bytes each device sends in an ideal ring: (forward only, forward + backward).

  The forward passes each K and V block on N-1 times, i.e. (N-1)/N of the global
  K and V.  The backward passes K and V on N-1 times again and the f32 dK/dV
  accumulators N times (they travel a full circle back to their owner).
  """
  block = BATCH * (seq_len // num_devices) * HEADS * HEAD_DIM * ITEMSIZE  # One K (or V) shard.
  fwd = 2 * (num_devices - 1) * block
  bwd = 2 * (num_devices - 1) * block + 2 * num_devices * block
  return fwd, fwd + bwd


# ------------------------------------------------------------------------------------------
# Collective traffic from compiled HLO text.

_DTYPE_BYTES = {
  "pred": 1,
  "s4": 0.5,
  "u4": 0.5,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY_SHAPE_RE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_CALLEE_RE = re.compile(r"\b(body|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_PAIRS_RE = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_COLLECTIVES = ("collective-permute", "all-gather", "all-reduce", "reduce-scatter", "all-to-all")


def _shape_bytes(shape: str) -> float:
  """Total bytes of an HLO shape string (arrays or tuples of arrays)."""
  total = 0.0
  for dtype, dims in _ARRAY_SHAPE_RE.findall(shape):
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    total += count * _DTYPE_BYTES.get(dtype, 4 if dtype.startswith("f") else 0)
  return total


def _matching_paren(text: str, start: int) -> int:
  """Index of the parenthesis closing the one at `text[start]`."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i
  return len(text)


def _split_instruction(rhs: str) -> tuple[str, str, str, str]:
  """Splits 'SHAPE opcode(operands), attrs' into its four parts."""
  if rhs.startswith("("):  # Tuple shape.
    end = _matching_paren(rhs, 0)
    shape, rest = rhs[: end + 1], rhs[end + 1 :].lstrip()
  else:
    shape, _, rest = rhs.partition(" ")
  match = re.match(r"([\w\-]+)\(", rest)
  if not match:
    return shape, "", "", rest
  end = _matching_paren(rest, match.end() - 1)
  return shape, match.group(1), rest[match.end() : end], rest[end + 1 :]


def _group_size(attrs: str, num_devices: int) -> int:
  """Devices per replica group, from any of XLA's replica_groups spellings."""
  match = re.search(r"replica_groups=(\S+)", attrs)
  if not match or match.group(1).startswith("{}"):
    return num_devices
  text = attrs[match.start(1) :]
  if text.startswith("{{"):  # {{0,1,2,3},{4,5,6,7}}
    return len(text[2 : text.index("}")].split(","))
  if text.startswith("["):  # [num_groups,group_size]<=[N]
    return int(text[1 : text.index("]")].split(",")[-1])
  if text.startswith("mesh["):  # mesh['a'=1,'b'=8] {'b'}
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", text[: text.index("]")]))
    axes = re.match(r"mesh\[[^\]]*\]\s*\{([^}]*)\}", text)
    names = re.findall(r"'([^']+)'", axes.group(1)) if axes else []
    size = 1
    for name in names:
      size *= int(sizes[name])
    return size
  return num_devices


def _collective_bytes(opcode: str, shape: str, operand_bytes: float, attrs: str, num_devices: int) -> CommVolume:
  """Bytes one device sends for a single collective instruction."""
  base = opcode.removesuffix("-start")
  if base == "collective-permute":
    match = _PAIRS_RE.search(attrs)
    pairs = re.findall(r"\{(\d+),(\d+)\}", match.group(1)) if match else []
    senders = sum(1 for src, dst in pairs if src != dst)
    return CommVolume(operand_bytes * senders / num_devices)
  n = _group_size(attrs, num_devices)
  if base == "all-gather":
    output = _shape_bytes(shape) - (operand_bytes if opcode.endswith("-start") else 0)
    return CommVolume(output - operand_bytes)
  if base == "all-reduce":
    return CommVolume(2 * (n - 1) / n * operand_bytes, estimated=True)
  # reduce-scatter and all-to-all: each device sends (n-1)/n of its input in a ring.
  return CommVolume((n - 1) / n * operand_bytes, estimated=True)


def collective_volume(hlo_text: str, num_devices: int = NUM_DEVICES) -> CommVolume:
  """Bytes sent per device by one execution of a compiled (SPMD) HLO module.

  Collectives inside a while body count once per trip (XLA's `known_trip_count`
  backend annotation; a loop without it is counted once and flagged), and a
  conditional counts its most expensive branch.  `-done` halves of async pairs
  are ignored.
  """
  shapes: dict[str, str] = {}
  own: dict[str, CommVolume] = {}
  calls: dict[str, list[tuple[list[str], int | None]]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    comp = _COMPUTATION_RE.match(line)
    if comp and not line.startswith(" "):
      current = comp.group(1)
      own[current], calls[current] = CommVolume(), []
      if line.startswith("ENTRY"):
        entry = current
      continue
    inst = _INSTRUCTION_RE.match(line)
    if current is None or not inst:
      continue
    name, rhs = inst.groups()
    shape, opcode, operands, attrs = _split_instruction(rhs)
    shapes[name] = shape
    if opcode.removesuffix("-start") in _COLLECTIVES:
      operand_bytes = sum(_shape_bytes(shapes.get(op, "")) for op in re.findall(r"%([\w.\-]+)", operands))
      own[current].add(_collective_bytes(opcode, shape, operand_bytes, attrs, num_devices))
    if opcode == "while":
      trips = _TRIP_COUNT_RE.search(attrs)
      body = re.search(r"\bbody=%?([\w.\-]+)", attrs)
      calls[current].append(([body.group(1)], int(trips.group(1)) if trips else None))
    elif opcode == "conditional":
      branches = _BRANCHES_RE.search(attrs)
      names = re.findall(r"%?([\w.\-]+)", branches.group(1)) if branches else [m[1] for m in _CALLEE_RE.findall(attrs)]
      calls[current].append((names, 1))
    else:
      for kind, callee in _CALLEE_RE.findall(attrs):
        if kind == "calls":
          calls[current].append(([callee], 1))

  @functools.cache
  def volume(comp: str) -> CommVolume:
    total = CommVolume()
    total.add(own.get(comp, CommVolume()))
    for callees, trips in calls.get(comp, []):
      branch = max((volume(c) for c in callees), key=lambda v: v.total, default=CommVolume())
      total.add(branch, trips or 1)
      total.unknown_trips |= trips is None
    return total

  return volume(entry) if entry else CommVolume()


# ------------------------------------------------------------------------------------------
# Implementations: each returns attention on global [B, T, N, H] arrays sharded along T.


def import_flax_ringattn() -> bool:
  """Makes `flax_ringattn` importable, falling back to the checkout this script lives in."""
  try:
    importlib.import_module("flax_ringattn")
  except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
      importlib.import_module("flax_ringattn")
    except ImportError as e:
      print(f"ring: flax_ringattn not importable ({e}); skipping ring rows")
      return False
  return True


def make_ring(mesh, causal: bool, load_balance: bool, block_sizes: tuple[int, int] | None) -> Attention:
  import flax_ringattn  # Imported lazily: optional while the package is being written.

  kwargs: dict[str, Any] = {
    "mesh": mesh,
    "axis_name": AXIS,
    "is_causal": causal,
    "load_balance": load_balance,
  }
  if block_sizes is not None:
    kwargs["block_sizes"] = flax_ringattn.BlockSizes(block_q=block_sizes[0], block_kv=block_sizes[1])
  return functools.partial(flax_ringattn.ring_attention, **kwargs)


def make_allgather(causal: bool) -> Attention:
  return functools.partial(jax.nn.dot_product_attention, is_causal=causal)


def load_haoliu(path: str | None):
  """Returns haoliu's `ringattention_jax`, or None (with a message) if unavailable."""
  if path:
    sys.path.insert(0, path)
  if not hasattr(jax.lib, "xla_bridge"):
    # ringattention/__init__.py calls jax.lib.xla_bridge.get_backend(), removed from JAX.
    jax.lib.xla_bridge = jax._src.xla_bridge
  try:
    import ringattention
  except ImportError as e:
    print(f"haoliu: not installed ({e}); {HAOLIU_INSTALL} and pass --haoliu-path /tmp/haoliu_pkg")
    return None
  return ringattention.ringattention_jax


def make_haoliu(ring_fn, mesh, causal: bool, seq_len: int, chunk: int) -> Attention:
  chunk = min(chunk, seq_len // mesh.size)
  blockwise_kwargs = {
    "causal_block_size": 1 if causal else None,  # None disables its causal mask entirely.
    "query_chunk_size": chunk,
    "key_chunk_size": chunk,
    "deterministic": True,
    "dropout_rng": None,
    "attn_pdrop": 0.0,
    "dtype": DTYPE,
    "policy": jax.checkpoint_policies.nothing_saveable,
    "precision": None,
    "prevent_cse": True,
  }

  def local(q, k, v):  # (q, k, v, attn_bias, segment_ids, cache_idx, axis_name, f32 logits, kw)
    return ring_fn(q, k, v, None, None, None, AXIS, True, blockwise_kwargs)

  spec = P(None, AXIS, None, None)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)


# ------------------------------------------------------------------------------------------
# Measurement.


CHECK_SEQ_LEN = 1024  # the correctness check's length: the dense reference stays small
CHECK_TOL = 2e-4  # f32 output and gradients, |a - b| <= tol * (1 + |b|)


def check_against_reference(args, mesh, haoliu_fn) -> list[str]:
  """Every timed configuration's output and q/k/v gradients against `reference_attention` at CHECK_SEQ_LEN.

  Returns one line per configuration; a line starting with FAILED means a wrong result.  The configurations
  are built by the same factories as the timed rows (only T differs), so a wrong flag or layout shows here.
  """
  import flax_ringattn

  sharding = NamedSharding(mesh, P(None, AXIS, None, None))
  q, k, v, g = (np.asarray(x) for x in make_inputs(CHECK_SEQ_LEN, sharding, args.seed + 1))
  lines = []
  for causal in args.causal_modes:
    reference = functools.partial(flax_ringattn.reference_attention, is_causal=causal)
    expected = [np.asarray(reference(q, k, v))]
    expected += [np.asarray(x) for x in fwd_bwd(reference, sharding)(q, k, v, g)]
    for impl in args.impls:
      if impl == "ring+lb" and not causal:
        continue
      if impl in ("ring", "ring+lb"):
        attention = make_ring(mesh, causal, impl == "ring+lb", args.block)
      elif impl == "allgather":
        attention = make_allgather(causal)
      elif haoliu_fn is not None:
        attention = make_haoliu(haoliu_fn, mesh, causal, CHECK_SEQ_LEN, args.haoliu_chunk)
      else:
        continue
      # ring+lb reads its inputs in zigzag order: permute them in, and the gradients back.
      zz = impl == "ring+lb"
      order = (lambda x: flax_ringattn.zigzag_order(x, NUM_DEVICES, axis=1)) if zz else (lambda x: x)
      inverse = (lambda x: flax_ringattn.zigzag_inverse(x, NUM_DEVICES, axis=1)) if zz else (lambda x: x)
      args_in = (order(q), order(k), order(v))
      got = [jax.jit(attention)(*args_in), *fwd_bwd(attention, sharding)(*args_in, order(g))]
      err = max(
        float(np.max(np.abs(np.asarray(inverse(x)) - e) / (1 + np.abs(e)))) for x, e in zip(got, expected, strict=True)
      )
      ok = np.isfinite(err) and err <= CHECK_TOL
      lines.append(f"{'ok' if ok else 'FAILED'}: {impl} causal={causal} T={CHECK_SEQ_LEN}: max rel err {err:.1e}")
  return lines


def fwd_bwd(attention: Attention, sharding: NamedSharding):
  """jit(grad of sum(attention(q, k, v) * g) w.r.t. q, k, v), gradients kept sharded."""

  def loss(q, k, v, g):
    return jnp.sum(attention(q, k, v) * g)

  grad = jax.grad(loss, argnums=(0, 1, 2))
  return jax.jit(grad, out_shardings=(sharding,) * 3)


def make_inputs(seq_len: int, sharding: NamedSharding, seed: int) -> tuple[jax.Array, ...]:
  shape = (BATCH, seq_len, HEADS, HEAD_DIM)

  @functools.partial(jax.jit, out_shardings=(sharding,) * 4)
  def sample(key):
    return tuple(jax.random.normal(k, shape, DTYPE) for k in jax.random.split(key, 4))

  return sample(jax.random.key(seed))


def matmul_gflops(repeats: int) -> float:
  """Median f32 GFLOP/s of a jitted MATMUL_N^3 matmul on one device."""
  device = jax.devices()[0]
  a = jax.device_put(jax.random.normal(jax.random.key(1), (MATMUL_N, MATMUL_N), DTYPE), device)
  b = jax.device_put(jax.random.normal(jax.random.key(2), (MATMUL_N, MATMUL_N), DTYPE), device)
  matmul = jax.jit(jnp.matmul)
  matmul(a, b).block_until_ready()
  times = []
  for _ in range(max(repeats, 10)):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * MATMUL_N**3 / statistics.median(times) / 1e9


def compile_row(
  row: Row,
  attention: Attention,
  inputs: Sequence[jax.Array],
  sharding: NamedSharding,
  mem_limit: float,
) -> None:
  """Compiles the row's fwd+bwd, records memory and traffic, marks it OOM-skip if too big."""
  compiled = fwd_bwd(attention, sharding).lower(*inputs).compile()
  stats = compiled.memory_analysis()
  if stats is not None:
    row.temp_bytes = stats.temp_size_in_bytes
    row.footprint_bytes = (
      stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    )
  row.sent = collective_volume(compiled.as_text())
  if row.footprint_bytes is not None and NUM_DEVICES * row.footprint_bytes > mem_limit:
    row.status = "OOM-skip"
  else:
    row.compiled = compiled


def run_row(row: Row, inputs: Sequence[jax.Array]) -> float | None:
  """One blocking call of the row's executable; errors mark the row and return None."""
  try:
    start = time.perf_counter()
    jax.block_until_ready(row.compiled(*inputs))
    return time.perf_counter() - start
  except Exception as e:  # One failing row must not kill the table.
    row.status = _error(e)
    row.compiled = None
    return None


def _error(e: Exception) -> str:
  return f"error: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def measure_seq_len(seq_len: int, args, mesh, haoliu_fn) -> list[Row]:
  """Compiles and times every requested (implementation, causal) pair at one T, interleaved."""
  sharding = NamedSharding(mesh, P(None, AXIS, None, None))
  inputs = make_inputs(seq_len, sharding, args.seed)
  mem_limit = args.mem_limit_gib * GIB
  rows = []
  for causal in args.causal_modes:
    for impl in args.impls:
      if impl == "ring+lb" and not causal:
        continue
      row = Row(impl, seq_len, causal)
      rows.append(row)
      try:
        if impl in ("ring", "ring+lb"):
          attention = make_ring(mesh, causal, impl == "ring+lb", args.block)
        elif impl == "allgather":
          attention = make_allgather(causal)
        else:
          if haoliu_fn is None:
            row.status = "not installed"
            continue
          attention = make_haoliu(haoliu_fn, mesh, causal, seq_len, args.haoliu_chunk)
        compile_row(row, attention, inputs, sharding, mem_limit)
      except Exception as e:
        row.status = _error(e)
  live = [r for r in rows if r.compiled is not None]
  for row in live:  # Warm-up call, excluded from timing.
    run_row(row, inputs)
  for _ in range(args.repeats):
    for row in live:
      if row.compiled is not None and (dt := run_row(row, inputs)) is not None:
        row.times.append(dt)
  for row in rows:
    row.compiled = None  # Release executables before the next T.
  return rows


# ------------------------------------------------------------------------------------------
# Reporting.

HEADER = (
  "impl",
  "T",
  "causal",
  "temp MiB/dev",
  "median ms",
  "GFLOP/s",
  "% matmul",
  "MiB sent/dev",
  "sent/ideal ring",
)


def median_time(row: Row) -> float | None:
  return statistics.median(row.times) if row.times else None


def format_row(row: Row, peak: float) -> list[str]:
  cells = [row.impl, str(row.seq_len), "yes" if row.causal else "no"]
  cells.append(f"{row.temp_bytes / MIB:.1f}" if row.temp_bytes is not None else "-")
  t = median_time(row)
  if t is None:
    cells += [row.status or "-", "-", "-"]
  else:
    gflops = attention_flops(row.seq_len, row.causal) / t / 1e9
    cells += [f"{1e3 * t:.1f}", f"{gflops:.1f}", f"{100 * gflops / peak:.1f}"]
  if row.sent is None:
    cells += ["-", "-"]
  else:
    marks = ("~" if row.sent.estimated else "") + ("?" if row.sent.unknown_trips else "")
    cells.append(f"{row.sent.total / MIB:.2f}{marks}")
    cells.append(f"{row.sent.total / ideal_ring_bytes(row.seq_len)[1]:.2f}")
  return cells


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]

  def line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

  sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
  return "\n".join([line(header), sep, *map(line, rows)])


def print_results(rows: Sequence[Row], peak: float, seq_lens: Sequence[int]) -> None:
  print(markdown_table(HEADER, [format_row(r, peak) for r in rows]))
  print()
  print(
    f"FLOP model (all implementations): fwd = {FWD_FLOP_FACTOR}*B*N*T*S*H, "
    f"bwd = {BWD_FLOP_FACTOR}*B*N*T*S*H (2.5x fwd), S = T; causal counts half. "
    f"'% matmul' is relative to the one-device f32 matmul rate above."
  )
  print(
    "MiB sent/dev: bytes one device sends per fwd+bwd call, from the compiled HLO "
    "(collective-permute: operand; all-gather: output - input; '~' = includes ring "
    "estimates, all-reduce 2(n-1)/n*size, reduce-scatter/all-to-all (n-1)/n*size; "
    "'?' = a while loop without known_trip_count counted once)."
  )
  print(
    f"Ideal ring per device (N={NUM_DEVICES}, f32): fwd sends K,V N-1 times = (N-1)/N of "
    "global K+V; fwd+bwd adds K,V N-1 times and the f32 dK,dV accumulators N times "
    "(haoliu's ring sends K,V N times in fwd and K,V,dK,dV N times in bwd: 48/44 = 1.09x "
    "ideal):"
  )
  for t in seq_lens:
    fwd, total = ideal_ring_bytes(t)
    print(f"  T={t}: fwd {fwd / MIB:.2f} MiB, fwd+bwd {total / MIB:.2f} MiB")


def _find(rows: Sequence[Row], impl: str, seq_len: int, causal: bool) -> Row | None:
  return next((r for r in rows if (r.impl, r.seq_len, r.causal) == (impl, seq_len, causal)), None)


def _ratio(a: float | None, b: float | None) -> float | None:
  return a / b if a is not None and b else None


def _fmt(x: float | None, spec: str = ".2f") -> str:
  return "n/a" if x is None else format(x, spec)


def _check(x: float | None, limit: float) -> str:
  return "n/a" if x is None else ("yes" if x <= limit else "NO")


def print_targets(rows: Sequence[Row], seq_lens: Sequence[int]) -> list[str]:
  """Project targets, at T=8k (time, traffic) and 16k (memory), else at the largest T measured.

  Returns the names of the targets measured and missed ("n/a" rows, e.g. without haoliu, are not misses).
  """
  t_time = 8192 if 8192 in seq_lens else max(seq_lens)
  t_mem = 16384 if 16384 in seq_lens else max(seq_lens)

  def time_of(impl: str, causal: bool) -> float | None:
    row = _find(rows, impl, t_time, causal)
    return median_time(row) if row else None

  def temp_mib(impl: str, seq_len: int) -> float | None:
    row = _find(rows, impl, seq_len, False)
    return row.temp_bytes / MIB if row and row.temp_bytes is not None else None

  table = []
  for impl in ("ring", "ring+lb"):
    r = _ratio(time_of(impl, True), time_of("haoliu", True))
    table.append([f"{impl} / haoliu time, T={t_time} causal", _fmt(r), "<= 0.80", _check(r, 0.8)])
  for impl in ("ring", "ring+lb"):
    r = _ratio(time_of(impl, True), time_of("ring", False))
    name = f"{impl} causal / ring non-causal time, T={t_time}"
    table.append([name, _fmt(r), "<= 0.55", _check(r, 0.55)])
  mem = f"{_fmt(temp_mib('ring', t_mem), '.1f')} vs {_fmt(temp_mib('haoliu', t_mem), '.1f')}"
  table.append([f"temp MiB/dev T={t_mem} non-causal, ring vs haoliu", mem, "-", "-"])
  pair = (8192, 16384) if {8192, 16384} <= set(seq_lens) else sorted(set(seq_lens))[-2:]
  if len(pair) == 2:
    small, large = pair
    growth = _ratio(temp_mib("ring", large), temp_mib("ring", small))
    name = f"ring temp growth T={small}->{large} non-causal"
    table.append([name, _fmt(growth), f"~{large / small:g} (linear in T)", "-"])
  ring_row = _find(rows, "ring", t_time, False)
  sent = ring_row.sent.total if ring_row and ring_row.sent else None
  ratio = _ratio(sent, ideal_ring_bytes(t_time)[1])
  table.append([f"ring bytes sent / ideal ring, T={t_time} non-causal", _fmt(ratio), "~1.0", "-"])
  print(markdown_table(("target", "value", "target", "met"), table))
  return [row[0] for row in table if row[3] == "NO"]


# ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--seq-lens",
    default=",".join(map(str, DEFAULT_SEQ_LENS)),
    help="comma-separated global sequence lengths (multiples of 8)",
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help=f"smoke run: T={','.join(map(str, QUICK_SEQ_LENS))}, 1 repeat",
  )
  parser.add_argument("--repeats", type=int, default=3, help="timed calls per row (median)")
  parser.add_argument("--impls", default=",".join(ALL_IMPLS), help=f"comma-separated subset of {','.join(ALL_IMPLS)}")
  parser.add_argument("--causal", choices=("both", "causal", "non-causal"), default="both")
  parser.add_argument(
    "--block",
    default=None,
    metavar="Q[,KV]",
    help="pass flax_ringattn.BlockSizes(block_q=Q, block_kv=KV) to ring rows",
  )
  parser.add_argument(
    "--haoliu-path",
    default=None,
    help="directory holding the `ringattention` package (e.g. a pip --target)",
  )
  parser.add_argument("--haoliu-chunk", type=int, default=256, help="haoliu query/key chunk size (clamped to T/8)")
  parser.add_argument(
    "--mem-limit-gib",
    type=float,
    default=16.0,
    help="skip rows whose estimated host memory (8 devices) exceeds this",
  )
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.quick:
    args.seq_lens, args.repeats = ",".join(map(str, QUICK_SEQ_LENS)), 1
  args.seq_lens = [int(t) for t in args.seq_lens.split(",")]
  if bad := [t for t in args.seq_lens if t <= 0 or t % NUM_DEVICES]:
    parser.error(f"--seq-lens {bad} must be positive multiples of {NUM_DEVICES}")
  args.impls = [i.strip() for i in args.impls.split(",")]
  if unknown := set(args.impls) - set(ALL_IMPLS):
    parser.error(f"unknown --impls {sorted(unknown)}; choose from {ALL_IMPLS}")
  args.causal_modes = {"both": (False, True), "causal": (True,), "non-causal": (False,)}[args.causal]
  if args.block:
    q, _, kv = args.block.partition(",")
    args.block = (int(q), int(kv or q))
  return args


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  if jax.device_count() < NUM_DEVICES:
    sys.exit(f"need {NUM_DEVICES} devices, have {jax.device_count()} (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})")
  mesh = jax.make_mesh(
    (NUM_DEVICES,),
    (AXIS,),
    axis_types=(jax.sharding.AxisType.Auto,),
    devices=jax.devices()[:NUM_DEVICES],
  )
  haoliu_fn = load_haoliu(args.haoliu_path) if "haoliu" in args.impls else None
  if any(i.startswith("ring") for i in args.impls) and not import_flax_ringattn():
    args.impls = [i for i in args.impls if not i.startswith("ring")]

  print(
    f"jax {jax.__version__}, backend {jax.default_backend()}, {NUM_DEVICES} simulated "
    f"devices on {os.cpu_count()} cores; B={BATCH}, heads={HEADS}, head_dim={HEAD_DIM}, "
    f"f32, fwd+bwd, repeats={args.repeats}"
  )
  args.peak = matmul_gflops(args.repeats)
  load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  print(f"one-device f32 matmul {MATMUL_N}^3: {args.peak:.1f} GFLOP/s (median); load avg {load}\n")

  if any(i.startswith("ring") for i in args.impls):
    checks = check_against_reference(args, mesh, haoliu_fn)
    print("\n".join(checks) + "\n")
    if any(line.startswith("FAILED") for line in checks):
      sys.exit(EXIT_WRONG_RESULT)
  rows = []
  for seq_len in args.seq_lens:
    print(f"T={seq_len} ...", file=sys.stderr)
    rows += measure_seq_len(seq_len, args, mesh, haoliu_fn)
  print_results(rows, args.peak, args.seq_lens)
  print()
  missed = print_targets(rows, args.seq_lens)
  if missed and not args.quick:
    print(f"\ntargets missed: {'; '.join(missed)}")
    sys.exit(EXIT_TARGET_MISSED)


if __name__ == "__main__":
  main()
