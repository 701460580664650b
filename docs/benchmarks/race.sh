#!/usr/bin/env bash
# race.sh LOG TARGET -- CMD...: run CMD (a training run of this repository or of nanoGPT), write each line
# it prints to LOG prefixed by the seconds since its launch, then print the first evaluation whose val
# loss is at most TARGET and the best one. Both kinds of evaluation line are read:
#   nanoGPT:  step 1750: train loss 1.1002, val loss 1.4695
#   ours:     eval   1750 | train 1.0887 | val 1.4675 | val 2.1172 bits/byte
# The launch is timed from just before CMD starts: Python's start, imports, data, compiling, evaluations
# and checkpoints all count, as a user waits for them. How it was used: docs/benchmarks/nanogpt.md.
set -u
log=$1 target=$2; shift 3
export PYTHONUNBUFFERED=1
start=$(date +%s.%N)
"$@" 2>&1 | while IFS= read -r line; do
    printf '[%s] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$start" 'BEGIN { printf "%.2f", a - b }')" "$line"
done > "$log"
awk -v target="$target" '
    / val loss / { split($0, a, "val loss "); val = a[2] + 0; step = $3 + 0 }
    /\] eval / { split($0, a, "[|] val "); val = a[2] + 0; step = $3 + 0 }
    / val loss |\] eval / { t = substr($1, 2) + 0
        if (best == "" || val < best) { best = val; best_t = t; best_step = step }
        if (hit == "" && val <= target) hit = sprintf("%.2f s: val %.4f at step %d", t, val, step) }
    END { print "first at or below " target ": " (hit == "" ? "never" : hit)
          printf "best: val %.4f at step %d, %.2f s\n", best, best_step, best_t }' "$log"
