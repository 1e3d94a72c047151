//! Tensor parallelism of the decoder layers, as Megatron-LM lays it out (Shoeybi et al.,
//! "Megatron-LM", 2019, §3; PyTorch's `ColwiseParallel` / `RowwiseParallel`): the stage graph a
//! rank builds is its shard of the layer, with the collectives as graph ops over the `tp` group.
//!
//! - Attention: `q_proj`, `k_proj`, `v_proj` are column-parallel (rows split: each rank holds
//!   `H / tp` query heads and `KV / tp` key/value heads, so tp must divide both), `o_proj` is
//!   row-parallel (columns split); its partial outputs are summed by an all-reduce, then its bias
//!   (if any) is added once.
//! - MLP: `gate_proj` and `up_proj` column-parallel (the width `F` split), `down_proj`
//!   row-parallel with the all-reduce after it.
//! - Before each column-parallel block the replicated hidden states pass a
//!   [`CollectiveKind::Replicate`], after each row-parallel one an [`CollectiveKind::AllReduce`]:
//!   Megatron's conjugate operators f and g, which autodiff turns into an all-reduce of the input
//!   gradient and an identity ([`graphpp_graph::MeshAxis::shares_loss`]).
//! - Everything else — embedding, norms, LM head and loss, multi-head latent attention, a
//!   mixture of experts' router, routed and shared experts — is replicated: every rank of the
//!   group computes it whole, and its gradients are whole and equal on every rank.
//!
//! The rule for which parameter is split along which dimension is [`shard_dim`]; the initial
//! weights of a shard are the rows or columns of the full parameter ([`shard_values`]), so any
//! tp gives the same model.

use graphpp_graph::{CollectiveKind, CommGroup, GraphBuilder, MeshAxis, Region, ValueId};

use crate::config::ModelError;

/// A rank's part of each decoder layer under tensor parallelism: position `index` in a group of
/// `size` ranks (graph group `tp`). [`TensorShard::WHOLE`] (size 1) holds every parameter whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorShard {
    /// Position in the tensor-parallel group, `0..size`.
    pub index: usize,
    /// Tensor-parallel degree.
    pub size: usize,
}

impl TensorShard {
    /// No tensor parallelism.
    pub const WHOLE: TensorShard = TensorShard { index: 0, size: 1 };

    /// Whether the layer is split over more than one rank.
    pub fn is_split(&self) -> bool {
        self.size > 1
    }

    /// The graph group of the collectives.
    pub fn group(&self) -> CommGroup {
        CommGroup::new(MeshAxis::Tensor, self.size)
    }

    /// Megatron's f: `x` (replicated, read by column-parallel projections next) through a
    /// [`CollectiveKind::Replicate`], so that its gradient is all-reduced; `x` itself when not
    /// split.
    ///
    /// # Errors
    /// Building the node.
    pub fn enter(&self, b: &mut GraphBuilder, x: ValueId) -> Result<ValueId, ModelError> {
        if !self.is_split() {
            return Ok(x);
        }
        Ok(b.collective(CollectiveKind::Replicate, &self.group(), 0, x)?)
    }

    /// Megatron's g: the row-parallel projection's partial output `y` summed over the group
    /// (comm region `tp.all_reduce`), then `bias` added once; `y + bias` when not split.
    ///
    /// # Errors
    /// Building the nodes.
    pub fn exit(&self, b: &mut GraphBuilder, y: ValueId, bias: Option<ValueId>) -> Result<ValueId, ModelError> {
        let y = if self.is_split() {
            b.set_region(Region::Comm("tp.all_reduce".into()));
            let s = b.collective(CollectiveKind::AllReduce, &self.group(), 0, y);
            b.set_region(Region::Compute);
            s?
        } else {
            y
        };
        Ok(match bias {
            Some(bias) => b.add2(y, bias)?,
            None => y,
        })
    }
}

/// The dimension along which tensor parallelism splits parameter `name` (HF layout `[out, in]`),
/// `None` for a replicated one: 0 for the column-parallel projections' weights and biases
/// (`self_attn.{q,k,v}_proj` when `attention` is split, `mlp.{gate,up}_proj` of a dense MLP), 1
/// for the row-parallel weights (`self_attn.o_proj.weight`, `mlp.down_proj.weight`). The
/// row-parallel biases, shared and routed experts (`mlp.shared_experts.…`,
/// `mlp.experts.<e>.…`) and every other parameter are replicated.
pub fn shard_dim(name: &str, attention: bool) -> Option<usize> {
    let mut parts = name.rsplit('.');
    let (kind, proj, block) = (parts.next()?, parts.next()?, parts.next()?);
    let column = match (block, proj) {
        ("self_attn", "q_proj" | "k_proj" | "v_proj") if attention => true,
        ("mlp", "gate_proj" | "up_proj") => true,
        ("self_attn", "o_proj") if attention => false,
        ("mlp", "down_proj") => false,
        _ => return None,
    };
    match (column, kind) {
        (true, "weight" | "bias") => Some(0),
        (false, "weight") => Some(1),
        _ => None,
    }
}

/// `params` (names and whole shapes) with the split ones divided along their [`shard_dim`] by
/// `tp.size` (`dim` of the rule).
pub fn shard_shapes(
    params: Vec<(String, Vec<usize>)>,
    tp: TensorShard,
    dim: impl Fn(&str) -> Option<usize>,
) -> Vec<(String, Vec<usize>)> {
    params
        .into_iter()
        .map(|(name, mut shape)| {
            if let Some(d) = dim(&name).filter(|_| tp.is_split()) {
                shape[d] /= tp.size;
            }
            (name, shape)
        })
        .collect()
}

/// Rank `tp`'s shard of each of `params` (name, whole row-major shape, f32 values): the split
/// ones cut along their `dim` into `tp.size` equal blocks, block `tp.index` kept.
pub fn shard_values(
    params: Vec<(String, Vec<usize>, Vec<f32>)>,
    tp: TensorShard,
    dim: impl Fn(&str) -> Option<usize>,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    params
        .into_iter()
        .map(|(name, shape, data)| match dim(&name).filter(|_| tp.is_split()) {
            Some(d) => {
                let (outer, inner): (usize, usize) =
                    (shape[..d].iter().product(), shape[d + 1..].iter().product());
                let block = shape[d] / tp.size;
                let mut kept = Vec::with_capacity(outer * block * inner);
                for o in 0..outer {
                    let start = (o * shape[d] + tp.index * block) * inner;
                    kept.extend_from_slice(&data[start..start + block * inner]);
                }
                let mut s = shape;
                s[d] = block;
                (name, s, kept)
            }
            None => (name, shape, data),
        })
        .collect()
}

/// Checks that tensor-parallel degree `tp` splits each of `fields` (HF name, size: the attention
/// heads, key/value heads and MLP width) evenly — Megatron's condition; key/value heads fewer
/// than tp, which Megatron replicates, are not supported yet.
///
/// # Errors
/// [`ModelError::TensorParallel`] naming the first field tp does not divide (every field when
/// tp is 0).
pub fn check_divides(tp: usize, fields: &[(&'static str, usize)]) -> Result<(), ModelError> {
    for &(field, value) in fields {
        if tp == 0 || !value.is_multiple_of(tp) {
            return Err(ModelError::TensorParallel { field, value, tp });
        }
    }
    Ok(())
}
