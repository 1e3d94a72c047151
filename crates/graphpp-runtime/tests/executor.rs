//! Executor behaviour: frees values after their last use (exact peak), per-node times, kernels
//! without gradients (top-k, eq), and typed errors for bad inputs and multi-rank collectives.

use graphpp_graph::{CollectiveKind, CommGroup, DType, GraphBuilder, InputKind, TensorType};
use graphpp_runtime::executor::{run, tensor_from_f64, tensor_u32, to_f64, ExecError, RunOptions};

#[test]
fn values_are_freed_after_their_last_use() {
    // x → exp → neg: x dies when exp has run, exp when neg has run. Peak = two live [1000] f32.
    let mut b = GraphBuilder::new("chain", DType::F32);
    let x = b.input("x", InputKind::Activation, vec![1000]).unwrap();
    let w = b.input("w", InputKind::Parameter, vec![1000]).unwrap();
    let y = b.exp(x).unwrap();
    let y = b.mul(y, w).unwrap();
    let z = b.neg(y).unwrap();
    b.output("z", z);
    let g = b.finish().unwrap();
    let data: Vec<f64> = (0..1000).map(|i| i as f64 * 1e-3).collect();
    let t = tensor_from_f64(&data, &[1000], DType::F32).unwrap();
    let r = run(&g, &[t.clone(), t.clone()], &RunOptions { time_nodes: true, trace_peak: true }).unwrap();
    assert_eq!(r.peak_live_bytes, 2 * 4000, "parameters are not counted; x freed after exp");
    assert_eq!(r.node_times.as_ref().unwrap().len(), g.nodes.len());
    // The peak is first reached while exp runs: its operand x is freed only after it.
    let live: Vec<usize> = r.live_at_peak.unwrap().iter().map(|v| v.0).collect();
    assert!(live.contains(&0) && live.contains(&2) && !live.contains(&3), "{live:?}");
    let out = to_f64(&r.outputs[0]).unwrap();
    assert!((out[500] + (0.5f64).exp() * 0.5).abs() < 1e-5);

    // Keeping x alive to the end (x is also an output) raises the peak by one tensor.
    let mut b = GraphBuilder::new("keep", DType::F32);
    let x = b.input("x", InputKind::Activation, vec![1000]).unwrap();
    let y = b.exp(x).unwrap();
    let z = b.neg(y).unwrap();
    b.output("z", z);
    b.output("x", x);
    let g = b.finish().unwrap();
    let r = run(&g, &[t], &RunOptions::default()).unwrap();
    assert_eq!(r.peak_live_bytes, 3 * 4000);
    assert!(r.node_times.is_none());

    // A transposed weight is a view of the state: not counted.
    let mut b = GraphBuilder::new("state", DType::F32);
    let w = b.input("w", InputKind::Parameter, vec![10, 100]).unwrap();
    let x = b.input("x", InputKind::Activation, vec![1, 10]).unwrap();
    let wt = b.permute(w, vec![1, 0]).unwrap();
    let wtt = b.permute(wt, vec![1, 0]).unwrap();
    let y = b.matmul(x, wtt).unwrap();
    b.output("y", y);
    let g = b.finish().unwrap();
    let x = tensor_from_f64(&[1.0; 10], &[1, 10], DType::F32).unwrap();
    let w = tensor_from_f64(&[0.5; 1000], &[10, 100], DType::F32).unwrap();
    let r = run(&g, &[w, x], &RunOptions::default()).unwrap();
    assert_eq!(r.peak_live_bytes, 40 + 400);
    assert_eq!(to_f64(&r.outputs[0]).unwrap()[7], 5.0);
}

#[test]
fn topk_and_eq_kernels() {
    let mut b = GraphBuilder::new("k", DType::F32);
    let x = b.input("x", InputKind::Activation, vec![2, 5]).unwrap();
    let k = b.topk(x, 2).unwrap();
    let m = b.max(x, 1, true).unwrap();
    let e = b.eq(x, m).unwrap();
    b.output("k", k);
    b.output("e", e);
    let g = b.finish().unwrap();
    let data = [0.1, 0.9, -1.0, 0.5, 0.3, 2.0, -2.0, 1.0, 1.5, 0.0];
    let r = run(&g, &[tensor_from_f64(&data, &[2, 5], DType::F32).unwrap()], &RunOptions::default()).unwrap();
    assert_eq!(r.outputs[0].flatten_all().unwrap().to_vec1::<u32>().unwrap(), vec![1, 3, 0, 3]);
    assert_eq!(to_f64(&r.outputs[1]).unwrap(), vec![0., 1., 0., 0., 0., 1., 0., 0., 0., 0.]);
}

#[test]
fn bad_inputs_and_multi_rank_collectives_are_typed_errors() {
    let mut b = GraphBuilder::new("c", DType::F32);
    let x = b.input("x", InputKind::Activation, vec![2, 3]).unwrap();
    let g2 = CommGroup { name: "fsdp".into(), size: 2 };
    let y = b.collective(CollectiveKind::AllGather, &g2, 0, x).unwrap();
    b.output("y", y);
    let g = b.finish().unwrap();
    let ok = tensor_from_f64(&[0.0; 6], &[2, 3], DType::F32).unwrap();
    match run(&g, &[ok], &RunOptions::default()) {
        Err(ExecError::Collective { size: 2, group, .. }) => assert_eq!(group, "fsdp"),
        other => panic!("expected a collective error, got {other:?}"),
    }
    let wrong = tensor_u32(&[0; 6], &[2, 3]).unwrap();
    match run(&g, &[wrong], &RunOptions::default()) {
        Err(ExecError::Input { name, .. }) => assert_eq!(name, "x"),
        other => panic!("expected an input error, got {other:?}"),
    }
    assert!(matches!(run(&g, &[], &RunOptions::default()), Err(ExecError::Input { .. })));
    let _ = TensorType::new(DType::F32, vec![1]);
}
