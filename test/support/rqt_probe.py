"""The real rqt with one plugin, headless, in a process of its own, and what it displays, read back.

The parent side (:class:`RqtProbe`) starts ``python test/support/rqt_probe.py PLUGIN ...``: that child runs rqt as
``rqt --standalone PLUGIN`` does (rqt_gui's Main, its plugin manager, rqt_gui_py's node and spinner)
with ``QT_QPA_PLATFORM=offscreen``. Every 250 ms the child does what an operator would do with the
plugin (select a status, open its inspector, re-add a topic that discovery had not shown yet, widen
the time axis to the data) and writes what the widgets show, read from the widgets themselves, to a
JSON file that the parent polls:

- ``runtime_monitor``: the status tree (group -> item texts) and, for the selected status, the
  details pane's header lines and key/value table (the cells of the displayed QTextTable).
- ``robot_monitor``: every device tree item (full name, shown name, message) and the text of the
  inspector window opened on the selected status ("key: value" lines).
- ``plot``: per plotted topic, the (x, y) points rqt_plot holds and how many its backend draws,
  and the widget's start time (rqt_plot's x is a message's header stamp minus that time).

Commands go to the child's stdin, one a line: ``screenshot PATH`` (the main window, plus the inspector
beside it for robot_monitor). rqt takes SIGTERM into rclpy and keeps its Qt loop running: the parent
stops it with SIGINT, which rqt answers by closing its window.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

PLUGINS = {
    "runtime_monitor": "rqt_runtime_monitor.runtime_monitor.RuntimeMonitor",
    "robot_monitor": "rqt_robot_monitor.robot_monitor_plugin.RobotMonitorPlugin",
    "plot": "rqt_plot.plot.Plot",
}
POLL_MS = 250
#: rqt_plot may subscribe to none of its start-up topics when discovery has not shown them yet;
#: after this long, the probe adds a missing one as an operator would (type it, press "+").
READD_AFTER_S = 3.0


def rqt_available() -> Optional[str]:
    """None when rqt and the three plugins import, else why not (for a skip reason)."""
    try:
        import rqt_gui.main  # noqa: F401
        import rqt_plot.plot  # noqa: F401
        import rqt_robot_monitor.robot_monitor_plugin  # noqa: F401
        import rqt_runtime_monitor.runtime_monitor  # noqa: F401
    except ImportError as exc:
        return (f"rqt is not installed in this venv ({exc}); run ../shared/rqt-tools/install.sh .venv "
                "after ../shared/ros2-tools/install.sh .venv, as .ci/run does")
    return None


# -- parent side ------------------------------------------------------------------------------------
class RqtProbe:
    """One rqt process showing ``plugin`` (a key of :data:`PLUGINS`); ``select`` names the status to
    select (runtime_monitor) or inspect (robot_monitor); ``args`` go to rqt after the plugin (e.g.
    ``["--args", "/topic/field"]`` or ``["--ros-args", "-r", "/a:=/b"]``)."""

    def __init__(self, plugin: str, folder: Path, args: List[str], select: str = "",
                 env: Optional[Dict[str, str]] = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.plugin = plugin
        self.state_path = folder / f"{plugin}.json"
        self.log_path = folder / f"{plugin}.log"
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("QT_QPA_PLATFORM", "offscreen")
        # rqt's settings (window geometry, plugin state) stay out of the user's home
        child_env.update(XDG_CONFIG_HOME=str(folder), XDG_RUNTIME_DIR=str(folder), PYTHONUNBUFFERED="1")
        os.chmod(folder, 0o700)  # Qt refuses a runtime dir others can read
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), plugin, "--state", str(self.state_path),
                 "--select", select, "--", *args],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=child_env, text=True)

    def shown(self) -> Dict[str, Any]:
        """The latest snapshot of what the plugin displays ({} before the first)."""
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return {}

    def wait_shown(self, predicate: Callable[[Dict[str, Any]], Any], timeout: float, what: str) -> Any:
        """Poll snapshots until ``predicate(snapshot)`` is truthy; its value, or AssertionError
        naming ``what`` with the last snapshot and rqt's log."""
        deadline = time.monotonic() + timeout
        while True:
            shown = self.shown()
            value = predicate(shown) if shown else None
            if value:
                return value
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"rqt {self.plugin} did not show {what} within {timeout:.0f} s "
                                     f"(exit status {self.proc.poll()}); last snapshot:\n"
                                     f"{json.dumps(shown, indent=1)[:6000]}\nrqt log:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def screenshot(self, path: Path, timeout: float = 30.0) -> Path:
        """A PNG of the window as it is now (the child grabs it between two polls)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"screenshot {path.resolve()}\n")
        self.proc.stdin.flush()
        self.wait_shown(lambda s: str(path.resolve()) in s.get("screenshots", []), timeout,
                        f"a screenshot saved to {path}")
        return path

    def close(self, timeout: float = 30.0) -> Optional[int]:
        """SIGINT (rqt closes its window and exits); SIGKILL if it has not after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


# -- child side: rqt itself --------------------------------------------------------------------------
def _table_rows(text_edit: Any) -> List[List[str]]:
    """The cells of the first table displayed in a QTextEdit/QTextBrowser, row by row."""
    from python_qt_binding.QtGui import QTextCursor, QTextTable

    rows: List[List[str]] = []
    for frame in text_edit.document().rootFrame().childFrames():
        if isinstance(frame, QTextTable):
            for r in range(frame.rows()):
                row = []
                for c in range(frame.columns()):
                    cell = frame.cellAt(r, c)
                    cursor = cell.firstCursorPosition()
                    cursor.setPosition(cell.lastCursorPosition().position(), QTextCursor.KeepAnchor)
                    row.append(cursor.selectedText().strip())
                rows.append(row)
            break
    return rows


def _lines_to_values(text: str) -> Dict[str, str]:
    """"key: value" lines (rqt_robot_monitor's inspector) as a dict; the first ": " splits."""
    values = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if sep:
            values[key] = value
    return values


class _Driver:
    """What the child does every poll: act like an operator on the plugin, then write a snapshot."""

    def __init__(self, app: Any, plugin: str, state: Path, select: str, topics: List[str]) -> None:
        self.app, self.plugin, self.state, self.select, self.topics = app, plugin, state, select, topics
        self.t0 = time.monotonic()
        self.screenshots: List[str] = []
        self.commands: "queue.Queue[str]" = queue.Queue()
        self.inspector: Any = None
        self.sized = False
        threading.Thread(target=self._read_commands, daemon=True).start()

    def _read_commands(self) -> None:
        for line in sys.stdin:
            self.commands.put(line.strip())

    def _widget(self, class_path: str) -> Any:
        module, _, name = class_path.rpartition(".")
        cls = getattr(__import__(module, fromlist=[name]), name)
        return next((w for w in self.app.allWidgets() if isinstance(w, cls)), None)

    def _window(self) -> Any:
        from qt_gui.main_window import MainWindow
        return next((w for w in self.app.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()),
                    None)

    def poll(self) -> None:
        window = self._window()
        snapshot: Dict[str, Any] = {"time": time.time(), "window": window is not None}
        try:
            if window is not None:
                if not self.sized:  # big enough for the details table / a readable plot
                    window.resize(*{"runtime_monitor": (1000, 860), "robot_monitor": (640, 420),
                                    "plot": (900, 480)}[self.plugin])
                    self.sized = True
                    if self.plugin == "runtime_monitor":  # drag the divider: full status lines
                        from python_qt_binding.QtWidgets import QSplitter
                        for splitter in window.findChildren(QSplitter):
                            splitter.setSizes([440, 560])
                snapshot.update(getattr(self, "_" + self.plugin)())
                while not self.commands.empty():
                    self._command(self.commands.get(), window)
        except Exception as exc:  # noqa: BLE001  reported to the parent, never a hung probe
            import traceback
            traceback.print_exc()
            snapshot["error"] = repr(exc)
        snapshot["screenshots"] = self.screenshots
        partial = self.state.with_suffix(".partial")
        partial.write_text(json.dumps(snapshot))
        os.replace(partial, self.state)  # the parent never reads half a snapshot

    def _command(self, command: str, window: Any) -> None:
        verb, _, argument = command.partition(" ")
        if verb == "screenshot":
            pixmap = window.grab()
            if self.inspector is not None:  # the inspector is a window of its own: put it beside
                from python_qt_binding.QtGui import QColor, QPainter, QPixmap
                side = self.inspector.grab()
                both = QPixmap(pixmap.width() + side.width() + 8, max(pixmap.height(), side.height()))
                both.fill(QColor("white"))
                painter = QPainter(both)
                painter.drawPixmap(0, 0, pixmap)
                painter.drawPixmap(pixmap.width() + 8, 0, side)
                painter.end()
                pixmap = both
            if pixmap.save(argument):
                self.screenshots.append(argument)

    def _runtime_monitor(self) -> Dict[str, Any]:
        widget = self._widget("rqt_runtime_monitor.runtime_monitor_widget.RuntimeMonitorWidget")
        if widget is None:
            return {}
        tree, groups = widget.tree_widget, {}
        for i in range(tree.topLevelItemCount()):
            group = tree.topLevelItem(i)
            label = group.text(0).split(" (")[0]  # "Ok (1)" -> "Ok"
            groups[label] = [group.child(j).text(0) for j in range(group.childCount())]
            for j in range(group.childCount()):
                if self.select and group.child(j).text(0).startswith(self.select + ":"):
                    group.setExpanded(True)
                    if tree.currentItem() is not group.child(j):
                        tree.setCurrentItem(group.child(j))  # the operator's click
        header = _lines_to_values(widget.html_browser.toPlainText().split("\n\n")[0])
        rows = _table_rows(widget.html_browser)
        return {"groups": groups, "selected": tree.currentItem().text(0) if tree.currentItem() else "",
                "details": header, "values": {row[0]: row[1] for row in rows if len(row) == 2}}

    def _robot_monitor(self) -> Dict[str, Any]:
        from python_qt_binding.QtWidgets import QTreeWidgetItemIterator
        widget = self._widget("rqt_robot_monitor.robot_monitor.RobotMonitorWidget")
        if widget is None:
            return {}
        items, it = [], QTreeWidgetItemIterator(widget.tree_all_devices)
        while it.value() is not None:
            item = it.value()
            items.append({"name": getattr(item, "name", ""), "shown": item.text(0), "message": item.text(1)})
            if self.select and getattr(item, "name", "") == self.select and self.inspector is None:
                widget.tree_all_devices.itemDoubleClicked.emit(item, 0)  # opens the inspector
                self.inspector = self._widget("rqt_robot_monitor.inspector_window.InspectorWindow")
                if self.inspector is not None:
                    self.inspector.resize(460, 420)
            it += 1
        inspected = self.inspector.disp.toPlainText() if self.inspector is not None else ""
        return {"items": items, "inspector": _lines_to_values(inspected)}

    def _plot(self) -> Dict[str, Any]:
        widget = self._widget("rqt_plot.plot_widget.PlotWidget")
        if widget is None or widget.data_plot is None:
            return {}
        if time.monotonic() - self.t0 > READD_AFTER_S:
            for topic in self.topics:
                if topic not in widget._rosdata:
                    widget.topic_edit.setText(topic)
                    widget.add_topic(topic)
        plot, curves = widget.data_plot, {}
        for topic, curve in plot._curves.items():
            drawn = plot._data_plot_widget._curves[topic].getData()[1]
            curves[topic] = {"x": [float(v) for v in curve["x"]], "y": [float(v) for v in curve["y"]],
                             "drawn": 0 if drawn is None else len(drawn)}
        if curves and not plot._markers_on:  # per-request topics are a few points: show them
            plot._switch_plot_markers(True)  # (the operator's "markers" box in the plot settings)
        xs = [x for c in curves.values() for x in c["x"]]
        ys = [y for c in curves.values() for y in c["y"] if y == y]  # not NaN
        if xs and ys:  # the whole run in view (rqt_plot starts 10 s wide and scrolls)
            plot.set_xlim([max(0.0, min(xs) - 1.0), max(xs) + 1.0])
            plot.set_ylim([min(0.0, min(ys)), 1.15 * max(ys)])
        return {"start_time": widget._start_time, "subscribed": sorted(widget._rosdata),
                "backend": plot.getTitle(), "curves": curves}


def child_main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description="rqt with one plugin, reporting what it shows")
    parser.add_argument("plugin", choices=sorted(PLUGINS))
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--select", default="")
    split = argv.index("--") if "--" in argv else len(argv)  # after "--": rqt's own arguments
    args = parser.parse_args(argv[:split])
    args.rqt_args = argv[split + 1:]
    from python_qt_binding.QtCore import QTimer
    from rqt_gui.main import Main

    topics: List[str] = []  # rqt_plot's: the words after --args, up to --ros-args
    if "--args" in args.rqt_args:
        topics = args.rqt_args[args.rqt_args.index("--args") + 1:]
        topics = topics[:topics.index("--ros-args")] if "--ros-args" in topics else topics

    class ProbedRqt(Main):
        def create_application(self, qt_argv: List[str]) -> Any:
            app = super().create_application(qt_argv)
            self.driver = _Driver(app, args.plugin, args.state, args.select, topics)
            self.timer = QTimer(app)
            self.timer.timeout.connect(self.driver.poll)
            self.timer.start(POLL_MS)
            return app

    rqt_argv = ["rqt", "--clear-config", "--standalone", PLUGINS[args.plugin], *args.rqt_args]
    sys.argv = rqt_argv  # rqt's node reads its --ros-args (remappings) from sys.argv
    return ProbedRqt().main(rqt_argv) or 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
