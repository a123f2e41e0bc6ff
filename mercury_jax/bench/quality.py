"""Sample-quality metrics: generative perplexity under the autoregressive twin, with the diversity guard-rails.

Generative perplexity alone rewards repetitive text (a low-entropy sampler scores well), so it is always reported
with unigram entropy and distinct-n; for code, the parse rate adds an outside judge: Python's own parser.
"""

from __future__ import annotations

import ast
import functools
import math
from collections import Counter
from collections.abc import Sequence

import jax
import numpy as np

from mercury_jax import kinds as K
from mercury_jax.config import Config, ModelConfig
from mercury_jax.model import Transformer
from mercury_jax.objectives import autoregressive


def unigram_entropy(samples: Sequence[Sequence[int]]) -> float:
  """Mean over samples of the entropy (nats) of each sample's own token distribution (as MDLM reports it)."""
  values = []
  for tokens in samples:
    if not len(tokens):
      continue
    counts = np.array(list(Counter(tokens).values()), np.float64)
    p = counts / counts.sum()
    values.append(float(-(p * np.log(p)).sum()))
  return float(np.mean(values)) if values else 0.0


def distinct_n(samples: Sequence[Sequence[int]], n: int) -> float:
  """Unique n-grams ÷ all n-grams, pooled over the samples (1.0: no n-gram repeats; near 0: degenerate loops)."""
  grams = [tuple(tokens[i : i + n]) for tokens in samples for i in range(len(tokens) - n + 1)]
  return len(set(grams)) / len(grams) if grams else 0.0


def parses(prompt: str, completion: str) -> bool:
  """Whether ``prompt + completion`` parses once trimmed to its last complete statement.

  Trailing lines are dropped one at a time (a sample cut off mid-statement is not penalised), but never the
  prompt's own lines, and at least one completion line must remain: an empty or hopeless completion fails.
  """
  prompt_lines = prompt.count("\n")
  lines = (prompt + completion).split("\n")
  for cut in range(len(lines), prompt_lines, -1):
    candidate = "\n".join(lines[:cut])
    if not candidate[len(prompt) :].strip():
      break
    try:
      ast.parse(candidate)
    except (SyntaxError, ValueError):
      continue
    return True
  return False


def parse_rate(prompts: Sequence[str], completions: Sequence[str]) -> float:
  return float(np.mean([parses(p, c) for p, c in zip(prompts, completions, strict=True)])) if prompts else 0.0


@functools.cache
def _completion_nll(model_cfg: ModelConfig):
  """The jitted ``(params, tokens, kinds) -> (nll sum, scored tokens)`` of one AR model shape (compiled once)."""
  model = Transformer(model_cfg)

  @jax.jit
  def nll(params, tokens, kinds):
    segments = K.segment_ids(kinds)
    logits_fn = lambda x: model.apply({"params": params}, x, segment_ids=segments)  # noqa: E731
    out = autoregressive.loss(logits_fn, tokens, kinds)
    return out["loss_sum"], out["tokens"]

  return nll


def generative_perplexity(
  params, cfg: Config, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], batch_size: int = 16
) -> float:
  """exp(mean NLL of the completion tokens) under an autoregressive model, the prompt given as context.

  Prompt + completion are truncated to the model's context from the left (the completion is always kept whole when
  it fits) and right-padded; padding is never attended to or scored.
  """
  if not cfg.objective.autoregressive:
    raise ValueError("generative perplexity needs the autoregressive twin's checkpoint")
  length = cfg.model.max_length
  nll = _completion_nll(cfg.model)
  tokens = np.full((len(prompts), length), 0, np.int32)
  kinds = np.zeros((len(prompts), length), np.int32)
  for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
    sequence = (list(prompt) + list(completion))[-length:]
    n_prompt = max(len(sequence) - len(completion), 0)
    tokens[row, : len(sequence)] = sequence
    kinds[row, : len(sequence)] = K.TARGET
    kinds[row, :n_prompt] = K.FIXED

  total = count = 0.0
  for start in range(0, len(prompts), batch_size):
    chunk = slice(start, start + batch_size)
    pad = batch_size - tokens[chunk].shape[0]  # One compiled shape: pad the last batch with empty rows.
    loss, n = nll(params, np.pad(tokens[chunk], ((0, pad), (0, 0))), np.pad(kinds[chunk], ((0, pad), (0, 0))))
    total, count = total + float(loss), count + float(n)
  return math.exp(total / max(count, 1.0))
