"""Public diffusion-LM checkpoints (LLaDA, Dream / DiffuCoder, SDAR, Fast-dLLM v2), and their autoregressive parents
(plain Qwen2 / Qwen3 / Llama models, ``--family autoregressive``), as mercury_jax checkpoints.

``python -m mercury_jax.convert --from DIR --out models/NAME`` reads a Hugging Face folder (``config.json``,
safetensors, tokenizer files) without torch and writes a params-only Orbax checkpoint that
:func:`mercury_jax.checkpoint.restore_params` and the sampler read, the tokenizer files with ``special_tokens.json``,
and a ``MODEL_CARD.md``. The family's decoding defaults (its authors' settings, with their source) go into the stored
config's ``[sampling]`` section. :func:`config_from_hf` gives the mercury_jax config of a ``config.json`` alone
(for memory estimates of the full-size models).
"""

from mercury_jax.convert.build import convert
from mercury_jax.convert.families import FAMILIES, ConvertError, config_from_hf, detect

__all__ = ["FAMILIES", "ConvertError", "config_from_hf", "convert", "detect"]
