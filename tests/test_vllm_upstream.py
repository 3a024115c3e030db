"""Everything a vLLM upstream can get wrong, each fed from a small fake server over real HTTP on
loopback through `VllmEngine` and the proxy: the agent gets an explicit answer (an error status
with a reason, or its reply for an unfaithful turn), the turn is recorded as `error` or
`unfaithful`, and the samples builder trains zero of its tokens. Also: `"token_id:N"` ids (id 0
included) are read correctly and train; a server in raw-logprobs mode is refused at start; a
request in flight across `set_policy` keeps its older version and is noted as straddling it;
session-affine routing across two replicas."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from fakes import in_process

from harnessrl.proxy.config import SamplingConfig
from harnessrl.chat.layer import ChatLayer
from harnessrl.engine.vllm.client import VllmEngine, parse_completion, parse_token_id
from harnessrl.errors import EngineError
from harnessrl.train.samples import build_rows
from harnessrl.types import Rollout, Trace

IDS = [504, 3458, 0, 2]
"""What the fake samples: three tokens and the EOS id `<|im_end|>` (id 0 is `<|endoftext|>`)."""
USER = [{"role": "user", "content": "Say something."}]


def completion_body(prompt: list[int], mode: str) -> tuple[int, Any]:
    """(status, JSON body) the fake answers for `mode`."""
    ids: list[Any] = list(IDS)
    lps: list[Any] = [-0.5, -1.25, -0.75, -0.1]
    choice: dict[str, Any] = {"index": 0, "text": "x", "finish_reason": "stop", "prompt_token_ids": prompt}
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
    match mode:
        case "token_id_strings":
            ids = [f"token_id:{i}" for i in ids]
        case "bad_token_id":
            ids[1] = "token_id:-3"
        case "float_token_id":
            ids[1] = 3458.0
        case "null_logprob":
            lps[1] = None
        case "nan_logprob":
            lps[1] = math.nan
        case "neg_inf_logprob":
            lps[2] = -math.inf
        case "sentinel_logprob":
            lps[0] = -9999.0
        case "positive_logprob":
            lps[0] = 0.5
        case "count_mismatch":
            lps = lps[:-1]
        case "usage_mismatch":
            usage["completion_tokens"] = 7
        case "prompt_mismatch":
            choice["prompt_token_ids"] = prompt[:-1]
        case "empty_choices":
            return 200, {"choices": [], "usage": usage}
        case "missing_choices":
            return 200, {"object": "text_completion", "usage": usage}
        case "missing_token_ids":
            ids = None  # type: ignore[assignment]
        case "bad_finish":
            choice["finish_reason"] = "abort"
        case "http_500":
            return 500, {"error": {"message": "engine core died"}}
        case "http_503":
            return 503, {"error": {"message": "overloaded"}}
    choice["token_ids"] = ids
    choice["logprobs"] = {"token_logprobs": lps, "tokens": [f"token_id:{i}" for i in IDS[:len(lps)]]
                          if mode == "token_id_strings" else ["a"] * len(lps)}
    return 200, {"id": "cmpl-1", "object": "text_completion", "choices": [choice], "usage": usage}


class FakeVllm(BaseHTTPRequestHandler):
    """`/v1/models` and `/v1/completions` of a vLLM server, misbehaving as `mode` says."""

    mode = "ok"
    delay_s = 0.0
    calls: list[dict[str, Any]]
    processed = True
    scales_temperature = True
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, payload: bytes, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload) if length is None else length))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._send(200, json.dumps({"data": [{"id": "base", "parent": None, "max_model_len": 4096}]}).encode())

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append(body)
        prompt = body["prompt"]
        if body.get("top_k") == 1 and body["max_tokens"] == 4:  # the processed-logprobs probe
            lp = 0.0 if self.processed else -0.31
            self._send(200, json.dumps({"choices": [{"token_ids": [5, 6, 7, 8], "finish_reason": "length",
                                                     "logprobs": {"token_logprobs": [lp] * 4}}]}).encode())
            return
        if body.get("logprobs") == 5 and body["max_tokens"] == 1:  # the temperature probe
            # processed logprobs of five candidates: log_softmax(z / T), or of z when the
            # server skips the temperature
            t = body["temperature"] if self.scales_temperature else 1.0
            z = [v / t for v in (2.0, 1.0, 0.5, 0.0, -1.0)]
            lse = math.log(sum(math.exp(v) for v in z))
            top = {f"token_id:{10 + i}": v - lse for i, v in enumerate(z)}
            self._send(200, json.dumps({"choices": [{"token_ids": [10], "finish_reason": "length",
                                                     "logprobs": {"token_logprobs": [z[0] - lse],
                                                                  "top_logprobs": [top]}}]}).encode())
            return
        mode = type(self).mode
        if type(self).delay_s:
            time.sleep(type(self).delay_s)
        if mode == "not_json":
            self._send(200, b"<html>502 Bad Gateway</html>")
            return
        status, payload = completion_body(prompt, mode)
        raw = json.dumps(payload).encode()  # NaN / -Infinity as the stdlib writes them
        if mode == "truncated_body":
            self._send(200, raw[:40], length=len(raw))
            self.close_connection = True
            return
        self._send(status, raw)


@pytest.fixture
def fake_servers() -> Iterator[list[tuple[type[FakeVllm], str]]]:
    made = []
    for _ in range(2):
        handler = type("Fake", (FakeVllm,), {"calls": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        made.append((server, handler, f"http://127.0.0.1:{server.server_address[1]}"))
    yield [(h, url) for _, h, url in made]
    for server, _, _ in made:
        server.shutdown()
        server.server_close()


def trained_tokens(trace: Trace) -> int:
    rollout = Rollout(rollout_id="r", group_id=0, task_id="t", harness="h", status="ok", reward=1.0, trace=trace)
    rows, _ = build_rows(rollout)
    return sum(r.num_trained_tokens for r in rows)


async def one_call(engine: VllmEngine, tokenizer) -> tuple[int, dict[str, Any], Trace]:
    http, store = in_process(engine, ChatLayer(tokenizer), sampling=SamplingConfig(max_tokens=8, temperature=1.0))
    session = store.open("r")
    async with http:
        r = await http.post("/v1/chat/completions", json={"messages": USER},
                            headers={"authorization": f"Bearer {session.key}"})
    return r.status_code, r.json(), store.close(session.session_id)


async def call_in_mode(fake_servers, tokenizer, mode: str, **engine_args: Any) -> tuple[Any, int, dict[str, Any], Trace]:
    """`one_call` through a `VllmEngine` of the first fake server answering in `mode`;
    (that server's handler, status, body, trace)."""
    handler, url = fake_servers[0]
    engine = VllmEngine([url], **engine_args)
    handler.mode = mode
    try:
        status, body, trace = await one_call(engine, tokenizer)
    finally:
        engine.close()
    return handler, status, body, trace


ERROR_MODES = {
    "bad_token_id": "is not a token id", "float_token_id": "is not a token id",
    "count_mismatch": "3 logprobs for 4 token ids", "usage_mismatch": "usage.completion_tokens=7",
    "prompt_mismatch": "prompt_token_ids differ", "empty_choices": "no choices", "missing_choices": "no choices",
    "missing_token_ids": "token_ids is missing", "bad_finish": "finish_reason='abort'",
    "http_500": "HTTP 500", "http_503": "HTTP 503", "not_json": "not JSON", "truncated_body": "cut its response short",
}
UNFAITHFUL_MODES = {
    "null_logprob": "completion_logprobs[1]=nan", "nan_logprob": "completion_logprobs[1]=nan",
    "neg_inf_logprob": "completion_logprobs[2]=-inf", "sentinel_logprob": "completion_logprobs[0]=-9999.0",
    "positive_logprob": "completion_logprobs[0]=0.5",
}


@pytest.mark.parametrize("mode", sorted(ERROR_MODES))
async def test_an_untrustworthy_response_is_an_error_turn_the_agent_is_told(fake_servers, tokenizer,
                                                                           mode: str) -> None:
    _, status, body, trace = await call_in_mode(fake_servers, tokenizer, mode, request_timeout_s=5.0)
    assert status == 503 and body["error"]["code"] == "engine_error"
    assert ERROR_MODES[mode] in body["error"]["message"]
    (turn,) = trace.turns
    assert turn.status == "error" and ERROR_MODES[mode] in turn.error and turn.completion_ids == []
    assert trained_tokens(trace) == 0


@pytest.mark.parametrize("mode", sorted(UNFAITHFUL_MODES))
async def test_a_bad_logprob_is_an_unfaithful_turn_never_trained(fake_servers, tokenizer, mode: str) -> None:
    _, status, body, trace = await call_in_mode(fake_servers, tokenizer, mode)
    assert status == 200 and body["choices"][0]["message"]["content"] is not None  # the agent still gets its reply
    (turn,) = trace.turns
    assert turn.status == "unfaithful" and UNFAITHFUL_MODES[mode] in turn.error
    assert turn.completion_ids == IDS
    assert trained_tokens(trace) == 0


@pytest.mark.parametrize("mode", ["ok", "token_id_strings"])
async def test_good_responses_train_every_sampled_id_including_id_0(fake_servers, tokenizer, mode: str) -> None:
    handler, status, _, trace = await call_in_mode(fake_servers, tokenizer, mode)
    (turn,) = trace.turns
    assert status == 200 and turn.status == "ok"
    assert turn.completion_ids == IDS and turn.completion_logprobs == [-0.5, -1.25, -0.75, -0.1]
    assert trained_tokens(trace) == len(IDS)
    sent = handler.calls[-1]
    assert sent["prompt"] == turn.prompt_ids and sent["logprobs"] == 0 and sent["return_token_ids"] is True
    assert sent["model"] == "base" and sent["temperature"] == 1.0 and sent["max_tokens"] == 8


async def test_a_timeout_is_an_error_turn(fake_servers, tokenizer) -> None:
    handler, url = fake_servers[0]
    engine = VllmEngine([url], request_timeout_s=0.5)
    handler.delay_s = 2.0
    status, body, trace = await one_call(engine, tokenizer)
    engine.close()
    assert status == 503 and "did not answer within 0.5 s" in body["error"]["message"]
    assert trace.turns[0].status == "error" and trained_tokens(trace) == 0


def test_a_server_in_raw_logprobs_mode_is_refused(fake_servers) -> None:
    handler, url = fake_servers[0]
    handler.processed = False
    with pytest.raises(EngineError, match="not in processed-logprobs mode.*--logprobs-mode processed_logprobs"):
        VllmEngine([url])


def test_a_server_whose_processed_logprobs_skip_the_temperature_is_refused(fake_servers) -> None:
    """It passes the top_k=1 probe (its processed logprobs are 0 there) but its logprobs at
    T=0.5 are those of T=1: the two-temperature probe refuses it; a scaling server passes."""
    from harnessrl.engine.vllm.client import check_temperature_scaling

    handler, url = fake_servers[0]
    VllmEngine([url]).close()  # scales the temperature: accepted
    handler.scales_temperature = False
    with pytest.raises(EngineError, match=r"does not scale its processed logprobs by the temperature.*a ratio of "
                                          r"1\.000 where sampling at T=0\.5 gives 2"):
        VllmEngine([url])
    assert check_temperature_scaling("u", {1.0: {1: -0.5, 2: -1.5}, 0.5: {1: -0.2, 2: -2.2}}) == pytest.approx(2.0)


def test_an_unreachable_or_wrong_server_is_refused_at_start(fake_servers) -> None:
    _, url = fake_servers[0]
    with pytest.raises(EngineError, match="does not serve model 'other'"):
        VllmEngine([url], served_model="other")
    with pytest.raises(EngineError, match="below engine.max_context_tokens=8192"):
        VllmEngine([url], max_context_tokens=8192)
    with pytest.raises(EngineError, match="unreachable"):
        VllmEngine(["http://127.0.0.1:9"])


def test_token_ids_parse_strictly() -> None:
    assert parse_token_id("token_id:0", "x") == 0 and parse_token_id(0, "x") == 0
    for bad in ("token_id:", "token_id:1a", "12", True, -1, 1.0, None):
        with pytest.raises(EngineError, match="not a token id"):
            parse_token_id(bad, "x")
    _, body = completion_body([1, 2], "null_logprob")
    ids, lps, finish = parse_completion(body, [1, 2], 8)
    assert ids == IDS and math.isnan(lps[1]) and finish == "stop"
    with pytest.raises(EngineError, match="4 completion ids for max_tokens=3"):
        parse_completion(completion_body([1, 2], "ok")[1], [1, 2], 3)


async def test_a_request_in_flight_across_an_update_keeps_its_older_version(fake_servers, tokenizer) -> None:
    handler, url = fake_servers[0]
    engine = VllmEngine([url])
    engine.set_policy(4)
    handler.delay_s = 0.6
    timer = threading.Timer(0.2, lambda: engine.set_policy(5, model="adapter-5"))
    timer.start()
    status, _, trace = await one_call(engine, tokenizer)
    timer.join()
    (turn,) = trace.turns
    assert status == 200 and turn.policy_version == 4 and handler.calls[-1]["model"] == "base"
    assert "straddled_update: sent under policy_version=4" in turn.notes
    # the policy version, then the session's prefix-cache scope (its group, else the session)
    assert handler.calls[-1]["cache_salt"].startswith("v4-s")
    handler.delay_s = 0.0
    _, _, trace = await one_call(engine, tokenizer)
    engine.close()
    assert trace.turns[0].policy_version == 5 and not trace.turns[0].notes
    assert handler.calls[-1]["model"] == "adapter-5" and handler.calls[-1]["cache_salt"].startswith("v5-adapter-5-s")


async def test_rollouts_stick_to_one_replica_and_spread_across_replicas(fake_servers, tokenizer) -> None:
    (h0, u0), (h1, u1) = fake_servers
    engine = VllmEngine([u0, u1])
    assert engine.replica_urls == (u0, u1)
    http, store = in_process(engine, ChatLayer(tokenizer), sampling=SamplingConfig(max_tokens=8, temperature=1.0))
    sessions = [store.open(f"r{i}") for i in range(4)]
    n0, n1 = len(h0.calls), len(h1.calls)
    async with http:
        for _ in range(3):  # three turns per rollout, interleaved
            for s in sessions:
                r = await http.post("/v1/chat/completions", json={"messages": USER},
                                    headers={"authorization": f"Bearer {s.key}"})
                assert r.status_code == 200
    replicas = [engine.replica_of(s.session_id) for s in sessions]
    engine.close()
    assert sorted(replicas) == [0, 0, 1, 1]  # spread evenly
    assert (len(h0.calls) - n0, len(h1.calls) - n1) == (6, 6)  # each rollout's 3 turns on its own replica
