#!/usr/bin/env bash
# Put Prometheus + promtool (the metrics integration test starts a real server) under
# .venv/prometheus/bin without touching the system: Debian's package, unpacked with dpkg -x.
# Uses a system-wide prometheus when one is already on PATH. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.venv/prometheus
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
if [ -x "$DEST/bin/prometheus" ] && [ -x "$DEST/bin/promtool" ]; then
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# A fresh machine may have no package lists yet: refresh them if we may.
if ! (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1); then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq; else sudo -n apt-get update -qq; fi
  (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1)
fi
dpkg -x "$tmp"/prometheus_*.deb "$tmp/root"
mkdir -p "$DEST/bin"
cp "$tmp/root/usr/bin/prometheus" "$tmp/root/usr/bin/promtool" "$DEST/bin/"
"$DEST/bin/prometheus" --version 2>&1 | head -1
