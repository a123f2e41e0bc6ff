"""Which decoder a checkpoint runs, and the compiled engine programs (one cache of them, one style).

:func:`choose` maps a checkpoint and the ``cache`` / ``block_length`` a user asked for to the engine's cache and
block (:class:`Decoder`):

* block-diffusion checkpoints (``objective.block_size > 0``) and the autoregressive twin run the exact key-value
  cache (``auto`` / ``exact``) over their trained block (1 for the twin), or no cache (``none``, the reference the
  cache reproduces);
* whole-sequence diffusion checkpoints refine their whole canvas as one block without a cache (``auto`` / ``none``),
  or semi-autoregressive blocks of ``block_length`` tokens, or Fast-dLLM's approximate ``dual`` and ``prefix``
  caches over blocks of ``block_length`` tokens (default :data:`APPROXIMATE_BLOCK`).

:class:`Programs` compiles, once per (settings without the traced knobs, plan, batch, constraint capacity, healing),
the two programs every decode runs: the engine's ``init`` (prefill) and ``advance`` (the refinement loop).
"""

from __future__ import annotations

import dataclasses
import time

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mercury_jax import sharding as sh
from mercury_jax.config import Config
from mercury_jax.constrain import device as constrained
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.network import Network
from mercury_jax.sampling.plan import CACHES, BlockPlan
from mercury_jax.sampling.settings import SamplerSettings, SettingError

CACHE_CHOICES = ("auto", *CACHES)  # What ``generate(cache=...)`` and ``--cache`` accept: auto picks the best exact one.
# What ``generate(decode=...)``, ``--decode`` and the server's ``decode`` field accept: ``auto`` is the checkpoint's
# best (``verified`` for a verified checkpoint, ``ar`` for the twin, ``diffusion`` for every diffusion checkpoint).
DECODES = ("auto", "ar", "diffusion", "verified")
APPROXIMATE_BLOCK = 32  # Block of the approximate caches of whole-sequence checkpoints when block_length is 0.
LENGTH_BUCKET = 64  # Canvases are padded to a multiple of this, so varying prompt lengths share compilations.


@dataclasses.dataclass(frozen=True)
class Decoder:
  """The engine's cache and block for one checkpoint and request.

  Attributes:
    cache: One of :data:`~mercury_jax.sampling.plan.CACHES`.
    block: The block size; 0 for the whole canvas as one block (a whole-sequence checkpoint's refinement).
    autoregressive: Decode left to right with the network's next-token head (the twin, or a verified checkpoint's
      ``ar`` and ``verified`` modes).
    draft: Verified decoding's draft length (0: off).
    causal_context: The checkpoint's clean keys and values are causal (a verified checkpoint).
  """

  cache: str
  block: int
  autoregressive: bool = False
  draft: int = 0
  causal_context: bool = False

  @property
  def decode(self) -> str:
    """``ar``, ``diffusion`` or ``verified``."""
    return "verified" if self.draft else "ar" if self.autoregressive else "diffusion"


def choose(
  cfg: Config, cache: str = "auto", block_length: int = 0, decode: str = "auto", draft_length: int = 0
) -> Decoder:
  """The decoder a checkpoint runs (module docstring).

  A verified checkpoint (``objective.name = "verified"``) decodes three ways: ``verified`` (its default: drafts of
  ``draft_length`` tokens, default its trained ``objective.draft_length``, verified by its own next-token head),
  ``ar`` (its next-token head alone, one token per forward pass: the distribution ``verified`` reproduces) and
  ``diffusion`` (its draft half as a block-diffusion model over blocks of its draft length, against the causal
  cache of its clean half).

  Raises:
    SettingError: A cache or decode mode this model does not have, or a block or draft length that contradicts its
      training.
  """
  if cache not in CACHE_CHOICES:
    raise SettingError("cache", cache, f"is unknown; choose one of {', '.join(CACHE_CHOICES)}")
  if decode not in DECODES:
    raise SettingError("decode", decode, f"is unknown; choose one of {', '.join(DECODES)}")
  if draft_length and cfg.objective.name != "verified":
    raise SettingError("draft_length", draft_length, "needs a verified checkpoint (objective.name='verified')")
  if cfg.objective.name == "verified":
    return _choose_verified(cfg, cache, block_length, decode, draft_length)
  autoregressive, block_size = cfg.objective.autoregressive, cfg.objective.block_size
  best = "ar" if autoregressive else "diffusion"
  if decode not in ("auto", best):
    raise SettingError(
      "decode",
      decode,
      f"needs a verified checkpoint; this {'autoregressive' if autoregressive else 'diffusion'} "
      f"model decodes with decode='{best}'",
    )
  if cfg.objective.continuous and not block_size:
    if cache in ("exact", "dual", "prefix"):
      raise SettingError(
        "cache", cache, "does not apply to a whole-sequence continuous checkpoint: it refines its canvas without one"
      )
    if block_length:
      raise SettingError(
        "block_length",
        block_length,
        "must be 0: a whole-sequence continuous checkpoint refines its whole canvas as one block (it was never "
        "trained on masked positions outside a block)",
      )
    return Decoder("none", 0)
  if autoregressive or block_size:
    if cache in ("dual", "prefix"):
      raise SettingError(
        "cache", cache, "is the approximate cache of whole-sequence checkpoints; this model has an exact cache"
      )
    block = 1 if autoregressive else block_size
    if block_length and not autoregressive and block_length != block:
      raise SettingError(
        "block_length", block_length, f"must be {block} (or 0): the block size this model was trained with"
      )
    return Decoder("none" if cache == "none" else "exact", block, autoregressive)
  if cache == "exact":
    raise SettingError(
      "cache",
      cache,
      "needs a block-diffusion checkpoint (objective.block_size > 0); this whole-sequence model has the "
      "approximate caches 'dual' and 'prefix'",
    )
  if cache in ("auto", "none"):
    return Decoder("none", block_length)
  return Decoder(cache, block_length or APPROXIMATE_BLOCK)


def _choose_verified(cfg: Config, cache: str, block_length: int, decode: str, draft_length: int) -> Decoder:
  trained = cfg.objective.draft_length
  if cache in ("dual", "prefix"):
    raise SettingError(
      "cache", cache, "is the approximate cache of whole-sequence checkpoints; this model has an exact cache"
    )
  if decode == "diffusion":
    if block_length and block_length != trained:
      raise SettingError(
        "block_length", block_length, f"must be {trained} (or 0): the draft length this model was trained with"
      )
    if draft_length:
      raise SettingError("draft_length", draft_length, "applies to decode='verified' only")
    return Decoder("none" if cache == "none" else "exact", trained, causal_context=True)
  if decode == "ar":
    if draft_length:
      raise SettingError("draft_length", draft_length, "applies to decode='verified' only")
    return Decoder("none" if cache == "none" else "exact", 1, autoregressive=True, causal_context=True)
  draft = draft_length or trained
  if not 2 <= draft <= trained:
    raise SettingError(
      "draft_length", draft, f"must lie in [2, {trained}]: this model drafts blocks of {trained} tokens at most"
    )
  if cache == "none":
    raise SettingError("cache", cache, "has no verified decoder; verified decoding runs the exact cache ('auto')")
  return Decoder("exact", 1, autoregressive=True, draft=draft, causal_context=True)


def bucketed_length(length: int, context: int) -> int:
  """The canvas length a whole-canvas decode runs ``length`` positions at: rounded up to ``LENGTH_BUCKET``, at most
  ``context`` (unless ``length`` itself is longer), so varying prompt lengths share compilations."""
  return min(-(-length // LENGTH_BUCKET) * LENGTH_BUCKET, max(context, length))


def without_knobs(settings: SamplerSettings) -> SamplerSettings:
  """``settings`` with the sampling knobs the engine traces (temperature, top-k, top-p, threshold) at their defaults:
  the compilation key, so a new value of one of them reuses the compiled program."""
  return dataclasses.replace(settings, temperature=1.0, top_k=0, top_p=1.0, threshold=0.9)


@dataclasses.dataclass(frozen=True)
class ProgramKey:
  """What one pair of compiled programs is for."""

  settings: SamplerSettings  # without the traced knobs
  plan: BlockPlan
  batch: int
  capacity: constrained.Capacity | None  # structured output's table sizes; None: no constraint
  healing: bool  # some row heals its prompt's last token
  prefill: int | None = None  # slots the exact cache's prefill covers (``engine.prefill_slots``); None: every slot


class Program:
  """The compiled ``init`` and ``advance`` of one :class:`ProgramKey`, each compiled ahead of time on its first call.

  ``advance`` takes and returns the state with the shardings ``init`` gave it, so one executable serves every chunk
  of a decode (a stream's too).
  """

  def __init__(self, engine: BlockEngine, mesh: Mesh, rules, param_shardings, prefill: int | None = None):
    self.engine, self.mesh, self.rules, self.param_shardings = engine, mesh, rules, param_shardings
    self.prefill = prefill
    self._init = None
    self._advance = None
    self.compile_time = 0.0  # seconds spent compiling this program's functions so far

  def _compile(self, jitted: sh.MeshJit, *args):
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    self.compile_time += time.perf_counter() - start
    return compiled

  def init(self, params, canvas, key, num_steps, knobs, tables, healing, extra_steps):
    """The state before the first step (:meth:`BlockEngine.init`)."""
    args = (params, canvas, key, num_steps, knobs, tables, healing, extra_steps)
    if self._init is None:
      engine = self.engine

      prefill = self.prefill

      def fn(p, c, k, n, kn, t, h, e):
        return engine.init(p, c, k, n, kn, prefill=prefill, tables=t, healing=h, extra_steps=e)

      jitted = sh.MeshJit(fn, self.mesh, self.rules, in_shardings=(self.param_shardings, *[None] * 7))
      self._init = self._compile(jitted, *args)
    return self._init(*args)

  def advance(self, params, state, max_blocks, max_steps):
    """The state after a chunk of steps (:meth:`BlockEngine.advance`; the state is donated)."""
    args = (params, state, max_blocks, max_steps)
    if self._advance is None:
      shardings = jax.tree.map(lambda a: a.sharding, state)
      scalar = NamedSharding(self.mesh, P())
      jitted = sh.MeshJit(
        self.engine.advance,
        self.mesh,
        self.rules,
        in_shardings=(self.param_shardings, shardings, scalar, scalar),
        out_shardings=shardings,
        donate_argnums=(1,),
      )
      self._advance = self._compile(jitted, *args)
    return self._advance(*args)


class Programs:
  """The compiled programs of one sampler, keyed by :class:`ProgramKey`."""

  def __init__(self, network: Network, mesh: Mesh, rules, param_shardings):
    self.network, self.mesh, self.rules, self.param_shardings = network, mesh, rules, param_shardings
    self._programs: dict[ProgramKey, Program] = {}

  def get(self, key: ProgramKey) -> Program:
    if key not in self._programs:
      engine = BlockEngine(self.network, key.settings, key.plan)
      self._programs[key] = Program(engine, self.mesh, self.rules, self.param_shardings, key.prefill)
    return self._programs[key]

  def __len__(self) -> int:
    return len(self._programs)
