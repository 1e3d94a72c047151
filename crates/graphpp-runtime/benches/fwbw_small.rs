//! One fw + full_bw of the `small` preset (all 8 layers on one stage, B=2, T=64, f32) on candle
//! CPU tensors, through the derived graphs. Run: `cargo bench -p graphpp-runtime --bench fwbw_small`.

use candle_core::Tensor;
use criterion::{criterion_group, criterion_main, Criterion};
use graphpp_graph::{stage_graphs, DType, RecomputePolicy};
use graphpp_models::rng::Rng;
use graphpp_models::{build_stage, init_parameters, split_layers, stage_buffers, LlamaConfig, StageOptions};
use graphpp_runtime::executor::{run_named, tensor_from_f64, tensor_u32, RunOptions};
use std::collections::HashMap;

fn bench(c: &mut Criterion) {
    let cfg = LlamaConfig::small();
    let opts = StageOptions::new(2, 64);
    let spec = split_layers(cfg.num_hidden_layers, 1, None).unwrap().remove(0);
    let sg = stage_graphs(&build_stage(&cfg, &spec, &opts).unwrap(), &RecomputePolicy::SaveAll).unwrap();
    let mut env: HashMap<String, Tensor> = HashMap::new();
    for (name, shape, data) in init_parameters(&cfg, &spec, 0) {
        env.insert(name, Tensor::from_vec(data, shape, &candle_core::Device::Cpu).unwrap());
    }
    for (name, shape, data) in stage_buffers(&cfg, opts.seq) {
        env.insert(name, tensor_from_f64(&data, &shape, DType::F32).unwrap());
    }
    let mut rng = Rng::new(1);
    let n = opts.batch * opts.seq;
    for name in ["tokens", "targets"] {
        let ids: Vec<u32> = (0..n).map(|_| rng.below(cfg.vocab_size as u64) as u32).collect();
        env.insert(name.into(), tensor_u32(&ids, &[opts.batch, opts.seq]).unwrap());
    }
    c.bench_function("small fw+full_bw (1 stage, B=2, T=64)", |b| {
        b.iter(|| {
            let f = run_named(&sg.fw, &env, &RunOptions::default()).unwrap();
            let mut e = env.clone();
            e.extend(sg.fw.output_names().into_iter().zip(f.outputs));
            run_named(&sg.full_bw, &e, &RunOptions::default()).unwrap()
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench
}
criterion_main!(benches);
