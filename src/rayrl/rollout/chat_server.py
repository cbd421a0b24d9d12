"""`ChatServer`: an OpenAI-compatible HTTP front for a `RolloutService`.

It serves ``POST /v1/chat/completions`` (the messages rendered with the tokenizer's
chat template, generation prompt added), ``POST /v1/completions`` (a text prompt, or
token ids), ``GET /v1/models``, ``GET /health`` and ``GET /stats`` (`stats()`), on a
thread per connection (`ThreadingHTTPServer`). Each request is one job of the service's turn loop
(`RolloutService.serve`), so requests that arrive together share the engine's steps:
continuous batching, as any rollout. At most ``max_num_seqs`` samples are in the
engine at once; more wait for a slot.

Sampling follows the request (``temperature``, ``top_p``, ``top_k``, ``max_tokens``,
``n``, ``stop``, ``seed``), else the server's defaults; ``max_tokens`` is capped by
``max_response_tokens``, and a prompt longer than ``max_prompt_tokens`` is refused (HTTP
400, with the lengths). A sample's draws are keyed by the seed and the prompt's tokens,
so the same request gets the same answer (seeded sampling, `rayrl.rollout.sampling`).

`stats()` counts what was served: requests, prompt and completion tokens, the seconds
requests spent in the server (summed), refusals, and the loop's steps and stepped
samples (``stepped / steps`` is the mean batch).

This is the engine layer: it knows requests and tokens, nothing of rewards; the LLM
judge (`rayrl.workers.judge`) puts a judge model behind it.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rayrl.rollout.sampling import SamplingParams, sample_keys

__all__ = ["ChatServer", "RequestError"]


class RequestError(ValueError):
    """A request the server refuses (HTTP 400), in words."""


@dataclass
class _Counts:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    request_s: float = 0.0
    refused: int = 0


class ChatServer:
    """An OpenAI-compatible server over ``service`` (module docstring).

    Args:
        service: a `RolloutService` whose engine serves requests.
        tokenizer: the model's tokenizer (chat template, decoding).
        model_name: the name `/v1/models` reports (requests may name any).
        defaults: sampling for what a request leaves out (its ``max_new_tokens`` is the
            default ``max_tokens``).
        max_prompt_tokens: longer prompts are refused.
        max_response_tokens: the cap on a request's ``max_tokens``.
        max_num_seqs: samples in the engine at once.
        host, port: where to listen (port 0: any free port).
    """

    def __init__(
        self,
        service: Any,
        tokenizer: Any,
        *,
        model_name: str = "judge",
        defaults: SamplingParams | None = None,
        max_prompt_tokens: int = 2048,
        max_response_tokens: int = 2048,
        max_num_seqs: int = 1024,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.service, self.tokenizer, self.model_name = service, tokenizer, model_name
        self.defaults = defaults or SamplingParams()
        self.max_prompt_tokens, self.max_response_tokens = max_prompt_tokens, max_response_tokens
        self.max_num_seqs = max_num_seqs
        self._room = threading.Condition()
        self._free = max_num_seqs  # samples the engine may still take
        self._lock = threading.Lock()
        self._counts = _Counts()
        self._http = _Listener((host, port), _handler(self))
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="chat-server", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        """``host:port`` the server listens on."""
        host, port = self._http.server_address[:2]
        return f"{host!s}:{port}" if isinstance(host, str) else f"{host.decode()}:{port}"

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def stats(self) -> dict[str, float]:
        with self._lock:
            counts = dict(vars(self._counts))
        loop = self.service.loop
        return {**counts, "steps": loop.steps, "stepped": loop.stepped}

    # ------------------------------------------------------------------ requests
    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The reply to a ``/v1/chat/completions`` body."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of {role, content}")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # noqa: BLE001 - a template that rejects the messages
            raise RequestError(f"the chat template cannot render these messages: {exc}") from exc
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        texts, finishes, used = self._generate(ids, body)
        choices = [
            {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": f}
            for i, (t, f) in enumerate(zip(texts, finishes, strict=True))
        ]
        return self._reply("chat.completion", choices, len(ids), used)

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """The reply to a ``/v1/completions`` body (``prompt``: text or token ids)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        elif isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            ids = prompt
        else:
            raise RequestError("'prompt' must be a string or a list of token ids (one prompt)")
        texts, finishes, used = self._generate(ids, body)
        choices = [
            {"index": i, "text": t, "finish_reason": f}
            for i, (t, f) in enumerate(zip(texts, finishes, strict=True))
        ]
        return self._reply("text_completion", choices, len(ids), used)

    def _generate(self, ids: list[int], body: dict) -> tuple[list[str], list[str], int]:
        """The request's samples: texts, finish reasons, completion tokens in all."""
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) > self.max_prompt_tokens:
            raise RequestError(
                f"the prompt has {len(ids)} tokens, over the server's {self.max_prompt_tokens} "
                "(reward.reward_model.rollout.prompt_length)"
            )
        sampling = self._sampling(body)
        digest = hashlib.blake2b(json.dumps(ids).encode(), digest_size=8).hexdigest()
        keys = sample_keys(sampling.seed, 0, [f"{digest}/{k}" for k in range(sampling.n)])
        started = time.perf_counter()
        with self._room:  # all of a request's samples at once, or none: no deadlock
            self._room.wait_for(lambda: self._free >= sampling.n)
            self._free -= sampling.n
        try:
            out = self.service.serve([ids], sampling, keys.numpy())
        finally:
            with self._room:
                self._free += sampling.n
                self._room.notify_all()
        lengths = out.lengths.tolist()
        texts = [
            self.tokenizer.decode(out.tokens[i, : lengths[i]].tolist(), skip_special_tokens=True)
            for i in range(sampling.n)
        ]
        finishes = ["stop" if bool(s) else "length" for s in out.stopped]
        with self._lock:
            c = self._counts
            c.requests += 1
            c.prompt_tokens += len(ids)
            c.completion_tokens += sum(lengths)
            c.request_s += time.perf_counter() - started
        return texts, finishes, sum(lengths)

    def _sampling(self, body: dict[str, Any]) -> SamplingParams:
        d = self.defaults
        try:
            n = int(body.get("n") or 1)
            if not 1 <= n <= self.max_num_seqs:
                raise RequestError(f"n={n} must be in [1, {self.max_num_seqs}] (max_num_seqs)")
            max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 0)
            stop = body.get("stop") or ()
            return replace(
                d,
                n=n,
                temperature=float(body.get("temperature", d.temperature)),
                top_p=float(body.get("top_p", d.top_p)),
                top_k=int(body.get("top_k", d.top_k) or 0),
                max_new_tokens=min(max_tokens or d.max_new_tokens, self.max_response_tokens),
                stop=(stop,) if isinstance(stop, str) else tuple(stop),
                seed=int(body.get("seed", d.seed)),
            )
        except (TypeError, ValueError) as exc:
            raise RequestError(f"bad sampling settings: {exc}") from None

    def _reply(self, kind: str, choices: list, prompt_tokens: int, used: int) -> dict[str, Any]:
        return {
            "id": f"{kind}-{time.time_ns()}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": used,
                "total_tokens": prompt_tokens + used,
            },
        }

    def refused(self) -> None:
        with self._lock:
            self._counts.refused += 1


class _Listener(ThreadingHTTPServer):
    """A thread per connection, and a listen backlog for a reward worker's burst of
    connections (the default 5 resets connections past it: ConnectionResetError)."""

    daemon_threads = True
    request_queue_size = 1024


def _handler(server: ChatServer) -> type[BaseHTTPRequestHandler]:
    routes = {"/v1/chat/completions": server.chat, "/v1/completions": server.complete}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet: a judge serves many requests
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") == "/health":
                self._send(200, {"status": "ok"})
            elif self.path.rstrip("/") == "/stats":
                self._send(200, server.stats())
            elif self.path.rstrip("/") == "/v1/models":
                model = {"id": server.model_name, "object": "model", "owned_by": "rayrl"}
                self._send(200, {"object": "list", "data": [model]})
            else:
                self._send(404, _error(f"no route {self.path}"))

        def do_POST(self) -> None:  # noqa: N802
            route = routes.get(self.path.rstrip("/"))
            if route is None:
                self._send(404, _error(f"no route {self.path}; try /v1/chat/completions"))
                return
            try:
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size) or b"{}")
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
                self._send(200, route(body))
            except (RequestError, ValueError) as exc:
                server.refused()
                self._send(400, _error(str(exc)))
            except Exception as exc:  # noqa: BLE001 - the engine failed: say so, keep serving
                server.refused()
                self._send(500, _error(f"{type(exc).__name__}: {exc}", "server_error"))

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def _error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}
