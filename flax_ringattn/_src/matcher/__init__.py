"""The hand-written-attention matcher: jaxpr analysis only (it imports neither the ops nor flax).

One entry point, `find_sites(program)`, on a `Program` (`Program.flatten(closed_jaxpr).dce()`): the attention
sites it can run exactly as ring attention, the ones it leaves alone (with the reason), and the attention-sink
columns found around them.  A site is then run with `site_inputs` (the model's q, k, v and masks in the op's
layouts), `read_sinks` and `site_output` (the op's output back in the model's layout).

Files: `program.py` (the flattened program and its constants), `band.py` (constants too big to build, read at
points), `site.py` (a recognised site and how it runs), `attention.py` (the matcher proper), `sinks.py` (sink
columns around it).
"""

from __future__ import annotations

from flax_ringattn._src.matcher import sinks
from flax_ringattn._src.matcher.program import OPAQUE_SCOPE, Program
from flax_ringattn._src.matcher.sinks import SinkRef, read_sinks
from flax_ringattn._src.matcher.site import Rejected, Site, site_inputs, site_output

__all__ = [
  "OPAQUE_SCOPE",
  "Program",
  "Rejected",
  "SinkRef",
  "Site",
  "find_sites",
  "read_sinks",
  "site_inputs",
  "site_output",
]


def find_sites(program: Program):
  """([Site], [Rejected], {g2: SinkRef}) of `program`: every attention it can run exactly, every one it leaves
  alone with the reason, and the sink column of the sites that have one.

  `Program.run` evaluates each remat body inside its `jax.checkpoint`, so an attention split across a body's edge
  is left alone too.
  """
  sites, rejected, refs = sinks.find_sites(program)
  kept = []
  for site in sites:
    bodies = {id(program.eqns[j].region) for j in (*site.interior, site.g2)}
    if len(bodies) > 1:
      rejected = [*rejected, Rejected(site.g1, "the attention crosses the edge of a jax.checkpoint body")]
    else:
      kept.append(site)
  return kept, rejected, {s.g2: refs[s.g2] for s in kept if s.g2 in refs}
