"""One row of results.json per run: a runner's :class:`~.runner.RunResult` (or its error) turned
into the figures the report reads (decode rate, hashes, acceptance counters, step profile)."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from .config import RunnerSpec
from .metrics import decode_rate, repeated_ngram_share, text_hash, tokens_hash
from .runner import Request, RunResult


def make_request(text: str, max_tokens: int, temperature: float, seed: int) -> Request:
    return {"prompt": text, "max_tokens": max_tokens, "temperature": temperature, "seed": seed}


def native_decode_rate(n_tokens: int, n_first: int, decode_s: float, max_tokens: int) -> float:
    """Tokens/s of a native tool from its printed decode time, less the ``n_first`` tokens whose
    pass is outside that time (llama-lookup's first token comes from its prompt pass), so the rate
    counts the same passes as ours after the first output. Before this, counting every token gave
    llama-lookup ~1% too much at 96-128 tokens.

    Tokens past ``max_tokens`` do not count: the tools check their limit only after a pass, so
    their last verify pass can emit up to K tokens more than asked (97-99 of 96), while the engine
    stops at ``max_tokens`` (its last drafts are shorter). Counting them gave ``llama-lookup`` ~2%
    more than what a request for ``max_tokens`` tokens gets; the last pass's time counts for both.

    >>> native_decode_rate(97, 1, 2.0, 128), native_decode_rate(99, 1, 2.0, 97)
    (48.0, 48.0)

    No rate (NaN, left out of every median) where nothing was decoded after the first token, as
    for our runners (a prompt answered by an end-of-generation token at once).
    """
    n = min(n_tokens, max_tokens) - n_first
    return n / decode_s if n > 0 and decode_s and decode_s > 0 else float("nan")


def make_record(spec: RunnerSpec, suite: str, prompt_id: str, repeat: int, request: Request,
                result: Optional[RunResult], error: str, keep_text: bool, load: float) -> Dict[str, Any]:
    """One row of results.json from a runner's raw result (or its error); ``load`` is the 1-minute
    load average when the run started."""
    record: Dict[str, Any] = {
        "suite": suite, "prompt_id": prompt_id, "runner": spec.name, "kind": spec.kind, "mode": spec.mode,
        "k": spec.k_label, "repeat": repeat, "temperature": request["temperature"], "seed": request["seed"],
        "error": error or None, "loadavg_1m": round(load, 2),
    }
    if result is None:
        return record
    n_tokens = int(result.n_tokens)
    wall, ttft = float(result.wall_s), float(result.ttft_s)
    if result.decode_s is not None:  # native tools print their own decode time
        rate = native_decode_rate(n_tokens, int(result.n_first), result.decode_s, int(request["max_tokens"]))
    else:
        rate = decode_rate(n_tokens, int(result.n_first), wall, ttft)
    tokens = result.tokens
    rep_tokens = tokens if tokens is not None else result.retokenized
    stats = result.stats or {}
    record.update({
        "n_tokens": n_tokens, "wall_s": wall, "ttft_s": ttft, "tokens_per_s": rate,
        "e2e_tokens_per_s": n_tokens / wall if wall > 0 else None,
        "finish_reason": result.finish_reason,
        "tau": stats.get("mean_acceptance_length"), "acceptance_rate": stats.get("acceptance_rate"),
        "acceptance_per_position": stats.get("acceptance_per_position"),
        "accepted_at": stats.get("accepted_at"), "drafted_at": stats.get("drafted_at"),
        "num_drafts": stats.get("num_drafts"), "num_draft_tokens": stats.get("num_draft_tokens"),
        "num_accepted_tokens": stats.get("num_accepted_tokens"),
        "tokens_per_pass": stats.get("tokens_per_pass"),
        "predicted_speedup": stats.get("predicted_speedup"),
        "engine_measured_speedup": stats.get("measured_speedup"),
        "engine_tokens_per_s": stats.get("tokens_per_second"),
        "engine_ttft_ms": stats.get("time_to_first_token_ms"),
        "spec_modes": result.spec_modes, "draft_max_last": result.draft_max_last,
        "repetition_4gram": repeated_ngram_share(rep_tokens) if rep_tokens is not None else None,
        "output_hash": text_hash(result.text) if result.text is not None else None,
        "tokens_hash": tokens_hash(tokens) if tokens is not None else None,
        "peak_rss_mb": result.peak_rss_mb,
        "text": result.text if keep_text else None,
    })
    record.update(step_profile(stats, wall - ttft if result.decode_s is None else result.decode_s))
    return record


def step_profile(stats: Mapping[str, Any], decode_s: float) -> Dict[str, Optional[float]]:
    """Milliseconds per target pass after the first token: the whole step (decode wall time / passes)
    and its parts: drafting, the target's decode (verify), sampling/acceptance, and the rest (Python
    bookkeeping: cache updates, text, stats; for the native tools everything but the target's decode).

    >>> step_profile({"num_steps": 10, "draft_ms": 5, "verify_ms": 200, "sample_ms": 10}, 0.25)["other_step_ms"]
    3.5
    """
    steps = stats.get("num_steps")
    if not steps or not decode_s or decode_s <= 0:
        return {"steps": steps or None, "step_ms": None, "draft_step_ms": None, "verify_step_ms": None,
                "sample_step_ms": None, "other_step_ms": None}
    per = {name: (stats[key] / steps if stats.get(key) is not None else None)
           for name, key in (("draft_step_ms", "draft_ms"), ("verify_step_ms", "verify_ms"),
                             ("sample_step_ms", "sample_ms"))}
    step_ms = decode_s * 1e3 / steps
    known = [v for v in per.values() if v is not None]
    return {"steps": steps, "step_ms": step_ms, **per,
            "other_step_ms": step_ms - sum(known) if known else None}
