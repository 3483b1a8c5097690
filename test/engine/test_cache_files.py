"""The n-gram cache files a peer can name: never a file the engine did not write, bounded memory,
safe saves, and a failed save that fails no request.

Real files and real llama.cpp models throughout; each test names the defect it guards
(shared/reviews/reliability-2.md: N2, N6, N8, N12, and the first review's L2) and failed on the
engine before the fix.
"""
from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import List

import numpy as np
import pytest

from gemma_spec_ros.engine.drafters import learned_cache
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.drafters.lookup import LookupDrafter
from gemma_spec_ros.engine.drafters.ngram_cache import NgramCache
from gemma_spec_ros.engine.config import EngineConfig, LookupConfig, ModelConfig
from gemma_spec_ros.engine.request import GenerationRequest
from support.engine import build_engine
from support.tiny_gguf import write_tiny_gguf

KEY = b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOqsecretsecretsecret robot@arm\n"
PROMPT = "the arm picks the cup. the arm picks the cup. the arm"


def snapshot(folder: Path) -> dict:
    """Every file in ``folder``: name -> (bytes, inode)."""
    return {p.name: (p.read_bytes(), p.stat().st_ino) for p in sorted(folder.iterdir())}


def tiny_engine(model: Path, **lookup: object) -> Engine:
    return build_engine(model, n_threads=1, lookup=LookupConfig(**lookup))


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> List[Path]:
    """Two tiny models of different vocabularies."""
    folder = tmp_path_factory.mktemp("models")
    return [write_tiny_gguf(folder / f"v{size}.gguf", vocab_size=size, seed=size) for size in (40, 48)]


def test_a_file_the_engine_did_not_write_is_refused_and_left_untouched(tmp_path: Path) -> None:
    """N2: a key file named as lookup.dynamic_path was moved to .corrupt-<time> and overwritten
    with the cache at the next save."""
    victim = tmp_path / "authorized_keys"
    victim.write_bytes(KEY)
    plain = tmp_path / "plain.lcd"  # llama.cpp's own format (llama-lookup-create): a static cache
    NgramCache.from_bytes(b"").save(plain)
    plain.write_bytes(plain.read_bytes() + np.array([1, -1, -1, -1, 1, 2, 3], "<i4").tobytes())
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    before = snapshot(tmp_path)
    for path in (victim, plain, empty):
        with pytest.raises(learned_cache.ForeignFileError, match="not a learned n-gram cache"):
            LookupDrafter(LookupConfig(dynamic_path=str(path)))
    assert snapshot(tmp_path) == before
    assert len(LookupDrafter(LookupConfig(static_path=str(plain))).static_cache) == 1


def test_a_foreign_file_that_appears_later_is_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "dynamic.bin"
    lookup = LookupDrafter(LookupConfig(dynamic_path=str(path)))
    lookup.end([5, 6, 7, 5, 6, 8])
    path.write_bytes(KEY)  # placed there after configure
    with pytest.raises(learned_cache.ForeignFileError, match="refusing to overwrite"):
        lookup.close()
    assert path.read_bytes() == KEY and [p.name for p in tmp_path.iterdir()] == ["dynamic.bin"]


def test_a_learned_cache_of_another_vocabulary_is_refused(tmp_path: Path, tiny_models: List[Path]) -> None:
    """L2: the learned cache was not tied to the model that learned it."""
    path = tmp_path / "dynamic.bin"
    with tiny_engine(tiny_models[0], dynamic_path=str(path)) as engine:
        list(engine.generate(GenerationRequest(PROMPT, max_tokens=8)))
        assert engine.dynamic_ngrams() > 0
    learned = path.read_bytes()
    with tiny_engine(tiny_models[0], dynamic_path=str(path)) as engine:  # same vocabulary: reloaded
        assert engine.dynamic_ngrams() > 0
    with pytest.raises(learned_cache.VocabularyMismatchError, match="another vocabulary"):
        tiny_engine(tiny_models[1], dynamic_path=str(path))
    assert path.read_bytes() == learned


def test_two_engines_saving_one_path_never_share_a_temporary_file(tmp_path: Path) -> None:
    """N12: the temporary file was named by pid, so two drafters in one process truncated each
    other's file mid-save (a corrupt cache, or a failed rename)."""
    path = tmp_path / "dynamic.bin"
    drafters = [LookupDrafter(LookupConfig(dynamic_path=str(path))) for _ in range(2)]
    for i, drafter in enumerate(drafters):
        drafter.end(np.random.default_rng(i).integers(0, 5000, 20000).tolist())
    errors: List[BaseException] = []

    def save_often(drafter: LookupDrafter) -> None:
        try:
            for _ in range(15):
                drafter.save()
        except BaseException as error:  # noqa: BLE001  reported below
            errors.append(error)

    threads = [threading.Thread(target=save_often, args=(d,)) for d in drafters]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert learned_cache.load(path, "") in (drafters[0].dynamic_cache, drafters[1].dynamic_cache)
    assert [p.name for p in tmp_path.iterdir()] == ["dynamic.bin"]


def test_a_failed_periodic_save_fails_no_request_and_is_a_fault(tmp_path: Path, tiny_models: List[Path]) -> None:
    """N6: the save's error ended an already streamed request with `error`, its stats unmerged."""
    folder = tmp_path / "cache"
    folder.mkdir()
    with tiny_engine(tiny_models[0], dynamic_path=str(folder / "dynamic.bin"), save_period=1e-6) as engine:
        folder.rmdir()  # the disk went away
        steps = list(engine.generate(GenerationRequest(PROMPT, max_tokens=6)))
        assert steps[-1].finish_reason in ("length", "stop")
        assert engine.rolling_stats().num_generated_tokens == steps[-1].stats.num_generated_tokens > 0
        faults = engine.take_faults()
        assert len(faults) == 1 and "saving the learned n-gram cache failed" in faults[0]
        assert engine.take_faults() == []  # reported once
        list(engine.generate(GenerationRequest(PROMPT, max_tokens=2)))  # still serving
        with pytest.raises(OSError):  # the save at close still fails, loudly
            engine.close()


_PEAK_SCRIPT = """
import sys
from gemma_spec_ros.engine.drafters.lookup import LookupDrafter
from gemma_spec_ros.engine.errors import CacheFormatError
from gemma_spec_ros.engine.config import LookupConfig
def peak_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
def current_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # reset the peak to the current resident size
before = current_kib()
try:
    drafter = LookupDrafter(LookupConfig(**{sys.argv[1]: sys.argv[2]}, dynamic_max_ngrams=1000))
    outcome = "moved aside" if drafter.warnings else "loaded"
except CacheFormatError as error:
    outcome = str(error)
print((peak_kib() - before) // 1024, outcome)
"""


@pytest.mark.parametrize("which", ["static_path", "dynamic_path"])
def test_loading_a_large_file_that_is_no_cache_costs_about_its_size(tmp_path: Path, venv_python: Path,
                                                                    which: str) -> None:
    """N8: a 40 MiB file that is not a cache peaked at +361 MiB before it was refused (every word
    became a Python int first). Peak RSS is counted by the kernel, not timed: not noisy."""
    junk = tmp_path / "junk.bin"
    words = np.tile(np.array([1, -1, -1, -1, 1, 7, 1], "<i4"), 40 * 2**20 // 28)  # valid records...
    words[-1] = -5  # ...with the last one broken: refused only after a walk over the whole file
    junk.write_bytes(words.tobytes())
    if which == "dynamic_path":  # a learned cache (ours) holding far more than the bound
        junk.write_bytes(learned_cache.encode(NgramCache(), "") + junk.read_bytes())
    proc = subprocess.run([str(venv_python), "-c", _PEAK_SCRIPT, which, str(junk)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak_mib, outcome = proc.stdout.split(" ", 1)
    # a static file is refused; a learned one (ours) that holds too many n-grams is moved aside
    assert outcome.startswith("n-gram cache" if which == "static_path" else "moved aside"), outcome
    print(which, "peak MiB", peak_mib)
    # the file's bytes, a record index and masks: ~3x the file (before: 7x, +287 MiB, and the
    # refusal quoted the file's values)
    assert int(peak_mib) < 3.5 * 40, proc.stdout


def test_lookup_create_seeds_a_learned_cache_the_engine_loads(tmp_path: Path, embedded_model_path: Path) -> None:
    """`gemma-spec-lookup-create --learned` writes the node's own format, tagged with the model's
    vocabulary, so a corpus can seed lookup.dynamic_path (a plain file there is refused)."""
    from gemma_spec_ros.tools import lookup_create
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("move_to(kitchen); pick(cup); place(cup, sink); say(done)\n" * 20)
    seed = tmp_path / "seed.bin"
    assert lookup_create.main([str(corpus), "-o", str(seed), "-m", str(embedded_model_path),
                               "--learned", "--ngram-min", "1", "--ngram-max", "4", "-q"]) == 0
    config = EngineConfig(ModelConfig(str(embedded_model_path), n_ctx=256),
                          lookup=LookupConfig(dynamic_path=str(seed), cache_dir=str(tmp_path)))
    with Engine(config, calibrate=False) as engine:
        assert engine.dynamic_ngrams() > 20
