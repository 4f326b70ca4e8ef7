"""The paged code reads one way (op above backends above shared helpers), and scales may be Python floats."""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from paged_cases import make_batch, ref_fn
from tolerances import assert_close

import flax_ringattn as fr

SRC = Path(fr.__file__).parent / "_src"


def _imports(path: Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
    elif isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
  return names


def test_backends_import_nothing_of_the_paged_op():
  """What paged backends share with the op (the ragged batch's schedule, pages as stored) lives below both, in
  `_src/ragged.py`: no backend imports the paged folder, and the floor imports neither ops, backends nor layers."""
  assert not _imports(SRC / "paged" / "__init__.py")
  for path in sorted((SRC / "backends").rglob("*.py")):
    up = {m for m in _imports(path) if m.startswith("flax_ringattn._src.paged")}
    assert not up, f"{path.relative_to(SRC)} imports the paged op: {sorted(up)}"
  above = (
    "flax_ringattn._src.backends",
    "flax_ringattn._src.nnx",
    "flax_ringattn._src.paged",
    "flax_ringattn._src.ring",
  )
  up = {m for m in _imports(SRC / "ragged.py") if m.startswith(above)}
  assert not up, f"ragged.py imports {sorted(up)}"
  # The op's folder: its API and call plan, registry, checks, cache (its admission, allocator, argument contracts,
  # eager programs, reservations, storage and rollback), context parallelism and ring prefill, the serving step, oracle, rules.
  assert sorted(p.name for p in (SRC / "paged").glob("*.py")) == [
    "__init__.py",
    "admission.py",
    "allocator.py",
    "attend.py",
    "cache.py",
    "checks.py",
    "common.py",
    "context_parallel.py",
    "contracts.py",
    "eager.py",
    "implementations.py",
    "op.py",
    "reference.py",
    "reservations.py",
    "ring_prefill.py",
    "rollback.py",
    "step.py",
    "storage.py",
  ]


def test_python_float_scales_match_array_scales():
  rng = np.random.default_rng(61)
  b = make_batch(rng, [(1, 9), (3, 3), (2, 11)], page_dtype=jnp.int8, scale_shape="scalar")
  ks, vs = float(b.k_scale), float(b.v_scale)
  expected = ref_fn(*b.args, **b.scales)
  for fn in (fr.paged_attention, fr.paged_reference_attention):
    out = jax.jit(lambda *a, fn=fn: fn(*a, k_scale=ks, v_scale=vs))(*b.args)
    assert_close(out, expected, jnp.float32)
