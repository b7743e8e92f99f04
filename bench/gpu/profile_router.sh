#!/usr/bin/env bash
# Where the way to the first token goes outside the engine: run bench/gpu/routing.py (rayattn
# only) and, once warm, sample the router, the HTTP proxy and one engine replica with py-spy
# (its wheel carried in .gpuwhl/pyspy), with asyncio's slow-callback log on in the router.
#   bash bench/gpu/profile_router.sh [routing.py args...]      (on the device, after install)
set -uo pipefail
. /tmp/gpu-env.sh
unset CUDA_VISIBLE_DEVICES
export PYTHONPATH=$PWD:$PYTHONPATH RAYATTN_SLOW_CALLBACK_S=0.05
pip install -q --no-deps --target /tmp/pyspy .gpuwhl/pyspy/*.whl || true
SPY=/tmp/pyspy/bin/py-spy
[ -f /tmp/rayattn-gpu/llama-0.85b/config.json ] || python3 -m rayattn.cli tiny-model \
  llama-0.85b /tmp/rayattn-gpu/llama-0.85b --tokenizer /tmp/gpuwhl/tok > "$OUT/tiny.log" 2>&1
timeout 480 python3 bench/gpu/routing.py --model /tmp/rayattn-gpu/llama-0.85b \
  --config deployments/h200.yaml --out "$OUT" --one-gpu --no-peers "$@" > "$OUT/routing.log" 2>&1 &
bench=$!
until grep -q "warm-up done" "$OUT/routing.log" 2>/dev/null; do
  kill -0 $bench 2>/dev/null || break; sleep 1; done
sleep 1
for who in "ServeReplica:rayattn:router" "ProxyActor" "ServeReplica:rayattn:engine"; do
  pid=$(pgrep -f "$who" | head -1)
  tag=$(echo "$who" | tr -c 'a-zA-Z\n' '_')
  [ -n "$pid" ] && $SPY record -p "$pid" -d 25 -r 100 -f speedscope -o "$OUT/spy-$tag.json" \
    --nonblocking > "$OUT/spy-$tag.log" 2>&1 &
  [ -n "$pid" ] && $SPY dump -p "$pid" > "$OUT/dump-$tag.txt" 2>&1
done
wait $bench
wait
cp /tmp/ray/session_latest/logs/serve/replica_rayattn_router_*.log "$OUT/" 2>/dev/null
grep -E "rayattn |hops" "$OUT/routing.log" | tail -20
ls -la "$OUT"
