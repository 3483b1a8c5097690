"""The PNG plots of a bench run (matplotlib, imported only when plotting), from results.json as
written."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple

from ..config import REFERENCE_RUNNER
from ..metrics import finite

PLOTS: Tuple[str, ...] = ("speedup_by_suite.png", "acceptance_by_position.png", "k_sweep.png",
                          "predicted_vs_measured.png")


def plot_all(results: Mapping[str, Any], out_dir: Path) -> List[Path]:
    """Write the four PNGs (see PLOTS) into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, draw in zip(PLOTS, (_plot_speedup, _plot_acceptance, _plot_k_sweep, _plot_predicted)):
        fig = draw(results, plt)
        path = out_dir / name
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def _title(results: Mapping[str, Any]) -> str:
    cfg = results["config"]
    temp = "greedy" if not cfg["temperature"] else f"T={cfg['temperature']}"
    return f"{Path(str(cfg['target'])).name}, {cfg['max_tokens']} tokens, {temp}"


def _plot_speedup(results: Mapping[str, Any], plt: Any) -> Any:
    runners = {n: e for n, e in results["summary"]["runners"].items() if n != REFERENCE_RUNNER}
    groups = results["summary"]["suites"] + ["all"]
    fig, ax = plt.subplots(figsize=(min(12.0, max(7.0, 0.35 * len(groups) * max(1, len(runners)))), 4.5))
    width = 0.8 / max(1, len(runners))
    for i, (name, e) in enumerate(runners.items()):
        xs, ys, lo, hi = [], [], [], []
        for g, suite in enumerate(groups):
            d = e["speedup"].get(suite)
            if d and d.get("n"):
                xs.append(g - 0.4 + width * (i + 0.5))
                ys.append(d["median"])
                lo.append(d["median"] - d["min"])
                hi.append(d["max"] - d["median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel("tokens/s ratio vs off (median, min-max)")
    ax.set_title(f"Speedup per suite - {_title(results)}", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def _plot_acceptance(results: Mapping[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    drawn = 0
    for name, e in results["summary"]["runners"].items():
        acc = e.get("acceptance_per_position") or []
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
            drawn += 1
    if not drawn:
        ax.text(0.5, 0.5, "no drafts in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("draft position")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("acceptance rate (pooled over runs)")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Acceptance per draft position - {_title(results)}", fontsize=10)
    if drawn:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _plot_k_sweep(results: Mapping[str, Any], plt: Any) -> Any:
    fig, (ax_tau, ax_rate) = plt.subplots(1, 2, figsize=(10.0, 4.0))
    by_mode: Dict[str, List[Tuple[int, Dict[str, Any]]]] = defaultdict(list)
    for name, e in results["summary"]["runners"].items():
        if e["kind"] in ("engine", "native") and str(e["k"]).isdigit() and int(e["k"]) > 0:
            by_mode[f"{e['kind']}:{e['mode']}" if e["kind"] == "native" else e["mode"]].append((int(e["k"]), e))
    off = results["summary"]["runners"].get(REFERENCE_RUNNER, {}).get("tokens_per_s", {})
    for mode, points in sorted(by_mode.items()):
        points.sort(key=lambda p: p[0])
        ks = [k for k, _ in points]
        ax_tau.plot(ks, [e["tau"]["median"] for _, e in points], marker="o", label=mode)
        ax_rate.plot(ks, [e["tokens_per_s"]["median"] for _, e in points], marker="o", label=mode)
    if off.get("n"):
        ax_rate.axhline(off["median"], color="black", linewidth=0.8, linestyle="--", label="off")
    if not by_mode:
        for ax in (ax_tau, ax_rate):
            ax.text(0.5, 0.5, "no fixed-K runs (use --k 1,2,3,4,8)", ha="center", va="center",
                    transform=ax.transAxes)
    for ax in (ax_tau, ax_rate):
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax_tau.set_xlabel("K (draft length)")
    ax_tau.set_ylabel("tau (median)")
    ax_rate.set_xlabel("K (draft length)")
    ax_rate.set_ylabel("decode tokens/s (median)")
    for ax in (ax_tau, ax_rate):
        if by_mode:
            ax.legend(fontsize=7)
    fig.suptitle(f"tau and tokens/s against K - {_title(results)}", fontsize=10)
    fig.tight_layout()
    return fig


def _plot_predicted(results: Mapping[str, Any], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(5.5, 5.0))
    points: Dict[str, Tuple[List[float], List[float]]] = defaultdict(lambda: ([], []))
    for r in results["runs"]:
        if (r["runner"] != REFERENCE_RUNNER and not r.get("error") and finite(r.get("predicted_speedup"))
                and finite(r.get("speedup"))):
            xs, ys = points[str(r["runner"])]
            xs.append(float(r["predicted_speedup"]))
            ys.append(float(r["speedup"]))
    for name, (xs, ys) in sorted(points.items()):
        ax.scatter(xs, ys, s=12, alpha=0.7, label=name)
    values = [v for xs, ys in points.values() for v in xs + ys]
    top = max(values + [2.0])
    ax.plot([0, top], [0, top], color="black", linewidth=0.8)
    if not points:
        ax.text(0.5, 0.5, "no predicted speedups in this run", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize=7)
    ax.set_xlabel("predicted speedup (engine's policy)")
    ax.set_ylabel("measured speedup vs off (same run)")
    ax.set_title(f"Predicted vs measured - {_title(results)}", fontsize=10)
    fig.tight_layout()
    return fig
