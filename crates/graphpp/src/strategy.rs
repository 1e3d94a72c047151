//! Strategies as data (after Piper's directives): a training strategy
//! is a small TOML (or JSON) file of six directives, each one decision about the distributed
//! step —
//!
//! | directive   | fields                                                   | flags it stands for |
//! |-------------|----------------------------------------------------------|---------------------|
//! | `place`     | `ranks`, `stages_per_rank`, `layers_per_stage`, `stages` | `--ranks`, `--stages-per-rank`, `--layers-per-stage` |
//! | `replicate` | `dp`                                                     | `--dp` |
//! | `shard`     | `fsdp`, `ep`                                             | `--fsdp`, `--ep` |
//! | `split`     | `microbatches`, `microbatch_size`                        | `--microbatches`, `--microbatch-size` |
//! | `order`     | `schedule`, `file`, `group`, `mem_cap`, `post_validate`  | `--schedule`, `--schedule-file`, `--group`, `--mem-cap`, `--post-validate` |
//! | `recompute` | `policy`                                                 | `--recompute` |
//!
//! `place.stages` lists the stages each rank holds (rank r's list is row r). The generators fix
//! the placement of each schedule kind (a loop for interleaved kinds, a V for ZB-V and
//! DualPipeV), so the field is checked, not chosen: a stage on no rank, or on other ranks than
//! `order.schedule` puts it, is an error. `--print-strategy` writes it, so a printed strategy
//! shows where every stage lives.
//!
//! `graphpp train --strategy FILE` (and `verify`) runs a strategy; `--print-strategy` prints the
//! strategy of the flags given. Errors name the directive and the field.

use std::path::{Path, PathBuf};

use graphpp_models::Recompute;
use graphpp_runtime::kernels::device::DeviceSpec;
use graphpp_schedule::{generate, Kind, Options, Shape};
use serde::{Deserialize, Serialize};

/// A training strategy: the six directives (see the module doc).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Strategy {
    /// Stages → ranks and layers → stages.
    pub place: Place,
    /// Data parallelism.
    #[serde(default)]
    pub replicate: Replicate,
    /// Sharding over the data-parallel replicas.
    #[serde(default)]
    pub shard: Shard,
    /// The batch into microbatches.
    pub split: Split,
    /// The order of the step's operations.
    pub order: Order,
    /// What the forward keeps for the backward.
    #[serde(default)]
    pub recompute: RecomputeDirective,
}

/// `place`: p pipeline ranks, v stages per rank, the decoder layers of each model stage, and
/// (checked) the stages each rank holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Place {
    /// p: pipeline ranks.
    pub ranks: usize,
    /// v: stages per rank (default: the schedule kind's, 2 for interleaved kinds and the V kinds
    /// (ZB-V, V-Half, V-Min, DualPipe(V)), else 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages_per_rank: Option<usize>,
    /// Decoder layers of each model stage (default: an even split).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers_per_stage: Option<Vec<usize>>,
    /// The stages of each rank, row r = rank r (checked against `order.schedule`'s placement).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages: Option<Vec<Vec<usize>>>,
    /// Where every rank computes (`--device`): `cpu` (the default) or `cuda` / `cuda:N`.
    #[serde(default, skip_serializing_if = "DeviceSpec::is_cpu")]
    pub device: DeviceSpec,
}

/// `replicate`: data-parallel replicas of the pipeline (the world is `ranks × dp × shard.tp`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Replicate {
    /// Replicas; must divide `split.microbatch_size`. Default: `shard.ep` (1 without it), as
    /// `--dp` defaults to `--ep` ([`Strategy::dp`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp: Option<usize>,
}

/// `shard`: FSDP (ZeRO-3) over the replicas, the expert-parallel degree, and the
/// tensor-parallel degree with or without sequence parallelism.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Shard {
    /// Parameters, gradients and AdamW state sharded over the replicas.
    #[serde(default)]
    pub fsdp: bool,
    /// Routed experts split over groups of this many replicas (MoE models); must divide `dp`.
    #[serde(default = "crate::train::one")]
    pub ep: usize,
    /// Tensor parallelism: each pipeline position split over this many ranks (Megatron's
    /// column- and row-parallel projections, vocabulary-parallel embedding and head); must divide
    /// the heads, MLP width and vocabulary, and the key/value heads (or be a multiple of them).
    /// The world is `place.ranks × dp × tp`.
    #[serde(default = "crate::train::one", skip_serializing_if = "is_one")]
    pub tp: usize,
    /// Sequence parallelism over the `tp` ranks (residual stream and hand-overs split along the
    /// sequence).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sequence_parallel: bool,
}

impl Default for Shard {
    fn default() -> Self {
        Shard { fsdp: false, ep: 1, tp: 1, sequence_parallel: false }
    }
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

/// `split`: m microbatches of B sequences per step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Split {
    /// m.
    pub microbatches: usize,
    /// B: sequences per microbatch (all replicas together).
    pub microbatch_size: usize,
}

/// `order`: the schedule kind — or a schedule file of one's own that keeps the kind's
/// placement — and the optimizer step's order against the global checks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Order {
    /// The named schedule kind (`zbv`, `1f1b`, `dualpipev`, …); with `file`, the placement
    /// family the file keeps.
    pub schedule: Kind,
    /// A compute-only schedule file (CSV or JSON) whose order runs instead of the kind's
    /// generated one; relative to the strategy file's folder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// `grouped-interleaved`: consecutive microbatches per chunk (default p).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<usize>,
    /// `zb-auto`, `zbv-auto`: activation-memory cap per rank in M_B units (default p).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_cap: Option<f64>,
    /// Optimizer post-validation (zero-bubble paper, section 4).
    #[serde(default)]
    pub post_validate: bool,
}

/// `recompute`: the activation-recomputation policy of every stage (absent: `pointwise`, the
/// `--recompute` default).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecomputeDirective {
    /// `pointwise`, `save-all`, `stage-inputs`, `matmuls` or `layers`.
    pub policy: Recompute,
}

/// A strategy file that cannot be run, naming the file and the directive and field.
#[derive(Debug, thiserror::Error)]
pub enum StrategyError {
    /// The file cannot be read.
    #[error("strategy file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not a strategy: bad syntax, an unknown directive or field, a missing one, a
    /// value of the wrong type (the parser's message names it, with its line).
    #[error("strategy file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A directive's field has an impossible value (in the file `path`, when read from one).
    #[error("{}: {directive}.{field}: {reason}", path.as_ref().map_or("strategy".to_string(), |p| format!("strategy file {}", p.display())))]
    Field {
        /// The strategy file, when the strategy came from one.
        path: Option<PathBuf>,
        /// The directive (`place`, `replicate`, …).
        directive: &'static str,
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
}

/// The most characters of one line of a parser's message that are echoed.
const ECHOED_LINE: usize = 160;

/// `message` with every line cut to [`ECHOED_LINE`] characters (the TOML parser echoes the
/// offending line whole, twice: a 10 MB line filled the terminal).
fn shorten(message: &str) -> String {
    let cut = |line: &str| match line.char_indices().nth(ECHOED_LINE) {
        Some((at, _)) => format!("{}… ({} more bytes)", &line[..at], line.len() - at),
        None => line.to_string(),
    };
    message.lines().map(cut).collect::<Vec<_>>().join("\n")
}

fn field(directive: &'static str, field: &'static str, reason: String) -> StrategyError {
    StrategyError::Field { path: None, directive, field, reason }
}

impl Strategy {
    /// Reads and checks a strategy file: JSON when its name ends in `.json`, else TOML.
    ///
    /// # Errors
    /// [`StrategyError::Read`], [`StrategyError::Parse`], and those of [`Strategy::check`].
    pub fn load(path: &Path) -> Result<Strategy, StrategyError> {
        let text = crate::textfile::read_text(path)
            .map_err(|source| StrategyError::Read { path: path.into(), source })?;
        let parse = |message: String| StrategyError::Parse { path: path.into(), message: shorten(&message) };
        let s: Strategy = if path.extension().is_some_and(|e| e == "json") {
            serde_json::from_str(&text).map_err(|e| parse(e.to_string()))?
        } else {
            toml::from_str(&text).map_err(|e| parse(e.to_string().trim_end().to_string()))?
        };
        let mut s = s;
        if let (Some(f), Some(dir)) = (&s.order.file, path.parent()) {
            s.order.file = Some(dir.join(f));
        }
        s.check().map_err(|e| match e {
            StrategyError::Field { directive, field, reason, .. } => {
                StrategyError::Field { path: Some(path.into()), directive, field, reason }
            }
            other => other,
        })?;
        Ok(s)
    }

    /// The TOML text of the strategy, with a header saying what it is.
    ///
    /// # Errors
    /// [`StrategyError::Field`] on `order.file` when its path is not UTF-8 (TOML cannot hold it).
    pub fn to_toml(&self) -> Result<String, StrategyError> {
        let body = toml::to_string(self).map_err(|e| field("order", "file", e.to_string()))?;
        Ok(format!("# graphpp strategy (graphpp train --strategy FILE)\n{body}"))
    }

    /// v: `place.stages_per_rank`, else the kind's default.
    pub fn stages_per_rank(&self) -> usize {
        self.place.stages_per_rank.unwrap_or_else(|| self.order.schedule.default_stages_per_rank())
    }

    /// The generator options of `order` (group, memory cap; default costs).
    pub fn options(&self) -> Options {
        Options { group: self.order.group, mem_cap: self.order.mem_cap, ..Options::default() }
    }

    /// Data-parallel replicas: `replicate.dp`, else `shard.ep`.
    pub fn dp(&self) -> usize {
        self.replicate.dp.unwrap_or(self.shard.ep)
    }

    /// The pipeline shape (p, v, m).
    pub fn shape(&self) -> Shape {
        Shape::new(self.place.ranks, self.stages_per_rank(), self.split.microbatches)
    }

    /// Checks what the file alone decides: counts ≥ 1; `replicate.dp` divides
    /// `split.microbatch_size`; `shard.ep` divides `replicate.dp`; `place.layers_per_stage` has
    /// one entry per model stage; `place.stages` is the placement `order.schedule` generates for
    /// the shape (every stage on exactly the rank the generator puts it).
    ///
    /// # Errors
    /// [`StrategyError::Field`] naming the directive and field.
    pub fn check(&self) -> Result<(), StrategyError> {
        for (d, f, v) in [
            ("place", "ranks", self.place.ranks),
            ("place", "stages_per_rank", self.stages_per_rank()),
            ("replicate", "dp", self.dp()),
            ("shard", "ep", self.shard.ep),
            ("shard", "tp", self.shard.tp),
            ("split", "microbatches", self.split.microbatches),
            ("split", "microbatch_size", self.split.microbatch_size),
        ] {
            if v == 0 {
                return Err(field(d, f, "must be at least 1".into()));
            }
        }
        let (dp, b) = (self.dp(), self.split.microbatch_size);
        if !b.is_multiple_of(dp) {
            return Err(field(
                "replicate",
                "dp",
                format!("{dp} replicas do not divide split.microbatch_size {b}"),
            ));
        }
        if !dp.is_multiple_of(self.shard.ep) {
            let reason = format!("{} does not divide replicate.dp {dp}", self.shard.ep);
            return Err(field("shard", "ep", reason));
        }
        let shape = self.shape();
        let model_stages = self.order.schedule.model_stages(&shape);
        if let Some(l) = self.place.layers_per_stage.as_ref().filter(|l| l.len() != model_stages) {
            let reason = format!("{} entries for the {model_stages} model stages of this placement", l.len());
            return Err(field("place", "layers_per_stage", reason));
        }
        if let Some(stages) = &self.place.stages {
            self.check_stages(stages, &shape)?;
        }
        if let Some(path) = &self.order.file {
            let bad = |e: String| field("order", "file", format!("{}: {e}", path.display()));
            let given = crate::train::read_schedule_file(path).map_err(bad)?;
            graphpp_runtime::train::build::compute_schedule(
                self.order.schedule,
                &shape,
                &self.options(),
                Some(&given),
            )
            .map_err(|e| bad(e.to_string()))?;
        }
        Ok(())
    }

    /// `place.stages` against the placement the schedule kind generates.
    fn check_stages(&self, stages: &[Vec<usize>], shape: &Shape) -> Result<(), StrategyError> {
        let bad = |reason: String| field("place", "stages", reason);
        if stages.len() != shape.ranks {
            return Err(bad(format!("{} rows for place.ranks = {}", stages.len(), shape.ranks)));
        }
        let kind = self.order.schedule;
        let generated =
            generated_stages(kind, shape, &self.options()).map_err(|e| field("order", "schedule", e))?;
        let total = generated.iter().flatten().max().map_or(0, |&s| s + 1);
        if let Some(s) = (0..total).find(|s| !stages.iter().any(|row| row.contains(s))) {
            return Err(bad(format!("stage {s} is on no rank")));
        }
        if let Some(s) = stages.iter().flatten().find(|&&s| s >= total) {
            return Err(bad(format!("stage {s} does not exist: the shape has stages 0..{total}")));
        }
        for (r, (want, got)) in generated.iter().zip(stages).enumerate() {
            let mut g = got.clone();
            g.sort_unstable();
            if &g != want {
                return Err(bad(format!("rank {r} holds stages {got:?}, but {kind} places {want:?} there")));
            }
        }
        Ok(())
    }

    /// The strategy of `c`'s settings, with the placement written out.
    ///
    /// # Errors
    /// [`StrategyError::Field`] on `order.schedule` when the kind cannot generate the shape.
    pub fn of_config(c: &crate::train::RunConfig) -> Result<Strategy, StrategyError> {
        let shape = Shape::new(c.ranks, c.stages_per_rank, c.microbatches);
        let stages = generated_stages(c.kind, &shape, &c.generator_options())
            .map_err(|e| field("order", "schedule", e))?;
        Ok(Strategy {
            place: Place {
                ranks: c.ranks,
                stages_per_rank: Some(c.stages_per_rank),
                layers_per_stage: c.layers_per_stage.clone(),
                stages: Some(stages),
                device: c.device,
            },
            replicate: Replicate { dp: Some(c.dp) },
            shard: Shard { fsdp: c.fsdp, ep: c.ep, tp: c.tp, sequence_parallel: c.sequence_parallel },
            split: Split { microbatches: c.microbatches, microbatch_size: c.microbatch_size },
            order: Order {
                schedule: c.kind,
                // Absolute: a printed strategy runs from any folder (`load` resolves a
                // relative one against the strategy file's folder).
                file: c.schedule_file.as_deref().map(std::path::absolute).transpose().map_err(|e| {
                    field(
                        "order",
                        "file",
                        format!("{}: {e}", c.schedule_file.as_deref().unwrap_or(Path::new("")).display()),
                    )
                })?,
                group: c.group,
                mem_cap: c.mem_cap,
                post_validate: c.post_validate,
            },
            recompute: RecomputeDirective { policy: c.recompute },
        })
    }
}

/// The stages each rank holds under `kind` at `shape` (sorted), from the generated schedule.
fn generated_stages(kind: Kind, shape: &Shape, options: &Options) -> Result<Vec<Vec<usize>>, String> {
    let s = generate(kind, shape, options).map_err(|e| e.to_string())?;
    let mut rows = vec![Vec::new(); shape.ranks];
    for (stage, ranks) in s.placement() {
        for r in ranks {
            if let Some(row) = rows.get_mut(r) {
                row.push(stage);
            }
        }
    }
    rows.iter_mut().for_each(|r| {
        r.sort_unstable();
        r.dedup();
    });
    Ok(rows)
}
