"""Tiny random Hugging Face checkpoints in each diffusion family's file format, built with transformers' own classes.

``hf_checkpoint(directory, family)`` saves a Llama (LLaDA's math, its tensors and config keys renamed to LLaDA's own
as ``modeling_llada.py`` names them), a Qwen2 (Dream, with ``model_type`` "Dream") or a Qwen3 (SDAR, "sdar", block
size 4) model with ``save_pretrained`` (safetensors), a word-level ``tokenizer.json`` whose special tokens sit at
:data:`SPECIAL`, and returns the float32 reference model beside the directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 320
SPECIAL = {"unk": 0, "pad": 1, "bos": 2, "eos": 3, "mask": 4}
_TEXTS = {"unk": "<unk>", "pad": "<pad>", "bos": "<s>", "eos": "</s>", "mask": "<|mask|>"}
_SHAPE = dict(
  hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
  head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10_000.0, vocab_size=VOCAB,
)  # fmt: skip
# Llama tensor name -> LLaDA's (modeling_llada.py, block_type "llama").
_LLADA_NAMES = {
  "model.embed_tokens.weight": "model.transformer.wte.weight",
  "model.norm.weight": "model.transformer.ln_f.weight",
  "lm_head.weight": "model.transformer.ff_out.weight",
}
_LLADA_LAYER = {
  "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
  "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "ff_out",
  "input_layernorm": "attn_norm", "post_attention_layernorm": "ff_norm",
}  # fmt: skip


def _tokenizer(directory: Path) -> None:
  vocab = {_TEXTS[name]: i for name, i in SPECIAL.items()}
  vocab.update({f"w{i}": i for i in range(len(SPECIAL), VOCAB)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(list(_TEXTS.values()))
  tok.save(str(directory / "tokenizer.json"))
  config = {f"{name}_token": _TEXTS[name] for name in SPECIAL}
  (directory / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))


def _sharpen(model: torch.nn.Module, seed: int) -> None:
  """Random weights with strong opinions (larger than the 0.02 init), so greedy decoding is not a tie-break game."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=generator))
      else:
        p.copy_(0.15 * torch.randn(p.shape, generator=generator))


def _rewrite_config(directory: Path, **changes) -> None:
  path = directory / "config.json"
  config = json.loads(path.read_text())
  config.update(changes)
  path.write_text(json.dumps(config, indent=2))


def _to_llada(directory: Path, num_layers: int) -> None:
  """Renames a saved Llama checkpoint's tensors and config keys to LLaDA's."""
  tensors = load_file(directory / "model.safetensors")
  renamed = {}
  for name, value in tensors.items():
    if name in _LLADA_NAMES:
      renamed[_LLADA_NAMES[name]] = value
      continue
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    module = rest.removesuffix(".weight")
    renamed[f"model.transformer.blocks.{layer}.{_LLADA_LAYER[module]}.weight"] = value
  (directory / "model.safetensors").unlink()
  save_file({k: np.ascontiguousarray(v) for k, v in renamed.items()}, directory / "model.safetensors")
  config = {
    "model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": 64, "n_layers": num_layers, "n_heads": 4,
    "n_kv_heads": 2, "mlp_hidden_size": 128, "vocab_size": VOCAB, "embedding_size": VOCAB, "rope_theta": 10_000.0,
    "rms_norm_eps": 1e-6, "weight_tying": False, "include_bias": False, "include_qkv_bias": False,
    "max_sequence_length": 256, "mask_token_id": SPECIAL["mask"], "eos_token_id": SPECIAL["eos"],
    "pad_token_id": SPECIAL["pad"], "bos_token_id": SPECIAL["bos"], "block_type": "llama", "activation_type": "silu",
  }  # fmt: skip
  (directory / "config.json").write_text(json.dumps(config, indent=2))


def hf_checkpoint(directory: Path, family: str, seed: int = 0) -> tuple[torch.nn.Module, Path]:
  """``(float32 reference model, checkpoint directory)`` of a tiny ``family`` checkpoint (llada, dream or sdar)."""
  directory.mkdir(parents=True, exist_ok=True)
  ids = dict(eos_token_id=SPECIAL["eos"], pad_token_id=SPECIAL["pad"], bos_token_id=SPECIAL["bos"])
  if family == "llada":
    config = transformers.LlamaConfig(**_SHAPE, **ids, tie_word_embeddings=False, attention_bias=False)
    model = transformers.LlamaForCausalLM(config)
  elif family == "dream":
    config = transformers.Qwen2Config(**_SHAPE, **ids, tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config)
  elif family == "sdar":
    config = transformers.Qwen3Config(**_SHAPE, **ids, tie_word_embeddings=False, attention_bias=False)
    model = transformers.Qwen3ForCausalLM(config)
  else:
    raise ValueError(f"family={family!r}: llada, dream or sdar")
  _sharpen(model, seed)
  model = model.float().eval()
  model.config._attn_implementation = "eager"
  model.save_pretrained(directory, safe_serialization=True)
  _tokenizer(directory)
  if family == "llada":
    _to_llada(directory, _SHAPE["num_hidden_layers"])
  elif family == "dream":
    _rewrite_config(directory, model_type="Dream", architectures=["DreamModel"], mask_token_id=SPECIAL["mask"])
  else:
    _rewrite_config(directory, model_type="sdar", architectures=["SDARForCausalLM"], block_size=4,
                    mask_token_id=SPECIAL["mask"])  # fmt: skip
  return model, directory
