"""RemoteEngine against real servers on loopback: llama-cpp-python's ``llama_cpp.server`` on the
embedded model (streaming, cancel, HTTP errors, server death and restart, local fallback), and
llama.cpp's ``llama-server`` with n-gram speculation for tau (skipped where it is not built).

The engine-level half of the remote backend; the node on real rclpy is in test/remote/test_node.py.
"""
from __future__ import annotations

import contextlib
import io
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, List

import pytest

from gemma_spec_ros.engine.engine import Engine, Step
from gemma_spec_ros.engine.fallback import FallbackEngine
from gemma_spec_ros.engine.remote import (KIND_LLAMA_CPP_PYTHON, KIND_LLAMA_SERVER, REMOTE_MODE,
                                          RemoteConfig, RemoteEngine, RemoteError,
                                          ServerUnreachableError, parse_prometheus)
from gemma_spec_ros.engine.remote.sse import SseReader, choice, parse_chunk
from gemma_spec_ros.engine.config import EngineConfig, ModelConfig, SpecConfig
from gemma_spec_ros.engine.request import GenerationRequest
from gemma_spec_ros.engine.errors import PromptTooLongError
from support.engine import collect
from support.servers import (API_KEY, API_KEY_ENV, LLAMA_SERVER, Server, free_port, llama_cpp_server,
                            llama_server, running_llama_cpp_server)

CODE_PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
SPEC = SpecConfig(mode="lookup")


@pytest.fixture(scope="module")
def server(embedded_model_path: Path, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[Server]:
    """llama_cpp.server on the embedded model, requiring an API key."""
    yield from running_llama_cpp_server(embedded_model_path, tmp_path_factory.mktemp("servers"))


@pytest.fixture
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(API_KEY_ENV, API_KEY)
    return API_KEY_ENV


@pytest.fixture
def remote_engine(server: Server, api_key: str) -> Iterator[Callable[..., RemoteEngine]]:
    """``remote_engine(**config)``: a RemoteEngine on the module's server with its API key and
    ``config`` over no background probe; every one made is closed when the test ends."""
    with contextlib.ExitStack() as made:
        def make(**config: Any) -> RemoteEngine:
            engine = RemoteEngine(RemoteConfig(**{"url": server.url, "api_key_env": api_key,
                                                  "probe_period": 0, **config}), SPEC)
            made.callback(engine.close)
            return engine
        yield make


@pytest.fixture
def engine(remote_engine: Callable[..., RemoteEngine]) -> RemoteEngine:
    return remote_engine(connect_timeout=2.0, read_timeout=60.0, probe_period=0.2)


def run(engine: RemoteEngine, request: GenerationRequest,
        cancel: threading.Event = None) -> List[Step]:
    return collect(engine, request, cancel).steps


# -- pure parts --------------------------------------------------------------------------------------
def test_sse_reader_keeps_utf8_characters_whole_across_reads() -> None:
    """A multi-byte character split between two socket reads comes out whole, in one event."""
    payload = 'data: {"choices": [{"text": "\u00e9\u4e16\U0001F916"}]}\n\ndata: [DONE]\n'.encode()
    reads = [payload[i:i + 1] for i in range(len(payload))]  # one byte per read
    feed = iter(reads + [b""])
    events = list(SseReader(lambda n: next(feed)))
    assert events[1] == "[DONE]"
    assert choice(parse_chunk(events[0]))[0] == "\u00e9\u4e16\U0001F916"
    assert list(SseReader(io.BytesIO(b": ping\r\n\r\n").read1)) == []


def test_prometheus_counters_of_llama_server_and_vllm() -> None:
    text = ("# TYPE llamacpp:spec_decode_num_drafts_total counter\n"
            "llamacpp:spec_decode_num_drafts_total 12\n"
            "llamacpp:spec_decode_num_draft_tokens_total 40\n"
            "llamacpp:spec_decode_num_accepted_tokens_total 25\n"
            "llamacpp:tokens_predicted_total 90\n"
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 10.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9.0\n')
    counters = parse_prometheus(text)
    assert counters == {"spec_decode_num_drafts": 15.0, "spec_decode_num_draft_tokens": 40.0,
                        "spec_decode_num_accepted_tokens": 25.0, "generation_tokens": 100.0}


def test_config_refuses_bad_urls_and_a_missing_key_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for url in ("127.0.0.1:8080", "ftp://host/", "http://"):
        with pytest.raises(ValueError, match="remote.url"):
            RemoteConfig(url=url)
    monkeypatch.delenv("GEMMA_SPEC_NO_SUCH_KEY", raising=False)
    with pytest.raises(ValueError, match="GEMMA_SPEC_NO_SUCH_KEY.*not set"):
        RemoteConfig(url="http://127.0.0.1:1", api_key_env="GEMMA_SPEC_NO_SUCH_KEY")
    with pytest.raises(ValueError, match="read_timeout"):
        RemoteConfig(url="http://127.0.0.1:1", read_timeout=0.0)


# -- llama_cpp.server ----------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_streams_text_per_chunk_with_stats(engine: RemoteEngine) -> None:
    """Greedy completion: one Step per chunk, whole text, TTFT and tokens/s, no invented tau."""
    assert engine.kind == KIND_LLAMA_CPP_PYTHON
    request = GenerationRequest(prompt=CODE_PROMPT, max_tokens=12)
    steps = run(engine, request)
    *chunks, last = steps
    assert last.finish_reason == "length" and all(s.finish_reason is None for s in chunks)
    assert len(chunks) >= 2 and all(s.text for s in chunks)
    stats = last.stats
    assert stats.num_generated_tokens == 12 and stats.spec_mode == REMOTE_MODE
    assert stats.num_prompt_tokens > 10  # llama_cpp.server streams no usage: its tokenizer counted
    assert 0 < stats.time_to_first_token < 30 and stats.tokens_per_second > 0
    # llama_cpp.server runs no speculation and reports none: unknown, not zero
    assert math.isnan(stats.mean_acceptance_length) and math.isnan(stats.acceptance_rate)
    assert run(engine, request)[-1].stats.num_generated_tokens == 12  # the engine is reusable
    assert collect(engine, request).text == "".join(s.text for s in steps)
    status = engine.status()
    assert status["served by"] == "remote" and status["requests served remote"] == 3
    assert status["prompt tokens by"] == "llama-cpp-python server tokenizer"


@pytest.mark.timeout(180)
def test_greedy_text_is_the_local_engines(engine: RemoteEngine, embedded_model_path: Path) -> None:
    """Same model, same greedy request: the server's text is the in-process engine's (the request
    neutralises llama_cpp.server's own sampling defaults: top_k 40, repeat_penalty 1.1)."""
    local = Engine(EngineConfig(target=ModelConfig(path=str(embedded_model_path), n_ctx=256,
                                                   n_threads=1), spec=SpecConfig(mode="off")),
                   calibrate=False)
    try:
        for prompt in (CODE_PROMPT, "Q: What is DNS?\nA:"):
            request = GenerationRequest(prompt=prompt, max_tokens=16)
            assert collect(engine, request).text == \
                "".join(s.text for s in local.generate(request))
    finally:
        local.close()


@pytest.mark.timeout(120)
def test_chat_template_goal_uses_chat_completions(engine: RemoteEngine) -> None:
    request = GenerationRequest(prompt="Name a colour.", system_prompt="Answer in one word.",
                                use_chat_template=True, max_tokens=4)
    steps = run(engine, request)
    assert steps[-1].finish_reason in ("stop", "length") and steps[-1].stats.num_generated_tokens >= 1


@pytest.mark.timeout(180)
def test_cancel_within_one_chunk_and_the_server_stops(engine: RemoteEngine, server: Server) -> None:
    """Cancel ends the stream at the next chunk; the server sees the client gone (its log says so,
    before any other request could interrupt it) and stops: the next request is served long before
    the cancelled one could have finished."""
    disconnects = server.log_path.read_text(errors="replace").count("Disconnected from client")
    cancel = threading.Event()
    seen: List[Step] = []
    started = time.perf_counter()
    for step in engine.generate(GenerationRequest(prompt=CODE_PROMPT, max_tokens=800), cancel):
        seen.append(step)
        if len(seen) == 4:
            rate = 3 / (time.perf_counter() - started - step.stats.time_to_first_token + 1e-9)
            cancel.set()
    assert seen[-1].finish_reason == "cancelled"
    assert len(seen) == 5, "the cancelled request yielded chunks after the cancel"
    _wait(lambda: server.log_path.read_text(errors="replace").count("Disconnected from client")
          > disconnects, 10, "the server to notice the closed stream")
    remaining_s = (800 - 4) / rate  # what the server would still need, at the rate seen
    t0 = time.perf_counter()
    after = run(engine, GenerationRequest(prompt="The robot", max_tokens=2))
    assert after[-1].finish_reason == "length"
    assert time.perf_counter() - t0 < min(30.0, remaining_s / 4), "the server kept generating"


@pytest.mark.timeout(120)
def test_cancel_while_the_server_hangs(server: Server, remote_engine: Callable[..., RemoteEngine]) -> None:
    """A read blocked on a hung server (SIGSTOP) returns when cancel is set: the socket is shut down."""
    eng = remote_engine(connect_timeout=0.5, read_timeout=60.0)
    with server.frozen():
        cancel = threading.Event()
        threading.Timer(0.5, cancel.set).start()
        t0 = time.perf_counter()
        steps = run(eng, GenerationRequest(prompt="Hi", max_tokens=2), cancel)
        assert steps[-1].finish_reason == "cancelled" and time.perf_counter() - t0 < 5.0


@pytest.mark.timeout(120)
def test_http_errors_end_the_request_with_the_reason(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "wrong-key")
    eng = RemoteEngine(RemoteConfig(url=server.url, api_key_env=API_KEY_ENV, probe_period=0), SPEC)
    with pytest.raises(RemoteError, match="HTTP 401"):
        run(eng, GenerationRequest(prompt="Hi", max_tokens=2))
    monkeypatch.setenv(API_KEY_ENV, API_KEY)  # read at each request: a rotated key works at once
    assert run(eng, GenerationRequest(prompt="Hi", max_tokens=2))[-1].finish_reason == "length"
    # a prompt beyond the server's context: llama_cpp.server ends the stream with no finish reason
    with pytest.raises(RemoteError, match="ended without a finish reason"):
        run(eng, GenerationRequest(prompt="robot " * 1100, max_tokens=2))
    eng.close()


@pytest.mark.timeout(120)
def test_read_timeout_ends_the_request(server: Server, remote_engine: Callable[..., RemoteEngine]) -> None:
    eng = remote_engine(connect_timeout=0.5, read_timeout=0.5)
    with server.frozen():
        t0 = time.perf_counter()
        with pytest.raises(RemoteError, match="read_timeout=0.5"):
            run(eng, GenerationRequest(prompt="Hi", max_tokens=2))
        assert time.perf_counter() - t0 < 5.0


@pytest.mark.timeout(300)
def test_server_death_mid_stream_then_restart(embedded_model_path: Path, tmp_path: Path,
                                              api_key: str) -> None:
    """SIGKILL mid-stream: the request fails with the reason; while down, requests fail fast and the
    probe says unreachable; once restarted on the same port the same engine serves again."""
    srv = llama_cpp_server(embedded_model_path, tmp_path).start()
    eng = RemoteEngine(RemoteConfig(url=srv.url, api_key_env=api_key, connect_timeout=1.0,
                                    probe_period=0.2), SPEC)
    try:
        seen = 0
        with pytest.raises(RemoteError, match="stream|finish reason") as failure:
            for step in eng.generate(GenerationRequest(prompt=CODE_PROMPT, max_tokens=400)):
                seen += 1
                if seen == 2:
                    srv.kill()
        assert not isinstance(failure.value, ServerUnreachableError)
        t0 = time.perf_counter()
        with pytest.raises(ServerUnreachableError, match="cannot connect"):
            run(eng, GenerationRequest(prompt="Hi", max_tokens=2))
        assert time.perf_counter() - t0 < 3.0
        _wait(lambda: eng.status()["server reachable"] is False, 10, "the probe to fail")
        srv.start()
        _wait(lambda: eng.status()["server reachable"] is True, 20, "the probe to succeed")
        assert run(eng, GenerationRequest(prompt="Hi", max_tokens=2))[-1].finish_reason == "length"
    finally:
        eng.close()
        srv.stop()


@pytest.mark.timeout(300)
def test_fallback_serves_locally_when_the_server_is_unreachable(embedded_model_path: Path) -> None:
    local = Engine(EngineConfig(target=ModelConfig(path=str(embedded_model_path), n_ctx=256,
                                                   n_threads=1)), calibrate=False)
    eng = FallbackEngine(RemoteEngine(RemoteConfig(url=f"http://127.0.0.1:{free_port()}",
                                                   connect_timeout=0.5, probe_period=0), SPEC), local)
    try:
        status = eng.status()
        assert status["server reachable"] is False and status["fallback"] == "local"
        steps = run(eng, GenerationRequest(prompt="The robot", max_tokens=3))
        assert steps[-1].finish_reason == "length" and steps[-1].stats.num_generated_tokens == 3
        assert steps[-1].spec_mode != REMOTE_MODE  # the local engine's label
        status = eng.status()
        assert status["served by"] == "local" and status["requests served local"] == 1
        assert "cannot connect" in status["last fallback reason"]
        assert eng.model_info()["fallback"]["path"] == str(embedded_model_path)
    finally:
        eng.close()


def test_spec_changes_are_refused_the_server_decides(engine: RemoteEngine) -> None:
    engine.update_spec(SPEC)  # the configured spec itself is fine
    with pytest.raises(ValueError, match="configured on the inference server"):
        engine.update_spec(SpecConfig(mode="off"))
    with pytest.raises(ValueError, match="configured on the inference server"):
        engine.check_request(GenerationRequest(prompt="Hi", spec_mode="draft"))
    assert engine.check_spec(SPEC) == ""


def test_goal_checks_estimate_prompt_tokens_the_start_counts_them(engine: RemoteEngine) -> None:
    """The goal checks' count is a lower-bound estimate (a valid prompt near a limit is never
    refused on it); the request itself is counted by the server's tokenizer (an estimate where
    none answers)."""
    request = GenerationRequest(prompt="The quick brown fox jumps over the lazy dog.", max_tokens=2)
    by_server = run(engine, request)[-1].stats.num_prompt_tokens
    assert 10 <= by_server <= 14  # BOS + ~11 tokens
    assert engine.count_prompt_tokens(request) <= by_server, "the estimate must not over-count"
    assert engine.status()["prompt tokens by"] == "llama-cpp-python server tokenizer"
    dead = RemoteEngine(RemoteConfig(url=f"http://127.0.0.1:{free_port()}", connect_timeout=0.3,
                                     probe_period=0), SPEC)
    with pytest.raises(ServerUnreachableError):
        run(dead, request)
    assert dead.status()["prompt tokens by"] == "estimate"
    dead.close()


@pytest.mark.timeout(120)
def test_goal_checks_make_no_round_trip_the_start_checks_exactly(
        server: Server, remote_engine: Callable[..., RemoteEngine]) -> None:
    """count_prompt_tokens runs in the node's goal callback, whose callback group also serves
    cancels: with the server hung it answers at once (before: a tokenizer call of up to
    connect_timeout, every cancel waiting behind it). The start counts exactly: a prompt denser than
    the estimate (digits, one token each) passes the goal check and is refused with
    PromptTooLongError before anything streams."""
    eng = remote_engine(connect_timeout=3.0, n_ctx=128)
    dense = GenerationRequest(prompt="7" * 150, max_tokens=4)
    with server.frozen():
        t0 = time.perf_counter()
        estimate = eng.count_prompt_tokens(dense)
        assert time.perf_counter() - t0 < 1.0, "the goal check waited for the server"
    eng.check_request(dense, estimate)  # 11 estimated + 4 fit in 128
    with pytest.raises(PromptTooLongError, match=r"prompt of 1[5-6]\d tokens .* context of 128"):
        run(eng, dense)
    limited = remote_engine(connect_timeout=3.0, max_prompt_tokens=100)
    # limits.max_prompt_tokens, checked on the exact count at start
    with pytest.raises(PromptTooLongError, match=r"more than limits.max_prompt_tokens=100"):
        run(limited, dense)


@pytest.mark.timeout(120)
def test_time_budget_ends_a_slow_stream_with_its_text(engine: RemoteEngine) -> None:
    """A stream that would run for ~20 s ends with finish_reason timeout about when its budget
    runs out (before: it ran to max_tokens), with the text streamed so far."""
    t0 = time.perf_counter()
    steps = run(engine, GenerationRequest(prompt=CODE_PROMPT, max_tokens=600, time_budget=1.5))
    assert steps[-1].finish_reason == "timeout"
    assert time.perf_counter() - t0 < 6.0
    assert "".join(s.text for s in steps) and 0 < steps[-1].stats.num_generated_tokens < 600


@pytest.mark.timeout(120)
def test_time_budget_ends_a_request_to_a_hung_server(server: Server,
                                                     remote_engine: Callable[..., RemoteEngine]) -> None:
    """A hung server (SIGSTOP) before the first byte: the budget ends the request with timeout,
    long before read_timeout (before: the read timeout's error, 30 s later)."""
    eng = remote_engine(connect_timeout=0.5, read_timeout=30.0)
    with server.frozen():
        t0 = time.perf_counter()
        steps = run(eng, GenerationRequest(prompt="Hi", max_tokens=2, time_budget=1.0))
        assert steps[-1].finish_reason == "timeout" and time.perf_counter() - t0 < 6.0


# -- llama.cpp's llama-server: tau from its timings and /metrics ---------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.skipif(not LLAMA_SERVER.is_file(),
                    reason=f"llama-server not built at {LLAMA_SERVER} (scripts/build_native_tools.sh)")
def test_tau_from_llama_server_with_ngram_speculation(embedded_model_path: Path, tmp_path: Path) -> None:
    """llama-server with n-gram drafting: the request's drafted/accepted tokens come from its
    timings, the verify-pass count from its /metrics deltas, so tau and the acceptance rate are the
    server's own; its tokenizer counts the prompt."""
    srv = llama_server(embedded_model_path, tmp_path,
                       ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                        "--spec-ngram-simple-size-m", "6"]).start()
    eng = RemoteEngine(RemoteConfig(url=srv.url, probe_period=0.2), SPEC)
    try:
        assert eng.kind == KIND_LLAMA_SERVER and eng.n_ctx == 1024
        request = GenerationRequest(prompt=CODE_PROMPT * 2, max_tokens=48)
        steps = run(eng, request)
        stats = steps[-1].stats
        assert steps[-1].finish_reason in ("length", "stop")
        assert stats.num_prompt_tokens == eng.server.count_tokens(request.plain_prompt, 5.0)
        assert stats.num_draft_tokens > 0 and 0 <= stats.acceptance_rate <= 1
        # tau counts the bonus token: between 1 and 1 + the mean draft length (drafts of <= 6 here)
        assert stats.num_drafts > 0 and stats.num_draft_tokens <= 6 * stats.num_drafts
        assert 1.0 <= stats.mean_acceptance_length <= 1 + stats.num_draft_tokens / stats.num_drafts
        assert "timings" in eng.status()["tau source"]
        _wait(lambda: eng.rolling_stats().num_drafts >= stats.num_drafts, 10, "the rolling counters")
        assert eng.status()["prompt tokens by"] == "llama.cpp server tokenizer"
    finally:
        eng.close()
        srv.stop()


@pytest.mark.timeout(300)
@pytest.mark.skipif(not LLAMA_SERVER.is_file(),
                    reason=f"llama-server not built at {LLAMA_SERVER} (scripts/build_native_tools.sh)")
def test_several_requests_stream_at_once_through_llama_servers_slots(embedded_model_path: Path,
                                                                     tmp_path: Path) -> None:
    """With max_running 3 three requests stream at the same time (llama-server -np 3 batches them in
    its slots): each one's first text comes before any of them ends; each gets its whole text."""
    srv = llama_server(embedded_model_path, tmp_path, ["-np", "3", "-c", "3072"]).start()
    eng = RemoteEngine(RemoteConfig(url=srv.url, probe_period=0.2), SPEC, max_running=3)
    try:
        assert eng.max_running == 3
        firsts: List[float] = []
        ends: List[float] = []
        texts: List[str] = []

        def one(prompt: str) -> None:
            steps = []
            for step in eng.generate(GenerationRequest(prompt=prompt, max_tokens=48)):
                if step.text and not steps:
                    firsts.append(time.monotonic())
                steps.append(step)
            ends.append(time.monotonic())
            texts.append("".join(step.text for step in steps))
            assert steps[-1].finish_reason in ("length", "stop")
        threads = [threading.Thread(target=one, args=(prompt,)) for prompt in
                   (CODE_PROMPT, "The three laws of robotics are", "A robot arm picks up")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=240)
        assert len(ends) == 3 and all(texts)
        assert max(firsts) < min(ends)
    finally:
        eng.close()
        srv.stop()


# -- helpers ---------------------------------------------------------------------------------------------
def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
