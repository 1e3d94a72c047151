//! A cluster's hardware as data (`graphpp plan --hardware FILE`): what a device computes and
//! holds, how many share a node, and the links inside and between nodes — so the planner can
//! rank strategies for machines it does not run on. A TOML file, or a preset from the vendors'
//! published figures (each preset's `source` names them).
//!
//! The planner's cost model reads it as rates: matmul FLOPs at the device's peak for the
//! compute dtype, every other node's written bytes at the memory bandwidth ([`Hardware::speed`]:
//! additive, so a bound that ignores overlap of compute and memory traffic), and each
//! communication over the link it crosses under graphpp's rank order (tp innermost, then the
//! pipeline, then the replicas: [`Hardware::links`]).

use std::path::Path;

use graphpp_graph::DType;
use serde::{Deserialize, Serialize};

use crate::profile::{NodeCost, Speed};

/// One device: peak matmul rates, memory bandwidth and capacity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Device {
    /// Dense f32 matmul FLOP/s (no tensor cores, no sparsity).
    pub flops_f32: f64,
    /// Dense bf16 matmul FLOP/s (a GPU's tensor cores, no sparsity; a CPU's bf16 matmul path,
    /// `graphpp_runtime::kernels::bf16_gemm`, as the probe measures it).
    pub flops_bf16: f64,
    /// Memory bandwidth, bytes/s.
    pub memory_bandwidth: f64,
    /// Memory capacity, bytes.
    pub memory_bytes: u64,
    /// Measured matmul rates by size: pairs `[FLOPs of one product, achieved FLOP/s]` in f32,
    /// ascending (`graphpp hardware probe`); a product's rate is interpolated between them (in
    /// log–log), clamped at the ends, and scaled to bf16 by `flops_bf16 / flops_f32` where there is
    /// no [`Device::bf16_matmul_curve`]. Empty: every product at the peak.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matmul_curve: Vec<[f64; 2]>,
    /// Measured attention rates by size, as [`Device::matmul_curve`] but for the fused attention
    /// ops (forward and backward: per-head products beside softmax, slower than a matmul of the
    /// same FLOPs); empty: they run at the matmul curve's rate (or the peak).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attention_curve: Vec<[f64; 2]>,
    /// Measured bf16 matmul rates by size, as [`Device::matmul_curve`] but for stage graphs
    /// computing in bf16 (the probe measures both: on a CPU a bf16 product's rate grows with its
    /// size differently from an f32 one's); empty: the f32 curve scaled by the peaks' ratio.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bf16_matmul_curve: Vec<[f64; 2]>,
    /// Measured bf16 attention rates by size, as [`Device::attention_curve`]; only beside a
    /// [`Device::bf16_matmul_curve`]. Empty: the f32 attention curve scaled by the peaks' ratio,
    /// else the bf16 matmul curve.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bf16_attention_curve: Vec<[f64; 2]>,
    /// Seconds every other node a compiled program writes costs besides its bytes (dispatch,
    /// small-tensor overheads; measured by the probe), microseconds.
    #[serde(default)]
    pub node_overhead_us: f64,
}

impl Device {
    /// Dense matmul FLOP/s in `dtype`: bf16's for bf16, f32's otherwise.
    pub fn peak(&self, dtype: DType) -> f64 {
        if dtype == DType::BF16 {
            self.flops_bf16
        } else {
            self.flops_f32
        }
    }
}

/// A link class: bandwidth one way per device, and latency.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Bytes/s one way, per device.
    pub bandwidth: f64,
    /// Microseconds per message.
    pub latency_us: f64,
}

/// A cluster (see the module doc).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    /// Name, e.g. `h100-sxm`.
    pub name: String,
    /// Where the figures come from.
    pub source: String,
    /// Devices per node (consecutive ranks share a node).
    pub devices_per_node: usize,
    /// Every device.
    pub device: Device,
    /// Between devices of one node (NVLink).
    pub intra_node: Link,
    /// Between nodes (the network, per device).
    pub inter_node: Link,
}

/// Why a hardware description cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum HardwareError {
    /// Neither a preset nor a readable file.
    #[error("{path}: not a preset ({}) and not a readable file: {source}", PRESETS.join(", "))]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Not TOML of a [`Hardware`] (a missing or unknown field is named).
    #[error("--hardware {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message.
        message: String,
    },
    /// A latency or a per-node overhead that is not a finite number ≥ 0.
    #[error("--hardware {path}: {field} is {value}: it must be a finite number of microseconds ≥ 0")]
    Latency {
        /// The file, or the preset's name.
        path: String,
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// A point of a measured curve that is not positive, or out of order; a bf16 attention curve
    /// without a bf16 matmul curve.
    #[error("--hardware {path}: {field} point {point}: {reason}")]
    Curve {
        /// The file, or the preset's name.
        path: String,
        /// The curve.
        field: &'static str,
        /// The point's index (from 0).
        point: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A figure that is not a positive finite number.
    #[error("--hardware {path}: {field} is {value}: it must be a positive finite number")]
    Field {
        /// The file, or the preset's name.
        path: String,
        /// The field.
        field: &'static str,
        /// Its value.
        value: f64,
    },
}

/// The preset names.
pub const PRESETS: [&str; 2] = ["h100-sxm", "h200-sxm"];

/// NVIDIA's published H100 SXM5 figures: 67 TFLOP/s FP32, 989.5 TFLOP/s BF16 dense (1,979
/// with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s per GPU (both ways: 450 one way),
/// 8 GPUs per HGX node; the network one 400 Gb/s ConnectX-7 NDR port per GPU (50 GB/s).
fn h100(name: &str, memory_bandwidth: f64, memory_bytes: u64, source: &str) -> Hardware {
    Hardware {
        name: name.into(),
        source: source.into(),
        devices_per_node: 8,
        device: Device {
            flops_f32: 67e12,
            flops_bf16: 989.5e12,
            memory_bandwidth,
            memory_bytes,
            matmul_curve: Vec::new(),
            attention_curve: Vec::new(),
            bf16_matmul_curve: Vec::new(),
            bf16_attention_curve: Vec::new(),
            // A kernel launch and a small kernel's tail: a few microseconds per node on a GPU
            // (CUDA launch latency is ~2–5 µs); without it a small model's step is all FLOPs.
            node_overhead_us: 4.0,
        },
        intra_node: Link { bandwidth: 450e9, latency_us: 3.0 },
        inter_node: Link { bandwidth: 50e9, latency_us: 5.0 },
    }
}

impl Hardware {
    /// A preset by name ([`PRESETS`]): `h100-sxm`, `h200-sxm` (an H100's compute with 141 GB of
    /// HBM3e at 4.8 TB/s).
    pub fn preset(name: &str) -> Option<Hardware> {
        match name {
            "h100-sxm" => Some(h100(
                name,
                3.35e12,
                80_000_000_000,
                "NVIDIA H100 Tensor Core GPU datasheet (SXM5: FP32 67 TFLOPS, BF16 989.5 TFLOPS dense, \
                 80 GB HBM3 3.35 TB/s, NVLink 900 GB/s); ConnectX-7 NDR 400 Gb/s per GPU",
            )),
            "h200-sxm" => Some(h100(
                name,
                4.8e12,
                141_000_000_000,
                "NVIDIA H200 Tensor Core GPU datasheet (SXM: FP32 67 TFLOPS, BF16 989.5 TFLOPS dense, \
                 141 GB HBM3e 4.8 TB/s, NVLink 900 GB/s); ConnectX-7 NDR 400 Gb/s per GPU",
            )),
            _ => None,
        }
    }

    /// A preset's name or a TOML file's path.
    ///
    /// # Errors
    /// [`HardwareError`]: an unreadable file, bad TOML, a figure that is not positive.
    pub fn load(name_or_path: &str) -> Result<Hardware, HardwareError> {
        let h = match Hardware::preset(name_or_path) {
            Some(h) => h,
            None => {
                let path = name_or_path.to_string();
                let text = crate::textfile::read_text(Path::new(name_or_path)).map_err(|e| {
                    HardwareError::Io { path: path.clone(), source: std::io::Error::other(e.to_string()) }
                })?;
                toml::from_str(&text).map_err(|e| HardwareError::Parse { path, message: e.to_string() })?
            }
        };
        h.check(name_or_path)?;
        Ok(h)
    }

    /// Checks every figure is a positive finite number (and at least one device per node).
    fn check(&self, path: &str) -> Result<(), HardwareError> {
        let d = &self.device;
        for (field, value) in [
            ("device.flops_f32", d.flops_f32),
            ("device.flops_bf16", d.flops_bf16),
            ("device.memory_bandwidth", d.memory_bandwidth),
            ("device.memory_bytes", d.memory_bytes as f64),
            ("devices_per_node", self.devices_per_node as f64),
            ("intra_node.bandwidth", self.intra_node.bandwidth),
            ("inter_node.bandwidth", self.inter_node.bandwidth),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(HardwareError::Field { path: path.into(), field, value });
            }
        }
        for (field, curve) in [
            ("device.matmul_curve", &d.matmul_curve),
            ("device.attention_curve", &d.attention_curve),
            ("device.bf16_matmul_curve", &d.bf16_matmul_curve),
            ("device.bf16_attention_curve", &d.bf16_attention_curve),
        ] {
            let curve_error = |point: usize, reason: &'static str| HardwareError::Curve {
                path: path.into(),
                field,
                point,
                reason,
            };
            if let Some(i) = curve.iter().position(|p| p.iter().any(|v| !(v.is_finite() && *v > 0.0))) {
                return Err(curve_error(i, "its FLOPs and FLOP/s must be positive finite numbers"));
            }
            if let Some(i) = curve.windows(2).position(|w| w[1][0] <= w[0][0]) {
                return Err(curve_error(i + 1, "the sizes must ascend"));
            }
        }
        if !d.bf16_attention_curve.is_empty() && d.bf16_matmul_curve.is_empty() {
            return Err(HardwareError::Curve {
                path: path.into(),
                field: "device.bf16_attention_curve",
                point: 0,
                reason: "it needs a device.bf16_matmul_curve beside it",
            });
        }
        for (field, value) in [
            ("intra_node.latency_us", self.intra_node.latency_us),
            ("inter_node.latency_us", self.inter_node.latency_us),
            ("device.node_overhead_us", d.node_overhead_us),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(HardwareError::Latency { path: path.into(), field, value });
            }
        }
        Ok(())
    }

    /// Seconds of one run of `g` computing in `dtype`, node by node: each product at its size's
    /// rate ([`Device::matmul_curve`], an attention op's on [`Device::attention_curve`] where
    /// there is one; in bf16 the bf16 curves where the file has them, else the f32 ones scaled by
    /// the peaks' ratio; no curve: the peak for the dtype), each other node the compiled
    /// program writes at the memory bandwidth plus [`Device::node_overhead_us`] (fused members
    /// are computed in registers: not counted, as [`crate::profile::Work::of`]).
    pub fn graph_seconds(&self, g: &graphpp_graph::Graph, dtype: DType) -> f64 {
        let d = &self.device;
        let peak = d.peak(dtype);
        let (bf16, scale) = (dtype == DType::BF16 && !d.bf16_matmul_curve.is_empty(), peak / d.flops_f32);
        let matmul = |flops: f64| match d.matmul_curve.as_slice() {
            _ if bf16 => interpolate(&d.bf16_matmul_curve, flops),
            [] => peak,
            curve => scale * interpolate(curve, flops),
        };
        // An attention op: its own curve in the dtype, else f32's scaled, else a matmul's rate.
        let rate = |flops: f64, attention: bool| match (
            d.bf16_attention_curve.as_slice(),
            d.attention_curve.as_slice(),
        ) {
            _ if !attention => matmul(flops),
            (curve @ [_, ..], _) if bf16 => interpolate(curve, flops),
            (_, curve @ [_, ..]) => scale * interpolate(curve, flops),
            _ => matmul(flops),
        };
        crate::profile::node_costs(g)
            .into_iter()
            .map(|c| match c {
                NodeCost::Product { flops, attention } => flops as f64 / rate(flops as f64, attention),
                NodeCost::Written { bytes } => bytes as f64 / d.memory_bandwidth + d.node_overhead_us * 1e-6,
            })
            .sum()
    }

    /// Model FLOPs utilisation (PaLM's MFU, Chowdhery et al. 2022, appendix B): a step's model
    /// FLOPs (`flops_per_token` × its tokens, no recomputation counted) over `world` devices'
    /// peak for `dtype` during `step_seconds`. A fraction (0.5 is 50%).
    pub fn mfu(
        &self,
        flops_per_token: f64,
        tokens: usize,
        world: usize,
        dtype: DType,
        step_seconds: f64,
    ) -> f64 {
        let peak = self.device.peak(dtype);
        flops_per_token * tokens as f64 / step_seconds / (world as f64 * peak)
    }

    /// The device's rates for stage graphs computing in `dtype`: matmul FLOPs at its peak for
    /// the dtype (bf16's for bf16, f32's otherwise), other nodes' bytes at the memory bandwidth.
    pub fn speed(&self, dtype: DType) -> Speed {
        let peak = self.device.peak(dtype);
        Speed { seconds_per_flop: 1.0 / peak, seconds_per_byte: 1.0 / self.device.memory_bandwidth }
    }

    /// The bandwidths (bytes/s) of a layout's four kinds of traffic under graphpp's rank order
    /// (`rank = (dp_index · pp + pp_index) · tp + tp_index`, nodes of `devices_per_node`
    /// consecutive ranks): a tp group stays in a node when tp fits one; a pipeline's hand-overs
    /// when its `pp · tp` ranks do; the data-parallel reduction when the whole world does; the
    /// all-to-alls of expert-parallel groups of `ep` replicas as [`Hardware::expert_bandwidth`]
    /// splits them. Each hand-over and each tp ring step also pays its link's latency.
    pub fn links(&self, (pp, dp, tp, ep): (usize, usize, usize, usize)) -> crate::plan::Links {
        let fits = |ranks: usize| ranks <= self.devices_per_node;
        let link = |inside: bool| if inside { self.intra_node } else { self.inter_node };
        let (tensor, hop) = (link(fits(tp)), link(fits(pp * tp)));
        crate::plan::Links {
            tensor: tensor.bandwidth,
            hop: hop.bandwidth,
            data: link(fits(pp * dp * tp)).bandwidth,
            hop_latency: hop.latency_us * 1e-6,
            tensor_latency: tensor.latency_us * 1e-6,
            expert: self.expert_bandwidth((pp, tp, ep)),
        }
    }

    /// The bytes per second a rank's expert-parallel all-to-all sends to the other members under
    /// graphpp's rank order ([`Hardware::links`]'s `expert`): the `ep` members of a group are data-parallel replicas `pp · tp`
    /// ranks apart, so a node holds `devices_per_node / (pp · tp)` of them (at least 1); of what a
    /// rank sends to its `ep − 1` peers, `(here − 1) / (ep − 1)` stays on NVLink and `(ep − here)
    /// / (ep − 1)` crosses the network, both at once: `1 / max(inside / intra, outside / inter)`
    /// (NVLink's bandwidth for ep = 1, where nothing is sent).
    fn expert_bandwidth(&self, (pp, tp, ep): (usize, usize, usize)) -> f64 {
        if ep <= 1 {
            return self.intra_node.bandwidth;
        }
        let here = (self.devices_per_node / (pp * tp).max(1)).clamp(1, ep);
        let peers = (ep - 1) as f64;
        let (inside, outside) = ((here - 1) as f64 / peers, (ep - here) as f64 / peers);
        1.0 / (inside / self.intra_node.bandwidth).max(outside / self.inter_node.bandwidth)
    }

    /// The TOML text of this description (what `graphpp plan --hardware` reads).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_default()
    }
}

/// `y` at `x` on the ascending points `[x, y]` of `curve`, interpolated in log–log and clamped
/// at the ends.
fn interpolate(curve: &[[f64; 2]], x: f64) -> f64 {
    let (first, last) = (curve[0], curve[curve.len() - 1]);
    if x <= first[0] {
        return first[1];
    }
    if x >= last[0] {
        return last[1];
    }
    let i = curve.windows(2).position(|w| x <= w[1][0]).unwrap_or(0);
    let ([x0, y0], [x1, y1]) = (curve[i], curve[i + 1]);
    let t = (x.ln() - x0.ln()) / (x1.ln() - x0.ln()).max(f64::MIN_POSITIVE);
    (y0.ln() + t * (y1.ln() - y0.ln())).exp()
}

/// What [`probe`] measured, and how.
#[derive(Debug, Clone)]
pub struct Probed {
    /// The description, in the format `plan --hardware` reads.
    pub hardware: Hardware,
    /// Seconds spent measuring.
    pub seconds: f64,
}

/// Runs `f` until `budget` has passed (at least 3 times) and returns the best time of one run.
fn best_of(
    budget: std::time::Duration,
    mut f: impl FnMut() -> candle_core::Result<()>,
) -> candle_core::Result<f64> {
    let start = std::time::Instant::now();
    let (mut best, mut runs) = (f64::INFINITY, 0);
    while runs < 3 || start.elapsed() < budget {
        let t = std::time::Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    Ok(best)
}

/// Measures this machine in the format of a cluster description, each rank a device with the
/// intra-op threads the caller set (`graphpp hardware probe`): the peak matmul FLOP/s of a
/// `[512, 256] · [256, 688]` product (the shape of `small`'s MLP at B·T = 512) in f32 and in bf16
/// on the bf16 path a bf16 run takes (`graphpp_runtime::kernels::matmul::matmul`);
/// the matmul curve, the bytes per second other nodes write (at most an elementwise add's over
/// 16 MiB) and the per-node overhead that graphpp's executor achieves on a stage's own ops
/// ([`executor_rates`]); the threads communicator's bandwidth (a 4 MiB
/// message) and latency (a one-float ping-pong) between two ranks, the machine's memory shared
/// by its cores. One host: `devices_per_node` is the core count and the two links are equal.
/// The best of repeated runs is taken (noise only slows a run down).
///
/// # Errors
/// A tensor or communicator error.
pub fn probe() -> Result<Probed, Box<dyn std::error::Error + Send + Sync>> {
    use candle_core::{DType as C, Device as Cpu, Tensor};
    let t0 = std::time::Instant::now();
    let budget = std::time::Duration::from_millis(400);
    let (m, k, n) = (512usize, 256usize, 688usize);
    let a = Tensor::randn(0f32, 1.0, (m, k), &Cpu::Cpu)?;
    let b = Tensor::randn(0f32, 1.0, (k, n), &Cpu::Cpu)?;
    let flops = 2.0 * (m * k * n) as f64;
    let f32_s = best_of(budget, || a.matmul(&b).map(drop))?;
    // bf16 as a bf16 run computes it: on the process's bf16 path (AMX, AVX-512 BF16 or widened;
    // candle's product under GRAPHPP_KERNELS=composed).
    let (a16, b16) = (a.to_dtype(C::BF16)?, b.to_dtype(C::BF16)?);
    let bf16_s = best_of(budget, || graphpp_runtime::kernels::matmul::matmul(&a16, &b16).map(drop))?;
    let x = Tensor::randn(0f32, 1.0, 4 << 20, &Cpu::Cpu)?;
    let add_s = best_of(budget, || (&x + &x).map(drop))?;
    // What the executor achieves on a stage's own ops: products by size, other nodes' bytes
    // and per-node overhead.
    let rates = executor_rates(5)?;
    let (bandwidth, latency_us) = probe_link()?;
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let memory = graphpp_runtime::train::memory::machine_memory().unwrap_or(0) / cores as u64;
    let link = Link { bandwidth, latency_us };
    let hardware = Hardware {
        name: "this machine".into(),
        source: format!("graphpp hardware probe, {cores} cores (one rank a core)"),
        devices_per_node: cores,
        device: Device {
            flops_f32: flops / f32_s,
            flops_bf16: flops / bf16_s,
            memory_bandwidth: rates.bandwidth.min((x.elem_count() * 4) as f64 / add_s),
            memory_bytes: memory.max(1),
            matmul_curve: rates.matmul_curve,
            attention_curve: rates.attention_curve,
            bf16_matmul_curve: rates.bf16_matmul_curve,
            bf16_attention_curve: rates.bf16_attention_curve,
            node_overhead_us: rates.node_overhead_us,
        },
        intra_node: link,
        inter_node: link,
    };
    Ok(Probed { hardware, seconds: t0.elapsed().as_secs_f64() })
}

/// What graphpp's compiled executor achieves on this machine ([`executor_rates`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ExecutorRates {
    /// Products' FLOP/s by size, `[flops, flop/s]` ascending (one point per 4× bin of sizes).
    pub matmul_curve: Vec<[f64; 2]>,
    /// Attention ops' FLOP/s by size, as `matmul_curve`.
    pub attention_curve: Vec<[f64; 2]>,
    /// `matmul_curve` of the same stages computing in bf16 mixed precision.
    pub bf16_matmul_curve: Vec<[f64; 2]>,
    /// `attention_curve` in bf16.
    pub bf16_attention_curve: Vec<[f64; 2]>,
    /// Bytes per second a node other than a product writes (the fitted line's slope).
    pub bandwidth: f64,
    /// Microseconds a node other than a product costs on top of its bytes (the line's intercept).
    pub node_overhead_us: f64,
}

/// Rates of graphpp's own compiled executor, from every node of a stage's forward and backward
/// — every layer of `tiny` at B = 8 sequences, then of `small` at B = 4 and 8 (products from 4
/// to 400 MFLOP; the same shapes at two row counts, so a product's size is not confounded with
/// its width), T = 64 tokens, in f32 and again in bf16 mixed precision (the bf16 curves; the
/// line below is f32's), the pointwise recompute policy `train` defaults to — each node timed ([`graphpp_runtime::exec::RunOptions::time_nodes`])
/// over `runs` runs, its median kept: the matmuls' FLOP/s by size and the attention ops' apart (a pair run side by side
/// counts as one product of both sizes, its time being the first's:
/// [`graphpp_runtime::exec::pairs`]), and the least-squares line `t = overhead + bytes /
/// bandwidth` over every other node the program writes (fused members cost nothing, as in
/// [`crate::profile::node_costs`]). These are the costs `graph_seconds` charges, measured on the
/// ops a stage runs rather than on one large product.
///
/// # Errors
/// Building the stage or running it.
pub fn executor_rates(runs: usize) -> Result<ExecutorRates, Box<dyn std::error::Error + Send + Sync>> {
    let (mut products, mut attention, mut written) = (Vec::new(), Vec::new(), Vec::new());
    let (mut bf16_products, mut bf16_attention) = (Vec::new(), Vec::new());
    let (tiny, small) = (graphpp_models::LlamaConfig::tiny(), graphpp_models::LlamaConfig::small());
    for (cfg, batch) in [(&tiny, 8), (&small, 4), (&small, 8)] {
        time_stage_nodes(cfg, (batch, DType::F32), runs, (&mut products, &mut attention), &mut written)?;
        // bf16's products; its other nodes are left out of the bandwidth's fit (f32's).
        let products = (&mut bf16_products, &mut bf16_attention);
        time_stage_nodes(cfg, (batch, DType::BF16), runs, products, &mut Vec::new())?;
    }
    let (intercept, slope) = least_squares(&written);
    Ok(ExecutorRates {
        matmul_curve: binned_rates(&products),
        attention_curve: binned_rates(&attention),
        bf16_matmul_curve: binned_rates(&bf16_products),
        bf16_attention_curve: binned_rates(&bf16_attention),
        bandwidth: if slope > 0.0 { 1.0 / slope } else { f64::INFINITY },
        node_overhead_us: intercept.max(0.0) * 1e6,
    })
}

/// Timed nodes: `(size, seconds)` pairs, the size a node's FLOPs or bytes.
type Timed = Vec<(f64, f64)>;

/// Times every node of one stage holding all of `cfg`'s layers (`batch` sequences, T = 64,
/// computing in `dtype`, the pointwise policy), fw then full_bw, `runs` runs each, the median per
/// node: appends products as
/// `(flops, seconds)` and other written nodes as `(bytes, seconds)` ([`executor_rates`]).
fn time_stage_nodes(
    cfg: &graphpp_models::LlamaConfig,
    (batch, dtype): (usize, DType),
    runs: usize,
    (products, attention): (&mut Timed, &mut Timed),
    written: &mut Timed,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    use graphpp_models::{Model, StageOptions};
    use graphpp_runtime::exec::RunOptions;
    let opts = StageOptions::mixed(batch, 64, dtype);
    let spec = graphpp_models::split_layers(cfg.num_layers(), 1, None)?.remove(0);
    let stage = cfg.build_stage(&spec, &opts)?;
    let graphs = graphpp_graph::stage_graphs(&stage, &graphpp_models::Recompute::Pointwise.policy(&spec))?;
    let cpu = candle_core::Device::Cpu;
    let build = graphpp_runtime::train::build::StageBuild {
        model: cfg,
        specs: std::slice::from_ref(&spec),
        opts: &opts,
        seed: 0,
        given: None,
        device: &cpu,
    };
    let mut env = build.state(&spec)?;
    let data = graphpp_runtime::verify::random_microbatches(cfg.vocab_size, 1, batch, 64, 0)?;
    env.insert(graphpp_graph::names::TOKENS.into(), data.tokens[0].clone());
    env.insert(graphpp_graph::names::TARGETS.into(), data.targets[0].clone());
    for g in [&graphs.fw, &graphs.full_bw] {
        let program = graphpp_runtime::Program::compile(g);
        let opts = RunOptions { time_nodes: true, ..RunOptions::default() };
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); g.nodes.len()];
        let mut outputs = Vec::new();
        for _ in 0..runs.max(1) {
            let r = program.run_named_with(g, &env, &opts, None)?;
            let run = r.node_times.as_deref().unwrap_or_default();
            times.iter_mut().zip(run).for_each(|(ts, t)| ts.push(t.as_secs_f64()));
            outputs = r.outputs;
        }
        // Each node's median run: the steady state a step sees, neither the best case nor noise.
        let median: Vec<f64> = times
            .into_iter()
            .map(|mut ts| {
                ts.sort_by(f64::total_cmp);
                ts.get(ts.len() / 2).copied().unwrap_or(f64::INFINITY)
            })
            .collect();
        let partner = &program.pairs().partner;
        let seconds: std::collections::HashSet<usize> = partner.iter().flatten().copied().collect();
        let flops = |j: usize| g.node_flops(graphpp_graph::ValueId(j)).unwrap_or(0) as f64;
        for (i, cost) in crate::profile::indexed_node_costs(g) {
            match cost {
                // A pair's second product was timed with its first.
                NodeCost::Product { .. } if seconds.contains(&i) => {}
                NodeCost::Product { flops: f, attention: true } => attention.push((f as f64, median[i])),
                NodeCost::Product { flops: f, attention: false } => {
                    products.push((f as f64 + partner[i].map_or(0.0, flops), median[i]))
                }
                NodeCost::Written { bytes } => written.push((bytes as f64, median[i])),
            }
        }
        env.extend(g.output_names().into_iter().zip(outputs));
    }
    Ok(())
}

/// `[flops, flop/s]` of products `(flops, seconds)` binned by size (4× bins), ascending.
fn binned_rates(products: &[(f64, f64)]) -> Vec<[f64; 2]> {
    let mut bins: std::collections::BTreeMap<i64, (f64, f64, usize)> = Default::default();
    for &(f, t) in products.iter().filter(|(f, t)| *f > 0.0 && t.is_finite() && *t > 0.0) {
        let b = bins.entry((f.ln() / 4f64.ln()).floor() as i64).or_default();
        (b.0, b.1, b.2) = (b.0 + f, b.1 + t, b.2 + 1);
    }
    bins.values().map(|&(f, t, n)| [f / n as f64, f / t]).collect()
}

/// The least-squares line `y = a + b·x` through `points` (`(x, y)`): `(a, b)`; `(mean y, 0)`
/// when the x do not vary.
fn least_squares(points: &[(f64, f64)]) -> (f64, f64) {
    let pts: Vec<_> = points.iter().filter(|(_, y)| y.is_finite()).collect();
    let n = pts.len().max(1) as f64;
    let (mx, my) = (pts.iter().map(|p| p.0).sum::<f64>() / n, pts.iter().map(|p| p.1).sum::<f64>() / n);
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx <= 0.0 {
        return (my, 0.0);
    }
    let b = sxy / sxx;
    (my - b * mx, b)
}

/// Round trips of one link probe: 8 of a 4 MiB message (its bandwidth), then 200 of one float
/// (its latency).
const BIG_TRIPS: usize = 8;
/// See [`BIG_TRIPS`].
const PING_TRIPS: usize = 200;

/// The threads communicator between two ranks of this process ([`link_between`] with an echo
/// thread): `(bytes/s, µs)`.
fn probe_link() -> Result<(f64, f64), Box<dyn std::error::Error + Send + Sync>> {
    let mut ends = graphpp_comm::ThreadComm::world(2).into_iter();
    let (a, b) = (ends.next().ok_or("no rank 0")?, ends.next().ok_or("no rank 1")?);
    let echo = std::thread::spawn(move || echo(&b, 0));
    let measured = link_between(&a, 1);
    echo.join().map_err(|_| "the echo rank panicked")??;
    measured
}

/// The link from this rank to `peer` (which runs [`echo`]): bytes per second of a 4 MiB message
/// (best of [`BIG_TRIPS`] round trips, the reply one float) and the one-way latency of a
/// one-float message (half a ping-pong, median of [`PING_TRIPS`]), µs.
fn link_between(
    comm: &dyn graphpp_comm::Comm,
    peer: usize,
) -> Result<(f64, f64), Box<dyn std::error::Error + Send + Sync>> {
    use candle_core::{Device as Cpu, Tensor};
    let big = Tensor::zeros(1 << 20, candle_core::DType::F32, &Cpu::Cpu)?;
    let one = Tensor::zeros(1, candle_core::DType::F32, &Cpu::Cpu)?;
    let mut best = f64::INFINITY;
    for i in 0..BIG_TRIPS {
        let t = std::time::Instant::now();
        comm.send(peer, probe_tag(i), big.clone())?;
        comm.recv(peer, probe_tag(i), PROBE_TIMEOUT)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    let mut pings = Vec::with_capacity(PING_TRIPS);
    for i in BIG_TRIPS..BIG_TRIPS + PING_TRIPS {
        let t = std::time::Instant::now();
        comm.send(peer, probe_tag(i), one.clone())?;
        comm.recv(peer, probe_tag(i), PROBE_TIMEOUT)?;
        pings.push(t.elapsed().as_secs_f64() / 2.0);
    }
    pings.sort_by(f64::total_cmp);
    let latency = pings[pings.len() / 2];
    // The 4 MiB trip's time less a ping's; where a noisy ping leaves less than half the trip,
    // the whole trip (a bandwidth from one lucky trip would be unbounded).
    let transfer = if best - latency > 0.5 * best { best - latency } else { best };
    Ok(((4 << 20) as f64 / transfer, latency * 1e6))
}

/// The other end of [`link_between`]: answers each of its messages from `peer` with one float.
fn echo(comm: &dyn graphpp_comm::Comm, peer: usize) -> Result<(), graphpp_comm::CommError> {
    let one = candle_core::Tensor::zeros(1, candle_core::DType::F32, &candle_core::Device::Cpu)
        .map_err(|e| graphpp_comm::CommError::Aborted { failed_rank: comm.rank(), reason: e.to_string() })?;
    for i in 0..BIG_TRIPS + PING_TRIPS {
        comm.recv(peer, probe_tag(i), PROBE_TIMEOUT)?;
        comm.send(peer, probe_tag(i), one.clone())?;
    }
    Ok(())
}

/// How long a probe's message may take.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The tag of a probe's `i`-th round trip.
fn probe_tag(i: usize) -> graphpp_comm::Tag {
    graphpp_comm::Tag::Activation { stage: 0, mb: i }
}

/// The MPI link [`probe_process_link`] measured between ranks 0 and 1.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessLink {
    /// Its bandwidth and latency.
    pub link: Link,
    /// Whether ranks 0 and 1 run on two hosts (rank 1 is the first process of its host), so
    /// the link is the network's.
    pub across_hosts: bool,
}

/// The link between ranks 0 and 1 of a run of several processes (`mpirun -n N graphpp hardware
/// probe`): rank 1 tells rank 0 its `local_rank` (its rank among its host's processes), then
/// echoes while rank 0 measures ([`link_between`]); the others do nothing. `Some` on rank 0
/// only.
///
/// # Errors
/// A communicator error.
pub fn probe_process_link(
    comm: &dyn graphpp_comm::Comm,
    local_rank: usize,
) -> Result<Option<ProcessLink>, Box<dyn std::error::Error + Send + Sync>> {
    use candle_core::{Device as Cpu, Tensor};
    let host_tag = probe_tag(BIG_TRIPS + PING_TRIPS);
    match comm.rank() {
        0 if comm.world() > 1 => {
            let theirs: Vec<f32> = comm.recv(1, host_tag, PROBE_TIMEOUT)?.to_vec1()?;
            let (bandwidth, latency_us) = link_between(comm, 1)?;
            let across_hosts = theirs.first() == Some(&0.0);
            Ok(Some(ProcessLink { link: Link { bandwidth, latency_us }, across_hosts }))
        }
        1 => {
            comm.send(0, host_tag, Tensor::new(&[local_rank as f32], &Cpu::Cpu)?)?;
            Ok(echo(comm, 0).map(|()| None)?)
        }
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_through_timed_nodes_gives_overhead_and_bandwidth() {
        // t = 5 µs + bytes / 10 GB/s, exactly.
        let pts: Vec<(f64, f64)> = [0.0, 1e3, 1e5, 1e6].iter().map(|&b| (b, 5e-6 + b / 1e10)).collect();
        let (a, b) = least_squares(&pts);
        assert!((a - 5e-6).abs() < 1e-12 && (1.0 / b - 1e10).abs() < 1.0, "{a} {b}");
        assert_eq!(least_squares(&[(3.0, 1.0), (3.0, 2.0)]), (1.5, 0.0));
    }

    #[test]
    fn products_are_binned_by_size_into_their_combined_rate() {
        // Two products in one 4x bin (1.1e6 and 2e6 FLOPs: 4^10 ≈ 1.05e6, 1 ms each), one far
        // larger, and an untimed one left out.
        let curve = binned_rates(&[(1.1e6, 1e-3), (2e6, 1e-3), (1e9, 1e-2), (5.0, f64::INFINITY)]);
        assert_eq!(curve.len(), 2, "{curve:?}");
        assert_eq!(curve[0], [1.55e6, 3.1e6 / 2e-3]);
        assert_eq!(curve[1], [1e9, 1e11]);
    }

    #[test]
    fn presets_round_trip() {
        for name in PRESETS {
            let h = Hardware::load(name).unwrap();
            let back: Hardware = toml::from_str(&h.to_toml()).unwrap();
            assert_eq!(back, h, "{name}");
        }
    }

    /// 8 devices per node: tp 8 stays inside, pp 2 × tp 8 crosses nodes for its hand-overs, and
    /// a 16-rank world reduces over the network.
    #[test]
    fn a_layouts_traffic_takes_the_links_it_crosses() {
        let h = Hardware::load("h100-sxm").unwrap();
        let l = h.links((2, 1, 8, 1));
        assert_eq!((l.tensor, l.hop, l.data), (450e9, 50e9, 50e9));
        assert!((l.tensor_latency - 3e-6).abs() < 1e-15 && (l.hop_latency - 5e-6).abs() < 1e-15, "{l:?}");
        let l = h.links((2, 2, 2, 1));
        assert_eq!((l.tensor, l.hop, l.data), (450e9, 450e9, 450e9));
        // Expert parallelism over 16 replicas of a 4-rank pipeline: 2 members a node, so 14 of a
        // rank's 15 peers are across the network at 50 GB/s; within one node, NVLink; two
        // members in two nodes send everything over the network.
        assert!((h.expert_bandwidth((4, 1, 16)) - 50e9 * 15.0 / 14.0).abs() < 1.0);
        assert_eq!(h.expert_bandwidth((1, 1, 8)), 450e9);
        assert_eq!(h.expert_bandwidth((8, 1, 2)), 50e9);
        assert_eq!(h.expert_bandwidth((4, 1, 1)), 450e9);
    }

    /// A measured curve sets each product's rate by its size (log–log between the points,
    /// clamped at the ends), and every other written node pays its bytes and the overhead.
    #[test]
    fn products_run_at_their_sizes_rate() {
        assert!((interpolate(&[[1e6, 1e9], [1e8, 1e10]], 1e7) - 10f64.powf(9.5)).abs() < 1e3);
        assert_eq!(interpolate(&[[1e6, 1e9], [1e8, 1e10]], 1e3), 1e9);
        assert_eq!(interpolate(&[[1e6, 1e9], [1e8, 1e10]], 1e12), 1e10);
        let mut b = graphpp_graph::GraphBuilder::new("g", DType::F32);
        let x = b.input("x", graphpp_graph::InputKind::Activation, vec![100, 50]).unwrap();
        let w = b.input("w", graphpp_graph::InputKind::Parameter, vec![50, 100]).unwrap();
        let y = b.matmul(x, w).unwrap();
        let z = b.neg(y).unwrap();
        b.output("z", z);
        let g = b.finish().unwrap();
        let mut h = Hardware::load("h100-sxm").unwrap();
        h.device.matmul_curve = vec![[1e6, 1e9], [1e8, 1e10]];
        (h.device.memory_bandwidth, h.device.node_overhead_us) = (4e10, 2.0);
        // 2·100·50·100 = 1e6 FLOPs at 1e9 FLOP/s; the negation writes 4e4 bytes at 4e10 B/s, + 2 µs.
        let want = 1e-3 + 1e-6 + 2e-6;
        assert!(
            (h.graph_seconds(&g, DType::F32) - want).abs() < 1e-12,
            "{}",
            h.graph_seconds(&g, DType::F32)
        );
        // bf16 scales the curve by the peaks' ratio.
        let ratio = h.device.flops_bf16 / h.device.flops_f32;
        assert!((h.graph_seconds(&g, DType::BF16) - (1e-3 / ratio + 3e-6)).abs() < 1e-12);
        // A bf16 curve of its own is read as it is (1e6 FLOPs at 4e9), for bf16 only.
        h.device.bf16_matmul_curve = vec![[1e6, 4e9], [1e8, 4e10]];
        assert!((h.graph_seconds(&g, DType::BF16) - (2.5e-4 + 3e-6)).abs() < 1e-12);
        assert!((h.graph_seconds(&g, DType::F32) - want).abs() < 1e-12);
    }

    /// An attention curve charges the attention ops (and only them) at its rate: a stage's
    /// forward costs more by exactly their FLOPs at the slower rate.
    #[test]
    fn attention_runs_on_its_own_curve() {
        use graphpp_models::{Model, StageOptions};
        let cfg = graphpp_models::LlamaConfig::tiny();
        let spec = graphpp_models::split_layers(cfg.num_layers(), 1, None).unwrap().remove(0);
        let g = cfg.build_stage(&spec, &StageOptions::mixed(2, 16, DType::F32)).unwrap();
        let mut h = Hardware::load("h100-sxm").unwrap();
        h.device.matmul_curve = vec![[1e3, 1e10], [1e9, 1e10]];
        let before = h.graph_seconds(&g, DType::F32);
        h.device.attention_curve = vec![[1e3, 1e9], [1e9, 1e9]];
        // The FLOPs of the graph's attention ops, and of its other products.
        let flops = |of_attention: bool| -> u64 {
            let costs = crate::profile::node_costs(&g).into_iter();
            costs
                .filter_map(|c| match c {
                    NodeCost::Product { flops, attention } if attention == of_attention => Some(flops),
                    _ => None,
                })
                .sum()
        };
        let attention = flops(true);
        assert!(attention > 0);
        let want = before + attention as f64 * (1e-9 - 1e-10);
        assert!((h.graph_seconds(&g, DType::F32) - want).abs() < 1e-12 * want.max(1.0), "{want}");
        // In bf16 with a bf16 matmul curve but no bf16 attention curve, attention stays on the f32
        // attention curve scaled by the peaks' ratio (not on the faster bf16 matmul curve).
        h.device.bf16_matmul_curve = vec![[1e3, 4e10], [1e9, 4e10]];
        let ratio = h.device.flops_bf16 / h.device.flops_f32;
        let products = flops(false);
        // The other nodes' seconds, the same in either dtype here (the graph's bytes are f32's).
        let written = before - (products + attention) as f64 * 1e-10;
        let want = products as f64 / 4e10 + attention as f64 * 1e-9 / ratio + written;
        let got = h.graph_seconds(&g, DType::BF16);
        assert!((got - want).abs() < 1e-12 * want.max(1.0), "{got} against {want}");
        // With its own bf16 attention curve, that.
        h.device.bf16_attention_curve = vec![[1e3, 2e9], [1e9, 2e9]];
        let want = products as f64 / 4e10 + attention as f64 * 5e-10 + written;
        let got = h.graph_seconds(&g, DType::BF16);
        assert!((got - want).abs() < 1e-12 * want.max(1.0), "{got} against {want}");
    }

    /// MFU divides the step's model FLOPs by the world's peak in the step's dtype.
    #[test]
    fn mfu_is_model_flops_over_the_peak_of_the_dtype() {
        let h = Hardware::load("h100-sxm").unwrap();
        let bf16 = h.mfu(6e9, 1000, 8, DType::BF16, 0.5);
        assert!((bf16 - 6e12 / 0.5 / (8.0 * 989.5e12)).abs() < 1e-15, "{bf16}");
        let f32 = h.mfu(6e9, 1000, 8, DType::F32, 0.5);
        assert!((f32 / bf16 - 989.5 / 67.0).abs() < 1e-9, "{f32}");
    }

    #[test]
    fn bad_files_name_the_field() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("h.toml");
        let mut h = Hardware::load("h100-sxm").unwrap();
        h.inter_node.bandwidth = 0.0;
        std::fs::write(&path, h.to_toml()).unwrap();
        let e = Hardware::load(path.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("inter_node.bandwidth is 0"), "{e}");
        let mut h = Hardware::load("h100-sxm").unwrap();
        h.intra_node.latency_us = -1.0;
        std::fs::write(&path, h.to_toml()).unwrap();
        let e = Hardware::load(path.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("intra_node.latency_us is -1"), "{e}");
        // A negative per-node overhead made every predicted step 0 ms (and the MFU infinite).
        let mut h = Hardware::load("h100-sxm").unwrap();
        h.device.node_overhead_us = -5.0;
        std::fs::write(&path, h.to_toml()).unwrap();
        let e = Hardware::load(path.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("device.node_overhead_us is -5"), "{e}");
        std::fs::write(&path, "name = \"x\"\n").unwrap();
        let e = Hardware::load(path.to_str().unwrap()).unwrap_err().to_string();
        assert!(e.contains("missing field"), "{e}");
        for (curve, want) in [
            (vec![[1e6, 1e9], [1e5, 1e10]], "device.matmul_curve point 1: the sizes must ascend"),
            (vec![[1e6, -1e9]], "device.matmul_curve point 0: its FLOPs and FLOP/s must be positive"),
        ] {
            let mut h = Hardware::load("h100-sxm").unwrap();
            h.device.matmul_curve = curve.clone();
            std::fs::write(&path, h.to_toml()).unwrap();
            let e = Hardware::load(path.to_str().unwrap()).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
            // The bf16 curve is checked alike, under its own name.
            let mut h = Hardware::load("h100-sxm").unwrap();
            h.device.bf16_matmul_curve = curve;
            std::fs::write(&path, h.to_toml()).unwrap();
            let e = Hardware::load(path.to_str().unwrap()).unwrap_err().to_string();
            assert!(e.contains(&want.replace("device.matmul", "device.bf16_matmul")), "{e}");
        }
        let mut h = Hardware::load("h100-sxm").unwrap();
        h.device.bf16_attention_curve = vec![[1e6, 1e9]];
        std::fs::write(&path, h.to_toml()).unwrap();
        let e = Hardware::load(path.to_str().unwrap()).unwrap_err().to_string();
        assert!(
            e.contains("device.bf16_attention_curve point 0: it needs a device.bf16_matmul_curve beside it"),
            "{e}"
        );
        let e = Hardware::load("/nonexistent/h.toml").unwrap_err().to_string();
        assert!(e.contains("/nonexistent/h.toml"), "{e}");
        let e = Hardware::load("h100").unwrap_err().to_string();
        assert!(e.starts_with("h100: not a preset (h100-sxm, h200-sxm) and not a readable file"), "{e}");
    }
}
