//! The bytes a stage's graphs hold and run in ([`StageBytes`]) and a schedule's [`ByteModel`]
//! over them: the input of the schedule simulator's memory figures
//! ([`graphpp_schedule::bytes`]), read from the graphs' value types alone.

use std::collections::{HashMap, HashSet};

use graphpp_graph::names::grad_of;
use graphpp_graph::names::INPUT;
use graphpp_graph::passes::{multiplex_fw_bw, Multiplex};
use graphpp_graph::{Graph, InputKind, StageGraphs};
use graphpp_schedule::bytes::{ByteModel, OverlapBytes, StageBytes};
use graphpp_schedule::{Action, Schedule};

use crate::exec::peak_live_bytes;
use crate::pipeline::stage::kept_names;
use crate::train::error::SetupError;

/// The bytes stage `graphs` hold and run in for one microbatch ([`StageBytes`]), from the graphs'
/// value types alone: what the runtime's caches keep ([`crate::pipeline::stage`]: the backward's reads
/// from F until B or I, bw_di's outputs and bw_dw's reads from I until W) and each graph's
/// [`peak_live_bytes`]. A stage without the dI/dW split (a model's first stage) keeps its
/// backward inputs from I and runs full_bw at W.
pub fn stage_bytes(graphs: &StageGraphs) -> StageBytes {
    let state: HashSet<String> = graphs
        .fw
        .input_specs()
        .into_iter()
        .filter(|i| matches!(i.kind, InputKind::Parameter | InputKind::Buffer))
        .map(|i| i.name)
        .collect();
    let (bw_reads, dw_reads) = kept_names(graphs, |n| state.contains(n));
    let mut size: HashMap<String, u64> = HashMap::new();
    let graphs_in = [Some(&graphs.fw), Some(&graphs.full_bw)]
        .into_iter()
        .chain(graphs.di_dw.iter().flat_map(|(di, dw)| [Some(di), Some(dw)]))
        .flatten();
    for g in graphs_in {
        for i in g.input_specs() {
            size.insert(i.name, i.ty.size_bytes() as u64);
        }
    }
    let outputs = |g: &Graph| -> Vec<(String, u64)> {
        g.outputs.iter().map(|o| (o.name.clone(), g.node(o.value).ty.size_bytes() as u64)).collect()
    };
    size.extend(outputs(&graphs.fw));
    let fw_names: HashSet<String> =
        graphs.fw.input_names().into_iter().chain(graphs.fw.output_names()).collect();
    let cache: HashSet<&String> = bw_reads.iter().filter(|n| fw_names.contains(*n)).collect();
    let bytes =
        |names: &mut dyn Iterator<Item = &String>| names.map(|n| size.get(n).copied().unwrap_or(0)).sum();
    let held_fb = bytes(&mut cache.iter().copied());
    // What the environment of I holds besides state: the cache and the backward's other inputs
    // (the output gradient, auxiliary-loss seeds).
    let bw_inputs = graphs.full_bw.input_names();
    let at_i: HashSet<&String> =
        cache.iter().copied().chain(bw_inputs.iter().filter(|n| !state.contains(*n))).collect();
    let (held_iw, run_i, run_w) = match &graphs.di_dw {
        Some((di, dw)) => {
            let mut stash: HashMap<String, u64> =
                outputs(di).into_iter().filter(|(n, _)| *n != grad_of(INPUT)).collect();
            for n in dw_reads.iter().filter(|n| at_i.contains(n)) {
                stash.entry(n.clone()).or_insert_with(|| size.get(n).copied().unwrap_or(0));
            }
            (stash.values().sum(), peak_live_bytes(di) as u64, peak_live_bytes(dw) as u64)
        }
        None => {
            let names: Vec<String> = at_i.iter().map(|n| (*n).clone()).collect();
            (bytes(&mut names.iter()), 0, peak_live_bytes(&graphs.full_bw) as u64)
        }
    };
    StageBytes {
        held_fb,
        held_iw,
        run_f: peak_live_bytes(&graphs.fw) as u64,
        run_b: peak_live_bytes(&graphs.full_bw) as u64,
        run_i,
        run_w,
        resident: resident_bytes(graphs),
    }
}

/// Bytes a stage holds for the whole step: its parameters four times (the values, their
/// gradient accumulators and the two AdamW moments) and its buffers, as the trainer counts them
/// ([`crate::StepReport::peak_bytes`]).
pub fn resident_bytes(graphs: &StageGraphs) -> u64 {
    4 * input_bytes(graphs, InputKind::Parameter) + input_bytes(graphs, InputKind::Buffer)
}

/// Bytes of the fw inputs of `kind` of stage `graphs` (its parameters, or its buffers).
pub fn input_bytes(graphs: &StageGraphs, kind: InputKind) -> u64 {
    graphs.fw.input_specs().iter().filter(|i| i.kind == kind).map(|i| i.ty.size_bytes() as u64).sum()
}

/// The [`ByteModel`] of `schedule` whose stage `s` runs `graphs[s]`: each stage's
/// [`stage_bytes`] (with its [`resident_bytes`]) and the peak of every OVERLAP_F_B pair the
/// schedule runs (its multiplexed graph built here).
///
/// # Errors
/// [`SetupError::Inconsistent`] for a schedule stage without graphs; building an overlap graph.
pub fn byte_model(graphs: &[&StageGraphs], schedule: &Schedule) -> Result<ByteModel, SetupError> {
    let mut overlap: Vec<OverlapBytes> = Vec::new();
    for a in schedule.ranks.iter().flatten().flatten() {
        let Action::Overlap { f, b } = *a else { continue };
        if overlap.iter().any(|o| (o.f, o.b) == (f.stage, b.stage)) {
            continue;
        }
        let get =
            |s: usize| graphs.get(s).ok_or_else(|| SetupError::Inconsistent(format!("stage {s}: no graphs")));
        let g = multiplex_fw_bw(&get(f.stage)?.fw, &get(b.stage)?.full_bw, Multiplex::CommOverlap).map_err(
            |e| SetupError::Inconsistent(format!("OVERLAP_F_B of stages {} and {}: {e}", f.stage, b.stage)),
        )?;
        overlap.push(OverlapBytes { f: f.stage, b: b.stage, run: peak_live_bytes(&g) as u64 });
    }
    if let Some(stage) = schedule.placement().into_keys().find(|&s| s >= graphs.len()) {
        return Err(SetupError::Inconsistent(format!("stage {stage}: no graphs for it")));
    }
    Ok(ByteModel { stages: graphs.iter().map(|g| stage_bytes(g)).collect(), overlap })
}
