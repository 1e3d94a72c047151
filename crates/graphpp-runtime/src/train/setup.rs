//! What a training run is built from ([`TrainSetup`]): the model, the schedule and its shape,
//! the parallelism degrees, the optimizer and the run's bounds. Shared by the trainer, the
//! rank-local step and the checks built on them (`verify`, `profile`, `plan`).

use std::sync::Arc;
use std::time::Duration;

use graphpp_models::{Model, Recompute};
use graphpp_schedule::{lower, Kind, LowerOptions, Options, Schedule, Shape};

use crate::optim::lr::CosineSchedule;
use crate::optim::AdamWConfig;
use crate::train::build::compute_schedule;
use crate::train::error::{SetupError, TrainError};
use crate::train::memory::{check_step, Layout, StepMemory};

/// Everything a training run is built from.
#[derive(Debug, Clone)]
pub struct TrainSetup {
    /// The model (any [`Model`]; the Llama config implements it).
    pub model: Arc<dyn Model>,
    /// Schedule kind.
    pub kind: Kind,
    /// Pipeline shape (p ranks, v stages per rank, m microbatches per step).
    pub shape: Shape,
    /// Generator options (group size, zb-auto costs).
    pub options: Options,
    /// A compute-only order of one's own (e.g. from a schedule file) run instead of `kind`'s
    /// generated one; it keeps `kind`'s placement ([`crate::train::build::compute_schedule`]).
    pub schedule: Option<Arc<Schedule>>,
    /// Decoder layers of each model stage; `None` splits evenly.
    pub layers_per_stage: Option<Vec<usize>>,
    /// Sequences per microbatch `B` (the global microbatch: each data-parallel replica runs
    /// `B / dp` of them).
    pub microbatch_size: usize,
    /// Data-parallel replicas of the pipeline (1: none); the world is `p × dp × tp` ranks.
    pub dp: usize,
    /// FSDP (ZeRO-3) over the data-parallel replicas: parameters, gradients and AdamW state
    /// sharded ([`crate::pipeline::data_parallel`]); with dp = 1 the same as without.
    pub fsdp: bool,
    /// Expert-parallel degree (1: none): each MoE layer's routed experts are split over groups
    /// of `ep` data-parallel replicas, which exchange tokens by all-to-all ([`graphpp_comm::mesh`]);
    /// must divide dp and the routed experts.
    pub ep: usize,
    /// Tensor-parallel degree (1: none): each pipeline position is tp ranks that split its
    /// decoder layers' matrices Megatron-style ([`graphpp_models::tensor_parallel`]); the world
    /// is `p × dp × tp` ranks, tp innermost ([`graphpp_comm::mesh`]).
    pub tp: usize,
    /// Sequence parallelism with tensor parallelism (`--sequence-parallel`): the residual
    /// stream, norms and stage hand-overs split along the sequence over the tp ranks
    /// ([`graphpp_models::tensor_parallel`]); needs tp > 1, tp dividing the sequence length, and
    /// a dense model.
    pub sequence_parallel: bool,
    /// Optimizer post-validation (`--post-validate`, [`crate::train::rank_train::RankTrainer`]): step at once, validate
    /// the global norm after, roll back when clipping or a non-finite gradient says so.
    pub post_validate: bool,
    /// Tokens per sequence `T`.
    pub seq_len: usize,
    /// Seed of the initial weights.
    pub seed: u64,
    /// AdamW hyperparameters.
    pub adamw: AdamWConfig,
    /// Learning rate per step.
    pub lr: CosineSchedule,
    /// Global gradient-norm bound (`clip_grad_norm_`'s `max_norm`); `None` disables clipping.
    pub grad_clip: Option<f64>,
    /// Activation recomputation of every stage.
    pub recompute: Recompute,
    /// An emulated interconnect every rank's traffic goes through ([`graphpp_comm::emulated`]);
    /// `None`: the communicator as it is.
    pub link: Option<graphpp_comm::LinkModel>,
    /// Bias update speed γ of MoE load balancing, per step (DeepSeek-V3 uses 0.001; 0 freezes
    /// the biases); unused by a dense model.
    pub expert_bias_update: f64,
    /// Bound on every RECV of a step.
    pub timeout: Duration,
    /// Compute dtype of the stage graphs: f32, or bf16 for mixed precision (f32 master weights,
    /// gradients and AdamW state; bf16 activations and messages; f32 loss — see
    /// [`graphpp_models::StageOptions::mixed`]). Evaluation and generation compute in it too.
    pub dtype: graphpp_graph::DType,
    /// The device every rank's stages live and run on (the CPU, or a CUDA device in a build with
    /// the `cuda` feature; ranks as threads share it). Off the CPU the stage graphs run through
    /// candle's kernels ([`crate::kernels::device`]).
    pub device: candle_core::Device,
    /// How many of the job's ranks run on this machine when they are processes (`mpirun` over
    /// several hosts): the memory check holds this machine's part of the job. `None`: every rank
    /// runs here (threads, or processes on one host).
    pub ranks_here: Option<usize>,
    /// Bytes this process holds beside the step ([`crate::train::memory::process_bytes`]): its
    /// program as resident when the run was set up, the corpus it reads and its computing
    /// threads' own memory; the memory estimate and the pre-flight check add them. 0 where
    /// nothing else is counted (tests).
    pub process_bytes: u128,
}

impl TrainSetup {
    /// Every check of a run's setup that needs neither a tensor nor the schedule, in one place,
    /// cheapest first: dp divides the microbatch size, the expert- and tensor-parallel degrees
    /// ([`TrainSetup::check_ep`], [`TrainSetup::check_tp`]), the bf16 matmul path a bf16 run on
    /// the CPU's own kernels takes ([`TrainSetup::bf16_path`]), the step's size from estimates
    /// ([`crate::check_step`]).
    ///
    /// # Errors
    /// [`TrainError::BatchNotDivisible`] when dp is 0 or does not divide the microbatch size;
    /// [`TrainError::ExpertParallel`]; [`TrainError::TensorParallel`]; [`SetupError::Bf16Path`] (in [`TrainError::Setup`]) when
    /// `GRAPHPP_BF16_GEMM` names a path this process cannot run; [`SetupError::Device`] when
    /// `GRAPHPP_KERNELS` names no choice; [`TrainError::Size`] when the schedule
    /// or the step would be too large.
    pub fn check(&self) -> Result<(), TrainError> {
        self.check_sized(false)
    }

    /// [`TrainSetup::check`], the step's size estimated for one device running every
    /// microbatch at once when `single_device` (a verification's reference step).
    ///
    /// # Errors
    /// Those of [`TrainSetup::check`].
    pub fn check_sized(&self, single_device: bool) -> Result<(), TrainError> {
        self.check_layout()?;
        crate::kernels::device::kernels_choice().map_err(SetupError::from)?;
        self.bf16_path().map_err(SetupError::from)?;
        self.check_step(single_device, None)
    }

    /// The bf16 matmul path the run's steps take ([`crate::kernels::bf16_gemm::chosen`]): `None`
    /// where they take none — an f32 run, or one
    /// on candle's kernels (a CUDA device, or `GRAPHPP_KERNELS=composed`), whose bf16 products
    /// are candle's whatever `GRAPHPP_BF16_GEMM` says, so that variable is not read.
    ///
    /// # Errors
    /// [`crate::kernels::bf16_gemm::PathError`] where `GRAPHPP_BF16_GEMM` names a path this
    /// process cannot run.
    pub fn bf16_path(
        &self,
    ) -> Result<Option<crate::kernels::bf16_gemm::Bf16Gemm>, crate::kernels::bf16_gemm::PathError> {
        let own = self.device.is_cpu() && !crate::kernels::device::forced_composed();
        if self.dtype != graphpp_graph::DType::BF16 || !own {
            return Ok(None);
        }
        crate::kernels::bf16_gemm::chosen().map(Some)
    }

    /// Whether the model splits over the layout: [`TrainSetup::check_dp`],
    /// [`TrainSetup::check_ep`] and [`TrainSetup::check_tp`], without this machine's memory
    /// (a plan for other hardware checks this much).
    ///
    /// # Errors
    /// Those three's.
    pub fn check_layout(&self) -> Result<(), TrainError> {
        self.check_dp()?;
        self.check_ep()?;
        self.check_tp()
    }

    /// The memory of one step of this run on `schedule` (the run's, compute-only or lowered:
    /// communication actions hold nothing), as the pre-flight check estimates it before anything
    /// is built ([`StepMemory::estimate`] at the schedule's peak, for every data-parallel
    /// replica and this machine's part of them: [`Layout`]).
    pub fn memory_estimate(&self, schedule: &Schedule) -> StepMemory {
        let local = (self.microbatch_size / self.dp.max(1), self.seq_len);
        let one = StepMemory::estimate(
            &*self.model,
            (self.kind, &self.shape),
            local.0,
            local.1,
            false,
            Some(schedule),
        );
        self.memory_layout().of(one)
    }

    /// The layout the memory estimate scales one replica's figures by ([`Layout`]).
    fn memory_layout(&self) -> Layout {
        let world = self.shape.ranks * self.dp * self.tp;
        let here = self.ranks_here.map(|n| (n, world));
        Layout { dp: self.dp, fsdp: self.fsdp, ep: self.ep, here, process: self.process_bytes }
    }

    /// The step's size from estimates ([`check_step`]): the activations at `schedule`'s peak
    /// once the run's schedule is made, else their lower bound.
    fn check_step(&self, single_device: bool, schedule: Option<&Schedule>) -> Result<(), TrainError> {
        let local = self.microbatch_size / self.dp;
        let layout = self.memory_layout();
        check_step(
            &*self.model,
            self.kind,
            &self.shape,
            (local, self.seq_len),
            &layout,
            single_device,
            schedule,
        )?;
        Ok(())
    }

    /// The run's compute-only schedule after [`TrainSetup::check`]: `kind`'s generated one, or
    /// the given order checked against it ([`compute_schedule`]).
    ///
    /// # Errors
    /// Those of [`TrainSetup::check`]; [`TrainError::Setup`] when the kind cannot serve the
    /// shape or a given order does not fit it ([`SetupError::ScheduleFile`]); [`TrainError::Size`]
    /// when the activations at the schedule's peak exceed the memory budget.
    pub fn compute_schedule(&self) -> Result<Schedule, TrainError> {
        self.check()?;
        let s = compute_schedule(self.kind, &self.shape, &self.options, self.schedule.as_deref())?;
        self.check_step(false, Some(&s))?;
        Ok(s)
    }

    /// The lowered schedule of the run (the same on every rank) of
    /// [`TrainSetup::compute_schedule`].
    ///
    /// # Errors
    /// Those of [`TrainSetup::compute_schedule`]; [`TrainError::Setup`] when lowering fails.
    pub fn lowered_schedule(&self) -> Result<Schedule, TrainError> {
        Ok(lower(&self.compute_schedule()?, &self.lower_options()).map_err(SetupError::from)?)
    }

    /// Checks that dp is at least 1 and divides the microbatch size (each replica runs B/dp
    /// sequences of every microbatch).
    ///
    /// # Errors
    /// [`TrainError::BatchNotDivisible`].
    pub fn check_dp(&self) -> Result<(), TrainError> {
        if self.dp == 0 || !self.microbatch_size.is_multiple_of(self.dp) {
            return Err(TrainError::BatchNotDivisible { batch: self.microbatch_size, dp: self.dp });
        }
        Ok(())
    }

    /// Checks the expert-parallel degree: a MoE model whose routed experts it divides, a
    /// divisor of dp, and no FSDP with it.
    ///
    /// # Errors
    /// [`TrainError::ExpertParallel`].
    pub fn check_ep(&self) -> Result<(), TrainError> {
        let ep = self.ep;
        let bad = |reason: String| Err(TrainError::ExpertParallel { ep, reason });
        if ep == 0 || !self.dp.is_multiple_of(ep) {
            return bad(format!(
                "the expert-parallel degree must divide the data-parallel degree dp = {} (ep groups are made of replicas)",
                self.dp
            ));
        }
        if ep > 1 && self.model.routed_experts() == 0 {
            return bad("expert parallelism needs a mixture-of-experts model (e.g. --model moe-tiny)".into());
        }
        if let Err(e) = self.model.check_ep(ep) {
            return bad(e.to_string());
        }
        if ep > 1 && self.fsdp {
            return bad("expert parallelism with FSDP is not implemented (drop --fsdp or --ep)".into());
        }
        Ok(())
    }

    /// Checks the tensor-parallel degree: at least 1, dividing the model's heads, key/value
    /// heads and MLP width ([`graphpp_models::Model::check_tp`]); with sequence parallelism,
    /// above 1, dividing the sequence length, on a dense model.
    ///
    /// # Errors
    /// [`TrainError::TensorParallel`].
    pub fn check_tp(&self) -> Result<(), TrainError> {
        let tp = self.tp;
        let bad = |reason: String| Err(TrainError::TensorParallel { tp, reason });
        if tp == 0 {
            return bad("the degree must be at least 1".into());
        }
        if let Err(e) = self.model.check_tp(tp) {
            return bad(e.to_string());
        }
        if !self.sequence_parallel {
            return Ok(());
        }
        if tp == 1 {
            return bad("--sequence-parallel splits the sequence over the tensor-parallel ranks: it needs --tp 2 or more".into());
        }
        if !self.seq_len.is_multiple_of(tp) {
            return bad(format!(
                "--sequence-parallel: tp must divide the sequence length {} (--seq-len)",
                self.seq_len
            ));
        }
        if self.model.routed_experts() > 0 {
            return bad("--sequence-parallel is built for dense models (a MoE layer's routing statistics span the whole sequence)".into());
        }
        Ok(())
    }

    /// The lowering a run needs: REDUCE_GRAD with data parallelism; UNSHARD / RESHARD too with
    /// FSDP, keeping every stage of a rank unsharded once gathered (one all-gather per stage
    /// and step, as FSDP2 without resharding after forward).
    pub fn lower_options(&self) -> LowerOptions {
        LowerOptions::data_parallel(self.dp, self.fsdp, self.shape.stages_per_rank)
    }
}
