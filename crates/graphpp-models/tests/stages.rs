//! Stage split and stage graphs of the Llama-style model.

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
        graphpp_graph::verify(&g).unwrap();
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
