"""Sampler settings: one frozen, hashable dataclass, static under ``jax.jit``.

The step count is traced everywhere; the block engine also traces temperature, top-k, top-p and threshold
(``proposal.Knobs``, per row), so only the whole-canvas loop compiles per value of those.

``SAMPLERS`` names the step rules a user picks with ``--sampler``; every knob is checked by
:meth:`SamplerSettings.validate`, whose ``ValueError`` names the knob and the allowed range.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

from mercury_jax.config import ObjectiveConfig
from mercury_jax.limits import MAX_GUIDANCE, MAX_SEED, SOLVERS

SAMPLERS = ("ancestral", "confidence", "threshold", "ode")
CONFIDENCES = ("prob", "margin", "entropy")
COMMIT_COUNTS = ("even", "timesteps")
# Verified decoding's draft trees by name: the rank paths each adds to the drafter's chain (``parse_tree``;
# ``mercury_jax.sampling.drafts``); ``none`` has no drafter node (the lookup chain alone).
TREES = {"chain": "", "small": "1", "wide": "1,2,10,01", "none": ""}
AUTO = "auto"  # A draft-tree knob's default: the device's (``drafts.DEFAULTS``).
MAX_LOOKUP = 16  # The longest lookup chain.
MAX_RANK = 9  # A rank path's digits: alternatives 1 .. 9.
# ``draft_blocks``: a pre-draft block after every node of the tree (the alternatives' and the lookup chain's too), so a
# step that accepts an alternative still has the drafter's chain next (``all`` pre-drafts after the chain's nodes).
EVERY_NODE = "tree"
# ``generate`` arguments that only the refinement loop has; an autoregressive model rejects them.
DIFFUSION_ONLY = (
  "steps", "steps_per_block", "rule", "confidence", "threshold", "block_length", "revision", "commit_counts",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
  """How each refinement step decides which masked positions to commit.

  Attributes:
    rule: ``ancestral`` (the exact MDLM/MD4 reverse step of ``objective``'s schedule), ``confidence`` (LLaDA
      low-confidence remasking: the k most confident positions per step) or ``threshold`` (Fast-dLLM parallel
      decoding: every position with confidence >= ``threshold``, never fewer than the confidence schedule's k; the
      default of the command line, the Python API and the server alike); a continuous checkpoint
      (``objective.name = "continuous"``) decodes with ``ode`` alone, its default: the probability-flow ODE over the
      block's latents, which commits the whole block at its last step (:mod:`~mercury_jax.sampling.latents`).
    confidence: What ranks positions: ``prob`` (probability of the proposed token), ``margin`` (top-1 minus top-2
      probability) or ``entropy`` (negative entropy of the position's distribution).
    temperature: Divides the logits before sampling a token; 0 picks the most likely token (greedy).
    top_k: Sample among the k most likely tokens only; 0 keeps all.
    top_p: Nucleus sampling: the smallest set of tokens whose probability reaches ``top_p``; 1 keeps all.
    threshold: The ``threshold`` rule's confidence bar tau.
    block_length: The engine's block for a whole-sequence checkpoint: semi-autoregressive blocks of this many canvas
      positions, finished left to right (0: the whole canvas is one block); a block-diffusion checkpoint's is its
      trained block, the twin's 1.
    revision: Re-masking strength eta in [0, 1) (0: off): committed tokens are masked again so later steps can
      rewrite them. Only tokens of blocks that still have a masked position are ever re-masked: a finished block
      stays as it is. With ``rule="ancestral"`` this is ReMDM (Wang et al. 2025) with the ReMDM-rescale schedule:
      each step re-masks every committed token with probability ``sigma_t = eta * min(1, (1 - alpha_s) / alpha_t)``
      and unmasks masked ones with ReMDM's matching, higher probability (see ``rules.ancestral``). With the
      ``confidence`` and ``threshold`` rules it is a deterministic low-confidence re-masking, not ReMDM's randomised
      schedule: each step re-masks the fraction ``eta * (steps left in the block - 1) / (steps of the block)`` of
      the committed tokens (rounded) with the lowest commit-time confidence (see ``rules.low_confidence_remasking``).
    min_length: No end-of-sequence token among a row's first ``min_length`` generated positions, counted over its
      holes in canvas order: with holes of 4 and 4 tokens, ``min_length=6`` keeps EOS out of the whole first hole
      and out of the first 2 positions of the second.
    eos_to_pad: An EOS ends its own hole only (a hole is a maximal run of consecutive generated positions): the
      positions after it in that hole become padding, while later fixed text and later holes stay and are still
      generated. False: an EOS is a token like any other and the whole hole is generated, for every model.
    trace: Record the canvas after each of the first ``trace`` steps (0: no trace). A static size, so each value
      compiles once.
    objective: The model's objective config: the schedule ``alpha(t)`` and the mask id.
    eos_id: The end-of-sequence token (proposed, except where ``min_length`` bans it).
    pad_id: The padding token (never proposed, unless it is also ``eos_id``).
    bos_id: The beginning-of-sequence token (never proposed, unless it is also ``eos_id``).
    unk_id: The unknown token (never proposed, unless it is also ``eos_id``).
    num_tokens: The tokenizer's size: ids at or above it (a padded vocabulary) are never proposed; 0: no limit.
    decode: ``auto`` (the checkpoint's best), ``ar``, ``diffusion`` or ``verified``
      (:func:`~mercury_jax.sampling.plan.plan_for`: which modes a checkpoint has).
    commit_counts: How many positions the ``confidence`` rule commits at a step (the ``threshold`` rule's minimum):
      ``even`` spreads a block's open positions evenly over its steps left, ``ceil(open / steps_left)`` (LLaDA's
      ``get_num_transfer_tokens``: the same counts); ``timesteps`` takes ``floor(open * (1 - s / t))`` on Dream's
      time grid ``linspace(1, 1e-3, steps + 1)`` (Dream's ``_sample``, which may commit nothing at a step).
    stop_ids: Other tokens that end a turn as EOS does (a converted chat model's ``<|eot_id|>`` or ``<|im_end|>``):
      the engine treats them as one event with EOS, whose probability is their sum (their logits are merged into
      EOS's by a log-sum-exp and they are never proposed themselves), so every EOS rule (``min_length``, ``eos_to_pad``,
      a stream's end) applies to them.
    draft_length: Verified decoding's draft length k (the drafter's chain of k - 1 drafts); 0: the checkpoint's
      trained ``objective.draft_length``.
    draft_tree: Verified decoding's draft tree (:mod:`~mercury_jax.sampling.drafts`): ``chain`` (the drafter's k - 1
      drafts), ``small``, ``wide`` (the chain and some of the drafter's next likeliest tokens), ``none`` (no drafter
      candidate: the lookup chain alone), rank paths added to the chain (``"1,2,10"``), or ``auto``: the device's
      (a CPU pays for every chunk position). Static: a compilation key.
    draft_lookup: The length of the prompt-lookup chain verified beside the drafter's candidates (the tokens that
      followed the row's last tokens where they occurred before in its text); 0: off; -1: the device's.
    draft_blocks: After which outcomes the chunk pre-drafts the next step's chain: ``all`` (every depth of the
      chain, TiDAR's), ``tree`` (every node: the alternatives and the lookup chain too, so a step that ends on one
      still drafts next), chain depths (``"0,1"``: the likeliest outcomes, a cheaper chunk), ``none``, or ``auto``.
    draft_confidence: Per-row adaptive draft length: a drafter candidate is verified only where the drafter's
      probability of it (the chain's: its top probability there) reaches this bar, so an unsure row stops its
      branches early (0: off); a batch whose candidates all stop early runs a shorter chunk.
    solver: The ``ode`` rule's solver: ``euler`` (one forward pass per step) or ``heun`` (EDM's second-order
      correction: two passes per step but the last).
    self_conditioning: The ``ode`` rule feeds each pass the previous step's estimate of the clean latents (a
      checkpoint trained with ``objective.self_conditioning > 0``; ignored otherwise).
    guidance: The ``ode`` rule's classifier-free guidance scale ``w`` (1: off): the block's logits become
      ``l_u + w (l_c - l_u)`` for the proposals and the denoiser alike, with ``l_u`` from a second pass over the block
      with every clean position outside it hidden (the block as a document's first, which block-causal training sees
      in every record; rotary attention inside the block is relative, so its position does not matter). ``w > 1``
      pulls the text towards what the context makes likely, ``w = 0`` ignores the context; each step runs two passes.
    prefill_chunk: The exact cache's prefill (the prompt's keys and values) runs in chunks of this many positions,
      rounded up to whole blocks, each against the cache the chunks before it wrote: a long prompt's memory is bounded
      by the chunk (``BlockPlan.prefill_chunk``). 0: one pass. The keys and values agree with the one-pass prefill's to
      float rounding.
  """

  rule: Literal["ancestral", "confidence", "threshold", "ode"] = "threshold"
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
  decode: Literal["auto", "ar", "diffusion", "verified"] = "auto"
  draft_length: int = 0
  draft_tree: str = AUTO
  draft_lookup: int = -1
  draft_blocks: str = AUTO
  draft_confidence: float = 0.0
  commit_counts: Literal["even", "timesteps"] = "even"
  stop_ids: tuple[int, ...] = ()
  prefill_chunk: int = 0
  solver: Literal["euler", "heun"] = "euler"
  self_conditioning: bool = True
  guidance: float = 1.0

  @property
  def mask_id(self) -> int:
    return self.objective.mask_id

  def validate(self) -> SamplerSettings:
    """Returns ``self`` or raises :class:`SettingError` naming the bad setting and its allowed range."""
    if self.rule not in SAMPLERS:
      raise SettingError("rule", self.rule, f"is unknown; choose one of {', '.join(SAMPLERS)}")
    if self.objective.continuous and self.rule != "ode":
      raise SettingError(
        "rule", self.rule, "does not apply to a continuous checkpoint: it decodes with 'ode' (the probability-flow ODE)"
      )
    if self.rule == "ode" and not self.objective.continuous:
      raise SettingError("rule", self.rule, "needs a continuous checkpoint (objective.name='continuous')")
    if self.solver not in SOLVERS:
      raise SettingError("solver", self.solver, f"is unknown; choose one of {', '.join(SOLVERS)}")
    if self.solver != "euler" and self.rule != "ode":
      raise SettingError("solver", self.solver, "applies to a continuous checkpoint's rule 'ode' only")
    if not 0.0 <= self.guidance <= MAX_GUIDANCE:
      raise SettingError("guidance", self.guidance, f"must lie in [0, {MAX_GUIDANCE:g}] (1: off)")
    if self.guidance != 1.0 and self.rule != "ode":
      raise SettingError("guidance", self.guidance, "applies to a continuous checkpoint's rule 'ode' only")
    if self.rule == "ode" and self.revision:
      raise SettingError("revision", self.revision, "does not apply to rule 'ode': its latents move at every step")
    if self.commit_counts not in COMMIT_COUNTS:
      raise SettingError("commit_counts", self.commit_counts, f"is unknown; choose one of {', '.join(COMMIT_COUNTS)}")
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
    if self.draft_length < 0:
      raise SettingError("draft_length", self.draft_length, "must be >= 0 (0: the checkpoint's own)")
    parse_tree(self.draft_tree)
    parse_blocks(self.draft_blocks)
    if not -1 <= self.draft_lookup <= MAX_LOOKUP:
      raise SettingError("draft_lookup", self.draft_lookup, f"must lie in [0, {MAX_LOOKUP}] (0: off; -1: the device's)")
    if not 0.0 <= self.draft_confidence < 1.0:
      raise SettingError("draft_confidence", self.draft_confidence, "must lie in [0, 1) (0: off)")
    if self.prefill_chunk < 0:
      raise SettingError("prefill_chunk", self.prefill_chunk, "must be >= 0 (0: the whole prompt in one pass)")
    if self.num_tokens < 0:
      raise SettingError("num_tokens", self.num_tokens, "must be >= 0 (0: the model's whole vocabulary)")
    specials = {self.mask_id, self.pad_id, self.bos_id, self.unk_id, self.eos_id}
    if self.num_tokens and self.num_tokens <= sum(0 <= i < self.num_tokens for i in specials):
      raise SettingError(
        "num_tokens",
        self.num_tokens,
        f"leaves no token to propose besides the special ids {sorted(specials)}; it must be the tokenizer's size",
      )
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


def check_seed(seed: int) -> None:
  """Raises :class:`SettingError` for a seed out of ``[0, limits.MAX_SEED]`` (two such seeds could share a key)."""
  if not 0 <= seed <= MAX_SEED:
    raise SettingError("seed", seed, f"must lie in [0, {MAX_SEED}]")


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


def block_loads(kinds_row, block: int) -> list[int]:
  """How many positions to generate each engine block of ``block`` positions holds, for one canvas row (its kinds,
  canvas positions; blocks without one are left out). The engine's blocks are aligned to canvas positions, so a hole
  that starts inside a block makes a partial first block."""
  import numpy as np

  from mercury_jax import kinds as K

  positions = np.flatnonzero(np.asarray(kinds_row) == K.TARGET)
  if not block:  # The whole canvas is one block.
    return [int(positions.size)] if positions.size else []
  return np.bincount(positions // block)[np.unique(positions // block)].tolist()


def hole_loads(first: int, count: int, block: int) -> list[int]:
  """:func:`block_loads` of a single hole of ``count`` positions from canvas position ``first``."""
  loads, position = [], first
  while position < first + count:
    end = min((position // block + 1) * block, first + count)
    loads.append(end - position)
    position = end
  return loads


class Budget(NamedTuple):
  """Steps per block of one row: ``per_block`` for every block, one more for its first ``extra`` blocks."""

  per_block: int
  extra: int = 0

  def total(self, loads, *, capped: bool = True) -> int:
    """The most steps the row can take with ``loads`` positions in its blocks."""
    steps = [self.per_block + (j < self.extra) for j in range(len(loads))]
    return sum(min(s, n) if capped else s for s, n in zip(steps, loads, strict=True))


def steps_per_block(steps: int | None, loads, *, capped: bool = True) -> Budget:
  """The engine's steps per block that spend a total budget of ``steps`` on a row whose blocks hold ``loads``
  positions to generate (:func:`block_loads`), never more.

  With ``capped`` (rules that commit at least one position per step: confidence and threshold without revision) a
  block never takes more steps than it has positions: every block gets the most steps ``p`` whose total,
  ``sum(min(p, n))`` over the blocks, stays within ``steps``, and the first blocks one more while the budget lasts.
  Otherwise (the ancestral rule, revision: a step may commit nothing) every block takes its steps: ``steps // blocks``
  each, one more for the first ``steps % blocks``. ``steps`` None means one token per step (``max(loads)`` a block).

  Raises:
    SettingError: ``steps`` is below 1, or below the number of blocks: every block takes at least one step, so a
      smaller budget cannot be honoured.
  """
  loads = [n for n in loads if n > 0]
  if not loads:
    return Budget(1)
  if steps is None:
    return Budget(max(loads))
  if steps < 1:
    raise SettingError("steps", steps, "must be >= 1")
  if steps < len(loads):
    raise SettingError(
      "steps",
      steps,
      f"is below the {len(loads)} blocks the {sum(loads)} generated positions lie in; every block takes at least one "
      f"step, so give steps >= {len(loads)} (or generate fewer tokens)",
    )
  if not capped:
    return Budget(steps // len(loads), steps % len(loads))
  best = 1
  for p in range(1, max(loads) + 1):
    if sum(min(p, n) for n in loads) > steps:
      break
    best = p
  if best == max(loads):  # One token per step already: more steps would never run.
    return Budget(best)
  spare = steps - sum(min(best, n) for n in loads)
  return Budget(best, min(spare, len(loads)))


def commits_every_step(settings: SamplerSettings) -> bool:
  """Whether every step of ``settings``' rule commits at least one open position (confidence and threshold without
  revision), so a block never takes more steps than it has positions."""
  return settings.rule not in ("ancestral", "ode") and settings.revision == 0


def parse_tree(spec: str) -> tuple[tuple[int, ...], ...]:
  """The rank paths a ``draft_tree`` adds to the chain (a name of :data:`TREES`, or comma-separated paths of digits:
  rank 0 the chain's draft, ``r`` the ``r``-th alternative); one-line :class:`SettingError` naming the value."""
  if spec == AUTO:
    return ()
  items = [item.strip() for item in TREES.get(spec, spec).split(",") if item.strip()]
  if not all(item.isdigit() for item in items):
    raise SettingError("draft_tree", spec, f"must be auto, one of {', '.join(TREES)}, or rank paths like '1,2,10'")
  paths = tuple(tuple(int(c) for c in item) for item in items)
  for path in paths:
    if path[:-1] and not all(r == 0 for r in path[:-1]) and path[:-1] not in paths:
      shown = "".join(map(str, path))
      raise SettingError("draft_tree", spec, f"has path {shown!r} without its parent {shown[:-1]!r}")
  return paths


def parse_blocks(spec: str) -> tuple[int, ...] | str | None:
  """The chain depths a ``draft_blocks`` pre-drafts after (None: ``all``; ``none``: no pre-draft at all), or
  :data:`EVERY_NODE` (after every node of the tree)."""
  if spec in (AUTO, "all"):
    return None
  if spec == "none":
    return ()
  if spec == EVERY_NODE:
    return EVERY_NODE
  items = [item.strip() for item in spec.split(",") if item.strip()]
  if not items or not all(item.isdigit() for item in items) or len(set(items)) < len(items):
    raise SettingError("draft_blocks", spec, "must be auto, all, tree, none, or distinct chain depths like '0,1'")
  return tuple(sorted(int(item) for item in items))
