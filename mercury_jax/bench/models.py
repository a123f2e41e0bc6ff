"""The benchmark's models: a :class:`~mercury_jax.sampling.sampler.Sampler` per checkpoint and the one tokenizer
they share, which encodes the prompts and decodes every completion.

Two ways to get that tokenizer:

* ``--data DATA_DIR``: the sentencepiece tokenizer of the prepared data both models were trained on (this project's
  own models). A checkpoint that carries a tokenizer of its own must carry that one.
* no ``--data``: each checkpoint's own tokenizer (a converted public checkpoint's ``tokenizer.json``, a train
  workdir's ``tokenizer.model``), and they must be one tokenizer (:func:`tokenizer_difference`). Each model keeps
  its own special ids (its mask, EOS and padding): a diffusion model and the autoregressive model it was adapted
  from share the text vocabulary but not the mask token.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from mercury_jax.checkpoint import restore_params
from mercury_jax.data import pipeline
from mercury_jax.data.hf_files import TOKENIZER_JSON
from mercury_jax.data.hf_tokenizer import HFTokenizer
from mercury_jax.data.tokenizer import TextTokenizer, load_tokenizer
from mercury_jax.sampling.sampler import Sampler, check_compatible, is_autoregressive


def _tokenizer_json(tokenizer: HFTokenizer) -> tuple[dict, dict[int, dict]]:
  """``(tokenizer.json without its added tokens, added tokens by id)``, as the ``tokenizers`` library writes it
  (so two files that differ only in how an older library spelled them compare equal)."""
  spec = json.loads(tokenizers.Tokenizer.from_str(tokenizer.tokenizer_json).to_str())
  return spec, {int(t["id"]): t for t in spec.pop("added_tokens", None) or ()}


def tokenizer_difference(a: TextTokenizer, b: TextTokenizer) -> str | None:
  """None when ``a`` and ``b`` are one tokenizer for the benchmark, else what differs (a few words).

  Two sentencepiece tokenizers must be the same model. Two ``tokenizer.json`` ones must have the same vocabulary,
  merges and text pipeline, and the added tokens both have must be equal; an added token only one has (the
  diffusion model's mask, which its authors added after the parent's ids) must be new to the other, in text and id.
  Then every prompt encodes to the same ids and every id decodes to the same text, whichever of the two does it
  (but for the text of a token only one has). Special ids (EOS, padding, the mask) may differ: each model uses its
  own.
  """
  if isinstance(a, HFTokenizer) != isinstance(b, HFTokenizer):
    return f"one is a sentencepiece tokenizer.model, the other a Hugging Face {TOKENIZER_JSON}"
  if not isinstance(a, HFTokenizer):
    return None if a.to_bytes() == b.to_bytes() else "their sentencepiece models differ"
  (spec_a, added_a), (spec_b, added_b) = _tokenizer_json(a), _tokenizer_json(b)
  for key in sorted(set(spec_a) | set(spec_b)):
    if spec_a.get(key) != spec_b.get(key):
      return f"their {TOKENIZER_JSON} {'vocabulary or merges' if key == 'model' else repr(key)} differ"
  for token_id in sorted(set(added_a) & set(added_b)):
    if added_a[token_id] != added_b[token_id]:
      return f"added token {token_id} is {added_a[token_id]['content']!r} in one, {added_b[token_id]['content']!r}"
  vocab = spec_a["model"].get("vocab") or {}  # The same in both by now: a dict (BPE) or a list (unigram).
  pieces = dict(vocab) if isinstance(vocab, dict) else {entry[0]: i for i, entry in enumerate(vocab)}
  piece_ids = set(pieces.values())
  for mine, other in ((added_a, added_b), (added_b, added_a)):
    texts = {*pieces, *(t["content"] for t in other.values())}
    for token_id in sorted(set(mine) - set(other)):
      content = mine[token_id]["content"]
      if content in texts or token_id in piece_ids:
        return f"added token {content!r} (id {token_id}) of one is a token of the other"
  return None


def _tokenizers(
  models: list[tuple[str, str, str]], data_dir: str | None
) -> tuple[TextTokenizer, dict[str, TextTokenizer]]:
  """``(the benchmark's tokenizer, each model's)`` for ``(model, flag, path)`` triples (see the module docstring).

  Raises:
    ValueError: A checkpoint's tokenizer is not --data's, a checkpoint has none without --data, or two differ.
  """
  own: dict[str, TextTokenizer | None] = {}
  for model, _, path in models:
    try:
      own[model] = load_tokenizer(path)
    except FileNotFoundError:
      own[model] = None
  if data_dir is not None:
    shared = pipeline.load_data_tokenizer(data_dir)
    for model, flag, path in models:
      if isinstance(own[model], HFTokenizer):
        raise ValueError(
          f"{flag} {path!r} carries its own tokenizer ({TOKENIZER_JSON}), not the sentencepiece one of --data "
          f"{data_dir!r}: leave out --data and name the prompts' corpus with --corpus"
        )
      if own[model] is not None and own[model].to_bytes() != shared.to_bytes():
        raise ValueError(f"{flag} {path!r} was trained with another tokenizer than the one in --data {data_dir!r}")
    return shared, {model: shared for model, _, _ in models}
  for model, flag, path in models:
    if own[model] is None:
      raise ValueError(f"{flag} {path!r} carries no tokenizer; pass --data DATA_DIR (the data it was trained on)")
  (first, first_flag, first_path), *others = models
  for model, flag, path in others:
    difference = tokenizer_difference(own[first], own[model])
    if difference:
      raise ValueError(
        f"{first_flag} {first_path!r} and {flag} {path!r} have different tokenizers ({difference}); the bench needs "
        "one tokenizer for all its models"
      )
  return own[first], own


def load_models(
  diffusion_dir: str | None, ar_dir: str, data_dir: str | None, verified_dir: str | None = None
) -> tuple[TextTokenizer, dict[str, Sampler]]:
  """The benchmark's tokenizer and a :class:`Sampler` of each model given (``"diffusion"``, ``"autoregressive"``,
  ``"verified"``), each with its own tokenizer (see the module docstring).

  Args:
    diffusion_dir: The diffusion checkpoint, or None.
    ar_dir: The autoregressive checkpoint.
    data_dir: A prepared data directory whose tokenizer every model uses, or None: the checkpoints' own tokenizers.
    verified_dir: A verified checkpoint, or None.

  Raises:
    ValueError: A path is missing, a checkpoint is of the wrong kind, the tokenizers differ or a checkpoint has none,
      or a model does not fit its tokenizer (:func:`~mercury_jax.sampling.sampler.check_compatible`).
  """
  models = [
    (model, flag, path)
    for model, flag, path in (
      ("diffusion", "--diffusion", diffusion_dir),
      ("autoregressive", "--autoregressive", ar_dir),
      ("verified", "--verified", verified_dir),
    )
    if path is not None
  ]
  for _, flag, path in models:
    if not Path(path).exists():
      raise ValueError(f"{flag} {path!r} does not exist; give a train workdir or exported checkpoint")
  shared, tokenizer_of = _tokenizers(models, data_dir)
  samplers: dict[str, Sampler] = {}
  for model, flag, path in models:
    try:
      params, cfg = restore_params(path)
    except FileNotFoundError as e:
      raise ValueError(f"{flag}: {e}") from None
    if (cfg.objective.name == "verified") != (model == "verified"):
      raise ValueError(f"{flag} {path!r} is a {cfg.objective.name} checkpoint; a verified one goes to --verified only")
    if model != "verified" and is_autoregressive(cfg) != (model == "autoregressive"):
      other = "--autoregressive" if flag == "--diffusion" else "--diffusion"
      raise ValueError(f"{flag} {path!r} is a {cfg.objective.name} checkpoint; pass it as {other}")
    try:
      check_compatible(cfg, tokenizer_of[model])
    except ValueError as e:
      raise ValueError(f"{flag} {path!r}: {e}") from None
    samplers[model] = Sampler(params, cfg, tokenizer_of[model])
  return shared, samplers
