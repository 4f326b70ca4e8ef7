"""`convert(to="paged")` for attention written by hand: each converted site serves from its own paged KV cache.

The matcher and the watching are `handwritten.py`'s; only what a site computes differs.  In a serving step
(`paged.step`, entered by `fr.ServingEngine`) a site takes the q, k and v the model computed (after its RoPE
and qk-norm), appends k and v to its cache and attends over the ragged batch: each sequence causal over its own
cached tokens, with the site's window (its causal side), soft cap, scale and sinks.  The model's mask, built or
passed, does not decide what a token sees.

The caches live on the module holding the sites, as `module.paged_kv_caches` (an `nnx.List` of `nnx.Cache`,
one per site in program order), created by `init_site_caches` after a "discover" step has recorded each site's
shapes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from flax_ringattn._src import matcher
from flax_ringattn._src.paged import attend
from flax_ringattn._src.paged import step as paged_step
from flax_ringattn._src.paged.cache import PagedKVCache

CACHES = "paged_kv_caches"  # the attribute of a module holding its sites' caches


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedSiteOptions:
  """What `convert(to="paged", ...)` passes to every hand-written site."""

  mesh: object = None
  seq_axis: object = None
  local_window_size: object = None  # declared: w, (left, right), or fn(module)
  implementation: str | None = None
  block_sizes: object = None
  interpret: object = None
  checked: bool = False


class PagedSiteFn:
  """The replacement of one site's second dot_general: attention over the site's paged cache."""

  def __init__(self, site, module, index: int, opts: PagedSiteOptions, declared_window=None, sinks=None):
    self.site, self.module, self.index, self.opts = site, module, index, opts
    self.declared, self.sinks = declared_window, sinks
    self.inputs = site.inputs + ([sinks.atom] if sinks is not None else [])

  def __call__(self, read):
    site, path = self.site, getattr(self.module, "_fr_path", type(self.module).__name__)
    q, k, v, _ = matcher.site_inputs(site, read)  # the model's masks are not read
    current = paged_step.current()
    if current is None:
      raise TypeError(
        f"{path}: its attention was converted to paged serving (convert(model, to='paged')) and runs only inside "
        "a serving step: serve the model with fr.ServingEngine"
      )
    if current.kind == "discover":  # any batch: convert(..., example=) discovers with the user's own shapes
      need = paged_step.CacheNeed(k.shape[2], k.shape[3], v.shape[3], jnp.dtype(q.dtype))
      current.needs.append((path, self.index, need))
      return matcher.site_output(site, jnp.zeros((*q.shape[:3], v.shape[3]), q.dtype))
    if q.shape[0] != 1:
      raise ValueError(
        f"{path}: a serving step runs the model on one flat ragged batch, [1, T] tokens; this site got a batch of "
        f"B={q.shape[0]} (q {tuple(q.shape)})"
      )
    caches = getattr(self.module, CACHES, None)
    if caches is None or self.index >= len(caches):
      raise ValueError(f"{path}: site {self.index} has no paged cache: ServingEngine creates them (init_site_caches)")
    var = caches[self.index]
    window = self.declared if self.declared is not None else site.window
    if window is not None:
      window = (window[0], 0)  # the band's causal side: a serving row sees no later token
    precision = site.precision[0] if isinstance(site.precision, tuple) else site.precision
    del precision  # the paged kernels accumulate in f32 at the inputs' precision
    sinks = None if self.sinks is None else matcher.read_sinks(site, self.sinks, read)
    out, cache = attend.in_step(
      var.get_value(),
      q[0],
      k[0].astype(q.dtype),
      v[0].astype(q.dtype),
      current,
      sinks=sinks,
      mesh=self.opts.mesh,
      seq_axis=self.opts.seq_axis,
      checked=self.opts.checked,
      local_window_size=window,
      logits_soft_cap=site.cap,
      scale=site.scale,
      implementation=self.opts.implementation,
      block_sizes=self.opts.block_sizes,
      interpret=self.opts.interpret,
    )
    self.new_cache = (var, cache)
    return matcher.site_output(site, out[None])

  def store(self):
    """Assigns the site's new cache (once the whole call has run: a call that raises leaves it as it was)."""
    if getattr(self, "new_cache", None) is not None:
      var, cache = self.new_cache
      var.set_value(cache)
      self.new_cache = None


def init_site_caches(
  module, needs, *, num_pages, page_size, max_num_seqs, pages_per_seq, mesh=None, seq_axis=None, dtype=None,
  merged=False,
):  # fmt: skip
  """Gives `module` one empty paged cache per site (`needs`: [(index, CacheNeed)] from a discover step)."""
  caches = []
  for index, need in sorted(needs, key=lambda x: x[0]):
    if index != len(caches):
      raise ValueError(f"internal: site caches of {type(module).__name__} found out of order ({index})")
    cache = PagedKVCache.create(
      num_pages=num_pages,
      page_size=page_size,
      max_num_seqs=max_num_seqs,
      pages_per_seq=pages_per_seq,
      num_kv_heads=need.num_kv_heads,
      head_dim=need.head_dim,
      v_head_dim=need.v_head_dim,
      dtype=need.dtype if dtype is None else dtype,
      merged=merged,
      **({} if seq_axis is None else dict(mesh=mesh, seq_axis=seq_axis)),
    )
    caches.append(nnx.Cache(cache))
  setattr(module, CACHES, nnx.List(caches))
