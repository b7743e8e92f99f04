"""What `make test` reports at its end: one line per area of the suite (passed, failed,
skipped, time), and progress lines while the cluster and the apps start."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest
from _pytest.terminal import TerminalReporter

AREAS: dict[str, str] = {
    "test_serving": "serving", "test_openai_surface": "serving",
    "test_correctness": "serving", "test_metrics": "serving",
    "test_affinity": "routing", "test_router_truth": "routing", "test_dp_ranks": "routing",
    "test_bench": "routing", "test_simulated_fleet": "routing",
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
        self.failures = ""

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        a = area(report.nodeid)
        self.seconds[a] += report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = "error" if report.when == "setup" and report.failed else report.outcome
            self.counts[a][outcome] += 1
        elif report.when == "teardown" and report.failed:
            self.counts[a]["error"] += 1

    def add(self, area_name: str, counts: dict[str, int], seconds: float, failures: str) -> None:
        for outcome, n in counts.items():
            self.counts[area_name][outcome] += n
        self.seconds[area_name] += seconds
        self.failures += failures

    def pytest_terminal_summary(self, terminalreporter: TerminalReporter) -> None:
        tr = terminalreporter
        if self.failures:
            tr.section("unit tests run beside: their output's end", red=True)
            tr.write_line(self.failures)
        tr.section("summary by area")
        for a in ORDER + sorted(set(self.counts) - set(ORDER)):
            if a not in self.counts:
                continue
            c = self.counts[a]
            tr.write_line(f"{a:<12} {c['passed']:>4} passed {c['failed']:>3} failed "
                          f"{c['error']:>3} errors {c['skipped']:>3} skipped "
                          f"{self.seconds[a] / 60:6.1f} min")


def configure(config: pytest.Config) -> None:
    global _config
    _config = config
    config.pluginmanager.register(AreaSummary(), "rayattn-area-summary")


def add(area_name: str, counts: dict[str, int], seconds: float, failures: str) -> None:
    """Outcomes of tests run outside this session (tests/beside.py) into its summary."""
    assert _config is not None
    summary = _config.pluginmanager.get_plugin("rayattn-area-summary")
    summary.add(area_name, counts, seconds, failures)
