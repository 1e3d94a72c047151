//! A training run on text: the corpus, the sampler, the pipelined [`Trainer`], evaluation,
//! checkpoints and resume — what `graphpp train` drives step by step (docs/ARCHITECTURE.md "Models,
//! data, training").
//!
//! Each step draws `m·B` windows of `T + 1` byte tokens from the training split with a
//! [`Batcher`] (batch `k` depends only on (seed, k)) and cuts them into `m` microbatches of `B`.
//! Validation uses a fixed set of windows of the validation split (the last 10% of the corpus),
//! the same for every seed, so curves of different runs compare.
//!
//! A checkpoint holds every distinct parameter and its AdamW moments (safetensors, f32) and a JSON
//! sidecar with the optimizer step, the sampler position and the run's settings. Resuming checks
//! that the settings that decide the loss sequence match (model, B, T, m, seed, data, learning
//! rate schedule); the schedule kind and the number of ranks may differ — a checkpoint does not
//! depend on the pipeline layout.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use candle_core::Tensor;
use graphpp_comm::Comm;
use graphpp_models::{Model, ModelConfig, Recompute};
use graphpp_runtime::kernels::tensor::{tensor_u32, to_f64};
use graphpp_runtime::{
    AdamWConfig, CosineSchedule, LrError, Microbatches, SetupError, StepReport, TrainError, TrainSetup,
    Trainer,
};
use graphpp_schedule::{Kind, Options, Shape};
use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, CheckpointError, NamedTensor};
use crate::data::{self, Batcher, ByteTokenizer, DataError};

/// Fraction of the corpus (its end) held out for validation.
pub const VAL_FRACTION: f64 = 0.1;
/// Validation windows: sequences of `T` tokens evaluated at every evaluation.
pub const VAL_SEQUENCES: usize = 64;
/// Stream of the validation windows (independent of `--seed`).
const VAL_STREAM: u64 = 0x7a1d_a7e5;

/// Why a run could not start or continue; each names the input at fault.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A setting is out of range (`--ranks 0`, `--steps 0`, …).
    #[error("{0}")]
    Config(String),
    /// `--device` (or a strategy's `place.device`) names a device this build or machine cannot
    /// open.
    #[error("--device (or a strategy's place.device): {0}")]
    Device(#[from] graphpp_runtime::kernels::device::DeviceError),
    /// The corpus could not be read or fetched.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A checkpoint could not be written or read.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The checkpoint was written by a run with other settings.
    #[error("{path}: cannot resume: {reason}")]
    Resume {
        /// The checkpoint sidecar.
        path: PathBuf,
        /// Which setting differs.
        reason: String,
    },
    /// Bad learning-rate settings.
    #[error("learning rate: {0}")]
    Lr(#[from] LrError),
    /// A fresh run was pointed at a checkpoint folder that holds another run's checkpoints.
    #[error(
        "--checkpoint-dir {dir} holds checkpoints of run {run_id} (newest: step {step}); continue it with \
         --resume, choose another folder, or pass --start-over to delete them"
    )]
    FolderInUse {
        /// The folder.
        dir: PathBuf,
        /// The identity of the run whose checkpoints it holds.
        run_id: String,
        /// Its newest checkpoint's step.
        step: u64,
    },
    /// Building the pipeline or a step failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// A tensor operation failed.
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The `--init-from` model folder could not be loaded.
    #[error("--init-from: {0}")]
    Pretrained(#[from] crate::pretrained::PretrainedError),
}

/// The settings of a run (the `graphpp train` flags); the ones that decide the loss sequence are
/// recorded in every checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    /// Model name as given (a preset such as `tiny` or `moe-tiny`, or a config path), for display.
    pub model_name: String,
    /// The model.
    pub model: ModelConfig,
    /// Schedule kind (with `schedule_file`, the placement family the file keeps).
    pub kind: Kind,
    /// A compute-only schedule file (CSV or JSON) whose order the run follows instead of
    /// `kind`'s generated one (`--schedule-file`; it must keep `kind`'s placement).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule_file: Option<PathBuf>,
    /// `grouped-interleaved`: consecutive microbatches per chunk (`--group`; default p).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<usize>,
    /// `zb-auto`, `zbv-auto`: activation-memory cap per rank in M_B units (`--mem-cap`; default p).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_cap: Option<f64>,
    /// p: ranks (one thread each).
    pub ranks: usize,
    /// v: stages per rank.
    pub stages_per_rank: usize,
    /// m: microbatches per step.
    pub microbatches: usize,
    /// B: sequences per microbatch (split over the data-parallel replicas).
    pub microbatch_size: usize,
    /// Data-parallel replicas of the pipeline (`--dp`; world = ranks × dp × tp threads); absent in
    /// checkpoints made before it existed (1).
    #[serde(default = "one")]
    pub dp: usize,
    /// FSDP over the data-parallel replicas (`--fsdp`); a layout setting, free to change on
    /// resume.
    #[serde(default)]
    pub fsdp: bool,
    /// Expert-parallel degree over the replicas (`--ep`; 1: none); a layout setting, free to
    /// change on resume (a checkpoint holds every expert).
    #[serde(default = "one")]
    pub ep: usize,
    /// Tensor-parallel degree of each pipeline position (`--tp`; world = ranks × dp × tp
    /// threads); a layout setting, free to change on resume (a checkpoint holds whole tensors).
    #[serde(default = "one")]
    pub tp: usize,
    /// Sequence parallelism over the tp ranks (`--sequence-parallel`); a layout setting, free
    /// to change on resume.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sequence_parallel: bool,
    /// Optimizer post-validation (`--post-validate`); bitwise the synchronous step, free to
    /// change on resume.
    #[serde(default)]
    pub post_validate: bool,
    /// T: tokens per sequence.
    pub seq_len: usize,
    /// Decoder layers of each model stage; `None` splits evenly.
    pub layers_per_stage: Option<Vec<usize>>,
    /// Optimizer steps of the whole run (the cosine schedule ends here).
    pub steps: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate (the cosine floor).
    pub min_lr: f64,
    /// Linear warm-up steps.
    pub warmup: u64,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// Global gradient-norm bound; `None` disables clipping.
    pub grad_clip: Option<f64>,
    /// Seed of the weights and of the training windows.
    pub seed: u64,
    /// Corpus file or folder; `None` is the Shakespeare corpus from the cache.
    pub data: Option<PathBuf>,
    /// Activation recomputation (memory for compute; the losses do not change).
    #[serde(default)]
    pub recompute: Recompute,
    /// Hugging Face model folder whose weights replace the seeded initial ones (`--init-from`);
    /// `model` must be its `config.json`.
    #[serde(default)]
    pub init_from: Option<PathBuf>,
    /// Compute dtype of the stage graphs (`--dtype`); absent in checkpoints made before it
    /// existed, which were f32.
    #[serde(default)]
    pub dtype: graphpp_graph::DType,
    /// Bias update speed γ of MoE load balancing (`--expert-bias-update`; DeepSeek-V3's 0.001);
    /// unused by a dense model.
    #[serde(default = "default_expert_bias_update")]
    pub expert_bias_update: f64,
    /// An emulated interconnect (`--link`): every message and collective takes its latency plus
    /// bytes over its bandwidth. It changes the timing, never the losses.
    #[serde(default)]
    pub link: Option<graphpp_comm::LinkModel>,
    /// How long a rank waits for a message or a collective before the run fails naming the ranks
    /// it waited for (`--timeout`, seconds; a silent peer — hung, stopped, on a dead host — ends
    /// the run); free to change on resume.
    #[serde(default = "default_timeout")]
    pub timeout: f64,
    /// Where every rank computes (`--device`); absent in checkpoints made before it existed,
    /// which ran on the CPU. Free to change on resume.
    #[serde(default)]
    pub device: graphpp_runtime::kernels::device::DeviceSpec,
}

/// `--timeout`'s default: 300 s (PyTorch's process groups wait 10–30 minutes). A healthy peer
/// answers within one step, except while the leader evaluates, samples or writes a checkpoint
/// alone: the timeout must exceed those.
pub fn default_timeout() -> f64 {
    300.0
}

/// The default of [`RunConfig::expert_bias_update`]: DeepSeek-V3's γ (technical report §4.2).
pub fn default_expert_bias_update() -> f64 {
    0.001
}

/// The default of [`RunConfig::dp`] (and of the other counts that default to one).
pub(crate) fn one() -> usize {
    1
}

impl RunConfig {
    /// Checks the ranges the pipeline and the optimizer need, then the run's setup with
    /// [`TrainSetup::check`] (dp dividing B, ep, the sizes from estimates, the schedule: all
    /// before the corpus is read or anything is built). Errors: [`RunError::Config`] naming the
    /// flag; [`RunError::Train`] ([`TrainError::Size`]) when the schedule or the step would be
    /// too large, or another setup error.
    pub fn validate(&self) -> Result<(), RunError> {
        let positive = [
            ("--ranks", self.ranks),
            ("--stages-per-rank", self.stages_per_rank),
            ("--microbatches", self.microbatches),
            ("--microbatch-size", self.microbatch_size),
            ("--seq-len", self.seq_len),
            ("--ep", self.ep),
            ("--dp", self.dp),
            ("--tp", self.tp),
        ];
        if let Some((flag, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(RunError::Config(format!("{flag} must be at least 1")));
        }
        if self.steps == 0 {
            return Err(RunError::Config("--steps must be at least 1".into()));
        }
        if !(self.timeout > 0.0 && self.timeout.is_finite() && self.timeout <= 1e7) {
            return Err(RunError::Config(format!(
                "--timeout {} must be a number of seconds above 0 (at most 10⁷)",
                self.timeout
            )));
        }
        if !(self.expert_bias_update >= 0.0 && self.expert_bias_update.is_finite()) {
            return Err(RunError::Config(format!(
                "--expert-bias-update {} must be a finite number >= 0",
                self.expert_bias_update
            )));
        }
        if self.seq_len > self.model.max_seq_len() {
            return Err(RunError::Config(format!(
                "--seq-len {} exceeds the model's max_position_embeddings {}",
                self.seq_len,
                self.model.max_seq_len()
            )));
        }
        if self.model.vocab_size() < ByteTokenizer::VOCAB {
            return Err(RunError::Config(format!(
                "the model's vocab_size {} is below the byte tokenizer's {}",
                self.model.vocab_size(),
                ByteTokenizer::VOCAB
            )));
        }
        let setup = train_setup(self)?;
        // A given order is checked against its kind here, so that its error names the flag; a
        // generated schedule is made once, by the trainer.
        let checked = match &self.schedule_file {
            Some(_) => setup.compute_schedule().map(drop),
            None => setup.check(),
        };
        match (checked, &self.schedule_file) {
            (Err(TrainError::BatchNotDivisible { batch, dp }), _) => {
                Err(RunError::Config(dp_not_dividing(dp, batch)))
            }
            // The setup's only schedule errors: a given order that does not fit, or the kind
            // that cannot serve the shape it is checked against.
            (
                Err(TrainError::Setup(e @ (SetupError::ScheduleFile(_) | SetupError::Generate(_)))),
                Some(path),
            ) => Err(RunError::Config(format!(
                "--schedule-file {}: {e} {}",
                path.display(),
                order_hint(self.kind)
            ))),
            (r, _) => r.map_err(RunError::from),
        }
    }

    /// The generator options of the run's schedule kind (`--group`, `--mem-cap`; default costs).
    pub fn generator_options(&self) -> Options {
        Options { group: self.group, mem_cap: self.mem_cap, ..Options::default() }
    }

    /// Seconds one activation (or its gradient) takes between two ranks over the emulated link:
    /// its latency plus `B/dp · T · D` values of the compute dtype over its bandwidth; 0 without
    /// a link.
    pub fn hop_seconds(&self) -> f64 {
        let Some(link) = self.link else { return 0.0 };
        let values = self.microbatch_size / self.dp.max(1) * self.seq_len * self.model.base().hidden_size;
        link.delay((values * self.dtype.size_bytes()) as f64).as_secs_f64()
    }

    /// Tokens per optimizer step: m·B·T.
    pub fn tokens_per_step(&self) -> usize {
        self.microbatches * self.microbatch_size * self.seq_len
    }

    /// Ranks of the whole run: pipeline ranks × data-parallel replicas × tensor-parallel degree.
    pub fn world(&self) -> usize {
        self.ranks * self.dp * self.tp
    }

    /// What must match for a resumed run to continue the same loss sequence: everything but the
    /// pipeline layout (kind, ranks, v, layer split, dp replicas, ep, tp, sequence parallelism), the recompute policy, the emulated link, the device, the display name, the
    /// `--init-from` folder (the checkpoint's parameters replace the initial ones; the model must
    /// match) and the run's length (`--steps` may grow to extend a finished run: the
    /// learning-rate schedule is then the new one from the resumed step on).
    fn resume_key(&self) -> RunConfig {
        RunConfig {
            model_name: String::new(),
            kind: Kind::Gpipe,
            schedule_file: None,
            group: None,
            mem_cap: None,
            ranks: 0,
            stages_per_rank: 0,
            dp: 0,
            fsdp: false,
            ep: 0,
            tp: 0,
            sequence_parallel: false,
            post_validate: false,
            layers_per_stage: None,
            steps: 0,
            recompute: Recompute::SaveAll,
            init_from: None,
            link: None,
            timeout: 0.0,
            device: Default::default(),
            ..self.clone()
        }
    }
}

/// What a checkpoint's sidecar records besides the step.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct SavedState {
    /// The identity of the run that wrote it (one per checkpoint folder).
    #[serde(default)]
    run_id: String,
    config: RunConfig,
    /// Training batches drawn (the [`Batcher`] position).
    batches: u64,
    /// Validation loss at this step, if evaluated.
    val_loss: Option<f64>,
}

/// A training run: corpus splits, sampler and trainer.
#[derive(Debug)]
pub struct Run {
    /// This run's identity, written into every checkpoint; a resumed run takes the checkpoint's.
    run_id: String,
    config: RunConfig,
    trainer: Trainer,
    /// Tokens of the validation split.
    val_tokens: usize,
    train: Vec<u32>,
    val: Vec<(Vec<u32>, Vec<u32>)>,
    batcher: Batcher,
}

impl Run {
    /// Reads the corpus (fetching Shakespeare on first use), builds the pipeline, every rank a
    /// thread of this process, and the initial weights. Nothing is written.
    ///
    /// # Errors
    /// [`RunError::Config`], [`RunError::Data`] (missing path, not UTF-8, too short),
    /// [`RunError::Lr`], [`RunError::Train`] (the schedule does not fit the shape, the layers do
    /// not divide into the stages).
    pub fn new(config: RunConfig) -> Result<Self, RunError> {
        Run::with_comm(config, None)
    }

    /// As [`Run::new`]; with `comm`, this process runs only the rank `comm.rank()` of a world of
    /// processes (ranks × dp × tp of them), each of which builds its `Run` with the same settings.
    ///
    /// # Errors
    /// As [`Run::new`]; [`RunError::Train`] when the world is not ranks × dp × tp.
    pub fn with_comm(config: RunConfig, comm: Option<Arc<dyn Comm>>) -> Result<Self, RunError> {
        config.validate()?;
        // Set up before the corpus is read: its memory counts the program as resident now.
        let setup = train_setup(&config)?;
        let text_path = match &config.data {
            Some(p) => p.clone(),
            None => data::shakespeare(&data::cache_dir())?,
        };
        let mut train = ByteTokenizer.encode(&data::read_text(&text_path)?);
        let val = train.split_off(data::split(&train, VAL_FRACTION).0.len());
        let t = config.seq_len;
        if train.len() <= t || val.len() <= t {
            return Err(RunError::Config(format!(
                "{}: {} tokens are too few for --seq-len {t} (train and validation splits each need more than {t})",
                text_path.display(),
                train.len() + val.len()
            )));
        }
        let val_split_len = val.len();
        let (x, y) = data::sample(&val, VAL_SEQUENCES, t, VAL_STREAM);
        let val = x.chunks(t * 8).zip(y.chunks(t * 8)).map(|(a, b)| (a.to_vec(), b.to_vec())).collect();
        // The run's device, opened once (train_setup leaves every setup on the CPU).
        let setup = TrainSetup { device: config.device.open()?, ..setup };
        let mut trainer = match comm {
            Some(c) => Trainer::on_comm(setup, c)?,
            None => Trainer::new(setup)?,
        };
        if let Some(dir) = &config.init_from {
            let weights = crate::pretrained::load_weights(dir, &config.model)?;
            trainer.load_parameters(&weights.into_iter().collect())?;
        }
        let batcher = Batcher { seed: config.seed, position: 0 };
        Ok(Run { run_id: new_run_id(), val_tokens: val_split_len, train, val, batcher, trainer, config })
    }

    /// This run's identity (16 hex digits), recorded in its checkpoints.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The settings.
    pub fn config(&self) -> &RunConfig {
        &self.config
    }

    /// The trainer (schedule, stages).
    pub fn trainer(&self) -> &Trainer {
        &self.trainer
    }

    /// Whether this process is the run's leader (world rank 0): it gets the gathered results
    /// and writes the checkpoints.
    pub fn is_leader(&self) -> bool {
        self.trainer.is_leader()
    }

    /// Optimizer steps completed.
    pub fn steps_done(&self) -> u64 {
        self.trainer.steps_done()
    }

    /// Model FLOPs per training token ([`graphpp_models::flops_per_token`] at `--seq-len`).
    pub fn flops_per_token(&self) -> f64 {
        self.config.model.flops_per_token(self.config.seq_len)
    }

    /// Tokens (bytes) of the (training, validation) splits.
    pub fn split_sizes(&self) -> (usize, usize) {
        (self.train.len(), self.val_tokens)
    }

    /// The next step's microbatches: `m·B` windows from the sampler, `B` per microbatch.
    fn next_microbatches(&mut self) -> Result<Microbatches, RunError> {
        let c = &self.config;
        let (b, t, m) = (c.microbatch_size, c.seq_len, c.microbatches);
        let (x, y) = self.batcher.next_batch(&self.train, m * b, t);
        let cut = |v: &[u32]| -> Result<Vec<Tensor>, RunError> {
            v.chunks(b * t).map(|c| tensor_u32(c, &[b, t]).map_err(RunError::from)).collect()
        };
        Ok(Microbatches { tokens: cut(&x)?, targets: cut(&y)? })
    }

    /// Runs one training step.
    ///
    /// # Errors
    /// [`RunError::Train`] naming the failing rank and action, or a non-finite gradient norm.
    pub fn step(&mut self) -> Result<StepReport, RunError> {
        let data = self.next_microbatches()?;
        Ok(self.trainer.step(data)?)
    }

    /// Validation loss (nats per byte) over the fixed validation windows, on the leader; `None`
    /// in the other processes (every process calls it at the same point).
    ///
    /// # Errors
    /// [`RunError::Train`] when the forward fails.
    pub fn evaluate(&mut self) -> Result<Option<f64>, RunError> {
        Ok(self.trainer.evaluate(&self.val, 8)?)
    }

    /// Continues `prompt` by `count` bytes (temperature 0.8, top-k 40, seeded by the run's seed),
    /// on the leader; `None` in the other processes.
    ///
    /// # Errors
    /// [`RunError::Train`] for an empty prompt or NaN logits.
    pub fn sample(&mut self, prompt: &str, count: usize) -> Result<Option<String>, RunError> {
        let mut rng = self.config.seed ^ 0x5A3D_1E00;
        let ids = self.trainer.generate(&ByteTokenizer.encode(prompt), count, 0.8, 40, &mut rng)?;
        Ok(ids.map(|ids| ByteTokenizer.decode(&ids)))
    }

    /// Writes a checkpoint of the current step into `dir` atomically: the state is gathered to
    /// the leader, which writes it and returns the sidecar path; `None` in the other processes
    /// (every process calls it at the same point).
    ///
    /// # Errors
    /// [`RunError::Checkpoint`] for I/O failures; [`RunError::Train`] when gathering fails.
    pub fn save(&mut self, dir: &Path, val_loss: Option<f64>) -> Result<Option<PathBuf>, RunError> {
        let Some(all) = self.trainer.gather_state(true)? else { return Ok(None) };
        let mut tensors = Vec::new();
        for (name, t) in all {
            if name == graphpp_runtime::optim::STEP_KEY {
                continue;
            }
            let data = to_f64(&t)?.into_iter().map(|x| x as f32).collect();
            tensors.push(NamedTensor { name, shape: t.dims().to_vec(), data });
        }
        let state = SavedState {
            run_id: self.run_id.clone(),
            config: self.config.clone(),
            batches: self.batcher.position,
            val_loss,
        };
        let state = serde_json::to_value(state).map_err(|e| RunError::Config(e.to_string()))?;
        Ok(Some(checkpoint::save(dir, self.steps_done(), &tensors, state)?))
    }

    /// Continues from the checkpoint at `path` (a sidecar, or a folder: its newest checkpoint).
    ///
    /// # Errors
    /// [`RunError::Checkpoint`] for a missing or corrupt checkpoint, [`RunError::Resume`] when it
    /// comes from a run with other settings, [`RunError::Train`] when its tensors do not fit.
    pub fn resume(&mut self, path: &Path) -> Result<u64, RunError> {
        if !path.exists() {
            return Err(CheckpointError::NotFound(path.to_path_buf()).into());
        }
        let ck = checkpoint::load(path)?;
        let bad = |reason: String| RunError::Resume { path: ck.path.clone(), reason };
        let saved: SavedState = serde_json::from_value(ck.sidecar.state.clone())
            .map_err(|e| bad(format!("sidecar state: {e}")))?;
        if saved.config.resume_key() != self.config.resume_key() {
            return Err(bad(describe_difference(&saved.config, &self.config)));
        }
        let mut tensors = HashMap::new();
        for (name, t) in &ck.tensors {
            tensors.insert(
                name.clone(),
                Tensor::from_vec(t.data.clone(), t.shape.clone(), &candle_core::Device::Cpu)?,
            );
        }
        let step = i64::try_from(ck.sidecar.step).map_err(|_| bad("step out of range".into()))?;
        tensors
            .insert(graphpp_runtime::optim::STEP_KEY.into(), Tensor::new(step, &candle_core::Device::Cpu)?);
        self.trainer.load_state(&tensors)?;
        self.batcher.position = saved.batches;
        self.run_id = saved.run_id;
        Ok(ck.sidecar.step)
    }
}

/// The newest checkpoint in `dir`, if any: its step, the identity of the run that wrote it and
/// that run's settings. Reads the sidecar only (no tensors). `None` when `dir` does not exist
/// or holds no checkpoint.
///
/// # Errors
/// [`RunError::Checkpoint`] for an unreadable folder or sidecar.
pub fn newest_checkpoint(dir: &Path) -> Result<Option<SavedRun>, RunError> {
    if !dir.is_dir() {
        return Ok(None);
    }
    checkpoint::sidecars(dir)?.pop().map(|(_, p)| checkpoint_settings(&p)).transpose()
}

/// The checkpoint a resume continues from: [`newest_checkpoint`], but the newest that loads
/// ([`checkpoint::newest_loadable`]: newer damaged ones are set aside), so that the step every
/// process agrees on is the one it loads; with its sidecar's path, for [`Run::resume`].
///
/// # Errors
/// [`RunError::Checkpoint`] for an unreadable folder, or a damaged checkpoint that cannot be
/// set aside.
pub fn resumable_checkpoint(dir: &Path) -> Result<Option<SavedRun>, RunError> {
    if !dir.is_dir() {
        return Ok(None);
    }
    checkpoint::newest_loadable(dir)?.map(|p| checkpoint_settings(&p)).transpose()
}

/// What a checkpoint's sidecar records of its run.
#[derive(Debug, Clone)]
pub struct SavedRun {
    /// The step it was saved after.
    pub step: u64,
    /// The run's identity (16 hex digits).
    pub run_id: String,
    /// The run's settings.
    pub config: RunConfig,
    /// The sidecar (a checkpoint path [`Run::resume`] loads directly).
    pub sidecar: PathBuf,
}

/// The step, run identity and settings recorded in sidecar `path`.
///
/// # Errors
/// [`RunError::Checkpoint`]: an unreadable sidecar, or one that records no graphpp run.
pub fn checkpoint_settings(path: &Path) -> Result<SavedRun, RunError> {
    saved_run(checkpoint::load_sidecar(path)?, path)
}

/// The run a sidecar already read from `path` describes ([`checkpoint_settings`]).
///
/// # Errors
/// [`RunError::Checkpoint`] when its state is not a graphpp run's.
pub fn saved_run(sidecar: checkpoint::Sidecar, path: &Path) -> Result<SavedRun, RunError> {
    let saved: SavedState = serde_json::from_value(sidecar.state).map_err(|e| {
        RunError::Checkpoint(CheckpointError::BadSidecar { path: path.to_path_buf(), message: e.to_string() })
    })?;
    Ok(SavedRun { step: sidecar.step, run_id: saved.run_id, config: saved.config, sidecar: path.into() })
}

/// Checks `dir` for a fresh run, changing nothing: a folder that holds another run's
/// checkpoints is refused (resuming it later would mix the two runs) unless `start_over` (the
/// caller then deletes them with [`checkpoint::remove_all`] once the run is built); the folder,
/// or the nearest existing folder above it, must accept new files.
///
/// # Errors
/// [`RunError::FolderInUse`] naming the other run; [`RunError::Checkpoint`] for I/O failures.
pub fn check_checkpoint_dir(dir: &Path, start_over: bool) -> Result<(), RunError> {
    if let Some(saved) = newest_checkpoint(dir)? {
        if !start_over {
            return Err(RunError::FolderInUse {
                dir: dir.to_path_buf(),
                run_id: saved.run_id,
                step: saved.step,
            });
        }
    }
    checkpoint::check_writable(dir)?;
    Ok(())
}

/// A fresh run identity: 16 hex digits of a hash of the clock and the process id.
fn new_run_id() -> String {
    use sha2::Digest;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let seed = format!("{}-{}", now.as_nanos(), std::process::id());
    sha2::Sha256::digest(seed.as_bytes()).iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The first setting that differs between a checkpoint's run and this one.
fn describe_difference(saved: &RunConfig, now: &RunConfig) -> String {
    let (a, b) = (serde_json::to_value(saved.resume_key()), serde_json::to_value(now.resume_key()));
    if let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) = (a, b) {
        if let Some((k, v)) = a.iter().find(|(k, v)| b.get(*k) != Some(v)) {
            let now = b.get(k).unwrap_or(&serde_json::Value::Null);
            // A setting that is one flag's value as written (a name, a path, a whole number): name
            // the flag that resumes the run. A float may be derived (`min_lr` from `lr`): none.
            let flag = match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Number(n) if !n.is_f64() => Some(n.to_string()),
                _ => None,
            };
            let hint =
                flag.map_or(String::new(), |f| format!(" (pass --{} {f} to resume it)", k.replace('_', "-")));
            return format!("it was written with {k} = {v}, this run has {now}{hint}");
        }
    }
    "its settings differ from this run's".into()
}

/// A schedule file (CSV or JSON, [`graphpp_schedule::Schedule::parse`]). Errors: why it cannot
/// be read or is not a schedule (the caller names the file and its flag or field).
pub fn read_schedule_file(path: &Path) -> Result<Arc<graphpp_schedule::Schedule>, String> {
    let text = crate::textfile::read_text(path).map_err(|e| e.to_string())?;
    let parsed = graphpp_schedule::Schedule::parse(&text);
    Ok(Arc::new(parsed.map_err(|e| graphpp_schedule::error_text::with_causes(&e))?))
}

/// The refusal of a data-parallel degree that does not divide the microbatch size.
pub fn dp_not_dividing(dp: usize, batch: usize) -> String {
    format!("--dp {dp} does not divide --microbatch-size {batch}: each replica runs B/dp sequences")
}

/// What a `--schedule-file` that does not fit must keep, and the way out: the order of one's own
/// keeps `kind`'s placement and the run's shape, so a file of another kind needs its kind given.
pub fn order_hint(kind: Kind) -> String {
    format!(
        "(the file must be an order of --schedule {kind}, given or implied by the file: its placement, \
         and --ranks, --stages-per-rank and --microbatches, given or the file's; give the file's own \
         kind with --schedule)"
    )
}

/// [`read_schedule_file`] of `--schedule-file`. Errors: [`RunError::Config`] naming it.
fn schedule_flag(path: &Path) -> Result<Arc<graphpp_schedule::Schedule>, RunError> {
    read_schedule_file(path).map_err(|e| RunError::Config(format!("--schedule-file {}: {e}", path.display())))
}

/// The ranks this process runs of a job of `world` ranks: one under `mpirun` (every rank a
/// process), else all of them (threads).
pub fn ranks_in_process(world: usize) -> usize {
    match crate::launch::launched_world_size() {
        Some(n) if n > 1 => 1,
        _ => world,
    }
}

/// The runtime setup of `c`, on the CPU: a run moves it to `c.device` ([`Run::with_comm`]).
///
/// # Errors
/// [`RunError`] for a schedule file that cannot be read or a bad learning-rate schedule.
pub fn train_setup(c: &RunConfig) -> Result<TrainSetup, RunError> {
    let launched = crate::launch::launched_world_size().filter(|&world| world > 1);
    let ranks_in_process = ranks_in_process(c.world());
    Ok(TrainSetup {
        model: Arc::new(c.model.clone()),
        kind: c.kind,
        shape: Shape::new(c.ranks, c.stages_per_rank, c.microbatches),
        options: c.generator_options(),
        schedule: c.schedule_file.as_deref().map(schedule_flag).transpose()?,
        layers_per_stage: c.layers_per_stage.clone(),
        microbatch_size: c.microbatch_size,
        dp: c.dp,
        fsdp: c.fsdp,
        ep: c.ep,
        tp: c.tp,
        sequence_parallel: c.sequence_parallel,
        post_validate: c.post_validate,
        seq_len: c.seq_len,
        seed: c.seed,
        adamw: AdamWConfig { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: c.weight_decay },
        lr: CosineSchedule::new(c.lr, c.min_lr, c.warmup.min(c.steps), c.steps)?,
        grad_clip: c.grad_clip,
        recompute: c.recompute,
        expert_bias_update: c.expert_bias_update,
        link: c.link,
        timeout: Duration::from_secs_f64(c.timeout),
        dtype: c.dtype,
        // Opened by the run itself (`Run::with_comm`): planning, profiling and checking a
        // setup never touch a GPU.
        device: candle_core::Device::Cpu,
        // Under mpirun over several hosts the memory check holds this host's part of the job.
        ranks_here: launched.map(|_| crate::launch::local_processes()),
        process_bytes: graphpp_runtime::train::memory::process_bytes(
            crate::data::corpus_memory(c.data.as_deref())?,
            ranks_in_process,
            graphpp_runtime::kernels::threads::op_threads(),
        ),
    })
}

/// Measured bubble of a run's steps beside the simulator's prediction from the same steps'
/// measured action times: the median over the steps given of each figure (a step slowed by
/// another process on the machine does not move it).
#[derive(Debug, Clone, PartialEq)]
pub struct BubbleSummary {
    /// Steps averaged.
    pub steps: usize,
    /// Measured step time (makespan of the compute intervals), seconds.
    pub measured_makespan: f64,
    /// Predicted step time, seconds.
    pub predicted_makespan: f64,
    /// Measured in-iteration bubble r = Σ idle / Σ busy (SEND/RECV waiting counts idle).
    pub measured_bubble: f64,
    /// Predicted r.
    pub predicted_bubble: f64,
    /// Measured idle fraction Σ idle / (p · makespan).
    pub measured_idle: f64,
    /// Predicted idle fraction.
    pub predicted_idle: f64,
}

/// Medians of [`graphpp_schedule::measured::measured_vs_predicted`] over `timelines` (each one
/// step of `schedule`). Errors: [`RunError::Config`] for no timelines or a schedule the simulator
/// rejects.
pub fn bubble_summary(
    schedule: &graphpp_schedule::Schedule,
    timelines: &[graphpp_schedule::Timeline],
    hop: f64,
) -> Result<BubbleSummary, RunError> {
    if timelines.is_empty() {
        return Err(RunError::Config("no measured steps to summarise".into()));
    }
    let mut rows = Vec::with_capacity(timelines.len());
    for t in timelines {
        let r = graphpp_schedule::measured::measured_vs_predicted(schedule, t, hop)
            .map_err(|e| RunError::Config(format!("simulating the measured schedule: {e}")))?;
        rows.push([
            r.measured.makespan,
            r.predicted.makespan,
            r.measured.bubble_ratio,
            r.predicted.bubble_ratio,
            r.measured.idle_fraction,
            r.predicted.idle_fraction,
        ]);
    }
    let median = |k: usize| {
        let mut v: Vec<f64> = rows.iter().map(|r| r[k]).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        }
    };
    Ok(BubbleSummary {
        steps: timelines.len(),
        measured_makespan: median(0),
        predicted_makespan: median(1),
        measured_bubble: median(2),
        predicted_bubble: median(3),
        measured_idle: median(4),
        predicted_idle: median(5),
    })
}

/// The in-graph collectives of measured steps (expert parallelism's all-to-alls): how long they
/// were in flight and how much of that the rank spent on other work rather than waiting
/// ([`graphpp_schedule::CommSpan`]), per rank and step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CommSummary {
    /// Collectives per rank and step.
    pub count: f64,
    /// Seconds in flight (start to completion), summed per rank and step.
    pub in_flight: f64,
    /// Of those, seconds the rank did other work (start to wait).
    pub overlapped: f64,
}

/// The [`CommSummary`] of `timelines` (each one step over `timelines[k].ranks` ranks); `None`
/// when they hold no in-graph collective.
pub fn comm_summary(timelines: &[graphpp_schedule::Timeline]) -> Option<CommSummary> {
    let spans: Vec<_> = timelines.iter().flat_map(|t| &t.comm).collect();
    if spans.is_empty() {
        return None;
    }
    let n: f64 = timelines.iter().map(|t| t.ranks as f64).sum();
    Some(CommSummary {
        count: spans.len() as f64 / n,
        in_flight: spans.iter().map(|c| c.end - c.start).sum::<f64>() / n,
        overlapped: spans.iter().map(|c| c.overlapped()).sum::<f64>() / n,
    })
}

/// Lays step timelines end to end: step `k`'s intervals shifted by its `offset` (seconds since
/// the run began), one timeline for a Chrome trace.
pub fn joined_timeline(steps: &[(f64, graphpp_schedule::Timeline)]) -> graphpp_schedule::Timeline {
    let ranks = steps.iter().map(|(_, t)| t.ranks).max().unwrap_or(0);
    let (mut intervals, mut comm) = (Vec::new(), Vec::new());
    for (offset, t) in steps {
        intervals.extend(t.intervals.iter().map(|i| graphpp_schedule::Interval {
            start: i.start + offset,
            end: i.end + offset,
            ..*i
        }));
        comm.extend(t.comm.iter().map(|c| graphpp_schedule::CommSpan {
            start: c.start + offset,
            wait: c.wait + offset,
            end: c.end + offset,
            ..c.clone()
        }));
    }
    graphpp_schedule::Timeline { ranks, intervals, comm, unit: "s".into() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphpp_schedule::{generate, simulate, Costs, Memory};

    /// Steps whose timelines follow the schedule exactly are predicted exactly; one step delayed
    /// by an outside stall (a RECV waiting 10 units longer) does not move the medians.
    #[test]
    fn bubble_summary_takes_medians() {
        let s = generate(Kind::OneFOneB, &Shape::new(2, 1, 4), &Options::default()).unwrap();
        let s = graphpp_schedule::lower(&s, &Default::default()).unwrap();
        let run = simulate(&s, &Costs::default(), &Memory::default()).unwrap();
        let mut stalled = run.timeline.clone();
        for i in &mut stalled.intervals {
            if i.rank == 1 {
                i.start += 10.0;
                i.end += 10.0;
            }
        }
        let steps = vec![run.timeline.clone(), stalled, run.timeline.clone()];
        let b = bubble_summary(&s, &steps, 0.0).unwrap();
        assert_eq!(b.steps, 3);
        assert_eq!(b.measured_makespan, run.makespan);
        assert!((b.measured_bubble - run.bubble_ratio).abs() < 1e-12);
        assert!((b.predicted_bubble - run.bubble_ratio).abs() < 1e-12);
        let stalled_only = bubble_summary(&s, &steps[1..2], 0.0).unwrap();
        assert!(stalled_only.measured_bubble > run.bubble_ratio + 0.1);
        assert!(bubble_summary(&s, &[], 0.0).is_err());
    }

    /// Per rank and step: two steps of two ranks holding 3 spans in all → 0.75 per rank and step;
    /// in flight and overlapped summed, divided by 4.
    #[test]
    fn comm_summary_is_per_rank_and_step() {
        let span = |start: f64, wait: f64, end: f64| graphpp_schedule::CommSpan {
            rank: 0,
            action: graphpp_schedule::Action::f(0, 0),
            start,
            wait,
            end,
            label: "ep.dispatch all_to_all_v (forward)".into(),
        };
        let t = |comm| graphpp_schedule::Timeline { ranks: 2, intervals: vec![], comm, unit: "s".into() };
        assert_eq!(comm_summary(&[t(vec![])]), None);
        let c =
            comm_summary(&[t(vec![span(0.0, 1.0, 2.0), span(1.0, 1.0, 3.0)]), t(vec![span(0.0, 4.0, 4.0)])])
                .unwrap();
        assert_eq!(c, CommSummary { count: 0.75, in_flight: 2.0, overlapped: 1.25 });
    }
}
