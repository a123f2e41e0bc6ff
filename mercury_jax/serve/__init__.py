"""``python -m mercury_jax.serve``: an OpenAI-compatible HTTP server over the block engine.

``scheduler`` is the engine's host side (slots, queue, the device thread); the thin HTTP layer is ``protocol``
(pydantic request and response models), ``routes`` (the FastAPI app), ``chat`` (chat templates) and ``metrics``
(Prometheus). The engine knows nothing of HTTP.
"""
