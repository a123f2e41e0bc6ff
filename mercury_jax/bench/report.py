"""The benchmark's verdict and reports: matched quality, the headline speed-up, a Markdown table and plots.

Matched quality. The reference is the autoregressive twin sampling at temperature 1 with its key-value cache, at
the same batch size, on the same prompts. A diffusion setting *matches* it when, on its completions,

- generative perplexity (under the twin) <= (1 + ``ppl``) x the reference's,
- unigram entropy >= the reference's - ``entropy`` nats (a low perplexity from repetitive text does not count),
- parse rate >= the reference's - ``parse`` (absolute).

The headline is the fastest matching diffusion setting's speed-up over the reference: the median, over the
interleaved measurement rounds, of (its tokens/s ÷ the reference's tokens/s in the same round).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

REFERENCE_TEMPERATURE = 1.0
QUALITY_KEYS = ("gen_ppl", "unigram_entropy", "parse_rate")


@dataclasses.dataclass(frozen=True)
class Tolerances:
  """How much worse than the reference a matching diffusion setting may be (see the module docstring)."""

  ppl: float = 0.10
  entropy: float = 0.10
  parse: float = 0.05

  def describe(self) -> str:
    return (
      f"generative perplexity <= {1 + self.ppl:g} x the AR twin's (temperature 1, KV cache, same batch), "
      f"unigram entropy >= its value - {self.entropy:g} nats, parse rate >= its value - {self.parse:g}"
    )


def is_reference(row: dict[str, Any]) -> bool:
  return row["model"] == "autoregressive" and row["temperature"] == REFERENCE_TEMPERATURE


def matches(row: dict[str, Any], reference: dict[str, Any], tol: Tolerances) -> bool:
  """Whether a diffusion row's quality matches the reference row's (finite values only)."""
  if not all(math.isfinite(row[k]) and math.isfinite(reference[k]) for k in QUALITY_KEYS):
    return False
  return (
    row["gen_ppl"] <= (1.0 + tol.ppl) * reference["gen_ppl"]
    and row["unigram_entropy"] >= reference["unigram_entropy"] - tol.entropy
    and row["parse_rate"] >= reference["parse_rate"] - tol.parse
  )


def headlines(rows: list[dict[str, Any]], tol: Tolerances) -> list[dict[str, Any]]:
  """One verdict per batch size: the fastest matching diffusion setting and its speed-up over the reference."""
  verdicts = []
  for batch in sorted({r["batch"] for r in rows}):
    reference = next((r for r in rows if r["batch"] == batch and is_reference(r)), None)
    if reference is None:
      continue
    diffusion = [r for r in rows if r["batch"] == batch and r["model"] == "diffusion"]
    matched = [r for r in diffusion if matches(r, reference, tol)]
    best = max(matched, key=lambda r: r["speedup_vs_ar"], default=None)
    verdict = {
      "batch": batch,
      "reference": reference["name"],
      "ar_tokens_per_s": reference["tokens_per_s"],
      "ar_gen_ppl": reference["gen_ppl"],
      "matched": [r["name"] for r in matched],
      "setting": best["name"] if best else None,
      "speedup": best["speedup_vs_ar"] if best else None,
      "diffusion_tokens_per_s": best["tokens_per_s"] if best else None,
    }
    if best:
      verdict["text"] = (
        f"batch {batch}: {best['name']} gives {best['speedup_vs_ar']:.2f}x the AR twin's tokens/s at matched quality "
        f"(gen ppl {best['gen_ppl']:.1f} vs {reference['gen_ppl']:.1f}, entropy {best['unigram_entropy']:.2f} vs "
        f"{reference['unigram_entropy']:.2f}, parse rate {best['parse_rate']:.2f} vs {reference['parse_rate']:.2f})"
      )
    else:
      closest = min(diffusion, key=lambda r: r["gen_ppl"] if math.isfinite(r["gen_ppl"]) else math.inf, default=None)
      verdict["text"] = f"batch {batch}: no diffusion setting matches the AR twin's quality"
      if closest:
        verdict["text"] += (
          f"; the lowest generative perplexity, {closest['name']} ({closest['gen_ppl']:.1f} vs "
          f"{reference['gen_ppl']:.1f}), runs at {closest['speedup_vs_ar']:.2f}x its tokens/s"
        )
    verdicts.append(verdict)
  return verdicts


COLUMNS = (
  ("setting", "name", "{}"),
  ("batch", "batch", "{}"),
  ("tokens/s", "tokens_per_s", "{:.1f}"),
  ("× AR", "speedup_vs_ar", "{:.2f}"),
  ("× no cache", "speedup_vs_no_cache", "{:.2f}"),
  ("NFE", "nfe", "{:.1f}"),
  ("tokens/NFE", "tokens_per_forward", "{:.2f}"),
  ("p50 s", "latency_p50_s", "{:.3f}"),
  ("p95 s", "latency_p95_s", "{:.3f}"),
  ("compile s", "compile_s", "{:.1f}"),
  ("gen ppl", "gen_ppl", "{:.1f}"),
  ("entropy", "unigram_entropy", "{:.2f}"),
  ("distinct-2", "distinct_2", "{:.2f}"),
  ("distinct-3", "distinct_3", "{:.2f}"),
  ("parse", "parse_rate", "{:.2f}"),
  ("tokens", "mean_tokens", "{:.0f}"),
)


def markdown(result: dict[str, Any]) -> str:
  """The results as a Markdown document: set-up, the table, the matched-quality definition and the headline."""
  m, c, load = result["machine"], result["canvas"], result["load"]
  lines = [
    "# mercury_jax benchmark: diffusion vs autoregressive twin",
    "",
    f"{m['date']}; jax {m['jax']} on {m['backend']} ({m['device']}), {m['cpu_count']} CPUs "
    f"({m['cpu_affinity']} usable), load average at start {m['load_average'][0]:.2f}; matmul "
    f"{load['matmul_gflops_median']:.0f} GFLOP/s median over rounds (min {load['matmul_gflops_min']:.0f}, "
    f"max {load['matmul_gflops_max']:.0f}).",
    f"{c['prompts']} prompts from {c['prompt_source']}; generation length {c['length']} "
    f"({c['rule']}); canvas {c['canvas_length']} tokens; seed {c['seed']}; {c['repeats']} repeat(s), "
    "diffusion and AR calls interleaved round by round.",
    "",
    "| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
    "|" + "---|" * len(COLUMNS),
  ]
  for row in result["rows"]:
    cells = []
    for _, key, fmt in COLUMNS:
      value = row.get(key)
      cells.append(
        "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else fmt.format(value)
      )
    lines.append("| " + " | ".join(cells) + " |")
  lines += [
    "",
    "tokens/s: generated tokens (up to and including EOS) ÷ wall time of the timed calls; × AR: median over rounds "
    "of the per-round ratio to the AR twin at temperature 1 and the same batch; NFE: forward passes per example "
    "(AR: prefill + one per token); p50/p95: per call; compile: once per executable (the confidence rows share one).",
    "",
    f"**Matched quality**: {result['matched_quality']}.",
    "",
  ]
  lines += [f"**Headline** {v['text']}." for v in result["headline"]]
  overhead = result.get("overhead")
  if overhead:
    lines += [
      "",
      f"**Loop overhead** ({overhead['setting']}, batch of the first prompts, {overhead['cache']} cache, block "
      f"{overhead['block']}, {overhead['steps_per_block']} steps per block): wall {overhead['wall_s']:.4f} s ÷ "
      f"(prefill {overhead['prefill_s']:.4f} s + {overhead['first_passes']} first passes × "
      f"{overhead['first_pass_s'] * 1e3:.3f} ms + {overhead['other_passes']} other passes × "
      f"{overhead['pass_s'] * 1e3:.3f} ms) = "
      f"**{overhead['ratio']:.3f}**.",
    ]
  return "\n".join(lines) + "\n"


def plots(rows: list[dict[str, Any]], out_dir: Path) -> list[str] | str:
  """Quality vs tokens/s and quality vs NFE as PNGs; returns their file names, or a note when matplotlib is missing."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
  except ImportError:
    return "matplotlib is not installed (pip install -e '.[bench]'); plots skipped"
  names = []
  batches = sorted({r["batch"] for r in rows})
  temperatures = sorted({r["temperature"] for r in rows if r["model"] == "diffusion"}, reverse=True)
  panels = (("gen_ppl", "generative perplexity (AR twin)", True), ("unigram_entropy", "unigram entropy", False))
  panels += (("parse_rate", "parse rate", False),)
  for x_key, x_label, file in (
    ("tokens_per_s", "tokens/s", "quality_vs_speed.png"),
    ("nfe", "NFE", "quality_vs_nfe.png"),
  ):
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), constrained_layout=True)
    for ax, (y_key, y_label, log_y) in zip(axes, panels, strict=True):
      for b, batch in enumerate(batches):
        for t, temperature in enumerate(temperatures):  # One line per rule, temperature and batch.
          color = f"C{b * len(temperatures) + t}"
          at = "" if len(temperatures) == 1 else f" T={temperature:g}"
          for rule, style in (("confidence", "o-"), ("threshold", "s--"), ("ode", "d-.")):
            key = ("diffusion", batch, rule, temperature)
            group = [r for r in rows if (r["model"], r["batch"], r["rule"], r["temperature"]) == key]
            if group:
              group.sort(key=lambda r: r[x_key])
              xy = ([r[x_key] for r in group], [r[y_key] for r in group])
              ax.plot(*xy, style, color=color, label=f"{rule}{at}, batch {batch}")
        for r in (r for r in rows if r["batch"] == batch and r["model"] == "autoregressive"):
          marker = "X" if r["temperature"] == 0 else "*"
          color = f"C{b * len(temperatures)}"
          ax.plot([r[x_key]], [r[y_key]], marker, color=color, markersize=12, label=f"{r['name']}, batch {batch}")
      ax.set_xscale("log")
      ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
      ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
      ax.set_yscale("log" if log_y else "linear")
      ax.set_xlabel(x_label)
      ax.set_ylabel(y_label)
    axes[0].legend(fontsize=7)
    fig.savefig(out_dir / file, dpi=120)
    plt.close(fig)
    names.append(file)
  return names


def finite(value: Any) -> Any:
  """``value`` with NaN and infinities replaced by None, so the JSON is strict."""
  if isinstance(value, dict):
    return {k: finite(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [finite(v) for v in value]
  return None if isinstance(value, float) and not math.isfinite(value) else value
