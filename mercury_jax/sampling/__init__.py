"""Sampling: the one refinement loop, its step rules, canvases, and the text-in, text-out ``Sampler``.

- ``loop``: :func:`sample`, the pure jit-able ``while_loop`` (traced step count), and :func:`jit_sample`.
- ``rules``: the step rules plugged into it (ancestral, confidence, threshold, revision).
- ``proposal``: the candidate token and confidence at every position (SUBS, temperature, top-k, top-p).
- ``canvas``: prompts, fill-in-the-middle and ``<mask:N>`` templates as ``(tokens, kinds)`` batches.
- ``autoregressive``: :func:`decode`, the autoregressive twin's key-value-cache loop over the same canvases.
- ``sampler``: :class:`Sampler`, checkpoint + tokenizer + mesh set up once; ``generate(prompts, steps=...)`` for
  diffusion and autoregressive checkpoints alike, optionally with each process feeding its own prompts.
"""

from mercury_jax.sampling.autoregressive import decode, jit_decode
from mercury_jax.sampling.canvas import Canvas, Hole, SampleOutput, from_fixed, make_canvas, parse_template, prefix
from mercury_jax.sampling.loop import jit_sample, model_denoise_fn, sample
from mercury_jax.sampling.mesh import jit_on_mesh, mesh_context
from mercury_jax.sampling.sampler import BatchLayout, Sample, Sampler
from mercury_jax.sampling.settings import SamplerSettings

__all__ = [
  "BatchLayout",
  "Canvas",
  "Hole",
  "Sample",
  "SampleOutput",
  "Sampler",
  "SamplerSettings",
  "decode",
  "from_fixed",
  "jit_decode",
  "jit_on_mesh",
  "jit_sample",
  "make_canvas",
  "mesh_context",
  "model_denoise_fn",
  "parse_template",
  "prefix",
  "sample",
]
