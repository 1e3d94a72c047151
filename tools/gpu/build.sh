#!/usr/bin/env bash
# Builds the binaries tools/gpu/check.sh runs on a GPU machine, here, on a machine without a GPU:
# `graphpp` and the `fwbw` benchmark with the `cuda` feature, release, stripped, into .gpu/ at
# the repository's root, and xz-compressed into .gpu/carry/ (what the device tool carries to the
# GPU machine, which has CUDA's libraries and driver but no Rust toolchain).
#
# candle links CUDA's libraries at build time (cudarc's `dynamic-linking`), and no wheel ships the
# driver's libcuda.so. So the link runs twice: first against empty stand-ins, whose undefined
# references name every CUDA function the binary calls; then against stand-ins that define those
# functions (each returns an error code), under the real libraries' sonames. The binary loads the
# real libraries at start-up on the GPU machine (LD_LIBRARY_PATH, set by check.sh); on a machine
# without them it does not start. Usage: tools/gpu/build.sh (after nothing: it runs
# tools/cuda/setup.sh itself).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
cuda_env="$(tools/cuda/setup.sh)"
eval "$cuda_env"
out="$root/.gpu"
stubs="$out/stubs"
mkdir -p "$stubs"
# library -> soname of the CUDA 13 / NCCL 2 libraries the device machine holds.
declare -A soname=([cuda]=libcuda.so.1 [cudart]=libcudart.so.13 [cublas]=libcublas.so.13
    [cublasLt]=libcublasLt.so.13 [curand]=libcurand.so.10 [nvrtc]=libnvrtc.so.13 [nccl]=libnccl.so.2)
make_stub() { # lib, C source
    gcc -shared -fPIC -o "$stubs/lib$1.so" -Wl,-soname,"${soname[$1]}" -x c - <<<"$2"
}
for lib in "${!soname[@]}"; do make_stub "$lib" ""; done
# Relink from the empty stand-ins, so the first link lists every function the binaries call.
touch crates/graphpp/src/main.rs crates/graphpp-runtime/examples/fwbw.rs
export CARGO_TARGET_DIR="$root/target/cuda-release"
export RUSTFLAGS="-L native=$stubs"
# lld stops listing undefined symbols after 20 unless told otherwise.
build() {
    local rc=0 all=(-- -C link-arg=-Wl,--error-limit=0)
    cargo rustc --release --locked -p graphpp --features cuda --bin graphpp "${all[@]}" 2>&1 || rc=1
    cargo rustc --release --locked -p graphpp-runtime --features cuda --example fwbw "${all[@]}" 2>&1 || rc=1
    return $rc
}
if ! log="$(build)"; then
    # lld (rustc's linker here) says "undefined symbol: f"; GNU ld "undefined reference to `f'"
    # (it rejects --error-limit: this script expects rust-lld, Rust ≥ 1.90 on x86-64 Linux).
    syms="$( (grep -o "undefined reference to \`[A-Za-z0-9_]*'" <<<"$log" | sed "s/.*\`\(.*\)'/\1/";
        grep -o "undefined symbol: [A-Za-z0-9_]*" <<<"$log" | sed "s/.*: //") | sort -u)"
    [ -n "$syms" ] || { echo "$log" >&2; exit 1; }
    for lib in "${!soname[@]}"; do
        case $lib in
            cublasLt) pat='^cublasLt' ;; cublas) pat='^cublas[^L]' ;; curand) pat='^curand' ;;
            nvrtc) pat='^nvrtc' ;; nccl) pat='^nccl' ;; cudart) pat='^(cuda[A-Z]|__cuda)' ;; cuda) pat='^cu[A-Z]' ;;
        esac
        src="$(grep -E "$pat" <<<"$syms" | sed 's/.*/int &(void) { return 999; }/' || true)"
        make_stub "$lib" "$src"
    done
    touch crates/graphpp/src/main.rs crates/graphpp-runtime/examples/fwbw.rs
    build >/dev/null || { build >&2; exit 1; }
fi
# xz-compressed for the trip (the device tool carries 64 MiB; the two binaries are ~100 MB).
mkdir -p "$out/carry"
for bin in "$CARGO_TARGET_DIR/release/graphpp" "$CARGO_TARGET_DIR/release/examples/fwbw"; do
    strip -o "$out/$(basename "$bin")" "$bin"
    xz -T0 -6 -c "$out/$(basename "$bin")" >"$out/carry/$(basename "$bin").xz"
done
ls -l "$out/carry"
