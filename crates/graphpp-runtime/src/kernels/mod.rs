//! CPU kernels: the arithmetic the executor calls for one op, on f32 slices and candle CPU
//! tensors. Nothing here knows a graph, a stage or a schedule; this layer imports nothing above it
//! (docs/ARCHITECTURE.md, "Runtime layers").
//!
//! - [`matmul`]: the interpreter's and the compiled executor's matrix products (gemm);
//! - [`bf16_gemm`]: bf16 products with f32 sums, on AVX-512 BF16 where the CPU has it;
//! - [`softmax`], [`attention`]: row-wise softmax kernels and fused causal attention;
//! - [`accumulate`]: gradient accumulators summed in place;
//! - [`segment`]: the mixture-of-experts routing kernels;
//! - [`expf`], [`tile8`]: the SIMD building blocks (the C library's `expf` bits eight lanes at a
//!   time, 8 × 8 register transposes), each behind a run-time CPU check;
//! - [`tensor`]: conversions between candle tensors and plain data;
//! - [`device`]: which tensors run these kernels and which run candle's compositions (a tensor
//!   on a GPU, or any under `GRAPHPP_KERNELS=composed`);
//! - [`threads`]: the rank's own thread pool every kernel splits its work over.

pub mod accumulate;
pub mod attention;
pub mod bf16_gemm;
pub mod device;
pub mod expf;
pub mod matmul;
pub mod segment;
pub mod softmax;
pub mod tensor;
pub mod threads;
pub(crate) mod tile8;
