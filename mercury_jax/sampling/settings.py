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

  @property
  def mask_id(self) -> int:
    return self.objective.mask_id

  def validate(self) -> SamplerSettings:
    """Returns ``self`` or raises ``ValueError`` naming the bad setting."""
    if self.rule not in SAMPLERS:
      raise ValueError(f"sampler {self.rule!r} is unknown; choose one of {', '.join(SAMPLERS)}")
    if self.confidence not in CONFIDENCES:
      raise ValueError(f"confidence {self.confidence!r} is unknown; choose one of {', '.join(CONFIDENCES)}")
    if not self.temperature >= 0.0:
      raise ValueError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k} must be >= 0 (0 keeps every token)")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p={self.top_p} must lie in (0, 1]")
    if self.confidence != "entropy" and not 0.0 <= self.threshold <= 1.0:
      raise ValueError(f"threshold={self.threshold} must lie in [0, 1] for confidence={self.confidence!r}")
    if self.block_length < 0:
      raise ValueError(f"block_length={self.block_length} must be >= 0 (0: one block)")
    if not 0.0 <= self.revision < 1.0:
      raise ValueError(f"revision={self.revision} must lie in [0, 1)")
    if self.min_length < 0:
      raise ValueError(f"min_length={self.min_length} must be >= 0")
    if self.trace < 0:
      raise ValueError(f"trace={self.trace} must be >= 0")
    return self
