"""Test-only helpers (CPU interpret-mode harness for Pallas TPU kernels); not part of the public API."""
