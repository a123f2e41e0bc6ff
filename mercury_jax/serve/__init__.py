"""``python -m mercury_jax.serve``: an OpenAI-compatible HTTP server over the block engine.

``slots`` is the engine's device side (prefill, insert, step, release over a fixed number of rows; the commands
that every process of a multi-host mesh runs), ``scheduler`` its host side (the queue, the requests in the slots,
the engine thread that survives a failing request). The thin HTTP layer is ``guard`` (the API key and the body
limit, before any route), ``protocol`` (pydantic request and response models, every field bounded), ``routes`` (the
FastAPI app), ``answers`` (updates into text: incremental detokenisation, stop strings, the SSE events), ``structured``
(response formats and tool calls), ``compiling`` (their constraints, compiled in killable worker processes with a
time and a memory limit), ``chat`` (chat templates) and ``metrics`` (Prometheus). The engine knows nothing of HTTP.
"""
