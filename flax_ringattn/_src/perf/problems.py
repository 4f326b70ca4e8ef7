"""Named attention problem shapes, shared by the benchmarks and the tests, and the inputs for them.

A `Problem` is one attention call's shape (B batch, T q length, S kv length,
N q heads, K kv heads, H head dim, dtype, mask); its FLOPs and bytes come from
the cost model (`cost.py`).  `PROBLEM_SETS` names the shapes each benchmark
runs by default, so a test can run the same shapes at a smaller T
(`Problem.replace(T=...)`) and a benchmark's table can be traced to a named
set.
"""

from __future__ import annotations

import dataclasses

from flax_ringattn._src.options import ProblemShape
from flax_ringattn._src.perf import cost


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
  """One attention call: q [B, T, N, H], k [B, S, K, H] and v [B, S, K, Hv] (S = T and Hv = H unless given),
  `dtype`, mask options."""

  B: int = 1
  T: int
  S: int | None = None
  N: int
  K: int
  H: int
  dtype: str = "float32"
  is_causal: bool = False
  local_window_size: int | tuple[int, int] | None = None
  Hv: int | None = None  # v's head dim when it differs from H (MLA)

  def __post_init__(self):
    for name in ("B", "T", "N", "K", "H"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"Problem: {name} must be a positive int, got {name}={value!r}")
    if self.Hv is not None and (not isinstance(self.Hv, int) or self.Hv < 1):
      raise ValueError(f"Problem: Hv must be a positive int or None, got Hv={self.Hv!r}")
    if self.N % self.K:
      raise ValueError(f"Problem: N={self.N} q heads must be a multiple of K={self.K} kv heads")

  @property
  def kv_len(self) -> int:
    return self.T if self.S is None else self.S

  @property
  def G(self) -> int:
    """q heads per kv head."""
    return self.N // self.K

  @property
  def itemsize(self) -> int:
    return cost.itemsize(self.dtype)

  @property
  def shape(self) -> ProblemShape:
    """The call's `ProblemShape` (per sequence of the batch), as the advisor and the planners take it."""
    return ProblemShape(
      q_len=self.T,
      kv_len=self.kv_len,
      num_heads=self.N,
      num_kv_heads=self.K,
      head_dim=self.H,
      dtype=self.dtype,
      v_head_dim=None if self.Hv in (None, self.H) else self.Hv,
    )

  def replace(self, **changes) -> Problem:
    return dataclasses.replace(self, **changes)

  def flops(self, direction: str = "fwd+bwd") -> float:
    """Useful FLOPs (`cost.attention_flops`): causal and windowed masks counted once."""
    return cost.attention_flops(
      B=self.B,
      T=self.T,
      S=self.kv_len,
      N=self.N,
      H=self.H,
      is_causal=self.is_causal,
      local_window_size=self.local_window_size,
      direction=direction,
      Hv=self.Hv,
    )

  def bytes(self, direction: str = "fwd") -> float:
    """HBM bytes of every operand once (`cost.attention_bytes`)."""
    dims = dict(B=self.B, T=self.T, S=self.kv_len, N=self.N, K=self.K, H=self.H, Hv=self.Hv)
    return cost.attention_bytes(**dims, itemsize=self.itemsize, direction=direction)

  def mask_kwargs(self) -> dict:
    """The mask keywords of `ring_attention` / `reference_attention` / `jax.nn.dot_product_attention`."""
    out = {"is_causal": self.is_causal}
    if self.local_window_size is not None:
      out["local_window_size"] = self.local_window_size
    return out

  def describe(self) -> str:
    mask = "causal" if self.is_causal else "full"
    if self.local_window_size is not None:
      mask += f", window {self.local_window_size}"
    return f"B={self.B} T={self.T} S={self.kv_len} N={self.N} K={self.K} H={self.H} {self.dtype} {mask}"

  def inputs(self, seed: int = 0, *, sharding=None):
    """(q, k, v, do): standard normal in `dtype` (drawn in f32), placed with `sharding` if given."""
    import jax
    import jax.numpy as jnp

    shapes = [(self.B, self.T, self.N, self.H), *[(self.B, self.kv_len, self.K, self.H)] * 2]
    shapes.append(shapes[0])

    def sample(key):
      return tuple(
        jax.random.normal(k, s, jnp.float32).astype(self.dtype)
        for k, s in zip(jax.random.split(key, 4), shapes, strict=True)
      )

    if sharding is not None:
      return jax.jit(sample, out_shardings=(sharding,) * 4)(jax.random.key(seed))
    return sample(jax.random.key(seed))


def fwd_bwd(attention, *, out_shardings=None, with_output: bool = True):
  """jit of (q, k, v, do) -> (out, (dq, dk, dv)): the forward and the gradient of sum(out * do) in f32;
  `with_output=False`: the gradients alone (what a training step keeps)."""
  import jax
  import jax.numpy as jnp

  def loss(q, k, v, do):
    return jnp.sum(attention(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

  grad = jax.grad(loss, argnums=(0, 1, 2))
  if not with_output:
    return jax.jit(grad, out_shardings=None if out_shardings is None else (out_shardings,) * 3)

  def run(q, k, v, do):
    return attention(q, k, v), grad(q, k, v, do)

  shardings = None if out_shardings is None else (out_shardings, (out_shardings,) * 3)
  return jax.jit(run, out_shardings=shardings)


def _sweep(base: Problem, seq_lens, causal=(False, True)) -> tuple[Problem, ...]:
  return tuple(base.replace(T=T, is_causal=c) for T in seq_lens for c in causal)


RING_SCALING = Problem(T=8192, N=4, K=4, H=64, dtype="float32")
STRATEGIES = Problem(T=8192, N=8, K=8, H=64, dtype="float32", is_causal=True)
GPU_ATTENTION = Problem(T=8192, N=32, K=8, H=128, dtype="bfloat16")
TPU_ROOFLINE = Problem(T=131072, N=32, K=8, H=128, dtype="bfloat16")
PAGED_STEP = Problem(T=1054, S=2048, N=8, K=2, H=128, dtype="float32", is_causal=True)  # 2 x 512 + 30 decodes

PROBLEM_SETS: dict[str, tuple[Problem, ...]] = {
  # benchmarks/ring_scaling.py: 8 simulated CPU devices, fwd+bwd, causal and not.
  "ring_scaling": _sweep(RING_SCALING, (2048, 4096, 8192, 16384, 32768)),
  "ring_scaling_quick": _sweep(RING_SCALING, (512, 1024)),
  # benchmarks/strategies.py: every strategy= on 8 CPU devices, causal, zigzag.
  "strategies": _sweep(STRATEGIES, (4096, 8192, 16384, 32768), causal=(True,)),
  # benchmarks/gpu_attention.py: one GPU, GQA 4:1, bf16; the smoke set runs in interpret mode on CPU.
  "gpu_attention": _sweep(GPU_ATTENTION, (4096, 8192, 16384, 32768), causal=(True, False)),
  "gpu_attention_smoke": _sweep(GPU_ATTENTION.replace(N=4, K=1, H=16), (64,), causal=(True, False)),
  # benchmarks/tpu_roofline.py: global T over a ring of 8 (shards T / 8), causal shown per mask there.
  "tpu_roofline": _sweep(TPU_ROOFLINE, (32768, 131072, 524288), causal=(False,)),
  "tpu_roofline_quick": _sweep(TPU_ROOFLINE, (16384,), causal=(False,)),
  # benchmarks/paged_throughput.py: the mixed step's q tokens, the longest kv, GQA 8:2 (the workload is ragged).
  "paged_step": (PAGED_STEP,),
  # Tests: small shapes of the same families (MHA, GQA, MQA; causal, windowed).
  "tiny": (
    Problem(T=64, N=4, K=4, H=16),
    Problem(T=64, N=4, K=2, H=16, is_causal=True),
    Problem(T=64, N=4, K=1, H=16, is_causal=True, local_window_size=(16, 0)),
  ),
}
