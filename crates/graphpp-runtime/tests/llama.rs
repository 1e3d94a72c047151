//! The derived stage graphs of the Llama-style model, executed: loss at init, dI + dW = full
//! backward, multiplexed = separate, recompute lowers peak memory, stages compose.

mod common;

use candle_core::Tensor;
use graphpp_graph::names::grad_of;
use graphpp_graph::passes::{multiplex_fw_bw, split_fsdp_collectives, Multiplex};
use graphpp_graph::MeshAxis;
use graphpp_graph::{stage_graphs, CommGroup, Graph, RecomputePolicy};
use graphpp_models::rng::Rng;
use graphpp_models::{
    build_stage, init_parameters, split_layers, stage_buffers, LlamaConfig, StageOptions, StageSpec,
};
use graphpp_runtime::exec::{run_named, RunOptions};
use graphpp_runtime::kernels::tensor::{tensor_from_f64, to_f64};
use std::collections::HashMap;

/// Parameters (seed 0), buffers, and random tokens / input / targets / output gradient.
fn stage_env(cfg: &LlamaConfig, spec: &StageSpec, opts: &StageOptions, seed: u64) -> HashMap<String, Tensor> {
    let mut env = HashMap::new();
    for (name, shape, data) in init_parameters(cfg, spec, 0) {
        let d: Vec<f64> = data.iter().map(|&x| x as f64).collect();
        env.insert(name, tensor_from_f64(&d, &shape, opts.dtype).unwrap());
    }
    for (name, shape, data) in stage_buffers(cfg, opts.seq) {
        env.insert(name, tensor_from_f64(&data, &shape, opts.dtype).unwrap());
    }
    let fw = build_stage(cfg, spec, opts).unwrap();
    let mut rng = Rng::new(seed);
    for s in fw.input_specs() {
        if !env.contains_key(&s.name) {
            env.insert(s.name.clone(), common::random_input(&s, &mut rng, -1.0, 1.0, cfg.vocab_size as u64));
        }
    }
    let d = [opts.batch, opts.seq, cfg.hidden_size];
    let g: Vec<f64> = (0..d.iter().product()).map(|_| rng.normal() * 1e-2).collect();
    env.insert(grad_of("output"), tensor_from_f64(&g, &d, opts.dtype).unwrap());
    env
}

fn outputs(g: &Graph, env: &HashMap<String, Tensor>) -> (HashMap<String, Tensor>, usize) {
    let r = run_named(g, env, &RunOptions::default()).unwrap();
    (g.output_names().into_iter().zip(r.outputs).collect(), r.peak_live_bytes)
}

fn spec(cfg: &LlamaConfig, stages: usize, stage: usize) -> StageSpec {
    split_layers(cfg.num_hidden_layers, stages, None).unwrap()[stage].clone()
}

#[test]
fn loss_at_init_is_near_ln_vocab() {
    let cfg = LlamaConfig::tiny();
    let opts = StageOptions::new(2, 16);
    let sp = spec(&cfg, 1, 0);
    let env = stage_env(&cfg, &sp, &opts, 1);
    let (o, _) = outputs(&build_stage(&cfg, &sp, &opts).unwrap(), &env);
    let loss = to_f64(&o["loss"]).unwrap()[0];
    let ln_v = (cfg.vocab_size as f64).ln();
    assert!((loss - ln_v).abs() < 0.1, "loss {loss} vs ln V {ln_v}");
}

#[test]
fn bw_di_then_bw_dw_give_exactly_the_full_bw_gradients() {
    let cfg = LlamaConfig::tiny();
    let opts = StageOptions::new(2, 8);
    for stage in [1, 3] {
        let sp = spec(&cfg, 4, stage);
        let sg = stage_graphs(&build_stage(&cfg, &sp, &opts).unwrap(), &RecomputePolicy::SaveAll).unwrap();
        let mut env = stage_env(&cfg, &sp, &opts, 2);
        let (fo, _) = outputs(&sg.fw, &env);
        env.extend(fo);
        let (full, _) = outputs(&sg.full_bw, &env);
        let (di, dw) = sg.di_dw.clone().expect("stages after the first split");
        let (dio, _) = outputs(&di, &env);
        env.extend(dio.clone());
        let (dwo, _) = outputs(&dw, &env);
        assert!(common::same(&dio[&grad_of("input")], &full[&grad_of("input")]), "stage {stage} grad.input");
        assert_eq!(dwo.len() + 1, full.len());
        for (name, g) in &dwo {
            assert!(common::same(g, &full[name]), "stage {stage} {name} differs");
        }
        let w = grad_of(&format!("model.layers.{stage}.mlp.down_proj.weight"));
        assert!(to_f64(&dwo[&w]).unwrap().iter().any(|x| *x != 0.0), "{w} is all zeros");
    }
}

#[test]
fn first_stage_has_no_di_dw_split() {
    let cfg = LlamaConfig::tiny();
    let sp = spec(&cfg, 4, 0);
    let sg =
        stage_graphs(&build_stage(&cfg, &sp, &StageOptions::new(1, 4)).unwrap(), &RecomputePolicy::SaveAll)
            .unwrap();
    assert!(sg.di_dw.is_none());
    assert!(!sg.full_bw.output_names().contains(&grad_of("input")));
    assert!(sg.full_bw.output_names().contains(&grad_of("model.embed_tokens.weight")));
}

#[test]
fn multiplexed_graph_gives_the_outputs_of_separate_runs() {
    let plain = StageOptions::new(2, 8);
    multiplex_case(&plain);
    // FSDP on a single-rank group: fw holds all-gathers, bw reduce-scatters (comm regions).
    multiplex_case(&StageOptions { fsdp: Some(CommGroup::new(MeshAxis::Fsdp, 1)), ..plain });
}

fn multiplex_case(opts: &StageOptions) {
    let cfg = LlamaConfig::tiny();
    let opts = opts.clone();
    let (sf, sb) = (spec(&cfg, 4, 1), spec(&cfg, 4, 2));
    let gf = stage_graphs(&build_stage(&cfg, &sf, &opts).unwrap(), &RecomputePolicy::SaveAll).unwrap();
    let gb = stage_graphs(&build_stage(&cfg, &sb, &opts).unwrap(), &RecomputePolicy::SaveAll).unwrap();
    let env_f = stage_env(&cfg, &sf, &opts, 3);
    let mut env_b = stage_env(&cfg, &sb, &opts, 4);
    let (fo_b, _) = outputs(&gb.fw, &env_b);
    env_b.extend(fo_b);
    let (sep_f, _) = outputs(&gf.fw, &env_f);
    let (sep_b, _) = outputs(&gb.full_bw, &env_b);
    for mode in [Multiplex::Concat, Multiplex::CommOverlap] {
        let m = multiplex_fw_bw(&gf.fw, &gb.full_bw, mode).unwrap();
        let mut env: HashMap<String, Tensor> =
            env_f.iter().map(|(k, v)| (format!("f.{k}"), v.clone())).collect();
        env.extend(env_b.iter().map(|(k, v)| (format!("b.{k}"), v.clone())));
        let (mo, _) = outputs(&m, &env);
        assert_eq!(mo.len(), sep_f.len() + sep_b.len());
        for (k, v) in &sep_f {
            assert!(common::same(&mo[&format!("f.{k}")], v), "{mode:?} f.{k}");
        }
        for (k, v) in &sep_b {
            assert!(common::same(&mo[&format!("b.{k}")], v), "{mode:?} b.{k}");
        }
    }
}

/// Peak live bytes of fw followed by full_bw (saved values are counted in both), bytes saved
/// between them, and the gradients.
fn fw_bw_peak(
    cfg: &LlamaConfig,
    sp: &StageSpec,
    opts: &StageOptions,
    policy: &RecomputePolicy,
) -> (usize, usize, HashMap<String, Tensor>) {
    let sg = stage_graphs(&build_stage(cfg, sp, opts).unwrap(), policy).unwrap();
    let env = stage_env(cfg, sp, opts, 5);
    let (fo, grads, pf, pb) = common::fw_then_bw(&sg.fw, &sg.full_bw, &env, &HashMap::new());
    let saved: usize = sg.saved.iter().map(|n| fo[n].elem_count() * 4).sum();
    (pf.max(pb), saved, grads)
}

#[test]
fn recompute_lowers_peak_live_bytes_and_keeps_gradients() {
    let cfg = LlamaConfig::tiny();
    // Enough tokens that activations, not the (always held) gradient outputs, dominate the peak.
    let opts = StageOptions::new(4, 64);
    let sp = spec(&cfg, 1, 0);
    let (p_all, s_all, g_all) = fw_bw_peak(&cfg, &sp, &opts, &RecomputePolicy::SaveAll);
    let (p_ck, s_ck, g_ck) =
        fw_bw_peak(&cfg, &sp, &opts, &RecomputePolicy::Checkpoints(graphpp_models::layer_checkpoints(&sp)));
    let (p_in, s_in, g_in) = fw_bw_peak(&cfg, &sp, &opts, &RecomputePolicy::SaveStageInputs);
    eprintln!(
        "tiny, 1 stage of 4 layers, B=4 T=64 — peak live bytes fw+full_bw / saved bytes: \
         save-all {p_all}/{s_all}, layer checkpoints {p_ck}/{s_ck}, stage inputs only {p_in}/{s_in}"
    );
    assert!(p_ck < p_all / 2, "layer checkpoints should lower the peak: {p_ck} vs {p_all}");
    // Recomputing the whole stage at once frees memory between fw and bw, not inside them.
    assert!(p_in <= p_all, "full recompute raised the peak: {p_in} vs {p_all}");
    assert!(s_ck < s_all / 4 && s_in == 0, "saved bytes: {s_all}, {s_ck}, {s_in}");
    for (k, g) in &g_all {
        assert!(common::rel_err(&g_ck[k], g, 1e-12) < 1e-6, "{k} differs after recompute");
        assert!(common::rel_err(&g_in[k], g, 1e-12) < 1e-6, "{k} differs after full recompute");
    }
}

#[test]
fn two_stages_compose_to_the_single_stage_loss_and_gradients() {
    let cfg = LlamaConfig::tiny();
    let opts = StageOptions::new(2, 8);
    let one = spec(&cfg, 1, 0);
    let s = split_layers(cfg.num_hidden_layers, 2, Some(&[3, 1])).unwrap();
    let g1 = stage_graphs(&build_stage(&cfg, &one, &opts).unwrap(), &RecomputePolicy::SaveAll).unwrap();
    let env1 = stage_env(&cfg, &one, &opts, 6);
    let (f1, b1, _, _) = common::fw_then_bw(&g1.fw, &g1.full_bw, &env1, &HashMap::new());
    // Stage 0 then stage 1, handing the activation forward and its gradient back.
    let (ga, gb) = (
        stage_graphs(&build_stage(&cfg, &s[0], &opts).unwrap(), &RecomputePolicy::SaveAll).unwrap(),
        stage_graphs(&build_stage(&cfg, &s[1], &opts).unwrap(), &RecomputePolicy::SaveAll).unwrap(),
    );
    let mut env_a = stage_env(&cfg, &s[0], &opts, 0);
    env_a.insert("tokens".into(), env1["tokens"].clone());
    let (fa, _) = outputs(&ga.fw, &env_a);
    let mut env_b = stage_env(&cfg, &s[1], &opts, 0);
    env_b.insert("input".into(), fa["output"].clone());
    env_b.insert("targets".into(), env1["targets"].clone());
    let (fb, bb, _, _) = common::fw_then_bw(&gb.fw, &gb.full_bw, &env_b, &HashMap::new());
    env_a.extend(fa);
    env_a.insert(grad_of("output"), bb[&grad_of("input")].clone());
    let (ba, _) = outputs(&ga.full_bw, &env_a);
    assert!(common::rel_err(&fb["loss"], &f1["loss"], 1e-12) < 1e-6);
    let mut n = 0;
    for (k, g) in ba.iter().chain(bb.iter().filter(|(k, _)| *k != &grad_of("input"))) {
        assert!(common::rel_err(g, &b1[k], 1e-12) < 1e-5, "{k}: {}", common::rel_err(g, &b1[k], 1e-12));
        n += 1;
    }
    assert_eq!(n, b1.len());
}

#[test]
fn fsdp_graphs_on_a_single_rank_group_give_the_plain_gradients() {
    let cfg = LlamaConfig::tiny();
    let sp = spec(&cfg, 2, 1);
    let plain = StageOptions::new(1, 8);
    let fsdp = StageOptions { fsdp: Some(CommGroup::new(MeshAxis::Fsdp, 1)), ..plain.clone() };
    let gp = stage_graphs(&build_stage(&cfg, &sp, &plain).unwrap(), &RecomputePolicy::SaveAll).unwrap();
    let gs = stage_graphs(&build_stage(&cfg, &sp, &fsdp).unwrap(), &RecomputePolicy::SaveAll).unwrap();
    let split = split_fsdp_collectives(&gs.fw, &gs.full_bw).unwrap();
    let mut env = stage_env(&cfg, &sp, &plain, 8);
    let (_, want, _, _) = common::fw_then_bw(&gp.fw, &gp.full_bw, &env, &HashMap::new());
    let (un, _) = outputs(&split.unshard, &env);
    env.extend(un);
    let (fo, _) = outputs(&split.fw, &env);
    env.extend(fo);
    let (bo, _) = outputs(&split.bw, &env);
    env.extend(bo);
    let (rg, _) = outputs(&split.reduce_grad, &env);
    assert_eq!(rg.len(), want.len() - 1, "every parameter gradient goes through reduce_grad");
    for (k, g) in &rg {
        assert!(common::same(g, &want[k]), "{k}");
    }
}

#[test]
fn bf16_forward_runs_and_stays_close_to_f32() {
    let cfg = LlamaConfig::tiny();
    let sp = spec(&cfg, 1, 0);
    let f32o = StageOptions::new(2, 16);
    let bf = StageOptions { dtype: graphpp_graph::DType::BF16, ..f32o.clone() };
    let loss = |opts: &StageOptions| {
        let env = stage_env(&cfg, &sp, opts, 9);
        let (o, _) = outputs(&build_stage(&cfg, &sp, opts).unwrap(), &env);
        to_f64(&o["loss"]).unwrap()[0]
    };
    let (a, b) = (loss(&f32o), loss(&bf));
    // bf16 keeps 8 significant bits: the loss itself is quantised in steps of 1/32 near 5.5, and
    // sums of 32 token losses accumulate a few such steps.
    assert!(b.is_finite() && (a - b).abs() < 0.1, "f32 loss {a}, bf16 loss {b}");
    assert!(a != b, "the bf16 graph did not run in bf16");
}
