"""HTTPReward: a client for a remote reward service, with timeout, retries and backoff.

Protocol (one POST per batch, JSON both ways, `Content-Type: application/json`):

    request:  {"items": [{"data_source": str, "solution_str": str,
                          "ground_truth": any, "extra_info": any}, ...]}
    response: HTTP 200, {"scores": [entry, ...]}, one entry per item, in order, where
              an entry is a number, or {"score": number, ...extra metrics}, or
              {"error": "why"} / null for an item the service could not score.

An item the service could not score gets score 0.0 and the error, like the process
pool. Connection errors, timeouts, HTTP 5xx and 429 are retried `retries` times,
waiting `backoff_s`, then twice that, and so on; after the last attempt (or at once on
another 4xx, or on a reply that breaks the protocol) `RewardServiceError` names the
url and the last status. Values numpy would hold (arrays, scalars) are sent as lists
and numbers. Only the standard library is used (urllib).
"""

from __future__ import annotations

import json
import time
from typing import Any

from rayrl.json_post import BadReply, PostFailed, excerpt, post_json
from rayrl.rewards.loader import PARAMS
from rayrl.rewards.result import RewardResult, failed, to_result


class RewardServiceError(RuntimeError):
    """The reward service could not be reached or answered outside the protocol."""


class HTTPReward:
    """Score samples by POSTing batches to a reward service (protocol in the module doc).

    Args:
        url: the service endpoint, e.g. "http://10.0.0.5:8000/score".
        timeout_s: socket timeout of one request.
        retries: extra attempts after the first on transient failures.
        backoff_s: wait before the first retry; doubles after each.
        batch_size: items per request; None sends all items in one request.

    Counters: `calls` (items scored), `errors` (items the service failed on),
    `requests` (HTTP attempts), `retried` (attempts that were retries).
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        batch_size: int | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward.http.url={url!r} must start with http:// or https://.")
        if retries < 0 or timeout_s <= 0 or (batch_size is not None and batch_size < 1):
            raise ValueError(
                f"HTTPReward needs retries >= 0, timeout_s > 0, batch_size >= 1 or None; got "
                f"retries={retries}, timeout_s={timeout_s}, batch_size={batch_size}."
            )
        self.url, self.timeout_s, self.retries, self.backoff_s = url, timeout_s, retries, backoff_s
        self.batch_size = batch_size
        self.calls = self.errors = self.requests = self.retried = 0

    def score(self, items: list[dict[str, Any]]) -> list[RewardResult]:
        """Score `items` (dicts with data_source, solution_str, ground_truth, extra_info)."""
        size = self.batch_size or max(1, len(items))
        results: list[RewardResult] = []
        for start in range(0, len(items), size):
            results += self._score_batch(items[start : start + size])
        self.calls += len(items)
        self.errors += sum(r.error is not None for r in results)
        return results

    def _score_batch(self, items: list[dict[str, Any]]) -> list[RewardResult]:
        payload = {"items": [{k: item.get(k) for k in PARAMS} for item in items]}
        started = time.monotonic()
        reply = self.post(payload)
        elapsed = time.monotonic() - started
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, list) or len(scores) != len(items):
            got = f"{len(scores)} scores" if isinstance(scores, list) else excerpt(reply)
            raise RewardServiceError(
                f"reward service {self.url} broke the protocol: sent {len(items)} items, "
                f"expected {{'scores': [...]}} with {len(items)} entries, got {got}."
            )
        return [_entry_result(entry, elapsed) for entry in scores]

    def post(self, payload: dict[str, Any]) -> Any:
        """POST `payload` as JSON and return the decoded reply, retrying transient failures."""
        body = json.dumps(payload, default=_to_json).encode()
        try:
            return post_json(
                self.url,
                body,
                timeout_s=self.timeout_s,
                retries=self.retries,
                backoff_s=self.backoff_s,
                attempted=self._attempted,
            )
        except PostFailed as err:
            raise RewardServiceError(
                f"reward service {self.url} {err}. Check that the service is up and reachable "
                "from this node (reward.http.url), or raise reward.http.retries / "
                "reward.http.timeout_s."
            ) from None
        except BadReply as err:
            raise RewardServiceError(f"reward service {self.url} {err}") from None

    def _attempted(self, attempt: int) -> None:
        self.requests += 1
        self.retried += attempt > 0


def _entry_result(entry: Any, elapsed_s: float) -> RewardResult:
    if entry is None:
        return failed("reward service returned no score for this item", elapsed_s)
    if isinstance(entry, dict) and entry.get("error"):
        return failed(f"reward service: {entry['error']}", elapsed_s)
    return to_result(entry, elapsed_s)


def _to_json(value: Any) -> Any:
    """JSON fallback: numpy arrays and scalars via tolist(); anything else as text."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)
