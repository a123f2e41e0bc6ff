"""The models shipped in the package: params-only checkpoints (``export_params``) with their ``tokenizer.model``."""

from __future__ import annotations

from pathlib import Path

from mercury_jax.files import TOKENIZER_FILE

ASSETS = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_CHECKPOINT = ASSETS / "default"
BUNDLED_MODELS = {
  "default": "the verified code model (drafts blocks by diffusion, verified by its own next-token head)",
  "default_ar": "its autoregressive twin (the fair baseline: the same data and tokens)",
  "default_bd": "the block-diffusion code model (Mercury-style refinement)",
}


def default_checkpoint(name: str = "default") -> Path | None:
  """The bundled model ``name`` (a key of :data:`BUNDLED_MODELS`), or None when the package lacks it.

  Raises:
    ValueError: ``name`` is not a bundled model.
  """
  if name not in BUNDLED_MODELS:
    raise ValueError(f"no bundled model is called {name!r}; the bundled models are {', '.join(BUNDLED_MODELS)}")
  path = DEFAULT_CHECKPOINT if name == "default" else ASSETS / name
  has_steps = path.is_dir() and any(p.name.isdigit() for p in path.iterdir())
  return path if has_steps and (path / TOKENIZER_FILE).is_file() else None
