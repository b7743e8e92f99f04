"""Ends a replica's engine processes once the replica is gone, however it went.

vLLM runs its engine core (and on some platforms its workers) as child processes of the Serve
replica. When the replica exits gracefully, AsyncLLM.shutdown() ends them; but `ray stop
--force`, a SIGKILLed replica or a killed raylet leave them orphaned under PID 1, still
holding device memory, so the next replica on that GPU cannot start. Ray's own child cleanup
needs a live raylet, and vLLM's engine core does not watch its parent.

So every replica starts one small watcher in its own session, through a launcher that exits
at once: the watcher is no child of the replica, so neither signals to the replica's process
group nor Ray's worker cleanup (which ends a worker's children when it exits, even on a
SIGTERM) reach it. It snapshots the replica's
descendants every second while the replica lives, and when the replica's PID is gone it
terminates the last snapshot (checked by creation time, so a reused PID is never hit) and
their descendants, removes the replica's run directory (vLLM's IPC sockets, the KV-event
sockets: files a killed process cannot remove itself), then exits.

    python -m rayattn.engine.reaper <replica-pid> [<run-dir>]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import psutil

POLL_S = 1.0
GRACE_S = 5.0


LAUNCH = """
import subprocess, sys
w = subprocess.Popen(sys.argv[1:], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
first = w.stdout.readline()
if first != b"ready\\n":
    sys.stderr.write((first + w.stdout.read()).decode(errors="replace"))
    sys.exit(1)
"""
"""The launcher's program: the watcher in a session of its own; exit once it has taken its
first snapshot (its `ready` line), or fail with what it wrote if it ended before."""


def start_for_current_process(run_dir: str | None = None) -> None:
    """Start a watcher for this process and return once it has seen this process's children
    (call from the replica before starting the engine); `run_dir` goes with the processes.
    The watcher is then a child of PID 1 (or the nearest subreaper), not of this process."""
    watcher = [sys.executable, "-m", "rayattn.engine.reaper", str(os.getpid()),
               *([run_dir] if run_dir else [])]
    # -S: the launcher needs nothing beyond the standard library, so no site-packages scan.
    try:
        out = subprocess.run([sys.executable, "-S", "-c", LAUNCH, *watcher], timeout=60,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError("the engine's watcher took no first look within 60 s") from e
    if out.returncode != 0:
        raise RuntimeError(f"the engine's watcher did not start: {out.stderr[-2000:]}")


def descendants(pid: int, exclude: set[int] = frozenset()) -> dict[int, float]:
    """PID → creation time of every live descendant of `pid`."""
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    out: dict[int, float] = {}
    for k in kids:
        if k.pid in exclude:
            continue
        try:
            out[k.pid] = k.create_time()
        except psutil.Error:
            pass
    return out


def end_processes(known: dict[int, float]) -> int:
    """SIGTERM the still-living processes of `known` and their descendants, children first,
    SIGKILL what is left of each generation after GRACE_S. Returns how many were ended."""
    victims: list[psutil.Process] = []
    for pid, created in known.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() != created:
                continue  # the PID was reused by an unrelated process
            victims.append(p)
            victims.extend(p.children(recursive=True))
        except psutil.Error:
            continue
    # Children before their parents: a process's own shutdown (vLLM's engine core) runs while
    # its parent lives, since a parent ended first can take its children down at once (a
    # prestarted engine core gets SIGKILL when its forkserver ends).
    pending = list({p.pid: p for p in victims}.values())
    while pending:
        pids = {p.pid for p in pending}
        parents = {_ppid(p) for p in pending} & pids
        leaves = [p for p in pending if p.pid not in parents] or pending
        for p in leaves:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(leaves, timeout=GRACE_S)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        pending = [p for p in pending if p not in leaves]
    return len(victims)


def _ppid(p: psutil.Process) -> int | None:
    try:
        return p.ppid()
    except psutil.Error:
        return None


def _ready() -> None:
    """Tell the launcher the first snapshot is taken; nothing is written after it (the
    launcher is gone then)."""
    try:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
    except OSError:
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)  # its errors went to the launcher until now
    os.close(devnull)


def watch(pid: int, run_dir: str | None = None) -> None:
    me = os.getpid()
    try:
        replica = psutil.Process(pid)
        created = replica.create_time()
    except psutil.Error:
        if run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        return
    known: dict[int, float] = {}

    def alive() -> bool:
        try:
            return replica.is_running() and replica.create_time() == created \
                and replica.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    ready = True
    while alive():
        # Not itself: until its launcher exits (after the first look) the watcher is the
        # replica's grandchild.
        known.update(descendants(pid, exclude={me}))
        # Forget exited ones so the set does not grow over a long-lived replica.
        known = {p: c for p, c in known.items() if psutil.pid_exists(p)}
        if ready:
            _ready()
            ready = False
        time.sleep(POLL_S)
    end_processes(known)
    if run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
