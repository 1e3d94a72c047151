//! The flags of a run's layout, shared by `train`, `profile` and `verify`: the schedule, the
//! pipeline's shape, the layer split, the microbatch size, data/expert/tensor parallelism with FSDP
//! and the device — what a strategy file's directives `place`, `replicate`, `shard`, `split` and `order` stand
//! for ([`graphpp::strategy`]). Each command sets its own defaults on them (`train`'s run, or
//! `verify`'s required shape); a `--schedule-file` supplies the shape flags not given.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Result};
use clap::Args;
use graphpp::strategy::Strategy;
use graphpp_runtime::kernels::device::DeviceSpec;
use graphpp_schedule::{Kind, Placement, ValidateOptions};

use crate::cmd::value::count;

/// The layout flags (see the module doc).
#[derive(Args, Clone, Debug)]
pub struct LayoutArgs {
    /// Schedule kind (`zbv`, `1f1b`, `dualpipev`, …; PyTorch class names accepted). With
    /// --schedule-file, default the kind the file implies: dualpipe for two parameter copies,
    /// dualpipev for the V placement with OVERLAP_F_B actions, zbv for other V orders, 1f1b or
    /// interleaved-1f1b for the loop.
    #[arg(long)]
    pub schedule: Option<Kind>,
    /// Follow the order of a compute-only schedule file (CSV or JSON: F, B, I, W, OVERLAP_F_B per
    /// rank) instead of --schedule's generated one; it must keep --schedule's placement and fit
    /// --ranks, --stages-per-rank and --microbatches, which default to the file's own (graphpp
    /// lowers it and checks it).
    #[arg(long, value_name = "FILE")]
    pub schedule_file: Option<PathBuf>,
    /// grouped-interleaved: consecutive microbatches per chunk (default p).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub group: Option<usize>,
    /// zb-auto, zbv-auto: activation-memory cap per rank in M_B units (default p).
    #[arg(long, allow_hyphen_values = true)]
    pub mem_cap: Option<f64>,
    /// p: pipeline ranks, the pipeline's depth (one thread each; under mpirun, one process
    /// each); the world is ranks × dp × tp. With --schedule-file, default its rows.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub ranks: Option<usize>,
    /// v: stages per rank (S = p·v; DualPipe's 2p stages hold two copies of a p-stage split);
    /// default 2 for interleaved kinds and the V kinds (ZB-V, V-Half, V-Min, DualPipe(V)),
    /// else 1; with --schedule-file and no --schedule, its stages over its rows.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub stages_per_rank: Option<usize>,
    /// Decoder layers of each model stage, e.g. `2,1,1` (default: an even split).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true, value_parser = count::<usize>)]
    pub layers_per_stage: Option<Vec<usize>>,
    /// m: microbatches per step. With --schedule-file, default those it names.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub microbatches: Option<usize>,
    /// B: sequences per microbatch (split over the --dp replicas: each runs B/dp of them).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub microbatch_size: Option<usize>,
    /// Data-parallel replicas of the pipeline (world = ranks × dp × tp threads, or processes
    /// under mpirun); must divide B. Default: the --ep degree (1 without it).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub dp: Option<usize>,
    /// Expert parallelism: each MoE layer's routed experts split over groups of this many
    /// data-parallel replicas, which exchange tokens by all-to-all (dispatch and combine);
    /// must divide --dp and the routed experts.
    #[arg(long, default_value_t = 1, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub ep: usize,
    /// FSDP (ZeRO-3) over the --dp replicas: parameters, gradients and AdamW state sharded,
    /// all-gathered before a stage computes (UNSHARD) and reduce-scattered after its last
    /// backward (REDUCE_GRAD). With --dp 1 the same as without.
    #[arg(long)]
    pub fsdp: bool,
    /// Tensor parallelism: each pipeline rank becomes this many ranks that split its decoder
    /// layers' matrices Megatron-style (attention heads and MLP width; an all-reduce after
    /// o_proj and down_proj; vocabulary-parallel embedding and LM head); must divide the heads,
    /// intermediate size and vocabulary, and the key/value heads (or be a multiple of them).
    /// The world is ranks × dp × tp.
    #[arg(long, default_value_t = 1, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub tp: usize,
    /// Sequence parallelism (Megatron's, with --tp): the residual stream, norms and the
    /// activations handed between stages split along the sequence over the tp ranks;
    /// all-gathers before the column-parallel blocks and reduce-scatters after the row-parallel
    /// ones replace the all-reduces. Needs --tp 2 or more dividing --seq-len, and a dense model.
    #[arg(long, requires = "tp")]
    pub sequence_parallel: bool,
    /// Where every rank computes: `cpu`, or `cuda` / `cuda:N` (a build with the `cuda` feature;
    /// the ranks run as threads sharing the GPU, the stage graphs on candle's CUDA kernels; not
    /// yet run on a GPU by the project: tools/gpu/check.sh is the prepared check). The
    /// environment variable GRAPHPP_KERNELS=composed runs those candle kernels on the CPU
    /// (`compiled`, the default, runs the CPU's own).
    #[arg(long, default_value = "cpu")]
    pub device: DeviceSpec,
}

/// The ids of [`LayoutArgs`]' flags, which a strategy file stands for (and so excludes).
pub const LAYOUT_FLAGS: [&str; 15] = [
    "schedule",
    "schedule_file",
    "group",
    "mem_cap",
    "ranks",
    "stages_per_rank",
    "layers_per_stage",
    "microbatches",
    "microbatch_size",
    "dp",
    "ep",
    "fsdp",
    "tp",
    "sequence_parallel",
    "device",
];

impl LayoutArgs {
    /// Takes the layout of strategy `s` (the flags its directives stand for).
    pub fn apply_strategy(&mut self, s: &Strategy) {
        self.schedule = Some(s.order.schedule);
        self.schedule_file = s.order.file.clone();
        self.group = s.order.group;
        self.mem_cap = s.order.mem_cap;
        self.ranks = Some(s.place.ranks);
        self.stages_per_rank = Some(s.stages_per_rank());
        self.layers_per_stage = s.place.layers_per_stage.clone();
        self.microbatches = Some(s.split.microbatches);
        self.microbatch_size = Some(s.split.microbatch_size);
        self.dp = Some(s.dp());
        self.fsdp = s.shard.fsdp;
        self.ep = s.shard.ep;
        self.tp = s.shard.tp;
        self.sequence_parallel = s.shard.sequence_parallel;
        self.device = s.place.device;
    }

    /// Data-parallel replicas: `--dp`, else the `--ep` degree.
    pub fn dp(&self) -> usize {
        self.dp.unwrap_or(self.ep)
    }

    /// The schedule kind, ranks and microbatches: the flags (or a strategy's), else what
    /// `--schedule-file` implies ([`LayoutArgs::take_schedule_file_shape`]), else `defaults`
    /// (train's; verify has none).
    ///
    /// # Errors
    /// One of them missing.
    pub fn shape(&self, defaults: Option<(Kind, usize, usize)>) -> Result<(Kind, usize, usize)> {
        let (k, p, m) = defaults.map_or((None, None, None), |(k, p, m)| (Some(k), Some(p), Some(m)));
        match (self.schedule.or(k), self.ranks.or(p), self.microbatches.or(m)) {
            (Some(k), Some(p), Some(m)) => Ok((k, p, m)),
            _ => bail!(
                "--schedule, --ranks and --microbatches are required (or --strategy, or --schedule-file)"
            ),
        }
    }

    /// Fills the shape flags not given from `--schedule-file`'s order: `--ranks` its rows,
    /// `--microbatches` the microbatches it names and, when `--schedule` is not given either,
    /// `--stages-per-rank` its stages over its rows and `--schedule` the kind the file implies
    /// (dualpipe for two parameter copies, dualpipev for OVERLAP_F_B actions, zbv for other V
    /// orders, 1f1b or interleaved-1f1b for the loop placement at one or more stages per rank).
    /// Given flags are kept: the run then checks the file against them and names what does not
    /// fit.
    ///
    /// # Errors
    /// The file cannot be read or is not a valid schedule (named with the flag); a placement that
    /// implies no kind without `--schedule`; idle rows, or stages that do not split evenly over
    /// the rows.
    pub fn take_schedule_file_shape(&mut self) -> Result<()> {
        let Some(path) = &self.schedule_file else { return Ok(()) };
        let shown = path.display();
        let order =
            graphpp::train::read_schedule_file(path).map_err(|e| anyhow!("--schedule-file {shown}: {e}"))?;
        let found = graphpp_schedule::validate(&order, &ValidateOptions::default())
            .map_err(|e| anyhow!("--schedule-file {shown}: not a valid schedule: {e}"))?;
        let p = found.ranks;
        if !found.idle_ranks.is_empty() || !found.stages.is_multiple_of(p) {
            bail!(
                "--schedule-file {shown}: its {p} rows hold {} stage(s), {}: every rank must run \
                 S/p of them",
                found.stages,
                if found.idle_ranks.is_empty() {
                    "which do not split evenly over them".to_string()
                } else {
                    format!("and rank(s) {:?} run nothing", found.idle_ranks)
                }
            );
        }
        self.ranks.get_or_insert(p);
        self.microbatches.get_or_insert(found.microbatches);
        if self.schedule.is_some() {
            // The kind given: its own default stages per rank, unless given too.
            return Ok(());
        }
        let v = found.stages / p;
        self.stages_per_rank.get_or_insert(v);
        let two_copies = order.route(0) != Some(0..found.stages);
        let overlapped = found.counts.overlap > 0;
        self.schedule = Some(match (found.placement, v) {
            _ if two_copies => Kind::DualPipe,
            _ if overlapped => Kind::DualPipeV,
            (Some(Placement::V), _) => Kind::Zbv,
            (Some(Placement::Loop), 1) => Kind::OneFOneB,
            (Some(Placement::Loop), _) => Kind::Interleaved1F1B,
            (None, _) => bail!(
                "--schedule-file {shown}: its stages are placed neither in a loop nor in a V: give \
                 its kind with --schedule"
            ),
        });
        Ok(())
    }

    /// B: `--microbatch-size`, else (a command without a default for it) one sequence per
    /// data-parallel replica, dp.
    pub fn microbatch_size(&self) -> usize {
        self.microbatch_size.unwrap_or_else(|| self.dp())
    }

    /// v: `--stages-per-rank`, else the kind's default.
    pub fn stages_per_rank(&self, kind: Kind) -> usize {
        self.stages_per_rank.unwrap_or_else(|| kind.default_stages_per_rank())
    }
}

/// The parallel layout a run's header line names, each degree above 1 (`dp=2 fsdp`, `ep=2`,
/// `tp=2 sequence-parallel`): what `train` and `verify` print.
pub fn parallel_parts(
    dp: usize,
    fsdp: bool,
    ep: usize,
    (tp, sequence_parallel): (usize, bool),
) -> Vec<String> {
    let mut parts = Vec::new();
    if dp > 1 || fsdp {
        parts.push(format!("dp={dp}{}", if fsdp { " fsdp" } else { "" }));
    }
    if ep > 1 {
        parts.push(format!("ep={ep}"));
    }
    if tp > 1 {
        parts.push(format!("tp={tp}{}", if sequence_parallel { " sequence-parallel" } else { "" }));
    }
    parts
}
