"""flax_ringattn: ring and paged attention layers for Flax NNX.

The public surface (see README.md for the table):

* ops: `ring_attention`, `dot_product_attention` (a hand-written attention
  block with the model's own mask, as ring attention), `paged_attention`,
  `reference_attention`,
  `paged_reference_attention`
* layers: `RingMultiHeadAttention`, `make_ring_attention_fn`,
  `PagedMultiHeadAttention`; cache: `PagedKVCache` (`CacheOverflowError`); `convert` (swap every
  `nnx.MultiHeadAttention` of a model in place) and its `ConversionReport`
* serving: `ServingEngine` (an unedited model, converted with
  `convert(model, to="paged")`, served by continuous batching with prefix
  reuse; `EngineStats`), `NGramDraft` (exact speculative decoding)
* masks: `Mask` (every term of the mask as one object, `mask=`); dense masks:
  `padded_segment_ids`, `structure_from_dense_mask` (`DenseStructure`),
  `dense_mask_from_structure`
* training: `save_attention_residuals` (a remat policy: the backward does not rerun the attention forward),
  `save_mask_structure` (a remat policy for long sequences: the backward does not keep the model's dense mask)
* `flax_ringattn.testing`: helpers for your own tests (imported on demand)
* `flax_ringattn.benchmarking`: the benchmark harness, hardware table and cost
  model the scripts in `benchmarks/` share (imported on demand)
* layout helpers: `zigzag_order`, `zigzag_inverse`, `zigzag_positions`;
  packed batches: `balanced_layout`, `apply_layout`, `undo_layout` (`Layout`),
  `layout_imbalance`
* strategies: `suggest_strategy` (cost model; `Hardware`, `StrategyAdvice`,
  `StrategyEstimate`)
* configuration: `BlockSizes`, `plan_block_sizes` (TPU tiles that fit VMEM),
  `available_implementations(op="ring" | "paged")`
"""

from flax_ringattn._src import public as _public
from flax_ringattn._src.advisor import Hardware, StrategyAdvice, StrategyEstimate, suggest_strategy
from flax_ringattn._src.backends.pallas_tpu.planners import plan_block_sizes
from flax_ringattn._src.block_sizes import BlockSizes
from flax_ringattn._src.dense_masks import (
  DenseStructure,
  dense_mask_from_structure,
  padded_segment_ids,
  structure_from_dense_mask,
)
from flax_ringattn._src.flash import save_attention_residuals, save_mask_structure
from flax_ringattn._src.implementations import available_implementations
from flax_ringattn._src.layout import zigzag_inverse, zigzag_order, zigzag_positions
from flax_ringattn._src.masks import Mask
from flax_ringattn._src.nnx.convert import ConversionReport, convert
from flax_ringattn._src.nnx.paged_mha import PagedMultiHeadAttention
from flax_ringattn._src.nnx.placement import place_on_mesh
from flax_ringattn._src.nnx.ring_mha import RingMultiHeadAttention, make_ring_attention_fn
from flax_ringattn._src.packing import Layout, apply_layout, balanced_layout, layout_imbalance, undo_layout
from flax_ringattn._src.paged.cache import CacheOverflowError, PagedKVCache
from flax_ringattn._src.paged.op import paged_attention
from flax_ringattn._src.paged.reference import paged_reference_attention
from flax_ringattn._src.paged.ring_prefill import paged_ring_prefill
from flax_ringattn._src.reference import reference_attention
from flax_ringattn._src.ring.dense import dot_product_attention
from flax_ringattn._src.ring.op import ring_attention
from flax_ringattn._src.serving.draft import NGramDraft
from flax_ringattn._src.serving.engine import ServingEngine
from flax_ringattn._src.serving.stats import EngineStats

__version__ = "0.1.0"

__all__ = [
  "BlockSizes",
  "CacheOverflowError",
  "Hardware",
  "ConversionReport",
  "DenseStructure",
  "EngineStats",
  "Layout",
  "Mask",
  "NGramDraft",
  "PagedKVCache",
  "PagedMultiHeadAttention",
  "RingMultiHeadAttention",
  "ServingEngine",
  "apply_layout",
  "available_implementations",
  "balanced_layout",
  "convert",
  "dense_mask_from_structure",
  "dot_product_attention",
  "layout_imbalance",
  "make_ring_attention_fn",
  "padded_segment_ids",
  "paged_attention",
  "paged_reference_attention",
  "paged_ring_prefill",
  "place_on_mesh",
  "plan_block_sizes",
  "reference_attention",
  "ring_attention",
  "save_attention_residuals",
  "save_mask_structure",
  "StrategyAdvice",
  "StrategyEstimate",
  "suggest_strategy",
  "structure_from_dense_mask",
  "undo_layout",
  "zigzag_inverse",
  "zigzag_order",
  "zigzag_positions",
]

_public.expose_init_signatures(globals()[name] for name in __all__)
