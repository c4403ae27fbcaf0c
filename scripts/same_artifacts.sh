#!/usr/bin/env bash
# Refactors keep what aot makes: builds a fixed set of artifacts (dp, fsdp, tp, sequence parallel,
# pp with 1f1b and zero-bubble, a 2D mesh, recomputation, bf16, two nodes, checkpoint calls,
# SyncBatchNorm, fp16) and two planner tables with BASE (a commit; default HEAD) and with the
# working tree, and compares them: every artifact file byte for byte, the plans' JSON but for the
# time planning took. Prints IDENTICAL or each difference; exit 1 on any. About 10 minutes.
#
#   scripts/same_artifacts.sh [BASE]
set -euo pipefail
base=${1:-HEAD}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'git -C "$repo" worktree remove --force "$work/base" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git -C "$repo" worktree add --detach "$work/base" "$base" >/dev/null 2>&1

make_all() {  # make_all SOURCE_TREE OUT
  local src=$1 out=$2
  mkdir -p "$out"
  while IFS='|' read -r model strategy extra; do
    local name ws
    name=$(basename "$model" .py)-$(echo "$strategy $extra" | tr ',= -' '____')
    ws=$(python -c "import math; print(math.prod(int(x.split('=')[1]) for x in '$strategy'.split(',')))")
    # shellcheck disable=SC2086
    (cd "$src" && python -m aot build "$model" --strategy "$strategy" --world-size "$ws" --topology dgx_a100 --no-onnx --quiet -o "$out/$name" $extra) \
      >"$out/$name.log" 2>&1 || echo "build failed: $name (see $out/$name.log)"
  done <<'LIST'
examples/mlp.py|dp=2|--nodes 1
examples/gpt.py|fsdp=2|--nodes 1
examples/gpt.py|tp=2|--nodes 1
examples/gpt.py|tp=2|--nodes 1 --sequence-parallel
tests/models/gpt4.py|pp=2|--nodes 1
tests/models/gpt4.py|pp=2,dp=2|--nodes 1 --pp-schedule zero-bubble --microbatches 4
examples/gpt.py|dp=2,tp=2|--nodes 1
examples/gpt.py|fsdp=2|--nodes 1 --activation-budget 0.5
examples/gpt.py|fsdp=2|--nodes 1 --precision bf16
examples/gpt.py|dp=16|--nodes 2
tests/models/checkpointed_dropout.py|dp=2|--nodes 1
tests/models/checkpointed_dropout.py|fsdp=2|--nodes 1
tests/models/resnet_bn.py|dp=2|--nodes 1 --sync-batchnorm
tests/models/fp16_overflow.py|dp=2|--nodes 1
LIST
  (cd "$src" && python -m aot plan examples/gpt.py --topology dgx_a100 --nodes 2 --json >"$out/plan.json" 2>/dev/null) || echo "plan failed"
  (cd "$src" && python -m aot plan tests/models/gpt4.py --topology dgx_a100 --nodes 1 --world-size 4 --axes pp,dp,fsdp,tp --json >"$out/plan_pp.json" 2>/dev/null) ||
    echo "plan (pp) failed"
}

make_all "$work/base" "$work/a"
make_all "$repo" "$work/b"
status=0
for dir in "$work"/a/*/; do
  name=$(basename "$dir")
  if ! diff -rq "$dir" "$work/b/$name" >/dev/null 2>&1; then
    echo "differs: $name"; diff -rq "$dir" "$work/b/$name" | head -5; status=1
  fi
done
for plan in plan.json plan_pp.json; do
  python - "$work/a/$plan" "$work/b/$plan" <<'PY' || status=1
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
for d in (a, b):
    d.pop("seconds", None)  # how long planning took
if a != b:
    print("differs:", sys.argv[1].rsplit("/", 1)[1])
    sys.exit(1)
PY
done
[ $status = 0 ] && echo IDENTICAL
exit $status
