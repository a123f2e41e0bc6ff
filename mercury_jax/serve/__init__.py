"""``python -m mercury_jax.serve``: an OpenAI-compatible HTTP server over the block engine.

``slots`` is the engine's device side (prefill, insert, step, release over a fixed number of rows; the commands
that every process of a multi-host mesh runs), ``scheduler`` its host side (the queue, the requests in the slots,
the engine thread). The thin HTTP layer is ``protocol`` (pydantic request and response models), ``routes`` (the
FastAPI app), ``chat`` (chat templates) and ``metrics`` (Prometheus). The engine knows nothing of HTTP.
"""
