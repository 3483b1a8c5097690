"""What an operator sees in the real rqt, watching the real node: rqt_runtime_monitor, rqt_robot_monitor
and rqt_plot, headless (``QT_QPA_PLATFORM=offscreen``), each in a process of its own (test/support/rqt_probe.py
reads back what their widgets display).

One node (gemma-spec-serve on config/embedded.yaml, named ``gemma_spec`` as the README's commands
expect) serves the whole module; a ROS client beside rqt receives the same ``/diagnostics`` and
SpecStats topics, so every check compares what rqt shows with what the node published. Goals use a
prompt full of repetition in ``lookup`` mode, so drafts are accepted and tau > 1.

rqt (python_qt_binding, qt_gui, rqt_gui(_py), rqt_py_common and the three plugins: Jazzy sources,
not on any package registry) comes from ``../shared/rqt-tools/install.sh .venv``; without it this
module skips, saying so. ``GEMMA_SPEC_RQT_SCREENSHOTS=DIR`` saves the screenshots there
(``make screenshots``: docs/rqt), else in the test's temporary folder.
"""
from __future__ import annotations

import math
import os
import signal
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from support.rqt_probe import RqtProbe, rqt_available

WHY_NOT = rqt_available()
if WHY_NOT:  # pragma: no cover - depends on the machine
    pytest.skip(WHY_NOT, allow_module_level=True)

from diagnostic_msgs.msg import DiagnosticStatus  # noqa: E402  (after the skip: rqt_available reports a missing install first)

from gemma_spec_ros.client import GenerateClient, key_values, wait_until  # noqa: E402
from gemma_spec_ros.node import spec_status_name  # noqa: E402
from support.node import serving  # noqa: E402

NODE = "gemma_spec"
SPEC_STATUS = spec_status_name(NODE)
MODELS_STATUS = f"{NODE}: models"
STATS = f"/{NODE}/spec_stats"
ROLLING = f"/{NODE}/spec_stats_rolling"
TAU, RATE, MODE, SPEED = "tau (mean acceptance length)", "acceptance rate", "mode", "tokens/s"
#: Re-measured at every diagnostics period, so two consecutive statuses differ in it.
VOLATILE_KEYS = {"RSS MiB"}
#: rqt_runtime_monitor's groups (the label before " (count)") by level.
GROUP_OF_LEVEL = {DiagnosticStatus.OK: "Ok", DiagnosticStatus.WARN: "Warnings",
                  DiagnosticStatus.ERROR: "Errors", DiagnosticStatus.STALE: "Stale"}
#: rqt_robot_monitor's inspector names the level in words.
WORD_OF_LEVEL = {DiagnosticStatus.OK: "OK", DiagnosticStatus.WARN: "WARNING",
                 DiagnosticStatus.ERROR: "ERROR", DiagnosticStatus.STALE: "STALE"}
#: Repetition that n-gram lookup drafts from, so the target accepts drafts (tau > 1); two kinds, so
#: that the plotted per-request values differ.
PROMPTS = ("red, green, blue, red, green, blue, red, green, blue, red, green, blue, red, green,",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n")
GOAL: Dict[str, Any] = dict(max_tokens=40, temperature=0.0, seed=1, spec_mode="lookup")
SHOWN_WITHIN = 60.0  # generous: two cores shared by the node, four rqt processes and other work


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("GEMMA_SPEC_RQT_SCREENSHOTS")
    return Path(folder) if folder else tmp_path_factory.mktemp("rqt_screenshots")


@pytest.fixture(scope="module")
def client(repo_root: Path, venv_python: Path, tmp_path_factory: pytest.TempPathFactory,
           ros: None) -> Iterator[GenerateClient]:
    """The node, active, with a fixed K (drafts independent of timing) and a fast diagnostics
    period; a client subscribed to its topics."""
    tmp = tmp_path_factory.mktemp("rqt_node")
    overrides = {"target.n_ctx": 512, "spec.adaptive": False, "spec.draft_max": 3,
                 "lookup.dynamic_path": str(tmp / "dynamic.bin"), "lookup.cache_dir": str(tmp),
                 "diagnostics.period": 0.5}
    with serving(repo_root, venv_python, overrides, tmp / "serve.log", node=NODE):
        client = GenerateClient(f"/{NODE}", name="gemma_spec_rqt_test_client")
        try:
            client.wait_subscribed()
            yield client
        finally:
            client.close()


@pytest.fixture(scope="module")
def rqt(client: GenerateClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, RqtProbe]]:
    """The four rqt windows, started together (their start-ups overlap), then two goals, so that
    tau > 1 on /diagnostics before the first check. Stopped with SIGINT at the end."""
    tmp = tmp_path_factory.mktemp("rqt")
    probes = {
        "runtime_monitor": RqtProbe("runtime_monitor", tmp / "runtime_monitor", [], select=SPEC_STATUS),
        # no diagnostic_aggregator here: rqt_robot_monitor reads the raw statuses
        "robot_monitor": RqtProbe("robot_monitor", tmp / "robot_monitor",
                                  ["--ros-args", "-r", "/diagnostics_agg:=/diagnostics"], select=SPEC_STATUS),
        "plot_tau": RqtProbe("plot", tmp / "plot_tau", ["--args", f"{STATS}/mean_acceptance_length",
                                                        f"{ROLLING}/mean_acceptance_length"]),
        "plot_speed": RqtProbe("plot", tmp / "plot_speed", ["--args", f"{STATS}/tokens_per_second",
                                                            f"{ROLLING}/tokens_per_second"]),
    }
    try:
        for prompt in PROMPTS:
            run = client.send(prompt=prompt, **GOAL)
            assert run.accepted and run.wait_result().stats.mean_acceptance_length > 1.0, run.result
        yield probes
    finally:
        statuses = {name: probe.close() for name, probe in probes.items()}
    # rqt answers SIGINT by closing its window and exiting cleanly; rqt_plot (PyQt5, offscreen) was
    # seen to end with SIGSEGV in its own Qt teardown in 2 of ~5 runs, after every check of what it
    # showed had passed: for the plots that one signal is taken as its exit, reported, not failed
    teardown_crash = {name: status for name, status in statuses.items()
                      if name.startswith("plot") and status == -signal.SIGSEGV}
    if teardown_crash:
        warnings.warn(f"rqt_plot crashed in its Qt teardown after SIGINT: {teardown_crash}")
    assert all(status == 0 for name, status in statuses.items() if name not in teardown_crash), statuses


def latest_status(client: GenerateClient, name: str) -> Optional[DiagnosticStatus]:
    """The last status named ``name`` that the client received on /diagnostics (None before one)."""
    return next((s for s in reversed(list(client.diagnostics)) if s.name == name), None)


def monitor_shows(shown: Dict[str, Any], status: DiagnosticStatus) -> bool:
    """rqt_runtime_monitor shows ``status``: its line "name: message" in the group of its level,
    selected, and the details table holding exactly its key-values (but the re-measured ones)."""
    line = f"{status.name}: {status.message}"
    table = {k: v for k, v in shown.get("values", {}).items() if k not in VOLATILE_KEYS}
    published = {k: v for k, v in key_values(status).items() if k not in VOLATILE_KEYS}
    return (line in shown.get("groups", {}).get(GROUP_OF_LEVEL[status.level], [])
            and shown.get("selected") == line and table == published)


def wait_monitor_shows_latest(client: GenerateClient, monitor: RqtProbe, what: str,
                              key: str = "", value: str = "") -> Dict[str, Any]:
    """Until rqt_runtime_monitor shows the latest published spec status (with ``key`` = ``value``
    where given: a change the node has just made); that snapshot."""
    def shows(shown: Dict[str, Any]) -> Any:
        status = latest_status(client, SPEC_STATUS)
        if status is None:
            return None
        changed = not key or key_values(status).get(key) == value
        return changed and monitor_shows(shown, status) and shown

    return monitor.wait_shown(shows, SHOWN_WITHIN, what)


@pytest.mark.timeout(300)
def test_runtime_monitor_shows_tau_rate_mode_and_speed_as_published(
        client: GenerateClient, rqt: Dict[str, RqtProbe], screenshots: Path) -> None:
    monitor = rqt["runtime_monitor"]
    shown = wait_monitor_shows_latest(client, monitor, "the spec status as /diagnostics carries it, "
                                      "both requests done", "requests ok", str(len(PROMPTS)))
    values = shown["values"]
    assert float(values[TAU]) > 1.0 and 0.0 < float(values[RATE]) <= 1.0, values
    assert values[MODE] == "lookup" and float(values[SPEED]) > 0.0, values
    assert shown["details"]["Component"] == SPEC_STATUS, shown["details"]
    png = monitor.screenshot(screenshots / "rqt-runtime-monitor.png")
    assert png.stat().st_size > 10_000


@pytest.mark.timeout(300)
def test_runtime_monitor_follows_a_mode_switch(client: GenerateClient, rqt: Dict[str, RqtProbe]) -> None:
    monitor = rqt["runtime_monitor"]
    try:
        assert client.set_parameters(spec__mode="off")[0].successful
        wait_monitor_shows_latest(client, monitor, "spec.mode off", MODE, "off")
    finally:
        assert client.set_parameters(spec__mode="lookup")[0].successful
    wait_monitor_shows_latest(client, monitor, "spec.mode lookup again", MODE, "lookup")


def plotted(shown: Dict[str, Any], topic: str) -> List[tuple]:
    """The (x, y) points rqt_plot holds for ``topic``, once its backend draws all of them."""
    curve = shown.get("curves", {}).get(topic)
    if not curve or curve["drawn"] != len(curve["y"]):
        return []
    return list(zip(curve["x"], curve["y"]))


def published_points(messages: List[Any], field: str, start_time: float) -> Dict[float, float]:
    """x -> y of each SpecStats message as rqt_plot computes them: x = header stamp - start time."""
    return {m.header.stamp.sec + m.header.stamp.nanosec * 10**-9 - start_time: getattr(m, field)
            for m in list(messages)}


def assert_plots_what_was_published(shown: Dict[str, Any], topic: str, messages: List[Any],
                                    field: str) -> List[float]:
    """Every point rqt_plot holds for ``topic`` is a published message's value at its stamp
    (same float); the plotted values in time order."""
    published = published_points(messages, field, shown["start_time"])
    points = plotted(shown, topic)
    for x, y in points:
        match = next((v for t, v in published.items() if abs(t - x) < 1e-6), None)
        assert match is not None, f"{topic}: a point at x={x} that no message has: {sorted(published)}"
        same = y == match or (math.isnan(y) and math.isnan(match))  # tau before any request: NaN
        assert same, f"{topic}: plotted {y} at x={x}, published {match}"
    return [y for _, y in sorted(points)]


@pytest.mark.timeout(300)
def test_plot_draws_the_published_tau_and_tokens_per_second(
        client: GenerateClient, rqt: Dict[str, RqtProbe], screenshots: Path) -> None:
    plots = {"mean_acceptance_length": rqt["plot_tau"], "tokens_per_second": rqt["plot_speed"]}
    for field, plot in plots.items():
        topics = [f"{STATS}/{field}", f"{ROLLING}/{field}"]
        plot.wait_shown(lambda s: all(t in s.get("subscribed", []) for t in topics), SHOWN_WITHIN,
                        f"subscriptions to {topics}")
    # both plots' subscriptions known to the graph, then more goals: their SpecStats must reach them
    wait_until(lambda: client.node.count_subscribers(STATS) >= 3, SHOWN_WITHIN, "rqt_plot's subscriptions")
    before = len(client.spec_stats)
    for prompt in PROMPTS + PROMPTS[:1]:
        run = client.send(prompt=prompt, **GOAL)
        assert run.wait_result().stats.mean_acceptance_length > 1.0, run.result
    wait_until(lambda: len(client.spec_stats) >= before + 3, 30.0, "the goals' SpecStats on ~/spec_stats")
    for field, plot in plots.items():
        per_request, rolling = f"{STATS}/{field}", f"{ROLLING}/{field}"

        def all_goals_plotted(shown: Dict[str, Any]) -> Any:
            """Each goal's point, and a rolling point published after the last goal."""
            if not shown.get("curves"):
                return None
            goals = published_points(client.spec_stats[before:], field, shown["start_time"])
            xs = [x for x, _ in plotted(shown, per_request)]
            every_goal = all(any(abs(t - x) < 1e-6 for x in xs) for t in goals)
            after_goals = any(x > max(goals) for x, _ in plotted(shown, rolling))
            return every_goal and after_goals and shown

        shown = plot.wait_shown(all_goals_plotted, SHOWN_WITHIN, f"the {field} of the three goals")
        request_values = assert_plots_what_was_published(shown, per_request, client.spec_stats, field)
        rolling_values = assert_plots_what_was_published(shown, rolling, client.spec_stats_rolling, field)
        # tau > 1: drafts were accepted (and tokens/s > 1); the lifetime value after the goals too
        assert min(request_values) > 1.0 and rolling_values[-1] > 1.0, (request_values, rolling_values)
        plot.screenshot(screenshots / f"rqt-plot-{field.replace('_', '-')}.png")


@pytest.mark.timeout(300)
def test_robot_monitor_remapped_shows_both_statuses(
        client: GenerateClient, rqt: Dict[str, RqtProbe], screenshots: Path) -> None:
    monitor = rqt["robot_monitor"]

    def inspector_shows_latest(shown: Dict[str, Any]) -> bool:
        """The inspector holds every key-value of the latest status (but the re-measured ones)."""
        status = latest_status(client, SPEC_STATUS)
        if status is None:
            return False
        inspected = shown.get("inspector", {})
        published = {k: v for k, v in key_values(status).items() if k not in VOLATILE_KEYS}
        return inspected.get("Level") == WORD_OF_LEVEL[status.level] and all(inspected.get(k) == v for k, v in published.items())

    shown = monitor.wait_shown(lambda s: inspector_shows_latest(s) and s, SHOWN_WITHIN,
                               "the inspector of the spec status as /diagnostics carries it")
    names = {item["name"]: item for item in shown["items"]}
    assert SPEC_STATUS in names and MODELS_STATUS in names, names
    assert names[MODELS_STATUS]["message"] == "loaded", names
    assert float(shown["inspector"][TAU]) > 1.0, shown["inspector"]
    monitor.screenshot(screenshots / "rqt-robot-monitor.png")


@pytest.mark.timeout(300)
def test_runtime_monitor_shows_an_inactive_node_as_ok_inactive(
        client: GenerateClient, rqt: Dict[str, RqtProbe]) -> None:
    """A deliberately inactive node is not a fault and not a dead node: OK with the message
    "inactive", never Stale (which the monitor keeps for a node that stopped publishing); back to
    active afterwards."""
    monitor = rqt["runtime_monitor"]
    try:
        assert client.transition("deactivate")
        shown = wait_monitor_shows_latest(client, monitor, "the inactive node's status", "state", "inactive")
        assert f"{SPEC_STATUS}: inactive" in shown["groups"]["Ok"], shown["groups"]
        assert not any(SPEC_STATUS in line for line in shown["groups"].get("Stale", [])), shown["groups"]
    finally:
        assert client.transition("activate")
    wait_monitor_shows_latest(client, monitor, "the active node's status again", "state", "active")
