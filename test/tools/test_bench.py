"""gemma-spec-bench: pure figures on fixed numbers, inputs (suites, params, runner plan), and a
--smoke run on the embedded model that must write the JSON, tables and plots (schema, not speed)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

from gemma_spec_dev.bench import cli as bench, config as bench_config, metrics as bench_metrics, native as bench_native, report as bench_report

REQUIRED_SUITES = {"code", "qa", "creative", "math", "structured", "planning"}
RUN_FIELDS = {
    "suite", "prompt_id", "runner", "kind", "mode", "k", "repeat", "temperature", "seed", "error",
    "n_tokens", "wall_s", "ttft_s", "tokens_per_s", "e2e_tokens_per_s", "tau", "acceptance_rate",
    "acceptance_per_position", "predicted_speedup", "speedup", "repetition_4gram", "output_hash",
    "tokens_hash", "peak_rss_mb", "finish_reason",
}


# -- figures on fixed numbers ----------------------------------------------------------------------
def test_repeated_ngram_share_fixed_numbers() -> None:
    assert bench_metrics.repeated_ngram_share([]) == 0.0
    assert bench_metrics.repeated_ngram_share([1, 2, 3]) == 0.0  # shorter than one 4-gram
    assert bench_metrics.repeated_ngram_share([1, 2, 3, 4, 5, 6, 7]) == 0.0
    # 8 tokens -> 5 four-grams, (1,2,3,4) occurs twice: one repeat in five
    assert bench_metrics.repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(0.2)
    # a loop: 10 four-grams of a 3-token cycle, 3 distinct -> 7 repeats
    assert bench_metrics.repeated_ngram_share([5, 6, 7] * 4 + [5]) == pytest.approx(0.7)
    assert bench_metrics.repeated_ngram_share([9, 9, 9, 9, 9], n=2) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        bench_metrics.repeated_ngram_share([1, 2], n=0)


def test_same_run_ratio_median_and_min_max() -> None:
    rates = {
        "off": {("code", "a", 0): 30.0, ("code", "a", 1): 20.0, ("code", "b", 0): 40.0,
                ("code", "b", 1): 40.0, ("qa", "x", 0): 50.0, ("qa", "x", 1): 50.0},
        "lookup": {("code", "a", 0): 60.0, ("code", "a", 1): 30.0, ("code", "b", 0): 40.0,
                   ("code", "b", 1): 36.0, ("qa", "x", 0): 45.0,
                   ("qa", "y", 0): 99.0},  # no off run for ("qa", "y", 0): left out, not compared
    }
    ratios = bench_metrics.same_run_ratios(rates, "lookup", "off")
    assert ratios == {("code", "a", 0): 2.0, ("code", "a", 1): 1.5, ("code", "b", 0): 1.0,
                      ("code", "b", 1): 0.9, ("qa", "x", 0): 0.9}
    by_suite = bench_metrics.ratio_by_suite(ratios, ["code", "qa"])
    assert by_suite["code"] == bench_metrics.Spread(median=1.25, low=0.9, high=2.0, n=4)
    assert by_suite["qa"] == bench_metrics.Spread(median=0.9, low=0.9, high=0.9, n=1)
    assert by_suite["all"] == bench_metrics.Spread(median=1.0, low=0.9, high=2.0, n=5)
    assert by_suite["code"].format() == "1.25x (0.90-2.00)"
    by_prompt = bench_metrics.ratio_by_prompt(ratios)
    assert by_prompt[("code", "a")] == bench_metrics.Spread(1.75, 1.5, 2.0, 2)
    assert bench_metrics.spread([None, math.nan]).format() == "-"


def test_other_figures() -> None:
    assert bench_metrics.decode_rate(129, 1, 4.2, 0.2) == pytest.approx(32.0)
    assert math.isnan(bench_metrics.decode_rate(1, 1, 1.0, 0.5))
    assert bench_metrics.pooled_acceptance([[2, 1], [1]], [[3, 3], [2]]) == pytest.approx([0.6, 1 / 3])
    assert bench_metrics.text_hash("abc") == bench_metrics.text_hash("abc") != bench_metrics.text_hash("abd")
    assert math.isnan(bench_metrics.parity_share({("c", "a", 0): "h"}, {}))
    assert bench_metrics.parity_share({("c", "a", 0): "h", ("c", "b", 0): "g"},
                                      {("c", "a", 0): "h", ("c", "b", 0): "x"}) == 0.5


def test_native_log_parsing() -> None:
    log = ("main: some loading noise\n"
           "encoded   57 tokens in    0.412 seconds, speed:  138.350 t/s\n"
           "decoded  130 tokens in    2.150 seconds, speed:   60.465 t/s\n\n"
           "n_draft      = 3\nn_predict    = 130\nn_drafted    = 141\n"
           "t_draft      = 3.05 ms, 21.63 us per token\nn_accept     = 83\naccept       = 58.865%\n"
           "llama_perf_context_print: prompt eval time =     401.00 ms /    57 tokens\n"
           "llama_perf_context_print:        eval time =    2100.00 ms /    56 runs   (37.50 ms per token)\n")
    parsed = bench_native.parse_native_output(log)
    assert parsed["n_tokens"] == 130 and parsed["decode_s"] == pytest.approx(2.15)
    assert parsed["prompt_tokens"] == 57 and parsed["prompt_s"] == pytest.approx(0.412)
    assert (parsed["n_drafted"], parsed["n_accept"], parsed["eval_runs"]) == (141, 83, 56)
    with pytest.raises(ValueError):
        bench_native.parse_native_output("no timings here")
    # llama-lookup's decode time holds n_tokens - 1 passes (the first token is the prompt pass's):
    # its rate counts the tokens after the first, as ours does
    assert bench.native_decode_rate(130, 1, parsed["decode_s"], 130) == pytest.approx(129 / 2.15)
    assert bench.native_decode_rate(130, 0, parsed["decode_s"], 130) == pytest.approx(130 / 2.15)
    assert math.isnan(bench.native_decode_rate(130, 1, 0.0, 130))
    assert math.isnan(bench.native_decode_rate(1, 1, 0.002, 130))  # ended at once: no rate, not 0 or 500
    # the tool's last pass went past the request's 128 tokens: only the 128 asked for count
    assert bench.native_decode_rate(130, 1, parsed["decode_s"], 128) == pytest.approx(127 / 2.15)
    stdout = "\n\n<bos>Hello world, and more\n\n\n\n"  # prompt echo, output, the tools' two "\n\n"
    assert bench_native.generated_text(stdout, "Hello world") == ", and more"


# -- inputs ----------------------------------------------------------------------------------------
def test_prompt_suites(repo_root: Path) -> None:
    suites = bench_config.load_suites(repo_root / "gemma_spec_ros" / "prompts")
    assert REQUIRED_SUITES <= {s.name for s in suites}
    for suite in suites:
        assert len(suite.prompts) >= 6, suite.name
        assert all(p.text.strip() and p.suite == suite.name for p in suite.prompts)
    assert [s.name for s in bench_config.select_suites(suites, "math,code")] == ["math", "code"]
    with pytest.raises(ValueError, match="unknown suite"):
        bench_config.select_suites(suites, "nope")
    assert bench_config.select_suites(suites, "none") == []


def test_random_prompts_are_drawn_from_the_corpus_by_seed(tmp_path: Path, repo_root: Path) -> None:
    """--random-prompts: N windows of the corpus's text files, the same for the same seed and files,
    others for another seed; the project's own suites are left out; too small a corpus is an error."""
    from gemma_spec_dev.bench import corpus
    corpus_dir = tmp_path / "corpus"
    (corpus_dir / "pkg").mkdir(parents=True)
    for i in range(6):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}  # line {j}\n" for j in range(80))
        (corpus_dir / "pkg" / f"m{i}.py").write_text(body)
    (corpus_dir / "blob.bin").write_bytes(bytes(range(256)) * 10)  # not a text suffix: never read
    (corpus_dir / "prompts").symlink_to(repo_root / "gemma_spec_ros" / "prompts")  # a link: left out as well
    suite = corpus.random_suite(5, [corpus_dir], seed=3)
    again = corpus.random_suite(5, [corpus_dir], seed=3)
    other = corpus.random_suite(5, [corpus_dir], seed=4)
    assert suite.name == "random" and len(suite.prompts) == 5
    assert [p.text for p in suite.prompts] == [p.text for p in again.prompts]
    assert [p.id for p in suite.prompts] != [p.id for p in other.prompts]
    for prompt in suite.prompts:
        path, line = prompt.id.rsplit(":", 1)
        assert path.startswith("corpus/pkg/m") and path.endswith(".py")
        source = (tmp_path / path).read_text().splitlines(keepends=True)
        assert prompt.text == "".join(source[int(line) - 1:int(line) - 1 + prompt.text.count("\n")])
        assert 400 <= len(prompt.text) <= 1200
    with pytest.raises(ValueError, match="no text files"):
        corpus.random_suite(2, [corpus_dir], seed=3, exclude=[corpus_dir / "pkg"])
    with pytest.raises(ValueError, match="gave"):
        corpus.random_suite(10_000, [corpus_dir], seed=3)


def test_params_file_and_runner_plan(tmp_path: Path) -> None:
    params_file = tmp_path / "p.yaml"
    params_file.write_text("/**:\n  ros__parameters:\n    target:\n      model_path: /m/t.gguf\n"
                           "      n_ctx: 1024\n      n_threads: 2\n    spec:\n      mode: lookup\n"
                           "      draft_max: 6\n    lookup:\n      dynamic_path: /tmp/dyn.bin\n"
                           "    generation:\n      max_tokens: 99\n")
    params = bench_config.load_params(str(params_file))
    assert params["target.model_path"] == "/m/t.gguf" and params["generation.max_tokens"] == 99
    config = bench_config.engine_config(params, "lookup", 3)
    assert (config.target.n_ctx, config.spec.draft_max, config.spec.adaptive) == (1024, 3, False)
    assert config.lookup.dynamic_path == ""  # the bench never writes the node's cache file
    adaptive = bench_config.engine_config(params, "auto", None)
    assert (adaptive.spec.mode, adaptive.spec.draft_max, adaptive.spec.adaptive) == ("auto", 6, True)
    with_draft = bench_config.apply_overrides(params, "", "/m/d.gguf")
    draft = bench_config.model_config(with_draft, "draft")
    assert draft is not None and draft.n_ctx == 1024  # the node's rule: draft.n_ctx 0 = the target's

    specs, notes = bench_config.plan_runners(["off", "draft", "lookup"], [2, None], False,
                                             ["plain", "prompt-lookup"], "", [3], "")
    assert [s.name for s in specs] == ["off", "lookup/K2", "lookup", "lcp-plain", "lcp-prompt-lookup"]
    assert any("draft skipped" in n for n in notes)
    specs, notes = bench_config.plan_runners(["off", "lookup"], [None], False, [], str(tmp_path), [3],
                                             "gemma_spec")
    assert [s.name for s in specs] == ["off", "lookup", "action:off", "action:lookup"]
    assert any("native lookup skipped" in n for n in notes)
    assert bench_config.parse_ks("2, 8,adaptive,2") == [2, 8, None]
    with pytest.raises(ValueError):
        bench_config.parse_ks("0")


def test_params_mapping_is_the_nodes_and_needs_no_ros(repo_root: Path, tmp_path: Path) -> None:
    """The bench builds its EngineConfig with the node's own mapping, which must not import ROS
    (the bench runs on machines without it: the GPU machine)."""
    extra = tmp_path / "x.yaml"
    extra.write_text("/**:\n  ros__parameters:\n    target: {model_path: /m/t.gguf, n_ctx: 512, n_batch: 64}\n"
                     "    draft: {model_path: /m/d.gguf, n_threads: 3}\n    spec: {draft_max: 5, p_min: 0.5}\n")
    script = (
        "import sys\n"
        "from gemma_spec_dev.bench import config as bench_config\n"
        "from gemma_spec_ros.node.parameters import EMBEDDED_MODEL_PATH\n"
        f"configs = [bench_config.load_params(p) for p in {[str(p) for p in sorted((repo_root / 'gemma_spec_ros' / 'config').glob('*.yaml'))]!r}]\n"
        "for params in configs: bench_config.base_config(params)\n"
        f"c = bench_config.base_config(bench_config.load_params({str(extra)!r}))\n"
        "assert (c.target.path, c.target.n_ctx, c.target.n_batch) == ('/m/t.gguf', 512, 64), c.target\n"
        "assert (c.draft.path, c.draft.n_ctx, c.draft.n_batch, c.draft.n_threads) == ('/m/d.gguf', 512, 64, 3), c.draft\n"
        "assert (c.spec.mode, c.spec.draft_max, c.spec.p_min) == ('off', 5, 0.5), c.spec\n"
        "assert bench_config.base_config({}).target.path == EMBEDDED_MODEL_PATH\n"
        "ros = sorted(m for m in sys.modules if m.split('.')[0] in ('rclpy', 'rcl_interfaces'))\n"
        "assert not ros, ros\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    with pytest.raises(ValueError, match="spec.draftmax"):
        bench_config.base_config({"spec.draftmax": 3})


# -- the smoke run ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Dict[str, Any]:
    model = request.getfixturevalue("embedded_model_path")
    out = tmp_path_factory.mktemp("bench")
    assert bench.main(["--smoke", "--target", str(model), "--out", str(out), "--no-progress"]) == 0
    return {"out": out, "results": json.loads((out / "results.json").read_text())}


@pytest.mark.timeout(1200)
def test_smoke_run_writes_results_schema(smoke_results: Dict[str, Any]) -> None:
    results = smoke_results["results"]
    assert results["schema_version"] == bench.SCHEMA_VERSION
    assert {"machine", "config", "rss_method", "speed_method", "notes", "runners", "summary", "runs"} <= set(results)
    assert results["machine"]["cpu_count"] >= 1 and results["config"]["smoke"] is True
    assert results["config"]["max_tokens"] == 16 and results["config"]["repeats"] == 1
    names = {r["name"] for r in results["runners"]}
    assert {"off", "lookup", "auto", "lcp-plain", "lcp-prompt-lookup"} <= names
    assert any("draft" in n for n in results["notes"])  # no draft model: draft modes noted as skipped
    suites = results["config"]["suites"]
    assert len(suites) == 2
    runs = results["runs"]
    assert len(runs) == 2 * len(names)  # 1 prompt x 2 suites x every runner
    for run in runs:
        assert RUN_FIELDS <= set(run), RUN_FIELDS - set(run)
        assert run["error"] is None, (run["runner"], run["error"])
        assert 1 <= run["n_tokens"] <= 17 and run["tokens_per_s"] > 0 and run["ttft_s"] >= 0
        assert 0.0 <= run["repetition_4gram"] <= 1.0
        assert run["output_hash"] and run["peak_rss_mb"] > 0
    off = {(r["suite"], r["prompt_id"], r["repeat"]): r for r in runs if r["runner"] == "off"}
    assert all(run["tokens_hash"] for run in off.values())
    for run in (r for r in runs if r["runner"] != "off"):  # speedup = tokens/s over off's, same key
        reference = off[(run["suite"], run["prompt_id"], run["repeat"])]
        ratio = run["tokens_per_s"] / reference["tokens_per_s"]  # both stored rounded
        assert run["speedup"] == pytest.approx(ratio, rel=1e-3), run["runner"]
    for run in (r for r in runs if r["runner"] == "lookup"):
        assert run["acceptance_per_position"] is not None and run["accepted_at"] is not None
    summary = results["summary"]
    assert summary["suites"] == suites
    for name, entry in summary["runners"].items():
        assert set(suites + ["all"]) <= set(entry["speedup"]), name
        assert entry["peak_rss_mb"] > entry["base_rss_mb"] > 0, name


@pytest.mark.timeout(1200)
def test_smoke_run_writes_tables_and_plots(smoke_results: Dict[str, Any]) -> None:
    out: Path = smoke_results["out"]
    table = (out / "results.md").read_text()
    assert "## Speedup vs `off`" in table and "| `lookup` |" in table and "peak RSS" in table
    assert "| suite | prompt |" in (out / "results_per_prompt.md").read_text()
    for name in bench_report.PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    # the committed-results path: tables and plots re-made from results.json alone
    (out / "results.md").unlink()
    assert bench.main(["--report-only", str(out)]) == 0
    assert (out / "results.md").read_text() == table


def test_report_only_remakes_the_same_files_from_unrounded_runs(tmp_path: Path, repo_root: Path) -> None:
    """A run's timings are unrounded floats until results.json rounds them; --report-only can only
    read the rounded ones. Both must give the same results.json and tables, byte for byte (a ratio
    computed from unrounded rates once landed on the other side of a table's rounding, 1.00x vs 0.99x).
    The runs are a committed bench's, each float nudged off its 6-digit rounding."""
    results = json.loads((repo_root / "docs/bench/cpu_ksweep_native/results.json").read_text())

    def nudge(value: Any, i: int) -> Any:
        if isinstance(value, float):
            return value * (1.0 + 3.7e-7 * (1 + i % 7))
        if isinstance(value, list):
            return [nudge(v, i + j) for j, v in enumerate(value)]
        return value

    results["runs"] = [{k: nudge(v, i) for k, v in run.items()} for i, run in enumerate(results["runs"])]
    names = ["results.json", "results.md", "results_per_prompt.md"]
    bench.write_outputs(results, tmp_path)
    first = {name: (tmp_path / name).read_text() for name in names}
    assert bench.main(["--report-only", str(tmp_path)]) == 0
    for name in names:
        assert (tmp_path / name).read_text() == first[name], name


@pytest.mark.parametrize("module", ["metrics", "native", "report.summary", "report.results_file", "config"])
def test_bench_docstring_examples(module: str) -> None:
    """The worked examples in the bench's docstrings (ratios, the oracle, text agreement, parsing)."""
    import doctest
    import importlib
    result = doctest.testmod(importlib.import_module(f"gemma_spec_dev.bench.{module}"))
    assert result.attempted > 0 and result.failed == 0, result


# -- the native sweep and its oracle ---------------------------------------------------------------
def _native_bin() -> Path:
    """scripts/build_native_tools.sh's binaries (in the cache dir of scripts/setup.sh)."""
    import os
    cache = Path(os.environ.get("GEMMA_SPEC_CACHE") or Path.home() / ".cache" / "gemma_spec_ros")
    return cache / "native" / "bin"


def test_native_sweep_plan(tmp_path: Path) -> None:
    """--native-sweep adds llama-lookup at K 3, 5, 8 and every n-gram --spec-type setting, no draft model."""
    for tool in ("llama-lookup", "llama-speculative-simple"):
        (tmp_path / tool).write_text("")  # plan_runners only looks for the files
    sweep = bench_config.parse_native_sweep("all")
    specs, _ = bench_config.plan_runners(["off", "lookup"], [None], False, [], str(tmp_path), [3], "",
                                         native_sweep=sweep, adaptive_ks=[8])
    names = [s.name for s in specs]
    assert names[:6] == ["off", "lookup", "lookup/A8", "native-plain", "native-lookup/K3", "native-lookup/K5"]
    assert specs[2].adaptive_max == 8 and specs[2].draft_max is None and specs[2].k_label == "adaptive<=8"
    assert bench_config.engine_config({}, "lookup", None, 8).spec.draft_max == 8
    ngram = [s for s in specs if s.mode == "speculative-ngram"]
    assert [s.name for s in ngram] == [f"native-{n}" for n, _ in bench_config.NATIVE_NGRAM_SETTINGS]
    assert all(s.draft_max is None and s.native_args[:1] == ("--spec-type",) and s.reference == "native-plain"
               for s in ngram)
    plain, _ = bench_config.plan_runners(["off"], [None], False, [], str(tmp_path), [3], "")
    assert not any(s.mode == "speculative-ngram" for s in plain)
    some, _ = bench_config.plan_runners(["off"], [None], False, [], str(tmp_path), [3], "",
                                        native_sweep=bench_config.parse_native_sweep("ngram-mod/n4"))
    assert [s.name for s in some if s.mode == "speculative-ngram"] == ["native-ngram-mod/n4"]
    with pytest.raises(ValueError, match="ngram-bogus"):
        bench_config.parse_native_sweep("ngram-bogus")


@pytest.mark.skipif(not (_native_bin() / "llama-speculative-simple").is_file(),
                    reason="llama.cpp's tools not built (scripts/build_native_tools.sh)")
@pytest.mark.timeout(600)
def test_native_sweep_run_names_the_oracle_per_prompt(tmp_path: Path) -> None:
    """A real --native-sweep run on a tiny model: every native setting runs, and the oracle table
    names each prompt's fastest one and our ratio to it."""
    sys.path.insert(0, str(Path(__file__).parent))
    from support.tiny_gguf import write_tiny_gguf
    model = write_tiny_gguf(tmp_path / "tiny.gguf", vocab_size=64, arch="gemma3")
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    text = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
    (prompts / "rep.yaml").write_text(f"name: rep\nprompts:\n  - id: a\n    text: '{text}'\n"
                                      f"  - id: b\n    text: 'a b c d a b c d a b c'\n")
    out = tmp_path / "out"
    assert bench.main(["--target", str(model), "--prompts-dir", str(prompts), "--modes", "lookup",
                       "--k", "adaptive", "--baselines", "none", "--max-tokens", "12", "--repeats", "1",
                       "--native-bin", str(_native_bin()), "--native-sweep", "--no-progress",
                       "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["native_sweep"] == "all"
    runs = results["runs"]
    ngram = {r["runner"] for r in runs if r["mode"] == "speculative-ngram"}
    assert len(ngram) == len(bench_config.NATIVE_NGRAM_SETTINGS)
    assert all(r["error"] is None and r["n_tokens"] >= 1 for r in runs), [(r["runner"], r["prompt_id"], r["error"]) for r in runs if r["error"]]
    oracle = results["summary"]["vs_native_oracle"]
    natives = set(bench_report.native_drafting_runners(results["runners"]))
    assert set(oracle["winners"]) <= {"rep/a", "rep/b"} and set(oracle["winners"].values()) <= natives
    assert oracle["winners"]
    lookup = oracle["runners"]["lookup"]
    assert lookup["n"] == len(oracle["winners"]) and lookup["min"] <= lookup["median"]
    assert 0 < lookup["geomean"] and lookup["worst"] in oracle["winners"]
    table = (out / "results.md").read_text()
    assert "## Ours vs the best native setting per prompt" in table
    assert f"`{oracle['winners'][lookup['worst']]}`" in table
    # every runner's text is kept (first repeat), and the table says whose text is off's
    assert all(r["text"] is not None for r in runs if r["n_tokens"] >= 1), [r["runner"] for r in runs if r["text"] is None]
    same = bench_report.summary.same_text_as_off(runs)
    assert set(same) == {("rep", "a"), ("rep", "b")} and all(v["off"] for v in same.values())
    assert "Prompts with `off`'s text: the winners " in table
