"""HTTPReward against a real local HTTP server: success, retries, dead ports, protocol errors."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from rayrl.rewards import HTTPReward, RewardServiceError


class RewardHandler(BaseHTTPRequestHandler):
    """Scores items by data_source; the server's attributes script failures."""

    server: RewardServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state = self.server
        state.received.append(body)
        if state.fail_times > 0:  # decide the reply before any sleep: tests reset the state
            state.fail_times -= 1
            status, reply = state.fail_status, b'{"detail": "overloaded"}'
        else:
            scores = [self._entry(item) for item in body["items"]]
            status, reply = 200, json.dumps({"scores": scores[:-1] if state.drop_one else scores})
        time.sleep(state.sleep_s)
        self._send(status, reply.encode() if isinstance(reply, str) else reply)

    @staticmethod
    def _entry(item: dict):
        source, solution = item["data_source"], item["solution_str"]
        if source == "error":
            return {"error": "judge crashed"}
        if source == "none":
            return None
        if source == "metrics":
            return {"score": float(solution), "acc": 1.0}
        return float(solution)

    def _send(self, status: int, payload: bytes) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
            pass

    def log_message(self, *args) -> None:  # keep test output quiet
        pass


class RewardServer(ThreadingHTTPServer):
    daemon_threads = True

    def reset(self) -> None:
        self.received: list[dict] = []
        self.fail_times, self.fail_status, self.sleep_s, self.drop_one = 0, 500, 0.0, False


@pytest.fixture(scope="module")
def server():
    srv = RewardServer(("127.0.0.1", 0), RewardHandler)
    srv.reset()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def url(server) -> str:
    server.reset()
    return f"http://127.0.0.1:{server.server_address[1]}/score"


def item(source: str, solution: str = "1", **extra) -> dict:
    return dict(data_source=source, solution_str=solution, ground_truth="1", extra_info=extra)


def test_scores_extras_and_per_item_errors(server, url):
    client = HTTPReward(url, timeout_s=5, retries=0)
    items = [item("plain", "0.5"), item("metrics", "2"), item("error"), item("none")]
    items[0]["extra_info"] = {"numbers": np.array([1, 2]), "n": np.int64(3)}
    results = client.score(items)
    assert [r.score for r in results] == [0.5, 2.0, 0.0, 0.0]
    assert results[1].extra == {"acc": 1.0} and results[0].ok and results[1].ok
    assert results[2].error == "reward service: judge crashed"
    assert "no score" in results[3].error
    assert all(r.elapsed_s > 0 for r in results)
    sent = server.received[0]["items"]
    assert sent[0] == {
        "data_source": "plain",
        "solution_str": "0.5",
        "ground_truth": "1",
        "extra_info": {"numbers": [1, 2], "n": 3},
    }
    assert (client.calls, client.errors, client.requests, client.retried) == (4, 2, 1, 0)


def test_batches_split_by_batch_size_keep_order(server, url):
    client = HTTPReward(url, batch_size=2)
    results = client.score([item("plain", str(i)) for i in range(5)])
    assert [r.score for r in results] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [len(r["items"]) for r in server.received] == [2, 2, 1]


def test_two_server_errors_are_retried_then_it_succeeds(server, url):
    server.fail_times = 2
    client = HTTPReward(url, timeout_s=5, retries=3, backoff_s=0.05)
    started = time.monotonic()
    assert [r.score for r in client.score([item("plain", "3")])] == [3.0]
    assert time.monotonic() - started >= 0.05 + 0.1  # backoff doubles
    assert len(server.received) == 3 and (client.requests, client.retried) == (3, 2)


def test_persistent_server_errors_name_the_url_and_last_status(server, url):
    server.fail_times, server.fail_status = 10, 503
    client = HTTPReward(url, retries=2, backoff_s=0.01)
    with pytest.raises(RewardServiceError) as info:
        client.score([item("plain")])
    message = str(info.value)
    assert url in message and "after 3 attempt(s)" in message
    assert "HTTP 503" in message and "overloaded" in message
    assert len(server.received) == 3


def test_client_errors_are_not_retried(server, url):
    server.fail_times, server.fail_status = 1, 400
    with pytest.raises(RewardServiceError, match=r"after 1 attempt\(s\); last: HTTP 400"):
        HTTPReward(url, retries=3, backoff_s=0.01).score([item("plain")])
    assert len(server.received) == 1


def test_a_dead_port_gives_a_clear_error():
    with socket.socket() as sock:  # a port that was free a moment ago: nobody listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = f"http://127.0.0.1:{port}/score"
    client = HTTPReward(dead, timeout_s=2, retries=1, backoff_s=0.01)
    with pytest.raises(RewardServiceError) as info:
        client.score([item("plain")])
    message = str(info.value)
    assert dead in message and "after 2 attempt(s)" in message
    assert "refused" in message.lower() and "reachable" in message


def test_a_slow_service_times_out(server, url):
    server.sleep_s = 1.0
    client = HTTPReward(url, timeout_s=0.2, retries=0)
    with pytest.raises(RewardServiceError, match="timed out"):
        client.score([item("plain")])


def test_protocol_violations_are_errors(server, url):
    server.drop_one = True
    with pytest.raises(RewardServiceError, match="sent 2 items.*got 1 scores"):
        HTTPReward(url).score([item("plain"), item("plain")])
    with pytest.raises(ValueError, match="must start with http"):
        HTTPReward("127.0.0.1:80/score")
    with pytest.raises(ValueError, match="retries >= 0"):
        HTTPReward(url, retries=-1)


def test_an_outage_scores_zero_and_stops_only_past_the_error_rate(server, url):
    from rayrl.rewards.budget import ErrorBudget, RewardErrorRateError

    budget = ErrorBudget(HTTPReward(url, timeout_s=5, retries=0), max_error_rate=0.5)
    assert [r.score for r in budget.score([item("plain", "1")] * 4)] == [1.0] * 4
    server.fail_times = 1  # the service is down for one call
    down = budget.score([item("plain", "1")] * 2)
    assert [r.score for r in down] == [0.0, 0.0]
    assert all("reward service outage" in r.error and "HTTP 500" in r.error for r in down)
    assert budget.stats() == {"items": 6, "errors": 2, "outages": 1}
    server.fail_times = 10  # it stays down: 6 of 10 samples failed > 0.5
    with pytest.raises(
        RewardErrorRateError, match=r"6 of 10 samples .* \(60%\), over reward.max_error_rate=0.5"
    ):
        budget.score([item("plain", "1")] * 4)


def test_reward_worker_scores_an_outage_zero_then_stops_the_run(tmp_path):
    from rayrl.config import load_config
    from rayrl.models import build_tiny_model
    from rayrl.rewards.budget import RewardErrorRateError
    from rayrl.trainer.scoring import RewardErrors
    from rayrl.workers import RewardWorker
    from workers_cases import forced_batch, local_worker, prompts

    with socket.socket() as sock:  # a port nobody listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/score"
    model = build_tiny_model(tmp_path / "m", layers=1, hidden=32)
    settings = [f"reward.http.url={dead}", "reward.http.retries=0", "reward.http.timeout_s=2"]
    tolerant = local_worker(
        RewardWorker,
        config=load_config("grpo", [*settings, "reward.http.max_error_rate=1.0"]),
        tokenizer_path=str(model),
    )
    batch = prompts(tolerant.tokenizer, 2)
    batch = forced_batch(batch, token=5, length=3).union(
        batch.select("data_source", "ground_truth")
    )
    out = tolerant.compute_score(batch)
    assert out["scores"].tolist() == [0.0, 0.0]
    assert all("reward service outage" in e for e in out["reward_error"])
    # the run's budget is the trainer's (it sees the rows of every reward worker)
    scored, decode = batch.union(out), tolerant.tokenizer.batch_decode
    with pytest.raises(RewardErrorRateError, match=r"HTTP reward .* failed on 2 of 2 samples"):
        RewardErrors(load_config("grpo", settings)).check(scored, decode)
    own = load_config("grpo", [*settings, "reward.http.max_error_rate=0.4"])
    with pytest.raises(RewardErrorRateError, match=r"over reward.http.max_error_rate=0.4"):
        RewardErrors(own).check(scored, decode)
