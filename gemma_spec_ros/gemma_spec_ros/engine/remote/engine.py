"""``RemoteEngine``: the :class:`~gemma_spec_ros.engine.api.GenerationEngine` surface over an
OpenAI-compatible inference server; see the package docstring. Chunks become Steps here; the wire
details live beside it (http, sse, payload, server, metrics)."""
from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from functools import partial
from typing import Any, Dict, Iterator, List, Mapping, Optional

from ..chat.turn import check_constraint
from ..stats import SpecStats
from ..request import CountedPrompt, GenerationRequest, Step
from ..errors import PromptTooLongError
from .chat import ToolCallDeltas, conversation_text
from .config import RemoteConfig
from ..config import SpecConfig
from .http import HttpClient, RemoteError, ServerUnreachableError
from .metrics import Counters, TauAttribution, fill_stats
from .payload import completion_request, parse_json_schema
from .server import ServerProbe, marks_of, read_counters
from .sse import EndedBeforeResponse, Stream, choice, open_stream

#: The spec_mode label of steps the server generated (the server's configuration decides the mode).
REMOTE_MODE = "remote"
#: The goal check's prompt-token estimate, a lower bound: one token per 16 UTF-8 bytes (Gemma/Llama
#: tokenizers give 1.2-4 bytes per token on text, code, JSON and digits; 8 on a repeated long word),
#: so the goal check refuses only prompts that cannot fit, never a valid one near a limit; the exact
#: count when the goal starts decides the rest (it ends the goal with an error).
ESTIMATE_BYTES_PER_TOKEN = 16
#: Template markup tokens added to a chat prompt's estimate (roles, turn markers).
CHAT_TEMPLATE_TOKENS = 16
#: The server's finish reasons -> ours.
FINISH_REASONS = {"stop": "stop", "eos": "stop", "tool_calls": "stop", "length": "length"}


class InFlight:
    """Generations in flight, at most ``limit``: ``with gate:`` waits for a place; ``acquire(
    blocking=False)`` / ``release()`` is the prober's idle gate (server.py ``when_idle``), taken
    only while none is in flight, and no generation starts while it is held."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._cond = threading.Condition()
        self._running = 0
        self._probing = False

    def __enter__(self) -> "InFlight":
        with self._cond:
            self._cond.wait_for(lambda: self._running < self.limit and not self._probing)
            self._running += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    def acquire(self, blocking: bool = True) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self._running == 0 and not self._probing,
                                       None if blocking else 0):
                return False
            self._probing = True
            return True

    def release(self) -> None:
        with self._cond:
            self._probing = False
            self._cond.notify_all()


class RemoteEngine:
    """The engine API over an OpenAI-compatible HTTP server; see the package docstring."""

    def __init__(self, config: RemoteConfig, spec: SpecConfig, max_running: int = 1) -> None:
        self.config = config
        self._spec = spec
        self._http = HttpClient(config)
        # generations in flight at once (the server's slots batch them); the prober's idle gate
        self._lock = InFlight(max_running)
        self._state_lock = threading.Lock()
        self._rolling = SpecStats(spec_mode=REMOTE_MODE, verification="server")
        self._served = 0
        self._tau = TauAttribution(partial(read_counters, self._http))
        self.server = ServerProbe(self._http, config, self._lock, self._tau)

    # -- configuration (the server's own decides) --------------------------------------------------
    @property
    def spec(self) -> SpecConfig:
        return self._spec

    @property
    def max_running(self) -> int:
        """Requests streamed at once (the server batches them in its slots; llama-server's
        ``-np``); tau then comes from each request's own timings where the server sends them
        (/metrics deltas of overlapping requests are nobody's alone, metrics.py)."""
        return self._lock.limit

    @property
    def n_ctx(self) -> int:
        return self.config.n_ctx or self.server.n_ctx

    @property
    def kind(self) -> str:
        """Which server this is ('' until it answered once)."""
        return self.server.kind

    @property
    def warnings(self) -> List[str]:
        return []

    def check_spec(self, spec: SpecConfig) -> str:
        """'' for the configured spec; any other is refused: the server's configuration decides."""
        if spec == self._spec:
            return ""
        return (f"backend is remote ({self.config.url}): speculative decoding is configured on the "
                "inference server (e.g. llama-server --spec-type / --model-draft, vLLM "
                "--speculative-config), not by spec.* or a goal's spec_mode")

    def update_spec(self, spec: SpecConfig) -> None:
        reason = self.check_spec(spec)
        if reason:
            raise ValueError(reason)

    # -- requests ------------------------------------------------------------------------------------
    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """An estimate of the prompt's tokens, without a round trip to the server: it runs in the
        node's goal callback, where cancels wait behind it. :meth:`generate` counts exactly."""
        count = -(-len(_prompt_text(request).encode("utf-8")) // ESTIMATE_BYTES_PER_TOKEN) + 1
        return count + _template_tokens(request)

    def count_prompt(self, request: GenerationRequest) -> CountedPrompt:
        """The estimate, without tokens: :meth:`generate` sends text and counts exactly."""
        return CountedPrompt(self.count_prompt_tokens(request))

    def check_request(self, request: GenerationRequest, n_prompt_tokens: Optional[int] = None) -> None:
        """PromptTooLongError when the server's n_ctx is known and exceeded; ValueError for a
        spec_mode (the server decides), a json_schema that is not a JSON object, or a chat turn with
        a grammar beside its tools."""
        parse_json_schema(request.json_schema)
        if request.conversation is not None:
            check_constraint(request.conversation, request.grammar, request.json_schema)
        n_ctx = self.n_ctx
        if n_ctx > 0:
            n_prompt = self.count_prompt_tokens(request) if n_prompt_tokens is None else n_prompt_tokens
            if n_prompt + request.max_tokens > n_ctx:
                raise PromptTooLongError(
                    f"prompt of {n_prompt} tokens + max_tokens {request.max_tokens} exceeds the "
                    f"server's context of {n_ctx} tokens: shorten the prompt or lower max_tokens")
        if request.spec_mode is not None:
            reason = self.check_spec(replace(self._spec, mode=request.spec_mode))
            if reason:
                raise ValueError(reason)

    def known_down(self) -> str:
        """Why the server is down, if the prober found it so just now; '' otherwise."""
        return self.server.known_down()

    def generate(self, request: GenerationRequest, cancel: Optional[threading.Event] = None,
                 prompt: Optional[CountedPrompt] = None) -> Iterator[Step]:
        """One Step per streamed chunk with text, then a last Step with the finish reason. Raises
        ValueError (a bad json_schema) before anything is sent, ServerUnreachableError when no
        connection can be made, RemoteError for the rest. ``prompt`` (an estimate) is not used:
        the server's tokenizer counts exactly here. A request whose body depends on the server's
        kind (a constraint, a turn that must call) and whose stream shows another kind of server
        than the one it was built for (server.py ``ServerMarks``: a backend swapped behind a proxy)
        is closed before its first Step and sent once more, after the server is identified anew."""
        cancel = cancel if cancel is not None else threading.Event()
        parse_json_schema(request.json_schema)
        budget_ends = time.monotonic() + request.time_budget if request.time_budget else math.inf
        constrained = bool(request.grammar or request.json_schema)
        must_call = request.conversation is not None and request.conversation.must_call
        try:
            for attempt in range(2):  # a second only after a stream that came from another kind of server
                if constrained:
                    self._check_identified()  # its kind decides the fields
                elif must_call and not self.server.identified:
                    self.server.probe()  # its template's call syntax decides how the turn opens (chat.py)
                n_prompt = self._count_exactly(request, budget_ends, cancel)
                path, body = completion_request(request, self.server.kind, self.config.model, self.server.call_syntax)
                with self._lock:
                    before = self._tau.before_request()
                    try:
                        stream = open_stream(self._http, path, body, cancel, budget_ends)
                    except EndedBeforeResponse as ended:
                        self._note_served()
                        stats = SpecStats(spec_mode=REMOTE_MODE, verification="server", num_prompt_tokens=n_prompt)
                        yield Step((), "", stats, REMOTE_MODE, 0, ended.finish_reason)
                        return
                    except ServerUnreachableError as exc:
                        self.server.mark(False, math.nan, str(exc))
                        raise
                    if not self._same_server(stream, path) and (constrained or must_call) and attempt == 0:
                        # built with the fields of the kind cached, which this server ignores: closed
                        # before any Step (the server stops), sent again once it is identified anew
                        stream.close()
                        continue
                    self._note_served()
                    yield from self._steps(stream, before, n_prompt, cancel, request)
                    return
        except RemoteError:  # unreachable, an HTTP error, a broken stream: it may be another server now
            self.server.forget_identity()
            raise

    def _same_server(self, stream: Stream, path: str) -> bool:
        """Whether ``stream`` comes from the kind of server identified, by its marks (server.py
        ``ServerMarks``): its header and first chunk, read now (still the first of its Steps).
        True when it ended before a chunk. The stream is closed if reading it fails."""
        try:
            first = stream.first()
        except BaseException:
            stream.close()
            raise
        return first is None or self.server.same_server(path, marks_of(stream.server_header, first))

    def _check_identified(self) -> None:
        """Probe the server now unless the prober identified it within its last two periods;
        ServerUnreachableError if it cannot be reached (the fallback may serve), RemoteError if it
        answers but is not identified: a constrained request is refused rather than sent with
        fields another kind of server ignores (it would return unconstrained text)."""
        server = self.server
        if not (server.identified and server.recently_probed()) and not server.probe():
            raise ServerUnreachableError(server.last.error)
        if not server.identified:
            why = server.last.error or "no answer to the identifying requests since it changed or failed"
            raise RemoteError(f"constrained output (grammar / json_schema) needs to know which server "
                              f"{self.config.url} is, and it is not identified now ({why}): refused "
                              "rather than sent unconstrained; try again")

    def _count_exactly(self, request: GenerationRequest, budget_ends: float, cancel: threading.Event) -> int:
        """The prompt's tokens by the server's tokenizer (0 if it has none), checked against the
        limits. Here rather than in the goal check (see count_prompt_tokens); before the lock:
        llama_cpp.server's tokenizer is asked only while this engine does not stream. The call
        ends within connect_timeout and the request's budget, or at its cancel."""
        timeout = min(self.config.connect_timeout, max(0.01, budget_ends - time.monotonic()))
        counted = self.server.count_tokens(_prompt_text(request), timeout, cancel)
        if counted is None:
            return 0
        n_prompt = counted + _template_tokens(request)
        limit = self.config.max_prompt_tokens
        if limit and n_prompt > limit:
            raise PromptTooLongError(f"prompt has {n_prompt} tokens, more than limits.max_prompt_tokens={limit}")
        self.check_request(request, n_prompt)
        return n_prompt

    def _steps(self, stream: Stream, before: Optional[Counters], n_prompt: int,
               cancel: threading.Event, request: GenerationRequest) -> Iterator[Step]:
        """The stream's chunks as Steps, then the last Step with the finish reason and the stats (a
        chat turn's with its reply: the streamed text and the server's calls, validated)."""
        stats = SpecStats(spec_mode=REMOTE_MODE, verification="server", num_prompt_tokens=n_prompt)
        calls = ToolCallDeltas() if request.conversation is not None else None
        # a turn that may make one call ends where it closes (a server may let the model go on:
        # llama-server's grammar for calls in tags let a second call follow, to max_tokens)
        one_call = request.conversation is not None and bool(request.conversation.tools) \
            and not request.conversation.parallel_tool_calls
        call_done = False
        content: List[str] = []
        chunks = 0
        first_at = last_at = math.nan
        finish: Optional[str] = None
        usage: Mapping[str, Any] = {}
        timings: Mapping[str, Any] = {}
        try:
            for chunk in stream.chunks():
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
                text, reason = choice(chunk)
                finish = reason or finish
                called = calls is not None and calls.add(chunk)  # a call's fragment is output too
                if call_done and (calls.opened > 1 or text):  # the model goes on after its one call:
                    calls.keep_first()  # the turn ended with the call (the server's last counters
                    finish = "tool_calls"  # are not read then: a usage chunk comes at the end only)
                    break
                if calls is not None:
                    content.append(text)
                if text or called:
                    last_at = time.perf_counter()
                    chunks += 1
                    if chunks == 1:
                        first_at = last_at
                        stats.time_to_first_token = last_at - stream.started
                    fill_stats(stats, chunks, first_at, last_at, usage, timings)
                    yield Step((), text, stats.snapshot(), REMOTE_MODE, 0, None)
                if one_call and not call_done and called:
                    call_done = calls.first_complete()
                if cancel.is_set() or (finish is None and stream.guard.budget_spent()):
                    break
            ended = stream.outcome(finish, FINISH_REASONS, self.config.read_timeout)
            fill_stats(stats, chunks, first_at, last_at, usage, timings)
            if ended not in ("cancelled", "timeout"):  # a cut stream's counters are not attributable
                self._tau.attribute(stats, before, timings)
            reply = None
            if calls is not None and request.conversation is not None:
                reply = calls.reply(request.conversation, "".join(content), ended)
            yield Step((), "", stats.snapshot(), REMOTE_MODE, 0, ended, reply=reply)
        finally:
            stream.close()
            with self._state_lock:
                self._rolling.merge(stats)
                self._rolling.spec_mode = REMOTE_MODE

    def _note_served(self) -> None:
        with self._state_lock:
            self._served += 1

    # -- what the node reads -------------------------------------------------------------------------
    def take_faults(self) -> List[str]:
        """None: nothing of this engine runs outside a request but the prober, which logs nothing."""
        return []

    def rolling_stats(self) -> SpecStats:
        """Requests merged; tau counters from the server's /metrics since configure when it has them."""
        with self._state_lock:
            snap = self._rolling.snapshot()
        self._tau.apply_since_configure(snap)
        return snap

    def model_info(self) -> Dict[str, Any]:
        target = {"backend": "remote", "url": self.config.url, "server": self.kind or "unknown",
                  "model": self.config.model or self.server.model or "server default",
                  "n_ctx": self.n_ctx}
        return {"target": target, "draft": None}

    def status(self) -> Dict[str, Any]:
        """Key-values for /diagnostics: reachability, RTT, requests served, tau source."""
        probe = self.server.last
        with self._state_lock:
            served = self._served
        age = time.monotonic() - probe.checked_at if math.isfinite(probe.checked_at) else math.nan
        return {
            "backend": "remote", "server url": self.config.url, "server": self.kind or "unknown",
            "server reachable": "unknown" if probe.reachable is None else probe.reachable,
            "server RTT ms": probe.rtt * 1e3, "server probe age s": age,
            "server error": probe.error, "served by": "remote" if served else "none yet",
            "requests served remote": served, "requests served local": 0,
            "fallback": "none", "last fallback reason": "", "tau source": self._tau.source,
            "prompt tokens by": self.server.tokenizer, "dynamic cache n-grams": 0,
        }

    def close(self, timeout: Optional[float] = None) -> bool:
        """Stop the prober (idempotent); nothing else to free."""
        self.server.close()
        return True


def _template_tokens(request: GenerationRequest) -> int:
    """Estimated chat-template markup tokens (the server applies its own template)."""
    return CHAT_TEMPLATE_TOKENS if request.use_chat_template or request.conversation is not None else 0


def _prompt_text(request: GenerationRequest) -> str:
    """The text the server's tokenizer counts: the plain prompt, or a chat turn's messages and tools."""
    if request.conversation is not None:
        return conversation_text(request.conversation)
    return request.plain_prompt


__all__ = ["CHAT_TEMPLATE_TOKENS", "ESTIMATE_BYTES_PER_TOKEN", "REMOTE_MODE", "RemoteEngine"]
