"""POSTing JSON to a service with retries: the one client loop of the HTTP reward
service (`rayrl.rewards.http`) and of SandboxFusion (`rayrl.sandbox_fusion`).

`post_json` sends a body, retries connection errors, timeouts and the statuses in
`RETRY_STATUS` after ``backoff_s``, doubling, and decodes the JSON reply. It raises
`PostFailed` (the attempts made and the last failure) or `BadReply` (the reply's start)
for the caller to put in its own words, with the key the user sets.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

__all__ = ["RETRY_STATUS", "BadReply", "PostFailed", "excerpt", "post_json"]

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class PostFailed(RuntimeError):
    """Every attempt failed: ``attempts`` made, ``last`` failure in words."""

    def __init__(self, attempts: int, last: str) -> None:
        super().__init__(f"failed after {attempts} attempt(s); last: {last}")
        self.attempts, self.last = attempts, last


class BadReply(RuntimeError):
    """The reply was not JSON; ``text`` is its start."""

    def __init__(self, text: str) -> None:
        super().__init__(f"replied with invalid JSON: {text}")
        self.text = text


def post_json(
    url: str,
    body: bytes,
    *,
    timeout_s: float,
    retries: int,
    backoff_s: float,
    attempted: Callable[[int], None] | None = None,
    slot: AbstractContextManager[Any] | None = None,
) -> Any:
    """The decoded JSON reply to ``body`` POSTed to ``url`` (module docstring).
    ``attempted(i)`` is told of each attempt (0: the first); ``slot`` is held while a
    request is in flight (a semaphore bounding the requests at once)."""
    last = "no attempt made"
    attempt = 0
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        if attempted is not None:
            attempted(attempt)
        try:
            with slot if slot is not None else nullcontext():
                raw = _send(url, body, timeout_s)
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code} {exc.reason}: {excerpt(exc.read())}"
            if exc.code not in RETRY_STATUS:
                break
            continue
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out
            last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            continue
        try:
            return json.loads(raw)
        except ValueError:
            raise BadReply(excerpt(raw)) from None
    raise PostFailed(attempt + 1, last)


def _send(url: str, body: bytes, timeout_s: float) -> bytes:
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return bytes(response.read())


def excerpt(data: Any, limit: int = 200) -> str:
    """The start of a reply (bytes decoded) or of an object's repr, for a message."""
    text = data.decode(errors="replace") if isinstance(data, bytes) else repr(data)
    return text if len(text) <= limit else text[:limit] + "..."
