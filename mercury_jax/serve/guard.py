"""What every HTTP request passes before it reaches a route: the API key and the body size (one ASGI middleware).

* ``api_key``: requests to ``/v1/...`` must carry ``Authorization: Bearer KEY`` (as vLLM's ``--api-key``); a missing
  or different key answers 401 in OpenAI's error shape, code ``invalid_api_key``. Keys are compared in constant time
  (:func:`hmac.compare_digest`). ``/health``, ``/metrics`` and ``/openapi.json`` stay open.
* ``max_body_bytes``: a body larger than this answers 413, code ``body_too_large``. A ``Content-Length`` above it is
  refused before a byte of the body is read; a body without one (chunked) is counted as it arrives and refused once
  it passes the limit, so at most ``max_body_bytes`` are ever held. The rest of the body is left to the HTTP server,
  which discards it.
"""

from __future__ import annotations

import hmac
import json

from mercury_jax.serve.protocol import APIError

PROTECTED = "/v1/"  # Paths under this prefix need the API key.


class Guard:
  """ASGI middleware: the API key on ``/v1/...`` and the body size limit, for every HTTP request.

  Args:
    app: The ASGI app behind it.
    api_key: The key clients must send; None: no key needed.
    max_body_bytes: The largest request body accepted (>= 1).
    refused: Called with ``(path, status)`` for every request it refuses (metrics).
  """

  def __init__(self, app, *, api_key: str | None, max_body_bytes: int, refused=None):
    if max_body_bytes < 1:
      raise ValueError(f"max_body_bytes={max_body_bytes} must be >= 1")
    self.app, self.max_body_bytes, self.refused = app, max_body_bytes, refused
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
    if length is not None:
      return await self.app(scope, receive, send)
    # No Content-Length: read the body here, up to the limit, and replay it to the app.
    body, more = [], True
    size = 0
    while more:
      message = await receive()
      if message["type"] != "http.request":
        break
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

  async def _refuse(self, scope, send, error: APIError) -> None:
    if self.refused is not None:
      self.refused(scope["path"], error.status)
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
      headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
