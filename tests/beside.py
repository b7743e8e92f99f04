"""`pytest --unit-beside` (what `make test` runs): the unit tests in a pytest process of their
own, started once the session's selection is known, so they use the CPU the first
integration tests leave idle (the lifecycle tests wait on cluster starts and stops, 35-41 %
of two cores idle) instead of running after them. Their outcome joins the area summary and
the session's exit status."""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple

import pytest

from tests import areas

OPTION = "--unit-beside"
NICE = 5
"""Below the integration tests' processes: a cluster start waits on its CPU, a unit test on
nothing in particular."""
WAIT_S = 1800
"""The most the session waits for the unit tests once its own tests are over."""


class Outcome(NamedTuple):
    exit_code: int
    counts: dict[str, int]
    seconds: float
    output_end: str
    """The end of the child's output where it failed, else empty."""


def is_unit(item: pytest.Item) -> bool:
    return item.nodeid.startswith("tests/unit/")


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: no dlopen after fork
PR_SET_PDEATHSIG = 1


def _child_setup(parent: int) -> None:
    os.nice(NICE)
    # Ends with the session's pytest however it ends (SIGKILLed included); a parent gone
    # before the call would not signal it, hence the check after.
    if _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM) != 0 or os.getppid() != parent:
        os._exit(1)


class UnitBeside:
    """Runs the selected unit tests in a child pytest; `finish` waits for it and reports."""

    def __init__(self, root: Path, nodeids: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="rayattn-unit-"))
        self.log, self.xml = self.dir / "unit.log", self.dir / "unit.xml"
        self.count = len(nodeids)
        with self.log.open("w") as out:
            # The session's PYTEST_ADDOPTS applies to the child too; its own --junitxml comes
            # later on the command line and wins.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "-p", "no:rayattn-area-summary", f"--junitxml={self.xml}", *nodeids],
                cwd=root, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=functools.partial(_child_setup, os.getpid()))

    def finish(self, interrupted: bool) -> Outcome:
        """Waits for the child (ends it where the session was interrupted, or after
        WAIT_S): its exit code, counts by outcome, the seconds its tests took and, where it
        failed, the end of its output."""
        if interrupted:
            self.proc.terminate()
        elif self.proc.poll() is None:
            areas.progress(f"waiting for the unit tests (pid {self.proc.pid}, output: "
                           f"{self.log})")
        try:
            rc = self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = -1
        counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
        seconds = 0.0
        try:
            cases = list(ET.parse(self.xml).iter("testcase")) if self.xml.exists() else []
        except ET.ParseError:
            cases = []
        for case in cases:
            seconds += float(case.get("time") or 0)
            kinds = {child.tag for child in case}
            outcome = ("failed" if "failure" in kinds else "error" if "error" in kinds
                       else "skipped" if "skipped" in kinds else "passed")
            counts[outcome] += 1
        if rc != 0 and not any(counts.values()):
            counts["error"] = 1  # it died before reporting a test: not a pass
        end = ""
        if rc != 0:
            end = self.log.read_text()[-6000:] + (
                f"\n(ended after {WAIT_S} s)" if rc == -1 else "")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
        return Outcome(rc, counts, seconds, end)


class Splitter:
    """Takes the unit tests out of the session once every selection (-k, -m, --deselect)
    is applied, and starts them beside it."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.child: UnitBeside | None = None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        opt = self.config.option
        # The last-failed and stepwise plugins select after this hook: they see one session.
        if opt.collectonly or any(getattr(opt, o, False)
                                  for o in ("lf", "failedfirst", "stepwise")):
            return
        unit = [it for it in items if is_unit(it)]
        if not unit or len(unit) == len(items):
            return
        items[:] = [it for it in items if not is_unit(it)]
        self.child = UnitBeside(self.config.rootpath, [it.nodeid for it in unit])
        areas.progress(f"unit tests: {self.child.count} running beside the integration tests "
                       f"in pid {self.child.proc.pid} (output: {self.child.log})")


def configure(config: pytest.Config) -> Splitter | None:
    if not config.getoption(OPTION):
        return None
    splitter = Splitter(config)
    config.pluginmanager.register(splitter, "rayattn-unit-beside")
    return splitter
