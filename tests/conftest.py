"""Test setup: 8 simulated CPU devices, shared mesh helpers."""

import os

# Must happen before JAX initialises its backends.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402


def make_mesh(shape, names, *, explicit: bool = True):
  """A mesh over the first prod(shape) CPU devices (Explicit axes by default, as jax.make_mesh)."""
  n = 1
  for s in shape:
    n *= s
  types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(shape)
  return jax.make_mesh(tuple(shape), tuple(names), axis_types=types, devices=jax.devices()[:n])


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
  assert jax.device_count() >= 8, f"tests need 8 CPU devices, got {jax.devices()}"
