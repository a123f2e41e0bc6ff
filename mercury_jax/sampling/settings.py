"""Sampler settings: one frozen, hashable dataclass, static under ``jax.jit`` (only the step count is traced).

``SAMPLERS`` names the step rules a user picks with ``--sampler``; every knob is checked by
:meth:`SamplerSettings.validate`, whose ``ValueError`` names the knob and the allowed range.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from mercury_jax.config import ObjectiveConfig

SAMPLERS = ("ancestral", "confidence", "threshold")
CONFIDENCES = ("prob", "margin", "entropy")
# ``generate`` arguments that only the refinement loop has; an autoregressive model rejects them.
DIFFUSION_ONLY = ("steps", "rule", "confidence", "threshold", "block_length", "revision")


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
  """How each refinement step decides which masked positions to commit.

  Attributes:
    rule: ``ancestral`` (the exact MDLM/MD4 reverse step of ``objective``'s schedule), ``confidence`` (LLaDA
      low-confidence remasking: the k most confident positions per step) or ``threshold`` (Fast-dLLM parallel
      decoding: every position with confidence >= ``threshold``, never fewer than the confidence schedule's k).
    confidence: What ranks positions: ``prob`` (probability of the proposed token), ``margin`` (top-1 minus top-2
      probability) or ``entropy`` (negative entropy of the position's distribution).
    temperature: Divides the logits before sampling a token; 0 picks the most likely token (greedy).
    top_k: Sample among the k most likely tokens only; 0 keeps all.
    top_p: Nucleus sampling: the smallest set of tokens whose probability reaches ``top_p``; 1 keeps all.
    threshold: The ``threshold`` rule's confidence bar tau.
    block_length: Semi-autoregressive blocks of this many generated tokens, finished left to right; 0: one block.
    revision: ReMDM-style revision strength eta in [0, 1): each step re-masks the fraction
      ``eta * (steps left in the block - 1) / (steps of the block)`` of the already committed tokens with the lowest
      commit-time confidence, so later steps can rewrite them. The fraction reaches 0 at a block's last step.
    min_length: No end-of-sequence token among the first ``min_length`` generated tokens.
    eos_to_pad: Generated positions after the first generated end-of-sequence token become padding.
    trace: Record the canvas after each of the first ``trace`` steps (0: no trace). A static size, so each value
      compiles once.
    objective: The model's objective config: the schedule ``alpha(t)`` and the mask id.
    eos_id: The end-of-sequence token.
    pad_id: The padding token.
    bos_id: The beginning-of-sequence token (never proposed).
    unk_id: The unknown token (never proposed).
    num_tokens: The tokenizer's size: ids at or above it (a padded vocabulary) are never proposed; 0: no limit.
  """

  rule: Literal["ancestral", "confidence", "threshold"] = "confidence"
  confidence: Literal["prob", "margin", "entropy"] = "prob"
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  threshold: float = 0.9
  block_length: int = 0
  revision: float = 0.0
  min_length: int = 0
  eos_to_pad: bool = True
  trace: int = 0
  objective: ObjectiveConfig = ObjectiveConfig()
  eos_id: int = 3
  pad_id: int = 0
  bos_id: int = 2
  unk_id: int = 1
  num_tokens: int = 0

  @property
  def mask_id(self) -> int:
    return self.objective.mask_id

  def validate(self) -> SamplerSettings:
    """Returns ``self`` or raises :class:`SettingError` naming the bad setting and its allowed range."""
    if self.rule not in SAMPLERS:
      raise SettingError("rule", self.rule, f"is unknown; choose one of {', '.join(SAMPLERS)}")
    if self.confidence not in CONFIDENCES:
      raise SettingError("confidence", self.confidence, f"is unknown; choose one of {', '.join(CONFIDENCES)}")
    if not self.temperature >= 0.0:
      raise SettingError("temperature", self.temperature, "must be >= 0 (0 is greedy)")
    if self.top_k < 0:
      raise SettingError("top_k", self.top_k, "must be >= 0 (0 keeps every token)")
    if not 0.0 < self.top_p <= 1.0:
      raise SettingError("top_p", self.top_p, "must lie in (0, 1]")
    if self.confidence != "entropy" and not 0.0 <= self.threshold <= 1.0:
      raise SettingError("threshold", self.threshold, f"must lie in [0, 1] for confidence={self.confidence!r}")
    if self.block_length < 0:
      raise SettingError("block_length", self.block_length, "must be >= 0 (0: one block)")
    if not 0.0 <= self.revision < 1.0:
      raise SettingError("revision", self.revision, "must lie in [0, 1)")
    if self.min_length < 0:
      raise SettingError("min_length", self.min_length, "must be >= 0")
    if self.trace < 0:
      raise SettingError("trace", self.trace, "must be >= 0")
    if self.num_tokens < 0:
      raise SettingError("num_tokens", self.num_tokens, "must be >= 0 (0: the model's whole vocabulary)")
    return self


class SettingError(ValueError):
  """A sampler setting (or a ``generate`` argument) that cannot be used.

  ``str(error)`` reads ``field=value requirement``; a front end that calls the setting something else (a CLI flag,
  a request field) writes its own name with :meth:`named`, so every front end shares one validation.
  """

  def __init__(self, field: str, value, requirement: str):
    self.field, self.value, self.requirement = field, value, requirement
    super().__init__(self.named(field))

  def named(self, name: str) -> str:
    return f"{name}={self.value!r} {self.requirement}"


def check_knobs_for_model(knobs: dict, autoregressive: bool) -> None:
  """Raises :class:`SettingError` for a refinement knob (``DIFFUSION_ONLY``) given to an autoregressive model.

  ``knobs`` maps ``generate`` argument names to values; None means "not given".
  """
  if not autoregressive:
    return
  for name in DIFFUSION_ONLY:
    if knobs.get(name) is not None:
      raise SettingError(
        name,
        knobs[name],
        "applies to diffusion models only; this checkpoint is an autoregressive model (it decodes one token per "
        "forward pass)",
      )
