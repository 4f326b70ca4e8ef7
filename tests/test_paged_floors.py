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


def test_paged_floors_import_downward_only():
  """The paged folder's floor (input checks and dequantisation, the ragged-batch schedule) sits below the op and
  the backends: the backends import it and nothing else of the folder; it imports neither backends nor layers."""
  floor = {"flax_ringattn._src.paged.common", "flax_ringattn._src.paged.metadata"}
  # `from flax_ringattn._src.paged import metadata` names the package too: it runs its __init__, which is empty.
  assert not _imports(SRC / "paged" / "__init__.py")
  floor.add("flax_ringattn._src.paged")
  helpers = [SRC / "paged" / "common.py", SRC / "paged" / "metadata.py"]
  backends = sorted((SRC / "backends").rglob("*.py"))
  for path in helpers + backends:
    up = {
      m
      for m in _imports(path)
      if (m.startswith("flax_ringattn._src.paged.") or m == "flax_ringattn._src.paged") and m not in floor
    }
    assert not up, f"{path.relative_to(SRC)} imports the paged op above its floor: {sorted(up)}"
  for path in helpers:
    up = {m for m in _imports(path) if m.startswith(("flax_ringattn._src.backends", "flax_ringattn._src.nnx"))}
    assert not up, f"{path.relative_to(SRC)} imports a floor above it: {sorted(up)}"
  # The op's folder: its API, registry, checks, cache (its admission, allocator, argument contracts, eager programs and storage),
  # context parallelism and ring prefill, oracle and floor.
  assert sorted(p.name for p in (SRC / "paged").glob("*.py")) == [
    "__init__.py",
    "admission.py",
    "allocator.py",
    "cache.py",
    "checks.py",
    "common.py",
    "context_parallel.py",
    "contracts.py",
    "eager.py",
    "implementations.py",
    "metadata.py",
    "op.py",
    "reference.py",
    "ring_prefill.py",
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
