"""Measured tiles per chip: the tables `flax_ringattn.tune` writes, read by the planners before their models.

A table is JSON: {"generation": "v5e", "entries": {key: {"block_q": ..., "block_kv": ..., ...}}}, one entry per
problem shape (`block_key`, `paged_key`).  The planners look a shape up in the tables registered in this process
(`register`, newest first), then in the one the package ships for the attached generation (`tables/<gen>.json`,
absent: none).  An entry is used only where the planner's own rules accept it (legal tiles whose footprint fits
the generation's VMEM budget); anything else falls back to the model, so a table changes tiles, never results.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import jax.numpy as jnp

SHIPPED = Path(__file__).parent / "tables"
_registered: list[dict] = []  # tables added in this process, newest last
_version = [0]  # bumped by `register` / `unregister`: callers that cache plans key them on `version()`


def version() -> int:
  return _version[0]


def block_key(shape) -> str:
  """The key of a block-kernel problem (`options.ProblemShape`: per-kernel lengths, heads, dtype, features)."""
  f = shape.features
  return (
    f"block T={shape.q_len} S={shape.kv_len} N={shape.num_heads} K={shape.num_kv_heads} H={shape.head_dim} "
    f"Hv={shape.head_dim_v} {jnp.dtype(shape.dtype).name} seg={int(f['has_segments'])} cap={int(f['soft_cap'])} "
    f"drop={int(f['dropout'])} extra={','.join(f.get('extra_fields', ())) or '-'}"
  )


def paged_key(T, page_size, pages_per_seq, N, K, H, Hv, dtype, page_dtype, scale_rows, soft_cap, spans, merged) -> str:
  """The key of a paged-kernel problem, in `plan_paged_block_sizes`' terms."""
  return (
    f"paged T={T} ps={page_size} pps={pages_per_seq} N={N} K={K} H={H} Hv={Hv or H} {jnp.dtype(dtype).name} "
    f"pages={jnp.dtype(page_dtype).name} scales={scale_rows[0]},{scale_rows[1]} cap={int(bool(soft_cap))} "
    f"spans={int(bool(spans))} merged={int(bool(merged))}"
  )


def check_table(table) -> dict:
  """`table` (a dict, or a path to a JSON file) after checking its form; raises ValueError naming what is wrong."""
  if isinstance(table, (str, Path)):
    table = json.loads(Path(table).read_text())
  if not isinstance(table, dict) or not isinstance(table.get("generation"), str):
    raise ValueError(f"a tuned table is a dict with a 'generation' string and 'entries', got {type(table).__name__}")
  entries = table.get("entries")
  if not isinstance(entries, dict):
    raise ValueError(f"tuned table for {table['generation']}: 'entries' must be a dict of key -> block sizes")
  for key, entry in entries.items():
    if not isinstance(entry, dict) or not all(isinstance(entry.get(k), int) for k in ("block_q", "block_kv")):
      raise ValueError(f"tuned table entry {key!r} needs int block_q and block_kv, got {entry!r}")
    if entry.get("fused_bwd") is not None and not isinstance(entry["fused_bwd"], bool):
      raise ValueError(f"tuned table entry {key!r}: fused_bwd must be true, false or null, got {entry['fused_bwd']!r}")
  return table


def register(table) -> dict:
  """Adds a table (a dict or a JSON path) for this process; its entries win over the shipped table's and those
  of tables registered before it.  Returns the table (pass it to `unregister`)."""
  table = check_table(table)
  _registered.append(table)
  _version[0] += 1
  return table


def unregister(table: dict) -> None:
  _registered[:] = [t for t in _registered if t is not table]
  _version[0] += 1


@contextlib.contextmanager
def using(table):
  """`register(table)` for the duration of a `with` block."""
  table = register(table)
  try:
    yield table
  finally:
    unregister(table)


@functools.cache
def _shipped(generation: str) -> dict:
  path = SHIPPED / f"{generation}.json"
  return check_table(path)["entries"] if path.exists() else {}


def lookup(generation: str, key: str) -> dict | None:
  """The entry for `key` on `generation`: the newest registered table's, else the shipped one's, else None."""
  for table in reversed(_registered):
    if table["generation"] == generation and key in table["entries"]:
      return table["entries"][key]
  return _shipped(generation).get(key)
