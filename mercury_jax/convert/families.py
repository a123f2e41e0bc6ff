"""What each public diffusion-LM family is, in this project's terms: its config, its tensors and its decoding defaults.

:func:`detect` names the family of a Hugging Face ``config.json``; :func:`config_from_hf` maps the config to a
mercury_jax :class:`~mercury_jax.config.Config` (no weights read); :func:`tensor_plan` lists, for every parameter of
the model, the checkpoint tensors that fill it. The facts (keys, tensor names, mask ids, shifted logits, block sizes,
sampling defaults) are those of the families' own repositories, cited in each :class:`Family`'s ``sampling.source``.

========================  ===========  ===============  ==========  ===============================
family (``model_type``)   layout       attention        logits      mask id (``mask_token_id``)
========================  ===========  ===============  ==========  ===============================
llada (``llada``)         LLaDA/OLMo   bidirectional    own         126336 ``<|mdm_mask|>``
dream (``Dream``)         Qwen2        bidirectional    shifted     151666 (Dream, DiffuCoder)
sdar (``sdar``)           Qwen3        block-causal 4   own         151669 ``<|MASK|>``
fast_dllm_v2              Qwen2        block-causal 32  shifted     151665 ``|<MASK>|``
(``Fast_dLLM_Qwen``)
autoregressive            Qwen2 /      causal           own         a spare id: a placeholder
(``qwen2``, ``qwen3``,    Qwen3 /                                   (``tokens.autoregressive_mask_id``)
``llama``; explicit)      Llama
========================  ===========  ===============  ==========  ===============================

``autoregressive`` converts a plain causal model as itself (the parent of a diffusion family: Qwen2.5 for Dream and
Fast-dLLM v2, Qwen3 for SDAR): ``objective.name = "autoregressive"``, a causal model, the engine's token-by-token
decoding with the exact key-value cache, and ``[sampling]`` defaults from its ``generation_config.json`` as
transformers' ``generate`` reads it. A plain ``model_type`` never selects a family by itself: the same layout also
converts into a diffusion family (``--family dream`` initialises Dream from a Qwen2.5), and a diffusion model
adapted from one may keep its parent's ``model_type``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mercury_jax.config import Config, ModelConfig, ObjectiveConfig, SamplingConfig

DIFFUSION_FAMILIES = ("llada", "dream", "sdar", "fast_dllm_v2")
AUTOREGRESSIVE = "autoregressive"  # A plain causal model, converted as the autoregressive model it is.
FAMILIES = (*DIFFUSION_FAMILIES, AUTOREGRESSIVE)
# model_type (lower case) -> family; plain autoregressive types convert only with an explicit family.
MODEL_TYPES = {"llada": "llada", "dream": "dream", "sdar": "sdar", "fast_dllm_qwen": "fast_dllm_v2"}
PLAIN_TYPES = ("qwen2", "qwen3", "llama")
_QWEN2_TYPES = ("qwen2", "dream", "fast_dllm_qwen")  # q/k/v biases, no qk-norm
_QWEN3_TYPES = ("qwen3", "sdar")  # qk RMSNorm over head_dim, no biases
ROPE_TYPES = {"default": "none", "linear": "linear", "yarn": "yarn", "llama3": "llama3"}
DEFAULT_CONTEXT = 4096  # Cap on model.max_length (the sampler's canvas limit) when the source allows more.


class ConvertError(ValueError):
  """The source checkpoint cannot be converted; the message (one line) says what is wrong and what would be right."""


@dataclasses.dataclass(frozen=True)
class Family:
  """A family's fixed facts.

  Attributes:
    name: One of :data:`FAMILIES`.
    title: The family's public name.
    shifted: Position i's output predicts token i + 1 (``ModelConfig.shifted_logits``).
    block_key: The config.json key of the trained block size of a block-diffusion family (None: whole-sequence).
    block_default: The block size when ``block_key`` is absent.
    mask_id: The mask token id when neither config.json nor the tokenizer names one (None: the autoregressive
      placeholder, chosen from the tokenizer by :func:`~mercury_jax.convert.tokens.autoregressive_mask_id`).
    mask_tokens: The mask token's text in the family's tokenizers (looked up when config.json has no id).
    chat_stops: Tokens that end an assistant turn in the family's chat template (stop ids when the tokenizer has them).
    sampling: The authors' recommended decoding defaults, with ``source`` (an autoregressive model's come from its
      ``generation_config.json``: :func:`generation_defaults`).
  """

  name: str
  title: str
  shifted: bool
  block_key: str | None
  block_default: int
  mask_id: int | None
  mask_tokens: tuple[str, ...]
  chat_stops: tuple[str, ...]
  sampling: SamplingConfig


SPECS = {
  "llada": Family(
    "llada",
    "LLaDA",
    False,
    None,
    0,
    126336,
    ("<|mdm_mask|>",),
    ("<|eot_id|>",),
    SamplingConfig(
      rule="confidence",
      confidence="prob",
      block_length=32,
      steps_per_block=0,
      temperature=0.0,
      source=(
        "ML-GSAI/LLaDA generate.py (b7e6c35): remasking='low_confidence' (the k most probable positions per step), "
        "temperature 0, main() block_length 32 with steps = gen_length (one token per step)"
      ),
    ),
  ),
  "dream": Family(
    "dream",
    "Dream",
    True,
    None,
    0,
    151666,
    ("<|mask|>",),
    ("<|im_end|>",),
    SamplingConfig(
      rule="confidence",
      confidence="entropy",
      commit_counts="timesteps",
      block_length=0,
      steps_per_block=0,
      temperature=0.2,
      top_p=0.95,
      source=(
        "HKUNLP/Dream README (a1b4472): diffusion_generate(steps = max_new_tokens, temperature 0.2, top_p 0.95, "
        "alg='entropy'): whole canvas ranked by negative entropy, commit counts on the time grid "
        "linspace(1, 1e-3, steps + 1) of generation_utils._sample (DiffuCoder's README: the same with temperature "
        "0.2-0.4)"
      ),
    ),
  ),
  "sdar": Family(
    "sdar",
    "SDAR",
    False,
    "block_size",
    4,
    151669,
    ("<|MASK|>", "<MASK>"),
    ("<|im_end|>",),
    SamplingConfig(
      rule="threshold",
      confidence="prob",
      threshold=0.9,
      block_length=4,
      steps_per_block=4,
      temperature=0.0,
      source=(
        "JetAstra/SDAR (c2041a8): README inference engines decode with confidence threshold 0.9; generate.py "
        "denoising_steps = block_length (4 steps per block of 4, low_confidence_dynamic: at least one token a step); "
        "benchmarks greedy (temperature 0)"
      ),
    ),
  ),
  "fast_dllm_v2": Family(
    "fast_dllm_v2",
    "Fast-dLLM v2",
    True,
    "bd_size",
    32,
    151665,
    ("|<MASK>|",),
    ("<|im_end|>",),
    SamplingConfig(
      rule="threshold",
      confidence="prob",
      threshold=0.9,
      block_length=32,
      steps_per_block=0,
      temperature=0.0,
      top_p=0.95,
      source=(
        "NVlabs/Fast-dLLM v2/run_chatbot.py: block_size 32, small_block_size 8, threshold 0.9, temperature 0, "
        "top_p 0.95; mapped to threshold 0.9 over the whole 32-token block (the engine has no sub-blocks: each "
        "step still commits every position above 0.9 and at least the most confident one)"
      ),
    ),
  ),
  AUTOREGRESSIVE: Family(
    AUTOREGRESSIVE,
    "plain autoregressive",
    False,
    None,
    0,
    None,
    (),
    ("<|im_end|>", "<|eot_id|>"),  # Qwen's and Llama 3's end of turn, where the tokenizer has them.
    SamplingConfig(),
  ),
}
TRANSFORMERS_TOP_K = 50  # GenerationConfig's top_k when generation_config.json does not set it.


def generation_defaults(generation: dict[str, Any]) -> SamplingConfig:
  """An autoregressive model's ``[sampling]`` defaults: its ``generation_config.json`` as transformers' ``generate``
  reads it. Greedy unless ``do_sample`` is true; then its temperature, top_p and top_k (transformers' 1.0, 1.0 and
  50 where absent). A repetition penalty, which the engine does not have, is named in ``source`` as not applied."""
  if not generation.get("do_sample") or generation.get("temperature") == 0:
    source = "generation_config.json (absent, or without do_sample true): transformers' generate decodes greedily"
    return SamplingConfig(temperature=0.0, source=source)
  temperature = float(generation.get("temperature") or 1.0)
  top_p = float(generation.get("top_p") or 1.0)
  top_k = int(generation.get("top_k", TRANSFORMERS_TOP_K) or 0)  # An explicit null turns top-k off.
  source = f"generation_config.json: do_sample true, temperature {temperature:g}, top_p {top_p:g}, top_k {top_k}"
  penalty = generation.get("repetition_penalty")
  if penalty not in (None, 1, 1.0):
    source += f"; its repetition_penalty {penalty} is not applied (the engine has no repetition penalty)"
  return SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, source=source)


def _is_moe(hf: dict[str, Any]) -> bool:
  model_type = str(hf.get("model_type", "")).lower()
  keys = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
  return "moe" in model_type or any(hf.get(k) for k in keys) or any(k.startswith("moe_") and hf[k] for k in hf)


def detect(hf: dict[str, Any], family: str = "auto") -> str:
  """The family of ``hf`` (a config.json dict): from ``model_type``, or ``family`` when given.

  Raises:
    ConvertError: an MoE config, an unknown ``model_type``, a plain AR type without a family, or a bad ``family``.
  """
  model_type = str(hf.get("model_type", ""))
  if _is_moe(hf):
    raise ConvertError(
      f"model_type {model_type!r} is a mixture-of-experts model (LLaDA-MoE / LLaDA 2.0 style); MoE is not supported"
    )
  if family not in ("auto", *FAMILIES):
    raise ConvertError(f"family={family!r} must be one of auto, {', '.join(FAMILIES)}")
  kind = model_type.lower()
  if kind not in MODEL_TYPES and kind not in PLAIN_TYPES:
    supported = ", ".join(["llada", "Dream", "sdar", "Fast_dLLM_Qwen", *PLAIN_TYPES])
    raise ConvertError(f"model_type {model_type!r} is not supported; supported model types: {supported}")
  if family != "auto":
    if kind == "llada" and family != "llada":
      raise ConvertError(f"model_type 'llada' has LLaDA's layout; --family {family} needs a Qwen2/Qwen3/Llama layout")
    if family == AUTOREGRESSIVE and kind not in PLAIN_TYPES:
      raise ConvertError(
        f"--family {AUTOREGRESSIVE} converts a plain causal model (model_type {', '.join(PLAIN_TYPES)}); model_type "
        f"{model_type!r} is a {SPECS[MODEL_TYPES[kind]].title} diffusion model"
      )
    return family
  if kind in PLAIN_TYPES:  # The layout of an AR model and of diffusion models adapted from one: the user says which.
    raise ConvertError(
      f"model_type {model_type!r} is a plain causal layout, which does not say how the weights were trained; pass "
      f"--family {AUTOREGRESSIVE} to convert the model as it is, or a diffusion family "
      f"({', '.join(DIFFUSION_FAMILIES)}) to adapt it"
    )
  return MODEL_TYPES[kind]


def _need(hf: dict[str, Any], key: str) -> Any:
  if hf.get(key) is None:
    raise ConvertError(f"config.json has no {key!r}, which model_type {hf.get('model_type')!r} needs")
  return hf[key]


def _require(hf: dict[str, Any], key: str, allowed: tuple, why: str) -> None:
  """Fails unless config.json's ``key`` is absent, null or one of ``allowed``."""
  if hf.get(key) is not None and hf[key] not in allowed:
    raise ConvertError(f"config.json {key}={hf[key]!r} is not supported ({why}); supported: {list(allowed)}")


def _rope(hf: dict[str, Any], max_positions: int) -> dict[str, Any]:
  """ModelConfig's rope fields from ``rope_scaling`` (transformers 4) or ``rope_parameters`` (transformers 5)."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  theta = hf.get("rope_theta") or params.get("rope_theta") or 10_000.0
  kind = params.get("rope_type", params.get("type", "default")) or "default"
  if kind not in ROPE_TYPES:
    raise ConvertError(f"rope_scaling type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
  fields: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": ROPE_TYPES[kind]}
  if kind == "default":
    return fields
  fields["rope_factor"] = float(params.get("factor", 1.0))
  if kind in ("yarn", "llama3"):
    fields["rope_original_length"] = int(params.get("original_max_position_embeddings") or max_positions)
  if kind == "yarn":
    fields["rope_beta_fast"] = float(params.get("beta_fast") or 32.0)
    fields["rope_beta_slow"] = float(params.get("beta_slow") or 1.0)
    fields["rope_attention_factor"] = float(params.get("attention_factor") or 0.0)
  if kind == "llama3":
    fields["rope_low_freq_factor"] = float(params.get("low_freq_factor", 1.0))
    fields["rope_high_freq_factor"] = float(params.get("high_freq_factor", 4.0))
  return fields


def _llada_model(hf: dict[str, Any]) -> tuple[dict[str, Any], int]:
  """``(ModelConfig fields, source context)`` of LLaDA's (OLMo-derived) config keys."""
  _require(hf, "block_type", ("llama",), "LLaDA's llama block is the one converted")
  _require(hf, "activation_type", ("silu",), "the MLP is silu(ff_proj(x)) * up_proj(x)")
  _require(hf, "layer_norm_type", ("rms",), "the norms are RMSNorm")
  _require(hf, "attention_layer_norm", (False,), "qk LayerNorm is not in this model")
  _require(hf, "include_bias", (False,), "only q/k/v biases are")
  _require(hf, "rope", (True,), "positions are rotary")
  _require(hf, "clip_qkv", (), "q/k/v clipping is not in this model")
  for key in ("alibi", "input_emb_norm", "scale_logits"):
    _require(hf, key, (False,), "not in this model")
  d, heads = int(_need(hf, "d_model")), int(_need(hf, "n_heads"))
  kv = 1 if hf.get("multi_query_attention") else int(hf.get("n_kv_heads") or heads)
  mlp = hf.get("mlp_hidden_size") or int(hf.get("mlp_ratio", 4) * d)
  return dict(
    vocab_size=int(hf.get("embedding_size") or _need(hf, "vocab_size")),
    d_model=d,
    num_layers=int(_need(hf, "n_layers")),
    num_heads=heads,
    num_kv_heads=kv,
    head_dim=d // heads,
    mlp_dim=int(mlp),
    norm_eps=float(hf.get("rms_norm_eps") or 1e-5),
    tie_embeddings=bool(hf.get("weight_tying", False)),
    qkv_bias=bool(hf.get("include_qkv_bias", False)),
    qk_norm=False,
    **_rope({"rope_theta": hf.get("rope_theta")}, int(hf.get("max_sequence_length") or DEFAULT_CONTEXT)),
  ), int(hf.get("max_sequence_length") or DEFAULT_CONTEXT)


def _qwen_model(hf: dict[str, Any]) -> tuple[dict[str, Any], int]:
  """``(ModelConfig fields, source context)`` of a Qwen2 / Qwen3 / Llama-style config (Dream, SDAR, Fast-dLLM v2)."""
  kind = str(hf.get("model_type", "")).lower()
  _require(hf, "hidden_act", ("silu",), "the MLP is silu(gate_proj(x)) * up_proj(x)")
  _require(hf, "use_sliding_window", (False,), "sliding-window attention is not in this model")
  _require(hf, "mlp_bias", (False,), "MLP biases are not in this model")
  if kind not in _QWEN2_TYPES:
    _require(hf, "attention_bias", (False,), "it adds an output-projection bias, which this model lacks")
  d, heads = int(_need(hf, "hidden_size")), int(_need(hf, "num_attention_heads"))
  max_positions = int(hf.get("max_position_embeddings") or DEFAULT_CONTEXT)
  return dict(
    vocab_size=int(_need(hf, "vocab_size")),
    d_model=d,
    num_layers=int(_need(hf, "num_hidden_layers")),
    num_heads=heads,
    num_kv_heads=int(hf.get("num_key_value_heads") or heads),
    head_dim=int(hf.get("head_dim") or d // heads),
    mlp_dim=int(_need(hf, "intermediate_size")),
    norm_eps=float(hf.get("rms_norm_eps") or 1e-6),
    tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    qkv_bias=kind in _QWEN2_TYPES,
    qk_norm=kind in _QWEN3_TYPES,
    **_rope(hf, max_positions),
  ), max_positions


def block_size(hf: dict[str, Any], family: str) -> int:
  """The trained block of a block-diffusion family (0: whole-sequence)."""
  spec = SPECS[family]
  return int(hf.get(spec.block_key) or spec.block_default) if spec.block_key else 0


def config_from_hf(
  hf_config: dict[str, Any],
  family: str = "auto",
  *,
  dtype: str = "bfloat16",
  max_length: int | None = None,
  mask_id: int | None = None,
  chat_template: str = "",
  generation: dict[str, Any] | None = None,
) -> Config:
  """The mercury_jax config of a Hugging Face ``config.json`` dict (no weights are read).

  Args:
    hf_config: the parsed config.json.
    family: one of :data:`FAMILIES`, or ``"auto"`` to read it from ``model_type``.
    dtype: the parameters' storage and compute dtype, ``"bfloat16"`` or ``"float32"``.
    max_length: the context (the sampler's canvas limit); default: the source's, capped at :data:`DEFAULT_CONTEXT`,
      rounded down to a multiple of the block size.
    mask_id: the mask token id; default: config.json's ``mask_token_id``, else the family's (an autoregressive
      model's: ``vocab_size - 1``, any id of its embedding; the converter passes the one chosen from the tokenizer).
    chat_template: the tokenizer's chat template, stored as ``data.chat_template``.
    generation: the source's ``generation_config.json`` (an autoregressive model's ``[sampling]`` defaults:
      :func:`generation_defaults`).

  Raises:
    ConvertError: an unsupported config (the message names the key and what is supported).
  """
  if dtype not in ("bfloat16", "float32"):
    raise ConvertError(f"dtype={dtype!r} must be bfloat16 or float32")
  family = detect(hf_config, family)
  spec, autoregressive = SPECS[family], family == AUTOREGRESSIVE
  is_llada = str(hf_config.get("model_type", "")).lower() == "llada"
  fields, source_context = (_llada_model if is_llada else _qwen_model)(hf_config)
  block = block_size(hf_config, family)
  if max_length is None:
    max_length = min(source_context, DEFAULT_CONTEXT)
    max_length -= max_length % block if block else 0
  if max_length < 1 or (block and max_length % block):
    raise ConvertError(f"max_length={max_length} must be >= 1 and a multiple of the block size {block}")
  model = ModelConfig(
    **fields,
    max_length=max_length,
    causal=autoregressive,
    scale_tied_logits=False,
    shifted_logits=spec.shifted,
    param_dtype=dtype,
    dtype=dtype,
  )
  mask = mask_id if mask_id is not None else hf_config.get("mask_token_id")
  mask = int(mask) if mask is not None else spec.mask_id if spec.mask_id is not None else model.vocab_size - 1
  # A block-causal family's block is its trained block_size (the engine's exact cache); block_length stays 0.
  sampling = dataclasses.replace(spec.sampling, block_length=0) if block else spec.sampling
  objective = ObjectiveConfig(mask_id=mask, block_size=block)
  if autoregressive:
    sampling = generation_defaults(generation or {})
    objective = dataclasses.replace(objective, name="autoregressive")
  cfg = Config(model=model, objective=objective, sampling=sampling, name=family)
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, chat_template=chat_template))
  try:
    return cfg.validate()
  except ValueError as e:
    raise ConvertError(f"the converted config is invalid: {e}") from None


@dataclasses.dataclass(frozen=True)
class Target:
  """One parameter of the converted model and the checkpoint tensors that fill it.

  Attributes:
    path: the parameter's path, e.g. ``("blocks", "attention", "query")``.
    shape: its shape (with the leading ``layers`` axis when ``len(sources) > 1`` or stacked).
    sources: one tensor name per layer (stacked) or a single name.
    source_shape: each source tensor's expected shape.
    transpose: the source is a Hugging Face ``Linear`` weight ``[out, in]``, stored here as ``[in, out]``.
    stacked: the parameter has a leading ``layers`` axis.
  """

  path: tuple[str, ...]
  shape: tuple[int, ...]
  sources: tuple[str, ...]
  source_shape: tuple[int, ...]
  transpose: bool
  stacked: bool


def tensor_plan(hf: dict[str, Any], model: ModelConfig) -> list[Target]:
  """Every parameter of ``model`` with the tensors of the checkpoint described by ``hf`` that fill it."""
  llada = str(hf.get("model_type", "")).lower() == "llada"
  d, h, kv, hd, mlp, v, n = (
    model.d_model, model.num_heads, model.num_kv_heads, model.head_dim, model.mlp_dim, model.vocab_size,
    model.num_layers,
  )  # fmt: skip
  if llada:
    top = {"embedding": "model.transformer.wte.weight", "final": "model.transformer.ln_f.weight",
           "head": "model.transformer.ff_out.weight"}  # fmt: skip
    layer = "model.transformer.blocks.{i}."
    names = {"attention_norm": "attn_norm", "mlp_norm": "ff_norm", "query": "q_proj", "key": "k_proj",
             "value": "v_proj", "out": "attn_out", "gate": "ff_proj", "up": "up_proj", "down": "ff_out"}  # fmt: skip
  else:
    top = {"embedding": "model.embed_tokens.weight", "final": "model.norm.weight", "head": "lm_head.weight"}
    layer = "model.layers.{i}."
    names = {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "query": "self_attn.q_proj",
             "key": "self_attn.k_proj", "value": "self_attn.v_proj", "out": "self_attn.o_proj",
             "query_norm": "self_attn.q_norm", "key_norm": "self_attn.k_norm", "gate": "mlp.gate_proj",
             "up": "mlp.up_proj", "down": "mlp.down_proj"}  # fmt: skip

  def stack(path, shape, name, suffix, source_shape, transpose=False):
    sources = tuple(layer.format(i=i) + f"{name}.{suffix}" for i in range(n))
    return Target(path, (n, *shape), sources, source_shape, transpose, True)

  plan = [Target(("embedding",), (v, d), (top["embedding"],), (v, d), False, False)]
  plan.append(stack(("blocks", "attention_norm", "scale"), (d,), names["attention_norm"], "weight", (d,)))
  plan.append(stack(("blocks", "mlp_norm", "scale"), (d,), names["mlp_norm"], "weight", (d,)))
  for param, heads in (("query", h), ("key", kv), ("value", kv)):
    path = ("blocks", "attention", param)
    plan.append(stack(path, (d, heads, hd), names[param], "weight", (heads * hd, d), transpose=True))
    if model.qkv_bias:
      bias = ("blocks", "attention", f"{param}_bias")
      plan.append(stack(bias, (heads, hd), names[param], "bias", (heads * hd,)))
    if model.qk_norm and param != "value":
      norm = ("blocks", "attention", f"{param}_norm", "scale")
      plan.append(stack(norm, (hd,), names[f"{param}_norm"], "weight", (hd,)))
  plan.append(stack(("blocks", "attention", "out"), (h, hd, d), names["out"], "weight", (d, h * hd), transpose=True))
  for param in ("gate", "up"):
    plan.append(stack(("blocks", "mlp", param), (d, mlp), names[param], "weight", (mlp, d), transpose=True))
  plan.append(stack(("blocks", "mlp", "down"), (mlp, d), names["down"], "weight", (d, mlp), transpose=True))
  plan.append(Target(("final_norm", "scale"), (d,), (top["final"],), (d,), False, False))
  if not model.tie_embeddings:
    plan.append(Target(("head",), (d, v), (top["head"],), (v, d), True, False))
  return plan
