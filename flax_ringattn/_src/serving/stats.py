"""`EngineStats`: what a `ServingEngine` counts over its lifetime."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
  """Counts over the engine's lifetime (every `generate` / `stream` call adds to them).

  Read from `ServingEngine.stats`: `steps` and `ring_prefills` run, `compiles`; `prompt_tokens`,
  `prefill_tokens_computed` and `shared_prefix_tokens` (prefix reuse), `generated_tokens`; `draft_proposed` /
  `draft_accepted` (speculative decoding), `evictions`, wall `seconds` (of it `compile_seconds`, and
  `step_seconds` in the step calls: the rest is host work the device waits through) and the mean
  `cache_utilization`; `overlapped_steps` (decode steps dispatched before the previous one was read).
  `decode_steps`, `decode_tokens` and `decode_seconds` count the pure decode steps alone
  (every row one new token of a sequence whose prompt is in the cache: no prompt chunk, no draft proposal).
  `tokens_per_s`, `decode_tokens_per_s` and `as_dict()` summarise them.
  """

  steps: int = 0  # ragged steps run (ring prefills not included)
  ring_prefills: int = 0  # prompts prefilled by the ring (context parallel)
  compiles: int = 0  # traces of the engine's jitted programs (steps, ring prefills, cache updates)
  prompt_tokens: int = 0  # tokens of the prompts served
  prefill_tokens_computed: int = 0  # prompt tokens run through the model (shared prefixes are not)
  shared_prefix_tokens: int = 0  # prompt tokens taken from another sequence's pages
  generated_tokens: int = 0
  draft_proposed: int = 0  # speculative tokens proposed by the draft
  draft_accepted: int = 0  # ... and kept
  evictions: int = 0  # sequences freed and re-queued because their tokens did not fit
  seconds: float = 0.0  # wall time inside generate / stream
  # ... of it, the host calls that traced and compiled a program (with that call's own run): seconds minus this
  # is the steady state
  compile_seconds: float = 0.0
  # ... of it, inside the step and ring prefill calls (dispatch, the device's run, the outputs' transfer; compiling
  # calls included): seconds minus this is the host's own work (scheduling, admission, releases), in which the
  # device waits
  step_seconds: float = 0.0
  cache_utilization: float = 0.0  # mean over steps of the cache's used / allocated token slots
  # Of the ragged steps, the pure decode ones: each row one new token of a sequence whose prompt is in the cache
  # (a step with a prompt chunk or a draft's proposals is not one).  A decode benchmark reads these: under
  # continuous batching a batch's first prompts decode inside the later ones' prefill steps.
  decode_steps: int = 0
  decode_tokens: int = 0  # the sequences those steps decoded (one token each)
  decode_seconds: float = 0.0  # ... the steps' wall time, as step_seconds counts it (compiling calls included)
  # Of the ragged steps, those dispatched before the host read the step before them (`ServingEngine(overlap=True)`,
  # pure decode steps): their step_seconds run from that read's end to their own, so the host's work between
  # the two (the tokens' emission, the next step's inputs and dispatch) is inside step_seconds, beside the device.
  overlapped_steps: int = 0

  @property
  def tokens_per_s(self) -> float:
    return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

  @property
  def decode_tokens_per_s(self) -> float:
    return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

  def as_dict(self) -> dict:
    return dataclasses.asdict(self) | {
      "tokens_per_s": self.tokens_per_s,
      "decode_tokens_per_s": self.decode_tokens_per_s,
    }
