#!/usr/bin/env bash
# Device-side steps of the GPU runs of docs/results.md, one per `run` call of the device tool
# (nvidia-h200-x2), after the wheel bundles of ../shared/gpu/README.md (plus vllm-router and
# orjson) have been moved to /tmp/gpuwhl. Run from the repository root on the device:
#
#   bash bench/gpu/run.sh install     # install wheels, make both models, unit tests on vLLM 0.25
#   bash bench/gpu/run.sh routing     # DP2×TP1 device check, rayattn vs vllm-router, metrics
#   bash bench/gpu/run.sh placement   # DP1×TP2 (DPn×TP2 with more GPUs) placement-group check
#   bash bench/gpu/run.sh backends    # extend-path gain per attention backend
#   bash bench/gpu/run.sh dp-ranks    # one DP-attention replica on 2 GPUs: rank-aware routing
#                                     # vs vLLM's internal DP balancer (bench/gpu/dp_ranks.py)
#   bash bench/gpu/run.sh capacity    # the router tier against simulated engines, on the
#                                     # host's cores (bench/router_capacity.py; no GPU used)
#   bash bench/gpu/run.sh ramp        # engines autoscaled 1..2 on a load ramp, one policy per
#                                     # call (bench/autoscale_ramp.py --real-engines)
#
# Results land in $OUT (the device tool copies them back). Sources: rayattn from /tmp/snap when
# a snapshot was carried there (so a tree edited while the run goes on cannot change it
# between calls), else from this checkout.
set -uo pipefail
step=${1:?usage: run.sh install|routing|placement|backends|dp-ranks|capacity|cold-start|ramp [args...]}
shift
W=/tmp/rayattn-gpu
OUT=${OUT:-$W/out}
mkdir -p "$W/logs" "$OUT"

# GPU processes an earlier call of this run left behind (killed by id; nothing else runs here).
for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
  echo "killing leftover GPU process $pid: $(ps -o cmd= -p "$pid" | cut -c1-120)"
  kill -9 "$pid" 2>/dev/null
done

if [ "$step" = install ]; then
  bash /tmp/gpuwhl/device-install.sh 2>&1 | tee "$OUT/install.log" | tail -4 || exit 1
  if [ -d /tmp/gpuwhl/snap ]; then rm -rf /tmp/snap && cp -r /tmp/gpuwhl/snap /tmp/snap; fi
fi
. /tmp/gpu-env.sh || exit 1
TREE=$PWD
SRC=$PWD
[ -d /tmp/snap/rayattn ] && SRC=/tmp/snap
export PYTHONPATH=$SRC:$PYTHONPATH
echo "rayattn from $SRC ($(cat "$SRC/SNAPSHOT.txt" 2>/dev/null | head -1))"
NG=$(nvidia-smi -L | grep -c "^GPU")
# Run from $SRC: Ray puts the driver's working directory ahead of PYTHONPATH in every worker
# (Serve replicas included), so running from the checkout would serve the checkout's code.
cd "$SRC"

case "$step" in
install)
  python3 -c "import torch, vllm, ray; print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'gpus', torch.cuda.device_count())"
  python3 -m rayattn.cli tiny-model llama-0.85b $W/llama-0.85b --tokenizer /tmp/gpuwhl/tok
  python3 -m rayattn.cli tiny-model deepseek-v2-lite $W/deepseek-v2-lite \
    --tokenizer /tmp/gpuwhl/tok "$@"
  python3 -m rayattn.cli check "$TREE/deployments/h200.yaml" 2>&1 | grep -v Warn | tail -12
  # A snapshot carries its own tests/, deployments/ and pyproject.toml: test what will run.
  python3 -m pytest -q -p no:cacheprovider tests/unit/test_backends.py tests/unit/config/test_plan.py \
    tests/unit/routing/test_hashing.py tests/unit/config/test_placement.py tests/unit/test_compat.py \
    tests/unit/integrations 2>&1 \
    | tee "$OUT/unit-vllm025.log" | tail -25
  ;;
routing)
  # Both stacks on GPUs 0 and 1 (Ray is given those two, the vllm serve peers pin one each).
  export CUDA_VISIBLE_DEVICES=0,1
  timeout 585 python3 "$TREE/bench/gpu/routing.py" --model $W/llama-0.85b --out "$OUT" --repeats 2 \
    --deadline-s 450 "$@" 2>&1 \
    | tee "$OUT/routing.log" | grep -v -E "^\s*$|INFO|WARNING" | tail -60
  ;;
placement)
  # DP2 × TP2 where the node has 4 GPUs, else DP1 × TP2.
  timeout 560 python3 "$TREE/bench/gpu/placement.py" --model $W/llama-0.85b --out "$OUT" --tp 2 \
    --dp $((NG >= 4 ? 2 : 1)) "$@" 2>&1 \
    | tee "$OUT/placement.log" | grep -v -E "INFO|WARNING" | tail -40
  ;;
backends)
  # The MLA runs (larger model, longer start) first; each GPU takes the next run when free.
  timeout 580 python3 "$TREE/bench/gpu/backends.py" --models mha=$W/llama-0.85b,mla=$W/deepseek-v2-lite \
    --runs TRITON_MLA@mla,FLASHMLA@mla,FLASH_ATTN_MLA@mla,FLASH_ATTN@mha,TRITON_ATTN@mha \
    --gpus "$(seq -s, 0 $((NG - 1)))" --timeout-s 300 --deadline-s 250 --out "$OUT" "$@" 2>&1 \
    | tee "$OUT/backends.log" | tail -40
  ;;
dp-ranks)
  # One engine replica holding both GPUs (Ray gives it CUDA_VISIBLE_DEVICES of the two); vLLM
  # runs a DP rank on each. ~2-3 min start-up, then 6 runs of ~20-40 s each.
  [ "$NG" -ge 2 ] || { echo "dp-ranks needs 2 GPUs, this node has $NG"; exit 2; }
  export CUDA_VISIBLE_DEVICES=0,1
  timeout 585 python3 "$TREE/bench/gpu/dp_ranks.py" --model $W/deepseek-v2-lite --out "$OUT" \
    --deadline-s 470 "$@" 2>&1 \
    | tee "$OUT/dp-ranks.log" | grep -v -E "^\s*$|INFO|WARNING|DEBUG" | tail -70
  ;;
cold-start)
  # `rayattn serve deployments/h200.yaml` against one `vllm serve` per GPU, in turn (two
  # engines, or one where the node has one GPU).
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((NG - 1)))
  one=()
  [ "$NG" -ge 2 ] || one=(--set parallelism.data_parallel_size=1 --set platform.gpus_per_node=1)
  timeout 585 python3 "$TREE/bench/cold_start.py" --config deployments/h200.yaml \
    --model $W/llama-0.85b --gpus "$((NG >= 2 ? 2 : 1))" "${one[@]}" \
    --out "$OUT/cold_start.json" "$@" 2>&1 \
    | tee "$OUT/cold_start.log" | grep -E "^\{|engines|Error|Traceback" | tail -20
  ;;
capacity)
  timeout 585 python3 "$TREE/bench/router_capacity.py" --model $W/llama-0.85b \
    --out "$OUT/router_capacity.json" "$@" 2>&1 \
    | tee "$OUT/capacity.log" | grep -E "^\{|serving in|Error|Traceback" | tail -60
  ;;
ramp)
  # h200.yaml's engine, 1..2 replicas: one per GPU, or both on GPU 0 where the node has one
  # (Ray told of two GPUs, neither engine's CUDA_VISIBLE_DEVICES narrowed, 0.3 of it each).
  # Plot here afterwards: bench/autoscale_ramp.py --replot ramp.json --plot docs/img/….png
  # Ray refuses more GPUs than CUDA_VISIBLE_DEVICES names: 0,1 on one GPU, as routing does.
  export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((NG >= 2 ? NG - 1 : 1)))
  one=()
  [ "$NG" -ge 2 ] || one=(--num-gpus 2 --set engine.gpu_memory_utilization=0.3
                          --set 'engine.env={RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: "1"}')
  timeout 585 python3 "$TREE/bench/autoscale_ramp.py" --config deployments/h200.yaml \
    --real-engines --model $W/llama-0.85b --engines 1,2 "${one[@]}" \
    --out "$OUT/ramp.json" "$@" 2>&1 \
    | tee "$OUT/ramp.log" | grep -E "^\{|serving in|Error|Traceback" | tail -20
  ;;
*) echo "unknown step $step"; exit 2 ;;
esac
