"""RemoteEngine (and the node over it) against servers that change, trickle, restart their counters
or send numbers that are none: kind and n_ctx detected again, constrained requests never sent to a
server of unknown kind, total deadlines of plain calls, /metrics resets and NaN samples, the event
reader's cost on small reads, the local fallback's own prompt limit, hostile numbers.

The servers are :class:`support.servers.ScriptedStreamServer` fakes on loopback: no real server
swaps its kind behind one address, trickles a tokenizer answer or reports a negative token count on
demand. Their answers copy the shapes of the real ones (llama-server's /props and /tokenize, vLLM's
/v1/models and Prometheus names); the same engine paths against real servers are in
test/remote/test_engine.py.
"""
from __future__ import annotations

import json
import math
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest
from action_msgs.msg import GoalStatus

from gemma_spec_ros.client import key_values, wait_until
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.fallback import FallbackEngine
from gemma_spec_ros.engine.remote import (KIND_LLAMA_SERVER, KIND_VLLM, RemoteConfig, RemoteEngine,
                                          RemoteError)
from gemma_spec_ros.engine.remote.metrics import parse_prometheus
from gemma_spec_ros.engine.remote.sse import SseReader
from gemma_spec_ros.engine.config import EngineConfig, ModelConfig, SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest
from gemma_spec_ros.engine.errors import PromptTooLongError
from support.servers import SSE_CHUNKED_HEAD, ScriptedStreamServer, chunk, free_port, json_answer
from support.tiny_gguf import write_tiny_gguf

SPEC = SpecConfig(mode="off")
GRAMMAR = 'root ::= " yes" | " no"'
#: How long a trickling answer lasts at most: far beyond every bound asserted.
TRICKLE_SECONDS = 12.0


def completion(text: str = " yes", usage: Any = None, timings: Any = None,
               marks: Optional[Dict[str, str]] = None) -> Callable[[Callable[[bytes], bool]], None]:
    """A chunked completion stream: one text chunk, a last chunk with finish_reason stop (and
    ``usage`` / ``timings`` when given), [DONE]. ``usage`` may be a raw JSON text (for NaN);
    ``marks`` (``model``, ``system_fingerprint``) go into every chunk, as real servers put them."""
    first: Dict[str, Any] = {"choices": [{"text": text, "finish_reason": None}], **(marks or {})}
    last: Dict[str, Any] = {"choices": [{"text": "", "finish_reason": "stop"}], **(marks or {})}
    if timings is not None:
        last["timings"] = timings
    last_json = json.dumps(last)
    if usage is not None:
        usage_json = usage if isinstance(usage, str) else json.dumps(usage)
        last_json = last_json[:-1] + f', "usage": {usage_json}}}'
    events = [json.dumps(first), last_json, "[DONE]"]

    def script(send: Callable[[bytes], bool]) -> None:
        send(SSE_CHUNKED_HEAD + b"".join(chunk(f"data: {e}\n\n".encode()) for e in events) + b"0\r\n\r\n")
    return script


def vllm_routes(metrics: Callable[[], str] = lambda: "", max_model_len: int = 4096) -> Dict[str, Any]:
    """vLLM's answers: an empty /health, max_model_len in /v1/models, /tokenize with a count."""
    def metrics_script(send: Callable[[bytes], bool]) -> None:
        json_answer(metrics().encode())(send)
    return {"GET /health": json_answer(b""), "GET /metrics": metrics_script,
            "GET /v1/models": json_answer({"data": [{"id": "big", "max_model_len": max_model_len}]}),
            "POST /tokenize": json_answer({"count": 3})}


def llama_server_routes(n_ctx: Any = 512, tokens: Any = (1, 2, 3)) -> Dict[str, Any]:
    """llama-server's answers: {"status": "ok"} on /health, n_ctx in /props, tokens from /tokenize."""
    return {"GET /health": json_answer({"status": "ok"}),
            "GET /props": json_answer({"default_generation_settings": {"n_ctx": n_ctx}}),
            "GET /v1/models": json_answer({"data": [{"id": "small"}]}),
            "POST /tokenize": json_answer({"tokens": list(tokens) if isinstance(tokens, tuple) else tokens})}


@pytest.fixture
def engine_on() -> Iterator[Callable[..., RemoteEngine]]:
    """``engine_on(url, **config)``: a RemoteEngine (no prober unless asked), closed afterwards."""
    engines: List[RemoteEngine] = []

    def make(url: str, **config: Any) -> RemoteEngine:
        settings = {"connect_timeout": 1.0, "read_timeout": 10.0, "probe_period": 0, **config}
        engines.append(RemoteEngine(RemoteConfig(url=url, **settings), SPEC))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def sent_bodies(server: ScriptedStreamServer) -> List[Dict[str, Any]]:
    return [json.loads(body) for body in server.bodies("POST /v1/completions")]


# -- kind and n_ctx -----------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_a_server_replaced_behind_the_url_is_identified_again(engine_on) -> None:
    """The box behind remote.url changes from vLLM to llama-server: the kind and n_ctx were kept
    from the first detection, so the goal check let through a request too long for the new
    server's context, and a grammar was sent in vLLM's field, which llama-server ignores
    (unconstrained text). Now the changed server is detected again before a constrained request."""
    with ScriptedStreamServer(completion(), vllm_routes()) as first:
        engine = engine_on(first.url)
        assert (engine.kind, engine.n_ctx) == (KIND_VLLM, 4096)
        port = first.port
    with ScriptedStreamServer(completion(), llama_server_routes(n_ctx=512), port=port) as second:
        steps = list(engine.generate(GenerationRequest("Is water wet? Answer:", max_tokens=4, grammar=GRAMMAR)))
        assert steps[-1].finish_reason == "stop"
        [body] = sent_bodies(second)
        assert body.get("grammar") == GRAMMAR and "structured_outputs" not in body
        assert (engine.kind, engine.n_ctx) == (KIND_LLAMA_SERVER, 512)
        with pytest.raises(PromptTooLongError, match="server's context of 512"):
            engine.check_request(GenerationRequest("word " * 100, max_tokens=500))


@pytest.mark.timeout(60)
def test_the_prober_sees_a_replaced_server_by_its_health_answer(engine_on) -> None:
    """With the prober running, a server replaced between two probes (no failure seen in between)
    is told by its /health answer, and its n_ctx is read again for the goal checks."""
    with ScriptedStreamServer(completion(), vllm_routes()) as first:
        engine = engine_on(first.url, probe_period=0.1)
        assert engine.n_ctx == 4096
        port = first.port
    with ScriptedStreamServer(completion(), llama_server_routes(n_ctx=512), port=port):
        wait_until(lambda: engine.n_ctx == 512 and engine.server.identified, 20, "n_ctx detected again")
        assert engine.kind == KIND_LLAMA_SERVER


#: What a proxy in front of the backends answers to GET /health itself, whichever backend serves.
PROXY_HEALTH = {"GET /health": json_answer({"status": "ok"})}
#: The marks each backend's chunks carry (server.py ServerMarks): vLLM's model and no
#: system_fingerprint, llama-server's with its build.
VLLM_MARKS = {"model": "big"}
LLAMA_SERVER_MARKS = {"model": "small.gguf", "system_fingerprint": "b6000-1a2b3c"}


def constrained() -> GenerationRequest:
    return GenerationRequest("Is water wet? Answer:", max_tokens=4, grammar=GRAMMAR)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("noticed_by", ["the constrained request", "an earlier stream"])
def test_a_backend_swapped_behind_a_proxy_is_noticed_by_its_stream(engine_on, noticed_by: str) -> None:
    """A proxy switches its backend from vLLM to llama-server and answers /health itself, the same
    before and after: the probe saw the same server, so every constrained request went out with
    vLLM's structured_outputs, which llama-server ignores (unconstrained text). Now the streams'
    marks tell the swap: a constrained request whose own stream shows it is closed before its first
    Step and sent again with llama-server's grammar once the server is identified anew; a swap seen
    by an earlier stream has the next constrained request built for llama-server from the start."""
    with ScriptedStreamServer(completion(marks=VLLM_MARKS), {**vllm_routes(), **PROXY_HEALTH}) as first:
        engine = engine_on(first.url)
        assert engine.kind == KIND_VLLM
        list(engine.generate(constrained()))  # the stream that teaches the backend's marks
        assert "structured_outputs" in sent_bodies(first)[0]
        port = first.port
    with ScriptedStreamServer(completion(marks=LLAMA_SERVER_MARKS), {**llama_server_routes(), **PROXY_HEALTH},
                              port=port) as second:
        if noticed_by == "an earlier stream":
            assert list(engine.generate(GenerationRequest("Hi", max_tokens=4)))[-1].finish_reason == "stop"
            assert not engine.server.identified
        steps = list(engine.generate(constrained()))
        assert [s.text for s in steps] == [" yes", ""] and steps[-1].finish_reason == "stop"
        bodies = sent_bodies(second)
        assert bodies[-1].get("grammar") == GRAMMAR and "structured_outputs" not in bodies[-1]
        assert len(bodies) == 2 and engine.kind == KIND_LLAMA_SERVER and engine.n_ctx == 512
        if noticed_by == "the constrained request":
            assert "structured_outputs" in bodies[0]  # the first try, closed at its first chunk
        list(engine.generate(constrained()))
        assert len(sent_bodies(second)) == 3 and len(second.bodies("GET /props")) == 1  # nothing more


@pytest.mark.timeout(60)
def test_a_backend_of_the_same_kind_is_identified_again_without_a_resend(engine_on) -> None:
    """A balancer's other backend, of the same kind but another model and context: its stream's
    marks differ only in the model, so the constrained request it served (built with the right
    field) is not sent again, and the next constrained request reads the new context first."""
    with ScriptedStreamServer(completion(marks=VLLM_MARKS), {**vllm_routes(), **PROXY_HEALTH}) as first:
        engine = engine_on(first.url)
        list(engine.generate(constrained()))
        port = first.port
    with ScriptedStreamServer(completion(marks={"model": "bigger"}),
                              {**vllm_routes(max_model_len=2048), **PROXY_HEALTH}, port=port) as second:
        list(engine.generate(constrained()))
        assert len(sent_bodies(second)) == 1 and engine.n_ctx == 4096 and not engine.server.identified
        list(engine.generate(constrained()))
        assert len(sent_bodies(second)) == 2 and (engine.kind, engine.n_ctx) == (KIND_VLLM, 2048)
        assert all("structured_outputs" in body for body in sent_bodies(second))


def failing_routes() -> Dict[str, Any]:
    """A server that answers HTTP 503 to everything but a completion (which it streams)."""
    error = json_answer({"error": {"message": "loading model"}}, status="503 Service Unavailable")
    return {"GET /health": error, "GET /props": error, "GET /v1/models": error, "POST /tokenize": error}


@pytest.mark.timeout(60)
def test_a_constrained_request_to_a_server_not_identified_now_is_refused(engine_on) -> None:
    """A server known as vLLM is replaced by one that answers errors while it loads: the kind is
    stale, so a constrained request is refused with the reason and nothing is sent (before: the
    body built for vLLM went out, and a server of another kind returns unconstrained text). A
    request without a constraint is still served."""
    with ScriptedStreamServer(completion(), vllm_routes()) as first:
        engine = engine_on(first.url)
        assert engine.kind == KIND_VLLM
        port = first.port
    with ScriptedStreamServer(completion(), failing_routes(), port=port) as second:
        with pytest.raises(RemoteError, match=r"not identified now .*refused rather than sent unconstrained"):
            list(engine.generate(GenerationRequest("Is water wet? Answer:", max_tokens=4, grammar=GRAMMAR)))
        assert sent_bodies(second) == []
        steps = list(engine.generate(GenerationRequest("Is water wet? Answer:", max_tokens=4)))
        assert steps[-1].finish_reason == "stop" and len(sent_bodies(second)) == 1


# -- /metrics --------------------------------------------------------------------------------------
def vllm_metrics(drafts: float, drafted: float, accepted: float, generated: float = 100.0) -> str:
    return (f"vllm:spec_decode_num_drafts_total {drafts}\n"
            f"vllm:spec_decode_num_draft_tokens_total {drafted}\n"
            f"vllm:spec_decode_num_accepted_tokens_total {accepted}\n"
            f"vllm:generation_tokens_total {generated}\n")


def test_prometheus_samples_that_are_not_counts_are_left_out() -> None:
    text = ("vllm:spec_decode_num_drafts_total NaN\nvllm:spec_decode_num_draft_tokens_total +Inf\n"
            "vllm:spec_decode_num_accepted_tokens_total -3\nvllm:generation_tokens_total 7\n")
    assert parse_prometheus(text) == {"generation_tokens": 7.0}


@pytest.mark.timeout(60)
def test_a_counter_reset_and_a_nan_sample_keep_tau_finite(engine_on) -> None:
    """The server restarts (its counters start again from 0): the counts since configure went
    negative, were clamped to 0 and tau read NaN; a NaN sample made rolling_stats() (and so every
    /diagnostics tick) and generate() raise ValueError. Now a reset moves the baseline and
    non-finite samples are left out."""
    metrics = {"text": vllm_metrics(10, 40, 20)}
    with ScriptedStreamServer(completion(), vllm_routes(lambda: metrics["text"])) as server:
        engine = engine_on(server.url)  # its first probe takes the baseline
        metrics["text"] = vllm_metrics(20, 80, 40)
        engine.server.probe()
        assert engine.rolling_stats().mean_acceptance_length == pytest.approx(1 + 20 / 10)
        metrics["text"] = vllm_metrics(5, 20, 10)  # restarted, then 5 drafts
        engine.server.probe()
        rolling = engine.rolling_stats()
        assert (rolling.num_drafts, rolling.num_accepted_tokens) == (15, 30)
        assert rolling.mean_acceptance_length == pytest.approx(1 + 30 / 15)
        metrics["text"] = vllm_metrics(float("nan"), 20, 10)
        engine.server.probe()
        assert math.isfinite(engine.rolling_stats().mean_acceptance_length)
        steps = list(engine.generate(GenerationRequest("Hi", max_tokens=4)))
        assert steps[-1].finish_reason == "stop"


# -- total deadlines of plain calls ----------------------------------------------------------------
def trickle(head: bytes) -> Callable[[Callable[[bytes], bool]], None]:
    """A plain answer whose head promises 100 bytes, then one byte every 0.25 s."""
    def script(send: Callable[[bytes], bool]) -> None:
        send(head)
        deadline = time.monotonic() + TRICKLE_SECONDS
        while time.monotonic() < deadline and send(b" "):
            time.sleep(0.25)
    return script


TRICKLE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"


@pytest.mark.timeout(60)
def test_a_trickling_tokenizer_answer_ends_at_the_cancel(engine_on) -> None:
    """The tokenizer's answer trickles a byte every 0.25 s: each read came within the per-read
    timeout, so generate() waited for the whole answer, past the goal's budget and its cancel (the
    review measured 9.8 s for a 1 s budget cancelled at 0.5 s). Now the call ends at the cancel."""
    routes = {**llama_server_routes(), "POST /tokenize": trickle(TRICKLE_HEAD)}
    with ScriptedStreamServer(completion(), routes) as server:
        engine = engine_on(server.url, connect_timeout=5.0)
        assert engine.kind == KIND_LLAMA_SERVER
        cancel = threading.Event()
        threading.Timer(0.5, cancel.set).start()
        started = time.monotonic()
        steps = list(engine.generate(GenerationRequest("Hi", max_tokens=4, time_budget=30.0), cancel))
        assert steps[-1].finish_reason == "cancelled"
        assert time.monotonic() - started < 3.0


@pytest.mark.timeout(60)
def test_a_trickling_answer_ends_at_the_budget_and_probes_at_connect_timeout(engine_on) -> None:
    """The same trickle ends a request at its time budget (finish_reason timeout), and a probe of
    a trickling /health returns within connect_timeout, not when the answer is whole."""
    routes = {**llama_server_routes(), "POST /tokenize": trickle(TRICKLE_HEAD)}
    with ScriptedStreamServer(completion(), routes) as server:
        engine = engine_on(server.url, connect_timeout=5.0)
        started = time.monotonic()
        steps = list(engine.generate(GenerationRequest("Hi", max_tokens=4, time_budget=1.0)))
        assert steps[-1].finish_reason == "timeout"
        assert time.monotonic() - started < 4.0
    routes = {**llama_server_routes(), "GET /health": trickle(TRICKLE_HEAD)}
    with ScriptedStreamServer(completion(), routes) as server:
        started = time.monotonic()
        engine = engine_on(server.url, connect_timeout=1.0)  # its first probe
        assert time.monotonic() - started < 4.0
        assert engine.server.last.reachable is False and "no whole answer within 1 s" in engine.server.last.error


# -- the event reader --------------------------------------------------------------------------------
def _read_one_byte_at_a_time(size: int) -> float:
    """Seconds the reader takes for one event of ``size`` bytes arriving one byte per read (best of 3)."""
    payload = b"data: " + b"x" * size + b"\n"
    best = math.inf
    for _ in range(3):
        reads = (payload[i:i + 1] for i in range(len(payload) + 1))  # the last one is b"": the end
        started = time.perf_counter()
        events = list(SseReader(lambda n: next(reads)))
        best = min(best, time.perf_counter() - started)
        assert len(events) == 1 and len(events[0]) == size
    return best


def test_the_event_reader_is_linear_in_small_reads() -> None:
    """One-byte reads of a long line: the reader re-joined and re-split the whole pending line at
    every read, so 4x the bytes cost 16x the time (256 KiB took 23 s in the review). Now each byte
    is searched and copied once: about 4x. The bound, 8x, sits between the two growth rates (a
    growth check, not a speed goal: both sizes run in this process, one after the other)."""
    small, large = _read_one_byte_at_a_time(32 * 1024), _read_one_byte_at_a_time(128 * 1024)
    assert large / small < 8.0, (small, large)


# -- the local fallback ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = write_tiny_gguf(tmp_path_factory.mktemp("fallback") / "tiny.gguf", vocab_size=64, seed=3)
    engine = Engine(EngineConfig(target=ModelConfig(path=str(path), n_ctx=512, n_threads=1), spec=SPEC))
    yield engine
    engine.close()


def test_the_local_fallback_checks_max_prompt_tokens_on_its_own_count(tiny_local: Engine) -> None:
    """The goal check passed the prompt on the remote estimate (16 bytes per token); served by the
    local fallback, the prompt was never checked against limits.max_prompt_tokens (the review: 3,002
    tokens evaluated under a limit of 300). Now the fallback counts and refuses it."""
    primary = RemoteEngine(RemoteConfig(url=f"http://127.0.0.1:{free_port()}", connect_timeout=0.5,
                                        probe_period=0, max_prompt_tokens=40), SPEC)
    engine = FallbackEngine(primary, tiny_local)
    try:
        long_request = GenerationRequest("ab ba " * 40, max_tokens=2)
        estimate = engine.count_prompt_tokens(long_request)
        assert estimate <= 40 < tiny_local.count_prompt_tokens(long_request)
        with pytest.raises(PromptTooLongError, match=r"limits.max_prompt_tokens=40 \(counted by the local"):
            list(engine.generate(long_request))
        steps = list(engine.generate(GenerationRequest("ab ba", max_tokens=2)))
        assert steps[-1].finish_reason in ("stop", "length")
        assert engine.status()["served by"] == "local"
    finally:
        primary.close()


# -- numbers that are none -------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("usage, timings, tokens, needle", [
    ({"completion_tokens": -5}, None, (1, 2), "usage.completion_tokens=-5: not a count"),
    ({"completion_tokens": "many"}, None, (1, 2), "usage.completion_tokens=many: not a count"),
    ({"prompt_tokens": 1.5}, None, (1, 2), "usage.prompt_tokens=1.5: not a count"),
    ('{"completion_tokens": NaN}', None, (1, 2), "usage.completion_tokens=nan: not a count"),
    (None, {"prompt_ms": -1, "predicted_n": 2}, (1, 2), "timings.prompt_ms=-1: not a duration"),
    (None, {"draft_n": 2 ** 40}, (1, 2), "timings.draft_n=1099511627776: not a count"),
    ("[1, 2]", None, (1, 2), "usage as list, not an object"),
    (None, None, 5, "tokens as int, not a list"),
])
def test_numbers_that_are_none_end_the_request_with_the_reason(engine_on, usage, timings, tokens,
                                                                 needle: str) -> None:
    """Server numbers were taken with int()/len(): a wrong type raised TypeError/ValueError (an
    "internal error"), a negative count passed into the stats. Now each is checked in one place
    and ends the request with a RemoteError that names the field."""
    with ScriptedStreamServer(completion(usage=usage, timings=timings), llama_server_routes(tokens=tokens)) as server:
        engine = engine_on(server.url)
        with pytest.raises(RemoteError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            list(engine.generate(GenerationRequest("Hi", max_tokens=4)))


def test_a_context_length_that_is_no_count_is_unknown(engine_on) -> None:
    with ScriptedStreamServer(completion(), llama_server_routes(n_ctx=-1)) as server:
        engine = engine_on(server.url)
        assert (engine.kind, engine.n_ctx) == (KIND_LLAMA_SERVER, 0)


@pytest.mark.timeout(120)
def test_a_negative_count_ends_the_goal_through_the_node_s_error_path(ros: None) -> None:
    """On the node: a server reporting completion_tokens -5 ended the goal outside the execute
    callback's error path (the result message's uint32 setter raised after the generation), so
    rclpy aborted it with an empty result and /diagnostics never counted it. Now the goal ends
    ``error`` with the reason, counted as a failed request."""
    from support.node import node_factory
    with ScriptedStreamServer(completion(usage={"completion_tokens": -5}), llama_server_routes()) as server:
        with node_factory() as serve:
            served = serve("gemma_spec_server_faults", {
                "backend": "remote", "remote.url": server.url, "remote.connect_timeout": 1.0,
                "remote.probe_period": 0.0, "generation.max_tokens": 4, "diagnostics.period": 0.2})
            client = served.client
            run = client.send(prompt="Hi", max_tokens=4, temperature=0.0)
            result = run.wait_result(timeout=30)
            assert run.status == GoalStatus.STATUS_ABORTED
            assert result.finish_reason == "error" and "usage.completion_tokens=-5: not a count" in result.error
            assert result.text == " yes"
            status = client.wait_status(served.status_name, lambda s: key_values(s)["requests failed"] == "1")
            assert key_values(status)["internal errors"] == "0"
            again = client.send(prompt="Hi", max_tokens=4, temperature=0.0)
            assert again.wait_result(timeout=30).finish_reason == "error"
