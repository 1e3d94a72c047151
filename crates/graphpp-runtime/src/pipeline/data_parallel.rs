//! Data parallelism and FSDP (ZeRO-3) inside one rank's stages: what the lowered schedule's
//! REDUCE_GRAD, UNSHARD and RESHARD actions do (docs/ARCHITECTURE.md "Runtime": data
//! parallelism and FSDP).
//!
//! Every rank of a data-parallel group holds the same stages (the same pipeline position in
//! each replica) and runs the same schedule, so the members call the same collectives in the
//! same order.
//!
//! - **REDUCE_GRAD(s)** (placed right after stage s's last backward-like action) takes the
//!   stage's accumulated gradients and *starts* their reduction over the group — an all-reduce
//!   (plain data parallelism) or a reduce-scatter (FSDP) per parameter, in name order — so it
//!   runs while the rank computes its other stages. [`DataParallel::finish`] waits for them
//!   after the pipeline run and puts back the mean over the replicas (the sum × 1/dp).
//! - With **FSDP**, a parameter lives as a *shard*: the parameter flattened, zero-padded to a
//!   multiple of dp elements, and cut into dp equal pieces; group rank i keeps piece i. Between
//!   steps a stage's state holds shards, and so do its gradients after the reduce-scatter and the
//!   AdamW moments (the optimizer updates shards only).
//!   **UNSHARD(s)** starts an all-gather of each of the stage's shards; the stage's next compute
//!   waits for it and puts the full tensor (the gathered pieces, unpadded and reshaped) in the
//!   state. **RESHARD(s)** drops the full tensors and puts the shards back. Under mixed
//!   precision a shard the stage reads only through its cast to bf16 is rounded to bf16 before
//!   the all-gather — half the bytes, the values the stage computes with unchanged (the
//!   rounding commutes with the gather) — as PyTorch FSDP's `MixedPrecisionPolicy(param_dtype=
//!   torch.bfloat16)` gathers; the gathered tensor is widened back to the f32 the stage's
//!   parameter input is. Gradients are reduced in f32.
//!
//! With **expert parallelism** a routed expert's parameters live on dp / ep replicas only (see
//! [`graphpp_comm::mesh`]): REDUCE_GRAD all-reduces their gradients over those (group `edp`), and the
//! mean is still the sum × 1/dp — each replica's expert gradient already holds the contributions
//! of the ep replicas whose tokens it served (through the all-to-all's VJP).
//!
//! The reductions sum in group order in f32 ([`graphpp_comm`]), so the result does not depend on
//! which replica finishes first.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Tensor};

use crate::kernels::tensor::cast;

use graphpp_comm::{Comm, CommError, Group, Pending};

/// Why a data-parallel operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DataParallelError {
    /// A collective failed (a timeout, another rank's abort, mismatched contributions).
    #[error("data-parallel {what} of stage {stage}: {source}")]
    Comm {
        /// What was running (`reduce_grad`, `unshard`).
        what: &'static str,
        /// The stage.
        stage: usize,
        /// The communicator's error.
        source: Box<CommError>,
    },
    /// A tensor operation (flatten, pad, scale) failed.
    #[error("data-parallel {name}: {source}")]
    Tensor {
        /// The parameter.
        name: String,
        /// candle's error.
        source: candle_core::Error,
    },
    /// A parameter whose full shape was never recorded (not sharded by this rank).
    #[error("FSDP: parameter {name} is not sharded on this rank")]
    Unknown {
        /// The parameter.
        name: String,
    },
}

/// Rows of the padded, flattened parameter each of `size` members keeps: ⌈numel / size⌉.
pub fn shard_len(numel: usize, size: usize) -> usize {
    numel.div_ceil(size.max(1))
}

/// Group rank `index`'s shard of `full` among `size` members (see the module doc): a 1-D tensor
/// of [`shard_len`] elements.
///
/// # Errors
/// candle's, for a tensor it cannot flatten or pad.
pub fn shard(full: &Tensor, size: usize, index: usize) -> candle_core::Result<Tensor> {
    let len = shard_len(full.elem_count(), size);
    pad_flat(full, size)?.narrow(0, index * len, len)
}

/// The full tensor of `shape` from the concatenated shards of every member (an all-gather's
/// result): the padding dropped, reshaped.
///
/// # Errors
/// candle's, when `gathered` holds fewer elements than `shape`.
pub fn unshard(gathered: &Tensor, shape: &[usize]) -> candle_core::Result<Tensor> {
    let n: usize = shape.iter().product();
    gathered.narrow(0, 0, n)?.reshape(shape)
}

/// One rank's data-parallel state (see the module doc).
pub struct DataParallel {
    comm: Arc<dyn Comm>,
    group: Group,
    index: usize,
    fsdp: bool,
    timeout: Duration,
    /// FSDP: the full shape of every parameter of this rank.
    shapes: HashMap<String, Vec<usize>>,
    /// FSDP: the shards of the stages that are unsharded now, by (stage, name).
    kept: HashMap<(usize, String), Tensor>,
    /// FSDP: all-gathers started by UNSHARD and not yet waited for, by stage; each says
    /// whether its shard was rounded to bf16 for the gather (and is widened back).
    gathering: HashMap<usize, Vec<(String, Pending<Tensor>, bool)>>,
    /// FSDP: bytes this rank has sent into UNSHARD's all-gathers.
    unshard_bytes: usize,
    /// Gradient reductions started by REDUCE_GRAD: (stage, name, handle).
    reducing: Vec<(usize, String, Pending<Tensor>)>,
    /// Bytes of the gradients whose reductions are in flight (held until [`DataParallel::finish`]).
    reducing_bytes: usize,
    /// Expert parallelism: the replicas holding this rank's routed experts, and those experts'
    /// parameter names (their gradients are reduced over that group only).
    experts: Option<(Group, std::collections::BTreeSet<String>)>,
}

impl std::fmt::Debug for DataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field("group", &self.group.to_string())
            .field("fsdp", &self.fsdp)
            .field("reducing", &self.reducing.len())
            .finish_non_exhaustive()
    }
}

fn comm_err(what: &'static str, stage: usize) -> impl Fn(CommError) -> DataParallelError {
    move |e| DataParallelError::Comm { what, stage, source: Box::new(e) }
}

fn tensor_err(name: &str) -> impl Fn(candle_core::Error) -> DataParallelError + '_ {
    move |source| DataParallelError::Tensor { name: name.to_string(), source }
}

impl DataParallel {
    /// Data parallelism of `comm`'s rank over `group` (this rank must be a member), FSDP when
    /// `fsdp`; waits at most `timeout` for a collective.
    ///
    /// # Errors
    /// [`CommError::NotInGroup`].
    pub fn new(comm: Arc<dyn Comm>, group: Group, fsdp: bool, timeout: Duration) -> Result<Self, CommError> {
        let index = group
            .index_of(comm.rank())
            .ok_or_else(|| CommError::NotInGroup { rank: comm.rank(), group: group.to_string() })?;
        Ok(DataParallel {
            comm,
            group,
            index,
            fsdp,
            timeout,
            shapes: HashMap::new(),
            kept: HashMap::new(),
            gathering: HashMap::new(),
            unshard_bytes: 0,
            reducing: Vec::new(),
            reducing_bytes: 0,
            experts: None,
        })
    }

    /// Expert parallelism: the gradients of `names` (this rank's routed experts) are reduced
    /// over `group` (the replicas holding the same experts, a subset of the data-parallel group)
    /// instead of the whole data-parallel group; their mean still divides by dp.
    ///
    /// # Errors
    /// [`CommError::NotInGroup`] when this rank is not in `group`.
    pub fn set_expert_parallel(
        &mut self,
        group: Group,
        names: std::collections::BTreeSet<String>,
    ) -> Result<(), CommError> {
        if group.index_of(self.comm.rank()).is_none() {
            return Err(CommError::NotInGroup { rank: self.comm.rank(), group: group.to_string() });
        }
        self.experts = Some((group, names));
        Ok(())
    }

    /// Whether parameters are sharded.
    pub fn fsdp(&self) -> bool {
        self.fsdp
    }

    /// Number of replicas.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// The full shape of parameter `name` (FSDP), if this rank shards it.
    pub fn full_shape(&self, name: &str) -> Option<&[usize]> {
        self.shapes.get(name).map(Vec::as_slice)
    }

    /// This rank's shard of the full tensor `full` of parameter `name`, recording its shape.
    ///
    /// # Errors
    /// [`DataParallelError::Tensor`].
    pub fn to_shard(&mut self, name: &str, full: &Tensor) -> Result<Tensor, DataParallelError> {
        self.shapes.insert(name.to_string(), full.dims().to_vec());
        shard(full, self.size(), self.index).map_err(tensor_err(name))
    }

    /// Bytes of the full f32 parameters this rank shards: what its unsharded stages hold on top
    /// of the shards between UNSHARD and RESHARD (every stage at once, as the run lowers it).
    pub fn full_bytes(&self) -> usize {
        self.shapes.values().map(|s| s.iter().product::<usize>() * 4).sum()
    }

    /// Bytes this rank has sent into UNSHARD's all-gathers so far (f32 shards 4 bytes an
    /// element, shards gathered in bf16 2).
    pub fn unshard_bytes(&self) -> usize {
        self.unshard_bytes
    }

    /// Bytes of the gradients REDUCE_GRAD handed over whose reductions [`DataParallel::finish`]
    /// has not yet collected: gradients the rank still holds, outside its stages' accumulators.
    pub fn pending_bytes(&self) -> usize {
        self.reducing_bytes
    }

    /// This rank's shard of `full` (no shape recorded).
    ///
    /// # Errors
    /// [`DataParallelError::Tensor`].
    pub fn shard_of(&self, full: &Tensor) -> Result<Tensor, DataParallelError> {
        shard(full, self.size(), self.index)
            .map_err(|source| DataParallelError::Tensor { name: "(loaded tensor)".into(), source })
    }

    /// UNSHARD: starts the all-gather of each `(name, shard)` of `stage` (the shards are kept
    /// until [`DataParallel::reshard`]); an f32 shard for which `in_bf16(name)` holds is gathered
    /// rounded to bf16 (the module doc).
    ///
    /// # Errors
    /// [`DataParallelError::Comm`] when a start fails; [`DataParallelError::Tensor`] from the
    /// rounding.
    pub fn start_unshard(
        &mut self,
        stage: usize,
        shards: Vec<(String, Tensor)>,
        in_bf16: impl Fn(&str) -> bool,
    ) -> Result<(), DataParallelError> {
        let mut pending = Vec::with_capacity(shards.len());
        for (name, s) in shards {
            let rounded = in_bf16(&name) && s.dtype() == DType::F32;
            let sent = if rounded { cast(&s, DType::BF16).map_err(tensor_err(&name))? } else { s.clone() };
            self.unshard_bytes += sent.elem_count() * sent.dtype().size_in_bytes();
            pending.push((
                name.clone(),
                self.comm.all_gather(&self.group, &sent).map_err(comm_err("unshard", stage))?,
                rounded,
            ));
            self.kept.insert((stage, name), s);
        }
        self.gathering.insert(stage, pending);
        Ok(())
    }

    /// Waits for `stage`'s all-gathers, if any are in flight; returns the full tensors by name.
    ///
    /// # Errors
    /// [`DataParallelError::Comm`]; [`DataParallelError::Unknown`].
    pub fn wait_unshard(&mut self, stage: usize) -> Result<Vec<(String, Tensor)>, DataParallelError> {
        let Some(pending) = self.gathering.remove(&stage) else { return Ok(Vec::new()) };
        let mut full = Vec::with_capacity(pending.len());
        for (name, p, rounded) in pending {
            let mut gathered = p.wait(self.timeout).map_err(comm_err("unshard", stage))?;
            if rounded {
                gathered = cast(&gathered, DType::F32).map_err(tensor_err(&name))?;
            }
            let shape =
                self.shapes.get(&name).ok_or_else(|| DataParallelError::Unknown { name: name.clone() })?;
            full.push((name.clone(), unshard(&gathered, shape).map_err(tensor_err(&name))?));
        }
        Ok(full)
    }

    /// RESHARD: the shards of `stage` kept since UNSHARD, by name.
    pub fn reshard(&mut self, stage: usize) -> Vec<(String, Tensor)> {
        let names: Vec<(usize, String)> = self.kept.keys().filter(|(s, _)| *s == stage).cloned().collect();
        names.into_iter().filter_map(|k| self.kept.remove(&k).map(|t| (k.1, t))).collect()
    }

    /// REDUCE_GRAD: starts the reduction of each `(name, gradient)` of `stage` (name order):
    /// all-reduce, or with FSDP the reduce-scatter of the padded, flattened gradient.
    ///
    /// # Errors
    /// [`DataParallelError::Comm`], [`DataParallelError::Tensor`].
    pub fn start_reduce(
        &mut self,
        stage: usize,
        mut grads: Vec<(String, Tensor)>,
    ) -> Result<(), DataParallelError> {
        grads.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, g) in grads {
            self.reducing_bytes += g.elem_count() * g.dtype().size_in_bytes();
            let p = if self.fsdp {
                let padded = pad_flat(&g, self.size()).map_err(tensor_err(&name))?;
                self.comm.reduce_scatter(&self.group, &padded)
            } else {
                let group = match &self.experts {
                    Some((experts, names)) if names.contains(&name) => experts,
                    _ => &self.group,
                };
                self.comm.all_reduce(group, &g)
            };
            self.reducing.push((stage, name, p.map_err(comm_err("reduce_grad", stage))?));
        }
        Ok(())
    }

    /// Waits for every reduction REDUCE_GRAD started; returns `(stage, name, mean)`: the
    /// gradient averaged over the replicas (with FSDP, this rank's shard of it).
    ///
    /// # Errors
    /// [`DataParallelError::Comm`], [`DataParallelError::Tensor`].
    pub fn finish(&mut self) -> Result<Vec<(usize, String, Tensor)>, DataParallelError> {
        let inv = 1.0 / self.size() as f64;
        self.reducing_bytes = 0;
        let mut out = Vec::with_capacity(self.reducing.len());
        for (stage, name, p) in std::mem::take(&mut self.reducing) {
            let sum = p.wait(self.timeout).map_err(comm_err("reduce_grad", stage))?;
            let mean = sum.affine(inv, 0.0).map_err(tensor_err(&name))?;
            out.push((stage, name, mean));
        }
        Ok(out)
    }

    /// The full tensors of this rank's shards `shards` (by name, sorted), all-gathered over the
    /// group: every member calls it with the same names.
    ///
    /// # Errors
    /// [`DataParallelError::Comm`], [`DataParallelError::Unknown`] for a name without a shape
    /// (`shape_of` maps e.g. an AdamW moment to its parameter).
    pub fn gather_full(
        &self,
        shards: &[(String, Tensor)],
        shape_of: impl Fn(&str) -> String,
    ) -> Result<Vec<(String, Tensor)>, DataParallelError> {
        let pending = shards
            .iter()
            .map(|(n, s)| Ok((n, self.comm.all_gather(&self.group, s).map_err(comm_err("gather", 0))?)))
            .collect::<Result<Vec<_>, DataParallelError>>()?;
        pending
            .into_iter()
            .map(|(name, p)| {
                let gathered = p.wait(self.timeout).map_err(comm_err("gather", 0))?;
                let param = shape_of(name);
                let shape = self.shapes.get(&param).ok_or(DataParallelError::Unknown { name: param })?;
                Ok((name.clone(), unshard(&gathered, shape).map_err(tensor_err(name))?))
            })
            .collect()
    }
}

/// `g` flattened and zero-padded to a multiple of `size` elements.
fn pad_flat(g: &Tensor, size: usize) -> candle_core::Result<Tensor> {
    let flat = g.flatten_all()?;
    let n = flat.elem_count();
    let len = shard_len(n, size) * size;
    if len == n {
        return Ok(flat);
    }
    let pad = Tensor::zeros(len - n, flat.dtype(), flat.device())?;
    Tensor::cat(&[&flat, &pad], 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn shards_cover_the_tensor_with_zero_padding() {
        let full = Tensor::arange(0f32, 10.0, &Device::Cpu).unwrap().reshape((2, 5)).unwrap();
        assert_eq!(shard_len(10, 3), 4);
        let parts: Vec<Vec<f32>> = (0..3).map(|i| shard(&full, 3, i).unwrap().to_vec1().unwrap()).collect();
        assert_eq!(parts, [vec![0.0, 1.0, 2.0, 3.0], vec![4.0, 5.0, 6.0, 7.0], vec![8.0, 9.0, 0.0, 0.0]]);
        let cat = Tensor::cat(
            &parts.iter().map(|p| Tensor::new(p.as_slice(), &Device::Cpu).unwrap()).collect::<Vec<_>>(),
            0,
        )
        .unwrap();
        let back = unshard(&cat, &[2, 5]).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), full.to_vec2::<f32>().unwrap());
        assert_eq!(pad_flat(&full, 4).unwrap().dims(), &[12]);
        assert_eq!(pad_flat(&full, 5).unwrap().dims(), &[10]);
    }
}

#[cfg(test)]
mod unshard_tests {
    use super::*;
    use candle_core::Device;
    use graphpp_comm::thread::ThreadComm;

    /// Two FSDP ranks gather a [3, 5] parameter: in bf16 where asked, half the bytes, and the
    /// full tensor is the f32 one rounded to bf16 (widened back to f32); otherwise the f32 bits.
    #[test]
    fn a_bf16_gather_moves_half_the_bytes_and_rounds_once() {
        let full = Tensor::arange(0f32, 15.0, &Device::Cpu)
            .unwrap()
            .affine(0.1013, -0.7)
            .unwrap()
            .reshape((3, 5))
            .unwrap();
        let ranks: Vec<_> = ThreadComm::world(2).into_iter().map(|c| Arc::new(c) as Arc<dyn Comm>).collect();
        let runs: Vec<_> = ranks
            .into_iter()
            .map(|comm| {
                let full = full.clone();
                std::thread::spawn(move || {
                    let group = Group::world(2).unwrap();
                    let mut dp = DataParallel::new(comm, group, true, Duration::from_secs(10)).unwrap();
                    let mut got = Vec::new();
                    for bf16 in [false, true] {
                        let shard = dp.to_shard("w", &full).unwrap();
                        dp.start_unshard(0, vec![("w".into(), shard)], |_| bf16).unwrap();
                        let before = dp.unshard_bytes();
                        let (_, t) = dp.wait_unshard(0).unwrap().remove(0);
                        assert_eq!(dp.reshard(0)[0].1.dtype(), DType::F32, "the kept shard stays f32");
                        got.push((t, before));
                    }
                    got
                })
            })
            .collect();
        for run in runs {
            let got = run.join().unwrap();
            let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(got[0].0.dtype(), DType::F32);
            assert_eq!(values(&got[0].0), values(&full));
            let rounded = full.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
            assert_eq!(got[1].0.dtype(), DType::F32);
            assert_eq!(values(&got[1].0), values(&rounded));
            assert_ne!(values(&rounded), values(&full));
            // A shard of 8 elements (15 padded to 16, over 2): 32 bytes in f32, then 16 in bf16.
            assert_eq!((got[0].1, got[1].1 - got[0].1), (32, 16));
        }
    }
}
