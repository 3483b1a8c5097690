"""Where and how the remote backend reaches an inference server."""
from __future__ import annotations

import math
import os
import urllib.parse
from dataclasses import dataclass

from ..config import check_params, param


@dataclass(frozen=True)
class RemoteConfig:
    """Where and how to reach an OpenAI-compatible inference server (engine/remote/)."""

    url: str = param("http://127.0.0.1:8080", "base URL of the inference server (http or https; a trailing /v1 "
                     "is accepted)")
    model: str = param("", "model name sent with each request; '' = the server's default model")
    api_key_env: str = param("", "NAME of the environment variable holding the server's API key (sent as a "
                             "Bearer token); '' = no key. The key itself is never a parameter")
    connect_timeout: float = param(2.0, "seconds to connect to the server; also the limit of its tokenizer and "
                                   "probe calls", (0.01, 600.0))
    read_timeout: float = param(60.0, "seconds a stream may go without a data event (the first token included; "
                                "keep-alive comments do not count) before the goal ends with an error",
                                (0.01, 86_400.0))
    probe_period: float = param(2.0, "seconds between reachability/RTT probes (GET /health) and /metrics reads; "
                                "0 = off", (0.0, 3600.0))
    n_ctx: int = param(0, "context length for goal checks; 0 = what the server reports (llama-server /props, "
                       "vLLM max_model_len), else the server alone checks", (0, 1 << 24))
    #: the node's limits.max_prompt_tokens as of configure, checked on the exact count at start
    #: (the goal check has only the lower-bound estimate); 0 = no limit
    max_prompt_tokens: int = param(0, "", (0, 1 << 20), node=False)

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"remote.url {self.url!r}: expected http://HOST:PORT or https://HOST:PORT")
        for name in ("connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"remote.{name}={value}: must be > 0 seconds")
        if self.probe_period < 0 or self.n_ctx < 0 or self.max_prompt_tokens < 0:
            raise ValueError("remote.probe_period, remote.n_ctx and max_prompt_tokens must be >= 0")
        check_params(self)
        if self.api_key_env and self.api_key_env not in os.environ:
            raise ValueError(f"remote.api_key_env names {self.api_key_env!r}, which is not set in "
                             "the node's environment: export it, or set remote.api_key_env to ''")
