"""Sampling: one decoding engine behind every entry point, its parts, and the text-in, text-out ``Sampler``.

- ``engine``: :class:`BlockEngine`, the one refinement loop (a jitted ``lax.while_loop`` over steps): forward,
  propose, rule, commit, end of sequence, advance.
- ``plan``: :class:`BlockPlan`, what is static about a run (block, slots, cache).
- ``caches``: the cache strategies (exact, none, dual, prefix) that give a step its logits.
- ``hooks``: structured output and token healing as hooks of the step.
- ``rules``: the step rules (ancestral, confidence, threshold, revision); ``proposal``: the candidate token and
  confidence at every position (SUBS, temperature, top-k, top-p).
- ``canvas``: prompts, fill-in-the-middle and ``<mask:N>`` templates as ``(tokens, kinds)`` batches.
- ``network``: the denoiser as the engine calls it; ``state``: the loop state.
- ``sampler``: :class:`Sampler`, checkpoint + tokenizer + mesh set up once; ``generate(prompts, steps=...)`` and
  ``stream(...)``; ``decoders`` (which cache and block a checkpoint runs, the compiled programs), ``placement``
  (arrays onto a mesh, one process or many), ``text`` (text to canvases and back), ``registry`` (bundled models).
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
