"""The remote backend: the engine's public surface over an OpenAI-compatible inference server.

For a target too large for the robot, or a fleet sharing one GPU server, the node keeps its ROS face
(action, queue, cancel, diagnostics) and an existing serving engine generates: llama.cpp's
``llama-server``, vLLM, or llama-cpp-python's ``llama_cpp.server``. The server runs the speculation
(its own configuration decides the mode); this package streams completions, maps them to
:class:`~gemma_spec_ros.engine.request.Step` objects and reads the acceptance figures the server
exposes. Standard library only (``http.client``, ``json``, ``threading``); no ROS.

Parts, each readable and testable alone (lower ones never import higher ones):

========================  ==========================================================================
``http.py``               one HTTP call (connect, request, read), the API key, error texts
``sse.py``                a streamed completion: event lines, the watcher (cancel, budget, silence)
``metrics.py``            tau: the server's Prometheus counters, attributed to a request or not
``server.py``             the prober: reachability, kind, n_ctx, tokenizer, the idle gate
``payload.py``            the request body per kind of server, constrained output included
``engine.py``             :class:`RemoteEngine`: chunks -> Steps, rolling stats, ``status()``
========================  ==========================================================================

Public API (what the node uses; :class:`~gemma_spec_ros.engine.api.GenerationEngine`)::

    engine = RemoteEngine(RemoteConfig(url="http://gpu-box:8080"), spec)
    engine.spec, engine.check_spec(spec), engine.update_spec(spec)   # refused: the server decides
    engine.count_prompt_tokens(request)      # an estimate, no round trip (see below)
    engine.count_prompt(request)             # the same estimate as a CountedPrompt (no tokens)
    engine.check_request(request)            # PromptTooLongError when the server's n_ctx is known
    engine.n_ctx                             # the server's context length, 0 if unknown
    for step in engine.generate(request, cancel):   # one Step per streamed chunk
        ...
    engine.rolling_stats(), engine.model_info(), engine.status(), engine.close()

Streaming: ``POST /v1/completions`` (raw prompt) or ``/v1/chat/completions`` (the goal asked for the
chat template; the server applies its own) with ``stream: true``; see sse.py for the watcher that
ends a stream on cancel, on the time budget and on ``read_timeout`` without a data event. HTTP
errors, timeouts and a dead server raise :class:`RemoteError` (an EngineError: the goal ends with
finish_reason ``error`` and the reason); the next request connects afresh.

Prompt tokens: :meth:`RemoteEngine.count_prompt_tokens` (the node's goal checks) makes no round
trip: it estimates one token per ``ESTIMATE_BYTES_PER_TOKEN`` UTF-8 bytes, a lower bound. The node
calls it in its goal callback, which shares a mutually exclusive callback group with cancel
requests: a round trip there would make every cancel wait behind it (up to ``connect_timeout`` on a
hung server). :meth:`RemoteEngine.generate` counts exactly before it streams, with the server's
tokenizer (within ``connect_timeout``), and raises PromptTooLongError when the prompt and
``max_tokens`` do not fit the server's context or the prompt exceeds ``RemoteConfig.max_prompt_tokens``.

Fallback to a local engine when the server is unreachable: :class:`~gemma_spec_ros.engine.fallback.FallbackEngine`.
"""
from .config import RemoteConfig
from .engine import REMOTE_MODE, RemoteEngine
from .http import RemoteError, ServerUnreachableError
from .metrics import parse_prometheus
from .server import KIND_LLAMA_CPP_PYTHON, KIND_LLAMA_SERVER, KIND_OPENAI, KIND_VLLM

__all__ = ["KIND_LLAMA_CPP_PYTHON", "KIND_LLAMA_SERVER", "KIND_OPENAI", "KIND_VLLM", "REMOTE_MODE",
           "RemoteConfig", "RemoteEngine", "RemoteError", "ServerUnreachableError", "parse_prometheus"]
