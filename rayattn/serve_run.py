"""`serve run` under `rayattn serve`: stopped the way Ctrl-C stops it, whichever signal comes.

`serve run` drains only on SIGINT (its KeyboardInterrupt path calls `serve.shutdown()`, which
lets every replica finish its requests). A SIGTERM, what a container runtime, systemd or a
Kubernetes pod sends to the process it started, reaches Ray's driver handler instead: it
exits at once, the requests in flight are cut, and Ray's own fatal-signal handler aborts the
process (exit -6, SIGABRT, seen on a GPU host). So `rayattn serve` stays the parent: `serve
run` runs as its child in a process group of its own (a signal to the parent's group, a
terminal's Ctrl-C included, reaches the parent alone), and the parent passes the first
SIGINT or SIGTERM on as SIGINT, once the front door has no request left in flight (closed
to new connections first, rayattn/server/haproxy_admin.py: Serve's shutdown kills HAProxy
before anything else, which would cut every stream; serve.front_door_drain_s at most). A
stop during that wait ends it; any other later one goes on as SIGTERM (stop now, without
Serve's shutdown). A hangup goes on as a hangup (the terminal closed: as before, and where the
cluster is already gone a drain would wait for it forever); under `nohup` it stays ignored.
If the parent itself is killed (SIGKILL), the kernel kills the child too, as when `serve
run` was the process the signal reached."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from types import FrameType

from rayattn.server import haproxy_admin
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


def run(argv: list[str], drain_s: float = 0.0) -> int:
    """Run `argv` (`serve run <config>`) to its end; its exit status, as a shell reports it.
    `drain_s`: how long a first stop waits for the front door's requests in flight before
    it reaches `serve run` (serve.front_door_drain_s; 0: no wait)."""
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
            stops += 1  # passed on by the loop below, after the front door's drain

        for s in _STOPS:
            if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN:
                signal.signal(s, forward)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOPS)
    passed = 0  # the stops acted on
    while (code := child.poll()) is None:
        if stops > passed:
            if passed == 0:
                first = stops
                if first == 1 and drain_s > 0:
                    _drain_front_door(
                        drain_s, lambda: stops > 1 or child.poll() is not None)
                send(signal.SIGINT)
                # A stop that came during the wait ended it: spent. One after the SIGINT
                # goes on as SIGTERM at the next turn.
                passed = first + (stops > first)
            else:
                send(signal.SIGTERM)
                passed = stops
        time.sleep(0.1)
    if pidfd is not None:
        os.close(pidfd)
    return 128 - code if code < 0 else code


def _drain_front_door(timeout_s: float, stop_waiting: Callable[[], bool]) -> None:
    paths = haproxy_admin.sockets()
    if paths:
        left = haproxy_admin.drain(paths, timeout_s, stop_waiting)
        if left:
            print(f"rayattn serve: stopping with {left} requests still in flight",
                  file=sys.stderr, flush=True)
