"""What every HTTP request passes before it reaches a route: the API key, the body size and the time the body takes
(one ASGI middleware).

* ``api_key``: requests to ``/v1/...`` must carry ``Authorization: Bearer KEY`` (as vLLM's ``--api-key``); a missing
  or different key answers 401 in OpenAI's error shape, code ``invalid_api_key``. Keys are compared in constant time
  (:func:`hmac.compare_digest`). ``/openapi.json`` needs the key too: it describes the API to its clients, who have
  the key, and an unauthenticated caller learns nothing from it (the model's context, vocabulary and block are in
  its bounds). ``/health`` and ``/metrics`` stay open: load balancers' probes and Prometheus' scrapers carry no key.
* ``max_body_bytes``: a body larger than this answers 413, code ``body_too_large``. A ``Content-Length`` above it is
  refused before a byte of the body is read; a body without one (chunked) is counted as it arrives and refused once
  it passes the limit, so at most ``max_body_bytes`` are ever held. The rest of the body is left to the HTTP server,
  which discards it.
* ``body_timeout``: the whole body must arrive within this many seconds of the request's headers; a body slower than
  that (shorter than its ``Content-Length``, or a chunked one that never ends) answers 408, code ``body_timeout``, and
  the connection is closed, so a client cannot hold a connection and its task by sending a body slowly.

The body is read here, whole, and handed to the app from memory: the app never waits on a slow client's body.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from mercury_jax.serve.protocol import APIError

PROTECTED = ("/v1/", "/openapi.json")  # Paths that start so need the API key.
MAX_BODY_TIMEOUT = 600.0  # The largest --body-timeout, in seconds.


class Guard:
  """ASGI middleware: the API key on ``/v1/...`` and ``/openapi.json``, the body size limit and the body's read
  timeout, for every HTTP request.

  Args:
    app: The ASGI app behind it.
    api_key: The key clients must send; None: no key needed.
    max_body_bytes: The largest request body accepted (>= 1).
    body_timeout: Seconds a request's whole body may take to arrive, in ``(0, MAX_BODY_TIMEOUT]``.
    refused: Called with ``(path, status)`` for every request it refuses (metrics).
  """

  def __init__(self, app, *, api_key: str | None, max_body_bytes: int, body_timeout: float = 10.0, refused=None):
    if max_body_bytes < 1:
      raise ValueError(f"max_body_bytes={max_body_bytes} must be >= 1")
    if not 0 < body_timeout <= MAX_BODY_TIMEOUT:
      raise ValueError(f"body_timeout={body_timeout} must lie in (0, {MAX_BODY_TIMEOUT:g}] seconds")
    self.app, self.max_body_bytes, self.body_timeout, self.refused = app, max_body_bytes, body_timeout, refused
    self._key = f"Bearer {api_key}".encode() if api_key else None

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = dict(scope["headers"])
    if self._key is not None and scope["path"].startswith(PROTECTED):
      given = headers.get(b"authorization", b"")
      if not hmac.compare_digest(given, self._key):
        message = "missing API key: send Authorization: Bearer KEY" if not given else "invalid API key"
        return await self._refuse(scope, send, APIError(401, message, code="invalid_api_key"))
    length = headers.get(b"content-length")
    if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
      return await self._refuse(scope, send, self._too_large())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + self.body_timeout
    body, size, more = [], 0, True
    while more:
      try:
        async with asyncio.timeout_at(deadline):
          message = await receive()
      except TimeoutError:
        return await self._refuse(scope, send, self._too_slow(size, length), close=True)
      if message["type"] != "http.request":  # The client left: nobody to answer.
        return None
      size += len(message.get("body", b""))
      if size > self.max_body_bytes:
        return await self._refuse(scope, send, self._too_large())
      body.append(message.get("body", b""))
      more = message.get("more_body", False)
    replay = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

    async def replayed():
      return replay.pop() if replay else await receive()

    return await self.app(scope, replayed, send)

  def _too_large(self) -> APIError:
    return APIError(
      413, f"the request body is larger than the {self.max_body_bytes} bytes this server takes", code="body_too_large"
    )

  def _too_slow(self, size: int, length: bytes | None) -> APIError:
    of = f" of the {int(length)} its Content-Length announced" if length is not None else ""
    message = (
      f"the request body did not arrive within the server's body timeout ({self.body_timeout:g} s): {size} bytes"
      f"{of} came; send the whole body at once"
    )
    return APIError(408, message, code="body_timeout")

  async def _refuse(self, scope, send, error: APIError, close: bool = False) -> None:
    if self.refused is not None:
      self.refused(scope["path"], error.status)
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
      headers.append((b"www-authenticate", b"Bearer"))
    if close:  # The rest of the body may still come: the connection cannot carry another request.
      headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
