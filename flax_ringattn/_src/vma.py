"""shard_map's varying-manual-axes (vma) bookkeeping for freshly made arrays.

Inside `jax.shard_map(check_vma=True)` an array built from constants (zeros,
-inf) is "invariant" while values computed from the shards are "varying";
`lax.cond`/`switch`/`scan` require both sides to agree.  `like(x, ref)` marks
`x` as varying over the same manual axes as `ref`; outside shard_map it is a
no-op.
"""

from __future__ import annotations

import jax


def _varying_axes(x) -> frozenset:
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # JAX 0.10: aval.mat.varying
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))  # older JAX


def like(x, ref):
  want, have = _varying_axes(ref), _varying_axes(x)
  missing = tuple(sorted(want - have, key=str))
  return jax.lax.pcast(x, missing, to="varying") if missing else x
