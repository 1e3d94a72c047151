//! Stage split and stage graphs of the Llama-style model.

use graphpp_graph::names::grad_of;
use graphpp_graph::print::{render, stats, Format};
use graphpp_graph::{GraphKind, InputKind, Op, RecomputePolicy};
use graphpp_models::{
    build_stage, split_layers, stage_graph_set, stage_parameters, LlamaConfig, ModelError, StageOptions,
};

#[test]
fn even_and_uneven_splits() {
    let s = split_layers(12, 4, None).unwrap();
    let ranges: Vec<_> = s.iter().map(|x| x.layers.clone()).collect();
    assert_eq!(ranges, vec![0..3, 3..6, 6..9, 9..12]);
    // Layers that do not divide into the stages need an explicit split; the error suggests one.
    match split_layers(10, 4, None) {
        Err(ModelError::Split(msg)) => assert!(msg.contains("--layers-per-stage (e.g. 3,3,2,2)"), "{msg}"),
        other => panic!("{other:?}"),
    }
    let s = split_layers(10, 4, Some(&[3, 3, 2, 2])).unwrap();
    assert_eq!(s[3].layers, 8..10);
    let s = split_layers(8, 3, Some(&[4, 3, 1])).unwrap();
    assert_eq!(s[2].layers, 7..8);
    assert!(s[0].is_first() && s[2].is_last() && !s[1].is_first() && !s[1].is_last());
    assert!(matches!(split_layers(8, 3, Some(&[4, 3])), Err(ModelError::Split(_))));
    assert!(matches!(split_layers(8, 3, Some(&[4, 3, 2])), Err(ModelError::Split(_))));
    assert!(matches!(split_layers(2, 3, None), Err(ModelError::Split(_))));
    match split_layers(4, 2, Some(&[4, 0])) {
        Err(ModelError::Split(m)) => assert!(m.contains("stage 1 holds no decoder layer"), "{m}"),
        other => panic!("{other:?}"),
    }
}

/// More stages than layers: no split can work, so the message says so instead of suggesting one
/// with an empty stage (`1,1,1,1,0`, which the split then rejected).
#[test]
fn more_stages_than_layers_says_so() {
    for (layers, stages, want) in
        [(4, 5, "5 stages exceed the model's 4 decoder layers"), (1, 2, "model's 1 decoder layer ")]
    {
        match split_layers(layers, stages, None) {
            Err(ModelError::Split(m)) => {
                assert!(m.contains(want) && !m.contains("--layers-per-stage"), "{m}");
                assert!(!m.contains(",0"), "no suggestion with an empty stage: {m}");
            }
            other => panic!("{other:?}"),
        }
    }
    // Every suggestion the split makes is a split it accepts.
    for layers in 1..12 {
        for stages in 1..=layers {
            if let Err(ModelError::Split(m)) = split_layers(layers, stages, None) {
                let hint = m.split("(e.g. ").nth(1).and_then(|h| h.split(')').next()).expect("a suggestion");
                let counts: Vec<usize> = hint.split(',').map(|c| c.parse().unwrap()).collect();
                assert!(split_layers(layers, stages, Some(&counts)).is_ok(), "{layers} into {stages}: {m}");
            }
        }
    }
}

/// A graph holds shapes only: building one for T = 100000 allocates nothing of size T² (the mask
/// values were once computed just to read their shape, 80 GB), and T beyond the model's
/// positions is an error naming both numbers.
#[test]
fn long_sequences_are_checked_not_allocated() {
    let cfg = LlamaConfig { max_position_embeddings: 1_000_000, ..LlamaConfig::tiny() };
    let spec = &split_layers(4, 1, None).unwrap()[0];
    let g = build_stage(&cfg, spec, &StageOptions::new(1, 100_000)).unwrap();
    assert!(g.nodes.len() > 100);
    let e = build_stage(&LlamaConfig::tiny(), spec, &StageOptions::new(1, 100_000)).unwrap_err();
    assert!(
        matches!(&e, ModelError::Shape(m) if m.contains("T=100000") && m.contains("max_position_embeddings 512")),
        "{e}"
    );
    let e = build_stage(&LlamaConfig::tiny(), spec, &StageOptions::new(0, 8)).unwrap_err();
    assert!(matches!(e, ModelError::Shape(_)), "{e}");
}

#[test]
fn stage_interfaces_follow_the_convention() {
    let cfg = LlamaConfig::tiny();
    let opts = StageOptions::new(2, 8);
    let specs = split_layers(4, 4, None).unwrap();
    let first = build_stage(&cfg, &specs[0], &opts).unwrap();
    let mid = build_stage(&cfg, &specs[1], &opts).unwrap();
    let last = build_stage(&cfg, &specs[3], &opts).unwrap();
    let kinds =
        |g: &graphpp_graph::Graph| g.input_specs().into_iter().map(|s| (s.name, s.kind)).collect::<Vec<_>>();
    assert_eq!(kinds(&first)[0], ("model.embed_tokens.weight".into(), InputKind::Parameter));
    assert_eq!(kinds(&first).last().unwrap(), &("tokens".to_string(), InputKind::Activation));
    assert_eq!(kinds(&mid).last().unwrap(), &("input".to_string(), InputKind::Activation));
    assert_eq!(kinds(&last).last().unwrap(), &("targets".to_string(), InputKind::Target));
    assert_eq!(first.output_names(), vec!["output"]);
    assert_eq!(last.output_names(), vec!["loss"]);
    assert_eq!(last.node(last.outputs[0].value).ty.shape, Vec::<usize>::new());
    // Parameter count of the whole model = sum over stages.
    let total: usize =
        specs.iter().flat_map(|s| stage_parameters(&cfg, s)).map(|(_, s)| s.iter().product::<usize>()).sum();
    let (d, f, v, l) = (64, 176, 256, 4);
    assert_eq!(total, 2 * v * d + l * (4 * d * d + 3 * d * f + 2 * d) + d);
}

#[test]
fn show_selects_each_graph_and_the_first_stage_has_no_split() {
    let cfg = LlamaConfig::tiny();
    let opts = StageOptions::new(1, 4);
    let sg = stage_graph_set(&cfg, 4, 1, None, &opts, &RecomputePolicy::SaveAll).unwrap();
    for k in ["fw", "full_bw", "bw_di", "bw_dw", "overlap"] {
        let g = sg.select(k.parse::<GraphKind>().unwrap()).unwrap();
        graphpp_graph::check_graph(&g).unwrap();
        assert!(render(&g, Format::Text).lines().count() == g.nodes.len() + 3); // header, nodes, return, closing brace
        assert!(stats(&g).contains("matmul FLOPs"));
    }
    let s0 = stage_graph_set(&cfg, 4, 0, None, &opts, &RecomputePolicy::SaveAll).unwrap();
    assert!(s0.select(GraphKind::BwDi).is_err());
    assert!("bw".parse::<GraphKind>().is_err());
    assert!(matches!(
        stage_graph_set(&cfg, 4, 4, None, &opts, &RecomputePolicy::SaveAll),
        Err(ModelError::Split(_))
    ));
    // Text form of a q_proj matmul in the documented format.
    let text = render(&sg.fw, Format::Text);
    assert!(text.lines().any(|l| l.contains("= matmul(") && l.ends_with(": f32[4,64]  # model.layers.1.self_attn.q_proj")), "{text}");
    assert!(sg.fw.nodes.iter().any(|n| matches!(n.op, Op::Matmul)));
}

/// Shapes of the parameters of a model with every HF Llama option graphpp implements.
fn options_config() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 32,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: Some(6),
        attention_bias: true,
        mlp_bias: true,
        tie_word_embeddings: true,
        ..LlamaConfig::tiny()
    }
}

#[test]
fn head_dim_and_biases_set_the_projection_shapes() {
    let cfg = options_config();
    let spec = &split_layers(2, 1, None).unwrap()[0];
    let p: std::collections::HashMap<String, Vec<usize>> = stage_parameters(&cfg, spec).into_iter().collect();
    let l = "model.layers.1";
    // q_proj out = heads·head_dim = 24 (≠ hidden 16); o_proj in = 24; k/v out = kv·head_dim = 12.
    assert_eq!(p[&format!("{l}.self_attn.q_proj.weight")], vec![24, 16]);
    assert_eq!(p[&format!("{l}.self_attn.k_proj.weight")], vec![12, 16]);
    assert_eq!(p[&format!("{l}.self_attn.v_proj.weight")], vec![12, 16]);
    assert_eq!(p[&format!("{l}.self_attn.o_proj.weight")], vec![16, 24]);
    assert_eq!(p[&format!("{l}.self_attn.q_proj.bias")], vec![24]);
    assert_eq!(p[&format!("{l}.self_attn.k_proj.bias")], vec![12]);
    assert_eq!(p[&format!("{l}.self_attn.o_proj.bias")], vec![16]);
    assert_eq!(p[&format!("{l}.mlp.gate_proj.bias")], vec![24]);
    assert_eq!(p[&format!("{l}.mlp.down_proj.bias")], vec![16]);
    // 9 matrices/norms + 7 biases per layer, embedding, final norm; tied: no lm_head.
    assert_eq!(p.len(), 2 * 16 + 2);
    assert!(!p.contains_key("lm_head.weight"));
    let untied = LlamaConfig { attention_bias: false, mlp_bias: false, tie_word_embeddings: false, ..cfg };
    let q: Vec<String> = stage_parameters(&untied, spec).into_iter().map(|(n, _)| n).collect();
    assert!(q.iter().all(|n| !n.ends_with(".bias")) && q.contains(&"lm_head.weight".to_string()));
}

#[test]
fn tied_embeddings_the_last_stage_holds_a_copy_named_like_the_embedding() {
    let cfg = options_config();
    let specs = split_layers(2, 2, None).unwrap();
    let names = |s| stage_parameters(&cfg, &specs[s]).into_iter().map(|(n, _)| n).collect::<Vec<_>>();
    assert_eq!(names(0)[0], "model.embed_tokens.weight");
    assert_eq!(names(1).last().unwrap(), "model.embed_tokens.weight");
    assert!(!names(1).contains(&"lm_head.weight".to_string()));
    // On one stage the LM head reads the embedding input itself: one parameter, used twice.
    let opts = StageOptions::new(1, 4);
    let g = build_stage(&cfg, &split_layers(2, 1, None).unwrap()[0], &opts).unwrap();
    let embeds = g.input_specs().into_iter().filter(|s| s.name == "model.embed_tokens.weight").count();
    assert_eq!(embeds, 1);
    let last = build_stage(&cfg, &specs[1], &opts).unwrap();
    assert!(last.input_by_name("model.embed_tokens.weight").is_some());
    assert!(last.input_by_name("lm_head.weight").is_none());
}

#[test]
fn init_is_hf_style_biases_zero_norms_one_matrices_initializer_range() {
    let cfg = LlamaConfig { initializer_range: 0.5, ..options_config() };
    let spec = &split_layers(2, 1, None).unwrap()[0];
    for (name, _, data) in graphpp_models::init_parameters(&cfg, spec, 3) {
        if name.ends_with(".bias") {
            assert!(data.iter().all(|&x| x == 0.0), "{name}");
        } else if name.ends_with("norm.weight") {
            assert!(data.iter().all(|&x| x == 1.0), "{name}");
        } else {
            let sd = (data.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / data.len() as f64).sqrt();
            assert!((sd - 0.5).abs() < 0.1, "{name}: sd {sd}");
        }
    }
}

/// bf16 mixed precision, read off the graph: f32 parameter inputs each cast to bf16 (the
/// embedding after its gather), bf16 matmuls and stage output, f32 RMSNorm reduction, attention
/// softmax and loss; the derived backward returns f32 parameter gradients and a bf16 input
/// gradient. f32 options build exactly the graph they built before (no cast node).
#[test]
fn bf16_stage_graphs_say_where_precision_changes() {
    use graphpp_graph::{stage_graphs, DType, UnaryOp};
    let cfg = LlamaConfig::tiny();
    let specs = split_layers(4, 2, None).unwrap();
    let opts = StageOptions::mixed(2, 8, DType::BF16);
    assert_eq!(opts.parameter_dtype(), DType::F32);
    let first = build_stage(&cfg, &specs[0], &opts).unwrap();
    let last = build_stage(&cfg, &specs[1], &opts).unwrap();
    for g in [&first, &last] {
        for s in g.input_specs() {
            let want = match s.kind {
                InputKind::Parameter => DType::F32,
                InputKind::Buffer => DType::BF16,
                _ if s.name == "input" => DType::BF16,
                _ => DType::U32,
            };
            assert_eq!(s.ty.dtype, want, "{}: {}", g.name, s.name);
        }
        for n in &g.nodes {
            let d = n.ty.dtype;
            match &n.op {
                Op::Matmul => assert_eq!(d, DType::BF16, "{} matmul", n.meta.scope),
                Op::Sum { .. } | Op::Max { .. } | Op::Unary { .. } if n.meta.scope.ends_with("layernorm") => {
                    assert_eq!(d, DType::F32, "{} {}", n.meta.scope, n.op.mnemonic())
                }
                Op::Unary { .. } | Op::Sum { .. } | Op::Max { .. } if n.meta.scope == "model.norm" => {
                    assert_eq!(d, DType::F32)
                }
                // Its products in bf16, its softmax in f32 (the mask it adds is f32).
                Op::Attention { .. } => {
                    assert_eq!(d, DType::BF16, "attention in {}", n.meta.scope);
                    assert_eq!(g.node(n.inputs[3]).ty.dtype, DType::F32, "mask in {}", n.meta.scope)
                }
                Op::Softmax { .. } | Op::Unary { f: UnaryOp::Exp } | Op::Sum { .. } | Op::Max { .. }
                    if n.meta.scope.ends_with("self_attn") =>
                {
                    assert_eq!(d, DType::F32, "softmax in {}", n.meta.scope)
                }
                _ if n.meta.scope.starts_with("loss") && d != DType::U32 => {
                    assert_eq!(d, DType::F32, "loss {}", n.op.mnemonic())
                }
                _ => {}
            }
        }
    }
    // 1 embedding cast + 9 per layer (7 weights + 2 norms) + 1 per RMSNorm down and 1 up +
    // 1 per attention (the mask up: the node runs its softmax in f32); last stage: + final
    // norm weight, lm_head, norm casts and the logits cast.
    let casts = |g: &graphpp_graph::Graph| g.nodes.iter().filter(|n| matches!(n.op, Op::Cast { .. })).count();
    assert_eq!(casts(&first), 1 + 2 * (9 + 4 + 1));
    assert_eq!(casts(&last), 2 * (9 + 4 + 1) + 2 + 2 + 1);
    let dtype_of = |g: &graphpp_graph::Graph, name: &str| g.node(g.output_by_name(name).unwrap()).ty.dtype;
    assert_eq!(dtype_of(&first, "output"), DType::BF16);
    assert_eq!(dtype_of(&last, "loss"), DType::F32);
    let logits = build_stage(&cfg, &specs[1], &StageOptions { logits: true, ..opts.clone() }).unwrap();
    assert_eq!(dtype_of(&logits, "logits"), DType::F32);
    let bw = stage_graphs(&last, &RecomputePolicy::SaveAll).unwrap().full_bw;
    for name in bw.output_names() {
        let want = if name == grad_of("input") { DType::BF16 } else { DType::F32 };
        assert_eq!(dtype_of(&bw, &name), want, "{name}");
    }
    // Saved activations are bf16 but for the f32 islands (norm statistics, softmax, loss).
    let saved: Vec<_> = bw.input_specs().into_iter().filter(|s| s.kind == InputKind::Saved).collect();
    let bf = saved.iter().filter(|s| s.ty.dtype == DType::BF16).count();
    assert!(bf * 2 > saved.len(), "{bf} of {} saved values are bf16", saved.len());

    let f32o = StageOptions::new(2, 8);
    assert_eq!(StageOptions::mixed(2, 8, DType::F32), f32o);
    let plain = build_stage(&cfg, &specs[1], &f32o).unwrap();
    assert_eq!(casts(&plain), 0);
    assert!(plain.nodes.iter().all(|n| matches!(n.ty.dtype, DType::F32 | DType::U32)));
}

/// What W holds from I to W (its non-state inputs: the stash and the stage's saved values it
/// reads) is chosen by a minimum cut: under every recompute policy it is no more than under
/// save-all, on tiny and small (an earlier split held 1,097,728 bytes under
/// `layers` against 876,544 under save-all on tiny's stage 1 of 2); W runs no forward matmul —
/// its matmul FLOPs are the weight gradients' alone, the same under every policy.
#[test]
fn w_holds_no_more_than_under_save_all_and_runs_no_forward_matmul() {
    use graphpp_graph::Phase;
    use graphpp_models::Recompute;
    for cfg in [LlamaConfig::tiny(), LlamaConfig::small()] {
        let opts = StageOptions::new(2, 64);
        let specs = split_layers(cfg.num_hidden_layers, 2, None).unwrap();
        let held = |policy: Recompute| {
            let g = graphpp_graph::stage_graphs(
                &build_stage(&cfg, &specs[1], &opts).unwrap(),
                &policy.policy(&specs[1]),
            )
            .unwrap();
            let (_, dw) = g.di_dw.expect("a later stage splits");
            assert!(
                dw.nodes.iter().all(|n| !matches!(n.op, Op::Matmul) || n.meta.phase == Phase::Backward),
                "{policy:?}: a forward matmul in bw_dw"
            );
            let bytes: usize = dw
                .input_specs()
                .iter()
                .filter(|i| !matches!(i.kind, InputKind::Parameter | InputKind::Buffer))
                .map(|i| i.ty.size_bytes())
                .sum();
            (bytes, dw.matmul_flops())
        };
        // Each matmul of full_bw runs exactly once, in I or in W.
        for policy in [Recompute::SaveAll, Recompute::Layers, Recompute::Matmuls, Recompute::StageInputs] {
            let g = graphpp_graph::stage_graphs(
                &build_stage(&cfg, &specs[1], &opts).unwrap(),
                &policy.policy(&specs[1]),
            )
            .unwrap();
            let (di, dw) = g.di_dw.as_ref().unwrap();
            assert_eq!(di.matmul_flops() + dw.matmul_flops(), g.full_bw.matmul_flops(), "{policy:?}");
        }
        let (save_all, flops) = held(Recompute::SaveAll);
        for policy in [Recompute::Layers, Recompute::Matmuls, Recompute::StageInputs] {
            let (bytes, f) = held(policy);
            assert!(
                bytes <= save_all,
                "{} {policy:?}: W holds {bytes} bytes, save-all {save_all}",
                cfg.hidden_size
            );
            assert_eq!(f, flops, "{policy:?}: W's matmuls are the weight gradients'");
        }
    }
}
