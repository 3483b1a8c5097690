"""``RemoteEngine``: the Engine's public surface over an OpenAI-compatible inference server.

For a target too large for the robot, or a fleet sharing one GPU server, the node keeps its ROS face
(action, queue, cancel, diagnostics) and an existing serving engine generates: llama.cpp's
``llama-server``, vLLM, or llama-cpp-python's ``llama_cpp.server``. The server runs the speculation
(its own configuration decides the mode); this module streams completions, maps them to
:class:`~gemma_spec_ros.engine.engine.Step` objects and reads the acceptance figures the server
exposes. Standard library only (``http.client``, ``json``, ``threading``); no ROS.

Public API (what the node uses, as for :class:`~gemma_spec_ros.engine.engine.Engine`)::

    engine = RemoteEngine(RemoteConfig(url="http://gpu-box:8080"), spec, fallback=None)
    engine.spec, engine.check_spec(spec), engine.update_spec(spec)   # refused: the server decides
    engine.count_prompt_tokens(request)      # the server's tokenizer, else an estimate (see below)
    engine.check_request(request)            # PromptTooLongError when the server's n_ctx is known
    engine.n_ctx                             # the server's context length, 0 if unknown
    for step in engine.generate(request, cancel):   # one Step per streamed chunk
        ...
    engine.rolling_stats(), engine.model_info(), engine.backend_status(), engine.close()

Streaming: ``POST /v1/completions`` (raw prompt) or ``/v1/chat/completions`` (the goal asked for the
chat template; the server applies its own) with ``stream: true``; server-sent events ``data: {...}``
up to ``data: [DONE]``, decoded incrementally so a chunk boundary never splits a UTF-8 character.
Cancel shuts the socket down from a watcher thread, so a blocked read returns at once and the server
sees the client gone and stops generating. HTTP errors, timeouts and a dead server raise
:class:`RemoteError` (an EngineError: the goal ends with finish_reason ``error`` and the reason);
the next request connects afresh.

Acceptance (tau), never invented:

- llama-server's per-request ``timings`` carry ``draft_n`` and ``draft_n_accepted`` (drafted and
  accepted tokens: the acceptance rate), but not the number of verify passes that tau needs.
- Its ``/metrics`` (``--metrics``) and vLLM's ``/metrics`` have the counters
  ``*:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens`` (``_total``).
  They are read before and after each request; the deltas are this request's only when the server's
  generated-token counter moved by exactly this request's tokens (no other client generated in
  between), otherwise the request's tau stays unknown. The rolling stats take the server's deltas
  since configure: the server-wide tau over all its clients (the server's speculation serves them all).
- A server that reports none of these leaves every acceptance figure unknown (NaN), as local ``off``.

Prompt tokens: llama-server ``/tokenize``, llama_cpp.server ``/extras/tokenize/count``, vLLM
``/tokenize``; otherwise (or when the call fails within ``connect_timeout``) an estimate of one
token per :data:`ESTIMATE_BYTES_PER_TOKEN` UTF-8 bytes. llama_cpp.server serves one request at a
time and, by default, a new request interrupts the running stream: its tokenizer is therefore only
asked while this engine is not streaming (the estimate otherwise), and one such server should serve
one robot (or run with ``--interrupt_requests false``).

Fallback: with ``fallback`` (a local :class:`Engine`), a request whose connection fails (refused,
unreachable, connect timeout), or that arrives while the prober's last look found the server down,
is generated locally; :meth:`backend_status` says which backend served. A stream that breaks after
it started is not resumed locally: that goal ends with an error.
"""
from __future__ import annotations

import codecs
import http.client
import json
import math
import os
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, replace
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from .types import Step
from .stats import SpecStats
from .types import EngineError, GenerationRequest, PromptTooLongError, SpecConfig

#: The spec_mode label of steps the server generated (the server's configuration decides the mode).
REMOTE_MODE = "remote"
#: Prompt-token estimate without a server tokenizer: ~4 bytes per token is typical of English text
#: with Gemma/Llama tokenizers, so 3 over-counts ordinary text (a conservative prompt-length check).
ESTIMATE_BYTES_PER_TOKEN = 3
#: Template markup tokens added to a chat prompt's estimate (roles, turn markers).
CHAT_TEMPLATE_TOKENS = 16
#: Seconds between two checks of the cancel event by a stream's watcher thread.
CANCEL_POLL = 0.02
#: Attempts to see the server's counters include a finished request (they update after the stream).
METRICS_SETTLE_TRIES = 5
METRICS_SETTLE_SLEEP = 0.02
#: Kinds of server, told apart by the endpoints they answer.
KIND_LLAMA_SERVER = "llama.cpp server"
KIND_LLAMA_CPP_PYTHON = "llama-cpp-python server"
KIND_VLLM = "vllm"
KIND_OPENAI = "openai-compatible"
_FINISH = {"stop": "stop", "eos": "stop", "tool_calls": "stop", "length": "length"}
_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
             "spec_decode_num_accepted_tokens", "generation_tokens")
#: Server counter names -> ours (llama-server calls generated tokens ``tokens_predicted``).
_COUNTER_ALIASES = {"tokens_predicted": "generation_tokens"}


class RemoteError(EngineError):
    """The server answered with an error, timed out, or went away mid-stream."""


class ServerUnreachableError(RemoteError):
    """No connection could be made (refused, no route, connect timeout): the fallback may serve."""


@dataclass(frozen=True)
class RemoteConfig:
    """Where and how to reach the inference server."""

    url: str  # base URL, e.g. http://127.0.0.1:8080 (a trailing /v1 is accepted)
    model: str = ""  # "model" of each request; '' = the server's default model
    api_key_env: str = ""  # NAME of the environment variable holding the API key; '' = no key
    connect_timeout: float = 2.0  # seconds to connect; also the limit of tokenizer and probe calls
    read_timeout: float = 60.0  # longest wait for the next bytes of a stream (the first token too)
    probe_period: float = 2.0  # seconds between reachability/RTT probes and /metrics reads; 0 = off
    n_ctx: int = 0  # context length for goal checks; 0 = what the server reports (else no check)

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"remote.url {self.url!r}: expected http://HOST:PORT or https://HOST:PORT")
        for name in ("connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"remote.{name}={value}: must be > 0 seconds")
        if self.probe_period < 0 or self.n_ctx < 0:
            raise ValueError("remote.probe_period and remote.n_ctx must be >= 0")
        if self.api_key_env and self.api_key_env not in os.environ:
            raise ValueError(f"remote.api_key_env names {self.api_key_env!r}, which is not set in "
                             "the node's environment: export it, or set remote.api_key_env to ''")


@dataclass
class _Probe:
    """What the last probe of the server found."""

    reachable: Optional[bool] = None  # None: not probed yet
    rtt: float = math.nan  # seconds of the last GET /health (any HTTP answer counts)
    checked_at: float = math.nan  # time.monotonic() of the last probe
    error: str = ""


def parse_prometheus(text: str) -> Dict[str, float]:
    """The counters this module reads, summed over label sets, from Prometheus text.

    Names lose their ``vllm:`` / ``llamacpp:`` prefix and ``_total`` suffix.

    >>> parse_prometheus('# HELP x\\nvllm:spec_decode_num_drafts_total{model_name="m"} 3.0\\n'
    ...                  'vllm:spec_decode_num_drafts_total{model_name="n"} 2\\n'
    ...                  'llamacpp:tokens_predicted_total 7\\n')
    {'spec_decode_num_drafts': 5.0, 'generation_tokens': 7.0}
    """
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
        if "}" in rest:
            rest = rest.split("}", 1)[1]
        name = name.split(":", 1)[-1]
        if name.endswith("_total"):
            name = name[:-len("_total")]
        name = _COUNTER_ALIASES.get(name, name)
        if name not in _COUNTERS:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def _delta(after: Mapping[str, float], before: Mapping[str, float], name: str) -> Optional[int]:
    if name not in after or name not in before:
        return None
    return int(round(after[name] - before[name]))


class _SseReader:
    """Server-sent events from an HTTP response: ``data:`` payloads, whole UTF-8 characters.

    >>> import io
    >>> r = _SseReader(io.BytesIO(': ping\\r\\ndata: {"a": 1}\\n\\ndata: [DONE]\\n'.encode()).read1)
    >>> list(r)
    ['{"a": 1}', '[DONE]']
    """

    def __init__(self, read1: Any) -> None:
        self._read1 = read1
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""

    def __iter__(self) -> Iterator[str]:
        while True:
            data = self._read1(65536)
            if not data:
                return
            self._buffer += self._decoder.decode(data)
            *lines, self._buffer = self._buffer.split("\n")
            for line in lines:
                line = line.rstrip("\r")
                if line.startswith("data:"):
                    yield line[len("data:"):].strip()


class RemoteEngine:
    """The Engine API over an OpenAI-compatible HTTP server; see the module docstring."""

    def __init__(self, config: RemoteConfig, spec: SpecConfig, fallback: Optional[Any] = None) -> None:
        self.config = config
        self._spec = spec
        self._fallback = fallback
        parts = urllib.parse.urlsplit(config.url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        base = parts.path.rstrip("/")
        self._base = base[:-len("/v1")] if base.endswith("/v1") else base
        self._lock = threading.Lock()  # one generation at a time (the node serialises anyway)
        self._state_lock = threading.Lock()
        self._rolling = SpecStats(spec_mode=REMOTE_MODE, verification="server")
        self._probe = _Probe()
        self.kind = ""  # which server (detected once reachable); '' = not yet known
        self._server_n_ctx = 0
        self._server_model = ""
        self._has_metrics = False
        self._metrics_baseline: Optional[Dict[str, float]] = None
        self._metrics_last: Optional[Dict[str, float]] = None
        self._served = {"remote": 0, "local": 0}
        self._last_served = ""
        self._last_fallback_reason = ""
        self._tau_source = "none"
        self._tokenizer = "estimate"
        self._closed = threading.Event()
        self.probe()
        self._prober: Optional[threading.Thread] = None
        if config.probe_period > 0:
            self._prober = threading.Thread(target=self._probe_loop, name="gemma_spec_remote_probe",
                                            daemon=True)
            self._prober.start()

    # -- configuration (the server's own decides) --------------------------------------------------
    @property
    def spec(self) -> SpecConfig:
        return self._spec

    @property
    def n_ctx(self) -> int:
        return self.config.n_ctx or self._server_n_ctx

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
        """Prompt tokens by the server's tokenizer (chat: + template estimate), else an estimate."""
        text = request.prompt
        if request.system_prompt:
            text = request.system_prompt + "\n\n" + text
        extra = CHAT_TEMPLATE_TOKENS if request.use_chat_template else 0
        count = self._server_token_count(text)
        if count is None:
            count = -(-len(text.encode("utf-8")) // ESTIMATE_BYTES_PER_TOKEN) + 1
        return count + extra

    def check_request(self, request: GenerationRequest, n_prompt: Optional[int] = None) -> None:
        n_ctx = self.n_ctx
        if n_ctx > 0:
            n_prompt = self.count_prompt_tokens(request) if n_prompt is None else n_prompt
            if n_prompt + request.max_tokens > n_ctx:
                raise PromptTooLongError(
                    f"prompt of {n_prompt} tokens + max_tokens {request.max_tokens} exceeds the "
                    f"server's context of {n_ctx} tokens: shorten the prompt or lower max_tokens")
        if request.spec_mode is not None:
            reason = self.check_spec(replace(self._spec, mode=request.spec_mode))
            if reason:
                raise ValueError(reason)

    def generate(self, request: GenerationRequest,
                 cancel: Optional[threading.Event] = None) -> Iterator[Step]:
        """One Step per streamed chunk with text, then a last Step with the finish reason."""
        cancel = cancel if cancel is not None else threading.Event()
        # llama_cpp.server streams no usage: count the prompt first (its tokenizer is free now)
        n_prompt = self.count_prompt_tokens(request) if self.kind == KIND_LLAMA_CPP_PYTHON else 0
        with self._lock:
            down = self._known_down() if self._fallback is not None else ""
            if down:  # the prober found the server down just now: no connect timeout to wait out
                self._note_served("local", down)
                yield from self._fallback.generate(request, cancel)
                return
            try:
                stream = self._open_stream(request, cancel)
            except _Cancelled:
                self._note_served("remote", "")
                yield Step((), "", SpecStats(spec_mode=REMOTE_MODE, verification="server",
                                             num_prompt_tokens=n_prompt), REMOTE_MODE, 0, "cancelled")
                return
            except ServerUnreachableError as exc:
                self._set_probe(False, math.nan, str(exc))
                if self._fallback is None:
                    raise
                self._note_served("local", str(exc))
                yield from self._fallback.generate(request, cancel)
                return
            self._note_served("remote", "")
            yield from self._stream(stream, n_prompt, cancel)

    def take_faults(self) -> List[str]:
        """The local fallback's faults (a failed cache save), as :meth:`Engine.take_faults`."""
        return self._fallback.take_faults() if self._fallback is not None else []

    def rolling_stats(self) -> SpecStats:
        """Requests merged; tau counters from the server's /metrics since configure when it has them."""
        with self._state_lock:
            snap = self._rolling.snapshot()
            baseline, last = self._metrics_baseline, self._metrics_last
        if baseline is not None and last is not None:
            drafts = _delta(last, baseline, "spec_decode_num_drafts")
            drafted = _delta(last, baseline, "spec_decode_num_draft_tokens")
            accepted = _delta(last, baseline, "spec_decode_num_accepted_tokens")
            if drafts is not None and drafted is not None and accepted is not None:
                _set_acceptance(snap, drafts, drafted, accepted)
        return snap

    def model_info(self) -> dict:
        target = {"backend": "remote", "url": self.config.url, "server": self.kind or "unknown",
                  "model": self.config.model or self._server_model or "server default",
                  "n_ctx": self.n_ctx}
        info: Dict[str, Any] = {"target": target, "draft": None}
        if self._fallback is not None:
            info["fallback"] = self._fallback.model_info().get("target")
        return info

    def backend_status(self) -> Dict[str, Any]:
        """Key-values for /diagnostics: reachability, RTT, which backend served, tau source."""
        with self._state_lock:
            probe = replace(self._probe)
            served = dict(self._served)
            last, fallback_reason = self._last_served, self._last_fallback_reason
            tau_source = self._tau_source
        age = time.monotonic() - probe.checked_at if math.isfinite(probe.checked_at) else math.nan
        return {
            "backend": "remote", "server url": self.config.url, "server": self.kind or "unknown",
            "server reachable": "unknown" if probe.reachable is None else probe.reachable,
            "server RTT ms": probe.rtt * 1e3, "server probe age s": age,
            "server error": probe.error, "served by": last or "none yet",
            "requests served remote": served["remote"], "requests served local": served["local"],
            "fallback": "local" if self._fallback is not None else "none",
            "last fallback reason": fallback_reason, "tau source": tau_source,
            "prompt tokens by": self._tokenizer,
        }

    def close(self, timeout: Optional[float] = None) -> bool:
        """Stop the prober; close the fallback engine (idempotent). Like ``Engine.close``: False if
        the fallback's running step keeps its models until that step ends (it frees them then)."""
        self._closed.set()
        if self._prober is not None:
            self._prober.join(timeout=self.config.connect_timeout * 3 + 1.0)
            self._prober = None
        freed = True
        if self._fallback is not None:
            freed = self._fallback.close(timeout=timeout)
            self._fallback = None
        return freed

    # -- probing -------------------------------------------------------------------------------------
    def probe(self) -> bool:
        """GET /health once: reachability and round-trip time (any HTTP answer counts: llama_cpp.server
        has no /health and answers 404 without touching its model lock). Detects the server's kind
        the first time it is reachable and reads /metrics. Returns reachability."""
        started = time.perf_counter()
        try:
            status, _ = self._get("/health")
        except RemoteError as exc:
            self._set_probe(False, math.nan, str(exc))
            return False
        self._set_probe(True, time.perf_counter() - started, "" if status < 500 else f"/health: HTTP {status}")
        if not self.kind and status < 500:  # llama-server answers 503 while it loads the model
            self._when_idle(self._detect)
        if self._has_metrics:
            counters = self._read_metrics()
            if counters is not None:
                with self._state_lock:
                    if self._metrics_baseline is None:
                        self._metrics_baseline = counters
                    self._metrics_last = counters
                    if self._tau_source == "none":
                        self._tau_source = "server /metrics"
        return True

    def _probe_loop(self) -> None:
        while not self._closed.wait(self.config.probe_period):
            try:
                self.probe()
            except Exception as exc:  # noqa: BLE001  a probe must never kill its thread
                self._set_probe(False, math.nan, f"probe failed: {exc!r}")

    def _known_down(self) -> str:
        """The last probe's error if the running prober found the server unreachable within its
        last two periods, else '' (then a request tries to connect)."""
        if self._prober is None:
            return ""
        with self._state_lock:
            probe = self._probe
        fresh = time.monotonic() - probe.checked_at <= 2 * self.config.probe_period
        return probe.error if probe.reachable is False and fresh else ""

    def _set_probe(self, reachable: bool, rtt: float, error: str) -> None:
        with self._state_lock:
            self._probe = _Probe(reachable, rtt, time.monotonic(), error)

    def _when_idle(self, call: Any) -> Optional[Any]:
        """``call()`` while no generation of this engine runs (it holds the generation lock
        meanwhile), else None: llama_cpp.server interrupts a running stream at any request that
        needs its model (tokenize, /v1/models)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            return call()
        finally:
            self._lock.release()

    def _detect(self) -> None:
        """Which server this is, from the endpoints it answers; its n_ctx and /metrics."""
        kind = KIND_OPENAI
        props = self._get_json("/props")
        models = self._get_json("/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        entry = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        if isinstance(props, dict) and "default_generation_settings" in props:
            kind = KIND_LLAMA_SERVER
            settings = props.get("default_generation_settings") or {}
            self._server_n_ctx = int(settings.get("n_ctx") or props.get("n_ctx") or 0)
        elif "max_model_len" in entry:
            kind = KIND_VLLM
            self._server_n_ctx = int(entry.get("max_model_len") or 0)
        elif self._post_json("/extras/tokenize/count", {"input": "a"}, self.config.connect_timeout):
            kind = KIND_LLAMA_CPP_PYTHON
        self._server_model = str(entry.get("id") or "")
        self.kind = kind
        self._has_metrics = kind in (KIND_LLAMA_SERVER, KIND_VLLM) and self._read_metrics() is not None

    def _read_metrics(self) -> Optional[Dict[str, float]]:
        try:
            status, body = self._get("/metrics")
        except RemoteError:
            return None
        if status != 200:
            return None
        counters = parse_prometheus(body.decode("utf-8", "replace"))
        return counters if "spec_decode_num_drafts" in counters else None

    def _server_token_count(self, text: str) -> Optional[int]:
        with self._state_lock:
            unreachable = self._probe.reachable is False
        kind = "" if unreachable else self.kind  # no wait on a server the last probe found down
        timeout = self.config.connect_timeout
        reply: Optional[Any] = None
        if kind == KIND_LLAMA_SERVER:
            reply = self._post_json("/tokenize", {"content": text, "add_special": True}, timeout)
            count = len(reply["tokens"]) if isinstance(reply, dict) and "tokens" in reply else None
        elif kind == KIND_VLLM:
            body = {"prompt": text, **({"model": self.config.model} if self.config.model else {})}
            reply = self._post_json("/tokenize", body, timeout)
            count = reply.get("count") if isinstance(reply, dict) else None
        elif kind == KIND_LLAMA_CPP_PYTHON:
            reply = self._when_idle(
                lambda: self._post_json("/extras/tokenize/count", {"input": text}, timeout))
            count = reply.get("count") if isinstance(reply, dict) else None
        else:
            count = None
        self._tokenizer = f"{kind} tokenizer" if count is not None else "estimate"
        return int(count) if count is not None else None

    # -- HTTP ------------------------------------------------------------------------------------------
    def _headers(self) -> Dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.config.api_key_env:
            key = os.environ.get(self.config.api_key_env, "")
            if key:
                headers["Authorization"] = f"Bearer {key}"
        return headers

    def _connect(self, read_timeout: float) -> http.client.HTTPConnection:
        """A connected HTTP(S) connection; ServerUnreachableError if none can be made."""
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.config.connect_timeout)
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise ServerUnreachableError(
                f"cannot connect to {self.config.url}: {_describe(exc)}") from None
        if conn.sock is not None:
            conn.sock.settimeout(read_timeout)
        return conn

    def _call(self, method: str, path: str, body: Optional[bytes], timeout: float) -> Tuple[int, bytes]:
        conn = self._connect(timeout)
        try:
            conn.request(method, self._base + path, body=body, headers=self._headers())
            response = conn.getresponse()
            return response.status, response.read(1 << 22)
        except (OSError, http.client.HTTPException) as exc:
            raise RemoteError(f"{method} {path} on {self.config.url}: {_describe(exc)}") from None
        finally:
            conn.close()

    def _get(self, path: str) -> Tuple[int, bytes]:
        return self._call("GET", path, None, self.config.connect_timeout)

    def _get_json(self, path: str) -> Optional[Any]:
        try:
            status, body = self._get(path)
            return json.loads(body) if status == 200 else None
        except (RemoteError, ValueError):
            return None

    def _post_json(self, path: str, payload: Mapping[str, Any], timeout: float) -> Optional[Any]:
        try:
            status, body = self._call("POST", path, json.dumps(payload).encode(), timeout)
            return json.loads(body) if status == 200 else None
        except (RemoteError, ValueError):
            return None

    # -- streaming -----------------------------------------------------------------------------------
    def _payload(self, request: GenerationRequest) -> Tuple[str, Dict[str, Any]]:
        sampling = request.sampling
        body: Dict[str, Any] = {
            "max_tokens": request.max_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "min_p": sampling.min_p, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.kind in (KIND_LLAMA_SERVER, KIND_LLAMA_CPP_PYTHON):
            # the request's sampler exactly: llama.cpp reads top_k 0 as no limit, and
            # llama_cpp.server would otherwise apply its own defaults (top_k 40, repeat_penalty 1.1)
            body.update(top_k=sampling.top_k, repeat_penalty=1.0)
        elif sampling.top_k > 0:  # vLLM & co spell "no limit" differently: leave it to them
            body["top_k"] = sampling.top_k
        if sampling.seed >= 0:
            body["seed"] = sampling.seed
        if request.stop:
            body["stop"] = list(request.stop)
        if self.config.model:
            body["model"] = self.config.model
        if request.use_chat_template:
            messages = [{"role": "user", "content": request.prompt}]
            if request.system_prompt:
                messages.insert(0, {"role": "system", "content": request.system_prompt})
            body["messages"] = messages
            return "/v1/chat/completions", body
        prompt = request.prompt
        if request.system_prompt:
            prompt = request.system_prompt + "\n\n" + prompt
        body["prompt"] = prompt
        return "/v1/completions", body

    def _open_stream(self, request: GenerationRequest, cancel: threading.Event) -> "_Stream":
        """Connect, send, read the status: a stream whose socket a watcher thread shuts down on
        cancel (from here on, so a server silent before its first byte is covered too)."""
        path, body = self._payload(request)
        before = self._read_metrics() if self._has_metrics else None
        started = time.perf_counter()
        conn = self._connect(self.config.read_timeout)
        done = threading.Event()
        threading.Thread(target=_watch, args=(cancel, done, conn), daemon=True,
                         name="gemma_spec_remote_cancel").start()
        try:
            conn.request("POST", self._base + path, body=json.dumps(body).encode(),
                         headers={**self._headers(), "Accept": "text/event-stream"})
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            done.set()
            conn.close()
            if cancel.is_set():
                raise _Cancelled() from None
            if isinstance(exc, socket.timeout):
                raise RemoteError(f"no response from {self.config.url} within remote.read_timeout="
                                  f"{self.config.read_timeout:g} s") from None
            raise RemoteError(f"POST {path} on {self.config.url}: {_describe(exc)}") from None
        if response.status != 200:
            done.set()
            try:
                detail = _error_message(response.read(1 << 16))
            except (OSError, http.client.HTTPException):
                detail = ""
            conn.close()
            raise RemoteError(f"HTTP {response.status} {response.reason} from POST {path} on "
                              f"{self.config.url}" + (f": {detail}" if detail else ""))
        return _Stream(conn, response, started, before, done)

    def _stream(self, stream: "_Stream", n_prompt: int, cancel: threading.Event) -> Iterator[Step]:
        stats = SpecStats(spec_mode=REMOTE_MODE, verification="server", num_prompt_tokens=n_prompt)
        chunks = 0
        first_at = last_at = math.nan
        finish: Optional[str] = None
        usage: Dict[str, Any] = {}
        timings: Dict[str, Any] = {}
        ended = "error"
        try:
            try:
                for data in _SseReader(stream.response.read1):
                    if data == "[DONE]":
                        break
                    chunk = _parse_chunk(data)
                    usage = chunk.get("usage") or usage
                    timings = chunk.get("timings") or timings
                    text, reason = _choice(chunk)
                    finish = reason or finish
                    if text:
                        t = time.perf_counter()
                        chunks += 1
                        if chunks == 1:
                            first_at = t
                            stats.time_to_first_token = t - stream.started
                        last_at = t
                        _fill(stats, chunks, first_at, last_at, usage, timings)
                        yield Step((), text, stats.snapshot(), REMOTE_MODE, 0, None)
                    if cancel.is_set():
                        break
            except (OSError, http.client.HTTPException) as exc:
                if not cancel.is_set():
                    raise RemoteError(f"stream from {self.config.url} broke after {chunks} chunks: "
                                      f"{_describe(exc)}") from None
            if cancel.is_set():
                ended = "cancelled"
            elif finish is None:
                raise RemoteError(f"the stream from {self.config.url} ended without a finish reason "
                                  f"after {chunks} chunks (server stopped, or a request of another "
                                  "client interrupted it)")
            elif finish not in _FINISH:
                raise RemoteError(f"the server ended the generation with finish_reason {finish!r}")
            else:
                ended = _FINISH[finish]
            _fill(stats, chunks, first_at, last_at, usage, timings)
            if ended != "cancelled":
                self._attribute_metrics(stats, stream.metrics_before, timings)
            yield Step((), "", stats.snapshot(), REMOTE_MODE, 0, ended)
        finally:
            stream.done.set()
            stream.conn.close()
            with self._state_lock:
                self._rolling.merge(stats)
                self._rolling.spec_mode = REMOTE_MODE

    def _attribute_metrics(self, stats: SpecStats, before: Optional[Dict[str, float]],
                           timings: Mapping[str, Any]) -> None:
        """Per-request tau from /metrics deltas, when they can only be this request's."""
        if "draft_n" in timings:
            with self._state_lock:
                self._tau_source = "server timings" + (" + /metrics" if self._has_metrics else "")
        if before is None:
            return
        mine = stats.num_generated_tokens
        for _ in range(METRICS_SETTLE_TRIES):
            after = self._read_metrics()
            if after is None:
                return
            moved = _delta(after, before, "generation_tokens")
            if moved is not None and moved >= mine:
                break
            time.sleep(METRICS_SETTLE_SLEEP)
        with self._state_lock:
            self._metrics_last = after
        if moved != mine:  # another client generated meanwhile: not attributable
            return
        drafts = _delta(after, before, "spec_decode_num_drafts")
        drafted = _delta(after, before, "spec_decode_num_draft_tokens")
        accepted = _delta(after, before, "spec_decode_num_accepted_tokens")
        if drafts is None or drafted is None or accepted is None:
            return
        if "draft_n" in timings and (drafted, accepted) != (int(timings.get("draft_n") or 0),
                                                             int(timings.get("draft_n_accepted") or 0)):
            return
        _set_acceptance(stats, drafts, drafted, accepted)
        with self._state_lock:
            if "draft_n" not in timings:
                self._tau_source = "server /metrics"

    def _note_served(self, backend: str, reason: str) -> None:
        with self._state_lock:
            self._served[backend] += 1
            self._last_served = backend
            if reason:
                self._last_fallback_reason = reason


@dataclass
class _Stream:
    conn: http.client.HTTPConnection
    response: http.client.HTTPResponse
    started: float  # perf_counter when the request was sent (TTFT counts from here)
    metrics_before: Optional[Dict[str, float]]
    done: threading.Event  # set when the stream is over: its cancel watcher exits


class _Cancelled(Exception):
    """Cancel was set before the server's response arrived."""


def _watch(cancel: threading.Event, done: threading.Event, conn: http.client.HTTPConnection) -> None:
    """Shut the stream's socket down as soon as ``cancel`` is set, so a blocked read returns and
    the server sees the client gone (it then stops generating)."""
    while not done.is_set():
        if cancel.wait(CANCEL_POLL):
            sock = conn.sock
            if sock is not None and not done.is_set():
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            return


def _parse_chunk(data: str) -> Dict[str, Any]:
    try:
        chunk = json.loads(data)
    except ValueError:
        raise RemoteError(f"the server sent an event that is not JSON: {data[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise RemoteError(f"the server sent an unexpected event: {data[:200]!r}")
    if "error" in chunk:
        raise RemoteError(f"the server reported an error mid-stream: {_error_message(data.encode())}")
    return chunk


def _choice(chunk: Mapping[str, Any]) -> Tuple[str, Optional[str]]:
    """(new text, finish_reason or None) of a completion or chat-completion chunk."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return text or "", choice.get("finish_reason")


def _fill(stats: SpecStats, chunks: int, first_at: float, last_at: float,
          usage: Mapping[str, Any], timings: Mapping[str, Any]) -> None:
    """Counts and rates of a request from what the server reported, else from the chunks."""
    generated = usage.get("completion_tokens") or timings.get("predicted_n") or chunks
    stats.num_generated_tokens = int(generated)
    prompt = usage.get("prompt_tokens")
    if prompt is None and "prompt_n" in timings:
        prompt = int(timings.get("prompt_n") or 0) + int(timings.get("cache_n") or 0)
    if prompt is not None:
        stats.num_prompt_tokens = int(prompt)
    if "prompt_ms" in timings:
        stats.prompt_time = float(timings["prompt_ms"]) / 1e3
    # Decode rate as local mode defines it: tokens after the first / time after the first.
    stats.num_step_tokens = max(0, stats.num_generated_tokens - 1)
    stats.generation_time = (last_at - first_at) if chunks > 1 else 0.0
    if "draft_n" in timings:
        _set_acceptance(stats, 0, int(timings.get("draft_n") or 0),
                        int(timings.get("draft_n_accepted") or 0))


def _set_acceptance(stats: SpecStats, drafts: int, drafted: int, accepted: int) -> None:
    """Counters the server reported, in place of ours (``drafts`` 0 = not reported: tau unknown).

    The server gives totals, not the per-draft events :meth:`SpecStats.observe_draft` records, so
    the totals are set directly; acceptance per position stays empty (unknown)."""
    stats.num_drafts = max(0, drafts)
    stats.num_draft_tokens = max(0, drafted)
    stats.num_accepted_tokens = max(0, min(accepted, drafted))


def _error_message(body: bytes) -> str:
    """The message of an OpenAI-style / FastAPI error body, else its start."""
    text = body.decode("utf-8", "replace").strip()
    if text.startswith("data:"):
        text = text[len("data:"):].strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:300]
    if isinstance(data, dict):
        error = data.get("error", data.get("detail", data))
        if isinstance(error, dict):
            return str(error.get("message") or error)[:300]
        return str(error)[:300]
    return text[:300]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    return str(exc) or type(exc).__name__


__all__ = ["RemoteConfig", "RemoteEngine", "RemoteError", "ServerUnreachableError", "REMOTE_MODE",
           "parse_prometheus"]
