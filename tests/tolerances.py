"""The one tolerance table (per dtype, forward and gradients); compare in f32.

It lives in the public `flax_ringattn.testing` module; the tests use it from there.
"""

from flax_ringattn._src.testing.checks import TOLERANCES, tolerance

tol = tolerance


def assert_close(actual, expected, dtype, kind: str = "fwd"):
  """Tree-wise comparison in float32 with the table's tolerance; no NaN allowed."""
  from flax_ringattn._src.testing.checks import assert_close as check

  check(actual, expected, dtype, kind)


__all__ = ["TOLERANCES", "assert_close", "tol"]
