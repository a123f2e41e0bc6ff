"""The benchmark's verified-decoding part: what the drafts buy and what a verify+draft forward costs.

A verified checkpoint (``--verified``) samples exactly its own next-token head's distribution, so its quality is that
head's by construction (its held-out bits/char come from ``python -m mercury_jax.evaluate``); what the benchmark
measures is speed:

* tokens per forward (TPF) and tokens/s ÷ the twin at the same temperature, from the interleaved rounds;
* acceptance by draft position: the share of steps whose ``i``-th draft was accepted (a step commits its accepted
  drafts and one token of the network's own, none past the hole's end or an EOS, so TPF is at most 1 + the sum of
  these shares);
* the cost of one verify+draft forward (the draft tree's whole chunk over the cache, ``k + k²`` tokens for TiDAR's
  chain) ÷ one twin step (one token), each on the final state of a generation
  (:func:`~mercury_jax.bench.overhead.engine_overhead`), timed in interleaved pairs (the median of their ratios).
  TPF ÷ that ratio is the speed-up any hardware can give; on a GPU, where a 20-token forward costs what a 1-token
  one does, the ratio approaches 1;
* the loop overhead: wall time ÷ (prefill + forward passes × that forward's cost).

The engine's levers (docs/results/verified.md; ``--levers``, :data:`LEVERS`) run as separate verified settings on the
same prompts, lengths and seeds, interleaved with the twin round by round: the drafter's chain alone (TiDAR's chunk, the
baseline), then the prompt-lookup chain, a wider draft tree (with pre-draft blocks after the chain's nodes, or after
every node), cheaper chunks (pre-draft blocks for the two likeliest outcomes only), the adaptive draft length, each
alone, and all together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mercury_jax.bench.overhead import engine_overhead
from mercury_jax.bench.throughput import median_seconds
from mercury_jax.sampling import canvas as cv
from mercury_jax.sampling.plan import Decoding
from mercury_jax.sampling.sampler import Sampler

SOURCES = ("chain", "alternatives", "lookup")  # where accepted candidates come from (``SampleOutput.sources``)
_OFF = {"draft_tree": "chain", "draft_lookup": 0, "draft_blocks": "all", "draft_confidence": 0.0}
# Each lever's verified-decoding knobs (``SamplerSettings``' draft fields), alone and together; ``auto`` is the
# device's default (``sampling.drafts.DEFAULTS``).
LEVERS = {
  "auto": {},
  "chain": _OFF,
  "lookup": {**_OFF, "draft_lookup": 8},
  "lookup-only": {**_OFF, "draft_tree": "none", "draft_lookup": 8, "draft_blocks": "none"},
  "tree": {**_OFF, "draft_tree": "wide"},
  "tree-blocks": {**_OFF, "draft_tree": "wide", "draft_blocks": "tree"},  # a pre-draft block after every node
  "alternatives": {**_OFF, "draft_tree": "1,2,3,4,5,6,7", "draft_blocks": "tree"},  # 8 first drafts, T = 1's best
  "cheap": {**_OFF, "draft_blocks": "0,1"},
  "adaptive": {**_OFF, "draft_confidence": 0.1},
  "lookup-cheap": {**_OFF, "draft_lookup": 8, "draft_blocks": "0,1"},  # the two that paid on a CPU, together
  "lookup4": {**_OFF, "draft_lookup": 4},  # a short lookup chain, every pre-draft block
  "lookup4-cheap": {**_OFF, "draft_lookup": 4, "draft_blocks": "0,1"},  # the same, blocks for two outcomes only
  "all": {"draft_tree": "wide", "draft_lookup": 8, "draft_blocks": "0,1", "draft_confidence": 0.1},
}


def acceptance(calls: list[dict[str, Any]]) -> dict[str, Any]:
  """Acceptance figures of one verified setting's calls (each carries ``accepted`` [rows, k], the steps that
  accepted 0 .. k - 1 drafts)."""
  histogram = np.sum([np.asarray(c["accepted"]).sum(axis=0) for c in calls], axis=0).astype(np.float64)  # [W]
  sources = np.zeros(3)
  for c in calls:
    if c.get("sources") is not None:
      sources += np.asarray(c["sources"]).sum(axis=0)
  steps = histogram.sum()
  at_least = histogram[::-1].cumsum()[::-1]  # steps that accepted >= i drafts, i = 0 .. k - 1
  by_position = (at_least[1:] / max(steps, 1.0)).tolist()  # draft i (1-based) accepted
  return {
    "steps": int(steps),
    "accepted_histogram": histogram.astype(int).tolist(),
    "accepted_by_position": by_position,  # = by depth of the draft tree
    "mean_accepted_per_step": float((histogram * np.arange(len(histogram))).sum() / max(steps, 1.0)),
    "one_outcome_tpf_estimate": one_outcome_tpf(histogram),
    # accepted candidates per step, by where they came from
    "accepted_by_source": dict(zip(SOURCES, (sources / max(steps, 1.0)).tolist(), strict=True)),
  }


def one_outcome_tpf(histogram) -> float:
  """Tokens per forward if a step pre-drafted only the outcome where every draft is accepted (a chunk of ``2 k``
  tokens instead of ``k + k²``), estimated from the histogram of accepted drafts measured with every outcome
  pre-drafted: a step with drafts accepts ``a`` and commits ``a + 1``, and keeps drafts for the next step only when
  ``a = k - 1``; a step without drafts commits 1 and drafts for the next. The stationary share of steps with drafts
  is ``1 / (2 - p_all)``."""
  histogram = np.asarray(histogram, np.float64)
  steps = histogram.sum()
  if steps == 0:
    return float("nan")
  share = histogram / steps
  p_all = share[-1]
  with_drafts = 1.0 / (2.0 - p_all)
  return float(with_drafts * (share * (np.arange(len(share)) + 1)).sum() + (1.0 - with_drafts) * 1.0)


def chunk_costs(sampler: Sampler, batch: int, lengths, *, repeats: int = 5, passes: int = 16) -> dict[int, float]:
  """Seconds of one forward pass of a causal chunk of each length over a half-full cache of the model's context
  (the attention mask does not change a dense pass's work), each timed alone in a ``fori_loop``."""
  net, slots = sampler.network, sampler.max_length
  cache = net.empty_cache(batch, slots)
  out = {}
  for length in lengths:
    tokens = jnp.full((batch, length), 5, jnp.int32)
    positions = jnp.broadcast_to(slots // 2 + jnp.arange(length, dtype=jnp.int32), (batch, length))
    segments = jnp.ones((batch, length), jnp.int32)

    def run(params, cache, tokens=tokens, positions=positions, segments=segments):
      def body(i, total):
        logits = net.chunk(
          params, tokens + i % 2, segments=segments, positions=positions, mask="causal", cache=cache,
          starts=jnp.full((batch,), slots // 2, jnp.int32), return_kv=False,
        )  # fmt: skip
        return total + logits[0, 0, 0]

      return jax.lax.fori_loop(0, passes, body, jnp.zeros((), jnp.float32))

    out[length] = median_seconds(jax.jit(run), sampler.params, cache, repeats=repeats) / passes
  return out


def costs(
  verified: Sampler, twin: Sampler, canvas: cv.Canvas, settings_v, settings_ar, memo=None, *, rounds: int = 9
) -> dict[str, Any]:
  """One verify+draft forward (the lever's whole chunk, every node live) ÷ one twin step, and each engine's overhead
  ratio, on the same canvas batch; and the cost of causal chunks of 1, ``2 k`` and ``k + k²`` tokens (a
  one-outcome chunk against the full one). The ratio is the median over ``rounds`` of one verify forward ÷ one twin
  step timed right after it (a shared host's capacity drifts). ``memo`` (a dict) keeps the twin's and the chunks'
  figures of a batch for the next lever's call."""
  memo = {} if memo is None else memo
  tree = verified.plan(Decoding.of(settings_v)).tree
  k, batch = tree.k, int(np.shape(canvas.tokens)[0])
  mine = engine_overhead(verified, canvas, None, settings_v, timer=True)
  if (batch, "twin") not in memo:
    memo[(batch, "twin")] = engine_overhead(twin, canvas, None, settings_ar, timer=True)
    memo[(batch, "chunks")] = chunk_costs(verified, batch, (1, 2 * k, k + k * k))
  theirs, chunks = memo[(batch, "twin")], memo[(batch, "chunks")]
  ratios = [mine["timer"]() / theirs["timer"]() for _ in range(rounds)]  # interleaved: the load cancels
  mine, theirs = ({key: v for key, v in d.items() if key != "timer"} for d in (mine, theirs))
  return {
    "chunk_s": {str(n): t for n, t in chunks.items()},
    "chunk_positions": tree.mask.size,
    "tree_nodes": tree.nodes,
    "batch": batch,
    "verify_forward_s": mine["pass_s"],
    "ar_forward_s": theirs["pass_s"],
    "cost_ratio": float(np.median(ratios)),  # the median of interleaved pairs
    "verified_overhead": mine["ratio"],
    "ar_overhead": theirs["ratio"],
    "verified_forwards": mine["forwards"],
  }


def markdown(summary: dict[str, Any]) -> list[str]:
  """Lines for ``results.md``."""
  lines = ["", "## Verified decoding", ""]
  lines.append(
    "Quality is exactly the network's own next-token head's (speculative sampling): the rows' gen ppl, entropy and "
    "parse differ from the twin's through the network, not through the sampler."
  )
  lines += levers_table(summary)
  lines += ["", "| setting | batch | TPF | mean accepted drafts per step | accepted by draft position |"]
  lines.append("|---|---|---|---|---|")
  for row in summary["rows"]:
    shares = ", ".join(f"{p:.2f}" for p in row["accepted_by_position"])
    lines.append(
      f"| {row['name']} | {row['batch']} | {row['tokens_per_forward']:.2f} | {row['mean_accepted_per_step']:.2f} | "
      f"{shares} |"
    )
  lines += [
    "",
    "Pre-drafting every outcome (chunk k + k²) against only the all-accepted one (chunk 2 k): the second's TPF is "
    "estimated from the first's histogram (`one_outcome_tpf`), the chunks' costs are measured:",
    "",
    "| setting | batch | TPF, every outcome | TPF, one outcome (est.) |",
    "|---|---|---|---|",
  ]
  for row in summary["rows"]:
    lines.append(
      f"| {row['name']} | {row['batch']} | {row['tokens_per_forward']:.2f} | {row['one_outcome_tpf_estimate']:.2f} |"
    )
  lines += ["", "| batch | causal chunk ms by length |", "|---|---|"]
  for cost in {c["batch"]: c for c in summary["costs"]}.values():  # one row a batch (its levers share the chunks)
    shown = ", ".join(f"{n}: {t * 1e3:.3f}" for n, t in cost["chunk_s"].items())
    lines.append(f"| {cost['batch']} | {shown} |")
  lines += ["", "| lever | batch | verify+draft forward ms | AR step ms | cost ratio | verified wall ÷ passes |"]
  lines.append("|---|---|---|---|---|---|")
  for cost in summary["costs"]:
    lines.append(
      f"| {cost.get('lever', 'auto')} | {cost['batch']} | {cost['verify_forward_s'] * 1e3:.3f} | "
      f"{cost['ar_forward_s'] * 1e3:.3f} | {cost['cost_ratio']:.2f} | {cost['verified_overhead']:.3f} |"
    )
  return lines


def levers_table(summary: dict[str, Any]) -> list[str]:
  """The levers side by side: per lever and batch, TPF and tokens/s ÷ twin at each temperature, acceptance by depth
  (at T = 1), the chunk's positions and its whole forward's cost ÷ one twin step."""
  cost = {(c.get("lever", "auto"), c["batch"]): c for c in summary["costs"]}
  rows: dict[tuple[str, int], dict[float, dict]] = {}
  for row in summary["rows"]:
    rows.setdefault((row.get("lever", "auto"), row["batch"]), {})[row["temperature"]] = row
  lines = ["", "| lever | knobs | batch | TPF greedy / T=1 | × twin greedy / T=1 | accepted by depth (T=1) | accepted "
           "per step from chain / alternatives / lookups (greedy; T=1) | chunk | chunk ÷ AR step |",
           "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
  for (lever, batch), by_t in rows.items():
    pair = lambda key, by_t=by_t: " / ".join(f"{by_t[t][key]:.2f}" if t in by_t else "–" for t in (0.0, 1.0))  # noqa: E731
    sampled = by_t.get(1.0, next(iter(by_t.values())))
    depth = ", ".join(f"{a:.2f}" for a in sampled["accepted_by_position"])
    knobs = ", ".join(f"{k.removeprefix('draft_')}={v}" for k, v in LEVERS.get(lever, {}).items()) or "device default"
    source = lambda t, by_t=by_t: (
      "/".join(f"{v:.2f}" for v in by_t[t]["accepted_by_source"].values()) if t in by_t else "–"
    )  # noqa: E731
    sources = f"{source(0.0)}; {source(1.0)}"
    c = cost.get((lever, batch))
    chunk, ratio = (c["chunk_positions"], f"{c['cost_ratio']:.2f}") if c else ("–", "–")
    lines.append(
      f"| {lever} | {knobs} | {batch} | {pair('tokens_per_forward')} | {pair('speedup_vs_ar')} | {depth} | {sources} | "
      f"{chunk} | {ratio} |"
    )
  return lines


def plot(summary: dict[str, Any], out_dir: Path) -> str | None:
  """``acceptance_by_position.png``: the share of steps whose i-th draft was accepted, one line per setting."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return None
  fig, ax = plt.subplots(figsize=(5, 4), constrained_layout=True)
  for row in summary["rows"]:
    shares = row["accepted_by_position"]
    ax.plot(range(1, len(shares) + 1), shares, "o-", label=f"{row['name']}, batch {row['batch']}")
  ax.set_xticks(range(1, 1 + max((len(r["accepted_by_position"]) for r in summary["rows"]), default=0)))
  ax.set_xlabel("draft position")
  ax.set_ylabel("share of steps that accepted it")
  ax.set_ylim(0, 1)
  ax.legend(fontsize=7)
  fig.savefig(out_dir / "acceptance_by_position.png", dpi=120)
  plt.close(fig)
  return "acceptance_by_position.png"
