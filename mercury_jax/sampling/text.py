"""Text to canvases and back: what ``Sampler.generate`` and ``stream`` are asked (:class:`Request`), the token-level
rows they build from it (:class:`Row`, :func:`build_rows`; the server builds the same rows), what they give back
(:class:`Sample`, :class:`StreamEvent`, :func:`frames`), and the one incremental detokeniser of the library's streams
and the server's answers (:class:`Detokenizer`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from mercury_jax import kinds as K
from mercury_jax.data.tokenizer import Tokenizer
from mercury_jax.sampling import canvas as cv, healing
from mercury_jax.sampling.proposal import Knobs

if TYPE_CHECKING:  # The host half of structured output loads on first use (outlines-core, jsonschema).
  from mercury_jax.constrain.automaton import Automaton

MASK_TEXT = "░"  # How an undecided position looks in a step-by-step trace and in a draft.


@dataclasses.dataclass
class Request:
  """What to generate (``Sampler.generate``'s arguments; see there).

  ``steps`` is the refinement budget for the generated length, ``steps_per_block`` the engine's steps per block
  (give at most one; neither: one token per step).
  """

  prompts: str | Sequence[str] | None = None
  template: str | None = None
  length: int = 64
  steps: int | None = None
  steps_per_block: int | None = None
  seed: int = 0
  num_samples: int = 1
  streams: Sequence[int] | None = None
  show_steps: bool = False
  bos: bool = False
  per_process: bool = False
  cache: str = "auto"
  token_healing: bool = True
  knobs: dict = dataclasses.field(default_factory=dict)  # ``SamplerSettings`` fields


@dataclasses.dataclass(frozen=True)
class Row:
  """One completion to generate, in tokens: what the library and the server both hand the engine.

  Attributes:
    pieces: The canvas: token ids (tuples, fixed text) and :class:`~mercury_jax.sampling.canvas.Hole` s (positions
      to generate), in order; a completion is ``(prompt, Hole(max_tokens), suffix)``.
    knobs: Temperature, top-k, top-p and the threshold rule's bar (traced per row, so no value recompiles); None:
      the engine's defaults.
    steps_per_block: Refinement steps each block of the holes gets (>= 1); None: the engine's default.
    extra_steps: The first ``extra_steps`` blocks take one step more (the rest of a total budget).
    seed: The PRNG seed.
    stream: The random stream within the seed: the row draws from ``fold_in(key(seed), stream)``.
    constraint: The hole's text must be accepted by it (structured output; the canvas has one hole).
    heal: Token healing: the first hole's first token starts with these characters (the prompt's backed-off end).
  """

  pieces: tuple
  knobs: Knobs | None = None
  steps_per_block: int | None = None
  extra_steps: int = 0
  seed: int = 0
  stream: int = 0
  constraint: Automaton | None = None
  heal: str = ""

  @classmethod
  def completion(cls, prompt, max_tokens: int, suffix=(), knobs=None, steps_per_block=None, **fields) -> Row:
    """``prompt``, a hole of ``max_tokens`` positions, then ``suffix`` (token ids): an HTTP completion's row."""
    pieces = (tuple(prompt), cv.Hole(max_tokens)) + ((tuple(suffix),) if len(suffix) else ())
    return cls(pieces, knobs, steps_per_block, **fields)

  @property
  def prompt(self) -> tuple[int, ...]:
    """The tokens before the first hole."""
    return tuple(self.pieces[0]) if self.pieces and not isinstance(self.pieces[0], cv.Hole) else ()

  @property
  def max_tokens(self) -> int:
    """The positions of the first hole (a completion's generated tokens)."""
    return next((p.length for p in self.pieces if isinstance(p, cv.Hole)), 0)

  @property
  def suffix(self) -> tuple[int, ...]:
    """The tokens after the first hole (a completion's suffix; fill in the middle)."""
    holes = [i for i, p in enumerate(self.pieces) if isinstance(p, cv.Hole)]
    after = self.pieces[holes[0] + 1 :] if holes else ()
    return tuple(t for piece in after if not isinstance(piece, cv.Hole) for t in piece)

  @property
  def positions(self) -> int:
    """The canvas's positions: its tokens and its holes."""
    return sum(p.length if isinstance(p, cv.Hole) else len(p) for p in self.pieces)


@dataclasses.dataclass
class Rows:
  """The rows of a library request (one per sample), with what its answer shows of each."""

  rows: list[Row]
  prompts: list[str]  # the prompt of each row
  prompt_lengths: list[int]  # its tokens (after token healing's back-off)

  @property
  def healed(self) -> list[str]:
    """The characters token healing backed off each row's prompt ("" for none)."""
    return [row.heal for row in self.rows]


@dataclasses.dataclass
class Sample:
  """One generated sample.

  Attributes:
    prompt: The prompt text ("" for a template alone).
    text: The completion after the prompt: generated text, with a template's fixed text in place.
    tokens: Token ids of that completion (padding dropped).
    nfe: Forward passes this sample needed.
    wall_time: Seconds the batch it belongs to took (compilation excluded).
    tokens_per_s: Generated tokens of the whole batch (with ``per_process``: of this process's rows) per second of
      ``wall_time``.
    tokens_per_forward: Generated tokens of this sample per forward pass it needed (TPF, ``len(tokens) / nfe``).
    compile_time: Seconds spent compiling for this batch (0 when a compilation was reused).
    steps: With ``show_steps``, the canvas text after each refinement step (autoregressive: after each generated
      token), undecided positions as ``MASK_TEXT``.
    complete: With a ``constraint``: whether the text is a whole sentence of it (False: ``length`` ran out first and
      the text is a valid prefix); None without one.
    healed: The prompt's last characters that token healing re-generated ("" when none): ``tokens`` starts with
      their token, ``text`` does not repeat them.
    accepted: Verified decoding: the steps that accepted 0, 1, ..., k - 1 drafts (None for the other modes); a
      step commits its accepted drafts and one token of the network's own.
  """

  prompt: str
  text: str
  tokens: list[int]
  nfe: int
  wall_time: float
  tokens_per_s: float
  compile_time: float = 0.0
  steps: list[str] | None = None
  tokens_per_forward: float = 0.0
  complete: bool | None = None
  healed: str = ""
  accepted: list[int] | None = None


@dataclasses.dataclass
class StreamEvent:
  """One update of ``Sampler.stream``.

  Attributes:
    index: The sample (its index in ``generate``'s output).
    text: Text committed since this sample's previous event ("" when only the draft changed).
    draft: With ``drafts``: the sample's whole completion now, committed tokens plus the current proposals, later
      undecided positions as ``MASK_TEXT``; None otherwise and in the last event.
    done: This is the sample's last event.
    nfe: Forward passes the sample has needed so far.
  """

  index: int
  text: str
  draft: str | None
  done: bool
  nfe: int


def build_rows(
  request: Request, tokenizer: Tokenizer, *, max_length: int, autoregressive: bool, heal: bool
) -> tuple[Rows, list | None]:
  """The rows of ``request`` (``num_samples`` per prompt) and the template's pieces (None in prompt mode).

  ``heal``: back off each prompt's last token where token healing applies (prompt mode only).

  Raises:
    ValueError: An empty prompt without a template, a template without holes, a bad length or sample count, or a
      canvas beyond ``max_length``.
  """
  prompts = request.prompts
  if isinstance(prompts, str):
    prompts = [prompts]
  elif request.per_process and prompts is not None:
    prompts = list(prompts)  # This process may have none.
  else:
    prompts = list(prompts or ([""] if request.template is not None else []))
    if not prompts:
      raise ValueError("give a prompt or a template")
  if request.num_samples < 1:
    raise ValueError(f"num_samples={request.num_samples} must be >= 1")
  if request.template is None and request.length < 1:
    raise ValueError(f"length={request.length} must be >= 1")
  tail = cv.parse_template(request.template, tokenizer.encode) if request.template is not None else None
  heal = heal and tail is None
  rows = Rows([], [], [])
  for i, prompt in enumerate(prompts):
    if not prompt and tail is None:
      raise ValueError(f"prompt {i} is empty; give text to continue, or a template with <mask:N> holes")
    ids = ([tokenizer.bos_id] if request.bos else []) + tokenizer.encode(prompt)
    if autoregressive and not ids and (tail is None or isinstance(tail[0], cv.Hole)):
      ids = [tokenizer.bos_id]  # The decoder needs a known first token.
    pieces = [ids, *tail] if tail is not None else cv.prefix(ids, request.length)
    size = sum(p.length if isinstance(p, cv.Hole) else len(p) for p in pieces)
    if size > max_length:
      what = "the template" if tail is not None else f"length={request.length}"
      raise ValueError(
        f"prompt {i} ({len(ids)} tokens) plus {what} needs {size} positions but the model's context is "
        f"{max_length} tokens"
      )
    removed = ""
    if heal:
      kept, removed = healing.back_off(tokenizer, prompt, ids)
      if removed and not healing.healable(tokenizer, removed):  # No token writes it (half a character): as is.
        kept, removed = ids, ""
      if removed:  # The same positions, one more of them generated.
        ids, pieces = kept, cv.prefix(kept, request.length + 1)
    rows.rows += [Row(tuple(pieces), heal=removed, seed=request.seed)] * request.num_samples
    rows.prompts += [prompt] * request.num_samples
    rows.prompt_lengths += [len(ids)] * request.num_samples
  return rows, tail


def frames(tokenizer: Tokenizer, out, kinds: np.ndarray, row: int, settings, autoregressive: bool):
  """The canvas text of one row after each step (diffusion) or each generated token (autoregressive)."""
  end = int((kinds[row] != K.PAD).sum())
  decode = lambda ids: tokenizer.decode(ids, mask_text=MASK_TEXT)  # noqa: E731
  if not autoregressive:
    count = int((out.commits[:, row] >= 0).sum())  # The engine marks frames past its last step with -1.
    return [decode(out.canvases[j, row, :end]) for j in range(count)]
  # The decoder commits one position per forward pass, left to right, and skips the rest of a hole after its EOS:
  # frame k shows the first k decided positions.
  final = out.tokens[row, :end]
  generate = kinds[row, :end] == K.TARGET
  skipped = np.asarray(cv.after_eos(final[None], generate[None], settings.eos_id))[0] if settings.eos_to_pad else None
  positions = np.flatnonzero(generate & (~skipped if skipped is not None else True))
  shown = []
  for k in range(1, len(positions)):
    canvas = final.copy()
    canvas[positions[k:]] = settings.mask_id
    shown.append(decode(canvas))
  return [*shown, decode(final)]


class Detokenizer:
  """The text of a growing list of token ids, one delta per :meth:`add`.

  Only a small window of ids is decoded per update, the way vLLM's incremental detokenizer keeps a prefix and a read
  offset: the text of ``ids[prefix:]`` minus the text of ``ids[prefix:read]`` is what the new ids add, in context (a
  piece's leading space, a character split over byte pieces). Replacement characters ``\\ufffd`` at the end of the
  text wait for the bytes that complete them; the text before them goes out at once.
  """

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self._ids: list[int] = []  # the ids from the prefix offset on
    self._read = 0  # ids before this one (in ``_ids``) are decoded and their text sent
    self._sent = 0  # characters of the newer ids' text sent already (before a character still incomplete)

  def add(self, ids, final: bool = False) -> str:
    """The text ``ids`` add (up to a character still incomplete at the end); ``final`` flushes whatever is left."""
    self._ids.extend(ids)
    if self._read == len(self._ids):
      return ""
    decode = self.tokenizer.decode
    before = decode(self._ids[: self._read]) if self._read else ""
    after = decode(self._ids)
    complete = after if final else after.rstrip("\ufffd")
    start = len(before) + self._sent
    if len(complete) <= start:
      return ""
    if len(complete) < len(after):  # The window stays: its last character is still to come.
      self._sent = len(complete) - len(before)
      return complete[start:]
    prefix = self._read  # The next window starts at the ids decoded now, for their context.
    self._ids, self._read, self._sent = self._ids[prefix:], len(self._ids) - prefix, 0
    return after[start:]
