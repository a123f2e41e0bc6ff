"""Correctness and speed of our Pallas flash attention on a GPU, next to XLA, cuDNN and JAX's bundled Pallas kernel.

Part 1 compares the kernel (forward and dq/dk/dv) with the float32 reference for every mask kind, with and without
segment ids, GQA, head_dim 64 and 128, in bfloat16 and float32, and checks ``attend(implementation="pallas"|"cudnn")``;
it prints the worst error relative to the largest reference value and PASS/FAIL. Part 2 times forward and
forward+backward in bfloat16 over lengths 1k..32k with batch * length fixed, printing TFLOP/s: 4 * B * H * L^2 * D per
forward, halved for causal; forward+backward counts 3.5x that (the backward pass is 2.5 forwards, the FlashAttention-2
convention). A combination that fails or runs out of memory is skipped with a note. ``--sweep`` also times alternative
BlockSizes for our kernel. ``--cached`` times attention of a decoding chunk over a key-value cache
(``attention.attend_cached``, what every engine step runs): the Pallas kernel over a dense cache and over pages read in
place through a page table (the server's ``PagedKVCache``), against the XLA path over the same two layouts (it gathers
pages, or reads long caches in tiles), printing microseconds per call and the cache's visible bytes read per second.

Run (on the GPU host; the default grid takes about 6-8 minutes on one H200)::

  JAX_PLATFORMS=cuda python -m mercury_jax.bench gpu-attention --json /tmp/attention_bench.json
  JAX_PLATFORMS=cuda python -m mercury_jax.bench gpu-attention --quick     # about 2 minutes
  python -m mercury_jax.bench gpu-attention --interpret --quick            # any host: checks the command itself
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax import attention
from mercury_jax.bench.throughput import median_seconds, time_call
from mercury_jax.kernels import flash_attention as fa
from mercury_jax.kvcache import read_pages

TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}  # max |error| / max |reference|
IMPLS = ("ours", "bundled", "cudnn", "xla")
# Alternatives to BlockSizes.get_default; each compiles for sm_90 without register spills (Triton 3.9, cuobjdump).
SWEEP = {
  64: [
    fa.BlockSizes(128, 128, 64, 128, 128, 64, num_warps=(8, 8, 8), num_stages=(3, 3, 3)),
    fa.BlockSizes(64, 64, 32, 64, 64, 32, num_warps=(4, 4, 4), num_stages=(3, 3, 3)),
    fa.BlockSizes(128, 64, 32, 128, 128, 32, num_warps=(8, 8, 8), num_stages=(4, 4, 4)),
  ],
  128: [
    fa.BlockSizes(128, 128, 32, 64, 64, 32, num_warps=(8, 8, 8), num_stages=(2, 2, 2)),
    fa.BlockSizes(64, 64, 32, 64, 64, 32, num_warps=(4, 8, 4), num_stages=(3, 3, 3)),
    fa.BlockSizes(128, 64, 32, 64, 128, 32, num_warps=(8, 8, 8), num_stages=(3, 3, 3)),
  ],
}


def _random(shape, dtype, seed):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _max_rel_error(got, want) -> float:
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


def check_correctness(interpret: bool, quick: bool) -> list[dict]:
  """Kernel vs reference (forward and gradients) and attend() vs the reference; prints one line per combination."""
  if interpret:  # Tiny shapes: the interpreter runs every grid step in Python-level XLA loops.
    batch, length, heads, kv_heads, dims, blocks = 1, 72, 4, 2, (64,), fa.BlockSizes(32, 32, 16, 32, 32, 16)
  else:
    batch, length, heads, kv_heads, dims, blocks = 2, 1000, 8, 2, (64,) if quick else (64, 128), None
  masks = [
    ("bidirectional", None),
    ("causal", None),
    ("block_causal", 48 if interpret else 96),
    ("block_diffusion", 8 if interpret else 64),  # Over x_t ⊕ x_0: halves of length // 2.
  ]
  ids = np.sort(np.random.default_rng(0).integers(1, 4, (batch, length)), axis=1)
  ids[:, -length // 10 :] = 0  # Right padding.
  half_ids = np.sort(np.random.default_rng(1).integers(1, 4, (batch, length // 2)), axis=1)
  half_ids[:, -length // 20 :] = 0
  # block_diffusion packs each half alike: the ids of x_t, then the same ids for x_0.
  segments_of = {m: jnp.asarray(ids, jnp.int32) for m, _ in masks}
  segments_of["block_diffusion"] = jnp.asarray(np.concatenate([half_ids, half_ids], axis=1), jnp.int32)
  results = []
  print(f"\n== correctness: batch={batch} length={length} heads={heads} kv_heads={kv_heads} (error / max |reference|)")
  for dim in dims:
    for dtype in ("bfloat16", "float32"):
      q = _random((batch, length, heads, dim), dtype, 0)
      k, v = (_random((batch, length, kv_heads, dim), dtype, s) for s in (1, 2))
      do = _random(q.shape, dtype, 3)
      for (mask, db), segments in [(m, s) for m in masks for s in (False, True)]:
        if quick and segments != (mask != "bidirectional"):
          continue
        options = {"segment_ids": segments_of[mask] if segments else None, "mask": mask, "diffusion_block": db}
        kernel = lambda q, k, v, options=options: fa.flash_attention(
          q, k, v, block_sizes=blocks, interpret=interpret, **options
        )
        reference = lambda q, k, v, options=options: fa.reference_attention(q, k, v, **options)
        grads = lambda f, q, k, v, do: (f(q, k, v), *jax.vjp(f, q, k, v)[1](do))
        f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
        try:
          got = jax.jit(functools.partial(grads, kernel))(q, k, v, do)
          want = jax.jit(functools.partial(grads, reference))(*f32)
          errors = [_max_rel_error(g, w) for g, w in zip(got, want, strict=True)]
          ok = max(errors) <= TOLERANCE[dtype]
          note = " ".join(f"{n}={e:.1e}" for n, e in zip(("out", "dq", "dk", "dv"), errors, strict=True))
        except Exception as e:  # noqa: BLE001 - report and go on
          ok, errors, note = False, [], f"ERROR {type(e).__name__}: {str(e)[:200]}"
        tag = f"D={dim} {dtype:8s} {mask:15s}{'+segments' if segments else '':9s}"
        print(f"  {'PASS' if ok else 'FAIL'}  {tag} {note}", flush=True)
        results.append(
          {
            "check": "kernel",
            "head_dim": dim,
            "dtype": dtype,
            "mask": mask,
            "segments": segments,
            "errors": errors,
            "pass": ok,
          }
        )
  if not interpret:  # The model's switch, on GPU: the pallas path and the cuDNN mapping of segments/block-causal.
    q, k, v = (_random((batch, length, h, 128), jnp.bfloat16, s) for s, h in ((4, heads), (5, kv_heads), (6, kv_heads)))
    for impl in ("pallas", "cudnn"):
      for mask, db in masks[1:]:
        try:
          options = {"segment_ids": segments_of[mask], "mask": mask, "diffusion_block": db}
          got = attention.attend(q, k, v, implementation=impl, **options)
          want = fa.reference_attention(q, k, v, **options)
          error = _max_rel_error(got, want)
          ok, note = error <= TOLERANCE["bfloat16"], f"out={error:.1e}"
        except Exception as e:  # noqa: BLE001
          ok, note = False, f"ERROR {type(e).__name__}: {str(e)[:200]}"
        print(f"  {'PASS' if ok else 'FAIL'}  attend(implementation={impl!r}) {mask}+segments {note}", flush=True)
        results.append({"check": f"attend-{impl}", "mask": mask, "pass": ok})
  return results


def _bundled():
  try:
    from jax.experimental.pallas.ops.gpu import attention as bundled

    return bundled
  except Exception:  # noqa: BLE001 - deprecated in newer JAX; reported as a skip
    return None


def _attention_fn(impl: str, causal: bool, interpret: bool, block_sizes=None):
  """A function (q, k, v) -> out for one implementation; layouts are all [batch, length, heads, head_dim]."""
  mask = "causal" if causal else "bidirectional"
  if impl == "ours":
    return lambda q, k, v: fa.flash_attention(q, k, v, mask=mask, block_sizes=block_sizes, interpret=interpret)
  if impl == "bundled":
    bundled = _bundled()
    if bundled is None:
      raise RuntimeError("jax.experimental.pallas.ops.gpu.attention is not importable")
    return lambda q, k, v: bundled.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal, interpret=interpret)
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)


def _time(fn, args, reps: int) -> tuple[float, float]:
  """(compile + first call seconds, median seconds per call after a warm-up call)."""
  return time_call(fn, *args), median_seconds(fn, *args, repeats=reps)


def _measure(impl, args, causal, *, interpret, block_sizes=None) -> list[dict]:
  """Times forward and forward+backward of ``args`` (q, k, v and the output's gradient, ``[batch, length, heads,
  head_dim]``); returns one record per mode (``ms`` None and a note when skipped)."""
  batch, length, heads, dim = args[0].shape
  fwd = _attention_fn(impl, causal, interpret, block_sizes)
  fns = {"fwd": jax.jit(fwd), "fwd+bwd": jax.jit(lambda q, k, v, do: jax.vjp(fwd, q, k, v)[1](do))}
  flops = 4 * batch * heads * length * length * dim / (2 if causal else 1)
  records = []
  for mode, fn in fns.items():
    record = {
      "impl": impl,
      "mode": mode,
      "causal": causal,
      "batch": batch,
      "length": length,
      "heads": heads,
      "head_dim": dim,
      "ms": None,
      "tflops": None,
      "note": "",
    }
    try:
      first, seconds = _time(fn, args if mode == "fwd+bwd" else args[:3], reps=_reps(length))
      total = flops * (3.5 if mode == "fwd+bwd" else 1.0)
      record.update(ms=seconds * 1e3, tflops=total / seconds / 1e12, compile_s=first)
    except Exception as e:  # noqa: BLE001 - out of memory or unsupported: note it and go on
      record["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    records.append(record)
  return records


def _short(blocks: fa.BlockSizes) -> str:
  """fwd q x k | dkv q x kv | dq q x kv, warps, stages."""
  b = blocks
  return (
    f"fwd {b.block_q}x{b.block_k} | dkv {b.block_q_dkv}x{b.block_kv_dkv} | dq {b.block_q_dq}x{b.block_kv_dq}"
    f" | warps {b.num_warps} stages {b.num_stages}"
  )


def _reps(length: int) -> int:
  return 10 if length <= 4096 else 5


def run_grid(interpret: bool, quick: bool, budget_s: float, xla_max_len: int, sweep: bool) -> list[dict]:
  """The timing grid; stops starting new shapes once ``budget_s`` seconds have passed."""
  if interpret:
    lengths, tokens, width, dims = (128, 256), 256, 128, (64,)
  elif quick:
    lengths, tokens, width, dims = (2048, 8192), 32768, 2048, (64, 128)
  else:
    lengths, tokens, width, dims = (1024, 2048, 4096, 8192, 16384, 32768), 32768, 2048, (64, 128)
  start, results = time.perf_counter(), []
  print(f"\n== timing, bfloat16, batch * length = {tokens}, heads * head_dim = {width} (TFLOP/s; ms in --json)")
  header = f"  {'mask':13s} {'D':>3s} {'B':>3s} {'L':>6s} {'H':>3s} {'mode':8s}" + "".join(f"{i:>9s}" for i in IMPLS)
  print(header + f"{'ours/bundled':>14s}{'ours/cudnn':>12s}")
  ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"
  # Longest-first after 4k, so that a spent budget drops the short, least telling shapes.
  for length in sorted(lengths, key=lambda n: (n != 4096, -n)):
    for dim in dims:
      for causal in (False, True):
        if time.perf_counter() - start > budget_s:
          print(f"  -- time budget of {budget_s:.0f}s spent: skipping D={dim} causal={causal} L={length}")
          continue
        batch, heads = max(1, tokens // length), width // dim
        q, k, v, do = (_random((batch, length, heads, dim), jnp.bfloat16, s) for s in range(4))
        rows = {}
        for impl in IMPLS:
          if impl == "xla" and length > xla_max_len:
            rows[impl] = [
              {"impl": impl, "mode": m, "tflops": None, "note": f"skipped: L > {xla_max_len=}"}
              for m in ("fwd", "fwd+bwd")
            ]
            continue
          rows[impl] = _measure(impl, (q, k, v, do), causal, interpret=interpret)
          results += rows[impl]
        for m, mode in enumerate(("fwd", "fwd+bwd")):
          cells = [rows[i][m]["tflops"] for i in IMPLS]
          print(
            f"  {'causal' if causal else 'bidirectional':13s} {dim:3d} {batch:3d} {length:6d} {heads:3d} "
            f"{mode:8s}"
            + "".join(f"{c:9.3g}" if c else f"{'skip':>9s}" for c in cells)
            + f"{ratio(cells[0], cells[1]):>14s}{ratio(cells[0], cells[2]):>12s}",
            flush=True,
          )
        for impl in IMPLS:
          for record in rows[impl]:
            if record.get("note"):
              print(f"      note: {impl} {record['mode']}: {record['note']}")
        del q, k, v, do
  if sweep:
    length = 256 if interpret else 8192
    print(f"\n== BlockSizes sweep for our kernel: causal, L={length}, bfloat16 (TFLOP/s fwd, fwd+bwd)")
    for dim in dims:
      batch, heads = max(1, tokens // length), width // dim
      q, k, v, do = (_random((batch, length, heads, dim), jnp.bfloat16, s) for s in range(4))
      for blocks in [fa.BlockSizes.get_default(dim)] + SWEEP[dim]:
        records = _measure("ours", (q, k, v, do), True, interpret=interpret, block_sizes=blocks)
        for r in records:
          r["block_sizes"] = str(blocks)
        results += records
        cells = " ".join(f"{r['tflops']:9.3g}" if r["tflops"] else f"skip ({r['note'][:60]})" for r in records)
        print(f"  D={dim} {_short(blocks)}: {cells}", flush=True)
  return results


def run_cached(interpret: bool, page_size: int = 16) -> list[dict]:
  """Times ``attend_cached`` for decoding chunks (1 token: the twin; a block of 8: block diffusion) over caches of
  several lengths, dense and paged, Pallas and XLA; each row's chunk starts at a random slot in the cache's second
  half (its cache filled up to there), its pages shuffled over a pool that holds every row's."""
  if interpret:
    grid, heads, kv_heads, dim = [(2, 1, 64), (2, 8, 64)], 4, 2, 64
  else:
    grid = [(64, chunk, slots) for chunk in (1, 8) for slots in (2048, 16384)]
    heads, kv_heads, dim = 8, 2, 128
  print(f"\n== cached attention, bfloat16, heads {heads}, kv heads {kv_heads}, head_dim {dim}, pages of {page_size}")
  names = ("pallas dense", "pallas paged", "xla dense", "xla paged")
  print("  rows chunk  slots   " + "".join(f"{n:>16s}" for n in names))
  rng, results = np.random.default_rng(0), []
  for rows, chunk, slots in grid:
    mask, block = ("causal", None) if chunk == 1 else ("block_causal", chunk)
    q = _random((rows, chunk, heads, dim), jnp.bfloat16, 0)
    k, v = (_random((rows, chunk, kv_heads, dim), jnp.bfloat16, s) for s in (1, 2))
    cache_k, cache_v = (_random((rows, slots, kv_heads, dim), jnp.bfloat16, s) for s in (3, 4))
    starts = (rng.integers(slots // 2, slots - chunk, rows) // chunk * chunk).astype(np.int32)
    cache_segments = jnp.asarray(np.arange(slots)[None, :] < starts[:, None], jnp.int32)
    segments = jnp.ones((rows, chunk), jnp.int32)
    per_row = slots // page_size
    table = rng.permutation(np.arange(1, 1 + rows * per_row)).reshape(rows, per_row).astype(np.int32)
    pool_k, pool_v = (  # PagedKVCache's pages: [pages, kv_heads, page_size, head_dim]
      jnp.zeros((1 + rows * per_row, kv_heads, page_size, dim), jnp.bfloat16)
      .at[table.reshape(-1)]
      .set(x.reshape(rows * per_row, page_size, kv_heads, dim).swapaxes(1, 2))
      for x in (cache_k, cache_v)
    )
    table = jnp.asarray(table)
    assert bool(jnp.all(read_pages(pool_k, table, slots) == cache_k))
    visible = 2 * float(starts.sum()) * kv_heads * dim * 2  # bytes of keys and values each row's chunk can see
    cells = []
    for impl, paged in (("pallas", False), ("pallas", True), ("xla", False), ("xla", True)):
      record = {"check": "cached", "impl": impl, "paged": paged, "rows": rows, "chunk": chunk, "slots": slots}
      try:
        fn = jax.jit(
          functools.partial(
            attention.attend_cached, mask=mask, diffusion_block=block, implementation=impl,
            table=table if paged else None,
          )
        )  # fmt: skip
        caches = (pool_k, pool_v) if paged else (cache_k, cache_v)
        inputs = attention.CachedInputs(q, k, v, segments, *caches, cache_segments, jnp.asarray(starts))
        _, seconds = _time(fn, (inputs,), reps=20)
        record.update(us=seconds * 1e6, gbps=visible / seconds / 1e9)
        cells.append(f"{seconds * 1e6:8.1f} us {visible / seconds / 1e9:5.0f}G")
      except Exception as e:  # noqa: BLE001 - report and go on
        record["note"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        cells.append(f"{'ERROR':>16s}")
      results.append(record)
    print(f"  {rows:4d} {chunk:5d} {slots:6d}   " + "".join(f"{c:>16s}" for c in cells), flush=True)
    for r in results[-4:]:
      if r.get("note"):
        print(f"      note: {r['impl']} paged={r['paged']}: {r['note']}")
  return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--quick", action="store_true", help="a short grid (and fewer correctness combinations)")
  parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode with tiny shapes (any host)")
  parser.add_argument("--json", type=Path, help="write every check and timing to this file")
  parser.add_argument("--skip-correctness", action="store_true")
  parser.add_argument("--skip-timing", action="store_true")
  parser.add_argument("--sweep", action="store_true", help="also time alternative BlockSizes for our kernel")
  parser.add_argument("--cached", action="store_true", help="also time attention over a dense and a paged cache")
  parser.add_argument("--budget-s", type=float, default=240.0, help="start no new timing shape after this long")
  parser.add_argument("--xla-max-len", type=int, default=8192, help="XLA materialises L^2 scores: skip longer L")


def run_gpu_attention(args: argparse.Namespace) -> int:
  """GPU: the Pallas flash attention against XLA, cuDNN and JAX's kernel.

  Part 1 checks the kernel (forward and gradients) and attend()'s GPU paths against the float32 reference; part 2
  times forward and forward+backward over lengths 1k-32k; --cached times attention over a dense and a paged cache.
  Exits 1 when a check fails, 2 without a GPU (--interpret runs tiny shapes on any host).
  """
  backend = jax.default_backend()
  print(f"jax {jax.__version__}, backend {backend}, devices {jax.devices()}")
  if backend != "gpu" and not args.interpret:
    print("no GPU: pass --interpret (with --quick) to exercise the script on this host", file=sys.stderr)
    return 2
  report = {"jax": jax.__version__, "device": str(jax.devices()[0]), "argv": sys.argv[1:]}  # the command's flags
  if not args.skip_correctness:
    report["correctness"] = check_correctness(args.interpret, args.quick)
  if not args.skip_timing:
    report["timing"] = run_grid(args.interpret, args.quick, args.budget_s, args.xla_max_len, args.sweep)
  if args.cached:
    report["cached"] = run_cached(args.interpret)
  failed = [c for c in report.get("correctness", []) if not c["pass"]]
  print(f"\ncorrectness: {'FAIL' if failed else 'PASS'} ({len(failed)} of {len(report.get('correctness', []))} failed)")
  if args.json:
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
  return 1 if failed else 0


COMMANDS = {"gpu-attention": (add_arguments, run_gpu_attention)}
