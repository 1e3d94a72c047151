//! Whether a step fits in memory, checked from estimates before anything is built: the schedule's
//! size ([`graphpp_schedule::check_size`]) and the bytes of one step ([`StepMemory`], from the
//! model's formulas in [`graphpp_models::memory`]) against a budget of 3/4 of the machine's memory.
//! A shape above it is an error naming the estimate, not an abort or a swap storm.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use graphpp_graph::autodiff::grad_name;
use graphpp_graph::names::INPUT;
use graphpp_graph::passes::{multiplex_fw_bw, Multiplex};
use graphpp_graph::{Graph, InputKind, StageGraphs};
use graphpp_models::{Model, StageSpec};
use graphpp_schedule::bytes::{ByteModel, OverlapBytes, StageBytes};
use graphpp_schedule::generate::human_bytes;
use graphpp_schedule::{check_size, Action, GenerateError, Kind, Schedule, Shape};

use crate::exec::peak_live_bytes;
use crate::pipeline::stage::kept_names;
use crate::verify::VerifyError;

/// Saved-activation bytes of one microbatch through the whole model (all layers on one stage).
fn whole_model_activation_bytes(model: &dyn Model, batch: usize, seq: usize) -> u128 {
    let whole = StageSpec::whole(model.num_layers());
    model.stage_activation_bytes(&whole, batch, seq)
}
/// Fraction of the machine's memory a step may use: 3/4 (the rest for the system and the corpus).
pub const BUDGET_NUMERATOR: u128 = 3;
/// Denominator of the budget fraction.
pub const BUDGET_DENOMINATOR: u128 = 4;
/// Memory assumed where it cannot be read (not Linux): 16 GiB.
pub const ASSUMED_MEMORY: u64 = 16 << 30;

/// Bytes of one step, at least: every figure is a lower bound of what the runtime holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepMemory {
    /// Saved activations of one microbatch through every stage (all stages hold it at once when
    /// the last stage runs its forward); for `verify`, the larger of that and the single-device
    /// step over all `m` microbatches at once.
    pub activations: u128,
    /// Mask and RoPE tables of every schedule stage (f32), plus one f64 build of them.
    pub buffers: u128,
    /// Parameters, gradients and the two AdamW moments (f32) of every parameter copy.
    pub parameters: u128,
    /// Token ids and targets of the `m` microbatches (u32).
    pub batch: u128,
}

impl StepMemory {
    /// The estimate of a step of `kind` at `shape` with `batch` sequences of `seq` tokens per
    /// microbatch; `single_device` adds `verify`'s step over all microbatches on one device.
    pub fn estimate(
        cfg: &dyn Model,
        kind: Kind,
        shape: &Shape,
        batch: usize,
        seq: usize,
        single_device: bool,
    ) -> StepMemory {
        let (m, stages) = (shape.microbatches as u128, shape.stages() as u128);
        let copies: u128 = if kind == Kind::DualPipe { 2 } else { 1 };
        let mut activations = whole_model_activation_bytes(cfg, batch, seq);
        if single_device {
            activations = activations.max(whole_model_activation_bytes(
                cfg,
                batch.saturating_mul(shape.microbatches),
                seq,
            ));
        }
        let per_stage = cfg.buffer_bytes(seq);
        StepMemory {
            activations,
            buffers: per_stage.saturating_mul(stages).saturating_add(per_stage.saturating_mul(2)),
            parameters: cfg.parameter_count().saturating_mul(16).saturating_mul(copies),
            batch: m.saturating_mul(batch as u128).saturating_mul(seq as u128).saturating_mul(8),
        }
    }

    /// The sum of the parts.
    pub fn total(&self) -> u128 {
        self.activations
            .saturating_add(self.buffers)
            .saturating_add(self.parameters)
            .saturating_add(self.batch)
    }
}

/// Why a step is too large to run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// The schedule would be too large to build.
    #[error(transparent)]
    Schedule(#[from] GenerateError),
    /// The step would need more memory than the budget.
    #[error(transparent)]
    Memory(Box<MemoryShortfall>),
}

/// A step's memory estimate above the budget.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "one step with B={batch} sequences of T={seq} tokens per microbatch would need at least {} of \
     memory (activations of one microbatch {}, stage buffers {}, parameters and optimizer state {}, \
     token batch {}); the limit is {} ({source_of_budget}): lower --microbatch-size, --seq-len, \
     --microbatches or the model size",
    human_bytes(.need.total()),
    human_bytes(.need.activations),
    human_bytes(.need.buffers),
    human_bytes(.need.parameters),
    human_bytes(.need.batch),
    human_bytes(*.budget)
)]
pub struct MemoryShortfall {
    /// B.
    pub batch: usize,
    /// T.
    pub seq: usize,
    /// The estimate.
    pub need: StepMemory,
    /// The budget in bytes.
    pub budget: u128,
    /// Where the budget comes from (`3/4 of the 25 GB of memory`).
    pub source_of_budget: String,
}

/// The budget of a step in bytes and where it comes from: 3/4 of [`machine_memory`], or of
/// [`ASSUMED_MEMORY`] when that cannot be read.
pub fn memory_budget() -> (u128, String) {
    let (total, known) = match machine_memory() {
        Some(b) => (b, true),
        None => (ASSUMED_MEMORY, false),
    };
    let budget = u128::from(total) * BUDGET_NUMERATOR / BUDGET_DENOMINATOR;
    let what = if known { "of memory" } else { "of memory assumed (it could not be read)" };
    (budget, format!("3/4 of the {} {what}", human_bytes(u128::from(total))))
}

/// The machine's memory in bytes: `MemTotal` of `/proc/meminfo`, or the cgroup (v2) limit
/// `/sys/fs/cgroup/memory.max` when that is lower; `None` where neither can be read.
pub fn machine_memory() -> Option<u64> {
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| parse_meminfo(&t));
    let cgroup =
        std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok().and_then(|t| t.trim().parse::<u64>().ok());
    match (total, cgroup) {
        (Some(t), Some(c)) => Some(t.min(c)),
        (t, c) => t.or(c),
    }
}

/// `MemTotal` in bytes from the text of `/proc/meminfo` (`MemTotal:   24555520 kB`).
pub fn parse_meminfo(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut words = line["MemTotal:".len()..].split_whitespace();
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

/// Checks a step before anything is built: the schedule's size, then [`StepMemory::estimate`]
/// against `budget` bytes (`source_of_budget` says where it comes from; see [`memory_budget`]).
///
/// # Errors
/// [`SizeError::Schedule`] or [`SizeError::Memory`].
pub fn check_step_with(
    cfg: &dyn Model,
    kind: Kind,
    shape: &Shape,
    (batch, seq): (usize, usize),
    single_device: bool,
    (budget, source_of_budget): (u128, String),
) -> Result<StepMemory, SizeError> {
    check_size(kind, shape)?;
    let need = StepMemory::estimate(cfg, kind, shape, batch, seq, single_device);
    if need.total() > budget {
        return Err(SizeError::Memory(Box::new(MemoryShortfall {
            batch,
            seq,
            need,
            budget,
            source_of_budget,
        })));
    }
    Ok(need)
}

/// [`check_step_with`] against this machine's [`memory_budget`].
///
/// # Errors
/// As [`check_step_with`].
pub fn check_step(
    cfg: &dyn Model,
    kind: Kind,
    shape: &Shape,
    batch: usize,
    seq: usize,
    single_device: bool,
) -> Result<StepMemory, SizeError> {
    check_step_with(cfg, kind, shape, (batch, seq), single_device, memory_budget())
}

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
                outputs(di).into_iter().filter(|(n, _)| *n != grad_name(INPUT)).collect();
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
/// [`VerifyError::Mismatch`] for a schedule stage without graphs; building an overlap graph.
pub fn byte_model(graphs: &[&StageGraphs], schedule: &Schedule) -> Result<ByteModel, VerifyError> {
    let mut overlap: Vec<OverlapBytes> = Vec::new();
    for a in schedule.ranks.iter().flatten().flatten() {
        let Action::Overlap { f, b } = *a else { continue };
        if overlap.iter().any(|o| (o.f, o.b) == (f.stage, b.stage)) {
            continue;
        }
        let get =
            |s: usize| graphs.get(s).ok_or_else(|| VerifyError::Mismatch(format!("stage {s}: no graphs")));
        let g = multiplex_fw_bw(&get(f.stage)?.fw, &get(b.stage)?.full_bw, Multiplex::CommOverlap).map_err(
            |e| VerifyError::Mismatch(format!("OVERLAP_F_B of stages {} and {}: {e}", f.stage, b.stage)),
        )?;
        overlap.push(OverlapBytes { f: f.stage, b: b.stage, run: peak_live_bytes(&g) as u64 });
    }
    if let Some(stage) = schedule.placement().into_keys().find(|&s| s >= graphs.len()) {
        return Err(VerifyError::Mismatch(format!("stage {stage}: no graphs for it")));
    }
    Ok(ByteModel { stages: graphs.iter().map(|g| stage_bytes(g)).collect(), overlap })
}

/// The graphs of every schedule stage of a training run (index = stage id), built as its ranks
/// build theirs: `B / dp` sequences per replica, the run's recompute policy and dtype, the first
/// expert shard.
///
/// # Errors
/// As [`crate::train::build::stage_specs`] and [`crate::train::build::graphs_of`].
pub fn run_stage_graphs(setup: &crate::TrainSetup) -> Result<Vec<Arc<StageGraphs>>, VerifyError> {
    let (specs, opts) = crate::train::build::run_stages(setup, 0)?;
    crate::train::build::all_stage_graphs(&*setup.model, &specs, &opts)
}

/// The [`ByteModel`] of a training run's `schedule` (compute-only or lowered) over its
/// [`run_stage_graphs`]. FSDP's gathered parameters are not counted.
///
/// # Errors
/// As [`run_stage_graphs`] and [`byte_model`].
pub fn run_byte_model(setup: &crate::TrainSetup, schedule: &Schedule) -> Result<ByteModel, VerifyError> {
    let graphs = run_stage_graphs(setup)?;
    let refs: Vec<&StageGraphs> = graphs.iter().map(|g| &**g).collect();
    byte_model(&refs, schedule)
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphpp_models::LlamaConfig;

    fn budget(gb: u128) -> (u128, String) {
        (gb * 1_000_000_000, format!("{gb} GB for the test"))
    }

    #[test]
    fn a_huge_microbatch_is_refused_naming_the_estimate() {
        let tiny = LlamaConfig::tiny();
        let shape = Shape::new(2, 2, 8);
        let e = check_step_with(&tiny, Kind::Zbv, &shape, (100_000, 64), false, budget(96)).unwrap_err();
        let SizeError::Memory(short) = &e else { panic!("{e:?}") };
        assert_eq!(short.need.activations, 193_843_200_000);
        let text = e.to_string();
        assert!(
            text.contains("B=100000") && text.contains("194 GB") && text.contains("96 GB for the test"),
            "{text}"
        );
        // The default shape of `graphpp train` fits in a few MB.
        let ok = check_step_with(&tiny, Kind::Zbv, &shape, (8, 64), false, budget(1)).unwrap();
        assert!(ok.total() < 50_000_000, "{ok:?}");
    }

    #[test]
    fn verify_counts_the_single_device_step_over_all_microbatches() {
        let tiny = LlamaConfig::tiny();
        let shape = Shape::new(2, 1, 1000);
        let pipelined = StepMemory::estimate(&tiny, Kind::OneFOneB, &shape, 100, 64, false);
        let verify = StepMemory::estimate(&tiny, Kind::OneFOneB, &shape, 100, 64, true);
        assert_eq!(verify.activations, 1000 * pipelined.activations);
    }

    #[test]
    fn a_schedule_too_large_is_refused_first() {
        let e = check_step_with(
            &LlamaConfig::tiny(),
            Kind::Zbv,
            &Shape::new(1_000_000, 2, 8),
            (8, 64),
            false,
            budget(96),
        )
        .unwrap_err();
        assert!(matches!(e, SizeError::Schedule(GenerateError::TooLarge { ranks: 1_000_000, .. })), "{e:?}");
    }

    #[test]
    fn meminfo_is_read_in_bytes() {
        assert_eq!(parse_meminfo("MemTotal:       24555520 kB\nMemFree: 1 kB\n"), Some(24_555_520 * 1024));
        assert_eq!(parse_meminfo("MemFree: 1 kB\n"), None);
        let (b, what) = memory_budget();
        assert!(b > 0 && what.starts_with("3/4 of the "), "{what}");
    }
}
