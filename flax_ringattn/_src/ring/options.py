"""`RingOptions`: the static keyword options of one ring attention call, held once and forwarded whole.

The layers (`RingMultiHeadAttention`), `make_ring_attention_fn`, `convert`'s hand-written sites and
`dot_product_attention` validate their own keywords once, build one `RingOptions`, and hand it to
`dense.masked_ring_attention`, which calls `ring_attention(**options.ring_kwargs())`.  Every field but
`check_mask` is a keyword of `ring_attention` of the same name (a test checks this), so a new static option of the
op reaches every caller by one field here, plus the public signatures that accept it.  Tensors (segment ids, the
dropout key) and the dense mask stay call arguments.
"""

from __future__ import annotations

import dataclasses

# Fields that are not `ring_attention` keywords.
_NOT_OP_KEYWORDS = ("check_mask",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingOptions:
  axis_name: object = None
  mesh: object = None
  is_causal: bool = False
  local_window_size: object = None
  chunk_size: int | None = None
  logits_soft_cap: float | None = None
  scale: float | None = None
  load_balance: bool = False
  strategy: str = "ring"
  implementation: str | None = None
  block_sizes: object = None
  batch_axis: object = None
  head_axis: object = None
  precision: object = None
  interpret: object = None
  dropout_rate: float = 0.0
  broadcast_dropout: bool = True
  # Verify under jit that a dense mask was recovered exactly (the output is NaN where not; "report" also says why
  # in a host callback); a concrete mask is always checked.
  check_mask: bool | str = True

  def __post_init__(self):
    # Here, not in the op's checks: `dot_product_attention` and converted sites build options without them.
    if not isinstance(self.check_mask, bool) and self.check_mask != "report":
      raise TypeError(f"check_mask must be a bool or 'report', got {self.check_mask!r}")

  def ring_kwargs(self) -> dict:
    """The keyword arguments of `ring_attention` these options stand for."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_OP_KEYWORDS}

  def replace(self, **changes) -> RingOptions:
    return dataclasses.replace(self, **changes)
