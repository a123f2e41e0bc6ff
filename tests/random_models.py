"""Small random-weight checkpoints of every kind, with sharp distributions (a random model with strong opinions)."""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp

from mercury_jax.checkpoint import export_params
from mercury_jax.config import Config, ModelConfig, ObjectiveConfig
from mercury_jax.model import Transformer

KINDS = {
  "block_diffusion": (False, ObjectiveConfig(block_size=4)),
  "autoregressive": (True, ObjectiveConfig(name="autoregressive")),
  "whole_sequence": (False, ObjectiveConfig()),
  "verified": (False, ObjectiveConfig(name="verified", draft_length=4)),
}
# The continuous family (latents of LATENT_DIM dimensions): block-causal and whole-sequence.
LATENT_KINDS = {
  "continuous_block": (False, ObjectiveConfig(name="continuous", block_size=4, self_conditioning=0.5)),
  "continuous": (False, ObjectiveConfig(name="continuous", self_conditioning=0.5)),
}
LATENT_DIM = 16
# Verified decoding with every kind of candidate: the drafter's chain, a lookup chain beside it, a pre-draft block
# after each chain depth. The serving, cache and structured-output tests run a verified model with it: a CPU's
# device default (``sampling.drafts.DEFAULTS``) verifies the lookup chain alone and would leave the drafter out.
DRAFTER = {"draft_tree": "chain", "draft_lookup": 4, "draft_blocks": "all"}


def drafting(kind: str) -> dict:
  """:data:`DRAFTER` for a verified ``kind``, else nothing (the draft knobs need a verified checkpoint)."""
  return DRAFTER if kind == "verified" else {}


def random_checkpoint(root: Path, kind: str, tokenizer: Path, vocab_size: int = 512) -> Path:
  """An exported checkpoint of ``kind`` (a key of :data:`KINDS` or :data:`LATENT_KINDS`) under ``root / kind``."""
  causal, objective = {**KINDS, **LATENT_KINDS}[kind]
  model = ModelConfig(
    vocab_size=vocab_size, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64,
    max_length=128, causal=causal, latent_dim=LATENT_DIM if objective.continuous else 0,
  )  # fmt: skip
  params = nn.meta.unbox(Transformer(model).init(jax.random.key(1), jnp.zeros((1, 8), jnp.int32)))["params"]
  params = jax.tree.map(lambda p: p * 8.0, params)
  return export_params(root / kind, params, Config(model=model, objective=objective, name=kind), tokenizer).parent
