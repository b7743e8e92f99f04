"""`serve run` under `rayattn serve`: stopped the way Ctrl-C stops it, whichever signal comes.

`serve run` drains only on SIGINT (its KeyboardInterrupt path calls `serve.shutdown()`, which
lets every replica finish its requests). A SIGTERM, what a container runtime, systemd or a
Kubernetes pod sends to the process it started, reaches Ray's driver handler instead: it
exits at once, the requests in flight are cut, and Ray's own fatal-signal handler aborts the
process (exit -6, SIGABRT, seen on a GPU host). So `rayattn serve` stays the parent: `serve
run` runs as its child in a process group of its own (a signal to the parent's group, a
terminal's Ctrl-C included, reaches the parent alone), and the parent passes the first
SIGINT or SIGTERM on as SIGINT, any later one as SIGTERM (a second Ctrl-C: stop now without
the drain). If the parent itself is killed (SIGKILL), the kernel kills the child too, as
when `serve run` was the process the signal reached."""

from __future__ import annotations

import signal
import subprocess
from types import FrameType

from rayattn.server.haproxy_exec import die_with_parent


def _child_setup() -> None:
    # Between fork and exec: default handling of SIGINT (a shell's background job inherits
    # it ignored, and Python then never raises KeyboardInterrupt), gone with the parent.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent()


def run(argv: list[str]) -> int:
    """Run `argv` (`serve run <config>`) to its end; its exit status, as a shell reports it."""
    child = subprocess.Popen(argv, process_group=0, preexec_fn=_child_setup)
    signals = 0

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal signals
        signals += 1
        try:
            child.send_signal(signal.SIGINT if signals == 1 else signal.SIGTERM)
        except ProcessLookupError:
            pass

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, forward)
    code = child.wait()  # a handler interrupts the wait, PEP 475 resumes it
    return 128 - code if code < 0 else code
