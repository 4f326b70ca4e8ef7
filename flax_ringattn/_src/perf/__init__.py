"""Performance models and the benchmark harness: one hardware table (`hardware`), one cost model (`cost`), named
problem shapes (`problems`), the harness the scripts in `benchmarks/` share (`harness`, `hlo`).

Below the ops: nothing here imports an op, a layer or a backend, and the planners may import `hardware`.
Public through `flax_ringattn.benchmarking`.
"""
