//! A rank's training state as whole tensors: parameters, AdamW moments and routing biases
//! gathered to the leader for checkpoints and evaluation, and loaded back on resume.

use super::*;

impl RankTrainer {
    /// Every distinct parameter of the model and the MoE routing biases (and, with `optimizer`,
    /// the AdamW moments and `adam.step`), gathered to the leader: every rank of the world calls
    /// it at the same point; FSDP shards are all-gathered over the replicas and tensor-parallel
    /// blocks over the tp group first ([`RankTrainer::whole_over_tp`]), then each parameter's
    /// owner (its lowest holder in its lead replica: 0, or a routed expert's block; tp index 0)
    /// sends its whole tensors to world rank 0, which returns them all; the others return `None`.
    ///
    /// # Errors
    /// [`TrainError::Poisoned`]; [`TrainError::Comm`] (a timeout, an abort);
    /// [`TrainError::Optim`] for a missing moment.
    pub fn gather_state(&self, optimizer: bool) -> Result<Option<BTreeMap<String, Tensor>>, TrainError> {
        let mut local = self.parameters()?;
        local.extend(self.biases()?);
        if optimizer {
            local.extend(self.optimizer_state()?);
        }
        let local = self.whole_over_tp(self.unsharded(local)?)?;
        self.send_to_leader(local, if optimizer { Gather::Training } else { Gather::Parameters })
    }

    /// The owner half of [`RankTrainer::gather_state`]: each rank sends the entries of `local`
    /// it owns to the leader, which returns them all.
    pub(super) fn send_to_leader(
        &self,
        local: BTreeMap<String, Tensor>,
        what: Gather,
    ) -> Result<Option<BTreeMap<String, Tensor>>, TrainError> {
        let rank = self.comm.rank();
        let mine = self.owned_keys(rank, what);
        let missing = |k: &String| mismatch(format!("rank {rank} holds no {k} to gather"));
        if rank != 0 {
            for (i, k) in mine.iter().enumerate() {
                let t = local.get(k).ok_or_else(|| missing(k))?;
                self.comm.send(0, gather_tag(Gathered::State, i), t.clone())?;
            }
            return Ok(None);
        }
        let mut out = BTreeMap::new();
        for k in &mine {
            out.insert(k.clone(), local.get(k).ok_or_else(|| missing(k))?.clone());
        }
        if what == Gather::Training {
            out.insert(
                STEP_KEY.to_string(),
                local.get(STEP_KEY).ok_or_else(|| missing(&STEP_KEY.to_string()))?.clone(),
            );
        }
        for &from in self.owned.keys().filter(|&&r| r != 0) {
            for (i, k) in self.owned_keys(from, what).into_iter().enumerate() {
                let t = self.comm.recv(from, gather_tag(Gathered::State, i), self.setup.timeout)?;
                out.insert(k, t);
            }
        }
        Ok(Some(out))
    }

    /// With FSDP, this rank's data parallelism (it holds shards).
    pub(super) fn sharding(&self) -> Option<&DataParallel> {
        self.work.as_ref()?.data_parallel().filter(|d| d.fsdp())
    }

    /// The full tensors of this rank's parameters and moments `local` (by name): with FSDP
    /// all-gathered over the data-parallel group, in name order (every member calls it).
    pub(super) fn unsharded(
        &self,
        local: BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>, TrainError> {
        Self::unsharded_in(self.work.as_ref(), local)
    }

    /// [`RankTrainer::unsharded`] with the stages `work`.
    pub(super) fn unsharded_in(
        work: Option<&GraphStages>,
        local: BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>, TrainError> {
        let Some(dp) = work.and_then(|w| w.data_parallel()).filter(|d| d.fsdp()) else { return Ok(local) };
        // Only parameters and their moments are sharded; `adam.step` and the biases are whole.
        let (step, shards): (Vec<_>, Vec<_>) =
            local.into_iter().partition(|(k, _)| dp.full_shape(parameter_of(k)).is_none());
        let full = dp.gather_full(&shards, |k| parameter_of(k).to_string()).map_err(StageError::from)?;
        Ok(full.into_iter().chain(step).collect())
    }

    /// How tensor parallelism splits a parameter or moment key (`None` without tensor
    /// parallelism or for a replicated parameter).
    fn tp_split(&self, key: &str) -> Option<graphpp_models::tensor_parallel::Split> {
        let tp = self.setup.tp;
        (tp > 1).then(|| self.setup.model.tensor_parallel_split(parameter_of(key), tp)).flatten()
    }

    /// `local` (parameters, gradients or moments by name, this rank's tensor-parallel shards)
    /// with every split one all-gathered whole over the tensor-parallel group along its
    /// dimension, in name order (every member calls it); `local` itself without tensor
    /// parallelism.
    ///
    /// # Errors
    /// [`TrainError::Comm`]; a tensor error.
    pub(super) fn whole_over_tp(
        &self,
        mut local: BTreeMap<String, Tensor>,
    ) -> Result<BTreeMap<String, Tensor>, TrainError> {
        if self.setup.tp == 1 {
            return Ok(local);
        }
        let group = self.mesh.tensor_parallel_group(self.comm.rank()).map_err(SetupError::from)?;
        let split: Vec<(String, graphpp_models::tensor_parallel::Split)> =
            local.keys().filter_map(|k| Some((k.clone(), self.tp_split(k)?))).collect();
        for (k, s) in split {
            let t = local[&k].transpose(0, s.dim)?.contiguous()?;
            let gathered = self.comm.all_gather(&group, &t)?.wait(self.setup.timeout)?;
            // Blocks held by several ranks (replicated key/value heads) are kept once each.
            let block = t.dim(0)?;
            let blocks: Vec<Tensor> = (0..self.setup.tp)
                .step_by(s.replicas.max(1))
                .map(|r| gathered.narrow(0, r * block, block))
                .collect::<candle_core::Result<_>>()?;
            let whole = Tensor::cat(&blocks, 0)?;
            local.insert(k, whole.transpose(0, s.dim)?.contiguous()?);
        }
        Ok(local)
    }

    /// This rank's view of full tensors `full` (parameters, moments by name): each split by
    /// tensor parallelism cut to this rank's shard, then with FSDP each one of its parameters or
    /// their moments is checked against the parameter's full shape and replaced by this rank's
    /// shard; other names (`adam.step`, biases) are kept whole.
    pub(super) fn localize(
        &self,
        full: &HashMap<String, Tensor>,
    ) -> Result<HashMap<String, Tensor>, TrainError> {
        let tp = graphpp_models::TensorShard::new(self.tp_index, self.setup.tp);
        let mut sliced = HashMap::new();
        for (k, t) in full {
            let shard = crate::train::build::tensor_parallel_shard(t, self.tp_split(k), tp)
                .map_err(|reason| StageError::Parameter { name: k.clone(), reason })?;
            sliced.insert(k.clone(), shard);
        }
        let full = &sliced;
        let Some(dp) = self.sharding() else { return Ok(full.clone()) };
        let mut out = HashMap::new();
        for (k, t) in full {
            let Some(shape) = dp.full_shape(parameter_of(k)) else {
                out.insert(k.clone(), t.clone());
                continue;
            };
            if t.dims() != shape {
                let reason = format!("given {:?}, the model's parameter is {shape:?}", t.dims());
                return Err(StageError::Parameter { name: k.clone(), reason }.into());
            }
            out.insert(k.clone(), dp.shard_of(t).map_err(StageError::from)?);
        }
        Ok(out)
    }

    /// Whether `flag` is set on any rank of the world (an all-reduce; every rank calls it).
    ///
    /// # Errors
    /// [`TrainError::Comm`].
    pub fn any(&self, flag: bool) -> Result<bool, TrainError> {
        let t = Tensor::new(&[if flag { 1f32 } else { 0.0 }], &Device::Cpu)?;
        let sum: Vec<f32> = self.comm.all_reduce(&self.world, &t)?.wait(self.setup.timeout)?.to_vec1()?;
        Ok(sum[0] > 0.0)
    }

    /// This rank's parameters by name (copies on one rank are equal; one is taken).
    ///
    /// # Errors
    /// [`TrainError::Poisoned`] after a failed step.
    pub fn parameters(&self) -> Result<BTreeMap<String, Tensor>, TrainError> {
        let w = self.work.as_ref().ok_or(TrainError::Poisoned)?;
        Ok(w.stages().values().flat_map(|s| s.parameters()).collect())
    }

    /// This rank's optimizer state (`adam.m.<name>`, `adam.v.<name>`, `adam.step`) and the MoE
    /// routing biases its stages hold (state outside the gradient that a resume needs).
    ///
    /// # Errors
    /// [`TrainError::Optim`] from [`AdamW::state_dict`].
    pub fn optimizer_state(&self) -> Result<BTreeMap<String, Tensor>, TrainError> {
        let mut state: BTreeMap<String, Tensor> = self.optim.state_dict()?.into_iter().collect();
        state.extend(self.biases()?);
        Ok(state)
    }

    /// The MoE balancing biases this rank's stages hold (f32), by name.
    pub(super) fn biases(&self) -> Result<BTreeMap<String, Tensor>, TrainError> {
        let w = self.work.as_ref().ok_or(TrainError::Poisoned)?;
        let names: Vec<String> = self
            .setup
            .model
            .moe_layers()
            .into_iter()
            .filter_map(|(l, _)| self.setup.model.balance_bias(l))
            .collect();
        let mut out = BTreeMap::new();
        for s in w.stages().values() {
            for n in &names {
                if let Some(t) = s.state().get(n) {
                    out.insert(n.clone(), t.to_dtype(DType::F32)?);
                }
            }
        }
        Ok(out)
    }

    /// Checks that every stage of this rank finds its parameters in `params`.
    ///
    /// # Errors
    /// [`TrainError::Stage`] naming the first missing or misshapen parameter;
    /// [`TrainError::Poisoned`].
    pub fn check_parameters(&self, params: &HashMap<String, Tensor>) -> Result<(), TrainError> {
        let w = self.work.as_ref().ok_or(TrainError::Poisoned)?;
        let local = self.localize(params)?;
        for s in w.stages().values() {
            s.check_parameters(&local)?;
        }
        Ok(())
    }

    /// Replaces every parameter of this rank's stages (and every MoE routing bias `params`
    /// holds) with the tensor of the same name in `params`; the optimizer state is not touched.
    ///
    /// # Errors
    /// As [`RankTrainer::check_parameters`]; nothing changes then.
    pub fn load_parameters(&mut self, params: &HashMap<String, Tensor>) -> Result<(), TrainError> {
        self.check_parameters(params)?;
        let local = self.localize(params)?;
        let biases: Vec<String> = self.biases()?.into_keys().collect();
        let w = self.work.as_mut().ok_or(TrainError::Poisoned)?;
        for s in w.stages_mut().values_mut() {
            s.set_parameters(&local)?;
            for b in biases.iter().filter(|b| local.contains_key(*b)) {
                s.set_buffer(b, &local[b])?;
            }
        }
        Ok(())
    }

    /// The optimizer this rank would have after [`RankTrainer::load_state`] of `tensors`
    /// (checks everything, changes nothing).
    ///
    /// # Errors
    /// As [`RankTrainer::load_state`].
    pub fn prepare_state(&self, tensors: &HashMap<String, Tensor>) -> Result<AdamW, TrainError> {
        self.check_parameters(tensors)?;
        let tensors = &self.localize(tensors)?;
        let w = self.work.as_ref().ok_or(TrainError::Poisoned)?;
        let names = w.stages().values().flat_map(|s| s.parameter_names().iter());
        let keys = std::iter::once(STEP_KEY.to_string())
            .chain(names.flat_map(|n| [format!("{M_PREFIX}{n}"), format!("{V_PREFIX}{n}")]));
        // The moments live where the parameters do; the step count stays a host scalar.
        let device = |k: &str| if k == STEP_KEY { &candle_core::Device::Cpu } else { &self.setup.device };
        let state = keys
            .filter_map(|k| tensors.get(&k).map(|t| Ok((k.clone(), t.to_device(device(&k))?))))
            .collect::<candle_core::Result<HashMap<String, Tensor>>>()?;
        let mut opt = self.optim.clone();
        opt.load_state_dict(&state)?;
        Ok(opt)
    }

    /// Restores this rank's parameters and optimizer state from a saved state (see
    /// [`crate::Trainer::load_state`]); the step count continues from `adam.step`.
    ///
    /// # Errors
    /// [`TrainError::Stage`] for a missing or misshapen parameter, [`TrainError::Optim`] for a
    /// missing or inconsistent optimizer entry; nothing changes then.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>) -> Result<(), TrainError> {
        let opt = self.prepare_state(tensors)?;
        self.commit_state(tensors, opt)
    }

    /// Applies a state checked by [`RankTrainer::prepare_state`].
    pub(crate) fn commit_state(
        &mut self,
        tensors: &HashMap<String, Tensor>,
        opt: AdamW,
    ) -> Result<(), TrainError> {
        let tensors = &self.localize(tensors)?;
        let biases: Vec<String> = self.biases()?.into_keys().collect();
        let w = self.work.as_mut().ok_or(TrainError::Poisoned)?;
        for s in w.stages_mut().values_mut() {
            s.set_parameters(tensors)?;
            for b in &biases {
                if let Some(t) = tensors.get(b) {
                    s.set_buffer(b, t)?;
                }
            }
        }
        self.step = opt.step_count();
        self.optim = opt;
        Ok(())
    }
}
