#!/usr/bin/env bash
# graphpp's predictions of published training runs (docs/PERFORMANCE.md, "Predictions beside
# published results"): each strategy file here planned in bf16 on the H100 preset (Megatron-LM's
# runs on the A100 description a100-sxm-selene.toml).
# Usage: tools/published/predict.sh [path/to/graphpp]   (default: target/release/graphpp)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
g="${1:-$here/../../target/release/graphpp}"
plan() { # name model seq-len strategy [hardware]
  printf '%-34s ' "$1"
  "$g" plan --strategy "$here/$4" --model "$2" --seq-len "$3" --hardware "${5:-h100-sxm}" --dtype bf16 | tail -n 1
}
plan "Llama 3.1 8B, FSDP 8" "$here/llama31-8b.json" 8192 llama31-8b-fsdp8.toml
plan "Llama 3.1 8B, FSDP 128" "$here/llama31-8b.json" 8192 llama31-8b-fsdp128.toml
plan "Llama 3.1 405B, 1F1B" "$here/llama31-405b.json" 8192 llama31-405b-1f1b.toml
plan "Llama 3.1 405B, interleaved 1F1B" "$here/llama31-405b.json" 8192 llama31-405b-interleaved-1f1b.toml
for k in 1f1b zbv dualpipev; do
  plan "DeepSeek-V3 16B, $k" deepseek-v3-16b 4096 "deepseek-v3-16b-$k.toml"
done
for n in 39b 76b 146b 310b 530b 1t; do
  plan "Megatron-LM GPT $n" "$here/megatron-gpt-$n.json" 2048 "megatron-gpt-$n.toml" "$here/a100-sxm-selene.toml"
done
