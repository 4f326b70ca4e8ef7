"""Bytes each device sends in a compiled SPMD program, read from its HLO text, and its memory statistics.

`collective_volume` walks the compiled module: collective-permute counts its
operand once per sending pair, all-gather its output minus its input;
all-reduce, reduce-scatter and all-to-all are ring estimates (marked
`estimated`).  Collectives inside a while body count once per trip (XLA's
`known_trip_count` annotation; a loop without one is counted once and marked
`unknown_trips`), a conditional counts its most expensive branch.
`compiled_stats` adds XLA's per-device memory analysis.
"""

from __future__ import annotations

import dataclasses
import functools
import re


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


def collective_volume(hlo_text: str, num_devices: int) -> CommVolume:
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


@dataclasses.dataclass
class CompiledStats:
  """What a compiled program costs per device, read without running it."""

  temp_bytes: int | None  # XLA's temp allocation
  footprint_bytes: int | None  # temp + arguments + outputs - aliased
  sent: CommVolume


def compiled_stats(compiled, num_devices: int) -> CompiledStats:
  """Memory analysis and collective volume of a `jax.stages.Compiled`."""
  stats = compiled.memory_analysis()
  temp = footprint = None
  if stats is not None:
    temp = stats.temp_size_in_bytes
    footprint = temp + stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
  return CompiledStats(temp, footprint, collective_volume(compiled.as_text(), num_devices))
