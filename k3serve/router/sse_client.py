"""A small blocking client of the HTTP door's streamed completions (stdlib http.client), for k3serve's own
drills and benches: no extra dependency in the runtime install. Users have the openai package."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator


class HttpCallError(Exception):
    """A non-200 answer: ``status`` and OpenAI's error body."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(f"HTTP {status}: {body.get('error', {}).get('message', body)}")
        self.status, self.body = status, body


def stream_completion(address: str, body: dict, headers: dict[str, str] | None = None,
                      timeout_s: float = 300.0) -> Iterator[dict]:
    """POST /v1/completions with ``stream: true`` to "host:port"; yields each SSE chunk (decoded JSON) until
    ``[DONE]``. Raises HttpCallError for an error answer or an error event, ConnectionError if the stream breaks."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        if resp.status != 200:
            raise HttpCallError(resp.status, json.loads(resp.read() or b"{}"))
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                return
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise HttpCallError(500, chunk)
            yield chunk
        raise ConnectionError(f"the stream from {address} ended without [DONE]")
    except (http.client.HTTPException, OSError) as e:
        raise ConnectionError(f"{address}: {type(e).__name__}: {e}") from None
    finally:
        conn.close()
