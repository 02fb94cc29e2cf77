"""Peer authentication for internal endpoints: an HMAC of a timestamp under the per-deployment secret.

Metadata ``x-k3serve-auth: <unix seconds>.<hex hmac-sha256(secret, "k3serve:" + seconds)>``; a token is
accepted within ``max_skew_s`` of the receiver's clock, so a captured token goes stale quickly.
"""

from __future__ import annotations

import hashlib
import hmac
import time

AUTH_KEY = "x-k3serve-auth"


def make_token(secret: str, now: float | None = None) -> str:
    ts = str(int(now if now is not None else time.time()))
    mac = hmac.new(secret.encode(), f"k3serve:{ts}".encode(), hashlib.sha256).hexdigest()
    return f"{ts}.{mac}"


def verify_token(secret: str, token: str, max_skew_s: float = 120.0, now: float | None = None) -> bool:
    ts, _, mac = token.partition(".")
    if not ts.isdigit() or not mac:
        return False
    if abs((now if now is not None else time.time()) - int(ts)) > max_skew_s:
        return False
    want = hmac.new(secret.encode(), f"k3serve:{ts}".encode(), hashlib.sha256).hexdigest()
    return hmac.compare_digest(want, mac)


def auth_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    return ((AUTH_KEY, make_token(secret)),)
