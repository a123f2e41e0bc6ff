"""Long prompts through the engine and the server: chunked prefill against one pass, and the streams it interrupts.

    python -m mercury_jax.bench long-context prefill --model default_ar --lengths 4096,16384 --chunks 0,512,2048
    python -m mercury_jax.bench long-context gaps --model default_ar --long 16384 --chunk 512
    python -m mercury_jax.bench long-context cached --slots 4096,16384 --chunk 512
    python -m mercury_jax.bench long-context tiles --slots 4096,16384 --chunk 512 --positions 0.125,0.5,1

Both extend a bundled model's context with YaRN RoPE scaling (``model.rope_scaling``; the weights are unchanged, so
text past the trained context is poor: these are speed and memory figures, not quality ones) into a temporary export.

``prefill``: for each prompt length and ``--prefill-chunk`` (0: one pass), a fresh process prefills a random prompt
of that many tokens through the block engine (``BlockEngine.init``, the command line's path) and generates
``--generate`` tokens; it prints the prefill's tokens/s, the generation's seconds and the process's peak resident
memory (``ru_maxrss``), one markdown row each.

``gaps``: ``--streams`` short greedy requests stream from a server engine (``Scheduler``); they run once alone, then
again (the same prompts and seeds, so the same tokens in the same updates) with a ``--long``-token prompt arriving
after ``--warm-tokens`` and prefilled in chunks of ``--chunk`` at ``--prefill-share`` ``--share`` (streams that
outlast the long prefill, ``--stream-tokens``, measure all of it). Each update that
arrived during the long prefill is compared with the same update of the run alone, at the same stream lengths (a
stream's own step grows with its length, prefill or not). Prints both sides' gap median, mean, 90th percentile and
maximum, their ratios, the long request's time to first token and its chunks' share of that time, and the median
time of the engine's step and prefill-chunk programs in the second run (from ``SlotEngine.timing`` after each
iteration: a step to the copy of its view, an iteration's chunks together, divided by their count).
``--one-softmax`` reads the cache in one softmax over every slot, as before the tiles.

``cached``: the XLA attention of a prefill chunk over a cache (``attention.attend_cached``, batched matmuls over
``[batch, kv_heads]``) against the einsum formulation it replaced (head axes between the query and slot axes),
interleaved, for the model shapes given.

``tiles``: the same attention reading the cache tile by tile up to the chunk's last visible slot
(``attend_cached(blockwise=True)``, ``kernels/blockwise_cached_attention.py``) against one softmax over every slot
(``blockwise=False``), for a chunk ending at several positions of the cache, interleaved.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mercury_jax.bench.throughput import interleaved, timed


def extended(model: str, context: int, out: Path) -> Path:
  """An export of the bundled ``model`` with a context of ``context`` tokens (YaRN over the trained length)."""
  from mercury_jax.checkpoint import export_params, find_tokenizer, restore_params
  from mercury_jax.sampling.registry import default_checkpoint

  source = default_checkpoint(model)
  params, cfg = restore_params(source)
  trained = cfg.model.max_length
  rope = dict(rope_scaling="yarn", rope_factor=context / trained, rope_original_length=trained)
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, max_length=context, **rope))
  return export_params(out, params, cfg, find_tokenizer(source)).parent


def prefill_once(path: str, length: int, chunk: int, generate: int) -> dict:
  """One measurement, in this process (run by :func:`prefill` in a fresh one)."""
  import jax
  import jax.numpy as jnp

  from mercury_jax.sampling import canvas as cv
  from mercury_jax.sampling.engine import BlockEngine
  from mercury_jax.sampling.plan import Decoding
  from mercury_jax.sampling.sampler import Sampler

  sampler = Sampler.from_checkpoint(path)
  vocab = sampler.tokenizer.vocab_size
  prompt = np.random.default_rng(0).integers(5, vocab, length).tolist()
  canvas = cv.make_canvas([cv.prefix(prompt, generate)])
  settings = sampler.settings(temperature=0.0, prefill_chunk=chunk)
  plan = sampler.plan(Decoding(prefill_chunk=chunk), canvas.tokens.shape[1])
  canvas = cv.pad_length(canvas, plan.length)
  engine = BlockEngine(sampler.network, settings, plan)
  init = jax.jit(lambda p, c: engine.init(p, c, jax.random.key(0), jnp.int32(1)))
  advance = jax.jit(engine.advance)
  _, compiled = timed(lambda p, c: advance(p, init(p, c)), sampler.params, canvas)  # compile both, and a first run
  state, prefill_s = timed(init, sampler.params, canvas)
  _, generate_s = timed(advance, sampler.params, state)
  return {
    "length": length,
    "chunk": chunk,
    "prefill_tokens_per_s": length / prefill_s,
    "generate_s": generate_s,
    "total_s": prefill_s + generate_s,
    "compile_and_first_run_s": compiled,
    "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
  }


def prefill(args) -> None:
  with tempfile.TemporaryDirectory() as tmp:
    path = extended(args.model, max(args.lengths) + args.generate + 64, Path(tmp) / "long")
    print(f"model {args.model} extended to {max(args.lengths) + args.generate + 64} tokens; {args.generate} generated")
    print("| prompt tokens | --prefill-chunk | prefill tok/s | generate s | total s | peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
      for chunk in args.chunks:
        child = [sys.executable, "-m", "mercury_jax.bench.long_context"]  # a fresh process: its own peak memory
        command = [*child, str(path), str(length), str(chunk), str(args.generate)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
          print(f"| {length} | {chunk} | failed: {done.stderr.strip().splitlines()[-1]} | | | |")
          continue
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(
          f"| {length} | {chunk or 'one pass'} | {r['prefill_tokens_per_s']:.0f} | {r['generate_s']:.2f} | "
          f"{r['total_s']:.2f} | {r['peak_rss_gib']:.2f} |",
          flush=True,
        )


def _pairs(alone: list[list[float]], beside: list[list[float]], start: float, end: float):
  """(gap alone, gap beside) of every stream's updates that arrived within ``[start, end]`` beside the long prefill,
  each against the same update's gap in the run without it (greedy: the same tokens in the same updates)."""
  pairs = []
  for quiet, busy in zip(alone, beside, strict=True):
    for j in range(1, min(len(quiet), len(busy))):
      if start <= busy[j - 1] and busy[j] <= end:
        pairs.append((quiet[j] - quiet[j - 1], busy[j] - busy[j - 1]))
  return pairs


def gaps(args) -> None:
  from mercury_jax import attention
  from mercury_jax.sampling.proposal import Knobs
  from mercury_jax.sampling.sampler import Sampler
  from mercury_jax.sampling.text import Row
  from mercury_jax.serve.config import ServeConfig
  from mercury_jax.serve.scheduler import Scheduler

  if args.one_softmax:  # The cache read in one softmax over every slot, as before the tiles.
    attention.CACHED_BLOCKWISE_MIN_SLOTS = sys.maxsize
  with tempfile.TemporaryDirectory() as tmp:  # the weights and tokenizer are in memory once loaded
    path = extended(args.model, args.long + 256, Path(tmp) / "long")
    sampler = Sampler.from_checkpoint(path)
  config = ServeConfig(slots=args.streams + 1, prefill_chunk=args.chunk, prefill_share=args.share)
  scheduler = Scheduler(sampler, config)
  programs = {"step": [], "chunk": []}  # the engine's step and prefill-chunk programs, each call's seconds
  engine, dispatch, collect = scheduler.engine, scheduler.engine.dispatch, scheduler.engine.collect

  def timed_dispatch(command, **kwargs):  # an iteration's admissions and chunks, as ``SlotEngine.timing`` says
    out = dispatch(command, **kwargs)
    if engine.timing.chunks:
      programs["chunk"] += [engine.timing.chunk_seconds / engine.timing.chunks] * engine.timing.chunks
    return out

  def timed_collect(dispatched):  # its step, to the copy of its view
    out = collect(dispatched)
    if engine.timing.step_seconds is not None and dispatched.packed is not None:
      programs["step"].append(engine.timing.step_seconds)
    return out

  engine.dispatch, engine.collect = timed_dispatch, timed_collect
  greedy = Knobs(0.0, 0, 1.0, 0.9)
  vocab = scheduler.vocab_size
  rng = np.random.default_rng(0)
  prompts = [tuple(rng.integers(5, vocab, 16).tolist()) for _ in range(args.streams)]
  long = Row.completion(tuple(rng.integers(5, vocab, args.long).tolist()), 8, knobs=greedy)
  scheduler.start()

  async def run(with_long: bool):
    """The streams' update times, and (with the long prompt) when it arrived and when its first token came."""
    loop = asyncio.get_running_loop()
    shorts = [
      scheduler.submit(Row.completion(prompt, args.stream_tokens, knobs=greedy, seed=i), loop)
      for i, prompt in enumerate(prompts)
    ]
    times = [[] for _ in shorts]

    async def follow(i, handle):
      async for update in handle.updates():
        if update.tokens:
          times[i].append(update.time)

    followers = [asyncio.create_task(follow(i, h)) for i, h in enumerate(shorts)]
    submitted = first = None
    if with_long:
      while min(len(t) for t in times) < args.warm_tokens:
        await asyncio.sleep(0.005)
      submitted = time.perf_counter()
      updates = [u async for u in scheduler.submit(long, loop).updates()]
      first = min(u.time for u in updates if u.tokens)
    await asyncio.gather(*followers)
    return times, submitted, first

  try:
    alone, _, _ = asyncio.run(run(False))  # the same streams without the long prompt: the baseline, token by token
    for key in programs:
      programs[key].clear()
    chunks_before, chunk_seconds_before = scheduler.stats.chunks, scheduler.stats.chunk_seconds
    beside, submitted, first = asyncio.run(run(True))
  finally:
    scheduler.shutdown(0)
  pairs = _pairs(alone, beside, submitted, first)
  if not pairs:
    raise SystemExit("no stream received two updates during the long prefill: raise --stream-tokens")
  quiet, busy = (np.asarray(side) for side in zip(*pairs, strict=True))
  longest = max(len(t) for t in beside)
  share = (scheduler.stats.chunk_seconds - chunk_seconds_before) / (first - submitted)
  print(
    f"model {args.model}, {args.streams} streams of {args.stream_tokens} tokens, a {args.long}-token prompt "
    f"prefilled in chunks of {args.chunk}, --prefill-share {args.share}"
  )
  print("| the streams' updates during the long prefill | gaps | median ms | mean ms | p90 ms | max ms |")
  print("|---|---|---|---|---|---|")
  for name, g in (("the same updates without it", quiet), ("beside it", busy)):
    stats = (np.median(g), g.mean(), np.percentile(g, 90), g.max())
    print(f"| {name} | {len(g)} | " + " | ".join(f"{1e3 * v:.1f}" for v in stats) + " |")
  print(
    f"ratio beside / without: mean {busy.mean() / quiet.mean():.2f}, median {np.median(busy) / np.median(quiet):.2f}, "
    f"p90 {np.percentile(busy, 90) / np.percentile(quiet, 90):.2f}; long request TTFT {first - submitted:.2f} s; "
    f"chunks {scheduler.stats.chunks - chunks_before}, {100 * share:.0f} % of the prefill's time; "
    f"the streams' updates beside it: up to {longest}"
  )
  for name, times in programs.items():
    if times:
      print(f"{name} program: {len(times)} calls, median {1e3 * statistics.median(times):.1f} ms")


def _einsum_cached(q, k, v, visible, cache_k, cache_v):
  """The replaced formulation of ``attention._cached_xla`` (scores ``[b, kv, groups, chunk, slots]``)."""
  import jax.numpy as jnp

  batch, chunk, heads, head_dim = q.shape
  kv_heads, (in_cache, in_chunk) = k.shape[2], visible
  q = q.reshape(batch, chunk, kv_heads, heads // kv_heads, head_dim) * head_dim**-0.5
  cached = jnp.where(in_cache[:, None, None], jnp.einsum("bqkgd,bskd->bkgqs", q, cache_k), -jnp.inf)
  own = jnp.where(in_chunk[:, None, None], jnp.einsum("bqkgd,bjkd->bkgqj", q, k), -jnp.inf)
  top = jnp.maximum(jnp.max(cached, axis=-1), jnp.max(own, axis=-1))
  cached, own = jnp.exp(cached - top[..., None]), jnp.exp(own - top[..., None])
  total = jnp.moveaxis(jnp.sum(cached, axis=-1) + jnp.sum(own, axis=-1), -1, 1)[..., None]
  out = jnp.einsum("bkgqs,bskd->bqkgd", cached, cache_v) + jnp.einsum("bkgqj,bjkd->bqkgd", own, v)
  return (out / total).reshape(batch, chunk, heads, head_dim)


def _chunk_inputs(chunk: int, slots: int, heads: int, kv_heads: int, dim: int):
  """Random ``(q, k, v, cache_k, cache_v)`` of one row's chunk over a cache, and ``(segments, cache_segments)``."""
  import jax
  import jax.numpy as jnp

  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(keys[0], (1, chunk, heads, dim))
  k, v = (jax.random.normal(key, (1, chunk, kv_heads, dim)) for key in keys[1:3])
  cache_k, cache_v = (jax.random.normal(key, (1, slots, kv_heads, dim)) for key in keys[3:5])
  return (q, k, v, cache_k, cache_v), (jnp.ones((1, chunk), jnp.int32), jnp.ones((1, slots), jnp.int32))


def _interleaved_ms(fns, inputs, repeats: int) -> list[float]:
  """Each function's median milliseconds on ``inputs``, the functions run in turn ``repeats`` times."""
  seconds = interleaved({i: (fn, inputs) for i, fn in enumerate(fns)}, repeats, order="same")
  return [1e3 * statistics.median(t) for t in seconds.values()]


def _cases(args):
  """``(slots, "heads / kv heads x dim", chunk inputs, segments)`` of every cache length and shape of the flags, the
  markdown table's header printed first."""
  print("| slots | chunk | heads / kv heads x dim | " + " | ".join(args.columns) + " |")
  print("|---|---|---|" + "---|" * len(args.columns))
  for slots in args.slots:
    for heads, kv_heads, dim in args.shapes:
      yield slots, f"{heads} / {kv_heads} x {dim}", *_chunk_inputs(args.chunk, slots, heads, kv_heads, dim)


def cached(args) -> None:
  import jax
  import jax.numpy as jnp

  from mercury_jax.attention import CachedInputs, attend_cached
  from mercury_jax.kernels import masks

  args.columns = ("einsum ms", "batched matmuls ms", "speed-up")
  for slots, shape, inputs, (segments, cache_segments) in _cases(args):
    starts = jnp.asarray([slots - args.chunk], jnp.int32)
    visible = masks.cached(segments, cache_segments, starts, "causal", block=None, xp=jnp)
    old = jax.jit(lambda q, k, v, ck, cv, vis=visible: _einsum_cached(q, k, v, vis, ck, cv))
    new = jax.jit(
      lambda q, k, v, ck, cv, s=segments, cs=cache_segments, st=starts: attend_cached(
        CachedInputs(q, k, v, s, ck, cv, cs, st), mask="causal", implementation="xla"
      )
    )
    np.testing.assert_allclose(np.asarray(old(*inputs)), np.asarray(new(*inputs)), atol=1e-4, rtol=1e-4)
    a, b = _interleaved_ms((old, new), inputs, args.repeats)
    print(f"| {slots} | {args.chunk} | {shape} | {a:.1f} | {b:.1f} | {a / b:.1f}x |", flush=True)


def _tiles_program(blockwise: bool, segments, cache_segments):
  """The compiled causal attention of a chunk over a cache, read in tiles (``blockwise``) or in one softmax."""
  import jax

  from mercury_jax.attention import CachedInputs, attend_cached

  def fn(q, k, v, cache_k, cache_v, starts):
    inputs = CachedInputs(q, k, v, segments, cache_k, cache_v, cache_segments, starts)
    return attend_cached(inputs, mask="causal", implementation="xla", blockwise=blockwise)

  return jax.jit(fn)


def tiles(args) -> None:
  import jax.numpy as jnp

  args.columns = ("chunk starts at", "one softmax ms", "tiles ms", "speed-up")
  for slots, shape, inputs, (segments, cache_segments) in _cases(args):
    one, tiled = (_tiles_program(blockwise, segments, cache_segments) for blockwise in (False, True))
    for fraction in args.positions:
      starts = jnp.asarray([max(int(fraction * slots) - args.chunk, 0)], jnp.int32)
      expected, got = (np.asarray(fn(*inputs, starts)) for fn in (one, tiled))
      np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
      a, b = _interleaved_ms((one, tiled), (*inputs, starts), args.repeats)
      print(f"| {slots} | {args.chunk} | {shape} | {int(starts[0])} | {a:.1f} | {b:.1f} | {a / b:.1f}x |", flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
  sub = p.add_subparsers(dest="what", metavar="WHAT", required=True)
  part = lambda name, help: sub.add_parser(name, help=help, command=f"mercury_jax.bench long-context {name}")  # noqa: E731
  a = part("prefill", "chunked prefill against one pass: speed and peak memory")
  a.add_argument("--model", default="default_ar", help="a bundled model (default default_ar)")
  a.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384, 32768])
  a.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[0, 512, 2048])
  a.add_argument("--generate", type=int, default=64, help="tokens generated after the prompt (default 64)")
  b = part("gaps", "short streams' inter-token gaps with and without a long prefill beside them")
  b.add_argument("--model", default="default_ar", help="a bundled model (default default_ar)")
  b.add_argument("--long", type=int, default=16384, help="the long prompt's tokens (default 16384)")
  b.add_argument("--chunk", type=int, default=512, help="--prefill-chunk of the server (default 512)")
  b.add_argument("--share", type=float, default=0.5, help="--prefill-share of the server (default 0.5)")
  b.add_argument("--streams", type=int, default=4, help="short streams (default 4)")
  b.add_argument("--warm-tokens", type=int, default=40, help="tokens each stream gets before the long prompt")
  b.add_argument("--stream-tokens", type=int, default=200, help="tokens each stream asks for (default 200)")
  b.add_argument("--one-softmax", action="store_true", help="read the cache in one softmax (no tiles), as before")
  c = part("cached", "the cached attention's XLA path against the einsum it replaced")
  c.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384])
  c.add_argument("--chunk", type=int, default=512, help="query tokens of the chunk (default 512)")
  c.add_argument(
    "--shapes",
    type=lambda s: [tuple(int(x) for x in shape.split("/")) for shape in s.split(",")],
    default=[(2, 1, 16), (4, 4, 64)],
    help="HEADS/KV_HEADS/HEAD_DIM,... (default 2/1/16,4/4/64: the tests' random model, the bundled models)",
  )
  c.add_argument("--repeats", type=int, default=7)
  t = part("tiles", "the cache read in tiles up to the chunk against one softmax over every slot")
  t.add_argument("--slots", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384])
  t.add_argument("--chunk", type=int, default=512, help="query tokens of the chunk (default 512)")
  t.add_argument("--positions", type=lambda s: [float(x) for x in s.split(",")], default=[0.125, 0.5, 1.0],
                 help="where the chunk ends, as fractions of the cache (default 0.125,0.5,1)")  # fmt: skip
  t.add_argument(
    "--shapes",
    type=lambda s: [tuple(int(x) for x in shape.split("/")) for shape in s.split(",")],
    default=[(4, 4, 64)],
    help="HEADS/KV_HEADS/HEAD_DIM,... (default 4/4/64: the bundled models)",
  )
  t.add_argument("--repeats", type=int, default=7)


def run_long_context(args: argparse.Namespace) -> None:
  """Long prompts: chunked prefill, the streams beside it, the cache reads.

  prefill: speed and peak memory of each prompt length and --chunks; gaps: short streams' update gaps beside a long
  chunked prefill; cached: the XLA cached attention against its einsum formulation; tiles: the cache read in tiles
  against one softmax. A bundled model is extended with YaRN RoPE scaling (speed figures, not quality ones).
  """
  {"prefill": prefill, "gaps": gaps, "cached": cached, "tiles": tiles}[args.what](args)


COMMANDS = {"long-context": (add_arguments, run_long_context)}

if __name__ == "__main__":  # a child of ``prefill``: one measurement in a fresh process
  path, length, chunk, generate = sys.argv[1:5]
  print(json.dumps(prefill_once(path, int(length), int(chunk), int(generate))))
