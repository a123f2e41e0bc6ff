"""Shutdown: SIGTERM (or Ctrl-C) drains the server, and at the ``--grace`` limit every request still in flight ends
properly.

1. On the signal the server keeps listening, so nobody's connection is refused: ``/health`` answers 503
   ``{"status": "draining"}`` (a load balancer takes the server out), and a new ``/v1/...`` request answers 503, code
   ``draining``, with ``Retry-After`` and ``Connection: close``.
2. The API requests in flight (tokenising, compiling a constraint, waiting for a slot, generating, streaming) get
   ``grace`` seconds to finish.
3. At the limit every one still in flight ends (:attr:`Drain.closing`): a plain request answers 503 in OpenAI's error
   shape, code ``shutdown``, with its request id and ``Retry-After``; a stream sends that error as an event, then
   ``data: [DONE]``, and ends its body. Their engine requests are cancelled, which frees their slots.
4. Once no request is in flight, or :data:`MARGIN` seconds after the limit (for clients too slow to read their last
   bytes), the server stops listening, closes its connections and exits 0.

A second signal moves the limit to now. Until the signal the drain is invisible: :class:`InFlight` counts the requests.
"""

from __future__ import annotations

import asyncio
import json
import logging

from mercury_jax.serve.protocol import APIError

logger = logging.getLogger("mercury_jax.serve")
MARGIN = 1.0  # Seconds the ended requests get to write their last bytes after the grace limit.
RETRY_AFTER = 1  # Seconds a client refused or ended by the drain is told to wait (another replica can take it).
POLL = 0.02  # Seconds between looks at the requests in flight.


class Drain:
  """The server's shutdown state, shared by the routes, :class:`InFlight` and the command line.

  Args:
    grace: Seconds the requests in flight get to finish after the signal (>= 0).

  Attributes:
    draining: The signal came: ``/health`` answers 503 and new API requests are refused.
    closing: Set at the grace limit: every request still in flight ends (:meth:`ended`).
    in_flight: API requests (``/v1/...``) being answered (counted by :class:`InFlight`).
  """

  def __init__(self, grace: float = 30.0):
    if not grace >= 0:
      raise ValueError(f"grace={grace} must be >= 0 seconds")
    self.grace, self.draining, self.in_flight = grace, False, 0
    self.closing = asyncio.Event()
    self._task: asyncio.Task | None = None

  def signal(self, stop) -> None:
    """The server got SIGTERM or SIGINT (call it on the event loop): the first one starts the drain, which calls
    ``stop()`` once it is over (uvicorn's ``should_exit``); a second one ends the grace now."""
    if self._task is None:
      self.draining = True
      logger.info("draining: %d requests in flight get %g s to finish", self.in_flight, self.grace)
      self._task = asyncio.get_running_loop().create_task(self._drain(stop))
    else:
      self.closing.set()

  async def _drain(self, stop) -> None:
    loop = asyncio.get_running_loop()
    limit = loop.time() + self.grace
    while self.in_flight and loop.time() < limit and not self.closing.is_set():
      await asyncio.sleep(POLL)
    if self.in_flight:
      logger.warning("the grace period is over: %d requests in flight end with 503", self.in_flight)
    self.closing.set()
    limit = loop.time() + MARGIN
    while self.in_flight and loop.time() < limit:
      await asyncio.sleep(POLL)
    stop()

  def ended(self, request_id: str) -> APIError:
    """The 503 of a request in flight at the grace limit."""
    message = (
      f"the server shut down before this request finished (request id {request_id}; its grace period of "
      f"{self.grace:g} s ran out); send it again"
    )
    return APIError(503, message, code="shutdown", headers={"Retry-After": str(RETRY_AFTER)})

  @staticmethod
  def refused() -> APIError:
    """The 503 of a request that arrives while the server drains."""
    message = "the server is shutting down and takes no new request; send it elsewhere or retry shortly"
    return APIError(503, message, code="draining", headers={"Retry-After": str(RETRY_AFTER)})


class InFlight:
  """ASGI middleware: counts the API requests (``/v1/...``) being answered (:attr:`Drain.in_flight`) and, while the
  server drains, answers a new one 503 at once (``Connection: close``).

  Args:
    app: The ASGI app behind it.
    drain: The server's :class:`Drain`.
    refused: Called with ``(path, status)`` for every request it refuses (metrics).
  """

  def __init__(self, app, *, drain: Drain, refused=None):
    self.app, self.drain, self.refused = app, drain, refused

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
      return await self.app(scope, receive, send)
    if self.drain.draining:
      error = self.drain.refused()
      if self.refused is not None:
        self.refused(scope["path"], error.status)
      body = json.dumps(error.body()).encode()
      headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
      headers += [(b"retry-after", str(RETRY_AFTER).encode()), (b"connection", b"close")]
      await send({"type": "http.response.start", "status": error.status, "headers": headers})
      return await send({"type": "http.response.body", "body": body})
    self.drain.in_flight += 1
    try:
      return await self.app(scope, receive, send)
    finally:
      self.drain.in_flight -= 1
