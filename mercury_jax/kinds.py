"""Token kinds: the one definition of what each position of a training record or a sampling canvas is.

A record (``mercury_jax.data.records``) and a canvas (``mercury_jax.sampling.canvas``) are both ``(tokens, kinds)``
rows with one kind per position:

* ``PAD`` (0): fills the row to its length; never attended to, never noised, never scored, never generated.
* ``FIXED`` (1): known text. In training, an SFT prompt: clean context, never noised, not scored. In sampling, the
  prompt, fill-in-the-middle context or a template's text: conditioning that never changes.
* ``TARGET`` (2): what the model predicts. In training, noised by the objective and scored; in sampling, the
  positions that start masked and are generated.
* ``DISTILLED`` (3): training only, a token the network's own next-token head wrote (a self-distillation record,
  ``mercury_jax.distill``). A verified model's drafter masks and scores it like ``TARGET``; every next-token loss
  (the verifier's, the twin's) reads it as context and never scores it, and every other objective sees clean context.
"""

from __future__ import annotations

import numpy as np

PAD = 0
FIXED = 1
TARGET = 2
DISTILLED = 3


def segment_ids(kinds):
  """Attention segments of ``kinds`` (numpy or jax, any shape): padding is segment 0, everything else segment 1.

  Attention stays within a segment and segment 0 is never attended to (see ``mercury_jax.attention``).
  """
  if isinstance(kinds, np.ndarray):
    return (kinds != PAD).astype(np.int32)
  import jax.numpy as jnp

  return (kinds != PAD).astype(jnp.int32)
