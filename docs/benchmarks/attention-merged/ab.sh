#!/usr/bin/env bash
# A/B of the working tree against base.tar (`git archive` of the base commit) on matrix cells;
# trees alternate per cell. Usage: bash ab.sh CELL... (outputs under $OUT/base, $OUT/cand)
set -e
export PYTHONPATH=.
mkdir -p /tmp/base && tar -xf base.tar -C /tmp/base
run() {  # tree-dir label cell
  (cd "$1" && PYTHONPATH=. python -m benchmarks.wcpb_matrix --modes split wcpb --num-requests 100 \
    --repeats 3 --busy-rounds 1 --cells "$3" --out-dir "$OUT/$2" 2>&1 | grep -v Warning | tail -4)
}
for cell in "$@"; do
  run /tmp/base base "$cell"
  run . cand "$cell"
done
find "$OUT" -name '*.png' -delete
