//! Tensor parallelism of the decoder layers, as Megatron-LM lays it out (Shoeybi et al.,
//! "Megatron-LM", 2019, §3; PyTorch's `ColwiseParallel` / `RowwiseParallel`): the stage graph a
//! rank builds is its shard of the layer, with the collectives as graph ops over the `tp` group.
//!
//! - Attention: `q_proj`, `k_proj`, `v_proj` are column-parallel (rows split: each rank holds
//!   `H / tp` query heads and `KV / tp` key/value heads — one, held by `tp / KV` ranks, when there
//!   are fewer key/value heads than ranks, as Megatron replicates them), `o_proj` is
//!   row-parallel (columns split); its partial outputs are summed by an all-reduce, then its bias
//!   (if any) is added once.
//! - MLP: `gate_proj` and `up_proj` column-parallel (the width `F` split), `down_proj`
//!   row-parallel with the all-reduce after it.
//! - Before each column-parallel block the replicated hidden states pass a
//!   [`CollectiveKind::Replicate`], after each row-parallel one an [`CollectiveKind::AllReduce`]:
//!   Megatron's conjugate operators f and g, which autodiff turns into an all-reduce of the input
//!   gradient and an identity ([`graphpp_graph::MeshAxis::shares_loss`]).
//! - Embedding and LM head are vocabulary-parallel (Megatron's `VocabParallelEmbedding` and
//!   column-parallel head): each rank holds `V / tp` rows; the embedding looks up the tokens of
//!   its block and sums over the group; the cross-entropy combines the blocks' maxima, sums of
//!   exponentials and target logits by small collectives
//!   ([`TensorShard::vocab_parallel_cross_entropy`]), so the `[N, V]` logits are never formed.
//! - A MoE layer's shared experts follow the dense MLP's rule. Everything else — norms,
//!   multi-head latent attention, a mixture of experts' router and routed experts (those split
//!   over expert parallelism) — is replicated: every rank of the group computes it whole, and its
//!   gradients are whole and equal on every rank.
//!
//! - With sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
//!   Transformer Models", 2022, §4.2.2; `TensorShard::sequence`) the residual stream, the norms
//!   and the stage's input and output are split along the sequence: each rank holds `T / tp`
//!   tokens. f becomes an all-gather along the sequence before each column-parallel block, g a
//!   reduce-scatter after each row-parallel one (their adjoints: reduce-scatter and all-gather).
//!   The vocabulary-parallel embedding reduce-scatters to the rank's tokens; the LM head gathers
//!   the sequence back; the replicated parameters read by sequence shards (norms, row-parallel
//!   biases) get one partial gradient per rank, which the trainer sums over the group.
//!
//! The rule for which parameter is split along which dimension, and by how many ranks each
//! block is held, is [`split_of`]; the initial weights of a shard are the rows or columns of the
//! full parameter ([`shard_values`]), so any tp gives the same model.

use graphpp_graph::{CollectiveKind, CommGroup, GraphBuilder, MeshAxis, Region, ValueId};

use crate::config::ModelError;

/// Added to a row's maximum logit before its floor is taken through u32 (see
/// [`TensorShard::vocab_parallel_cross_entropy`]): maxima down to −2²⁰ stay positive.
const SHIFT_OFFSET: f64 = 1_048_576.0;

/// A rank's part of each decoder layer under tensor parallelism: position `index` in a group of
/// `size` ranks (graph group `tp`). [`TensorShard::WHOLE`] (size 1) holds every parameter whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorShard {
    /// Position in the tensor-parallel group, `0..size`.
    pub index: usize,
    /// Tensor-parallel degree.
    pub size: usize,
    /// Sequence parallelism: the residual stream split along the sequence (see the module doc).
    pub sequence: bool,
}

impl TensorShard {
    /// No tensor parallelism.
    pub const WHOLE: TensorShard = TensorShard { index: 0, size: 1, sequence: false };

    /// Position `index` of `size` ranks, without sequence parallelism.
    pub fn new(index: usize, size: usize) -> TensorShard {
        TensorShard { index, size, sequence: false }
    }

    /// Whether the layer is split over more than one rank.
    pub fn is_split(&self) -> bool {
        self.size > 1
    }

    /// This rank's block of a dimension of `whole` elements split over the group:
    /// `index · whole/size .. (index + 1) · whole/size`; `None` when `size` does not divide it.
    pub fn block(&self, whole: usize) -> Option<std::ops::Range<usize>> {
        self.block_of(whole, 1)
    }

    /// The tp indices holding this rank's block when each block is held by `replicas` ranks
    /// (`index − index mod replicas ..`, `replicas` of them): their gradients of it are summed,
    /// and the first counts it in the norm.
    pub fn holders(&self, replicas: usize) -> std::ops::Range<usize> {
        let replicas = replicas.max(1);
        let first = self.index - self.index % replicas;
        first..first + replicas
    }

    /// This rank's block of a dimension of `whole` elements cut into `size / replicas` parts,
    /// each held by `replicas` consecutive ranks (key/value heads fewer than tp: Megatron's
    /// replication): part `index / replicas`; `None` when the parts do not divide `whole` or
    /// `replicas` does not divide `size`. The one rule of every shard (shapes, initial values,
    /// given or saved whole tensors).
    pub fn block_of(&self, whole: usize, replicas: usize) -> Option<std::ops::Range<usize>> {
        let (size, replicas) = (self.size.max(1), replicas.max(1));
        if !size.is_multiple_of(replicas) || !whole.is_multiple_of(size / replicas) {
            return None;
        }
        let per = whole / (size / replicas);
        let part = self.index / replicas;
        Some(part * per..(part + 1) * per)
    }

    /// Whether the residual stream is split along the sequence (sequence parallelism over more
    /// than one rank).
    pub fn splits_sequence(&self) -> bool {
        self.sequence && self.is_split()
    }

    /// Tokens of a sequence of `seq` this rank's residual stream holds: `seq / size` with
    /// sequence parallelism, else `seq`.
    pub fn local_seq(&self, seq: usize) -> usize {
        if self.splits_sequence() {
            seq / self.size
        } else {
            seq
        }
    }

    /// `kind` over the group along `axis` on `x`, in the comm region `tp.<kind>`.
    fn reduce(
        &self,
        b: &mut GraphBuilder,
        kind: CollectiveKind,
        axis: usize,
        x: ValueId,
    ) -> Result<ValueId, ModelError> {
        b.set_region(Region::Comm(format!("tp.{}", kind.name())));
        let y = b.collective(kind, &self.group(), axis, x);
        b.set_region(Region::Compute);
        Ok(y?)
    }

    /// The graph group of the collectives.
    pub fn group(&self) -> CommGroup {
        CommGroup::new(MeshAxis::Tensor, self.size)
    }

    /// This rank's vocabulary block's view of the token ids `ids` `[n, 1]` (u32): the ids
    /// minus the block's first, clamped into the block (u32 `[n, 1]`, for row gathers), and a
    /// mask `[n, 1]` in `wide` (1 where the id falls in the block, else 0). Built of float ops
    /// only (`wide` must hold the ids exactly: f32 below 2²⁴): `clamp(x, 0, K) = K − relu(K −
    /// relu(x))`, each relu a max over `[x, 0]`.
    fn local_ids(
        &self,
        b: &mut GraphBuilder,
        ids: ValueId,
        vocab: usize,
        wide: graphpp_graph::DType,
    ) -> Result<(ValueId, ValueId), ModelError> {
        let block = self.block(vocab).unwrap_or(0..0);
        let n = b.shape(ids)[0];
        let x = b.cast(ids, wide)?;
        let local = b.affine(x, 1.0, -(block.start as f64))?;
        let zero = b.full(0.0, vec![n, 1])?;
        let zero = b.cast(zero, wide)?;
        let relu = |b: &mut GraphBuilder, v: ValueId| -> Result<ValueId, ModelError> {
            let both = b.concat(&[v, zero], 1)?;
            Ok(b.max(both, 1, true)?)
        };
        let last = block.len().saturating_sub(1) as f64;
        let r = relu(b, local)?;
        let below = b.affine(r, -1.0, last)?;
        let r2 = relu(b, below)?;
        let clamped = b.affine(r2, -1.0, last)?;
        let mask = b.eq(local, clamped)?;
        let idx = b.cast(clamped, graphpp_graph::DType::U32)?;
        Ok((idx, mask))
    }

    /// The vocabulary-parallel token embedding (Megatron's `VocabParallelEmbedding`): this
    /// rank's rows `table` `[V/tp, D]` (f32) looked up for the ids of `tokens` `[B, T]` that fall
    /// in its block (zero rows for the others), cast to `dtype` and summed over the group
    /// ([`TensorShard::exit`]: `[B, T, D]`, or this rank's `[B, T/tp, D]` with sequence
    /// parallelism).
    ///
    /// # Errors
    /// Building the nodes.
    pub fn vocab_embedding(
        &self,
        b: &mut GraphBuilder,
        table: ValueId,
        tokens: ValueId,
        (vocab, dtype): (usize, graphpp_graph::DType),
    ) -> Result<ValueId, ModelError> {
        let shape = b.shape(tokens);
        let n: usize = shape.iter().product();
        let ids = b.reshape(tokens, vec![n, 1])?;
        // Token ids compared in f32 (exact below 2²⁴), whatever the table's dtype.
        let (idx, mask) = self.local_ids(b, ids, vocab, graphpp_graph::DType::F32)?;
        let mask = b.cast(mask, b.ty(table).dtype)?;
        let idx = b.reshape(idx, vec![n])?;
        let rows = b.index_select(table, idx, 0)?;
        let rows = b.mul(rows, mask)?;
        let d = b.shape(table)[1];
        let e = b.reshape(rows, vec![shape[0], shape[1], d])?;
        let e = b.cast(e, dtype)?;
        self.exit(b, e, None)
    }

    /// The vocabulary-parallel cross-entropy (Megatron's `vocab_parallel_cross_entropy`): the
    /// mean over the `N` rows of `−log softmax(z)[target]` where this rank holds the logits
    /// `logits` `[N, V/tp]` of its vocabulary block and `targets` `[N]` (u32) are whole; the
    /// full `[N, V]` logits are never formed. Per row: a shift `M` (the floor of the global
    /// maximum: an all-gather of the blocks' maxima; a constant to autodiff), `S = Σ exp(z − M)`
    /// and the target's logit `z_t` (each an all-reduce of the blocks' parts); the loss is
    /// `ln S + M − z_t`. In the logits'
    /// [`graphpp_graph::DType::wide`]; the result is the same on every rank.
    ///
    /// # Errors
    /// Building the nodes.
    pub fn vocab_parallel_cross_entropy(
        &self,
        b: &mut GraphBuilder,
        logits: ValueId,
        targets: ValueId,
        vocab: usize,
    ) -> Result<ValueId, ModelError> {
        let wide = b.ty(logits).dtype.wide();
        let z = b.cast(logits, wide)?;
        let n = b.shape(z)[0];
        let block_max = b.max(z, 1, true)?;
        let maxima = self.reduce(b, CollectiveKind::AllGather, 1, block_max)?;
        let m = b.max(maxima, 1, true)?;
        // The shift only keeps exp in range: any constant near the maximum gives the same loss
        // and gradient. Its floor, through u32 (which carries no gradient), is such a constant
        // — so no rounding noise flows back through the maximum. (In f32, M + 2²⁰ rounds to
        // 1/8, so the floor may be M's rounded up: within 1 of M either way, which is all the
        // shift needs, for |M| < 2²⁰.)
        let lifted = b.affine(m, 1.0, SHIFT_OFFSET)?;
        let floor = b.cast(lifted, graphpp_graph::DType::U32)?;
        let floor = b.cast(floor, wide)?;
        let m = b.affine(floor, 1.0, -SHIFT_OFFSET)?;
        let shifted = b.sub(z, m)?;
        let e = b.exp(shifted)?;
        let part = b.sum(e, 1, false)?;
        let s = self.reduce(b, CollectiveKind::AllReduce, 0, part)?;
        let ids = b.reshape(targets, vec![n, 1])?;
        let (idx, mask) = self.local_ids(b, ids, vocab, wide)?;
        let picked = b.gather(z, idx, 1)?;
        let picked = b.mul(picked, mask)?;
        let picked = b.reshape(picked, vec![n])?;
        let zt = self.reduce(b, CollectiveKind::AllReduce, 0, picked)?;
        let ln_s = b.log(s)?;
        let m = b.reshape(m, vec![n])?;
        let a = b.add2(ln_s, m)?;
        let per_row = b.sub(a, zt)?;
        let total = b.sum(per_row, 0, false)?;
        Ok(b.scale(total, 1.0 / n as f64)?)
    }

    /// Megatron's f: `x` `[B, T, D]` (replicated, read by column-parallel projections next)
    /// through a [`CollectiveKind::Replicate`], so that its gradient is all-reduced — with
    /// sequence parallelism `x` is this rank's `[B, T/tp, D]` and is all-gathered along the
    /// sequence (comm region `tp.all_gather`; its gradient reduce-scattered); `x` itself when
    /// not split.
    ///
    /// # Errors
    /// Building the node.
    pub fn enter(&self, b: &mut GraphBuilder, x: ValueId) -> Result<ValueId, ModelError> {
        if self.splits_sequence() {
            return self.reduce(b, CollectiveKind::AllGather, 1, x);
        }
        if !self.is_split() {
            return Ok(x);
        }
        Ok(b.collective(CollectiveKind::Replicate, &self.group(), 0, x)?)
    }

    /// Megatron's g: the row-parallel projection's partial output `y` `[B, T, D]` summed over
    /// the group (comm region `tp.all_reduce`) — with sequence parallelism reduce-scattered
    /// along the sequence to this rank's `[B, T/tp, D]` (`tp.reduce_scatter`) —, then `bias`
    /// added once; `y + bias` when not split.
    ///
    /// # Errors
    /// Building the nodes.
    pub fn exit(
        &self,
        b: &mut GraphBuilder,
        y: ValueId,
        bias: Option<ValueId>,
    ) -> Result<ValueId, ModelError> {
        let y = if self.splits_sequence() {
            self.reduce(b, CollectiveKind::ReduceScatter, 1, y)?
        } else if self.is_split() {
            self.reduce(b, CollectiveKind::AllReduce, 0, y)?
        } else {
            y
        };
        Ok(match bias {
            Some(bias) => b.add2(y, bias)?,
            None => y,
        })
    }
}

/// How tensor parallelism splits a parameter: along `dim` (HF layout `[out, in]`), into
/// `tp / replicas` blocks, each held by `replicas` consecutive tp ranks (1, except key/value
/// projections with fewer key/value heads than tp: [`split_of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    /// The dimension cut.
    pub dim: usize,
    /// Ranks holding each block (their gradients of it are partial and summed).
    pub replicas: usize,
}

/// How parameter `name` of a model with `kv_heads` key/value heads splits over `tp` ranks
/// ([`shard_dim`] with `attention`), `None` for a replicated one: the key/value projections
/// (`self_attn.{k,v}_proj.{weight,bias}`) of a model with fewer key/value heads than `tp` are
/// cut into `kv_heads` blocks of one head, each held by `tp / kv_heads` ranks (Megatron-LM
/// replicates them so: each rank's query heads read one key/value head).
pub fn split_of(name: &str, attention: bool, kv_heads: usize, tp: usize) -> Option<Split> {
    let dim = shard_dim(name, attention)?;
    let kv = name.contains(".self_attn.k_proj.") || name.contains(".self_attn.v_proj.");
    let replicas = if kv && kv_heads < tp && kv_heads > 0 { tp / kv_heads } else { 1 };
    Some(Split { dim, replicas })
}

/// The dimension along which tensor parallelism splits parameter `name` (HF layout `[out, in]`),
/// `None` for a replicated one: 0 for the vocabulary-parallel embedding and LM head
/// (`model.embed_tokens.weight`, `lm_head.weight`: rows are tokens) and the column-parallel
/// projections' weights and biases (`self_attn.{q,k,v}_proj` when `attention` is split,
/// `mlp.{gate,up}_proj` of a dense MLP), 1
/// for the row-parallel weights (`self_attn.o_proj.weight`, `mlp.down_proj.weight`); a MoE
/// layer's shared experts (`mlp.shared_experts.…`) follow the dense MLP's rule. The row-parallel
/// biases, the router and the routed experts (`mlp.gate.weight`, `mlp.experts.<e>.…`) and every
/// other parameter are replicated.
pub fn shard_dim(name: &str, attention: bool) -> Option<usize> {
    if name == crate::EMBED || name == crate::LM_HEAD {
        return Some(0);
    }
    let mut parts = name.rsplit('.');
    let (kind, proj, block) = (parts.next()?, parts.next()?, parts.next()?);
    let column = match (block, proj) {
        ("self_attn", "q_proj" | "k_proj" | "v_proj") if attention => true,
        ("mlp" | "shared_experts", "gate_proj" | "up_proj") => true,
        ("self_attn", "o_proj") if attention => false,
        ("mlp" | "shared_experts", "down_proj") => false,
        _ => return None,
    };
    match (column, kind) {
        (true, "weight" | "bias") => Some(0),
        (false, "weight") => Some(1),
        _ => None,
    }
}

/// `params` (names and whole shapes) with the split ones cut to rank `tp`'s block (`split` of
/// the rule, [`TensorShard::block_of`]).
pub fn shard_shapes(
    params: Vec<(String, Vec<usize>)>,
    tp: TensorShard,
    split: impl Fn(&str) -> Option<Split>,
) -> Vec<(String, Vec<usize>)> {
    params
        .into_iter()
        .map(|(name, mut shape)| {
            if let Some(Split { dim, replicas }) = split(&name).filter(|_| tp.is_split()) {
                shape[dim] = tp.block_of(shape[dim], replicas).map_or(0, |b| b.len());
            }
            (name, shape)
        })
        .collect()
}

/// Rank `tp`'s shard of each of `params` (name, whole row-major shape, f32 values): the split
/// ones cut along their dimension to the rank's block ([`TensorShard::block_of`]).
pub fn shard_values(
    params: Vec<(String, Vec<usize>, Vec<f32>)>,
    tp: TensorShard,
    split: impl Fn(&str) -> Option<Split>,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    params
        .into_iter()
        .map(|(name, shape, data)| match split(&name).filter(|_| tp.is_split()) {
            Some(Split { dim: d, replicas }) => {
                let (outer, inner): (usize, usize) =
                    (shape[..d].iter().product(), shape[d + 1..].iter().product());
                let block = tp.block_of(shape[d], replicas).unwrap_or(0..0);
                let mut kept = Vec::with_capacity(outer * block.len() * inner);
                for o in 0..outer {
                    let start = (o * shape[d] + block.start) * inner;
                    kept.extend_from_slice(&data[start..start + block.len() * inner]);
                }
                let mut s = shape;
                s[d] = block.len();
                (name, s, kept)
            }
            None => (name, shape, data),
        })
        .collect()
}

/// Checks that tensor-parallel degree `tp` splits each of `fields` (HF name, size: the attention
/// heads, MLP width, vocabulary) evenly — Megatron's condition — and `kv_heads` (the key/value
/// heads, when the attention splits) evenly or, fewer than tp, into tp (each head is then held
/// by `tp / KV` ranks: [`split_of`]).
///
/// # Errors
/// [`ModelError::TensorParallel`] naming the first field tp does not divide (every field when
/// tp is 0).
pub fn check_divides(
    tp: usize,
    fields: &[(&'static str, usize)],
    kv_heads: Option<usize>,
) -> Result<(), ModelError> {
    for &(field, value) in fields {
        if tp == 0 || !value.is_multiple_of(tp) {
            return Err(ModelError::TensorParallel { field, value, tp });
        }
    }
    if let Some(kv) = kv_heads {
        let replicated = kv > 0 && kv < tp && tp.is_multiple_of(kv);
        if tp == 0 || !(kv.is_multiple_of(tp) || replicated) {
            return Err(ModelError::TensorParallel { field: "num_key_value_heads", value: kv, tp });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LlamaConfig, Model, StageOptions, StageSpec};
    use graphpp_graph::Op;

    #[test]
    fn the_rule_splits_megatrons_projections_only() {
        let l = "model.layers.3";
        for (name, dim) in [
            ("self_attn.q_proj.weight", Some(0)),
            ("self_attn.k_proj.bias", Some(0)),
            ("self_attn.v_proj.weight", Some(0)),
            ("self_attn.o_proj.weight", Some(1)),
            ("self_attn.o_proj.bias", None),
            ("mlp.gate_proj.weight", Some(0)),
            ("mlp.up_proj.bias", Some(0)),
            ("mlp.down_proj.weight", Some(1)),
            ("mlp.down_proj.bias", None),
            ("mlp.shared_experts.gate_proj.weight", Some(0)),
            ("mlp.shared_experts.down_proj.weight", Some(1)),
            ("mlp.experts.5.down_proj.weight", None),
            ("mlp.gate.weight", None),
            ("input_layernorm.weight", None),
        ] {
            assert_eq!(shard_dim(&format!("{l}.{name}"), true), dim, "{name}");
        }
        // Attention that does not split (multi-head latent attention) keeps its projections whole.
        assert_eq!(shard_dim("model.layers.0.self_attn.q_proj.weight", false), None);
        assert_eq!(shard_dim("model.layers.0.self_attn.o_proj.weight", false), None);
        assert_eq!(shard_dim("model.embed_tokens.weight", true), Some(0));
        assert_eq!(shard_dim("lm_head.weight", false), Some(0));
    }

    /// A `[2, 4]` matrix split along dim 1 over 2 ranks: rank 1 keeps columns 2..4 of each row;
    /// along dim 0, rank 1 keeps row 1.
    #[test]
    fn shards_are_blocks_of_the_whole_parameter() {
        let whole = || vec![("w".to_string(), vec![2, 4], (0..8).map(|x| x as f32).collect())];
        let split = |dim| move |_: &str| Some(Split { dim, replicas: 1 });
        let cols = shard_values(whole(), TensorShard::new(1, 2), split(1));
        assert_eq!(cols[0].1, vec![2, 2]);
        assert_eq!(cols[0].2, vec![2.0, 3.0, 6.0, 7.0]);
        let rows = shard_values(whole(), TensorShard::new(1, 2), split(0));
        assert_eq!((rows[0].1.clone(), rows[0].2.clone()), (vec![1, 4], vec![4.0, 5.0, 6.0, 7.0]));
        let kept = shard_values(whole(), TensorShard::new(1, 2), |_| None);
        assert_eq!(kept[0].2.len(), 8);
    }

    /// The stage a rank builds at tp = 2: half the heads and half the MLP width, one replicate
    /// before each column-parallel block and one all-reduce after each row-parallel one, and
    /// initial weights that are the blocks of the whole model's.
    #[test]
    fn a_tp_stage_holds_its_shard_and_the_collectives() {
        let cfg = LlamaConfig::tiny();
        let whole = StageSpec::whole(cfg.num_hidden_layers);
        let spec = StageSpec { tp: TensorShard::new(1, 2), ..whole.clone() };
        let shapes: std::collections::HashMap<String, Vec<usize>> =
            cfg.stage_parameters(&spec).into_iter().collect();
        let (d, f) = (cfg.hidden_size, cfg.intermediate_size);
        assert_eq!(shapes["model.layers.0.self_attn.q_proj.weight"], vec![d / 2, d]);
        assert_eq!(shapes["model.layers.0.self_attn.o_proj.weight"], vec![d, d / 2]);
        assert_eq!(shapes["model.layers.0.mlp.down_proj.weight"], vec![d, f / 2]);
        assert_eq!(shapes["model.embed_tokens.weight"], vec![cfg.vocab_size / 2, d]);
        let g = cfg.build_stage(&spec, &StageOptions::new(1, 8)).unwrap();
        let count = |kind: CollectiveKind| {
            g.nodes
                .iter()
                .filter(|n| {
                    matches!(n.op, Op::CollectiveStart { kind: k, group, .. }
                    if k == kind && group.mesh_axis == MeshAxis::Tensor && group.size == 2)
                })
                .count()
        };
        // Two per layer, plus the vocabulary-parallel embedding's all-reduce, the LM head's
        // replicate and the cross-entropy's two all-reduces (sum of exponentials, target logit).
        let layers = cfg.num_hidden_layers;
        assert_eq!(
            (count(CollectiveKind::Replicate), count(CollectiveKind::AllReduce)),
            (2 * layers + 1, 2 * layers + 3)
        );
        let full: std::collections::HashMap<String, Vec<f32>> =
            cfg.init_parameters(&whole, 7).into_iter().map(|(n, _, v)| (n, v)).collect();
        for (name, shape, v) in cfg.init_parameters(&spec, 7) {
            let w = &full[&name];
            match shard_dim(&name, true) {
                Some(0) => assert_eq!(&v[..], &w[v.len()..], "{name}: rank 1 holds the second rows"),
                Some(_) => assert_eq!(v[..shape[1]], w[shape[1]..2 * shape[1]], "{name}: second columns"),
                None => assert_eq!(&v, w, "{name}: replicated"),
            }
        }
    }

    /// Sequence parallelism keeps only this rank's tokens of what the backward reads: the
    /// residual stream and norms are split, and the all-gathered inputs of the column-parallel
    /// projections are gathered again in the backward from the saved shard (Megatron's way) —
    /// under a recomputing policy; `save-all` saves them gathered.
    #[test]
    fn sequence_parallelism_saves_the_shards() {
        let cfg = LlamaConfig::tiny();
        // A middle stage: one decoder layer, no embedding or head.
        // The shapes of the values the backward reads saved.
        let saved = |sequence: bool, policy: &graphpp_graph::RecomputePolicy| -> Vec<Vec<usize>> {
            let tp = TensorShard { index: 0, size: 2, sequence };
            let spec = StageSpec { stage: 1, stages: 3, layers: 1..2, ep: crate::ExpertShard::WHOLE, tp };
            let g = cfg.build_stage(&spec, &StageOptions::new(1, 16)).unwrap();
            let sg = graphpp_graph::stage_graphs(&g, policy).unwrap();
            let specs = sg.full_bw.input_specs();
            specs
                .into_iter()
                .filter(|s| s.kind == graphpp_graph::InputKind::Saved)
                .map(|s| s.ty.shape)
                .collect()
        };
        let floats = |v: &[Vec<usize>]| v.iter().map(|s| s.iter().product::<usize>()).sum::<usize>() as f64;
        let pointwise = graphpp_graph::RecomputePolicy::Pointwise;
        let ratio = floats(&saved(true, &pointwise)) / floats(&saved(false, &pointwise));
        assert!(ratio <= 0.6, "saved floats with sequence parallelism: {ratio:.3} of without");
        // The gathered projection inputs ([B·T, D] = [16, 64], all 16 tokens) are saved under
        // save-all and gathered again (not saved) under pointwise.
        let gathered = |v: &[Vec<usize>]| v.iter().filter(|s| s[..] == [16, 64]).count();
        assert!(gathered(&saved(true, &graphpp_graph::RecomputePolicy::SaveAll)) > 0);
        assert_eq!(gathered(&saved(true, &pointwise)), 0);
    }

    /// One key/value head at tp = 2: both ranks hold it whole (each block held by 2 ranks).
    #[test]
    fn a_key_value_head_is_replicated_when_fewer_than_tp() {
        let s = split_of("model.layers.0.self_attn.k_proj.weight", true, 1, 2);
        assert_eq!(s, Some(Split { dim: 0, replicas: 2 }));
        assert_eq!(
            split_of("model.layers.0.self_attn.q_proj.weight", true, 1, 2).map(|s| s.replicas),
            Some(1)
        );
        for index in 0..2 {
            assert_eq!(TensorShard::new(index, 2).block_of(16, 2), Some(0..16));
        }
        // 2 heads over tp = 4: ranks 0, 1 hold head 0; ranks 2, 3 head 1.
        assert_eq!(TensorShard::new(3, 4).block_of(32, 2), Some(16..32));
        assert_eq!(TensorShard::new(1, 4).block_of(32, 2), Some(0..16));
    }

    #[test]
    fn a_degree_that_does_not_divide_is_named() {
        // A MoE model's key/value heads follow the same rule: one head replicated at tp 2.
        let moe_mqa = crate::MoeConfig {
            base: LlamaConfig { num_key_value_heads: Some(1), ..LlamaConfig::tiny() },
            ..crate::MoeConfig::tiny()
        };
        assert_eq!(moe_mqa.check_tp(2), Ok(()));
        let cfg = LlamaConfig::tiny();
        assert_eq!(
            cfg.check_tp(3),
            Err(ModelError::TensorParallel { field: "num_attention_heads", value: 4, tp: 3 })
        );
        // Fewer key/value heads than tp is fine where they divide it (replicated), not otherwise:
        // 6 heads, 2 key/value heads, tp = 3.
        let mqa = LlamaConfig { num_key_value_heads: Some(1), ..LlamaConfig::tiny() };
        assert_eq!(mqa.check_tp(2), Ok(()));
        let gqa = LlamaConfig {
            num_attention_heads: 6,
            num_key_value_heads: Some(2),
            head_dim: Some(16),
            intermediate_size: 192,
            vocab_size: 258,
            ..LlamaConfig::tiny()
        };
        let e = gqa.check_tp(3).unwrap_err();
        assert_eq!(e, ModelError::TensorParallel { field: "num_key_value_heads", value: 2, tp: 3 });
        assert!(e.to_string().contains("`num_key_value_heads` = 2 does not split over tp = 3"), "{e}");
        assert!(cfg.check_tp(0).is_err());
        assert_eq!(cfg.check_tp(4), Ok(()));
    }
}
