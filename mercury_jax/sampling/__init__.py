"""Sampling: one decoding engine behind every entry point, its parts, and the text-in, text-out ``Sampler``.

- ``engine``: :class:`BlockEngine`, the one loop (a jitted ``lax.while_loop`` over steps) and its programs (prefill,
  insert, release, step, advance): a step is the rule's needs, the cache's pass, the rule's decision, one tail.
- ``step``: the step rule protocol; ``refine`` (the discrete rules), ``verify`` (verified decoding), ``latents``
  (the continuous family's ODE) are its rules; ``rules``: which positions a refining step commits (ancestral,
  confidence, threshold, revision); ``proposal``: the candidate token and confidence at every position.
- ``plan``: :class:`BlockPlan`, what is static about a run, and ``plan_for``, the one function that chooses it.
- ``caches``: the cache strategies (exact, none, dual, prefix, verified) that give a step its logits.
- ``hooks``: structured output and token healing as hooks of the step; ``automata``: the structured-output automaton
  on the device (the dynamic program over a block, forced tokens).
- ``state``: the loop state, each field's row axis declared once, and the row moves.
- ``programs``: the compiled programs of every entry point (one object per network and mesh).
- ``canvas``: prompts, fill-in-the-middle and ``<mask:N>`` templates as ``(tokens, kinds)`` batches.
- ``network``: the denoiser as the engine calls it.
- ``sampler``: :class:`Sampler`, checkpoint + tokenizer + mesh set up once; ``generate(prompts, steps=...)`` and
  ``stream(...)``; ``jobs`` (requests made ready), ``text`` (text to token-level rows and back, the detokeniser),
  ``placement`` (arrays onto a mesh, one process or many), ``registry`` (bundled models).
"""

from mercury_jax.sampling.canvas import Canvas, Hole, SampleOutput, from_fixed, make_canvas, parse_template, prefix
from mercury_jax.sampling.engine import BlockEngine
from mercury_jax.sampling.mesh import jit_on_mesh, mesh_context
from mercury_jax.sampling.network import FunctionNetwork, Network
from mercury_jax.sampling.plan import CACHES, BlockPlan, plan_blocks
from mercury_jax.sampling.sampler import Sampler
from mercury_jax.sampling.settings import SamplerSettings
from mercury_jax.sampling.text import Sample, StreamEvent

__all__ = [
  "CACHES",
  "BlockEngine",
  "BlockPlan",
  "Canvas",
  "FunctionNetwork",
  "Hole",
  "Network",
  "Sample",
  "SampleOutput",
  "Sampler",
  "SamplerSettings",
  "StreamEvent",
  "from_fixed",
  "jit_on_mesh",
  "make_canvas",
  "mesh_context",
  "parse_template",
  "plan_blocks",
  "prefix",
]
