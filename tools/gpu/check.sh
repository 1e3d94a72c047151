#!/usr/bin/env bash
# The device check of `--device cuda` (issue: GPU execution), run on a GPU machine from the
# repository's root with .gpu/carry/ (tools/gpu/build.sh) beside it; ≤ 8 minutes on one H100/H200.
# Every figure goes to $OUT/gpu-check.txt (or ./gpu-check.txt without $OUT):
#   1. the GPU, its driver, and where CUDA's libraries were found;
#   2. `graphpp verify --device cuda` (ranks as threads sharing the GPU) for 1f1b, zbv and
#      dualpipev, f32 and bf16, tiny and small: the GPU's gradients against the CPU's reference;
#   3. one forward + backward on the GPU (`fwbw --device cuda`) of `small` and of a 1.1B Llama
#      (tools/gpu/llama-1b.json), bf16, beside PyTorch eager and torch.compile on the same GPU;
#   4. `graphpp train --device cuda`: `small` in f32 and bf16, the 1.1B Llama in bf16 — tokens/s,
#      GFLOP/s, and the MFU against the GPU's dense bf16 peak (989 TFLOP/s H100 SXM, the same for
#      the H200; NVIDIA's datasheets). The corpus is docs/ (the machine has no network).
# Usage: tools/gpu/check.sh   (device tool: carry [".gpu/carry"], command `bash tools/gpu/check.sh`)
set -uo pipefail
export RUST_BACKTRACE=0
report="${OUT:-.}/gpu-check.txt"
dir="$(mktemp -d)"
for f in .gpu/carry/*.xz; do xz -dc "$f" >"$dir/$(basename "$f" .xz)" && chmod +x "$dir/$(basename "$f" .xz)"; done
bin="$dir/graphpp"
exec > >(tee "$report") 2>&1
echo "== gpu"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# CUDA's libraries: the driver's libcuda, and the pip wheels of the machine's Python.
site="$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null)"
libs="$(find "$site/nvidia" /usr/local/nvidia /usr/lib/x86_64-linux-gnu -maxdepth 3 \
    \( -name 'libcublas.so.*' -o -name 'libnvrtc.so.*' -o -name 'libcurand.so.*' -o -name 'libcuda.so.1' \
    -o -name 'libnccl.so.*' \) -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)"
export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
echo "libraries: $LD_LIBRARY_PATH"
"$bin" --version || { echo "FAIL: $bin does not start (run tools/gpu/build.sh first)"; exit 1; }
fail=0
echo "== verify --device cuda"
for model in tiny small; do
    for kind in 1f1b zbv dualpipev; do
        for dtype in f32 bf16; do
            if ! timeout 120 "$bin" verify --device cuda --model "$model" --schedule "$kind" --ranks 2 \
                --microbatches 4 --dtype "$dtype" | tail -3; then
                echo "FAIL: verify $model $kind $dtype"; fail=1
            fi
        done
    done
done
echo "== fwbw --device cuda (graphpp beside PyTorch on the same GPU)"
for model in "--model small --batch 8 --seq 64" "--config tools/gpu/llama-1b.json --batch 4 --seq 512"; do
    # shellcheck disable=SC2086
    timeout 200 "$dir/fwbw" $model --dtype bf16 --device cuda --rounds 2 --runs 5 --torch python3 || {
        echo "FAIL: fwbw $model"; fail=1; }
done
echo "== train --device cuda"
train() { # label, flags...
    local label="$1"; shift
    line="$(timeout 240 "$bin" train --device cuda --data docs --eval-every 0 --sample-bytes 0 \
        --checkpoint-dir "/tmp/gpu-check-$label" --start-over "$@" | grep '^step' | tail -1)"
    echo "$label: $line"
    gflops="$(grep -o '[0-9.]* GFLOP/s' <<<"$line" | cut -d' ' -f1)"
    [ -n "$gflops" ] && echo "$label MFU: $(python3 -c "print(f'{$gflops / 989e3:.4%}')") of 989 TFLOP/s" || fail=1
}
train small-f32 --model small --schedule 1f1b --steps 30 --dtype f32
train small-bf16 --model small --schedule 1f1b --steps 30 --dtype bf16
train llama-1b-bf16 --model tools/gpu/llama-1b.json --schedule 1f1b --ranks 2 --microbatches 4 \
    --microbatch-size 4 --seq-len 512 --steps 8 --dtype bf16
echo "== host reads: each train line above ends with them (none: every kernel ran on the GPU)"
[ "$fail" = 0 ] && echo "PASS" || echo "FAIL"
exit "$fail"
