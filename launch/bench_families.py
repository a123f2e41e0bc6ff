"""The engine on a converted LLaDA-format checkpoint against the families' own PyTorch sampling loops on this CPU.

    python launch/bench_families.py --llada-repo DIR --fast-dllm-repo DIR [--rounds 3] [--write FILE]

``--llada-repo`` is a checkout of github.com/ML-GSAI/LLaDA (its ``generate.py``), ``--fast-dllm-repo`` one of
github.com/NVlabs/Fast-dLLM (its ``llada/generate.py`` and ``llada/model/``); neither is copied here, both are imported
from the checkout. The script builds a random LLaDA-layout checkpoint at ``--shape`` (a ``transformers``
``LlamaForCausalLM``, LLaDA's math, its tensors and config keys renamed to LLaDA's), converts it with
:func:`mercury_jax.convert.convert` (float32), and times at batch 1, greedy, semi-autoregressive blocks:

* LLaDA's ``generate`` over the Llama model run bidirectionally (an all-zeros 4-D float mask) against the engine
  with ``cache="none"``: every step recomputes the whole canvas; the tokens must be the same;
* Fast-dLLM's ``generate_with_dual_cache`` over its own ``LLaDAModelLM`` (the same weights) against the engine with
  ``cache="dual"`` (both approximate: the same tokens are not guaranteed).

Each round runs every (mode, steps) pair back to back, reference and engine in an order that alternates between
rounds, so a change in the machine's capacity hits both alike; the ratio is the median over rounds of the pair's
wall-time ratio. The engine's programs are compiled ahead of time (the compile column); every timed call is a
compiled one. The references get the engine's documented difference: they never propose the mask, padding, BOS or
UNK ids (those logits are set to -inf in the thin wrapper that hands them the network).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from mercury_jax.checkpoint import restore_params
from mercury_jax.convert import convert
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.network import Network
from mercury_jax.sampling.plan import Decoding, plan_blocks, plan_for
from mercury_jax.sampling.settings import SamplerSettings

SPECIAL = {"unk": 0, "pad": 1, "bos": 2, "eos": 3, "mask": 4}
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


@dataclasses.dataclass(frozen=True)
class Shape:
  """The benchmark model: LLaDA's Llama block (multi-head attention, SwiGLU, RMSNorm, untied head)."""

  d_model: int = 512
  n_layers: int = 8
  n_heads: int = 8
  mlp: int = 1408
  vocab: int = 8192
  max_length: int = 1024

  @classmethod
  def parse(cls, text: str) -> Shape:
    """``d_model,n_layers,n_heads,mlp,vocab``."""
    try:
      d_model, n_layers, n_heads, mlp, vocab = (int(v) for v in text.split(","))
    except ValueError:
      raise SystemExit(f"--shape={text!r} must be five integers d_model,n_layers,n_heads,mlp,vocab") from None
    if d_model % n_heads:
      raise SystemExit(f"--shape: d_model={d_model} must be a multiple of n_heads={n_heads}")
    return cls(d_model, n_layers, n_heads, mlp, vocab)

  def llada_config(self) -> dict:
    """config.json in LLaDA's keys (as LLaDA-8B-Instruct's)."""
    return {
      "model_type": "llada", "architectures": ["LLaDAModelLM"], "block_type": "llama", "activation_type": "silu",
      "layer_norm_type": "rms", "d_model": self.d_model, "n_layers": self.n_layers, "n_heads": self.n_heads,
      "n_kv_heads": self.n_heads, "mlp_hidden_size": self.mlp, "vocab_size": self.vocab,
      "embedding_size": self.vocab, "rope": True, "rope_theta": 10_000.0, "rms_norm_eps": 1e-5,
      "weight_tying": False, "include_bias": False, "include_qkv_bias": False, "attention_layer_norm": False,
      "max_sequence_length": self.max_length, "mask_token_id": SPECIAL["mask"], "eos_token_id": SPECIAL["eos"],
      "pad_token_id": SPECIAL["pad"], "bos_token_id": SPECIAL["bos"],
    }  # fmt: skip


def build_checkpoint(folder: Path, shape: Shape, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
  """Writes a random LLaDA-format checkpoint (float32 safetensors, config.json, a word-level tokenizer) into
  ``folder``; returns the float32 Llama model and its state dict in LLaDA's names.

  Weights have strong opinions (head std 3/sqrt(d)), so greedy decoding is not a game of float round-off ties.
  """
  config = transformers.LlamaConfig(
    hidden_size=shape.d_model, intermediate_size=shape.mlp, num_hidden_layers=shape.n_layers,
    num_attention_heads=shape.n_heads, num_key_value_heads=shape.n_heads, head_dim=shape.d_model // shape.n_heads,
    max_position_embeddings=shape.max_length, rms_norm_eps=1e-5, rope_theta=10_000.0, vocab_size=shape.vocab,
    tie_word_embeddings=False, attention_bias=False, eos_token_id=SPECIAL["eos"], pad_token_id=SPECIAL["pad"],
    bos_token_id=SPECIAL["bos"],
  )  # fmt: skip
  model = transformers.LlamaForCausalLM(config).float().eval()
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=generator)
      if "norm" in name:
        p.copy_(1.0 + 0.1 * noise)
      elif "embed" in name:
        p.copy_(noise)
      else:
        p.copy_(noise * (3.0 if name == "lm_head.weight" else 1.0) / p.shape[1] ** 0.5)
  state = {}
  for name, tensor in model.state_dict().items():
    if name in _LLADA_TOP:
      state[_LLADA_TOP[name]] = tensor.contiguous()
      continue
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    state[f"model.transformer.blocks.{layer}.{_LLADA_LAYER[rest.removesuffix('.weight')]}.weight"] = tensor.contiguous()
  folder.mkdir(parents=True, exist_ok=True)
  save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
  (folder / "config.json").write_text(json.dumps(shape.llada_config(), indent=2))
  vocab = {_TEXTS[name]: i for name, i in SPECIAL.items()}
  vocab.update({f"w{i}": i for i in range(len(SPECIAL), shape.vocab)})
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(list(_TEXTS.values()))
  tok.save(str(folder / "tokenizer.json"))
  tok_config = {f"{name}_token": _TEXTS[name] for name in SPECIAL}
  (folder / "tokenizer_config.json").write_text(
    json.dumps({**tok_config, "tokenizer_class": "PreTrainedTokenizerFast"})
  )
  return model, state


BANNED = sorted({SPECIAL["mask"], SPECIAL["pad"], SPECIAL["bos"], SPECIAL["unk"]})


class BidirectionalLlama(torch.nn.Module):
  """LLaDA's mask predictor as ``generate`` calls it: ``model(x, attention_mask=None).logits``, over the Llama model
  with every position visible (an explicit all-zeros 4-D float mask)."""

  def __init__(self, llama: torch.nn.Module):
    super().__init__()
    self.llama = llama

  @property
  def device(self) -> torch.device:
    return torch.device("cpu")

  def forward(self, x: torch.Tensor, attention_mask=None) -> types.SimpleNamespace:
    batch, length = x.shape
    mask = torch.zeros(batch, 1, length, length)  # [batch, heads, query, key]: every key visible
    logits = self.llama(input_ids=x, attention_mask=mask).logits
    logits[..., BANNED] = -torch.inf
    return types.SimpleNamespace(logits=logits)


class BannedIds(torch.nn.Module):
  """Fast-dLLM's ``LLaDAModelLM`` with the engine's never-proposed ids set to -inf in its logits."""

  def __init__(self, model: torch.nn.Module):
    super().__init__()
    self.model = model

  @property
  def device(self) -> torch.device:
    return torch.device("cpu")

  def forward(self, *args, **kwargs):
    out = self.model(*args, **kwargs)
    out.logits[..., BANNED] = -torch.inf
    return out


def _load_module(name: str, path: Path):
  if not path.is_file():
    raise SystemExit(f"{path} is missing: point the flag at a checkout of the family's repository")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def fast_dllm(repo: Path, shape: Shape, state: dict[str, torch.Tensor]):
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
  generate = _load_module("fast_dllm_generate", repo / "llada" / "generate.py")
  from model.configuration_llada import LLaDAConfig  # noqa: PLC0415 (from the checkout)

  model = generate.LLaDAModelLM(LLaDAConfig(**shape.llada_config())).float().eval()
  missing, unexpected = model.load_state_dict(state, strict=False)
  if unexpected or any(not k.endswith(("inv_freq", "_cache")) for k in missing):
    raise SystemExit(f"Fast-dLLM's LLaDAModelLM did not take the weights: {missing=} {unexpected=}")
  return generate.generate_with_dual_cache, BannedIds(model)


@dataclasses.dataclass(frozen=True)
class Run:
  """One generation request: the prompt, the length, LLaDA's total ``steps`` and block."""

  prompt: tuple[int, ...]
  gen_length: int
  block_length: int
  steps: int

  @property
  def steps_per_block(self) -> int:
    return self.steps // (self.gen_length // self.block_length)


class Engine:
  """The engine over a converted checkpoint, one compiled program per cache (the step count is traced)."""

  def __init__(self, out_dir: Path, run: Run):
    params, cfg = restore_params(out_dir)
    self.params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    self.cfg, self.run = cfg, run
    self.canvas = cv.make_canvas([cv.prefix(list(run.prompt), run.gen_length)])
    self.programs, self.compile_s = {}, {}

  def compile(self, cache: str) -> None:
    decoder = plan_for(
      self.cfg, Decoding(cache, self.run.block_length), self.canvas.tokens.shape[1], whole_canvas=False
    )
    settings = SamplerSettings(
      objective=self.cfg.objective, eos_id=SPECIAL["eos"], pad_id=SPECIAL["pad"], bos_id=SPECIAL["bos"],
      unk_id=SPECIAL["unk"], num_tokens=self.cfg.model.vocab_size, temperature=0.0, eos_to_pad=False,
      rule="confidence", block_length=self.run.block_length,
    ).validate()  # fmt: skip
    plan = plan_blocks(self.canvas.kinds, decoder.block, cache=decoder.cache, whole_sequence=True)
    engine = BlockEngine(Network(self.cfg.model), settings, plan)
    start = time.perf_counter()
    self.programs[cache] = (
      jax.jit(engine.sample).lower(self.params, self.canvas, jax.random.key(0), jnp.int32(0)).compile()
    )
    self.compile_s[cache] = time.perf_counter() - start

  def __call__(self, cache: str, steps: int) -> np.ndarray:
    per_block = jnp.int32(steps // (self.run.gen_length // self.run.block_length))
    out = self.programs[cache](self.params, self.canvas, jax.random.key(0), per_block)
    start = len(self.run.prompt)
    return np.asarray(jax.block_until_ready(out).tokens)[0, start : start + self.run.gen_length]


def _checkout(repo: Path) -> str:
  try:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()[:12]  # fmt: skip
  except (subprocess.CalledProcessError, FileNotFoundError):
    return "not a git checkout"


def _machine() -> str:
  try:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
      if line.startswith("Model name"):
        return line.split(":", 1)[1].strip()
  except (subprocess.CalledProcessError, FileNotFoundError):
    pass
  return platform.processor() or "unknown"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--llada-repo", type=Path, required=True, help="a checkout of github.com/ML-GSAI/LLaDA")
  p.add_argument("--fast-dllm-repo", type=Path, required=True, help="a checkout of github.com/NVlabs/Fast-dLLM")
  p.add_argument("--shape", type=Shape.parse, default=Shape(), help="d_model,n_layers,n_heads,mlp,vocab")
  p.add_argument("--prompt-length", type=int, default=32)
  p.add_argument("--gen-length", type=int, default=128)
  p.add_argument("--block-length", type=int, default=32)
  p.add_argument("--steps", type=int, nargs="+", default=[128, 64], help="LLaDA's total steps (over all blocks)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
  p.add_argument("--write", type=Path, help="also write the table as markdown to this file")
  args = p.parse_args()
  blocks = args.gen_length // args.block_length
  if args.gen_length % args.block_length or args.prompt_length % args.block_length:
    raise SystemExit(
      f"--gen-length={args.gen_length} and --prompt-length={args.prompt_length} must be multiples of "
      f"--block-length={args.block_length} (the engine's blocks sit at multiples of it from the canvas start)"
    )
  for steps in args.steps:
    if steps % blocks or not 0 < steps <= args.gen_length:
      raise SystemExit(f"--steps {steps} must be a multiple of {blocks} blocks and at most --gen-length")
  torch.set_num_threads(args.threads)
  llada_generate = _load_module("llada_generate", args.llada_repo / "generate.py").generate
  rng = np.random.default_rng(0)
  run = Run(tuple(int(t) for t in rng.integers(len(SPECIAL), args.shape.vocab, args.prompt_length)),
            args.gen_length, args.block_length, max(args.steps))  # fmt: skip
  with tempfile.TemporaryDirectory() as tmp:
    llama, state = build_checkpoint(Path(tmp) / "hf", args.shape)
    out = convert(Path(tmp) / "hf", Path(tmp) / "converted", dtype="float32")
    engine = Engine(out, run)
    for cache in ("none", "dual"):
      engine.compile(cache)
  dual_generate, fast_model = fast_dllm(args.fast_dllm_repo, args.shape, state)
  reference = BidirectionalLlama(llama)
  prompt = torch.tensor([run.prompt], dtype=torch.long)
  mask_id = SPECIAL["mask"]

  def llada(steps):
    x = llada_generate(reference, prompt, steps=steps, gen_length=run.gen_length, block_length=run.block_length,
                       temperature=0.0, remasking="low_confidence", mask_id=mask_id)  # fmt: skip
    return x[0, len(run.prompt) :].numpy()

  def fast(steps):
    x, _ = dual_generate(fast_model, prompt, steps=steps, gen_length=run.gen_length, block_length=run.block_length,
                         temperature=0.0, remasking="low_confidence", mask_id=mask_id)  # fmt: skip
    return x[0, len(run.prompt) :].numpy()

  pairs = {  # (mode, steps) -> (reference name, reference, engine cache)
    (mode, steps): (name, fn, cache)
    for steps in args.steps
    for mode, name, fn, cache in (
      ("semi-AR, no cache", "LLaDA generate", llada, "none"),
      ("dual cache", "Fast-dLLM generate_with_dual_cache", fast, "dual"),
    )
  }
  walls = {key: {"ref": [], "ours": []} for key in pairs}
  ratios = {key: [] for key in pairs}
  tokens, loads = {}, []
  with torch.no_grad():
    for key, (_, fn, cache) in pairs.items():  # warm-up (and the tokens compared)
      tokens[key] = (fn(key[1]), engine(cache, key[1]))
    for r in range(args.rounds):
      loads.append(os.getloadavg()[0])
      for key, (_, fn, cache) in pairs.items():
        timed = {}
        for side in ("ref", "ours") if r % 2 == 0 else ("ours", "ref"):
          start = time.perf_counter()
          fn(key[1]) if side == "ref" else engine(cache, key[1])
          timed[side] = time.perf_counter() - start
          walls[key][side].append(timed[side])
        ratios[key].append(timed["ref"] / timed["ours"])
        print(f"round {r} {key}: ref {timed['ref']:.2f} s, ours {timed['ours']:.2f} s", flush=True)
  dual_none = {steps: float(np.mean(tokens[("dual cache", steps)][1] == tokens[("semi-AR, no cache", steps)][1]))
               for steps in args.steps}  # fmt: skip
  rows = [
    "| implementation | mode | steps | tokens/s (median) | tokens/s (best) | ratio vs reference (median) "
    "| ratio (best) | compile s (ours) | tokens equal to the reference's |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for key, (name, _, cache) in pairs.items():
    mode, steps = key
    ref, ours = walls[key]["ref"], walls[key]["ours"]
    same = float(np.mean(tokens[key][0] == tokens[key][1]))
    rows.append(
      f"| {name} (PyTorch) | {mode} | {steps} | {run.gen_length / statistics.median(ref):.1f} | "
      f"{run.gen_length / min(ref):.1f} | 1.00 | 1.00 | - | - |"
    )
    rows.append(
      f'| mercury_jax BlockEngine `cache="{cache}"` | {mode} | {steps} | '
      f"{run.gen_length / statistics.median(ours):.1f} | {run.gen_length / min(ours):.1f} | "
      f"{statistics.median(ratios[key]):.2f} | {min(ref) / min(ours):.2f} | {engine.compile_s[cache]:.1f} | "
      f"{same:.3f} |"
    )
  table = "\n".join(rows)
  s = args.shape
  lines = [
    "# The engine against the families' own sampling loops (CPU)",
    "",
    "Command: `python launch/bench_families.py --llada-repo LLaDA --fast-dllm-repo Fast-dLLM "
    f"--rounds {args.rounds}` (checkouts: LLaDA {_checkout(args.llada_repo)}, Fast-dLLM "
    f"{_checkout(args.fast_dllm_repo)}).",
    "",
    f"Machine: {_machine()}, {torch.get_num_threads()} torch threads; torch {torch.__version__}, transformers "
    f"{transformers.__version__}, jax {jax.__version__}.",
    "",
    f"Model: random LLaDA-layout checkpoint, d_model {s.d_model}, {s.n_layers} layers, {s.n_heads} heads, MLP "
    f"{s.mlp}, vocabulary {s.vocab}, float32 everywhere. Batch 1, prompt {args.prompt_length} tokens, "
    f"{args.gen_length} generated in blocks of {args.block_length}, greedy low-confidence remasking.",
    "",
    f"tokens/s: generated tokens over the median (best) wall time of {args.rounds} rounds; ratio (median): the "
    "median over rounds of reference wall / engine wall, timed back to back; ratio (best): the best reference wall "
    "over the best engine wall (above 1: the engine is faster). The 2 cores are shared with other processes: "
    f"1-minute load average at the rounds' starts {min(loads):.1f} to {max(loads):.1f}; PyTorch's threads slow "
    "down far more than XLA's when the cores are oversubscribed, so the best columns are the fairer comparison.",
    "",
    table,
    "",
    "Dual-cache engine tokens equal to the engine's own no-cache tokens: "
    + ", ".join(f"{steps} steps {v:.3f}" for steps, v in dual_none.items())
    + ".",
  ]
  text = "\n".join(lines) + "\n"
  print(text)
  if args.write:
    args.write.parent.mkdir(parents=True, exist_ok=True)
    args.write.write_text(text)


if __name__ == "__main__":
  main()
