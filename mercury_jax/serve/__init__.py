"""``python -m mercury_jax.serve``: an OpenAI-compatible HTTP server over the block engine.

``config`` is what the engine and the queue are built from (``ServeConfig``, checked once). ``slots`` runs the
engine's device programs (prefill, insert, step, release over a fixed number of rows); ``commands`` is admission and
page bookkeeping on the host (the command of one iteration, a request's pages and prefill bucket), ``multihost`` what
makes every process of a multi-host mesh run the same commands. ``scheduler`` is the host side (the queue, the
requests in the slots, the engine thread that survives a failing request and reads a step's view while the next one
runs), with ``handles`` (how updates reach a request's event loop) and ``news`` (a request's news after a step). The
thin HTTP layer is ``guard`` (the API key, the body limit and its read timeout, before any route), ``draining``
(SIGTERM: the grace period, and how what still runs at its end is answered), ``protocol`` (pydantic request and
response models, every field bounded and strictly typed), ``requests`` (a request's text tokenised and its knobs read
into the token-level rows the library builds too), ``routes`` (the FastAPI app's handlers), ``answers`` (updates into
text: incremental detokenisation, stop strings, the SSE events), ``structured`` (response formats and tool calls),
``compiling`` (their constraints, compiled fairly in killable processes with a time and a memory limit, which
``zygote`` forks), ``chat`` (chat templates) and ``metrics`` (Prometheus, including where a step's time goes). The
engine knows nothing of HTTP.
"""
