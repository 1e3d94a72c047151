//! The collectives of a step after the pipeline run: the world-wide loss and byte sums, the
//! copies' gradient all-reduce, the global norm, the measured timeline gathered to the leader
//! and the MoE routing-bias update (the steps 1–2 of [`super`]'s list).

use super::*;

impl RankTrainer {
    /// Starts the world-wide sum of the microbatch losses and each rank's (peak, resident)
    /// bytes ([`RankTrainer::finish_loss`] waits for it).
    pub(super) fn start_loss(&self, work: &GraphStages) -> Result<Pending<Tensor>, TrainError> {
        let m = self.setup.shape.microbatches;
        let world = self.comm.world();
        // Summed over the world: m losses, m counts (where this rank holds the last stage), then
        // each rank's peak bytes and resident bytes at its own index, then the tokens per expert
        // of every MoE layer (where this rank ran it), then the auxiliary losses this rank's
        // MoE layers output, then its multi-token-prediction losses.
        let layers = self.setup.model.moe_layers();
        let experts: usize = layers.iter().map(|&(_, e)| e).sum();
        let mut rows = vec![0.0f64; 2 * m + 2 * world + experts + 2];
        // The tp ranks of a pipeline position compute the same losses: index 0 reports them.
        let reports = self.tp_index == 0;
        if reports {
            rows[2 * m + 2 * world + experts] = work.aux_loss();
            rows[2 * m + 2 * world + experts + 1] = work.mtp_loss();
        }
        let mut at = 2 * m + 2 * world;
        for (layer, e) in layers.into_iter().filter(|_| reports) {
            if let Some(load) = work.expert_load().get(&layer).filter(|l| l.len() == e) {
                rows[at..at + e].copy_from_slice(load);
            }
            at += e;
        }
        for (&mb, &l) in work.losses().iter().filter(|_| reports) {
            if mb < m {
                rows[mb] = l;
                rows[m + mb] = 1.0;
            }
        }
        let params_bytes = env_bytes(
            work.stages().values().flat_map(|s| s.parameter_names().iter().filter_map(|n| s.state().get(n))),
        );
        // With FSDP the unsharded stages hold the full parameters during the step as well.
        let gathered = work.data_parallel().filter(|d| d.fsdp()).map_or(0, |d| d.full_bytes());
        // Gradients REDUCE_GRAD took out of the accumulators are still held, being reduced.
        let reducing = work.data_parallel().map_or(0, |d| d.pending_bytes());
        rows[2 * m + self.comm.rank()] =
            (work.state_bytes() + reducing + 2 * params_bytes + gathered + work.peak_activation_bytes())
                as f64;
        // Parameters, their gradients and two AdamW moments, all f32 (shards with FSDP).
        let distinct: Env = work.stages().values().flat_map(|s| s.parameters()).collect();
        rows[2 * m + world + self.comm.rank()] = (4 * env_bytes(distinct.values())) as f64;
        let n = rows.len();
        let t = Tensor::from_vec(rows, n, &Device::Cpu)?;
        Ok(self.comm.all_reduce(&self.world, &t)?)
    }

    /// The step loss and each rank's (peak, resident) bytes from the sum [`RankTrainer::start_loss`] started.
    ///
    /// # Errors
    /// [`TrainError::Comm`]; [`TrainError::Data`] for a microbatch without its losses.
    pub(super) fn finish_loss(&self, pending: Pending<Tensor>) -> Result<StepSums, TrainError> {
        let (m, world) = (self.setup.shape.microbatches, self.comm.world());
        let summed: Vec<f64> = pending.wait(self.setup.timeout)?.to_dtype(DType::F64)?.to_vec1()?;
        let (losses, rest) = summed.split_at(m);
        let (counts, rest) = rest.split_at(m);
        let (peaks, rest) = rest.split_at(world);
        let (resident, mut loads) = rest.split_at(world);
        let mut expert_load = Vec::new();
        for (_, e) in self.setup.model.moe_layers() {
            let (layer, rest) = loads.split_at(e);
            expert_load.push(layer.to_vec());
            loads = rest;
        }
        let replicas = self.setup.dp as f64;
        if let Some(mb) = counts.iter().position(|&c| c != replicas) {
            return Err(TrainError::Data(format!(
                "microbatch {mb} has {} losses, {replicas} expected",
                counts[mb]
            )));
        }
        let mean = |sum: f64| sum / (m * self.setup.dp) as f64;
        // The MTP output is λ times its cross-entropy: the cross-entropy is reported.
        let lambda = self.setup.model.mtp_loss_weight();
        let mtp = if lambda > 0.0 { mean(loads.get(1).copied().unwrap_or(0.0)) / lambda } else { 0.0 };
        Ok(StepSums {
            loss: mean(losses.iter().sum::<f64>()),
            aux_loss: mean(loads.first().copied().unwrap_or(0.0)),
            mtp_loss: mtp,
            peak: peaks.iter().map(|&b| b as u64).collect(),
            resident: resident.iter().map(|&b| b as u64).collect(),
            expert_load,
        })
    }

    /// DeepSeek-V3's auxiliary-loss-free load balancing (Liu et al. 2024, §2.1.2): after the
    /// step, each MoE layer's routing bias moves by γ = `setup.expert_bias_update` towards
    /// balance — down for an expert that got more than the mean of the step's tokens, up for one
    /// that got fewer. `load` is the step's global count per expert (every replica sees the same,
    /// so the copies of a bias stay equal).
    pub(super) fn balance_experts(
        &self,
        work: &mut GraphStages,
        load: &[Vec<f64>],
    ) -> Result<(), TrainError> {
        let gamma = self.setup.expert_bias_update;
        if gamma == 0.0 {
            return Ok(());
        }
        for ((layer, _), load) in self.setup.model.moe_layers().into_iter().zip(load) {
            let Some(name) = self.setup.model.balance_bias(layer) else { continue };
            let mean = load.iter().sum::<f64>() / load.len().max(1) as f64;
            let step: Vec<f64> = load
                .iter()
                .map(|&l| match l.partial_cmp(&mean) {
                    Some(std::cmp::Ordering::Greater) => -gamma,
                    Some(std::cmp::Ordering::Less) => gamma,
                    _ => 0.0,
                })
                .collect();
            for s in work.stages_mut().values_mut() {
                let Some(bias) = s.state().get(&name) else { continue };
                let moved = (bias.to_dtype(DType::F64)? + Tensor::new(step.as_slice(), bias.device())?)?;
                s.set_buffer(&name, &moved)?;
            }
        }
        Ok(())
    }

    /// This rank's gradients of the step by name, complete: the data-parallel mean REDUCE_GRAD
    /// started (this rank's shard with FSDP), summed over the stages of this rank holding the
    /// parameter and over the ranks holding copies of it.
    /// Also returns how long the data-parallel reductions kept the rank waiting after its
    /// pipeline run (what REDUCE_GRAD did not hide behind compute).
    pub(super) fn reduce_grads(&self, work: &mut GraphStages) -> Result<(Env, Duration), TrainError> {
        let timeout = self.setup.timeout;
        let t = Instant::now();
        work.finish_data_parallel()?;
        let reduce_wait = t.elapsed();
        let local: Vec<(String, Tensor)> =
            work.stages_mut().values_mut().flat_map(|s| s.take_grads()).collect();
        let mut grads = sum_by_name(local)?;
        let pending: Vec<(String, Pending<Tensor>)> = self
            .copies
            .iter()
            .map(|c| {
                let g = grads.get(&c.name).ok_or_else(|| mismatch(format!("no gradient of {}", c.name)))?;
                Ok((c.name.clone(), self.comm.all_reduce(&c.group, g)?))
            })
            .collect::<Result<_, TrainError>>()?;
        for (name, p) in pending {
            grads.insert(name, p.wait(timeout)?);
        }
        Ok((grads, reduce_wait))
    }

    /// Starts the world-wide sum of the squared gradient norms: one entry per distinct parameter,
    /// from its lowest holder in its lead replica (0, or a routed expert's block) — or, with
    /// FSDP, in every replica (each adds its shard). Data parallelism: REDUCE_GRAD already
    /// averaged the gradients over the replicas.
    pub(super) fn start_norm(&self, work: &GraphStages, grads: &Env) -> Result<Pending<Tensor>, TrainError> {
        let sharded = work.data_parallel().is_some_and(|d| d.fsdp());
        let mut sq = vec![0.0f64; self.all_names.len()];
        for (i, name) in self.all_names.iter().enumerate() {
            if self.counts_here[i] && (self.replica == self.lead_replica[i] || sharded) {
                let g = grads.get(name).ok_or_else(|| mismatch(format!("no gradient of {name}")))?;
                sq[i] = local_sq_norm(&HashMap::from([(name.clone(), g.clone())]))?;
            }
        }
        let n = sq.len();
        Ok(self.comm.all_reduce(&self.world, &Tensor::from_vec(sq, n, &Device::Cpu)?)?)
    }

    /// The global squared norm: the entries of [`RankTrainer::start_norm`]'s sum added in name
    /// order.
    pub(super) fn finish_norm(&self, pending: Pending<Tensor>) -> Result<f64, TrainError> {
        let sq_all: Vec<f64> = pending.wait(self.setup.timeout)?.to_vec1()?;
        Ok(sq_all.iter().fold(0.0, |a, &x| a + x))
    }

    /// The leader (world rank 0) receives the timeline of every other rank of replica 0 (tp
    /// index 0) and returns all of replica 0's: its intervals (an `[n, 2]` f64 tensor of start and end in
    /// program order, matched with the schedule's program there) and its in-graph collectives
    /// ([`encode_comm`]). Every other rank of replica 0 sends its own; other replicas keep theirs.
    pub(super) fn gather_timeline(
        &self,
        intervals: Vec<Interval>,
        comm: Vec<CommSpan>,
    ) -> Result<(Vec<Interval>, Vec<CommSpan>), TrainError> {
        let (rank, timeout) = (self.comm.rank(), self.setup.timeout);
        let coords = self.mesh.coords(rank).map_err(SetupError::from)?;
        if coords.dp != 0 || coords.tp != 0 {
            return Ok((intervals, comm));
        }
        if rank != 0 {
            let times: Vec<f64> = intervals.iter().flat_map(|i| [i.start, i.end]).collect();
            let t = Tensor::from_vec(times, (intervals.len(), 2), &Device::Cpu)?;
            self.comm.send(0, gather_tag(Gathered::Intervals, 0), t)?;
            let (times, labels) = encode_comm(&self.schedule.program(coords.pp), &comm)?;
            self.comm.send(0, gather_tag(Gathered::Comm, 0), times)?;
            self.comm.send(0, gather_tag(Gathered::Comm, 1), labels)?;
            return Ok((intervals, comm));
        }
        let (mut all, mut all_comm) = (intervals, comm);
        for pp in 1..self.mesh.pp() {
            let from = self.mesh.rank_of(Coords::at(0, pp)).map_err(SetupError::from)?;
            let program = self.schedule.program(pp);
            let times: Vec<Vec<f64>> =
                self.comm.recv(from, gather_tag(Gathered::Intervals, 0), timeout)?.to_vec2()?;
            if times.len() != program.len() {
                return Err(mismatch(format!(
                    "rank {from} reported {} intervals for a program of {} actions",
                    times.len(),
                    program.len()
                )));
            }
            all.extend(program.iter().zip(times).map(|(a, t)| Interval {
                rank: pp,
                start: t[0],
                end: t[1],
                action: *a,
            }));
            let times = self.comm.recv(from, gather_tag(Gathered::Comm, 0), timeout)?;
            let labels = self.comm.recv(from, gather_tag(Gathered::Comm, 1), timeout)?;
            all_comm.extend(
                decode_comm(&program, pp, &times, &labels)
                    .map_err(|e| mismatch(format!("rank {from}: {e}")))?,
            );
        }
        Ok((all, all_comm))
    }

    /// The names rank `rank` sends to the leader, in order: each parameter (or its gradient) it
    /// owns; unless gradients, the MoE balancing biases it owns (state outside the gradient that
    /// inference and an exact resume need); for training state, the AdamW moments.
    pub(super) fn owned_keys(&self, rank: usize, what: Gather) -> Vec<String> {
        let names = self.owned.get(&rank).map(Vec::as_slice).unwrap_or_default();
        let mut keys: Vec<String> = names.to_vec();
        if what == Gather::Training {
            keys.extend(names.iter().flat_map(|n| [format!("{M_PREFIX}{n}"), format!("{V_PREFIX}{n}")]));
        }
        if what != Gather::Gradients {
            keys.extend(self.bias_owned.get(&rank).into_iter().flatten().cloned());
        }
        keys
    }
}
