#!/usr/bin/env python3
"""Library CPU matmul speed on graphpp's `small` linear-layer shapes, beside
`cargo run --release -p graphpp-runtime --example matmul` (same shapes, same hot loop: each
product --reps times after 50 warm-up products, operands in L2): PyTorch's matmul in --dtype
(f32; or bf16, which PyTorch runs on oneDNN with f32 accumulation), and with --mkl LIB the oneMKL
library at LIB (`libmkl_rt.so.3` from the PyPI `mkl` wheel): `cblas_sgemm`, or for bf16
`cblas_gemm_bf16bf16f32` (bf16 operands, f32 result).

Usage: python tools/torch/time_matmul.py [--threads 1] [--reps 400] [--dtype f32|bf16] [--mkl LIB]
"""
import argparse
import ctypes
import time

import torch

# (m, k, n, lhs transposed, rhs transposed), as SHAPES in the Rust example.
SHAPES = [(128, 256, 688, False, True), (128, 256, 688, False, False), (256, 128, 688, True, False),
          (128, 256, 256, False, True), (128, 688, 256, False, True)]

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def operand(r, c, t, dtype):
    x = torch.randn(c, r).t() if t else torch.randn(r, c)
    return x.to(dtype)


def time_ms(product, reps):
    for _ in range(50):
        product()
    t0 = time.perf_counter()
    for _ in range(reps):
        product()
    return (time.perf_counter() - t0) * 1e3 / reps


def mkl_product(lib, x, y, bf16):
    """A closure calling MKL's GEMM on x · y (row-major; a transposed operand passed as such)."""
    m, k = x.shape
    n = y.shape[1]
    ta, tb = x.stride(0) == 1 and m > 1, y.stride(0) == 1 and k > 1
    xs, ys = (x.t() if ta else x), (y.t() if tb else y)  # the stored (contiguous) matrices
    assert xs.is_contiguous() and ys.is_contiguous()
    lda, ldb = xs.shape[1], ys.shape[1]
    out = torch.empty(m, n, dtype=torch.float32)
    args = [ROW_MAJOR, TRANS if ta else NO_TRANS, TRANS if tb else NO_TRANS, m, n, k]
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())
    if bf16:
        f = lib.cblas_gemm_bf16bf16f32
        call = lambda: f(*args, ctypes.c_float(1.0), ptr(xs), lda, ptr(ys), ldb, ctypes.c_float(0.0), ptr(out), n)
    else:
        f = lib.cblas_sgemm
        call = lambda: f(*args, ctypes.c_float(1.0), ptr(xs), lda, ptr(ys), ldb, ctypes.c_float(0.0), ptr(out), n)
    return call, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--mkl", help="path of libmkl_rt.so.3 (PyPI `mkl`)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    lib = None
    if a.mkl:
        lib = ctypes.CDLL(a.mkl)
        lib.MKL_Set_Num_Threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), {a.dtype}, ms per product (GFLOP/s), hot:"
          f" torch{', MKL' if lib else ''}")
    for m, k, n, ta, tb in SHAPES:
        x, y = operand(m, k, ta, dtype), operand(k, n, tb, dtype)
        gflops = lambda ms: 2 * m * n * k / ms / 1e6
        ms = time_ms(lambda: x @ y, a.reps)
        line = f"{m}x{k}{'T' if ta else ''} . {k}x{n}{'T' if tb else ''}: torch {ms:.3f} ms ({gflops(ms):.0f})"
        if lib:
            call, out = mkl_product(lib, x, y, a.dtype == "bf16")
            mk = time_ms(call, a.reps)
            want = (x.float() @ y.float())
            err = ((out - want).abs().max() / want.abs().max()).item()
            line += f", MKL {mk:.3f} ms ({gflops(mk):.0f}; max rel. diff. to f32 {err:.1e})"
        print(line)


if __name__ == "__main__":
    main()
