//! Named schedule generators (docs/ARCHITECTURE.md, "Schedules and reference figures").
//!
//! [`generate`] dispatches on [`Kind`]; each kind lives in its own module and documents its
//! constraints. A shape a kind cannot serve is a [`GenerateError::Constraint`] naming the rule.

use std::fmt;
use std::str::FromStr;

use crate::costs::{Costs, Memory};
use crate::placement::Placement;
use crate::schedule::Schedule;

pub use size::{check_size, estimate, human_bytes, ScheduleSize, BYTES_PER_ACTION, MAX_ACTIONS};

mod dualpipe;
mod gpipe;
mod grouped;
mod interleaved;
mod interleaved_zb;
mod looped_bfs;
mod one_f_one_b;
mod size;
mod tolerance;
mod v_shape;
mod zb_auto;
mod zb_h;
#[cfg(feature = "ilp")]
pub mod zb_ilp;
mod zbv;
mod zbv_auto;

/// A named schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// GPipe / all-forward-all-backward.
    Gpipe,
    /// 1F1B (PipeDream-flush).
    OneFOneB,
    /// Megatron interleaved 1F1B (v chunks per rank, loop placement).
    Interleaved1F1B,
    /// Looped BFS (breadth-first over chunks).
    LoopedBfs,
    /// Llama-3 style interleaving with N consecutive microbatches per chunk (`--group N`).
    GroupedInterleaved,
    /// Zero-bubble ZB-H1.
    ZbH1,
    /// Zero-bubble ZB-H2.
    ZbH2,
    /// Zero-bubble automatic heuristic (ZB-1p / ZB-2p) with real costs and a memory cap.
    ZbAuto,
    /// ZB-V (2 chunks, V placement): PyTorch's fixed order.
    Zbv,
    /// Cost-adaptive ZB-V: the zero-bubble authors' V heuristic with real costs and a memory cap.
    ZbvAuto,
    /// V-Half (V placement, v = 2): the V-Half building block of Qi et al. 2024, "Pipeline
    /// Parallelism with Controllable Memory", repeated and squeezed; peak ≈ half of 1F1B's.
    VHalf,
    /// V-Min (V placement, v = 2): the V-Min building block of Qi et al. 2024, "Pipeline
    /// Parallelism with Controllable Memory", repeated and squeezed; peak ≈ a third of 1F1B's.
    VMin,
    /// Interleaved zero bubble (PyTorch `ScheduleInterleavedZeroBubble`, ZB1P).
    InterleavedZb,
    /// DualPipe (bidirectional, two parameter copies).
    DualPipe,
    /// DualPipeV (DualPipe folded onto one V-shaped pipeline).
    DualPipeV,
}

impl Kind {
    /// Every kind, in the order `compare` lists them.
    pub const ALL: [Kind; 15] = [
        Kind::Gpipe,
        Kind::OneFOneB,
        Kind::Interleaved1F1B,
        Kind::LoopedBfs,
        Kind::GroupedInterleaved,
        Kind::ZbH1,
        Kind::ZbH2,
        Kind::ZbAuto,
        Kind::Zbv,
        Kind::ZbvAuto,
        Kind::VHalf,
        Kind::VMin,
        Kind::InterleavedZb,
        Kind::DualPipe,
        Kind::DualPipeV,
    ];

    /// The canonical CLI name (`gpipe`, `1f1b`, …).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Gpipe => "gpipe",
            Kind::OneFOneB => "1f1b",
            Kind::Interleaved1F1B => "interleaved-1f1b",
            Kind::LoopedBfs => "looped-bfs",
            Kind::GroupedInterleaved => "grouped-interleaved",
            Kind::ZbH1 => "zb-h1",
            Kind::ZbH2 => "zb-h2",
            Kind::ZbAuto => "zb-auto",
            Kind::Zbv => "zbv",
            Kind::ZbvAuto => "zbv-auto",
            Kind::VHalf => "v-half",
            Kind::VMin => "v-min",
            Kind::InterleavedZb => "interleaved-zb",
            Kind::DualPipe => "dualpipe",
            Kind::DualPipeV => "dualpipev",
        }
    }

    /// PyTorch's class name for the kind, where PyTorch ships it.
    pub fn pytorch_name(self) -> Option<&'static str> {
        Some(match self {
            Kind::Gpipe => "ScheduleGPipe",
            Kind::OneFOneB => "Schedule1F1B",
            Kind::Interleaved1F1B => "ScheduleInterleaved1F1B",
            Kind::LoopedBfs => "ScheduleLoopedBFS",
            Kind::InterleavedZb => "ScheduleInterleavedZeroBubble",
            Kind::Zbv => "ScheduleZBVZeroBubble",
            Kind::DualPipeV => "ScheduleDualPipeV",
            _ => return None,
        })
    }

    /// The kind's shape constraints, as shown by `graphpp schedule compare` (each generator checks
    /// them and names the one that failed).
    pub fn constraints(self) -> &'static str {
        match self {
            Kind::Gpipe | Kind::OneFOneB => "v = 1; any m",
            Kind::Interleaved1F1B => "loop placement, v >= 1",
            Kind::LoopedBfs => "loop placement, v >= 1",
            Kind::GroupedInterleaved => "loop placement, p <= N <= m, N divides m",
            Kind::ZbH1 | Kind::ZbH2 => "v = 1",
            Kind::ZbAuto => "v = 1; memory cap >= 1 M_B",
            Kind::Zbv => "V placement, v = 2",
            Kind::ZbvAuto => "V placement, v = 2; memory cap >= 1 M_B",
            Kind::VHalf | Kind::VMin => "V placement, v = 2",
            Kind::InterleavedZb => "loop placement, v >= 1",
            Kind::DualPipe => "V placement, v = 2, p even, m even, m >= 2p; two parameter copies",
            Kind::DualPipeV => "V placement, v = 2, m >= 2p",
        }
    }

    /// The stages per rank `v` the kind uses when none is given: 2 where the kind interleaves
    /// chunks (interleaved kinds, the V kinds: ZB-V, V-Half, V-Min, DualPipe, DualPipeV), else 1.
    pub fn default_stages_per_rank(self) -> usize {
        match self {
            Kind::Interleaved1F1B
            | Kind::LoopedBfs
            | Kind::GroupedInterleaved
            | Kind::InterleavedZb
            | Kind::Zbv
            | Kind::ZbvAuto
            | Kind::VHalf
            | Kind::VMin
            | Kind::DualPipe
            | Kind::DualPipeV => 2,
            _ => 1,
        }
    }

    /// Copies of the model the kind's stages hold: 2 for DualPipe (its `2p` stages are two
    /// copies of a `p`-stage split, one per direction; DeepSeek-V3 report §3.2.1), else 1.
    pub fn model_copies(self) -> usize {
        if self == Kind::DualPipe {
            2
        } else {
            1
        }
    }

    /// Model stages of the kind at `shape`: the schedule's `S = p·v` stages, except where the
    /// kind holds [`Kind::model_copies`] copies: DualPipe's `2p` stages (v = 2) are two copies of
    /// a `p`-stage split.
    pub fn model_stages(self, shape: &Shape) -> usize {
        if self.model_copies() > 1 {
            shape.ranks
        } else {
            shape.stages()
        }
    }

    /// The placement the kind uses.
    pub fn placement(self) -> Placement {
        match self {
            Kind::Zbv | Kind::ZbvAuto | Kind::VHalf | Kind::VMin | Kind::DualPipe | Kind::DualPipeV => {
                Placement::V
            }
            _ => Placement::Loop,
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown schedule kind name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown schedule kind `{0}`; known: gpipe, 1f1b, interleaved-1f1b, looped-bfs, grouped-interleaved, zb-h1, zb-h2, zb-auto, zbv, zbv-auto, v-half, v-min, interleaved-zb, dualpipe, dualpipev (PyTorch class names accepted)")]
pub struct UnknownKind(pub String);

/// Serialised as its canonical name (`"zbv"`, `"1f1b"`, …).
impl serde::Serialize for Kind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

/// Deserialised from any name [`Kind::from_str`] accepts.
impl<'de> serde::Deserialize<'de> for Kind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

impl FromStr for Kind {
    type Err = UnknownKind;

    /// Canonical names, or PyTorch class names (case-insensitive, with or without `Schedule`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let norm: String =
            s.to_ascii_lowercase().chars().filter(|c| c.is_ascii_alphanumeric()).collect::<String>();
        let norm = norm.strip_prefix("schedule").unwrap_or(&norm).to_string();
        let kind = match norm.as_str() {
            "gpipe" | "afab" => Kind::Gpipe,
            "1f1b" => Kind::OneFOneB,
            "interleaved1f1b" => Kind::Interleaved1F1B,
            "loopedbfs" => Kind::LoopedBfs,
            "groupedinterleaved" | "llama3" => Kind::GroupedInterleaved,
            "zbh1" => Kind::ZbH1,
            "zbh2" => Kind::ZbH2,
            "zbauto" | "zb1p" | "zb2p" => Kind::ZbAuto,
            "zbv" | "zbvzerobubble" => Kind::Zbv,
            "zbvauto" => Kind::ZbvAuto,
            // The authors' Megatron names the two `zbv-half` / `zbv-min` (`--zero-bubble-v-schedule-mem-setup`).
            "vhalf" | "zbvhalf" => Kind::VHalf,
            "vmin" | "zbvmin" => Kind::VMin,
            "interleavedzb" | "interleavedzerobubble" => Kind::InterleavedZb,
            "dualpipe" => Kind::DualPipe,
            "dualpipev" => Kind::DualPipeV,
            _ => return Err(UnknownKind(s.to_string())),
        };
        Ok(kind)
    }
}

/// The shape of a pipeline: `p` ranks, `v` stages per rank (`S = p·v`), `m` microbatches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Shape {
    /// p.
    pub ranks: usize,
    /// v.
    pub stages_per_rank: usize,
    /// m.
    pub microbatches: usize,
}

impl Shape {
    /// A shape.
    pub fn new(ranks: usize, stages_per_rank: usize, microbatches: usize) -> Self {
        Shape { ranks, stages_per_rank, microbatches }
    }
    /// S = p·v.
    pub fn stages(&self) -> usize {
        self.ranks * self.stages_per_rank
    }
}

/// Knobs some generators read; the rest ignore them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Options {
    /// `grouped-interleaved`: N consecutive microbatches per chunk (default p).
    pub group: Option<usize>,
    /// `zb-auto`, `zbv-auto`: real T_F, T_I, T_W and c (per action, i.e. per chunk for zbv-auto).
    pub costs: Costs,
    /// `zb-auto`, `zbv-auto`: memory model.
    pub memory: Memory,
    /// `zb-auto`, `zbv-auto`: activation-memory cap per rank in M_B units (default p: ZB-1p, and
    /// ZB-V at 1F1B's peak).
    pub mem_cap: Option<f64>,
    /// `zb-auto`: how the order is found (default the heuristic).
    pub solver: Solver,
}

/// How `zb-auto` finds its order (`--solver`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Solver {
    /// The zero-bubble paper's heuristic (§3.1), milliseconds at any shape.
    #[default]
    Heuristic,
    /// The zero-bubble paper's ILP (§3.1) solved by HiGHS, warm-started from the heuristic and
    /// stopped after `time_limit`: never slower than the heuristic. Needs the `ilp` cargo
    /// feature (HiGHS is built from source: cmake and a C++ compiler).
    Ilp {
        /// Wall-clock limit of the solve.
        time_limit: std::time::Duration,
    },
}

/// Why a solver name and time limit do not make a [`Solver`] (each front end words it with its
/// own flag or argument names).
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum SolverError {
    /// A time limit given with the heuristic, which has none.
    #[error("a time limit applies to the ilp solver only")]
    TimeLimitWithHeuristic,
    /// A time limit that is not a finite number of seconds in (0, 1e6].
    #[error("the time limit must be a number of seconds in (0, 1e6], got {0}")]
    TimeLimit(f64),
}

impl Solver {
    /// The ILP's time limit when none is given, in seconds.
    pub const DEFAULT_TIME_LIMIT_S: f64 = 10.0;

    /// The heuristic (`ilp = false`) or the ILP with `time_limit` seconds (default
    /// [`Solver::DEFAULT_TIME_LIMIT_S`]).
    ///
    /// # Errors
    /// [`SolverError::TimeLimitWithHeuristic`] for a time limit with the heuristic;
    /// [`SolverError::TimeLimit`] for one outside (0, 1e6] seconds or not finite.
    pub fn new(ilp: bool, time_limit: Option<f64>) -> Result<Solver, SolverError> {
        match (ilp, time_limit) {
            (false, None) => Ok(Solver::Heuristic),
            (false, Some(_)) => Err(SolverError::TimeLimitWithHeuristic),
            (true, t) => {
                let secs = t.unwrap_or(Self::DEFAULT_TIME_LIMIT_S);
                if !(secs.is_finite() && secs > 0.0 && secs <= 1e6) {
                    return Err(SolverError::TimeLimit(secs));
                }
                Ok(Solver::Ilp { time_limit: std::time::Duration::from_secs_f64(secs) })
            }
        }
    }
}

/// The `--solver` name: `heuristic` or `ilp`.
impl fmt::Display for Solver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Solver::Heuristic => "heuristic",
            Solver::Ilp { .. } => "ilp",
        })
    }
}

/// Why a generator cannot produce a schedule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GenerateError {
    /// The solver asked for is not in this build (the ILP needs the `ilp` cargo feature).
    #[error(
        "the `{solver}` solver (--solver {solver}) is not in this build: rebuild with `--features ilp` (HiGHS, built from \
         source: needs cmake and a C++ compiler)"
    )]
    SolverUnavailable {
        /// The solver asked for.
        solver: Solver,
    },
    /// The schedule would be too large to build (see [`check_size`]); nothing was allocated.
    #[error(
        "{kind} at ranks={ranks}, stages-per-rank={stages_per_rank}, microbatches={microbatches} would \
         build {:.1e} actions (≈ {} of memory); the limit is {:.1e} actions (≈ {}): lower --ranks, \
         --stages-per-rank or --microbatches",
        *.actions as f64,
        human_bytes(*.bytes),
        MAX_ACTIONS as f64,
        human_bytes(MAX_ACTIONS * BYTES_PER_ACTION)
    )]
    TooLarge {
        /// The kind.
        kind: Kind,
        /// p.
        ranks: usize,
        /// v.
        stages_per_rank: usize,
        /// m.
        microbatches: usize,
        /// Actions the generator would build ([`ScheduleSize::built`]).
        actions: u128,
        /// Estimated bytes ([`ScheduleSize::bytes`]).
        bytes: u128,
    },
    /// An option was given to a kind that does not read it (it would be silently ignored).
    #[error("{kind} does not use {option}; it applies to {} only", kind_list(.applies_to))]
    UnusedOption {
        /// The kind.
        kind: Kind,
        /// The option, with its flag (`a group size (--group)`).
        option: &'static str,
        /// The kinds that read it.
        applies_to: &'static [Kind],
    },
    /// The shape breaks one of the kind's documented constraints.
    #[error("{kind} cannot serve ranks={ranks}, stages-per-rank={stages_per_rank}, microbatches={microbatches}: {constraint}")]
    Constraint {
        /// The kind.
        kind: Kind,
        /// p.
        ranks: usize,
        /// v.
        stages_per_rank: usize,
        /// m.
        microbatches: usize,
        /// The rule that failed, e.g. `needs m >= 2p (m=6, 2p=8)`.
        constraint: String,
    },
}

impl GenerateError {
    /// A constraint failure for `kind` at `shape`.
    pub fn constraint(kind: Kind, shape: &Shape, constraint: impl Into<String>) -> Self {
        GenerateError::Constraint {
            kind,
            ranks: shape.ranks,
            stages_per_rank: shape.stages_per_rank,
            microbatches: shape.microbatches,
            constraint: constraint.into(),
        }
    }
}

/// Checks `cond`, else a [`GenerateError::Constraint`] with the message.
pub(crate) fn require(
    cond: bool,
    kind: Kind,
    shape: &Shape,
    msg: impl FnOnce() -> String,
) -> Result<(), GenerateError> {
    if cond {
        Ok(())
    } else {
        Err(GenerateError::constraint(kind, shape, msg()))
    }
}

/// The checks the cost- and memory-aware kinds (zb-auto, zbv-auto) share; returns the memory cap
/// in M_B units (`opts.mem_cap`, default `p`).
///
/// # Errors
/// [`GenerateError::Constraint`] when a cost is not finite and `>= 0`, when `0 <= M_W < M_B`
/// fails, or when the cap is not finite or below 1 M_B.
pub(crate) fn check_model(kind: Kind, shape: &Shape, opts: &Options) -> Result<f64, GenerateError> {
    let c = &opts.costs;
    let ok = |x: f64| x.is_finite() && x >= 0.0;
    require([c.f, c.i, c.w, c.comm].into_iter().all(ok), kind, shape, || {
        format!("costs must be finite and >= 0 (F={}, I={}, W={}, C={})", c.f, c.i, c.w, c.comm)
    })?;
    let mem = &opts.memory;
    require(ok(mem.m_w) && mem.m_b.is_finite() && mem.m_w < mem.m_b, kind, shape, || {
        format!("memory needs 0 <= M_W < M_B (M_B={}, M_W={})", mem.m_b, mem.m_w)
    })?;
    let cap = opts.mem_cap.unwrap_or(shape.ranks as f64);
    require(cap.is_finite(), kind, shape, || {
        format!("the memory cap must be a finite number of M_B units (cap={cap}); omit --mem-cap for the default p")
    })?;
    require(cap >= 1.0, kind, shape, || format!("memory cap must be at least 1 M_B (cap={cap})"))?;
    Ok(cap)
}

/// Checks the constraints every kind shares: p ≥ 1, v ≥ 1, m ≥ 1.
pub(crate) fn check_common(kind: Kind, shape: &Shape) -> Result<(), GenerateError> {
    require(shape.ranks >= 1, kind, shape, || "needs at least 1 rank".into())?;
    require(shape.stages_per_rank >= 1, kind, shape, || "needs at least 1 stage per rank".into())?;
    require(shape.microbatches >= 1, kind, shape, || "needs at least 1 microbatch".into())
}

fn kind_list(kinds: &[Kind]) -> String {
    kinds.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ")
}

/// Refuses an option `kind` does not read: `group` outside grouped-interleaved, `mem_cap` outside
/// zb-auto and zbv-auto, a solver other than the heuristic outside zb-auto (`costs` and `memory` are shared with the simulator and never refused).
fn check_options(kind: Kind, opts: &Options) -> Result<(), GenerateError> {
    let unused: [(bool, &str, &'static [Kind]); 3] = [
        (opts.group.is_some(), "a group size (--group)", &[Kind::GroupedInterleaved]),
        (opts.mem_cap.is_some(), "a memory cap (--mem-cap)", &[Kind::ZbAuto, Kind::ZbvAuto]),
        (opts.solver != Solver::Heuristic, "a solver (--solver)", &[Kind::ZbAuto]),
    ];
    match unused.into_iter().find(|&(given, _, readers)| given && !readers.contains(&kind)) {
        Some((_, option, applies_to)) => Err(GenerateError::UnusedOption { kind, option, applies_to }),
        None => Ok(()),
    }
}

/// Generates the compute-only schedule of `kind` for `shape`.
///
/// # Errors
/// [`GenerateError::Constraint`] when the shape breaks a constraint of the kind,
/// [`GenerateError::UnusedOption`] for an option the kind does not read, [`GenerateError::TooLarge`]
/// (before allocating) when the schedule would exceed [`MAX_ACTIONS`].
pub fn generate(kind: Kind, shape: &Shape, opts: &Options) -> Result<Schedule, GenerateError> {
    check_common(kind, shape)?;
    check_options(kind, opts)?;
    check_size(kind, shape)?;
    match kind {
        Kind::Gpipe => gpipe::generate(shape),
        Kind::OneFOneB => one_f_one_b::generate(shape),
        Kind::Interleaved1F1B => interleaved::generate(shape),
        Kind::LoopedBfs => looped_bfs::generate(shape),
        Kind::GroupedInterleaved => grouped::generate(shape, opts),
        Kind::ZbH1 => zb_h::generate_h1(shape),
        Kind::ZbH2 => zb_h::generate_h2(shape),
        Kind::ZbAuto => zb_auto::generate(shape, opts),
        Kind::Zbv => zbv::generate(shape),
        Kind::ZbvAuto => zbv_auto::generate(shape, opts),
        Kind::VHalf => v_shape::generate_v_half(shape),
        Kind::VMin => v_shape::generate_v_min(shape),
        Kind::InterleavedZb => interleaved_zb::generate(shape),
        Kind::DualPipe => dualpipe::generate_dualpipe(shape),
        Kind::DualPipeV => dualpipe::generate_dualpipev(shape),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_aliases() {
        for k in Kind::ALL {
            assert_eq!(k.name().parse::<Kind>().unwrap(), k);
            if let Some(t) = k.pytorch_name() {
                assert_eq!(t.parse::<Kind>().unwrap(), k);
                assert_eq!(t.to_ascii_uppercase().parse::<Kind>().unwrap(), k);
            }
        }
        assert!("zz".parse::<Kind>().is_err());
        for (name, kind) in [
            ("V-Half", Kind::VHalf),
            ("zbv-half", Kind::VHalf),
            ("v_min", Kind::VMin),
            ("zbv-min", Kind::VMin),
        ] {
            assert_eq!(name.parse::<Kind>().unwrap(), kind, "{name}");
        }
        for k in Kind::ALL {
            assert!(
                UnknownKind(String::new()).to_string().contains(&format!(" {},", k.name()))
                    || k == Kind::DualPipeV,
                "{k}"
            );
        }
    }

    #[test]
    fn an_option_the_kind_ignores_is_refused() {
        let shape = Shape::new(2, 2, 4);
        let e = generate(Kind::Zbv, &shape, &Options { group: Some(2), ..Options::default() }).unwrap_err();
        assert_eq!(
            e.to_string(),
            "zbv does not use a group size (--group); it applies to grouped-interleaved only"
        );
        let e = generate(
            Kind::OneFOneB,
            &Shape::new(2, 1, 4),
            &Options { mem_cap: Some(3.0), ..Options::default() },
        )
        .unwrap_err();
        assert!(
            matches!(e, GenerateError::UnusedOption { applies_to: [Kind::ZbAuto, Kind::ZbvAuto], .. }),
            "{e:?}"
        );
        assert!(e.to_string().ends_with("it applies to zb-auto, zbv-auto only"), "{e}");
        assert!(generate(
            Kind::GroupedInterleaved,
            &shape,
            &Options { group: Some(2), ..Options::default() }
        )
        .is_ok());
        let zb = Options { mem_cap: Some(3.0), ..Options::default() };
        assert!(generate(Kind::ZbAuto, &Shape::new(2, 1, 4), &zb).is_ok());
    }
}
