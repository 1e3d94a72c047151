//! The MoE decoder pipelined: one step's loss and every gradient (gate, every expert, shared
//! experts) under 1F1B, ZB-V and DualPipeV — with and without data parallelism — equal the
//! single-device step within 1e-5 relative in f32, routing included (the choice of experts of a
//! token does not depend on how the batch is split into microbatches or stages).

use std::time::Duration;

use graphpp_graph::names::grad_of;
use graphpp_models::MoeConfig;
use graphpp_runtime::kernels::tensor::to_f64;
use graphpp_runtime::verify::{compare, pipelined_step, single_device_step, verify_step, TOLERANCE};
use graphpp_runtime::VerifySetup;
use graphpp_schedule::{Kind, Shape};

/// `moe-tiny` shrunk for a debug build: 4 layers (1 dense, 3 MoE), 4 experts, 2 per token.
fn model() -> MoeConfig {
    let mut m = MoeConfig::tiny();
    m.base.hidden_size = 16;
    m.base.intermediate_size = 24;
    m.base.num_attention_heads = 2;
    m.base.vocab_size = 32;
    m.n_routed_experts = 4;
    m.moe_intermediate_size = 8;
    m
}

/// `s` with `dp` replicas and expert-parallel degree `ep`, seed 3 and a 30 s RECV bound.
fn layout(mut s: VerifySetup, dp: usize, ep: usize) -> VerifySetup {
    (s.train.dp, s.train.ep, s.train.seed) = (dp, ep, 3);
    s.train.timeout = Duration::from_secs(30);
    s
}

#[test]
fn moe_pipelined_step_equals_one_device() {
    for (kind, shape, dp) in [
        (Kind::OneFOneB, Shape::new(2, 1, 4), 1),
        (Kind::Zbv, Shape::new(2, 2, 4), 1),
        (Kind::DualPipeV, Shape::new(2, 2, 4), 1),
        (Kind::DualPipeV, Shape::new(2, 2, 4), 2),
    ] {
        let mut s = VerifySetup::new(model(), kind, shape, 8, 8);
        s.train.seed = 3;
        s.train.timeout = Duration::from_secs(30);
        s.train.dp = dp;
        let pipelined = pipelined_step(&s).unwrap_or_else(|e| panic!("{kind} dp={dp}: {e}"));
        let one = single_device_step(&s).unwrap();
        let r = compare(&pipelined, &one).unwrap();
        assert!(r.passes(TOLERANCE), "{kind} dp={dp}: {r:?}");
        // Every expert of every MoE layer got tokens (a non-zero gradient): the comparison covers
        // all of them.
        let experts: Vec<_> = one
            .grads
            .iter()
            .filter(|(k, _)| k.contains(".experts.") && k.ends_with("down_proj.weight"))
            .collect();
        assert_eq!(experts.len(), 3 * 4, "{kind}");
        for (k, g) in experts {
            let max = to_f64(g).unwrap().iter().fold(0.0f64, |m, x| m.max(x.abs()));
            assert!(max > 0.0, "{kind}: {k} got no token");
        }
    }
}

/// The sequence-wise auxiliary balance loss (α = 0.05) is part of the objective: its gradient
/// reaches the gates of every stage scaled as the loss is (1/m per microbatch), so the pipelined
/// step — with and without expert parallelism — equals the single-device step within 1e-5
/// relative, and differs from the step without it (the gates' gradients change).
#[test]
fn aux_loss_gradients_are_pipelined_exactly() {
    let setup = |alpha: f64, kind: Kind, shape: Shape, dp: usize, ep: usize| {
        layout(VerifySetup::new(MoeConfig { aux_loss_alpha: alpha, ..model() }, kind, shape, 8, 8), dp, ep)
    };
    for (kind, shape, dp, ep) in
        [(Kind::OneFOneB, Shape::new(2, 1, 4), 1, 1), (Kind::DualPipeV, Shape::new(2, 2, 4), 2, 2)]
    {
        let r = verify_step(&setup(0.05, kind, shape, dp, ep)).unwrap_or_else(|e| panic!("{kind}: {e}"));
        assert!(r.passes(TOLERANCE), "{kind} dp={dp} ep={ep}: {r:?}");
    }
    let s = |alpha| setup(alpha, Kind::OneFOneB, Shape::new(2, 1, 4), 1, 1);
    let (with, without) = (single_device_step(&s(0.05)).unwrap(), single_device_step(&s(0.0)).unwrap());
    assert_eq!(with.loss.to_bits(), without.loss.to_bits(), "the reported loss is the cross-entropy");
    let gate = &grad_of("model.layers.2.mlp.gate.weight");
    let (a, b) = (to_f64(&with.grads[gate]).unwrap(), to_f64(&without.grads[gate]).unwrap());
    let scale = b.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let diff = a.iter().zip(&b).fold(0.0f64, |m, (x, y)| m.max((x - y).abs())) / scale;
    assert!(diff > 1e-3, "the aux loss must change the gate's gradient: {diff}");
}

/// Expert parallelism (`ep` replicas share each layer's routed experts and exchange tokens by
/// all-to-all): the step's loss and every gradient — each expert's gathered from the one
/// replica block holding it — equal the single-device step within 1e-5 relative, under 1F1B,
/// ZB-V and DualPipeV (whose overlapped F&B runs the dispatch and combine of two microbatches
/// in one graph); dp 4 with ep 2 also reduces each expert's gradient over its two holders.
#[test]
fn expert_parallel_step_equals_one_device() {
    let m = model();
    let params = graphpp_models::Model::stage_parameters(&m, &graphpp_models::StageSpec::whole(4)).len();
    for (kind, shape, dp, ep) in [
        (Kind::OneFOneB, Shape::new(2, 1, 4), 2, 2),
        (Kind::Zbv, Shape::new(2, 2, 4), 2, 2),
        (Kind::DualPipeV, Shape::new(2, 2, 4), 2, 2),
        (Kind::OneFOneB, Shape::new(2, 1, 2), 4, 2),
        (Kind::DualPipeV, Shape::new(2, 2, 4), 2, 1),
    ] {
        let s = layout(VerifySetup::new(model(), kind, shape, 8, 8), dp, ep);
        let r = verify_step(&s).unwrap_or_else(|e| panic!("{kind} dp={dp} ep={ep}: {e}"));
        assert!(r.passes(TOLERANCE), "{kind} dp={dp} ep={ep}: {r:?}");
        assert_eq!(r.gradients, params, "{kind} dp={dp} ep={ep}: every parameter compared");
    }
}

/// What expert parallelism cannot be given is refused before a step, naming the flag.
#[test]
fn bad_expert_parallel_degrees_are_refused() {
    let setup = |dp, ep, fsdp| {
        let mut s = VerifySetup::new(model(), Kind::OneFOneB, Shape::new(2, 1, 2), 12, 8);
        (s.train.dp, s.train.ep, s.train.fsdp) = (dp, ep, fsdp);
        s
    };
    for (s, says) in [
        (setup(2, 4, false), "must divide the data-parallel degree dp = 2"),
        (setup(3, 3, false), "4 routed experts do not split evenly over an expert-parallel degree of 3"),
        (setup(2, 2, true), "expert parallelism with FSDP is not implemented"),
        (
            {
                let mut s = VerifySetup::new(model().base, Kind::OneFOneB, Shape::new(2, 1, 2), 12, 8);
                (s.train.dp, s.train.ep) = (2, 2);
                s
            },
            "expert parallelism needs a mixture-of-experts model",
        ),
    ] {
        let e = verify_step(&s).unwrap_err().to_string();
        assert!(e.contains(says) && e.contains(&format!("--ep {}", s.train.ep)), "{e}");
    }
}
