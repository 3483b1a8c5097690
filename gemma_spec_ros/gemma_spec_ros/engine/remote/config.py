"""Where and how the remote backend reaches an inference server."""
from __future__ import annotations

import math
import os
import urllib.parse
from dataclasses import dataclass


@dataclass(frozen=True)
class RemoteConfig:
    """Where and how to reach an OpenAI-compatible inference server (engine/remote/)."""

    url: str  # base URL, e.g. http://127.0.0.1:8080 (a trailing /v1 is accepted)
    model: str = ""  # "model" of each request; '' = the server's default model
    api_key_env: str = ""  # NAME of the environment variable holding the API key; '' = no key
    connect_timeout: float = 2.0  # seconds to connect; also the limit of tokenizer and probe calls
    read_timeout: float = 60.0  # longest wait for the next data event of a stream (the first too);
    #                            keep-alive comments (": ping") do not count
    probe_period: float = 2.0  # seconds between reachability/RTT probes and /metrics reads; 0 = off
    n_ctx: int = 0  # context length for goal checks; 0 = what the server reports (else no check)
    #: the node's limits.max_prompt_tokens as of configure, checked on the exact count at start
    #: (the goal check has only the lower-bound estimate); 0 = no limit
    max_prompt_tokens: int = 0

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
        if self.api_key_env and self.api_key_env not in os.environ:
            raise ValueError(f"remote.api_key_env names {self.api_key_env!r}, which is not set in "
                             "the node's environment: export it, or set remote.api_key_env to ''")
