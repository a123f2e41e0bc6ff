"""Tiny random checkpoints in each public diffusion-LM family's exact Hugging Face file format, with the torch model
that computes their reference logits (transformers' own classes; tests only).

* Dream and Fast-dLLM v2 are Qwen2 checkpoints (``Qwen2ForCausalLM.save_pretrained``) whose config.json says
  ``model_type`` ``Dream`` / ``Fast_dLLM_Qwen`` and carries the family's keys (``mask_token_id``, ``bd_size``).
* SDAR is a Qwen3 checkpoint with ``model_type`` ``sdar``, ``block_size`` and ``mask_token_id``.
* LLaDA's math is Llama's (RMSNorm, rotate-half RoPE, SwiGLU with ``ff_proj`` as the gate): a ``LlamaForCausalLM``
  whose tensors are renamed to LLaDA's (:data:`LLADA_NAMES`) and whose config.json is rewritten in LLaDA's keys
  (``d_model``, ``n_layers``, ...), stored in bfloat16 as LLaDA ships.
* ``qwen2``, ``qwen3`` and ``llama`` are the plain causal models (:data:`PLAIN`) the diffusion families were adapted
  from, saved by transformers unchanged: what ``convert --family autoregressive`` reads.

Every parameter (norm scales and biases included) is drawn at random, so a mis-mapped tensor changes the logits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PLAIN = ("qwen2", "qwen3", "llama")
VOCAB = 320  # The model's vocabulary: larger than the tokenizer's (a padded vocabulary, as in Qwen's 152064).
SPECIALS = (
  "<|endoftext|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|eot_id|>", "<|mdm_mask|>", "<|mask|>",
  "<|MASK|>", "|<MASK>|",
)  # fmt: skip
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)
# Llama tensor name (regex) -> LLaDA's.
LLADA_NAMES = (
  (r"model\.embed_tokens\.weight", "model.transformer.wte.weight"),
  (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"model.transformer.blocks.\1.attn_norm.weight"),
  (r"model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.weight", r"model.transformer.blocks.\1.\2_proj.weight"),
  (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"model.transformer.blocks.\1.attn_out.weight"),
  (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"model.transformer.blocks.\1.ff_norm.weight"),
  (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", r"model.transformer.blocks.\1.ff_proj.weight"),
  (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", r"model.transformer.blocks.\1.up_proj.weight"),
  (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"model.transformer.blocks.\1.ff_out.weight"),
  (r"model\.norm\.weight", "model.transformer.ln_f.weight"),
  (r"lm_head\.weight", "model.transformer.ff_out.weight"),
)


def write_tokenizer(folder: Path) -> dict[str, int]:
  """A small byte-level BPE ``tokenizer.json`` (about 290 ids) and ``tokenizer_config.json``; returns the special
  tokens' ids."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=290, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  text = ["def add(a, b):\n    return a + b\n", "the quick brown fox jumps over the lazy dog. " * 3] * 20
  tok.train_from_iterator(text, trainer)
  folder.mkdir(parents=True, exist_ok=True)
  tok.save(str(folder / "tokenizer.json"))
  config = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  return {s: tok.token_to_id(s) for s in SPECIALS}


def _randomize(model: torch.nn.Module, seed: int) -> None:
  """Every parameter drawn at random: norm scales near 1, the rest with std 0.15 (embeddings 1.0)."""
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      if "norm" in name:
        p.copy_(1.0 + 0.2 * noise)
      else:
        p.copy_(noise * (1.0 if "embed" in name else 0.15))


def _patch_config(folder: Path, **fields) -> dict:
  config = json.loads((folder / "config.json").read_text())
  config.update(fields)
  (folder / "config.json").write_text(json.dumps(config, indent=2))
  return config


def build(folder: Path, family: str, *, tied: bool = False, shard_size: str | None = None, seed: int = 0):
  """Writes a tiny ``family`` checkpoint into ``folder``; returns ``(torch model in float32, special ids)``.

  The torch model holds exactly the weights written (for LLaDA, rounded to bfloat16 as stored).
  """
  from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

  ids = write_tokenizer(folder)
  common = dict(
    vocab_size=VOCAB, max_position_embeddings=256, rope_theta=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=tied,
    bos_token_id=ids["<|startoftext|>"], eos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"], **SHAPE,
  )  # fmt: skip
  if family in ("dream", "fast_dllm_v2", "qwen2"):
    model = Qwen2ForCausalLM(Qwen2Config(**common))
  elif family in ("sdar", "qwen3"):
    model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
  elif family in ("llada", "llama"):
    model = LlamaForCausalLM(LlamaConfig(**common))
  else:
    raise ValueError(f"family={family!r} must be llada, dream, sdar, fast_dllm_v2 or one of {PLAIN}")
  _randomize(model, seed)
  model.eval()
  if family == "llada":
    with torch.no_grad():  # The reference holds the stored (bfloat16) values; its RoPE buffers stay float32.
      for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).to(torch.float32))
    _write_llada(folder, model, ids)
    return model, ids
  model.save_pretrained(folder, max_shard_size=shard_size or "5GB")
  if family in PLAIN:
    return model, ids
  if family == "dream":
    _patch_config(folder, model_type="Dream", architectures=["DreamModel"], mask_token_id=ids["<|mask|>"])
  elif family == "fast_dllm_v2":  # Its mask id comes from the tokenizer's "|<MASK>|" (no mask_token_id key).
    _patch_config(folder, model_type="Fast_dLLM_Qwen", architectures=["Fast_dLLM_QwenForCausalLM"], bd_size=8)
  else:
    mask = ids["<|MASK|>"]
    _patch_config(folder, model_type="sdar", architectures=["SDARForCausalLM"], block_size=4, mask_token_id=mask)
  return model, ids


def llada_config(ids: dict[str, int], tied: bool = False) -> dict:
  """A LLaDA config.json for the tiny shape (keys as in LLaDA-8B-Instruct's)."""
  return {
    "model_type": "llada", "architectures": ["LLaDAModelLM"], "block_type": "llama", "activation_type": "silu",
    "layer_norm_type": "rms", "d_model": SHAPE["hidden_size"], "n_layers": SHAPE["num_hidden_layers"],
    "n_heads": SHAPE["num_attention_heads"], "n_kv_heads": SHAPE["num_key_value_heads"],
    "mlp_hidden_size": SHAPE["intermediate_size"], "vocab_size": VOCAB, "embedding_size": VOCAB,
    "rope": True, "rope_theta": 10_000.0, "rms_norm_eps": 1e-6, "weight_tying": tied, "include_bias": False,
    "include_qkv_bias": False, "attention_layer_norm": False, "max_sequence_length": 256,
    "mask_token_id": ids["<|mdm_mask|>"], "eos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
  }  # fmt: skip


def _write_llada(folder: Path, model: torch.nn.Module, ids: dict[str, int]) -> None:
  from safetensors.torch import save_file

  state = {}
  for name, tensor in model.state_dict().items():
    for pattern, repl in LLADA_NAMES:
      if re.fullmatch(pattern, name):
        state[re.sub(pattern, repl, name)] = tensor.to(torch.bfloat16).contiguous()
        break
    else:
      raise AssertionError(f"no LLaDA name for {name}")
  save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
  (folder / "config.json").write_text(json.dumps(llada_config(ids), indent=2))


def reference_logits(model: torch.nn.Module, tokens, mask: str = "causal", block: int = 0):
  """float32 ``[batch, length, vocab]`` logits of the torch model: ``causal``, ``bidirectional`` (an explicit 4-D
  all-zeros float mask) or ``block_causal`` (blocks of ``block``: a query sees keys of its own and earlier blocks)."""
  ids = torch.as_tensor(tokens, dtype=torch.long)
  batch, length = ids.shape
  if mask == "causal":
    attention = None
  else:
    allowed = torch.ones(length, length, dtype=torch.bool)
    if mask == "block_causal":
      blocks = torch.arange(length) // block
      allowed = blocks[:, None] >= blocks[None, :]
    attention = torch.zeros(batch, 1, length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)
  with torch.no_grad():
    return model(input_ids=ids, attention_mask=attention).logits.float().numpy()
