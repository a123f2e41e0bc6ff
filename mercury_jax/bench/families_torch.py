"""The PyTorch side of ``python -m mercury_jax.bench families``: a random LLaDA-layout checkpoint and the families'
own models, as their sampling loops call them (imported only by that command: it needs torch and transformers).

``shape`` is :data:`mercury_jax.bench.families.Shape`, ``llada`` / ``config`` its LLaDA config.json
(``families.llada_config``)
and ``special`` the special tokens' ids by name (``unk``, ``pad``, ``bos``, ``eos``, ``mask``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

_TEXTS = {"unk": "<unk>", "pad": "<pad>", "bos": "<s>", "eos": "</s>", "mask": "<|mask|>"}
# Llama tensor name (inside model.layers.N.) -> LLaDA's (modeling_llada.py, block_type "llama").
_LLADA_TOP = {
  "model.embed_tokens.weight": "model.transformer.wte.weight",
  "model.norm.weight": "model.transformer.ln_f.weight",
  "lm_head.weight": "model.transformer.ff_out.weight",
}
_LLADA_LAYER = {
  "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
  "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "ff_out",
  "input_layernorm": "attn_norm", "post_attention_layernorm": "ff_norm",
}  # fmt: skip


def build_checkpoint(folder: Path, shape, llada: dict, special: dict[str, int], seed: int = 0):
  """Writes a random LLaDA-format checkpoint (float32 safetensors, config.json ``llada``, a word-level tokenizer)
  into ``folder``; returns the float32 Llama model and its state dict in LLaDA's names.

  Weights have strong opinions (head std 3/sqrt(d)), so greedy decoding is not a game of float round-off ties.
  """
  config = transformers.LlamaConfig(
    hidden_size=shape.d_model, intermediate_size=shape.mlp, num_hidden_layers=shape.n_layers,
    num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_heads, head_dim=shape.d_model // shape.n_heads,
    max_position_embeddings=shape.max_length, rms_norm_eps=1e-5, rope_theta=10_000.0, vocab_size=shape.vocab,
    tie_word_embeddings=False, attention_bias=False, eos_token_id=special["eos"], pad_token_id=special["pad"],
    bos_token_id=special["bos"],
  )  # fmt: skip
  model = transformers.LlamaForCausalLM(config).float().eval()
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():  # norm scales near 1, embeddings N(0, 1), matrices N(0, 1 / fan-in)
      noise = torch.randn(p.shape, generator=generator)
      matrix = noise * (3.0 if name == "lm_head.weight" else 1.0) / p.shape[-1] ** 0.5
      p.copy_(1.0 + 0.1 * noise if "norm" in name else noise if "embed" in name else matrix)
  state = {}
  for name, tensor in model.state_dict().items():
    if name in _LLADA_TOP:
      state[_LLADA_TOP[name]] = tensor.contiguous()
      continue
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    state[f"model.transformer.blocks.{layer}.{_LLADA_LAYER[rest.removesuffix('.weight')]}.weight"] = tensor.contiguous()
  folder.mkdir(parents=True, exist_ok=True)
  save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
  (folder / "config.json").write_text(json.dumps(llada, indent=2))
  vocab = {_TEXTS[name]: i for name, i in special.items()}
  vocab.update({f"w{i}": i for i in range(len(special), shape.vocab)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(list(_TEXTS.values()))
  tok.save(str(folder / "tokenizer.json"))
  tok_config = {f"{name}_token": _TEXTS[name] for name in special}
  (folder / "tokenizer_config.json").write_text(
    json.dumps({**tok_config, "tokenizer_class": "PreTrainedTokenizerFast"})
  )
  return model, state


class BannedIds(torch.nn.Module):
  """A family's model with the engine's never-proposed ids (``banned``: mask, padding, BOS, UNK) set to -inf in its
  logits.

  ``bidirectional``: the Llama model as LLaDA's ``generate`` calls its mask predictor,
  ``model(x, attention_mask=None).logits``, with every position visible (an explicit all-zeros 4-D float mask);
  otherwise the model (Fast-dLLM's ``LLaDAModelLM``) called as it is.
  """

  def __init__(self, model: torch.nn.Module, banned: list[int], bidirectional: bool = False):
    super().__init__()
    self.model, self.banned, self.bidirectional = model, banned, bidirectional

  @property
  def device(self) -> torch.device:
    return torch.device("cpu")

  def forward(self, *args, **kwargs):
    if self.bidirectional:
      x = args[0]
      batch, length = x.shape
      mask = torch.zeros(batch, 1, length, length)  # [batch, heads, query, key]: every key visible
      out = types.SimpleNamespace(logits=self.model(input_ids=x, attention_mask=mask).logits)
    else:
      out = self.model(*args, **kwargs)
    out.logits[..., self.banned] = -torch.inf
    return out


def load_module(name: str, path: Path):
  if not path.is_file():
    raise SystemExit(f"{path} is missing: point the flag at a checkout of the family's repository")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def fast_dllm(repo: Path, config: dict, state: dict[str, torch.Tensor], banned: list[int]):
  """``(generate_with_dual_cache, its LLaDAModelLM holding state)`` from a Fast-dLLM checkout.

  Its LLaDA model imports ``einops`` for a block type this model does not use: a stub stands in when it is absent.
  """
  sys.path.insert(0, str(repo / "llada"))
  try:
    import einops  # noqa: F401
  except ImportError:
    stub = types.ModuleType("einops")
    stub.rearrange = lambda *a, **k: (_ for _ in ()).throw(NotImplementedError("einops stub"))
    sys.modules["einops"] = stub
  generate = load_module("fast_dllm_generate", repo / "llada" / "generate.py")
  from model.configuration_llada import LLaDAConfig  # noqa: PLC0415 (from the checkout)

  model = generate.LLaDAModelLM(LLaDAConfig(**config)).float().eval()
  missing, unexpected = model.load_state_dict(state, strict=False)
  if unexpected or any(not k.endswith(("inv_freq", "_cache")) for k in missing):
    raise SystemExit(f"Fast-dLLM's LLaDAModelLM did not take the weights: {missing=} {unexpected=}")
  return generate.generate_with_dual_cache, BannedIds(model, banned)
