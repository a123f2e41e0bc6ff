"""``python -m mercury_jax.serve``: an OpenAI-compatible HTTP server over the block engine.

``slots`` is the engine's device side (prefill, insert, step, release over a fixed number of rows; the commands
that every process of a multi-host mesh runs), ``scheduler`` its host side (the queue, the requests in the slots,
the engine thread that survives a failing request and reads a step's view while the next one runs). The thin HTTP
layer is ``guard`` (the API key, the body limit and its read timeout, before any route), ``draining`` (SIGTERM: the
grace period, and how what still runs at its end is answered), ``protocol`` (pydantic request and response models,
every field bounded and strictly typed), ``routes`` (the FastAPI app), ``answers`` (updates into text: incremental
detokenisation, stop strings, the SSE events), ``structured`` (response formats and tool calls), ``compiling`` (their
constraints, compiled fairly in killable processes with a time and a memory limit, which ``zygote`` forks), ``chat``
(chat templates) and ``metrics`` (Prometheus, including where a step's time goes). The engine knows nothing of HTTP.
"""
