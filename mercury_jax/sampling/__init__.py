"""Sampling: the refinement loops, their step rules, canvases, and the text-in, text-out ``Sampler``.

- ``loop``: :func:`sample`, the whole-canvas ``while_loop`` of whole-sequence checkpoints without a cache (traced
  step count), and :func:`jit_sample`.
- ``rules``: the step rules plugged into it (ancestral, confidence, threshold, revision).
- ``proposal``: the candidate token and confidence at every position (SUBS, temperature, top-k, top-p).
- ``canvas``: prompts, fill-in-the-middle and ``<mask:N>`` templates as ``(tokens, kinds)`` batches.
- ``blocks``: :class:`BlockEngine`, block-by-block decoding against a key-value cache: exact for block-diffusion
  checkpoints, the autoregressive twin (blocks of one token), Fast-dLLM's approximate caches for whole-sequence
  ones; streamed in jitted chunks.
- ``sampler``: :class:`Sampler`, checkpoint + tokenizer + mesh set up once; ``generate(prompts, steps=...)`` and
  ``stream(...)`` for diffusion and autoregressive checkpoints alike, optionally with each process feeding its own
  prompts.
"""

from mercury_jax.sampling.blocks import BlockEngine, BlockPlan, plan_blocks
from mercury_jax.sampling.canvas import Canvas, Hole, SampleOutput, from_fixed, make_canvas, parse_template, prefix
from mercury_jax.sampling.loop import jit_sample, model_denoise_fn, sample
from mercury_jax.sampling.mesh import jit_on_mesh, mesh_context
from mercury_jax.sampling.sampler import BatchLayout, Sample, Sampler, StreamEvent
from mercury_jax.sampling.settings import SamplerSettings

__all__ = [
  "BatchLayout",
  "BlockEngine",
  "BlockPlan",
  "Canvas",
  "Hole",
  "Sample",
  "SampleOutput",
  "Sampler",
  "SamplerSettings",
  "StreamEvent",
  "from_fixed",
  "jit_on_mesh",
  "jit_sample",
  "make_canvas",
  "mesh_context",
  "model_denoise_fn",
  "parse_template",
  "plan_blocks",
  "prefix",
  "sample",
]
