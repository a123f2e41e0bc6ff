"""Sampling: the one refinement loop, its step rules, canvases, and the text-in, text-out ``Sampler``.

- ``loop``: :func:`sample`, the pure jit-able ``while_loop`` (traced step count), and :func:`jit_sample`.
- ``rules``: the step rules plugged into it (ancestral, confidence, threshold, revision).
- ``proposal``: the candidate token and confidence at every position (SUBS, temperature, top-k, top-p).
- ``canvas``: prompts, fill-in-the-middle and ``<mask:N>`` templates as ``(tokens, kinds)`` batches.
- ``sampler``: :class:`Sampler`, checkpoint + tokenizer + mesh set up once; ``generate(prompts, steps=...)``.
"""

from mercury_jax.sampling.canvas import Canvas, Hole, from_fixed, make_canvas, parse_template, prefix
from mercury_jax.sampling.loop import SampleOutput, jit_sample, mesh_context, model_denoise_fn, sample
from mercury_jax.sampling.sampler import Sample, Sampler
from mercury_jax.sampling.settings import SamplerSettings

__all__ = [
  "Canvas",
  "Hole",
  "Sample",
  "SampleOutput",
  "Sampler",
  "SamplerSettings",
  "from_fixed",
  "jit_sample",
  "make_canvas",
  "mesh_context",
  "model_denoise_fn",
  "parse_template",
  "prefix",
  "sample",
]
