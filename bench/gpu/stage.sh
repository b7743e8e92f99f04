#!/usr/bin/env bash
# Prepare the GPU run here (no GPU needed): stage the wheels of ../shared/gpu/README.md plus
# vllm-router and orjson into .gpuwhl/b00..bNN (one device call each), the 32000-token
# tokenizer, and a snapshot of rayattn + its unit tests into the last bundle.
#
#   echo /.gpuwhl/ >> "$(git rev-parse --git-dir)/info/exclude"
#   bash bench/gpu/stage.sh [SHARED_GPU_DIR]      # default ../shared/gpu
#   bash bench/gpu/stage.sh --snapshot-only [--worktree]
#       only the snapshot again, into the last bundle already staged (wheels untouched);
#       --worktree: rayattn/, deployments/ and tests/ as the working tree has them (tracked
#       and untracked files) instead of HEAD's plus the GPU run's own files
#
# Then, on nvidia-h200-x2, back to back (the machine goes cold 30 s after a call):
#   calls 1..N-1 carry [".gpuwhl/bNN"]:  mkdir -p /tmp/gpuwhl && mv .gpuwhl/bNN/* /tmp/gpuwhl/
#   call N carries the last bundle:      mkdir -p /tmp/gpuwhl && mv .gpuwhl/bNN/* /tmp/gpuwhl/
#                                        && bash bench/gpu/run.sh install
#   then (nothing carried):              bash bench/gpu/run.sh routing | placement | backends
#                                        | dp-ranks
set -euo pipefail
snap_only=0 worktree=0
while [ $# -gt 0 ]; do
  case $1 in
  --snapshot-only) snap_only=1 ;;
  --worktree) worktree=1 ;;
  *) break ;;
  esac
  shift
done
shared=${1:-../shared/gpu}
dir=.gpuwhl
if [ $snap_only = 0 ]; then
  mkdir -p $dir
  grep -v '^#' "$shared/wheels-vllm0.25-ray2.60.txt" | grep . > $dir/list.txt
  printf 'vllm-router==0.1.17\norjson==3.13.0\n' >> $dir/list.txt
  # A call carries the working tree with its bundle, 64 MiB in all: bundles of what is left
  # (the tree's files, rounded up, and 2 MiB for files added before the calls).
  tree_mib=$(git ls-files -z | du -c --files0-from=- -BM 2>/dev/null | tail -1 | tr -dc 0-9 || true)
  if [ -z "$tree_mib" ] || [ "$tree_mib" -ge 40 ]; then
    echo "the tracked tree is ${tree_mib:-?} MiB: too large to carry with the wheels" >&2; exit 1
  fi
  bash "$shared/stage-wheels.sh" $dir $dir/list.txt $((62 - tree_mib)) 2>&1 \
    | grep -v "^WARNING: Location"
fi
last=$(ls -d $dir/b[0-9][0-9] 2>/dev/null | tail -1)
if [ -z "$last" ] || [ ! -f "$last/MANIFEST" ]; then
  echo "no staged last bundle in $dir: run bash bench/gpu/stage.sh first" >&2; exit 1
fi
if [ $snap_only = 0 ]; then
  "${PYTHON:-.venv/bin/python}" "$shared/make_tokenizer.py" "$last/tok"  # needs tokenizers + transformers
fi
# The committed tree (others may be editing the working tree while the run goes on) plus
# the GPU run's own files as they are now; or, with --worktree, the working tree at this
# moment (what travels is fixed once staged, whatever changes here afterwards).
snap="$last/snap"
paths="rayattn bench/peers deployments pyproject.toml tests/unit tests/__init__.py tests/conftest.py tests/areas.py tests/beside.py tests/own_apps.py"
rm -rf "$snap" && mkdir -p "$snap"
if [ $worktree = 1 ]; then
  # Tracked (as edited) and untracked files, not ignored ones; files deleted here stay out.
  git ls-files -co --exclude-standard -- $paths | while read -r f; do if [ -f "$f" ]; then echo "$f"; fi; done \
    | tar -c -T - | tar -x -C "$snap"
  { echo "snapshot of the working tree on $(git rev-parse --short HEAD), $(date -u +%FT%TZ)"
    git status --short -- $paths; } > "$snap/SNAPSHOT.txt"
else
  git archive HEAD $paths | tar -x -C "$snap"
  own="rayattn/compat.py rayattn/integrations/devices.py rayattn/integrations/vllm_backends.py
       rayattn/backends.py rayattn/models/tiny.py deployments/h200.yaml
       tests/unit/test_backends.py tests/unit/config/test_placement.py tests/unit/test_compat.py
       tests/unit/integrations/test_devices.py"
  for f in $own; do cp "$f" "$snap/$f"; done
  { echo "snapshot of $(git rev-parse --short HEAD) + $(echo $own | wc -w) files of the GPU run, $(date -u +%FT%TZ)"
    git status --short -- $own; } > "$snap/SNAPSHOT.txt"
fi
head -1 "$snap/SNAPSHOT.txt"
du -sh $dir/b[0-9][0-9]
[ $snap_only = 1 ] || cat $dir/PLAN.txt
