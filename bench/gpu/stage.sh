#!/usr/bin/env bash
# Prepare the GPU run here (no GPU needed): stage the wheels of ../shared/gpu/README.md plus
# vllm-router and orjson into .gpuwhl/b00..bNN (one device call each), the 32000-token
# tokenizer, and a snapshot of rayattn + its unit tests into the last bundle.
#
#   echo /.gpuwhl/ >> "$(git rev-parse --git-dir)/info/exclude"
#   bash bench/gpu/stage.sh [SHARED_GPU_DIR]      # default ../shared/gpu
#
# Then, on nvidia-h200-x2, back to back (the machine goes cold 30 s after a call):
#   calls 1..N-1 carry [".gpuwhl/bNN"]:  mkdir -p /tmp/gpuwhl && mv .gpuwhl/bNN/* /tmp/gpuwhl/
#   call N carries the last bundle:      mkdir -p /tmp/gpuwhl && mv .gpuwhl/bNN/* /tmp/gpuwhl/
#                                        && bash bench/gpu/run.sh install
#   then (nothing carried):              bash bench/gpu/run.sh routing | placement | backends
set -euo pipefail
shared=${1:-../shared/gpu}
dir=.gpuwhl
mkdir -p $dir
grep -v '^#' "$shared/wheels-vllm0.25-ray2.60.txt" | grep . > $dir/list.txt
printf 'vllm-router==0.1.17\norjson==3.13.0\n' >> $dir/list.txt
bash "$shared/stage-wheels.sh" $dir $dir/list.txt 2>&1 | grep -v "^WARNING: Location"
last=$(ls -d $dir/b[0-9][0-9] | tail -1)
"${PYTHON:-.venv/bin/python}" "$shared/make_tokenizer.py" "$last/tok"  # needs tokenizers + transformers
# The committed tree (others may be editing the working tree while the run goes on) plus
# the GPU run's own files as they are now.
snap="$last/snap"
rm -rf "$snap" && mkdir -p "$snap"
git archive HEAD rayattn deployments pyproject.toml tests/unit tests/__init__.py \
  tests/conftest.py | tar -x -C "$snap"
own="rayattn/compat.py rayattn/backends.py rayattn/models/tiny.py deployments/h200.yaml
     tests/unit/test_backends.py tests/unit/test_placement.py tests/unit/test_compat.py"
for f in $own; do cp "$f" "$snap/$f"; done
{ echo "snapshot of $(git rev-parse --short HEAD) + $(echo $own | wc -w) files of the GPU run, $(date -u +%FT%TZ)"
  git status --short -- $own; } > "$snap/SNAPSHOT.txt"
du -sh $dir/b[0-9][0-9]
cat $dir/PLAN.txt
