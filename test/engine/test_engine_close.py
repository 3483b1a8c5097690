"""Closing the engine at its worst moments: a dynamic-cache save that fails, a close that gave up
waiting while a long prompt is evaluated or a goal's prompt is tokenized, a failed deferred close:
the models are freed, never under a running llama.cpp call, and every failure is reported. Real
llama.cpp on tiny GGUFs and the embedded model (in a child process where the old code crashed).
Regressions at the engine level: each test names the defect it guards and fails on the code before
its fix."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gemma_spec_ros.engine.request import GenerationRequest
from support.engine import build_engine
from support.tiny_gguf import write_tiny_gguf


REPEAT_PROMPT = "abcab abcab abcab abcab abcab abcab abcab"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_reliability")


def test_close_frees_the_models_when_the_cache_save_fails(tiny_dir: Path, tmp_path: Path) -> None:
    """Defect 8: a failed dynamic-cache save (here: its folder was removed, a real OSError)
    still frees the target (before: close stopped at the save and leaked the models); the failure
    is raised to the caller after everything is freed."""
    path = write_tiny_gguf(tiny_dir / "t.gguf", vocab_size=40, seed=5)
    (tmp_path / "cache").mkdir()
    cache = tmp_path / "cache" / "dynamic.bin"
    engine = build_engine(path, n_ctx=128, n_threads=1, lookup=_lookup(str(cache)))
    list(engine.generate(GenerationRequest(REPEAT_PROMPT, max_tokens=4)))
    (tmp_path / "cache").rmdir()  # the save's temporary file cannot be created
    with pytest.raises(OSError):
        engine.close()
    assert engine.target._ctx is None and engine.target._model is None
    engine.close()  # idempotent, and nothing is left to fail


def _lookup(dynamic_path: str = "", static_path: str = ""):
    from gemma_spec_ros.engine.config import LookupConfig
    return LookupConfig(static_path=static_path, dynamic_path=dynamic_path)


LONG_PROMPT = " ".join(f"item {i} is {i * 7 % 13}." for i in range(170))  # ~1,500 tokens


CLOSE_DURING_PROMPT = textwrap.dedent("""
    import sys, threading, faulthandler
    faulthandler.enable()
    from gemma_spec_ros.engine.engine import Engine
    from gemma_spec_ros.engine.config import EngineConfig, ModelConfig, SpecConfig
    from gemma_spec_ros.engine.request import GenerationRequest
    LONG_PROMPT = {long_prompt!r}
    engine = Engine(EngineConfig(ModelConfig({model!r}, n_ctx=2048, n_batch=512, n_threads=1),
                                 spec=SpecConfig(mode="off")), calibrate=False)
    started = threading.Event()
    original = engine.target.decode
    def decode(tokens, rows, *args, **kwargs):
        started.set()
        return original(tokens, rows, *args, **kwargs)
    engine.target.decode = decode
    out = {{}}
    def run():
        try:
            out["steps"] = list(engine.generate(GenerationRequest(LONG_PROMPT, max_tokens=4,
                                                                  reuse_prompt=False)))
        except Exception as exc:
            out["error"] = exc
    thread = threading.Thread(target=run)
    thread.start()
    started.wait(60)
    engine.close(timeout=0.05)   # a transition gave up waiting: must not free under llama_decode
    thread.join(300)
    assert engine.target._ctx is None, "the engine was not freed after the step"
    print("OK", out.get("error"), out.get("steps", [None])[-1] and out["steps"][-1].finish_reason)
""")


@pytest.mark.timeout(400)
def test_close_during_prompt_evaluation_never_frees_under_decode(embedded_model_path: Path,
                                                                 tmp_path: Path) -> None:
    """Defect 1: close() while llama_decode evaluates a long prompt (a transition that gave up
    waiting) does not free the models under it: the running step finishes, then the engine is
    freed (before: llama_free ran under llama_decode, use-after-free). In a subprocess, so that a
    crash is a failed test, not a dead test session."""
    _run_script(tmp_path / "close_during_prompt.py", 360,
                CLOSE_DURING_PROMPT.format(long_prompt=LONG_PROMPT, model=str(embedded_model_path)))


def _run_script(script: Path, timeout: float, text: str) -> None:
    """Run ``text`` as a Python script in a child process with this checkout on its path; it must
    exit 0 and print OK (a crash there is a failed test, not a dead test session)."""
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2] / "gemma_spec_ros"),
                                                        os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "OK" in proc.stdout


TOKENIZE_DURING_CLOSE = textwrap.dedent("""
    import threading, faulthandler
    faulthandler.enable()
    from gemma_spec_ros.engine.engine import Engine
    from gemma_spec_ros.engine.config import EngineConfig, ModelConfig
    from gemma_spec_ros.engine.errors import EngineError
    from gemma_spec_ros.engine.request import GenerationRequest
    request = GenerationRequest("walk to the kitchen and " * 2700, use_chat_template=True)  # ~64 KB
    for attempt in range(2):
        engine = Engine(EngineConfig(ModelConfig({model!r}, n_ctx=512, n_threads=1)), calibrate=False)
        counted, refused, started = [], [], threading.Event()
        def count():
            while True:
                started.set()
                try:
                    counted.append(engine.count_prompt_tokens(request))
                except EngineError as error:
                    refused.append(str(error))
                    return
        thread = threading.Thread(target=count)
        thread.start()
        started.wait(30)
        engine.close()
        thread.join(60)
        assert refused == ["the engine is closed"], refused
    print("OK", counted[0])
""")


@pytest.mark.timeout(300)
def test_tokenizing_a_goal_while_the_engine_closes_never_touches_a_freed_model(
        embedded_model_path: Path, tmp_path: Path) -> None:
    """N3 (second review): a goal callback tokenizing a 64 KB prompt while cleanup closes the
    engine segfaulted in llama_tokenize (3 of 3 runs): close() now waits for a tokenization in
    flight and later ones are refused with EngineError. In a subprocess: a crash fails the test."""
    _run_script(tmp_path / "tokenize_during_close.py", 240,
                TOKENIZE_DURING_CLOSE.format(model=str(embedded_model_path)))


def test_a_failed_deferred_close_is_reported(tiny_dir: Path, tmp_path: Path) -> None:
    """N15 (second review): when close() timed out, the generation freed the engine after its step
    and kept a failure (the cache save) in close_error, which nobody read: take_faults() has it."""
    path = write_tiny_gguf(tiny_dir / "t.gguf", vocab_size=40, seed=5)
    (tmp_path / "cache").mkdir()
    engine = build_engine(path, n_ctx=128, n_threads=1, lookup=_lookup(str(tmp_path / "cache" / "dynamic.bin")))
    steps = engine.generate(GenerationRequest(REPEAT_PROMPT, max_tokens=50))
    next(steps)  # a generation is running (holds the engine)
    (tmp_path / "cache").rmdir()
    assert engine.close(timeout=0) is False  # gave up waiting: the generation frees it
    rest = list(steps)
    assert rest[-1].finish_reason == "cancelled"
    assert engine.target._model is None
    faults = engine.take_faults()
    assert len(faults) == 1 and "closing the engine after its last step failed" in faults[0]
