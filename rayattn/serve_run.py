"""`serve run` under `rayattn serve`: stopped the way Ctrl-C stops it, whichever signal comes.

`serve run` drains only on SIGINT (its KeyboardInterrupt path calls `serve.shutdown()`, which
lets every replica finish its requests). A SIGTERM, what a container runtime, systemd or a
Kubernetes pod sends to the process it started, reaches Ray's driver handler instead: it
exits at once, the requests in flight are cut, and Ray's own fatal-signal handler aborts the
process (exit -6, SIGABRT, seen on a GPU host). So `rayattn serve` stays the parent: `serve
run` runs as its child in a process group of its own (a signal to the parent's group, a
terminal's Ctrl-C included, reaches the parent alone), and the parent passes the first
SIGINT or SIGTERM on as SIGINT, any later one as SIGTERM (a second Ctrl-C: stop now without
the drain). A hangup goes on as a hangup (the terminal closed: as before, and where the
cluster is already gone a drain would wait for it forever); under `nohup` it stays ignored.
If the parent itself is killed (SIGKILL), the kernel kills the child too, as when `serve
run` was the process the signal reached."""

from __future__ import annotations

import os
import signal
import subprocess
from types import FrameType

from rayattn.server.haproxy_exec import die_with_parent

_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _child_setup(parent: int) -> None:
    # Between fork and exec: the signals the parent held back, open again (a mask survives
    # exec); SIGINT handled by default (a shell's background job inherits it ignored, and
    # Python then never raises KeyboardInterrupt); gone with the parent, also one that died
    # before the request took effect.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent()
    if os.getppid() != parent:
        os._exit(1)


def run(argv: list[str]) -> int:
    """Run `argv` (`serve run <config>`) to its end; its exit status, as a shell reports it."""
    parent = os.getpid()
    # Held back until the handlers are in place: a stop that came while the child forks
    # would otherwise end the parent alone (and the child by its death signal, undrained).
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
    try:
        child = subprocess.Popen(argv, process_group=0, stdin=subprocess.DEVNULL,
                                 preexec_fn=lambda: _child_setup(parent))
        try:
            # A pid can be reused once the child is reaped; its pidfd cannot.
            pidfd: int | None = os.pidfd_open(child.pid)
        except (AttributeError, OSError):
            pidfd = None
        stops = 0

        def send(sig: int) -> None:
            try:
                if pidfd is not None:
                    signal.pidfd_send_signal(pidfd, sig)
                else:
                    child.send_signal(sig)
            except ProcessLookupError:
                pass

        def forward(signum: int, frame: FrameType | None) -> None:
            nonlocal stops
            if signum == signal.SIGHUP:
                send(signal.SIGHUP)
                return
            stops += 1
            send(signal.SIGINT if stops == 1 else signal.SIGTERM)

        for s in _STOPS:
            if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN:
                signal.signal(s, forward)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
    code = child.wait()  # a handler interrupts the wait, PEP 475 resumes it
    if pidfd is not None:
        os.close(pidfd)
    return 128 - code if code < 0 else code
