"""Every benchmark and measurement of the project: ``python -m mercury_jax.bench COMMAND`` (``--help`` lists them).

- ``cli``: the command line, the commands grouped by what they are for (``GROUPS``).
- ``compare`` (with ``rounds``, ``models``, ``prompts``, ``quality``, ``report``, ``overhead``, ``verified``): the
  interleaved speed/quality benchmark of a diffusion (or verified) model and its autoregressive twin.
- ``serve`` (with ``serving``: the server process, the client's loads, the table): a server under load.
- ``slot_step``, ``sampler``, ``caches``, ``structured``, ``training``: the engine's parts and the training step.
- ``schema_coverage``: JSON Schema coverage of structured output, on the official test suite and JSONSchemaBench's
  real-world collections.
- ``long_context``, ``long_attention`` (and context parallelism), ``needle``: long prompts and long sequences.
- ``families`` (with ``families_torch``), ``convert``: converted public checkpoints and the converter.
- ``gpu_attention``, ``gpu_sampling``: the accelerator benchmarks ``launch/gpu_checks.sh`` runs.
- ``recipes``, ``objectives``: the experiments whose numbers the results pages (``docs/results/``) quote (targets,
  first text, the block-size sweep; the noise schedules, the noise profile, draft masking, the diffusion heads).
- ``throughput``: the one wall-clock timer every command uses, the FLOP/s peak MFU is quoted against (datasheet on
  accelerators, measured on CPU), and the machine a result was measured on.
"""
