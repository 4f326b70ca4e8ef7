"""Pieces shared by the NNX layers."""

from __future__ import annotations


def head_sharding_metadata(head_axis, mesh, *, kernel_metadata, bias_metadata, out_kernel_metadata, out_bias_metadata):
  """Parameter metadata of nnx.MultiHeadAttention with the heads on `head_axis`.

  q/k/v kernels are [F, heads, H] and their biases [heads, H]; the out kernel is
  [N, H, F].  Metadata the caller passed wins over these defaults.
  """
  metadata = dict(
    kernel_metadata=kernel_metadata,
    bias_metadata=bias_metadata,
    out_kernel_metadata=out_kernel_metadata,
    out_bias_metadata=out_bias_metadata,
  )
  if head_axis is None:
    return metadata
  extra = {"mesh": mesh} if mesh is not None else {}
  defaults = dict(
    kernel_metadata=(None, head_axis, None),
    bias_metadata=(head_axis, None),
    out_kernel_metadata=(head_axis, None, None),
    out_bias_metadata=(None,),
  )
  return {name: {"out_sharding": defaults[name], **extra, **metadata[name]} for name in metadata}
