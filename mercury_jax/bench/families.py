"""The engine on a converted LLaDA-format checkpoint against the families' own PyTorch sampling loops on this CPU.

    python -m mercury_jax.bench families --llada-repo DIR --fast-dllm-repo DIR [--rounds 3] [--write FILE]

``--llada-repo`` is a checkout of github.com/ML-GSAI/LLaDA (its ``generate.py``), ``--fast-dllm-repo`` one of
github.com/NVlabs/Fast-dLLM (its ``llada/generate.py`` and ``llada/model/``); neither is copied here, both are imported
from the checkout. The command builds a random LLaDA-layout checkpoint at ``--shape`` (a ``transformers``
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

The PyTorch side (the checkpoint's builder, the families' models) is :mod:`mercury_jax.bench.families_torch`: the
command needs ``torch``, ``transformers`` and ``safetensors`` besides this package's own.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax import usage
from mercury_jax.bench.throughput import cpu_name, timed
from mercury_jax.checkpoint import restore_params
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.network import Network
from mercury_jax.sampling.plan import Decoding, plan_blocks, plan_for
from mercury_jax.sampling.settings import SamplerSettings

SPECIAL = {"unk": 0, "pad": 1, "bos": 2, "eos": 3, "mask": 4}
# The benchmark model: LLaDA's Llama block (multi-head attention, SwiGLU, RMSNorm, untied head).
Shape = collections.namedtuple("Shape", "d_model n_layers n_heads mlp vocab max_length", defaults=(1024,))
DEFAULT_SHAPE = Shape(512, 8, 8, 1408, 8192)
_fail = functools.partial(usage.fail, "mercury_jax.bench families")


def parse_shape(text: str) -> Shape:
  """``d_model,n_layers,n_heads,mlp,vocab``."""
  try:
    d_model, n_layers, n_heads, mlp, vocab = (int(v) for v in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} must be five integers d_model,n_layers,n_heads,mlp,vocab") from None
  if d_model % n_heads:
    raise argparse.ArgumentTypeError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
  return Shape(d_model, n_layers, n_heads, mlp, vocab)


def llada_config(shape: Shape) -> dict:
  """config.json in LLaDA's keys (as LLaDA-8B-Instruct's)."""
  return {
    "model_type": "llada", "architectures": ["LLaDAModelLM"], "block_type": "llama", "activation_type": "silu",
    "layer_norm_type": "rms", "d_model": shape.d_model, "n_layers": shape.n_layers, "n_heads": shape.n_heads,
    "n_kv_heads": shape.n_heads, "mlp_hidden_size": shape.mlp, "vocab_size": shape.vocab,
    "embedding_size": shape.vocab, "rope": True, "rope_theta": 10_000.0, "rms_norm_eps": 1e-5,
    "weight_tying": False, "include_bias": False, "include_qkv_bias": False, "attention_layer_norm": False,
    "max_sequence_length": shape.max_length, "mask_token_id": SPECIAL["mask"], "eos_token_id": SPECIAL["eos"],
    "pad_token_id": SPECIAL["pad"], "bos_token_id": SPECIAL["bos"],
  }  # fmt: skip


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
    lowered = jax.jit(engine.sample).lower(self.params, self.canvas, jax.random.key(0), jnp.int32(0))
    self.programs[cache], self.compile_s[cache] = timed(lowered.compile)

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


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--llada-repo", type=Path, required=True, help="a checkout of github.com/ML-GSAI/LLaDA")
  p.add_argument("--fast-dllm-repo", type=Path, required=True, help="a checkout of github.com/NVlabs/Fast-dLLM")
  p.add_argument("--shape", type=parse_shape, default=DEFAULT_SHAPE, help="d_model,n_layers,n_heads,mlp,vocab")
  p.add_argument("--prompt-length", type=int, default=32)
  p.add_argument("--gen-length", type=int, default=128)
  p.add_argument("--block-length", type=int, default=32)
  p.add_argument("--steps", type=int, nargs="+", default=[128, 64], help="LLaDA's total steps (over all blocks)")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
  p.add_argument("--write", type=Path, help="also write the table as markdown to this file")


def run_families(args: argparse.Namespace) -> None:
  """The engine against LLaDA's and Fast-dLLM's own PyTorch sampling loops.

  A random LLaDA-layout checkpoint, converted; batch 1, greedy, blocks: LLaDA's generate against cache="none" and
  Fast-dLLM's dual cache against cache="dual", in alternating rounds; prints tokens/s and their ratios.
  """
  import torch
  import transformers

  from mercury_jax.bench import families_torch
  from mercury_jax.convert import convert

  blocks = args.gen_length // args.block_length
  if args.gen_length % args.block_length or args.prompt_length % args.block_length:
    _fail(
      f"--gen-length={args.gen_length} and --prompt-length={args.prompt_length} must be multiples of "
      f"--block-length={args.block_length} (the engine's blocks sit at multiples of it from the canvas start)"
    )
  for steps in args.steps:
    if steps % blocks or not 0 < steps <= args.gen_length:
      _fail(f"--steps {steps} must be a multiple of {blocks} blocks and at most --gen-length")
  torch.set_num_threads(args.threads)
  llada_generate = families_torch.load_module("llada_generate", args.llada_repo / "generate.py").generate
  rng = np.random.default_rng(0)
  run = Run(tuple(int(t) for t in rng.integers(len(SPECIAL), args.shape.vocab, args.prompt_length)),
            args.gen_length, args.block_length, max(args.steps))  # fmt: skip
  with tempfile.TemporaryDirectory() as tmp:
    llama, state = families_torch.build_checkpoint(Path(tmp) / "hf", args.shape, llada_config(args.shape), SPECIAL)
    out = convert(Path(tmp) / "hf", Path(tmp) / "converted", dtype="float32")
    engine = Engine(out, run)
    for cache in ("none", "dual"):
      engine.compile(cache)
  banned = sorted({SPECIAL["mask"], SPECIAL["pad"], SPECIAL["bos"], SPECIAL["unk"]})
  dual_generate, fast_model = families_torch.fast_dllm(args.fast_dllm_repo, llada_config(args.shape), state, banned)
  reference = families_torch.BannedIds(llama, banned, bidirectional=True)
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
        seconds = {}
        for side in ("ref", "ours") if r % 2 == 0 else ("ours", "ref"):
          seconds[side] = timed(fn, key[1])[1] if side == "ref" else timed(engine, cache, key[1])[1]
          walls[key][side].append(seconds[side])
        ratios[key].append(seconds["ref"] / seconds["ours"])
        print(f"round {r} {key}: ref {seconds['ref']:.2f} s, ours {seconds['ours']:.2f} s", flush=True)
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
    "Command: `python -m mercury_jax.bench families --llada-repo LLaDA --fast-dllm-repo Fast-dLLM "
    f"--rounds {args.rounds}` (checkouts: LLaDA {_checkout(args.llada_repo)}, Fast-dLLM "
    f"{_checkout(args.fast_dllm_repo)}).",
    "",
    f"Machine: {cpu_name()}, {torch.get_num_threads()} torch threads; torch {torch.__version__}, transformers "
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


COMMANDS = {"families": (add_arguments, run_families)}
