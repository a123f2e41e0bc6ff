"""What any drafter can reach at T = 1: the verifier's own two-step-ahead marginal, measured on its own samples.

    python launch/t1_ceiling.py --checkpoint mercury_jax/assets/default --data DATA_DIR [--corpus python-stdlib] \
      [--prompts 32] [--length 64] [--positions 16] [--candidates 64] [--seed 0] [--temperature 1] [--json OUT]

A verified step commits the accepted drafts and one token the head draws itself (the bonus or the correction). The
next step's drafts come from the pre-draft block written in the same forward pass, whose first slot is that token's:
the drafter never sees it. So the first draft the next step verifies, at slot ``i + 1``, was predicted from ``x_{<i}``
alone, while the verifier accepts it against ``p(. | x_{<=i})`` (``mercury_jax.sampling.verify``). When sampling, no
drafter can do better on average than a function of ``x_{<i}``; the one the training objective aims at is the head's
exact two-step marginal ``m(y) = sum_c p(c | x_{<i}) p(y | x_{<i}, c)``. ``--temperature`` measures it at another
sampling temperature: the continuations, the head's and the drafter's distributions all tempered, as the engine's.

For the head's own T = 1 continuations (``--decode ar`` of the bench's prompts, as ``launch/tpf_curve.py`` chooses
them) this script takes ``--positions`` evenly spaced generated slots ``i`` per prompt and runs one verify chunk over
the exact cache of ``x_{<i}``: the root ``x_{i-1}``, the head's ``--candidates`` likeliest tokens ``c`` for slot ``i``
as its children (their next-token distributions ``p(. | x_{<i}, c)``) and one pre-draft block of ``k`` masks after the
root (the drafter's ``q`` at slots ``i`` and ``i + 1``, exactly as the engine's chunk computes them). It reports, as
means over the probes, with two standard errors:

* ``drafter``: ``sum_y min(p(y | x_{<=i}), q_{i+1}(y))``, the engine's first-draft acceptance with the drafter's chain
  (compare ``tpf_curve``'s acceptance at position 1);
* ``drafter_first_slot``: ``sum_y min(p(y | x_{<i}), q_i(y))``, the drafter against the head at the slot they share
  (one step ahead): how well the drafter matches the head where it could match it exactly;
* ``ideal``: ``sum_y min(p(y | x_{<=i}), m(y))`` with ``m`` summed over the candidates: a lower bound of the exact
  marginal's acceptance; ``ideal_upper`` adds the candidates' missing mass (``1 - sum_c p(c | x_{<i})``);
* ``ideal_top_N`` / ``drafter_top_N``: ``sum_{y in top N} p(y | x_{<=i})`` over ``m``'s (or ``q_{i+1}``'s) ``N``
  likeliest tokens: the acceptance of ``N`` deterministic candidates at that depth (a tree's alternatives; exact
  multi-candidate acceptance takes each with its probability under the residual);
* ``ideal_tree_N`` / ``drafter_tree_N``: a draft drawn from ``m`` (``q_{i+1}``), then ``N`` deterministic
  alternatives (its likeliest other tokens), as the engine's tree tries them at one depth (:func:`tree_acceptance`);
* ``head_top_1``: ``max_y p(y | x_{<=i})``, what even a drafter that knew ``x_i`` gets with one deterministic guess.

Tokens per forward with ``k - 1`` chain drafts are ``1 + a_1 + a_1 a_2 + ...``; the report adds ``1 + a + a^2 + ...``
for ``a`` = the ideal first-draft acceptance, an optimistic estimate (a deeper draft is a further-ahead marginal).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tpf_curve import bench_canvases  # launch/, first on sys.path when this script runs

from mercury_jax.bench.rounds import generated
from mercury_jax.kernels.masks import Tree
from mercury_jax.sampling.proposal import clean_logits
from mercury_jax.sampling.sampler import Sampler

TOPS = (1, 2, 4, 8)


def probe_positions(mask: np.ndarray, per_row: int) -> tuple[np.ndarray, np.ndarray]:
  """``(slots [per_row], valid [per_row])``: ``per_row`` evenly spaced generated slots of one row (``mask`` [length],
  its generated slots), each with a slot before it and a generated token at it; repeated and marked invalid when the
  row has fewer."""
  slots = np.flatnonzero(mask)
  slots = slots[slots >= 1]
  if not len(slots):
    return np.zeros(per_row, np.int32), np.zeros(per_row, bool)
  picked = slots[np.linspace(0, len(slots) - 1, per_row).round().astype(int)]
  valid = np.ones(per_row, bool)
  valid[1:] = picked[1:] != picked[:-1]  # a short row repeats slots: count each once
  return picked.astype(np.int32), valid


def build(sampler: Sampler, settings, candidates: int, temperature: float, draft_temperature: float):
  """The jitted probe of one row: ``(tokens [L], segments [L], slots [P]) -> per-probe statistics``, the head's
  distributions at ``temperature`` and the drafter's at ``draft_temperature``, as the engine tempers them."""
  net, params = sampler.network, sampler.params
  k = sampler.cfg.objective.draft_length
  mask_id = sampler.cfg.objective.mask_id
  tree = Tree((-1,) + (0,) * candidates, (0,), k)

  def dist(logits, t=temperature):  # the engine's distribution at ``t`` (excluded ids and the mask class removed)
    logits = clean_logits(logits, jnp.zeros(logits.shape[:-1], bool), settings)
    return jax.nn.softmax(logits / t, axis=-1)

  def probe(tokens, segments, slots):
    length = tokens.shape[0]
    positions = jnp.arange(length, dtype=jnp.int32)
    logits, kv = net.chunk(params, tokens[None], segments=segments[None], positions=positions[None], mask="causal")
    head = dist(logits[0])  # [L, vocab]: head[j] = p(. | x_{<=j})
    n = slots.shape[0]
    p_here = head[slots - 1]  # p(. | x_{<i}) [n, vocab]
    p_next = head[slots]  # p(. | x_{<=i}) [n, vocab]
    top_p, top_c = jax.lax.top_k(p_here, candidates)  # [n, K]
    root = tokens[slots - 1]
    chunk = jnp.concatenate([root[:, None], top_c, jnp.full((n, k), mask_id, jnp.int32)], axis=1)
    chunk_pos = jnp.concatenate(
      [(slots - 1)[:, None], jnp.broadcast_to(slots[:, None], (n, candidates)), slots[:, None] + jnp.arange(k)], 1
    )
    cache = jax.tree.map(lambda a: jnp.repeat(a, n, axis=1 if a.ndim == 5 else 0), kv)
    out, _ = net.chunk(
      params, chunk, segments=jnp.ones_like(chunk), positions=chunk_pos, mask="verify_chunk",
      diffusion_block=tree, cache=cache, starts=slots - 1,
    )  # fmt: skip
    children = dist(out[:, 1 : 1 + candidates])  # p(. | x_{<i}, c) [n, K, vocab]
    drafts = dist(out[:, 1 + candidates :], draft_temperature)  # q at slots i .. i + k - 1 [n, k, vocab]
    marginal = jnp.einsum("nk,nkv->nv", top_p, children)  # m over the candidates
    stats = {
      "drafter": jnp.minimum(p_next, drafts[:, 1]).sum(-1),
      "drafter_first_slot": jnp.minimum(p_here, drafts[:, 0]).sum(-1),
      "ideal": jnp.minimum(p_next, marginal).sum(-1),
      "missing_mass": 1.0 - top_p.sum(-1),
      "head_top_1": p_next.max(-1),
    }
    for name, source in (("ideal", marginal), ("drafter", drafts[:, 1])):
      _, order = jax.lax.top_k(source, max(TOPS) + 1)
      taken = jnp.cumsum(jnp.take_along_axis(p_next, order, axis=-1), axis=-1)
      for top in TOPS:
        stats[f"{name}_top_{top}"] = taken[:, top - 1]
        stats[f"{name}_tree_{top}"] = tree_acceptance(p_next, source, order, top)
    return stats

  return jax.jit(probe)


def tree_acceptance(p: jax.Array, q: jax.Array, order: jax.Array, alternatives: int) -> jax.Array:
  """Acceptance at one depth of a draft ``X ~ q`` tried first and then ``alternatives`` deterministic candidates,
  ``q``'s likeliest tokens other than ``X`` (the engine's tree: ``mercury_jax.sampling.verify``), against ``p``;
  ``[n]`` from ``p``, ``q`` ``[n, vocab]`` and ``order`` ``[n, >= alternatives + 1]`` (``q``'s likeliest first).

  ``X`` is accepted with ``sum min(p, q)``; after its rejection the residual ``r = norm(max(0, p - q))`` accepts each
  candidate with its probability (removed after a rejection), so the alternatives add ``sum_{c} r(c)`` over the set.
  The set is ``q``'s top ``N`` when ``X`` is not among them, else the top ``N + 1`` without ``X``: in expectation
  ``base + (1 - base) R_N + sum_{X in top N} (q - min(p, q))(X) (r(c_{N+1}) - r(X))``."""
  overlap = jnp.minimum(p, q)
  base = overlap.sum(-1)
  excess = jnp.maximum(p - q, 0.0)
  r = excess / jnp.maximum(excess.sum(-1, keepdims=True), 1e-30)
  r_top = jnp.take_along_axis(r, order, axis=-1)  # [n, >= N + 1]
  rejected = jnp.take_along_axis(q - overlap, order, axis=-1)  # q(X) - min(p, q)(X): X drawn and rejected
  r_n = r_top[:, :alternatives].sum(-1)
  swap = (rejected[:, :alternatives] * (r_top[:, alternatives : alternatives + 1] - r_top[:, :alternatives])).sum(-1)
  return base + (1.0 - base) * r_n + swap


def summarise(values: dict[str, list[np.ndarray]], k: int) -> dict:
  out = {}
  for name, parts in values.items():
    v = np.concatenate(parts)
    out[name] = {"mean": float(v.mean()), "two_se": float(2 * v.std(ddof=1) / np.sqrt(len(v)))}
  out["ideal_upper"] = {"mean": out["ideal"]["mean"] + out["missing_mass"]["mean"]}
  for name in ("drafter", "ideal", "ideal_upper"):
    a = out[name]["mean"]
    out[f"tpf_estimate_{name}"] = float(sum(a**d for d in range(k)))
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True, help="a verified checkpoint (an export or a workdir)")
  parser.add_argument("--data", required=True, help="the prepared corpus whose validation split holds the prompts")
  parser.add_argument("--corpus", default="python-stdlib")
  parser.add_argument("--prompts", type=int, default=32)
  parser.add_argument("--length", type=int, default=64, help="new tokens per prompt")
  parser.add_argument("--positions", type=int, default=16, help="probed slots per prompt")
  parser.add_argument("--candidates", type=int, default=64, help="the head's likeliest tokens summed into m")
  parser.add_argument("--batch", type=int, default=32, help="rows per decode")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--temperature", type=float, default=1.0, help="of the continuations and every distribution")
  parser.add_argument("--draft-temperature", type=float, help="the drafter's own (default: --temperature)")
  parser.add_argument("--json", help="write the report here")
  args = parser.parse_args()
  for name in ("prompts", "length", "positions", "candidates", "batch"):
    if not 1 <= getattr(args, name) <= 4096:
      parser.error(f"--{name}={getattr(args, name)} must be in [1, 4096]")
  for name in ("temperature", "draft_temperature"):
    value = getattr(args, name)
    if value is not None and not 0.05 <= value <= 4.0:
      parser.error(f"--{name.replace('_', '-')}={value} must be in [0.05, 4] (greedy has no ceiling)")

  sampler = Sampler.from_checkpoint(args.checkpoint)
  if sampler.cfg.objective.name != "verified":
    parser.error(f"--checkpoint {args.checkpoint} is a {sampler.cfg.objective.name!r} model; this needs a verified one")
  tokenizer = sampler.tokenizer
  canvases, found = bench_canvases(sampler, tokenizer, args.data, args.corpus, args.prompts, args.length, args.batch)
  settings = sampler.settings(temperature=args.temperature, top_p=1.0, top_k=0, decode="ar")
  draft_temperature = args.temperature if args.draft_temperature is None else args.draft_temperature
  probe = build(sampler, settings, args.candidates, args.temperature, draft_temperature)
  values: dict[str, list[np.ndarray]] = {}
  left = found
  for canvas in canvases:
    out, _, _ = sampler.run(canvas, None, args.seed, settings)
    rows = min(left, canvas.tokens.shape[0])
    left -= rows
    tokens = np.asarray(out.tokens)[:, : canvas.tokens.shape[1]]
    mask = generated(canvas, tokens, tokenizer.pad_id, rows)
    for r in range(rows):
      slots, valid = probe_positions(mask[r], args.positions)
      if not valid.any():
        continue
      segments = (np.asarray(canvas.kinds)[r] != 0) & (tokens[r] != tokenizer.pad_id)
      stats = probe(jnp.asarray(tokens[r]), jnp.asarray(segments, jnp.int32), jnp.asarray(slots))
      for name, v in stats.items():
        values.setdefault(name, []).append(np.asarray(v)[valid])
  report = {
    "checkpoint": args.checkpoint,
    "prompts": found,
    "probes": int(sum(len(v) for v in values["ideal"])),
    "length": args.length,
    "candidates": args.candidates,
    "seed": args.seed,
    "temperature": args.temperature,
    "draft_temperature": draft_temperature,
    **summarise(values, sampler.cfg.objective.draft_length),
  }
  print(json.dumps(report, indent=1))
  if args.json:
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
  main()
