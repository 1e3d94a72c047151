//! What the executor examples share: one stage holding every layer of a Llama preset, its
//! graphs and its inputs.

use candle_core::Tensor;
use graphpp_graph::{stage_graphs, StageGraphs};
use graphpp_models::rng::Rng;
use graphpp_models::{
    build_stage, init_parameters, split_layers, stage_buffers, LlamaConfig, Recompute, StageOptions,
};
use graphpp_runtime::kernels::tensor::{tensor_from_f64, tensor_u32};
use std::collections::HashMap;

/// Prints `problem` (if any) and the example's `usage` line, then exits: 0 for `--help`, 2 for
/// a bad command line.
pub fn exit_with_usage(usage: &str, problem: Option<String>) -> ! {
    match problem {
        Some(p) => {
            eprintln!("error: {p}\nusage: {usage}");
            std::process::exit(2)
        }
        None => {
            println!("usage: {usage}");
            std::process::exit(0)
        }
    }
}

/// An example's `--flag value` pairs over their defaults: `--help` prints `usage` and exits 0;
/// an unknown flag or a missing value prints the problem and `usage` and exits 2.
pub struct Flags {
    usage: &'static str,
    values: HashMap<String, String>,
}

impl Flags {
    /// The command line's flags; `defaults` names every flag (without `--`) and its value.
    pub fn parse(usage: &'static str, defaults: &[(&str, &str)]) -> Flags {
        let mut values: HashMap<String, String> =
            defaults.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let mut it = std::env::args().skip(1);
        while let Some(k) = it.next() {
            if k == "--help" || k == "-h" {
                exit_with_usage(usage, None);
            }
            let key = k.trim_start_matches("--").to_string();
            if !values.contains_key(&key) {
                exit_with_usage(usage, Some(format!("unknown flag {k}")));
            }
            let v = it.next().unwrap_or_else(|| exit_with_usage(usage, Some(format!("{k} needs a value"))));
            values.insert(key, v);
        }
        Flags { usage, values }
    }

    /// Flag `k`'s value.
    pub fn text(&self, k: &str) -> &str {
        &self.values[k]
    }

    /// Flag `k`'s value as a positive number (exits 2 otherwise).
    pub fn num(&self, k: &str) -> usize {
        self.positive(k, self.text(k))
    }

    /// `v`, given for flag `k`, as a positive number (exits 2 otherwise).
    pub fn positive(&self, k: &str, v: &str) -> usize {
        v.parse()
            .ok()
            .filter(|&n: &usize| n > 0)
            .unwrap_or_else(|| self.bad(format!("--{k} takes a positive number, not {v:?}")))
    }

    /// Flag `k` as a `--recompute` choice (exits 2 otherwise).
    pub fn recompute(&self, k: &str) -> Recompute {
        self.text(k).parse().unwrap_or_else(|e: String| self.bad(format!("--{k}: {e}")))
    }

    /// Flag `k` as a compute dtype, `f32` or `bf16` (exits 2 otherwise).
    pub fn dtype(&self, k: &str) -> graphpp_graph::DType {
        use graphpp_graph::DType;
        let d = self.text(k);
        d.parse::<DType>()
            .ok()
            .filter(|d| matches!(d, DType::F32 | DType::BF16))
            .unwrap_or_else(|| self.bad(format!("--{k} takes f32 or bf16, not {d:?}")))
    }

    /// Prints `problem` and the usage line; exits 2.
    pub fn bad(&self, problem: String) -> ! {
        exit_with_usage(self.usage, Some(problem))
    }
}

/// Tensors by input name.
pub type Env = HashMap<String, Tensor>;

/// The graphs (under `recompute`) of one stage of every layer of `cfg` at `opts`, and every
/// input of its forward: parameters (seed 0, f32: the master weights under mixed precision),
/// buffers (in `opts.dtype`), and `tokens` / `targets` drawn from seed 1.
pub fn whole_model_stage(cfg: &LlamaConfig, opts: &StageOptions, recompute: Recompute) -> (StageGraphs, Env) {
    let spec = split_layers(cfg.num_hidden_layers, 1, None).unwrap().remove(0);
    let sg = stage_graphs(&build_stage(cfg, &spec, opts).unwrap(), &recompute.policy(&spec)).unwrap();
    let mut env = Env::new();
    for (name, shape, data) in init_parameters(cfg, &spec, 0) {
        env.insert(name, Tensor::from_vec(data, shape, &candle_core::Device::Cpu).unwrap());
    }
    for (name, shape, data) in stage_buffers(cfg, opts.seq) {
        env.insert(name, tensor_from_f64(&data, &shape, opts.dtype).unwrap());
    }
    let mut rng = Rng::new(1);
    for name in ["tokens", "targets"] {
        let ids: Vec<u32> =
            (0..opts.batch * opts.seq).map(|_| rng.below(cfg.vocab_size as u64) as u32).collect();
        env.insert(name.into(), tensor_u32(&ids, &[opts.batch, opts.seq]).unwrap());
    }
    (sg, env)
}
