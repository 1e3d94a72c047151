#!/usr/bin/env bash
# Predicted against measured step times on this machine (docs/cli/plan.md, "Predicted against
# measured on this 2-core host"): `graphpp hardware probe` describes the machine, `graphpp plan
# --hardware` predicts each layout, `graphpp train` measures it (median step_s of steps 3–10 from
# --metrics), the rounds alternating over the layouts.
# Usage: tools/plan_vs_train.sh [path/to/graphpp] [rounds]   (default: target/release/graphpp, 2)
set -euo pipefail
g="${1:-target/release/graphpp}"
rounds="${2:-2}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
"$g" hardware probe --output "$dir/here.toml" > /dev/null
layouts=("tiny 2 1f1b" "tiny 2 zbv" "tiny 2 dualpipev" "tiny 1 1f1b"
         "small 2 1f1b" "small 2 zbv" "small 2 dualpipev" "small 1 1f1b")
predict() { # model pp kind: the first plain-replica row's step (ms)
  "$g" plan --model "$1" --ranks 2 --pp "$2" --microbatches 8 --global-batch 64 --schedule "$3" \
    --recompute pointwise --tp 1 --hardware "$dir/here.toml" --top 20 |
    awk '$1 == "#" { for (i = 1; i <= NF; i++) col[$i] = i }
         $1 ~ /^[0-9]+$/ && $col["fsdp"] == "no" { print $col["step"]; exit }'
}
measure() { # model pp kind: the median step (ms) of steps 3–10
  local layout=(--ranks "$2")
  [ "$2" = 1 ] && layout=(--ranks 1 --dp 2)
  "$g" train --model "$1" --schedule "$3" "${layout[@]}" --steps 10 --eval-every 0 --sample-bytes 0 \
    --metrics "$dir/m.jsonl" > /dev/null
  sed -n 's/.*"step":\([0-9]*\),.*"step_s":\([0-9.e-]*\).*/\1 \2/p' "$dir/m.jsonl" |
    awk '$1 >= 3 { print 1000 * $2 }' | sort -n |
    awk '{ a[NR] = $1 } END { printf "%.1f", NR % 2 ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'
}
printf '%-6s %-6s %-10s %10s' model layout kind predicted
for r in $(seq "$rounds"); do printf ' %10s %6s' "measured$r" ratio; done
echo
declare -A predicted measured
for l in "${layouts[@]}"; do predicted[$l]=$(predict $l); done
for r in $(seq "$rounds"); do
  for l in "${layouts[@]}"; do measured[$l,$r]=$(measure $l); done
done
for l in "${layouts[@]}"; do
  set -- $l
  layout="pp $2"; [ "$2" = 1 ] && layout="dp 2"
  printf '%-6s %-6s %-10s %10s' "$1" "$layout" "$3" "${predicted[$l]}"
  for r in $(seq "$rounds"); do
    m="${measured[$l,$r]}"
    printf ' %10s %6s' "$m" "$(awk -v p="${predicted[$l]}" -v m="$m" 'BEGIN { printf "%.2f", p / m }')"
  done
  echo
done
