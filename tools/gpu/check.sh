#!/usr/bin/env bash
# The device check of `--device cuda` (issue: GPU execution), run on a GPU machine from the
# repository's root with .gpu/carry/ (tools/gpu/build.sh) beside it. Every figure goes to
# $OUT/gpu-check-PART.txt (or ./gpu-check-PART.txt without $OUT). Parts, each well inside the
# device tool's 10-minute limit per command (`all` runs the three, about 8 minutes at most):
#   verify — `graphpp verify --device cuda` (ranks as threads sharing the GPU) for 1f1b, zbv and
#            dualpipev, f32 and bf16 on tiny, f32 on small: the GPU's gradients against the
#            CPU's single-device reference (verify's tolerance);
#   bench  — one forward + backward on the GPU (`fwbw --device cuda`) of `small` and of a 1.1B
#            Llama (tools/gpu/llama-1b.json), bf16, beside PyTorch eager and torch.compile on
#            the same GPU;
#   train  — `graphpp train --device cuda`: `small` in f32 and bf16, the 1.1B Llama in bf16 —
#            tokens/s, GFLOP/s and the MFU against the GPU's dense bf16 peak (989 TFLOP/s for
#            the H100 SXM and the H200: NVIDIA's datasheets). The corpus is docs/ (no network).
# Usage: tools/gpu/check.sh [verify|bench|train|all]
#   (device tool: carry [".gpu/carry"], command `bash tools/gpu/check.sh verify`, …)
set -uo pipefail
export RUST_BACKTRACE=0
part="${1:-all}"
case "$part" in verify | bench | train | all) ;; *) echo "usage: $0 [verify|bench|train|all]" >&2; exit 2 ;; esac
report="${OUT:-.}/gpu-check-$part.txt"
dir="$(mktemp -d)"

setup() {
    echo "== gpu"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || return 1
    for f in .gpu/carry/*.xz; do
        xz -dc "$f" >"$dir/$(basename "$f" .xz)" && chmod +x "$dir/$(basename "$f" .xz)" || return 1
    done
    # CUDA's libraries: the driver's libcuda, and the pip wheels of the machine's Python.
    local site libs
    site="$(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null)"
    libs="$(find "$site/nvidia" /usr/local/nvidia /usr/lib/x86_64-linux-gnu -maxdepth 3 \
        \( -name 'libcublas.so.*' -o -name 'libnvrtc.so.*' -o -name 'libcurand.so.*' -o -name 'libcudart.so.*' \
        -o -name 'libcuda.so.1' -o -name 'libnccl.so.*' \) -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)"
    export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
    echo "libraries: $LD_LIBRARY_PATH"
    "$dir/graphpp" --version || { echo "FAIL: graphpp does not start (run tools/gpu/build.sh first)"; return 1; }
}

verify() {
    echo "== verify --device cuda"
    local fail=0 runs=("tiny f32" "tiny bf16" "small f32")
    for run in "${runs[@]}"; do
        set -- $run
        for kind in 1f1b zbv dualpipev; do
            timeout 60 "$dir/graphpp" verify --device cuda --model "$1" --schedule "$kind" --ranks 2 \
                --microbatches 4 --dtype "$2" | tail -3 || { echo "FAIL: verify $1 $kind $2"; fail=1; }
        done
    done
    return $fail
}

bench() {
    echo "== fwbw --device cuda (graphpp beside PyTorch on the same GPU)"
    local fail=0
    for model in "--model small --batch 8 --seq 64" "--config tools/gpu/llama-1b.json --batch 4 --seq 512"; do
        # shellcheck disable=SC2086
        timeout 150 "$dir/fwbw" $model --dtype bf16 --device cuda --rounds 2 --runs 5 --torch python3 ||
            { echo "FAIL: fwbw $model"; fail=1; }
    done
    return $fail
}

train() {
    echo "== train --device cuda"
    local fail=0
    one() { # label, flags...
        local label="$1" line gflops
        shift
        line="$(timeout 120 "$dir/graphpp" train --device cuda --data docs --eval-every 0 --sample-bytes 0 \
            --checkpoint-dir "/tmp/gpu-check-$label" --start-over "$@" | grep '^step' | tail -1)"
        echo "$label: $line"
        gflops="$(grep -o '[0-9.]* GFLOP/s' <<<"$line" | cut -d' ' -f1)"
        [ -n "$gflops" ] || return 1
        echo "$label MFU: $(python3 -c "print(f'{$gflops / 989e3:.4%}')") of 989 TFLOP/s"
    }
    one small-f32 --model small --schedule 1f1b --steps 30 --dtype f32 || fail=1
    one small-bf16 --model small --schedule 1f1b --steps 30 --dtype bf16 || fail=1
    one llama-1b-bf16 --model tools/gpu/llama-1b.json --schedule 1f1b --ranks 2 --microbatches 4 \
        --microbatch-size 4 --seq-len 512 --steps 8 --dtype bf16 || fail=1
    echo "(host reads: each train line ends with them when a kernel read a device tensor to the host)"
    return $fail
}

main() {
    setup || { echo "FAIL: setup"; return 1; }
    local fail=0
    case "$part" in
        verify) verify || fail=1 ;;
        bench) bench || fail=1 ;;
        train) train || fail=1 ;;
        all)
            verify || fail=1
            bench || fail=1
            train || fail=1
            ;;
    esac
    [ "$fail" = 0 ] && echo "PASS" || echo "FAIL"
    return "$fail"
}

# tee finishes before the script does: the report holds the verdict.
main 2>&1 | tee "$report"
exit "${PIPESTATUS[0]}"
