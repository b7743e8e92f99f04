"""What `make test` reports at its end: one line per area of the suite (passed, failed,
skipped, time), and progress lines while the cluster and the apps start."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

AREAS: dict[str, str] = {
    "test_serving": "serving", "test_openai_surface": "serving",
    "test_correctness": "serving", "test_metrics": "serving",
    "test_affinity": "routing", "test_router_truth": "routing", "test_dp_ranks": "routing",
    "test_bench": "routing",
    "test_reliability": "reliability", "test_operations": "reliability",
    "test_lifecycle": "reliability",
    "test_hostile": "security", "test_api_surface": "security",
    "test_multi_model": "multi-model",
}
ORDER = ["unit", "serving", "routing", "reliability", "security", "multi-model"]

_config: pytest.Config | None = None


def area(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/unit/"):
        return "unit"
    return AREAS.get(path.rsplit("/", 1)[-1].removesuffix(".py"), "other")


def progress(message: str) -> None:
    """A line on the terminal now, whatever pytest captures (a newcomer sees what the suite
    is waiting for)."""
    line = f"[{time.strftime('%H:%M:%S')}] {message}"
    plugins = _config.pluginmanager if _config else None
    reporter = plugins.get_plugin("terminalreporter") if plugins else None
    capture = plugins.get_plugin("capturemanager") if plugins else None
    if reporter is None or capture is None:
        print(line, flush=True)
        return
    with capture.global_and_fixture_disabled():
        reporter.ensure_newline()
        reporter.write_line(line, cyan=True)


class AreaSummary:
    """Per area: counts by outcome and the time its tests took (setup, call, teardown)."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        a = area(report.nodeid)
        self.seconds[a] += report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = "error" if report.when == "setup" and report.failed else report.outcome
            self.counts[a][outcome] += 1
        elif report.when == "teardown" and report.failed:
            self.counts[a]["error"] += 1

    def _merge(self, tr) -> None:
        """The unit run of scripts/test.sh, which ran beside this one: wait for its end."""
        path, pid = os.environ.get("RAYATTN_AREAS_MERGE"), os.environ.get(
            "RAYATTN_AREAS_MERGE_PID")
        if not path:
            return
        while pid and not Path(path).exists() and _alive(int(pid)):
            time.sleep(0.2)
        if not Path(path).exists():
            tr.write_line(f"(the run beside this one left no summary in {path})", red=True)
            return
        for a, got in json.loads(Path(path).read_text()).items():
            for outcome, n in got["counts"].items():
                self.counts[a][outcome] += n
            self.seconds[a] += got["seconds"]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        tr = terminalreporter
        out = os.environ.get("RAYATTN_AREAS_OUT")
        if out:
            Path(out).write_text(json.dumps({a: {"counts": dict(c), "seconds": self.seconds[a]}
                                             for a, c in self.counts.items()}))
        self._merge(tr)
        tr.section("summary by area")
        for a in ORDER + sorted(set(self.counts) - set(ORDER)):
            if a not in self.counts:
                continue
            c = self.counts[a]
            tr.write_line(f"{a:<12} {c['passed']:>4} passed {c['failed']:>3} failed "
                          f"{c['error']:>3} errors {c['skipped']:>3} skipped "
                          f"{self.seconds[a] / 60:6.1f} min")


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def configure(config: pytest.Config) -> None:
    global _config
    _config = config
    config.pluginmanager.register(AreaSummary(), "rayattn-area-summary")
