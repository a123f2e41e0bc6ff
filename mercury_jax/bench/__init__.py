"""Measuring the models: speed against quality, both models on one machine in one run.

- ``cli``: ``python -m mercury_jax.bench``, the interleaved speed/quality benchmark of a diffusion model and its twin.
- ``needle``: needle-in-a-haystack retrieval through the engine (the ``kv-retrieval`` corpus), by depth.
- ``prompts``: the prompt set (documented functions of the held-out split).
- ``quality``: generative perplexity, unigram entropy, distinct-n and the parse rate.
- ``report``: the matched-quality verdict, the Markdown table and the plots.
- ``throughput``: the FLOP/s peak MFU is quoted against (datasheet on accelerators, measured on CPU) and a timer.
"""
