"""The one hardware table: every accelerator figure the planners, `suggest_strategy` and `benchmarks/` use.

One `Chip` per accelerator (and one for the simulated CPU devices of this
project's CI machine), figures per JAX device unless a field says otherwise,
each chip with its sources:

* TPUs: peak matmul rates, HBM, VMEM and MXU size are JAX's own table
  (`jax/_src/pallas/mosaic/tpu_info.py`, JAX 0.10.2, which cites each number;
  `pltpu.get_tpu_info_for_chip` gives them per TensorCore, times the
  TensorCores of one JAX device here: v4 and v5p chips are one megacore device
  of 2 cores, a v7x device is one of its chip's 2 cores).
  `tests/test_benchmarks.py` checks every TPU figure against that function and
  `tests/test_planner.py` the VMEM sizes.  ICI figures are Google's Cloud TPU
  system-architecture pages (docs.cloud.google.com/tpu/docs/v5e, /v5p, and the
  generation table of /tpu7x, which also lists v6e); v4's page gives none.
* GPUs: vendor datasheets (SXM parts where both exist: dense, not sparse,
  tensor-core peaks) and the CUDA programming guide's opt-in shared memory per
  thread block ("Compute capabilities", table 21), keyed by the arch the GPU
  planner plans for.
* `latency` (seconds per collective step) is an assumption of the advisor's
  model, not a measurement; chips without one are not offered to it.

Users: `planners/chip.py` (`VMEM_BYTES`), `pallas_gpu/planner.py`
(`SMEM_PER_BLOCK`), `advisor.py` (`HARDWARE`), and the benchmarks (peaks,
ridge points, ICI links).  This module imports neither JAX nor the package.
"""

from __future__ import annotations

import dataclasses

import numpy as np

KiB, MiB, GiB = 2**10, 2**20, 2**30
GB = 1e9


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
  """One accelerator's figures, per JAX device unless said otherwise; None where no source gives one."""

  name: str  # the table's key: "tpu_v5e", "h100", "cpu"
  platform: str  # jax.Device.platform: "tpu", "gpu", "cpu"
  label: str  # the vendor's name, as `device_kind` spells it: "v5e", "H100"
  # dtype name -> dense matmul flop/s; the first entry is the working peak (bf16 on accelerators).
  matmul_flops: dict = dataclasses.field(default_factory=dict, hash=False)
  memory_bytes: float | None = None  # device memory (HBM)
  memory_bandwidth: float | None = None  # bytes/s of device memory
  # bytes/s one device sends to peers of its slice / NVLink domain / process: one direction, all links
  link_bandwidth: float | None = None
  # bytes/s one device sends to other hosts (a TPU slice's hosts talk over ICI: the same as link_bandwidth)
  network_bandwidth: float | None = None
  latency: float | None = None  # seconds per collective step (assumed, see the module docstring)
  devices_per_chip: int = 1  # v7x: 2 (a device is one TensorCore)
  # TPU
  generation: str | None = None  # the Pallas TPU planners' name: "v5e"
  jax_chip: str | None = None  # pltpu.ChipVersion member: "TPU_V5E"
  cores_per_device: int = 1  # TensorCores per JAX device
  vmem_bytes: int | None = None  # per TensorCore
  mxu_size: int | None = None  # systolic array rows (and columns)
  ici_ports: int | None = None  # ICI links per chip
  # GPU
  arch: str | None = None  # "sm_90": what the GPU planner plans for
  smem_per_block: int | None = None  # opt-in shared memory per thread block
  source: str = ""

  def peak_flops(self, dtype=None) -> float | None:
    """Dense matmul flop/s in `dtype` (None: the working peak, the table's first entry); None if no source gives it."""
    if dtype is None:
      return next(iter(self.matmul_flops.values()), None)
    name = _dtype_name(dtype)
    if name.startswith("float8"):
      name = "float8"
    return self.matmul_flops.get(name)

  @property
  def ridge(self) -> float | None:
    """FLOP per HBM byte where the working peak and memory bandwidth meet (the roofline's ridge point)."""
    peak = self.peak_flops()
    return peak / self.memory_bandwidth if peak and self.memory_bandwidth else None

  @property
  def ici_bidir(self) -> float | None:
    """TPU: bytes/s per chip, both directions, all links (what the Cloud TPU pages quote)."""
    if self.platform != "tpu" or self.link_bandwidth is None:
      return None
    return 2 * self.link_bandwidth * self.devices_per_chip

  @property
  def ici_link(self) -> float | None:
    """TPU: bytes/s of one ICI link, one direction (an estimate: the chip's figure spread evenly over its ports)."""
    if self.ici_bidir is None or not self.ici_ports:
      return None
    return self.ici_bidir / (2 * self.ici_ports)


def _dtype_name(dtype) -> str:
  if isinstance(dtype, str):
    return dtype
  try:
    return np.dtype(dtype).name
  except TypeError:
    return str(getattr(dtype, "__name__", dtype))


_JAX_TPU = "JAX 0.10.2 tpu_info.py (pltpu.get_tpu_info_for_chip) per TensorCore"
_CLOUD = "docs.cloud.google.com/tpu/docs"


def _tpu(
  gen,
  jax_chip,
  *,
  cores,
  per_core_flops,
  per_core_bw,
  per_core_mem,
  vmem,
  mxu,
  ici_bidir=None,
  ports=None,
  devices_per_chip=1,
  latency=None,
  source="",
):
  flops = {k: v * cores for k, v in per_core_flops.items()}
  link = None if ici_bidir is None else ici_bidir / 2 / devices_per_chip
  return Chip(
    name=f"tpu_{gen}",
    platform="tpu",
    label=gen,
    matmul_flops=flops,
    memory_bytes=per_core_mem * cores,
    memory_bandwidth=per_core_bw * cores,
    link_bandwidth=link,
    network_bandwidth=link,
    latency=latency,
    devices_per_chip=devices_per_chip,
    generation=gen,
    jax_chip=jax_chip,
    cores_per_device=cores,
    vmem_bytes=vmem,
    mxu_size=mxu,
    ici_ports=ports,
    source=source,
  )


def _gpu(name, label, arch, smem, *, bf16=None, memory=None, bw=None, nvlink=None, nic=None, latency=None, source=""):
  return Chip(
    name=name,
    platform="gpu",
    label=label,
    matmul_flops={} if bf16 is None else {"bfloat16": bf16},
    memory_bytes=memory,
    memory_bandwidth=bw,
    link_bandwidth=None if nvlink is None else nvlink / 2,
    network_bandwidth=nic,
    latency=latency,
    arch=arch,
    smem_per_block=smem,
    source=source,
  )


_TABLE = (
  # TPUs.  Per TensorCore from JAX's table (v4 and v5p: 2 cores per device; the others 1).  ICI: bidirectional
  # GB/s per chip from the Cloud TPU pages; ports: v5e's page lists 4, v6e (2D torus) and v5p (3D torus) are
  # assumed to have one per torus neighbour; v7x's are not documented.
  _tpu(
    "v4",
    "TPU_V4",
    cores=2,
    per_core_flops={"bfloat16": 137.5e12},
    per_core_bw=615e9,
    per_core_mem=17.2e9,
    vmem=16 * MiB,
    mxu=128,
    source=f"{_JAX_TPU}; no ICI figure in the v4 page",
  ),
  _tpu(
    "v5e",
    "TPU_V5E",
    cores=1,
    per_core_flops={"bfloat16": 197e12, "int8": 394e12},
    per_core_bw=820e9,
    per_core_mem=17.2e9,
    vmem=128 * MiB,
    mxu=128,
    ici_bidir=400 * GB,
    ports=4,
    latency=1e-5,
    source=f"{_JAX_TPU} (the v5e page: 197 TFLOP/s bf16, 16 GiB HBM at 819 GB/s); {_CLOUD}/v5e: ICI 1,600 Gbps "
    "per chip each way, 4 ports",
  ),
  _tpu(
    "v5p",
    "TPU_V5P",
    cores=2,
    per_core_flops={"bfloat16": 229.5e12, "int8": 459e12},
    per_core_bw=1230e9,
    per_core_mem=51.5e9,
    vmem=64 * MiB,
    mxu=128,
    ici_bidir=1200 * GB,
    ports=6,
    latency=1e-5,
    source=f"{_JAX_TPU} (the v5p page: 459 TFLOP/s bf16, 95 GB HBM at 2,765 GB/s); {_CLOUD}/v5p: ICI 4,800 Gbps "
    "per chip each way",
  ),
  _tpu(
    "v6e",
    "TPU_V6E",
    cores=1,
    per_core_flops={"bfloat16": 920e12, "int8": 1840e12, "float8": 920e12},
    per_core_bw=1640e9,
    per_core_mem=34.4e9,
    vmem=128 * MiB,
    mxu=256,
    ici_bidir=800 * GB,
    ports=4,
    source=f"{_JAX_TPU}; {_CLOUD}/tpu7x generation table: ICI 800 GB/s per chip, bidirectional",
  ),
  _tpu(
    "v7x",
    "TPU_7X",
    cores=1,
    per_core_flops={"bfloat16": 1155e12, "float8": 2300e12},
    per_core_bw=3700e9,
    per_core_mem=103e9,
    vmem=64 * MiB,
    mxu=256,
    ici_bidir=1200 * GB,
    devices_per_chip=2,
    source=f"{_JAX_TPU}; {_CLOUD}/tpu7x: ICI 1,200 GB/s per chip, bidirectional (ports not documented)",
  ),
  # GPUs, by arch.  Opt-in shared memory per block: CUDA programming guide, "Compute capabilities", table 21.
  _gpu("v100", "V100", "sm_70", 96 * KiB, source="CUDA guide table 21 (no bf16 tensor cores)"),
  _gpu("t4", "T4", "sm_75", 64 * KiB, source="CUDA guide table 21 (no bf16 tensor cores)"),
  _gpu(
    "a100",
    "A100",
    "sm_80",
    163 * KiB,
    bf16=312e12,
    memory=80e9,
    bw=2.0e12,
    nvlink=600e9,
    nic=200e9 / 8,
    latency=1e-5,
    source="nvidia.com A100 SXM datasheet: 312 TFLOP/s bf16, 80 GB HBM2e at 2.0 TB/s, NVLink 600 GB/s (300 GB/s "
    "each way); DGX A100: 200 Gb/s HDR InfiniBand per GPU; CUDA guide table 21",
  ),
  _gpu("a10", "A10", "sm_86", 99 * KiB, source="CUDA guide table 21 (sm_86: A10, A40, RTX 30xx)"),
  _gpu("l4", "L4", "sm_89", 99 * KiB, bf16=121e12, source="nvidia.com L4 datasheet; CUDA guide table 21"),
  _gpu("l40s", "L40S", "sm_89", 99 * KiB, bf16=362e12, source="nvidia.com L40S datasheet; CUDA guide table 21"),
  _gpu(
    "h100",
    "H100",
    "sm_90",
    227 * KiB,
    bf16=989e12,
    memory=80e9,
    bw=3.35e12,
    nvlink=900e9,
    nic=400e9 / 8,
    latency=1e-5,
    source="nvidia.com H100 SXM datasheet: 989 TFLOP/s bf16 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s "
    "(450 GB/s each way); DGX H100: 400 Gb/s NDR InfiniBand per GPU; CUDA guide table 21",
  ),
  _gpu(
    "h200",
    "H200",
    "sm_90",
    227 * KiB,
    bf16=989e12,
    memory=141e9,
    bw=4.8e12,
    nvlink=900e9,
    source="nvidia.com H200 SXM datasheet: 989 TFLOP/s bf16 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; "
    "CUDA guide table 21",
  ),
  _gpu("b200", "B200", "sm_100", 227 * KiB, bf16=2250e12, source="nvidia.com B200 datasheet; CUDA guide table 21"),
  # The 8 simulated CPU devices of this project's 2-core CI machine, measured by benchmarks/strategies.py
  # (f32 matmul rate of one device while the others idle, and the rate of an all-gather between the
  # simulated devices, which is a memory copy; gloo over loopback between processes is slower).
  Chip(
    name="cpu",
    platform="cpu",
    label="cpu",
    matmul_flops={"float32": 20e9},
    memory_bytes=8 * GiB,
    memory_bandwidth=5e9,
    link_bandwidth=2e9,
    network_bandwidth=0.5e9,
    latency=2e-4,
    source="measured on this project's CPU devices (benchmarks/strategies.py --calibrate)",
  ),
)

CHIPS: dict[str, Chip] = {c.name: c for c in _TABLE}
TPU_GENERATIONS: tuple[str, ...] = tuple(c.generation for c in _TABLE if c.platform == "tpu")


def chip(name: str) -> Chip:
  """The table's chip `name` ("tpu_v5e", "h100", "cpu"; case-insensitive; a TPU also by generation, "v5e")."""
  key = name.lower()
  if key in CHIPS:
    return CHIPS[key]
  if f"tpu_{key}" in CHIPS:
    return CHIPS[f"tpu_{key}"]
  raise ValueError(f"unknown chip {name=}; known: {tuple(CHIPS)}")


def tpu(generation: str) -> Chip:
  """The TPU of planner generation `generation` ('v4', 'v5e', 'v5p', 'v6e', 'v7x')."""
  if generation not in TPU_GENERATIONS:
    raise ValueError(f"unknown TPU {generation=}; known generations: {TPU_GENERATIONS}")
  return CHIPS[f"tpu_{generation}"]


def gpu_for_device_kind(kind: str) -> Chip | None:
  """The table's GPU whose label appears in a `jax.Device.device_kind` ("NVIDIA H100 80GB HBM3"), longest label
  first (so an L40S is not taken for an L4); None for a GPU the table does not know."""
  gpus = sorted((c for c in _TABLE if c.platform == "gpu"), key=lambda c: -len(c.label))
  return next((c for c in gpus if c.label.lower() in kind.lower()), None)


def smem_per_block_by_arch() -> dict[str, int]:
  """arch -> opt-in shared memory per thread block, in the table's order (one figure per arch)."""
  out: dict[str, int] = {}
  for c in _TABLE:
    if c.arch is not None:
      if out.setdefault(c.arch, c.smem_per_block) != c.smem_per_block:
        raise AssertionError(f"two shared-memory figures for {c.arch}")
  return out
