"""`pytest --unit-beside` (what `make test` runs): the unit tests in a pytest process of their
own, started with the session, so they use the CPU the first integration tests leave idle
(the lifecycle tests wait on cluster starts and stops, 35-41 % of two cores idle) instead of
running after them. Their outcome joins the area summary and the session's exit status."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

OPTION = "--unit-beside"


def is_unit(item: pytest.Item) -> bool:
    return item.nodeid.startswith("tests/unit/")


class UnitBeside:
    """Runs the session's unit tests in a child pytest; `finish` waits for it and reports."""

    def __init__(self, root: Path, nodeids: list[str]) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="rayattn-unit-"))
        self.log, self.xml = self.dir / "unit.log", self.dir / "unit.xml"
        self.count = len(nodeids)
        # PYTEST_ADDOPTS is the parent's (a --junitxml there would be overwritten by both).
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "-p", "no:rayattn-area-summary",
                 f"--junitxml={self.xml}", *nodeids],
                cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def finish(self, interrupted: bool) -> tuple[int, dict[str, int], float, str]:
        """Waits for the child (ends it where the session was interrupted): its exit code,
        counts by outcome, the seconds its tests took and, where it failed, the tail of its
        output."""
        if interrupted:
            self.proc.terminate()
        rc = self.proc.wait()
        counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
        seconds = 0.0
        if self.xml.exists():
            for case in ET.parse(self.xml).iter("testcase"):
                seconds += float(case.get("time") or 0)
                kinds = {child.tag for child in case}
                outcome = ("failed" if "failure" in kinds else "error" if "error" in kinds
                           else "skipped" if "skipped" in kinds else "passed")
                counts[outcome] += 1
        tail = "" if rc == 0 else self.log.read_text()[-6000:]
        return rc, counts, seconds, tail


def split_off(config: pytest.Config, items: list[pytest.Item]) -> UnitBeside | None:
    """With --unit-beside and integration tests beside the unit tests: takes the unit tests
    out of this session and starts them in a child."""
    unit = [it for it in items if is_unit(it)]
    if not config.getoption(OPTION) or not unit or len(unit) == len(items):
        return None
    items[:] = [it for it in items if not is_unit(it)]
    return UnitBeside(Path(str(config.rootpath)), [it.nodeid for it in unit])
