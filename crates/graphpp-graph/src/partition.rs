//! Partition of a joint graph into `fw` and `full_bw` with explicit saved values, and the
//! recompute policy (activation checkpointing) (docs/ARCHITECTURE.md "Graph IR" → Partition).
//!
//! * `fw` keeps every input of the forward (the stage interface) and computes the user outputs
//!   plus one output `saved.<n>` per saved value.
//! * `full_bw` inputs, in order: the parameters, buffers, activation and targets it reads, the
//!   saved values, then the tangents; outputs: the `grad.*` outputs of the joint graph.
//! * Values derived only from parameters, buffers and constants (e.g. a transposed weight) are
//!   recomputed in the backward instead of saved: they do not depend on the microbatch.
//! * Collective results are saved, not recomputed (no extra communication in bw) — except a
//!   sequence-parallel all-gather of activations under a recomputing policy, which the backward
//!   runs again from the saved shard, as Megatron-LM does ([`regathered`]).

use crate::error::Result;
use crate::extract::{input_order, Extractor};
use crate::graph::{Graph, Phase, ValueId};
use crate::op::{CollectiveKind, InputKind, Op};
use serde::{Deserialize, Serialize};

/// Which forward values the backward may read from memory; the rest is recomputed.
#[derive(Clone, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecomputePolicy {
    /// Save every forward value the backward reads (no recomputation).
    #[default]
    SaveAll,
    /// Save every forward value the backward reads except the *pointwise* ones it can recompute
    /// inside its own pointwise ops: a unary, affine or binary value whose every backward reader
    /// is such an op of its shape, computed from inputs, values the backward reads anyway and
    /// other such values ([`pointwise_recomputable`]). The SwiGLU's `σ(g)` and `g · σ(g)`: the
    /// backward's fused groups recompute them from the saved `g` instead of reading two more
    /// `[B, T, F]` tensors (what PyTorch's min-cut partitioner of `torch.compile` recomputes). In
    /// f32; in other dtypes the backward runs them as ops of their own (less memory, more time).
    Pointwise,
    /// Save nothing but the stage inputs: the backward recomputes the whole forward it needs
    /// (full activation checkpointing of the stage).
    SaveStageInputs,
    /// Save matmul (and attention) outputs only; recompute the cheap elementwise and layout ops
    /// (selective).
    SaveMatmuls,
    /// Save values whose scope starts with one of these prefixes.
    SaveScopes(Vec<String>),
    /// Checkpoints: save only values whose scope is exactly one of these (e.g. the residual
    /// stream at each decoder layer, scope `model.layers.<l>`); everything between two
    /// checkpoints is recomputed just before the backward of that segment (Chen et al. 2016,
    /// "Training Deep Nets with Sublinear Memory Cost", §4).
    Checkpoints(Vec<String>),
}

impl RecomputePolicy {
    fn may_save(&self, g: &Graph, v: ValueId) -> bool {
        let n = g.node(v);
        match self {
            RecomputePolicy::SaveAll | RecomputePolicy::Pointwise => true,
            RecomputePolicy::SaveStageInputs => false,
            RecomputePolicy::SaveMatmuls => n.op.is_product(),
            RecomputePolicy::SaveScopes(prefixes) => {
                prefixes.iter().any(|p| n.meta.scope.starts_with(p.as_str()))
            }
            RecomputePolicy::Checkpoints(scopes) => scopes.contains(&n.meta.scope),
        }
    }
}

/// Result of [`partition`].
#[derive(Clone, Debug, PartialEq)]
pub struct FwBw {
    /// Forward graph: user outputs, then `saved.<n>` outputs.
    pub fw: Graph,
    /// Full backward graph.
    pub full_bw: Graph,
    /// Names of the saved values (fw outputs = bw inputs of kind `Saved`), in order.
    pub saved: Vec<String>,
}

/// How a forward value reaches the backward.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Route {
    Unneeded,
    Input,
    Saved,
    Clone,
}

/// Splits `joint` (from [`crate::autodiff::autodiff`], whose first `num_user_outputs` outputs are
/// the forward's) into `fw` and `full_bw` under `policy`. Errors: a malformed graph.
pub fn partition(joint: &Graph, num_user_outputs: usize, policy: &RecomputePolicy) -> Result<FwBw> {
    let is_bw = |v: ValueId| joint.node(v).meta.phase == Phase::Backward;
    let grad_outs = &joint.outputs[num_user_outputs..];
    let live = joint.ancestors(grad_outs.iter().map(|o| o.value));
    let param_only = param_derived(joint);
    let pointwise = match policy {
        RecomputePolicy::Pointwise => pointwise_recomputable(joint, &live),
        _ => vec![false; joint.nodes.len()],
    };
    let mut route = vec![Route::Unneeded; joint.nodes.len()];
    // Walk backward-needed values in reverse so every consumer is routed before its producer.
    for i in (0..joint.nodes.len()).rev() {
        let v = ValueId(i);
        let needed = live[i] && (is_bw(v) || route[i] != Route::Unneeded);
        if !needed {
            continue;
        }
        let n = joint.node(v);
        if !is_bw(v) && route[i] == Route::Unneeded {
            continue;
        }
        if is_bw(v) || route[i] == Route::Clone {
            for &x in &n.inputs {
                if is_bw(x) || route[x.0] != Route::Unneeded {
                    continue;
                }
                route[x.0] =
                    if pointwise[x.0] { Route::Clone } else { classify(joint, x, policy, &param_only) };
            }
        }
    }
    let saved: Vec<ValueId> =
        (0..joint.nodes.len()).map(ValueId).filter(|v| route[v.0] == Route::Saved).collect();
    let saved_names: Vec<String> = saved.iter().enumerate().map(|(k, _)| crate::names::saved(k)).collect();
    let fw = build_fw(joint, num_user_outputs, &saved, &saved_names)?;
    let full_bw = build_bw(joint, grad_outs, &route, &live, &saved, &saved_names)?;
    Ok(FwBw { fw, full_bw, saved: saved_names })
}

fn classify(g: &Graph, x: ValueId, policy: &RecomputePolicy, param_only: &[bool]) -> Route {
    let n = g.node(x);
    match n.op {
        Op::Input { .. } => Route::Input,
        Op::Full { .. } => Route::Clone,
        Op::CollectiveWait | Op::Reshape { .. } if regathered(g, x, policy) => Route::Clone,
        Op::CollectiveWait => Route::Saved,
        // Reached only from a wait that is recomputed: its start is recomputed with it.
        Op::CollectiveStart { .. } => Route::Clone,
        _ if param_only[x.0] => Route::Clone,
        _ if policy.may_save(g, x) => Route::Saved,
        _ => Route::Clone,
    }
}

/// Whether `x` — the wait of a sequence-parallel all-gather of activations (along axis 1 of a
/// `[B, T/tp, D]` value, over a group sharing one loss: `tp`), or a reshape of one (a projection reads its input as `[B·T, D]`) — is
/// gathered again in the backward from the saved shard instead of being saved whole: what
/// Megatron-LM does under sequence parallelism (Korthikanti et al. 2022, §4.2.2: only the shard
/// is kept), under every policy that recomputes (not [`RecomputePolicy::SaveAll`]). The backward
/// then runs the all-gather once more.
fn regathered(g: &Graph, x: ValueId, policy: &RecomputePolicy) -> bool {
    if *policy == RecomputePolicy::SaveAll {
        return false;
    }
    let mut x = x;
    while let Op::Reshape { .. } = g.node(x).op {
        x = g.node(x).inputs[0];
    }
    if !matches!(g.node(x).op, Op::CollectiveWait) {
        return false;
    }
    let start = g.node(g.node(x).inputs[0]);
    let Op::CollectiveStart { kind: CollectiveKind::AllGather, group, axis: 1 } = start.op else {
        return false;
    };
    // Along the sequence of a [B, T/tp, D] activation: not a parameter, not a [N, 1] statistic.
    let operand = g.node(start.inputs[0]);
    group.mesh_axis.shares_loss()
        && operand.ty.shape.len() == 3
        && !matches!(operand.op, Op::Input { kind: InputKind::Parameter, .. })
}

/// The forward values [`RecomputePolicy::Pointwise`] recomputes: unary, affine and binary values
/// whose readers in the backward (`live`: the nodes the gradients need) and among the other
/// recomputed values are all unary, affine or binary ops of their shape — so in f32 the compiled
/// executor recomputes them inside its fused groups and never writes them (other dtypes run
/// them as ops of their own) — and whose operands are inputs, values the backward reads itself
/// (saved anyway), or values of this kind.
pub fn pointwise_recomputable(g: &Graph, live: &[bool]) -> Vec<bool> {
    let users = g.users();
    let in_bw = |v: ValueId| live[v.0] && g.node(v).meta.phase == Phase::Backward;
    let fused_reader =
        |u: ValueId, x: usize| g.node(u).op.is_pointwise() && g.node(u).ty.shape == g.nodes[x].ty.shape;
    let mut r = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        if n.meta.phase == Phase::Backward || !n.op.is_pointwise() {
            continue;
        }
        let available = |x: &ValueId| {
            matches!(g.node(*x).op, Op::Input { .. }) || r[x.0] || users[x.0].iter().any(|&u| in_bw(u))
        };
        let readers_fuse = users[i].iter().filter(|&&u| in_bw(u)).all(|&u| fused_reader(u, i));
        r[i] = readers_fuse && n.inputs.iter().all(available);
    }
    // A recomputed reader of another shape (a broadcasting binary) would make x a value of its
    // own in the backward: keep x saved instead.
    for i in 0..g.nodes.len() {
        if r[i] && users[i].iter().any(|&u| r[u.0] && !fused_reader(u, i)) {
            r[i] = false;
        }
    }
    r
}

/// Values computed from parameters, buffers and constants only, without collectives.
fn param_derived(g: &Graph) -> Vec<bool> {
    let mut p = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        p[i] = match &n.op {
            Op::Input { kind, .. } => matches!(kind, InputKind::Parameter | InputKind::Buffer),
            Op::Full { .. } => true,
            Op::CollectiveStart { .. } | Op::CollectiveWait => false,
            _ => n.meta.phase != Phase::Backward && n.inputs.iter().all(|x| p[x.0]),
        };
    }
    p
}

fn build_fw(joint: &Graph, nuser: usize, saved: &[ValueId], names: &[String]) -> Result<Graph> {
    let roots = joint.outputs[..nuser].iter().map(|o| o.value).chain(saved.iter().copied());
    let live = joint.ancestors(roots);
    let mut ex = Extractor::new(joint, "fw", "partition");
    for (i, n) in joint.nodes.iter().enumerate() {
        let v = ValueId(i);
        if n.meta.phase == Phase::Backward {
            continue;
        }
        if matches!(n.op, Op::Input { .. }) {
            ex.same_input(v);
        } else if live[i] {
            ex.copy(v, None)?;
        }
    }
    for o in &joint.outputs[..nuser] {
        ex.output(&o.name, o.value)?;
    }
    for (v, name) in saved.iter().zip(names) {
        ex.output(name, *v)?;
    }
    ex.finish()
}

fn build_bw(
    joint: &Graph,
    grad_outs: &[crate::graph::GraphOutput],
    route: &[Route],
    live: &[bool],
    saved: &[ValueId],
    names: &[String],
) -> Result<Graph> {
    let mut ex = Extractor::new(joint, "full_bw", "partition");
    let mut inputs: Vec<ValueId> = (0..joint.nodes.len())
        .map(ValueId)
        .filter(|v| {
            route[v.0] == Route::Input
                || (live[v.0] && matches!(joint.node(*v).op, Op::Input { kind: InputKind::Tangent, .. }))
        })
        .collect();
    inputs.sort_by_key(|v| input_order(joint, *v));
    let (before, tangents): (Vec<_>, Vec<_>) =
        inputs.into_iter().partition(|v| input_order(joint, *v).0 != InputKind::Tangent);
    for v in before {
        ex.same_input(v);
    }
    for (v, name) in saved.iter().zip(names) {
        ex.input(*v, name, InputKind::Saved);
    }
    for v in tangents {
        ex.same_input(v);
    }
    // Backward nodes in joint order; each recomputed value is emitted just before its first use,
    // so recomputation does not raise the live set at the start of the backward.
    for (i, n) in joint.nodes.iter().enumerate() {
        if n.meta.phase == Phase::Backward && live[i] && !matches!(n.op, Op::Input { .. }) {
            emit(&mut ex, joint, route, ValueId(i))?;
        }
    }
    for o in grad_outs {
        ex.output(&o.name, o.value)?;
    }
    ex.finish()
}

/// Copies `v` into the backward after its not-yet-copied recomputed operands (depth first).
fn emit(ex: &mut Extractor, joint: &Graph, route: &[Route], v: ValueId) -> Result<()> {
    let mut stack = vec![(v, false)];
    while let Some((x, expanded)) = stack.pop() {
        if ex.get(x).is_some() {
            continue;
        }
        if expanded {
            let phase = (route[x.0] == Route::Clone).then_some(Phase::Recompute);
            ex.copy(x, phase)?;
        } else {
            stack.push((x, true));
            for &y in joint.node(x).inputs.iter().rev() {
                if ex.get(y).is_none() {
                    stack.push((y, false));
                }
            }
        }
    }
    Ok(())
}
