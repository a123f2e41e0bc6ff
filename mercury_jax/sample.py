"""``python -m mercury_jax.sample --checkpoint DIR --prompt TEXT [--steps N --sampler NAME ...]``: generate text.

Examples::

  python -m mercury_jax.sample --checkpoint runs/tiny --prompt "def fibonacci(n):" --length 64 --steps 16
  python -m mercury_jax.sample --checkpoint runs/tiny --template '{"name": "<mask:8>", "age": <mask:2>}'
  python -m mercury_jax.sample --checkpoint runs/tiny --prompts-file prompts.jsonl --json
  python -m mercury_jax.sample --checkpoint runs/tiny --prompt "import os" --show-steps
  python -m mercury_jax.sample --checkpoint runs/tiny_bd --prompt "import os" --length 256 --steps 64 --stream
  python -m mercury_jax.sample --chat "Write a function that reverses a string."
  echo "Explain this code: print(sum(range(10)))" | python -m mercury_jax.sample --chat - --system "Be brief."

``--chat MESSAGE`` is one chat turn: the user's message (``-`` reads it from stdin), after ``--system TEXT`` when
given, rendered by the checkpoint's chat template (``data.chat_template``, or a converted checkpoint's own; the code
``/v1/chat/completions`` renders it with, :mod:`mercury_jax.data.chat_template`), BOS in front once, no token
healing; the reply is printed without the prompt, up to the end of the turn or ``--length`` tokens (default 128).
A model without a chat template is a usage error.

``--prompts-file`` is JSON lines, each ``{"prompt": "..."}`` or a JSON string. Without ``--checkpoint`` the model
bundled in ``mercury_jax/assets/default/`` is used (see its ``MODEL_CARD.md``). Compiled programs are kept in
``~/.cache/mercury_jax/xla`` (``$XDG_CACHE_HOME``; ``--no-compile-cache`` to skip), so a repeated command starts
faster. Bad input gets one line on stderr and exit code 2.

Block-diffusion checkpoints (``objective.block_size > 0``) decode block by block against an exact key-value cache;
the autoregressive twin is the same engine with blocks of one token. ``--cache none`` runs the same steps without a
cache (every pass recomputes the whole context). Whole-sequence checkpoints refine the whole canvas as one block
(``--cache none``, the default; ``--block-length`` for semi-autoregressive blocks) or use Fast-dLLM's *approximate*
``--cache dual`` / ``--cache prefix`` over blocks of ``--block-length`` tokens. ``--stream`` prints text as each
block is committed; it gives the text the batch mode gives.

``--steps`` is the refinement budget of each sample's generated tokens: its blocks share it evenly, one step each at
least (a smaller budget is an error, not silently exceeded). ``--steps-per-block`` sets the engine's steps per block
instead. Neither: one token per step. The default step rule is ``threshold`` (tau 0.9), as on the server.

A checkpoint of the autoregressive twin (``objective.name = "autoregressive"``) is decoded token by token with
a key-value cache, with the same prompts, templates, ``--length``, ``--temperature``/``--top-k``/``--top-p``,
``--min-length``, ``--num-samples``, ``--seed``, ``--json`` and ``--show-steps`` (one frame per token). The
refinement flags (``--steps``, ``--steps-per-block``, ``--sampler``, ``--confidence``, ``--threshold``,
``--block-length``, ``--revision``) are an error for it.

Several processes (``--coordinator ...`` or a launcher) sample one batch together. By default every process reads the
same prompts and process 0 prints every sample. When the ``--prompts-file`` path contains ``{process}``, each
process reads its own file (``{process}`` replaced by its index), e.g. ``--prompts-file 'prompts-{process}.jsonl'``,
and prints only its own samples (with ``--json``, each line has a ``"process"`` field); the tokens are those one
process would give for all the files' prompts in process order.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from mercury_jax import distributed, usage
from mercury_jax.config import ObjectiveConfig
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.settings import CONFIDENCES, SAMPLERS, SamplerSettings, SettingError

FRAME_SECONDS = 0.08  # Pause between frames of --show-steps on a terminal.
PROCESS_PLACEHOLDER = "{process}"  # In a --prompts-file path: each process reads its own file.
# The flags that are ``SamplerSettings`` fields (their argparse destinations are the field names).
KNOBS = (
  "rule", "confidence", "temperature", "top_k", "top_p", "threshold", "block_length", "revision", "min_length",
  "decode", "draft_length", "draft_tree", "draft_lookup", "draft_blocks", "draft_confidence", "prefill_chunk", "solver",
  "self_conditioning", "guidance",
)  # fmt: skip

EPILOG = """\
autoregressive checkpoints (objective.name = "autoregressive") are decoded token by token with a key-value
cache; --steps, --steps-per-block, --sampler, --confidence, --threshold, --block-length and --revision apply to
diffusion models only
and are an error for them. A canvas that starts with a hole gets BOS in front. --show-steps shows one frame per token.

several processes: by default every process reads the same prompts and process 0 prints every sample. With
--prompts-file 'prompts-{process}.jsonl' each process reads its own file ({process} becomes its process index, a
file may be empty) and prints only its own samples (--json lines carry "process"); the tokens equal those of one
process given all the files' prompts in process order.

chat: --chat MESSAGE (or --chat - to read it from stdin) renders [--system TEXT,] MESSAGE with the model's chat
template (the bundled default and default_ar have one) and prints the reply alone (default --length 128). A model
without a chat template, an empty message or an empty stdin: one line on stderr, exit code 2."""

NO_DEFAULT_MODEL = (
  "no --checkpoint given and the bundled model {name!r} is missing from mercury_jax/assets/{name}/ (reinstall the "
  "package, or train a model with `python -m mercury_jax.prepare --corpus python-stdlib --out data/stdlib` and "
  "`python -m mercury_jax.train --config tiny --workdir runs/tiny --set data.path=data/stdlib`, "
  "then pass --checkpoint runs/tiny)"
)


def bundled_model(name: str, fail) -> Path:
  """The folder of the bundled model ``name`` (``--model``); ``fail`` gets the one-line error when there is none."""
  from mercury_jax.sampling.registry import default_checkpoint

  try:
    path = default_checkpoint(name)
  except ValueError as e:
    fail(f"--model: {e}")
  if path is None:
    fail(NO_DEFAULT_MODEL.format(name=name))
  return path


def load_sampler(checkpoint: str | None, model: str, mesh: str | None, fail):
  """The :class:`~mercury_jax.sampling.sampler.Sampler` of ``--checkpoint`` (or the bundled ``--model``) on the
  ``--mesh`` the flags name; ``fail`` gets the one-line error of a flag that cannot be honoured."""
  from mercury_jax import sharding as sh
  from mercury_jax.config import ConfigError
  from mercury_jax.sampling.sampler import Sampler

  path = bundled_model(model, fail) if checkpoint is None else checkpoint
  if not Path(path).exists():
    fail(f"--checkpoint {str(path)!r} does not exist")
  try:
    placed = sh.mesh_from_flag(mesh)
  except ConfigError as e:
    fail(str(e) if str(e).startswith("--mesh") else f"--mesh {mesh!r}: {e}")
  try:
    return Sampler.from_checkpoint(path, mesh=placed)
  except (FileNotFoundError, ConfigError, ValueError) as e:
    fail(f"--checkpoint {str(path)!r}: {e}")


_Parser = functools.partial(usage.Parser, command="mercury_jax.sample")  # usage errors: one line, exit code 2
_fail = functools.partial(usage.fail, "mercury_jax.sample")


def flag_names(parser: argparse.ArgumentParser) -> dict[str, str]:
  """Each argparse destination's flag: ``top_p`` -> ``--top-p``, ``rule`` -> ``--sampler``, ``steps`` -> ``--steps``."""
  return {a.dest: max(a.option_strings, key=len) for a in parser._actions if a.option_strings}


def _fail_setting(error: SettingError, flags: dict[str, str]):
  """A sampler setting's error, the setting called by its flag (``--top-p=0.0 must lie in (0, 1]``)."""
  _fail(error.named(flags.get(error.field, error.field)))


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(
    prog="python -m mercury_jax.sample",
    description=__doc__.splitlines()[0],
    epilog=EPILOG,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  which = p.add_mutually_exclusive_group()
  which.add_argument("--checkpoint", help="train workdir, checkpoints folder, step folder or exported checkpoint")
  which.add_argument(
    "--model",
    default="default",
    help="a bundled model, without --checkpoint: default (verified decoding, the default), default_bd (block "
    "diffusion) or default_ar (the autoregressive twin, trained on the same data)",
  )
  source = p.add_mutually_exclusive_group()
  source.add_argument("--prompt", help="text to continue (or to put before --template)")
  source.add_argument(
    "--prompts-file",
    help='JSON lines: {"prompt": ...} or a JSON string per line; a path with {process} (e.g. prompts-{process}.jsonl) '
    "makes each process read its own file and print only its own samples",
  )
  source.add_argument(
    "--chat",
    metavar="MESSAGE",
    help="one chat turn: the user's MESSAGE ('-': read it from stdin) in the model's chat template; prints the reply",
  )
  p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the user's")
  p.add_argument("--template", help="text with <mask:N> holes to fill; its other text is kept as is")
  p.add_argument(
    "--length", type=int, help="tokens to generate after each prompt (default 64, 128 with --chat; not with --template)"
  )
  p.add_argument(
    "--steps",
    type=int,
    help="the refinement budget for each sample's generated tokens: every block gets the same share, at least one "
    "step each (fewer steps than blocks is an error); finished blocks stop early (default: one token per step)",
  )
  p.add_argument(
    "--steps-per-block",
    type=int,
    help="refinement steps per block instead of a total --steps budget (what the server's steps_per_block means)",
  )
  p.add_argument(
    "--cache",
    default="auto",
    help="key-value cache: auto (the model's best exact decoder), exact (block-diffusion and autoregressive "
    "checkpoints), none (recompute everything every step), dual or prefix (APPROXIMATE, Fast-dLLM's caches for "
    "whole-sequence checkpoints: faster, but a step sees stale keys and values of the other blocks)",
  )
  p.add_argument(
    "--decode",
    choices=("auto", "ar", "diffusion", "verified"),
    help="how to decode (default auto: the model's best): verified (a verified checkpoint drafts blocks by diffusion "
    "and keeps what its own next-token head accepts: exactly its autoregressive distribution, several tokens per "
    "forward pass), ar (its next-token head alone) or diffusion (block-diffusion refinement)",
  )
  p.add_argument(
    "--draft-length",
    type=int,
    help="verified decoding's draft length k: the drafter's chain of k - 1 drafts (default: the trained one)",
  )
  usage.add_draft_flags(p)
  p.add_argument(
    "--prefill-chunk",
    type=int,
    help="run a long prompt's prefill in chunks of this many tokens (whole blocks) against the cache: memory bounded "
    "by the chunk instead of the prompt (default 0: one pass)",
  )
  p.add_argument("--stream", action="store_true", help="print text as each block is committed (block engine)")
  p.add_argument(
    "--sampler",
    dest="rule",
    metavar="SAMPLER",
    help=f"step rule: {', '.join(SAMPLERS)} (default threshold; ode, the only one, for a continuous checkpoint)",
  )
  usage.add_latent_flags(p)
  p.add_argument(
    "--no-self-conditioning",
    dest="self_conditioning",
    action="store_false",
    default=None,
    help="a continuous checkpoint's passes do not read the previous step's estimate (default: they do, if trained so)",
  )
  p.add_argument("--confidence", help=f"what ranks positions: {', '.join(CONFIDENCES)} (default prob)")
  p.add_argument("--temperature", type=float, help="0 is greedy (default 1, or the checkpoint's own)")
  p.add_argument("--top-k", type=int, help="sample among the k most likely tokens (default 0: all)")
  p.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1] (default 1)")
  p.add_argument("--threshold", type=float, help="confidence bar of --sampler threshold (default 0.9)")
  p.add_argument("--block-length", type=int, help="semi-autoregressive blocks (default 0: one block)")
  p.add_argument(
    "--revision",
    type=float,
    help="re-masking strength eta in [0, 1) (default 0): ReMDM-rescale with --sampler ancestral, deterministic "
    "low-confidence re-masking with the others; never in a finished block",
  )
  p.add_argument("--min-length", type=int, default=0, help="no end-of-sequence among the first N generated tokens")
  p.add_argument("--bos", action="store_true", help="start prompts with BOS, as SFT data does")
  p.add_argument(
    "--no-token-healing",
    dest="token_healing",
    action="store_false",
    help="keep the prompt's last token as tokenised (default: re-generate it, constrained to start with its "
    "characters, so a prompt ending in ':' or half a word continues as the training text would)",
  )
  p.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument(
    "--mesh", help="DATA,FSDP,TENSOR or DATA,FSDP,SEQUENCE,TENSOR sizes (default: every device on the data axis)"
  )
  structured = p.add_mutually_exclusive_group()
  structured.add_argument(
    "--json-schema", metavar="FILE_OR_JSON", help="generate JSON valid under this JSON Schema (a file, or JSON text)"
  )
  structured.add_argument("--regex", metavar="PATTERN", help="generate text that matches this regular expression")
  p.add_argument(
    "--json", action="store_true", help="one JSON object per sample: text, tokens, NFE, wall time, batch tokens/s"
  )
  p.add_argument(
    "--show-steps", action="store_true", help="show the canvas being refined step by step (autoregressive: by token)"
  )
  p.add_argument(
    "--no-compile-cache",
    action="store_true",
    help="do not keep compiled programs in $XDG_CACHE_HOME/mercury_jax/xla (default ~/.cache/...) for the next run",
  )
  distributed.add_arguments(p)
  return p


def _read_prompts(path: str, *, allow_empty: bool = False) -> list[str]:
  """The prompts of a JSON-lines file; ``ValueError`` with a one-line message when it cannot be used."""
  try:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"cannot read --prompts-file {path!r}: {getattr(e, 'strerror', None) or e}") from None
  prompts = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      item = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"--prompts-file {path!r} line {number} is not JSON: {e}") from None
    if isinstance(item, dict) and isinstance(item.get("prompt"), str):
      item = item["prompt"]
    if not isinstance(item, str):
      raise ValueError(
        f'--prompts-file {path!r} line {number} must be a JSON string or an object with a "prompt" string'
      )
    prompts.append(item)
  if not prompts and not allow_empty:
    raise ValueError(f"--prompts-file {path!r} holds no prompt")
  return prompts


def _prompts(args: argparse.Namespace, path: str, *, allow_empty: bool = False) -> list[str]:
  """``--prompts-file`` read and checked (no empty prompt without a template); ``ValueError`` otherwise."""
  prompts = _read_prompts(path, allow_empty=allow_empty)
  if args.template is None:
    for number, prompt in enumerate(prompts, 1):
      if not prompt:
        raise ValueError(f"prompt {number} of --prompts-file {path!r} is empty")
  return prompts


def _own_prompts(args: argparse.Namespace) -> list[str]:
  """This process's prompts in per-process mode (its file may be empty); if any process cannot read its file, every
  process stops with one line."""
  error = None
  try:
    prompts = _prompts(args, args.prompts_file.replace(PROCESS_PLACEHOLDER, str(jax.process_index())), allow_empty=True)
  except ValueError as e:
    error = str(e)
  failed = [0 if error is None else 1]
  if jax.process_count() > 1:
    failed = np.asarray(multihost_utils.process_allgather(np.int32(failed[0]))).reshape(-1).tolist()
  if error is not None:
    _fail(error)
  if any(failed):
    _fail(f"process(es) {[i for i, f in enumerate(failed) if f]} could not read their --prompts-file (see their error)")
  return prompts


def _check_args(args: argparse.Namespace, flags: dict[str, str]) -> dict:
  """Every check that needs no model, before a checkpoint is read; returns the sampler knobs given."""
  if args.steps is not None and args.steps < 1:
    _fail(f"--steps={args.steps} must be >= 1")
  if args.steps_per_block is not None and args.steps_per_block < 1:
    _fail(f"--steps-per-block={args.steps_per_block} must be >= 1")
  if args.steps is not None and args.steps_per_block is not None:
    _fail("--steps and --steps-per-block are two budgets; give one of them")
  if args.length is not None and args.length < 1:
    _fail(f"--length={args.length} must be >= 1")
  if args.length is not None and args.template is not None:
    _fail("--length does not apply to --template; the template's <mask:N> holes set the length")
  if args.num_samples < 1:
    _fail(f"--num-samples={args.num_samples} must be >= 1")
  if args.template is not None:
    cv.parse_template(args.template, lambda text: [])  # Raises for a template without holes.
  if args.stream and args.show_steps:
    _fail("--stream and --show-steps do not go together; pick one")
  if args.stream and args.prompts_file is not None and PROCESS_PLACEHOLDER in args.prompts_file:
    _fail("--stream samples on one process; a per-process --prompts-file needs the batch mode (drop --stream)")
  if args.system is not None and args.chat is None:
    _fail("--system goes with --chat (a chat turn's system message)")
  if args.chat is not None and (args.template is not None or args.show_steps):
    _fail(f"--chat does not go with {'--template' if args.template is not None else '--show-steps'}")
  if args.prompt is None and args.prompts_file is None and args.template is None and args.chat is None:
    _fail(
      "give --prompt TEXT, --prompts-file FILE.jsonl, --chat MESSAGE or --template TEXT (e.g. --template '<mask:64>')"
    )
  if args.prompt is not None and not args.prompt and args.template is None:
    _fail("--prompt is empty; give text to continue, or a --template with <mask:N> holes")
  knobs = {name: getattr(args, name) for name in KNOBS if getattr(args, name) is not None}  # Else SamplerSettings'.
  # The checks that need no model: the continuous family's knobs are checked against a continuous objective.
  latent = knobs.get("rule") == "ode" or any(name in knobs for name in ("solver", "self_conditioning", "guidance"))
  objective = ObjectiveConfig(name="continuous") if latent else ObjectiveConfig()
  try:
    SamplerSettings(**{"rule": "ode", **knobs} if latent else knobs, objective=objective).validate()
  except SettingError as e:
    _fail_setting(e, flags)
  return knobs


def _show(frames: list[str], header: str, unit: str) -> None:
  tty = sys.stdout.isatty()
  for j, frame in enumerate(frames):
    if tty:
      sys.stdout.write("\033[H\033[J")
    sys.stdout.write(f"{header} {unit} {j + 1}/{len(frames)}\n{frame}\n\n")
    sys.stdout.flush()
    if tty:
      time.sleep(FRAME_SECONDS)


COMPILE_CACHE_BYTES = 4 << 30


def compile_cache_dir() -> Path:
  """Where the command line keeps XLA's persistent compilation cache: ``$XDG_CACHE_HOME/mercury_jax/xla``."""
  return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mercury_jax" / "xla"


def enable_compile_cache() -> None:
  """Turns on XLA's persistent compilation cache for a command-line entry point (``sample``, ``serve``).

  ``JAX_COMPILATION_CACHE_DIR``, when set, takes precedence over :func:`compile_cache_dir`. The cache is bounded
  (``COMPILE_CACHE_BYTES``, least recently used entries go first), which is also what makes JAX take its file lock
  around every read and write: without a bound, a process can read an entry that another one is still writing
  (two servers starting on one host) and crash deserialising it.
  """
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", str(compile_cache_dir()))
  if jax.config.jax_compilation_cache_max_size == -1:
    jax.config.update("jax_compilation_cache_max_size", COMPILE_CACHE_BYTES)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # The prefill too (0.4 s to compile).


def main(argv: list[str] | None = None, *, compile_cache: bool = False) -> int:
  """The command line; ``compile_cache`` (on for ``python -m``) reuses compiled programs across runs.

  With the cache a repeated command skips most of its compilation (the bundled model's sampler: 1.4 s to compile,
  0.3 s to load, on 2 idle CPU cores); see :func:`enable_compile_cache`.
  """
  parser = build_parser()
  args, flags = parser.parse_args(argv), flag_names(parser)
  if compile_cache and not args.no_compile_cache:
    enable_compile_cache()
  try:
    knobs = _check_args(args, flags)
  except ValueError as e:  # A template without holes.
    _fail(f"--template: {e}")
  per_process = args.prompts_file is not None and PROCESS_PLACEHOLDER in args.prompts_file
  prompts = None
  if args.prompts_file and not per_process:
    try:
      prompts = _prompts(args, args.prompts_file)
    except ValueError as e:
      _fail(str(e))
  try:
    distributed.initialize(args)
  except SystemExit as e:  # Inconsistent --coordinator/--num-processes/--process-id.
    _fail(str(e.code))
  if per_process:
    prompts = _own_prompts(args)

  sampler = load_sampler(args.checkpoint, args.model, args.mesh, _fail)
  request = _request(args, knobs, _constraint(sampler, args))
  if args.chat is not None:
    prompts, request["bos"] = _chat_prompt(sampler, args)
    request.update(token_healing=False, length=128 if args.length is None else args.length)
  if args.stream:
    return _stream(sampler, prompts, args, request, flags)
  try:  # Refinement flags for an autoregressive checkpoint are a SettingError too.
    samples = sampler.generate(
      prompts if prompts is not None else args.prompt, show_steps=args.show_steps, per_process=per_process, **request
    )
  except SettingError as e:
    _fail_setting(e, flags)
  except ValueError as e:
    _fail(str(e))

  if not per_process and not distributed.is_primary():
    return 0
  process = jax.process_index() if per_process else None
  verified = bool(samples) and samples[0].accepted is not None
  unit = "token" if sampler.autoregressive and not verified else "step"
  for i, s in enumerate(samples):
    if args.json:
      record = {
        "prompt": s.prompt,
        "text": s.text,
        "tokens": s.tokens,
        "nfe": s.nfe,
        "tokens_per_forward": round(s.tokens_per_forward, 3),
        "wall_time_s": round(s.wall_time, 6),
        "tokens_per_s": round(s.tokens_per_s, 2),
        "compile_time_s": round(s.compile_time, 3),
      }
      if s.complete is not None:
        record["complete"] = s.complete
      if s.healed:
        record["healed"] = s.healed
      if s.accepted is not None:
        record["accepted"] = s.accepted  # steps that accepted 0, 1, ... drafts
      if process is not None:
        record["process"] = process
      if s.steps is not None:
        record["steps"] = s.steps
      print(json.dumps(record, ensure_ascii=False))
      continue
    if s.steps is not None:
      _show(s.steps, f"[sample {i + 1}/{len(samples)}]", unit)
    print(s.text if args.chat is not None else s.prompt + s.text)
    if s.complete is False:
      sys.stderr.write(f"sample {i + 1}: the structured text is unfinished: --length ran out before it could end\n")
    if i + 1 < len(samples):
      print("-" * 40)
  if not args.json and samples:
    s = samples[0]
    where = f"process {process}: " if process is not None else ""
    tpf = sum(len(x.tokens) for x in samples) / max(sum(x.nfe for x in samples), 1)
    sys.stderr.write(
      f"{where}{len(samples)} sample(s): NFE {max(x.nfe for x in samples)}, {s.wall_time:.3f} s, "
      f"{s.tokens_per_s:,.0f} tokens/s, {tpf:.2f} tokens per forward (compile {s.compile_time:.1f} s)\n"
    )
  return 0


def _chat_prompt(sampler, args: argparse.Namespace) -> tuple[list[str], bool]:
  """``--chat``'s prompt: ``[--system,] MESSAGE`` rendered by the model's chat template, and whether BOS goes in
  front (as the server's :func:`~mercury_jax.data.chat_template.prompt_ids`: once, unless the template wrote it)."""
  from mercury_jax.data.chat_template import TemplateError, chat_template_of, prompt_ids

  message = args.chat
  if message == "-":
    try:
      message = sys.stdin.read()
    except (OSError, UnicodeDecodeError) as e:
      _fail(f"--chat -: cannot read stdin: {e}")
    message = message.removesuffix("\n")
  if not message.strip():
    _fail("--chat: the message is empty" + (" (nothing on stdin)" if args.chat == "-" else ""))
  try:
    template = chat_template_of(sampler.cfg.data.chat_template, sampler.tokenizer)
    if template is None:
      _fail("--chat: this model has no chat template (data.chat_template in its config); use --prompt")
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    rendered = template.render([*system, {"role": "user", "content": message}])
  except TemplateError as e:
    _fail(f"--chat: {e}")
  ids = sampler.tokenizer.encode(rendered)
  return [rendered], prompt_ids(sampler.tokenizer, ids) != ids


def _constraint(sampler, args: argparse.Namespace):
  """The ``--json-schema`` or ``--regex`` automaton (None without either); a bad one is a usage error."""
  if args.json_schema is None and args.regex is None:
    return None
  from mercury_jax.constrain.automaton import ConstraintError

  try:
    if args.regex is not None:
      return sampler.constraint(regex=args.regex)
    text = args.json_schema
    path = Path(text)
    if not text.lstrip().startswith("{") and path.is_file():
      text = path.read_text()
    try:
      schema = json.loads(text)
    except json.JSONDecodeError as e:
      _fail(f"--json-schema: neither a JSON Schema file nor JSON text ({e.msg} at character {e.pos})")
    return sampler.constraint(json_schema=schema)
  except ConstraintError as e:
    where = f" at {e.param}" if e.param and args.json_schema is not None else ""
    _fail(f"--{'regex' if args.regex is not None else 'json-schema'}{where}: {e}")


def _request(args: argparse.Namespace, knobs: dict, constraint) -> dict:
  """The arguments ``generate`` and ``stream`` share, from the flags."""
  return dict(
    template=args.template,
    length=64 if args.length is None else args.length,
    steps=args.steps,
    steps_per_block=args.steps_per_block,
    seed=args.seed,
    num_samples=args.num_samples,
    bos=args.bos,
    cache=args.cache,
    constraint=constraint,
    token_healing=args.token_healing,
    **knobs,
  )


def _stream(sampler, prompts, args: argparse.Namespace, request: dict, flags: dict[str, str]) -> int:
  """``--stream``: sample 0's text as its blocks commit, each later sample once those before it are done (``--json``:
  one line per event)."""
  given = prompts if prompts is not None else [args.prompt if args.prompt is not None else ""]
  shown_heads = [""] * len(given) if args.chat is not None else given  # A chat turn prints its reply alone.
  heads = [p for p in shown_heads for _ in range(args.num_samples)]  # What each sample's text follows.
  events = sampler.stream(given, **request)
  texts, done, nfe = [[] for _ in heads], [False] * len(heads), [0] * len(heads)
  shown, on_screen = 0, False  # The sample being printed, and whether its prompt is out.
  start = time.perf_counter()
  try:
    for event in events:
      nfe[event.index] = event.nfe
      if args.json:
        print(json.dumps({"index": event.index, "text": event.text, "done": event.done, "nfe": event.nfe}), flush=True)
        continue
      texts[event.index].append(event.text)
      done[event.index] = event.done
      while shown < len(heads):
        if not on_screen:
          sys.stdout.write(heads[shown])
          on_screen = True
        sys.stdout.write("".join(texts[shown]))
        texts[shown] = []
        sys.stdout.flush()
        if not done[shown]:
          break
        shown, on_screen = shown + 1, False
        sys.stdout.write("\n" + ("-" * 40 + "\n" if shown < len(heads) else ""))
  except SettingError as e:
    _fail_setting(e, flags)
  except ValueError as e:
    _fail(str(e))
  if not args.json:
    seconds = time.perf_counter() - start
    sys.stderr.write(f"{len(heads)} sample(s): NFE {max(nfe, default=0)}, {seconds:.3f} s (compile included)\n")
  return 0


CPU_COMPILE_FLAG = "--xla_backend_optimization_level=1"


def quick_cpu_compile() -> bool:
  """On a host without an accelerator (no JAX plugin, no libtpu, or ``JAX_PLATFORMS=cpu``), compiles with LLVM's
  ``-O1`` instead of ``-O2``: a command's cold start is mostly compilation, the matmuls run in precompiled library
  kernels either way, and the bundled model samples as fast (docs/results/engine.md). Returns whether the flag was
  added; an ``XLA_FLAGS`` that already sets the level is left alone. Call it before JAX creates its backend."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_backend_optimization_level" in flags:
    return False
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if platforms != "cpu":
    import importlib.metadata
    import importlib.util

    if platforms or list(importlib.metadata.entry_points(group="jax_plugins")) or importlib.util.find_spec("libtpu"):
      return False
  os.environ["XLA_FLAGS"] = f"{flags} {CPU_COMPILE_FLAG}".strip()
  return True


def cli() -> int:
  """The ``mercury-sample`` console script and ``python -m``: :func:`main` with the compilation cache (and the quick
  CPU compilation of :func:`quick_cpu_compile`)."""
  quick_cpu_compile()
  return main(compile_cache=True)


if __name__ == "__main__":
  sys.exit(cli())
