"""The files of a converted public checkpoint's tokenizer: Hugging Face's own, and ``special_tokens.json``.

A converted checkpoint's folder holds (the converter copies the first two and writes the third with
:func:`write_special_tokens`):

* ``tokenizer.json``: the Hugging Face fast tokenizer.
* ``tokenizer_config.json`` (optional): read for its ``chat_template`` (a string, or a list of ``{"name",
  "template"}`` of which ``"default"`` is used) and for the texts of its ``bos_token``, ``eos_token``,
  ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token`` and ``mask_token`` (strings or ``{"content": ...}``),
  which a template sees as variables, as ``transformers`` passes them. A ``chat_template.jinja`` beside it wins over
  the config's ``chat_template``, as in ``transformers``.
* ``special_tokens.json`` (:data:`SPECIAL_TOKENS_FILE`), one JSON object::

    {"bos_id": int | null, "eos_id": int, "pad_id": int, "unk_id": int | null, "mask_id": int,
     "stop_ids": [int, ...], "add_bos": bool}

  ``mask_id`` is the diffusion mask (LLaDA 126336, Dream 151666, SDAR 151669, Fast-dLLM v2 151665); ``stop_ids``
  are the ids besides ``eos_id`` that end an answer (LLaDA's ``<|eot_id|>``, Qwen's ``<|im_end|>``); ``add_bos``
  says whether a chat prompt starts with the BOS id when its rendered template did not write BOS itself. ``bos_id``,
  ``unk_id``, ``stop_ids`` and ``add_bos`` may be left out (null, null, [], false); any other key is an error.

:class:`~mercury_jax.data.hf_tokenizer.HFTokenizer` reads them; ``mercury_jax.convert`` writes them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

SPECIAL_TOKENS_FILE = "special_tokens.json"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
  """The special ids of a converted checkpoint: the contents of ``special_tokens.json``.

  Attributes:
    eos_id: End of sequence (the engine's EOS).
    pad_id: Padding.
    mask_id: The diffusion mask.
    bos_id: Beginning of sequence, or None when the model has none.
    unk_id: Unknown, or None (byte-level BPE never needs it).
    stop_ids: Further ids that end an answer.
    add_bos: A chat prompt starts with ``bos_id`` when the rendered template did not write it.
  """

  eos_id: int
  pad_id: int
  mask_id: int
  bos_id: int | None = None
  unk_id: int | None = None
  stop_ids: tuple[int, ...] = ()
  add_bos: bool = False

  def __post_init__(self):
    for field in ("eos_id", "pad_id", "mask_id", "bos_id", "unk_id"):
      value = getattr(self, field)
      if value is None and field in ("bos_id", "unk_id"):
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{field}={value!r} must be a non-negative integer id")
    stops = tuple(self.stop_ids)
    if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in stops):
      raise ValueError(f"stop_ids={list(stops)!r} must be a list of non-negative integer ids")
    object.__setattr__(self, "stop_ids", stops)
    if not isinstance(self.add_bos, bool):
      raise ValueError(f"add_bos={self.add_bos!r} must be true or false")
    if self.add_bos and self.bos_id is None:
      raise ValueError("add_bos=true needs a bos_id")

  def to_json(self) -> dict:
    """The object ``special_tokens.json`` holds, keys in the documented order."""
    return {
      "bos_id": self.bos_id,
      "eos_id": self.eos_id,
      "pad_id": self.pad_id,
      "unk_id": self.unk_id,
      "mask_id": self.mask_id,
      "stop_ids": list(self.stop_ids),
      "add_bos": self.add_bos,
    }

  @classmethod
  def from_json(cls, data: Mapping, name: str = SPECIAL_TOKENS_FILE) -> SpecialTokens:
    """Reads the object of ``special_tokens.json``.

    Raises:
      ValueError: A required key is missing, a key is unknown, or a value has the wrong type (naming it).
    """
    if not isinstance(data, Mapping):
      raise ValueError(f"{name} must hold a JSON object, not {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
      raise ValueError(f"{name} has unknown key {unknown[0]!r}; the keys are {', '.join(sorted(known))}")
    missing = [key for key in ("eos_id", "pad_id", "mask_id") if key not in data]
    if missing:
      raise ValueError(f"{name} lacks {missing[0]!r}")
    try:
      return cls(**{**data, "stop_ids": tuple(data.get("stop_ids") or ())})
    except (ValueError, TypeError) as e:
      raise ValueError(f"{name}: {e}") from None


def write_special_tokens(directory: str | os.PathLike, special: SpecialTokens) -> Path:
  """Writes ``special_tokens.json`` into ``directory`` (the converter's call); returns its path."""
  path = Path(directory) / SPECIAL_TOKENS_FILE
  path.write_text(json.dumps(special.to_json(), indent=2) + "\n")
  return path


def read_chat_template(directory: str | os.PathLike) -> str | None:
  """The chat template of a Hugging Face tokenizer folder: ``chat_template.jinja``, else ``tokenizer_config.json``'s
  ``chat_template`` (a string, or the ``"default"`` entry of a list of ``{"name", "template"}``); None without one."""
  directory = Path(directory)
  if (directory / CHAT_TEMPLATE_FILE).is_file():
    return (directory / CHAT_TEMPLATE_FILE).read_text()
  config = read_json(directory / TOKENIZER_CONFIG) if (directory / TOKENIZER_CONFIG).is_file() else {}
  return _template_of(config.get("chat_template"))


def _template_of(value) -> str | None:
  if isinstance(value, str):
    return value or None
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
    return named.get("default") or None
  return None


def read_json(path: Path):
  """A JSON file's value, or a ValueError naming the file."""
  try:
    return json.loads(path.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"cannot read {str(path)!r}: {e}") from None
