//! Whether a step fits in memory, checked from estimates before anything is built: the schedule's
//! size ([`graphpp_schedule::check_size`]) and the bytes of one step ([`StepMemory`], from the
//! model's formulas in [`graphpp_models::memory`]) against a budget of 3/4 of the machine's memory.
//! A shape above it is an error naming the estimate, not an abort or a swap storm.

use graphpp_models::{Model, StageSpec};
use graphpp_schedule::generate::human_bytes;
use graphpp_schedule::simulate::peak_memory;
use graphpp_schedule::{check_size, GenerateError, Kind, Memory, Schedule, Shape};

/// Saved-activation bytes of one microbatch through the whole model (all layers on one stage).
fn whole_model_activation_bytes(model: &dyn Model, batch: usize, seq: usize) -> u128 {
    let whole = StageSpec::whole(model.num_layers());
    model.stage_activation_bytes(&whole, batch, seq)
}

/// The activations the ranks hold at once at `schedule`'s peak, summed over the ranks, in
/// full-stage units (one microbatch through 1/p of the model, `p` the ranks; a chunk of v per
/// rank weighs 1/v): each rank's [`peak_memory`] walking its program (ZB's M_W = M_B / 2).
fn in_flight_full_stages(schedule: &Schedule) -> f64 {
    (0..schedule.ranks.len()).map(|r| peak_memory(schedule, r, &Memory::default()).0).sum()
}

/// Bytes per parameter a run holds: the f32 parameter, its gradient accumulator, the two AdamW
/// moments, and the row-major copy of a transposed weight a compiled program keeps
/// (`exec::kept`).
const BYTES_PER_PARAMETER: u128 = 20;
/// Bytes per parameter a checkpoint save holds on top of the run's state: the gathered
/// parameters and moments (12) and their serialised file (12).
const SAVE_BYTES_PER_PARAMETER: u128 = 24;
/// Fraction of the machine's memory a step may use: 3/4 (the rest for the system and the corpus).
pub const BUDGET_NUMERATOR: u128 = 3;
/// Denominator of the budget fraction.
pub const BUDGET_DENOMINATOR: u128 = 4;
/// Memory assumed where it cannot be read (not Linux): 16 GiB.
pub const ASSUMED_MEMORY: u64 = 16 << 30;

/// Bytes of one step, at least: every figure is a lower bound of what the runtime holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepMemory {
    /// Saved activations at the schedule's peak: one microbatch's activations of a stage times
    /// the microbatch-stages the ranks hold at once (the simulator's peak, at least one
    /// microbatch through every stage); for `verify`, the larger of that and the single-device
    /// step over all `m` microbatches at once.
    pub activations: u128,
    /// Mask and RoPE tables of every schedule stage (f32), plus one f64 build of them.
    pub buffers: u128,
    /// Parameters, gradients, the two AdamW moments and the transposed weight copies (f32) of
    /// every parameter copy (20 bytes a parameter), for one data-parallel replica.
    pub parameters: u128,
    /// The routed experts' part of `parameters` (a MoE model's; each expert lives on dp/ep of
    /// the replicas under expert parallelism).
    pub routed: u128,
    /// What a checkpoint save holds on top of the parameters, after the step's activations are
    /// gone: the gathered state and its file (24 bytes a parameter).
    pub saving: u128,
    /// Token ids and targets of the `m` microbatches (u32).
    pub batch: u128,
    /// What the processes hold beside the step: each one's program as resident when the check
    /// runs, the corpus it reads and its computing threads' own memory ([`process_bytes`],
    /// [`Layout::process`]); 0 in one replica's estimate.
    pub process: u128,
}

impl StepMemory {
    /// The estimate of a step of `kind` at `shape` with `batch` sequences of `seq` tokens per
    /// microbatch; `single_device` adds `verify`'s step over all microbatches on one device.
    /// The activations are those `schedule` holds at its peak when it is given (the run's
    /// schedule, once made), else the lower bound of one microbatch through every stage.
    pub fn estimate(
        cfg: &dyn Model,
        (kind, shape): (Kind, &Shape),
        batch: usize,
        seq: usize,
        single_device: bool,
        schedule: Option<&Schedule>,
    ) -> StepMemory {
        let (m, stages) = (shape.microbatches as u128, shape.stages() as u128);
        let copies = kind.model_copies() as u128;
        let whole = whole_model_activation_bytes(cfg, batch, seq);
        // Full-stage units: a microbatch through every stage of one model copy is p of them.
        let p = shape.ranks.max(1) as f64;
        let held = schedule.map_or(p, in_flight_full_stages).max(p);
        let mut activations = (whole as f64 / p * held) as u128;
        if single_device {
            activations = activations.max(whole_model_activation_bytes(
                cfg,
                batch.saturating_mul(shape.microbatches),
                seq,
            ));
        }
        let per_stage = cfg.buffer_bytes(seq);
        let whole_model = StageSpec::whole(cfg.num_layers());
        let routed: u128 = cfg
            .stage_parameters(&whole_model)
            .iter()
            .filter(|(name, _)| cfg.expert_of(name).is_some())
            .map(|(_, shape)| shape.iter().product::<usize>() as u128)
            .sum();
        StepMemory {
            activations,
            buffers: per_stage.saturating_mul(stages).saturating_add(per_stage.saturating_mul(2)),
            parameters: cfg.parameter_count().saturating_mul(BYTES_PER_PARAMETER).saturating_mul(copies),
            routed: routed.saturating_mul(BYTES_PER_PARAMETER).saturating_mul(copies),
            saving: cfg.parameter_count().saturating_mul(SAVE_BYTES_PER_PARAMETER).saturating_mul(copies),
            batch: m.saturating_mul(batch as u128).saturating_mul(seq as u128).saturating_mul(8),
            process: 0,
        }
    }

    /// The estimate of `dp` data-parallel replicas of this one (a replica's), all in this
    /// process: each holds its activations, buffers and token batch, and its copy of the shared
    /// parameters' 20 bytes a parameter; a routed expert lives on dp/ep replicas (expert
    /// parallelism). With `fsdp` (dp > 1) the parameters, AdamW moments and reduced gradients
    /// (16 bytes a parameter) are one copy sharded over the replicas, while each replica still
    /// holds the full gradient accumulators, the gathered weights and their transposed copies
    /// (12 bytes a parameter). A checkpoint save gathers one copy whatever `dp`.
    pub fn replicated(self, dp: usize, fsdp: bool, ep: usize) -> StepMemory {
        let (dp, ep) = (dp.max(1) as u128, ep.max(1) as u128);
        let shared = self.parameters.saturating_sub(self.routed);
        let shared = if fsdp && dp > 1 {
            let per = shared / BYTES_PER_PARAMETER;
            per.saturating_mul(16).saturating_add(per.saturating_mul(12).saturating_mul(dp))
        } else {
            shared.saturating_mul(dp)
        };
        let routed = self.routed.saturating_mul(dp) / ep;
        StepMemory {
            activations: self.activations.saturating_mul(dp),
            buffers: self.buffers.saturating_mul(dp),
            parameters: shared.saturating_add(routed),
            routed,
            saving: self.saving,
            batch: self.batch.saturating_mul(dp),
            process: self.process,
        }
    }

    /// This machine's part of a job of `world` ranks of which `here` run on it (processes under
    /// `mpirun` on several hosts): every figure but a checkpoint save's (the leader gathers the
    /// whole state) scaled by `here / world`.
    pub fn on_this_machine(self, here: usize, world: usize) -> StepMemory {
        let (here, world) = (here.min(world) as u128, world.max(1) as u128);
        let part = |x: u128| x.saturating_mul(here) / world;
        StepMemory {
            activations: part(self.activations),
            buffers: part(self.buffers),
            parameters: part(self.parameters),
            routed: part(self.routed),
            saving: self.saving,
            batch: part(self.batch),
            process: self.process,
        }
    }

    /// The peak: the processes, the parameters, buffers and batch, with the larger of the
    /// step's activations and a checkpoint save's copies (a save runs between steps).
    pub fn total(&self) -> u128 {
        self.activations
            .max(self.saving)
            .saturating_add(self.buffers)
            .saturating_add(self.parameters)
            .saturating_add(self.batch)
            .saturating_add(self.process)
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
    "one step with B={batch} sequences of T={seq} tokens per microbatch{} would need at least {} of \
     memory (activations at the schedule's peak {}, stage buffers {}, parameters, optimizer state \
     and weight copies {}, token batch {}, a checkpoint save's copies {}, the program, its corpus \
     and threads {}); the limit is {} \
     ({source_of_budget}): lower --microbatch-size, --seq-len, --microbatches or the model size",
    if *.replicas > 1 { format!(" on each of {} data-parallel replicas", .replicas) } else { String::new() },
    human_bytes(.need.total()),
    human_bytes(.need.activations),
    human_bytes(.need.buffers),
    human_bytes(.need.parameters),
    human_bytes(.need.batch),
    human_bytes(.need.saving),
    human_bytes(.need.process),
    human_bytes(*.budget)
)]
pub struct MemoryShortfall {
    /// B.
    pub batch: usize,
    /// T.
    pub seq: usize,
    /// Data-parallel replicas, each running B sequences.
    pub replicas: usize,
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
    kib_field(text, "MemTotal:")
}

/// Bytes each rank keeps beside the tensors the runtime counts: the allocator's own pages of
/// the threads that compute for it (mimalloc keeps a heap per thread, and
/// [`crate::malloc::retain_freed_memory`] keeps what it frees) and the matmul kernels' packing
/// buffers, with one worker in its op pool. Measured on this project's 2-core host
/// (docs/PERFORMANCE.md, "Memory history"): `train --model tiny` kept 20 MiB above its tensors,
/// program and corpus at 1 rank × 1 thread, 48 at 2 × 1 and 63 at 4 × 1 after 3 steps, about 10
/// more after 20 (a MoE model's varying expert loads keep more).
pub const RANK_BYTES: u128 = 24 << 20;

/// Bytes each further worker of a rank's op pool keeps ([`RANK_BYTES`]'s measurement: 1 × 2
/// threads kept 30 MiB against 1 × 1's 20, 2 × 2 58 against 48, 4 × 2 89 against 63).
pub const WORKER_BYTES: u128 = 8 << 20;

/// What a process holds beside the steps' tensors ([`Layout::process`]): its program as
/// resident now ([`resident_bytes`], 0 where unknown), `corpus` bytes it will read, and for each
/// of its `ranks` [`RANK_BYTES`] and [`WORKER_BYTES`] per op-pool worker past the first
/// (`workers` per rank).
pub fn process_bytes(corpus: u128, ranks: usize, workers: usize) -> u128 {
    let program = u128::from(resident_bytes().unwrap_or(0));
    let per_rank = RANK_BYTES.saturating_add(WORKER_BYTES.saturating_mul(workers.saturating_sub(1) as u128));
    program.saturating_add(corpus).saturating_add(per_rank.saturating_mul(ranks as u128))
}

/// This process's resident memory in bytes (`VmRSS` of `/proc/self/status`): the program, its
/// libraries and what it holds so far; `None` where it cannot be read (not Linux).
pub fn resident_bytes() -> Option<u64> {
    kib_field(&std::fs::read_to_string("/proc/self/status").ok()?, "VmRSS:")
}

/// The value of the line `name   N kB` of a `/proc` status text, in bytes (a bare `N` as is).
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let mut words = line[name.len()..].split_whitespace();
    let n: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") => n.checked_mul(1024),
        None => Some(n),
        Some(_) => None,
    }
}

/// Checks a step: the schedule's size, then [`StepMemory::estimate`] (with `schedule`'s peak
/// when it is given) of `layout`'s data-parallel replicas of `batch` sequences each, this
/// machine's part of them ([`Layout::of`]), against `budget` bytes (`source_of_budget` says where
/// it comes from; see [`memory_budget`]).
///
/// # Errors
/// [`SizeError::Schedule`] or [`SizeError::Memory`].
#[allow(clippy::too_many_arguments)]
pub fn check_step_with(
    cfg: &dyn Model,
    kind: Kind,
    shape: &Shape,
    (batch, seq): (usize, usize),
    layout: &Layout,
    single_device: bool,
    schedule: Option<&Schedule>,
    (budget, source_of_budget): (u128, String),
) -> Result<StepMemory, SizeError> {
    check_size(kind, shape)?;
    let need = layout.of(StepMemory::estimate(cfg, (kind, shape), batch, seq, single_device, schedule));
    let dp = layout.dp;
    if need.total() > budget {
        return Err(SizeError::Memory(Box::new(MemoryShortfall {
            batch,
            seq,
            replicas: dp,
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
    (batch, seq): (usize, usize),
    layout: &Layout,
    single_device: bool,
    schedule: Option<&Schedule>,
) -> Result<StepMemory, SizeError> {
    check_step_with(cfg, kind, shape, (batch, seq), layout, single_device, schedule, memory_budget())
}

/// What turns one replica's estimate into this machine's: the data-parallel degree, FSDP, the
/// expert-parallel degree ([`StepMemory::replicated`]), the job's ranks on this machine out
/// of all (`None`: every rank, as threads of this process; [`StepMemory::on_this_machine`]),
/// and what each process holds beside the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Data-parallel replicas.
    pub dp: usize,
    /// FSDP over them.
    pub fsdp: bool,
    /// Expert-parallel degree.
    pub ep: usize,
    /// (ranks on this machine, ranks in the job) under `mpirun`; `None` for threads.
    pub here: Option<(usize, usize)>,
    /// Bytes each process holds beside the step ([`process_bytes`]): its program as resident
    /// when checked, its corpus as read and tokenized (`graphpp::data`) and its computing
    /// threads' own memory. Under `mpirun` every process on this machine holds its own.
    pub process: u128,
}

impl Layout {
    /// One replica on its own, every rank here.
    pub const ONE: Layout = Layout { dp: 1, fsdp: false, ep: 1, here: None, process: 0 };

    /// `one` replica's estimate as this machine holds it under this layout.
    pub fn of(&self, one: StepMemory) -> StepMemory {
        let all = one.replicated(self.dp, self.fsdp, self.ep);
        let (part, processes) = match self.here {
            Some((here, world)) => (all.on_this_machine(here, world), here.min(world)),
            None => (all, 1),
        };
        StepMemory { process: self.process.saturating_mul(processes as u128), ..part }
    }
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
        let e =
            check_step_with(&tiny, Kind::Zbv, &shape, (100_000, 64), &Layout::ONE, false, None, budget(96))
                .unwrap_err();
        let SizeError::Memory(short) = &e else { panic!("{e:?}") };
        assert_eq!(short.need.activations, 193_843_200_000);
        let text = e.to_string();
        assert!(
            text.contains("B=100000") && text.contains("194 GB") && text.contains("96 GB for the test"),
            "{text}"
        );
        // The default shape of `graphpp train` fits in a few MB.
        let ok =
            check_step_with(&tiny, Kind::Zbv, &shape, (8, 64), &Layout::ONE, false, None, budget(1)).unwrap();
        assert!(ok.total() < 50_000_000, "{ok:?}");
    }

    #[test]
    fn verify_counts_the_single_device_step_over_all_microbatches() {
        let tiny = LlamaConfig::tiny();
        let shape = Shape::new(2, 1, 1000);
        let schedule = graphpp_schedule::generate(Kind::OneFOneB, &shape, &Default::default()).unwrap();
        let estimate = |single, s| StepMemory::estimate(&tiny, (Kind::OneFOneB, &shape), 100, 64, single, s);
        let whole = whole_model_activation_bytes(&tiny, 100, 64);
        assert_eq!(estimate(true, Some(&schedule)).activations, 1000 * whole);
        // 1F1B at p = 2 holds two microbatches on rank 0 and one on rank 1 at its peak: three
        // stage-microbatches of the two stages, 1.5 microbatches through the whole model.
        assert_eq!(estimate(false, Some(&schedule)).activations, whole * 3 / 2);
        // Before the schedule is made: the lower bound, one microbatch through every stage.
        assert_eq!(estimate(false, None).activations, whole);
    }

    /// With two chunks per rank the units are still full stages (1/p of the model): ZB-V at
    /// p = 2 holds p·M_B per rank at its peak (the ZB-V paper's memory, Qi et al. 2024, §3),
    /// two whole-model microbatches over the two ranks — twice what counting chunks as stages
    /// gave.
    #[test]
    fn chunks_count_as_fractions_of_a_stage() {
        let tiny = LlamaConfig::tiny();
        let shape = Shape::new(2, 2, 8);
        let schedule = graphpp_schedule::generate(Kind::Zbv, &shape, &Default::default()).unwrap();
        let e = StepMemory::estimate(&tiny, (Kind::Zbv, &shape), 8, 64, false, Some(&schedule));
        assert_eq!(e.activations, 2 * whole_model_activation_bytes(&tiny, 8, 64));
    }

    /// A checkpoint save (24 bytes a parameter, after the activations are gone) or the step's
    /// activations, whichever is larger, on top of the 20 bytes a parameter the run holds.
    #[test]
    fn the_peak_is_the_step_or_the_save() {
        let mut deep = LlamaConfig::small();
        deep.num_hidden_layers = 600;
        let e = StepMemory::estimate(&deep, (Kind::Zbv, &Shape::new(2, 2, 8)), 8, 64, false, None);
        let params = deep.parameter_count();
        assert_eq!((e.parameters, e.saving), (20 * params, 24 * params));
        // `--model small --layers 600` was let through and then killed for memory on a 24 GB
        // machine: its estimate is now above that machine's budget (3/4 of it).
        assert!(e.total() > 18 * (1u128 << 30), "{e:?}");
    }

    #[test]
    fn replicas_hold_their_own_activations_and_state_and_fsdp_one_state() {
        let tiny = LlamaConfig::tiny();
        let one = StepMemory::estimate(&tiny, (Kind::OneFOneB, &Shape::new(2, 1, 4)), 8, 64, false, None);
        assert_eq!(one.routed, 0);
        let four = one.replicated(4, false, 1);
        assert_eq!(
            (four.activations, four.parameters, four.batch),
            (4 * one.activations, 4 * one.parameters, 4 * one.batch)
        );
        assert_eq!(four.saving, one.saving);
        // FSDP: 16 bytes a parameter sharded once, 12 per replica (gradients, gathered and
        // transposed weights); over one replica it is plain data parallelism.
        let per = one.parameters / 20;
        assert_eq!(one.replicated(4, true, 1).parameters, 16 * per + 4 * 12 * per);
        assert_eq!(one.replicated(1, true, 1), one.replicated(1, false, 1));
        assert!(four.total() > one.replicated(4, true, 1).total());
        // Four replicas of B = 64 at T = 512 hold the activations of one of B = 256 (the
        // trial's run that passed the check and was OOM-killed); one replica fits 19 GB.
        let small = LlamaConfig::small();
        let shape = Shape::new(2, 1, 2);
        let b64 = StepMemory::estimate(&small, (Kind::OneFOneB, &shape), 64, 512, false, None);
        let b256 = StepMemory::estimate(&small, (Kind::OneFOneB, &shape), 256, 512, false, None);
        assert_eq!(b64.replicated(4, false, 1).activations, b256.activations);
        let dp = |dp| Layout { dp, ..Layout::ONE };
        assert!(check_step_with(&small, Kind::OneFOneB, &shape, (64, 512), &dp(1), false, None, budget(19))
            .is_ok());
        let e = check_step_with(&small, Kind::OneFOneB, &shape, (64, 512), &dp(4), false, None, budget(19));
        assert!(matches!(e, Err(SizeError::Memory(_))), "{e:?}");
        // Under mpirun on two hosts of 4 ranks each, this machine holds half of the job.
        let eight = Layout { here: Some((4, 8)), ..dp(4) };
        let half = eight.of(b64);
        assert_eq!(half.activations, dp(4).of(b64).activations / 2);
        assert_eq!(half.saving, b64.saving);
        // Each process holds its program and corpus once: one process for threads, each of the
        // 4 on this host under mpirun.
        let outside = 100 << 20;
        assert_eq!(Layout { process: outside, ..dp(4) }.of(b64).total(), dp(4).of(b64).total() + outside);
        assert_eq!(Layout { process: outside, ..eight }.of(b64).total(), half.total() + 4 * outside);
        // A process's own: the corpus, and per rank 24 MiB with 8 more per op-pool worker past
        // the first (the program's resident size, read twice, may move a little between).
        let own = process_bytes(100, 2, 3) as i128 - process_bytes(0, 0, 1) as i128;
        assert!((own - (100 + 2 * (24 + 2 * 8) * (1 << 20))).abs() < 1 << 20, "{own}");
    }

    #[test]
    fn routed_experts_live_on_dp_over_ep_replicas() {
        let moe = graphpp_models::MoeConfig::preset("moe-small").unwrap();
        let one = StepMemory::estimate(&moe, (Kind::OneFOneB, &Shape::new(2, 1, 4)), 8, 64, false, None);
        assert!(one.routed > one.parameters / 2, "moe-small is mostly routed experts: {one:?}");
        let ep4 = one.replicated(4, false, 4);
        assert_eq!(ep4.parameters, 4 * (one.parameters - one.routed) + one.routed);
        assert_eq!(ep4.routed, one.routed);
    }

    #[test]
    fn a_schedule_too_large_is_refused_first() {
        let e = check_step_with(
            &LlamaConfig::tiny(),
            Kind::Zbv,
            &Shape::new(1_000_000, 2, 8),
            (8, 64),
            &Layout::ONE,
            false,
            None,
            budget(96),
        )
        .unwrap_err();
        assert!(matches!(e, SizeError::Schedule(GenerateError::TooLarge { ranks: 1_000_000, .. })), "{e:?}");
    }

    #[test]
    fn meminfo_is_read_in_bytes() {
        assert_eq!(parse_meminfo("MemTotal:       24555520 kB\nMemFree: 1 kB\n"), Some(24_555_520 * 1024));
        assert_eq!(parse_meminfo("MemFree: 1 kB\n"), None);
        assert_eq!(kib_field("VmPeak:\t 20 kB\nVmRSS:\t   12228 kB\n", "VmRSS:"), Some(12228 * 1024));
        #[cfg(target_os = "linux")]
        assert!(resident_bytes().is_some_and(|b| b > 1 << 20), "a test process holds more than 1 MiB");
        let (b, what) = memory_budget();
        assert!(b > 0 && what.starts_with("3/4 of the "), "{what}");
    }
}
