//! What the executor examples share: one stage holding every layer of a Llama preset, its
//! graphs and its inputs.

use candle_core::Tensor;
use graphpp_graph::{stage_graphs, DType, RecomputePolicy, StageGraphs};
use graphpp_models::rng::Rng;
use graphpp_models::{build_stage, init_parameters, split_layers, stage_buffers, LlamaConfig, StageOptions};
use graphpp_runtime::executor::{tensor_from_f64, tensor_u32};
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

/// Tensors by input name.
pub type Env = HashMap<String, Tensor>;

/// The graphs (save-all) of one stage of every layer of `cfg` at `opts`, and every input of its
/// forward: parameters (seed 0), buffers, and `tokens` / `targets` drawn from seed 1.
pub fn whole_model_stage(cfg: &LlamaConfig, opts: &StageOptions) -> (StageGraphs, Env) {
    let spec = split_layers(cfg.num_hidden_layers, 1, None).unwrap().remove(0);
    let sg = stage_graphs(&build_stage(cfg, &spec, opts).unwrap(), &RecomputePolicy::SaveAll).unwrap();
    let mut env = Env::new();
    for (name, shape, data) in init_parameters(cfg, &spec, 0) {
        env.insert(name, Tensor::from_vec(data, shape, &candle_core::Device::Cpu).unwrap());
    }
    for (name, shape, data) in stage_buffers(cfg, opts.seq) {
        env.insert(name, tensor_from_f64(&data, &shape, DType::F32).unwrap());
    }
    let mut rng = Rng::new(1);
    for name in ["tokens", "targets"] {
        let ids: Vec<u32> =
            (0..opts.batch * opts.seq).map(|_| rng.below(cfg.vocab_size as u64) as u32).collect();
        env.insert(name.into(), tensor_u32(&ids, &[opts.batch, opts.seq]).unwrap());
    }
    (sg, env)
}
