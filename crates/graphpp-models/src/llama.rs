//! Llama-style dense decoder as a stage graph (docs/ARCHITECTURE.md "Models, data, training"): embedding on the first stage,
//! contiguous decoder layers, final RMSNorm + LM head + cross-entropy on the last. Parameter names
//! follow Hugging Face (`model.layers.0.self_attn.q_proj.weight`, …).

use crate::config::{LlamaConfig, ModelError};
use crate::recompute::Recompute;
use crate::tensor_parallel::{shard_shapes, shard_values, split_of, TensorShard};
use graphpp_graph::layers::{
    causal_attention, cross_entropy, embedding, gated_mlp, linear, rms_norm, AttentionDims, AttentionWeights,
    MlpWeights,
};
use graphpp_graph::names::{INPUT, LOGITS, LOSS, MTP_LOSS, OUTPUT, TARGETS, TOKENS};
use graphpp_graph::{CollectiveKind, CommGroup, DType, Graph, GraphBuilder, InputKind, TensorType, ValueId};
use std::collections::HashMap;
use std::ops::Range;

/// HF name of the token embedding (and, with `tie_word_embeddings`, of the LM head's matrix).
pub const EMBED: &str = "model.embed_tokens.weight";
/// HF name of the untied LM head.
pub const LM_HEAD: &str = "lm_head.weight";

/// Microbatch shape and numeric options of a stage graph.
///
/// Mixed precision (`dtype` bf16, `master_dtype` f32, as [`StageOptions::mixed`] sets): the
/// parameter inputs are f32 master weights and the graph casts each to bf16 right after its
/// input (the embedding table after the row gather, so its gradient is scattered in f32); the
/// activations, matmuls, saved values and the stage output (the activation sent to the next
/// stage; its gradient comes back in bf16) are bf16; RMSNorm's normalisation, the attention
/// softmax and the loss run in f32 ([`DType::wide`]). Autodiff turns each cast into a cast
/// back, so every `grad.<param>` is f32. With FSDP the f32 shard is all-gathered, then cast.
#[derive(Clone, Debug, PartialEq)]
pub struct StageOptions {
    /// Sequences per microbatch `B`.
    pub batch: usize,
    /// Tokens per sequence `T`.
    pub seq: usize,
    /// Float dtype of activations and compute (and of the buffers).
    pub dtype: DType,
    /// Dtype of the parameter inputs (the master weights) when it differs from `dtype`; each
    /// parameter is then cast to `dtype` in the graph. `None`: parameters are `dtype` too.
    pub master_dtype: Option<DType>,
    /// When set, parameters are shards along axis 0 over this group and all-gathered before use.
    pub fsdp: Option<CommGroup>,
    /// On the last stage, output `logits` `[B·T, V]` instead of the loss and take no `targets`
    /// (inference: validation sampling and text generation).
    pub logits: bool,
    /// What the forward saves for the backward; the runtime derives the stage's backward graphs
    /// under [`Recompute::policy`].
    pub recompute: Recompute,
}

impl StageOptions {
    /// `B×T` microbatch in f32, no FSDP, the default recomputation (`Recompute::Pointwise`).
    pub fn new(batch: usize, seq: usize) -> Self {
        StageOptions {
            batch,
            seq,
            dtype: DType::F32,
            master_dtype: None,
            fsdp: None,
            logits: false,
            recompute: Recompute::default(),
        }
    }

    /// `B×T` microbatch computed in `dtype` from f32 master weights (mixed precision when `dtype`
    /// is bf16; exactly [`StageOptions::new`] when it is f32).
    pub fn mixed(batch: usize, seq: usize, dtype: DType) -> Self {
        let master_dtype = (dtype != DType::F32).then_some(DType::F32);
        StageOptions { dtype, master_dtype, ..StageOptions::new(batch, seq) }
    }

    /// Dtype of the parameter inputs: `master_dtype`, else `dtype`.
    pub fn parameter_dtype(&self) -> DType {
        self.master_dtype.unwrap_or(self.dtype)
    }
}

/// Which part of the model a stage holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSpec {
    /// Stage index `s` in `0..S`.
    pub stage: usize,
    /// Number of stages `S`.
    pub stages: usize,
    /// Decoder layers held.
    pub layers: Range<usize>,
    /// Which routed experts of each MoE layer it holds (all without expert parallelism).
    pub ep: ExpertShard,
    /// Which shard of each decoder layer's split matrices it holds (all without tensor
    /// parallelism; [`crate::tensor_parallel`]).
    pub tp: TensorShard,
}

/// A rank's part of the routed experts under expert parallelism (DeepSeek-V3 report §3.4;
/// Megatron-LM's expert model parallelism): the `E` routed experts of every MoE layer are split
/// into `size` contiguous blocks of `E / size`; this stage holds block `index`, and the tokens
/// of the `size` ranks of its expert-parallel group (graph group `ep`) are exchanged by
/// all-to-alls. [`ExpertShard::WHOLE`] (size 1) holds every expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExpertShard {
    /// Position in the expert-parallel group, `0..size`.
    pub index: usize,
    /// Expert-parallel degree (ranks sharing one layer's experts).
    pub size: usize,
}

impl ExpertShard {
    /// Every expert on one rank (no expert parallelism).
    pub const WHOLE: ExpertShard = ExpertShard { index: 0, size: 1 };

    /// The experts held out of `experts` (which `size` divides): `index·E/size .. (index+1)·E/size`.
    pub fn experts(&self, experts: usize) -> Range<usize> {
        let per = experts / self.size.max(1);
        self.index * per..(self.index + 1) * per
    }
}

impl StageSpec {
    /// The whole model of `layers` decoder layers as one stage, every expert held.
    pub fn whole(layers: usize) -> StageSpec {
        StageSpec { stage: 0, stages: 1, layers: 0..layers, ep: ExpertShard::WHOLE, tp: TensorShard::WHOLE }
    }

    /// Whether this stage holds the embedding.
    pub fn is_first(&self) -> bool {
        self.stage == 0
    }
    /// Whether this stage holds the final norm, LM head and loss.
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }
}

/// The most even split of `num_layers` decoder layers over `stages` stages: each stage
/// `num_layers / stages` layers, the first `num_layers % stages` one more (the last stage, which
/// also runs the LM head and loss, is never among them); `stages` 0 is taken as 1.
pub fn balanced_split(num_layers: usize, stages: usize) -> Vec<usize> {
    let stages = stages.max(1);
    (0..stages).map(|s| num_layers / stages + usize::from(s < num_layers % stages)).collect()
}

/// Splits `num_layers` into `stages` contiguous ranges: evenly, or by `layers_per_stage`
/// (`--layers-per-stage 3,3,2`). Errors: [`ModelError::Split`] when the counts do not add up,
/// `stages` is 0 or above `num_layers`, or no split is given and the layers do not divide evenly
/// (the message suggests an uneven split, which then has one layer at least per stage).
pub fn split_layers(
    num_layers: usize,
    stages: usize,
    layers_per_stage: Option<&[usize]>,
) -> Result<Vec<StageSpec>, ModelError> {
    if stages == 0 {
        return Err(ModelError::Split("need at least one stage".into()));
    }
    let counts: Vec<usize> = match layers_per_stage {
        Some(c) => {
            if c.len() != stages || c.iter().sum::<usize>() != num_layers {
                return Err(ModelError::Split(format!(
                    "layers per stage {c:?} must be {stages} numbers adding up to {num_layers}"
                )));
            }
            if let Some(stage) = c.iter().position(|&n| n == 0) {
                return Err(ModelError::Split(format!(
                    "layers per stage {c:?}: stage {stage} holds no decoder layer (each stage needs one at least)"
                )));
            }
            c.to_vec()
        }
        None => {
            if stages > num_layers {
                return Err(ModelError::Split(format!(
                    "{stages} stages exceed the model's {} (each stage needs one at least); use at \
                     most {num_layers} stages or a model with more layers",
                    plural(num_layers, "decoder layer", "decoder layers")
                )));
            }
            if !num_layers.is_multiple_of(stages) {
                let hint: Vec<String> =
                    balanced_split(num_layers, stages).iter().map(ToString::to_string).collect();
                return Err(ModelError::Split(format!(
                    "{num_layers} layers do not divide into {stages} stages; give an uneven split with \
                     --layers-per-stage (e.g. {}) or another stage count",
                    hint.join(",")
                )));
            }
            vec![num_layers / stages; stages]
        }
    };
    let mut start = 0;
    Ok(counts
        .iter()
        .enumerate()
        .map(|(stage, &n)| {
            start += n;
            StageSpec {
                stage,
                stages,
                layers: start - n..start,
                ep: ExpertShard::WHOLE,
                tp: TensorShard::WHOLE,
            }
        })
        .collect())
}

/// Names and shapes (HF layout `[out, in]`) of the parameters a stage holds, in interface order:
/// per projection its `.weight`, then its `.bias` when the config has `attention_bias` /
/// `mlp_bias`. With `tie_word_embeddings` there is no `lm_head.weight`: the LM head reads
/// `model.embed_tokens.weight`, which the last stage then holds too (its own copy when it is not
/// also the first stage; the trainer sums the copies' gradients by name, so they stay equal).
pub fn stage_parameters(cfg: &LlamaConfig, spec: &StageSpec) -> Vec<(String, Vec<usize>)> {
    decoder_parameters(cfg, spec, &GroupedQueryAttention(cfg), &DenseMlp(cfg), None)
}

/// The parameters of one block of a stage by their HF names under a prefix
/// (`model.layers.3.self_attn`): `weight("q_proj")` is `{pre}.q_proj.weight`.
#[derive(Clone, Copy)]
pub(crate) struct ParamsAt<'a> {
    /// Every parameter of the stage by name, as the graph reads it (cast).
    pub all: &'a HashMap<String, ValueId>,
    /// The block's prefix.
    pub pre: &'a str,
}

impl ParamsAt<'_> {
    /// `{pre}.{name}.weight` (the stage holds it: the names come from the same config).
    pub fn weight(&self, name: &str) -> ValueId {
        self.all[&format!("{}.{name}.weight", self.pre)]
    }

    /// `{pre}.{name}.bias`, where the config has one.
    pub fn bias(&self, name: &str) -> Option<ValueId> {
        self.all.get(&format!("{}.{name}.bias", self.pre)).copied()
    }
}

/// The self-attention block of each decoder layer, after `input_layernorm`: Llama's
/// grouped-query attention ([`GroupedQueryAttention`]) or DeepSeek's multi-head latent attention
/// ([`crate::mla`]). Parameters are under `model.layers.<l>.self_attn`.
pub(crate) trait SelfAttention {
    /// Appends the names and shapes of the block's parameters under `pre`
    /// (`model.layers.<l>.self_attn`), whole.
    fn parameters(&self, pre: &str, out: &mut Vec<(String, Vec<usize>)>);

    /// Whether the block splits over tensor parallelism (its projections are then the shards
    /// of [`crate::tensor_parallel::shard_dim`]); one that does not is computed whole on every
    /// rank of the group.
    fn splits_over_tp(&self) -> bool;

    /// Builds the block on the normalised hidden states `h` `[B, T, D]` from its parameters
    /// `p`; `bufs` are `rope.cos`, `rope.sin` and `mask` ([`stage_buffer_shapes`]). A block
    /// that splits over tensor parallelism builds shard `tp` (its parameters are the shards of
    /// [`crate::tensor_parallel::split_of`]); one that does not ignores `tp` and is computed
    /// whole on every rank of the group.
    fn build(
        &self,
        b: &mut GraphBuilder,
        h: ValueId,
        p: ParamsAt,
        bufs: &[ValueId],
        tp: TensorShard,
    ) -> Result<ValueId, ModelError>;
}

/// Llama's attention: `q_proj`, `k_proj`, `v_proj`, `o_proj` (optional biases), grouped-query
/// heads, RoPE on q and k.
pub(crate) struct GroupedQueryAttention<'a>(pub &'a LlamaConfig);

impl SelfAttention for GroupedQueryAttention<'_> {
    fn parameters(&self, pre: &str, out: &mut Vec<(String, Vec<usize>)>) {
        let cfg = self.0;
        let (d, hd, ab) = (cfg.hidden_size, cfg.head_dim(), cfg.attention_bias);
        let (qd, kvd) = (cfg.num_attention_heads * hd, cfg.kv_heads() * hd);
        projection(out, format!("{pre}.q_proj"), qd, d, ab);
        projection(out, format!("{pre}.k_proj"), kvd, d, ab);
        projection(out, format!("{pre}.v_proj"), kvd, d, ab);
        projection(out, format!("{pre}.o_proj"), d, qd, ab);
    }

    fn splits_over_tp(&self) -> bool {
        true
    }

    /// Under tensor parallelism: `H / tp` query and `KV / tp` key/value heads (one, held by
    /// `tp / KV` ranks, when KV < tp), the output
    /// projection's partial sums all-reduced before its bias ([`crate::tensor_parallel`]).
    fn build(
        &self,
        b: &mut GraphBuilder,
        h: ValueId,
        p: ParamsAt,
        bufs: &[ValueId],
        tp: TensorShard,
    ) -> Result<ValueId, ModelError> {
        let cfg = self.0;
        // Key/value heads fewer than tp: each rank reads the one its query heads share.
        let kv_heads = (cfg.kv_heads() / tp.size).max(1);
        let dims = AttentionDims { heads: cfg.num_attention_heads / tp.size, kv_heads };
        let aw = AttentionWeights {
            q: p.weight("q_proj"),
            k: p.weight("k_proj"),
            v: p.weight("v_proj"),
            o: p.weight("o_proj"),
            q_bias: p.bias("q_proj"),
            k_bias: p.bias("k_proj"),
            v_bias: p.bias("v_proj"),
            o_bias: None,
        };
        let h = tp.enter(b, h)?;
        let a = causal_attention(b, h, aw, dims, bufs[0], bufs[1], bufs[2])?;
        b.scoped("o_proj", |b| tp.exit(b, a, p.bias("o_proj")))
    }
}

/// The feed-forward block of each decoder layer, after `post_attention_layernorm`: the dense
/// gated MLP of Llama ([`DenseMlp`]) or a mixture of experts ([`crate::moe`]). Parameters are
/// under `model.layers.<l>.mlp.`.
pub(crate) trait FeedForward {
    /// Appends the names and shapes of layer `layer`'s feed-forward parameters on a stage
    /// holding the experts `ep`.
    fn parameters(&self, layer: usize, ep: ExpertShard, out: &mut Vec<(String, Vec<usize>)>);

    /// Builds layer `layer`'s block on the normalised hidden states `h` `[B, T, D]`; `params` maps
    /// every parameter name of the stage to its (cast) value. As [`SelfAttention::build`], a
    /// block that splits over tensor parallelism builds shard `tp`, any other ignores it.
    fn build(
        &self,
        b: &mut GraphBuilder,
        layer: usize,
        shards: (ExpertShard, TensorShard),
        h: ValueId,
        params: &HashMap<String, ValueId>,
    ) -> Result<ValueId, ModelError>;
}

/// Llama's gated MLP (`gate_proj`, `up_proj`, `down_proj`, optional biases).
pub(crate) struct DenseMlp<'a>(pub &'a LlamaConfig);

impl FeedForward for DenseMlp<'_> {
    fn parameters(&self, layer: usize, _ep: ExpertShard, out: &mut Vec<(String, Vec<usize>)>) {
        let cfg = self.0;
        let pre = format!("model.layers.{layer}.mlp");
        mlp_parameters(out, &pre, cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
    }

    /// Under tensor parallelism: `F / tp` of the width, `down_proj`'s partial sums all-reduced
    /// before its bias ([`crate::tensor_parallel`]).
    fn build(
        &self,
        b: &mut GraphBuilder,
        layer: usize,
        (_, tp): (ExpertShard, TensorShard),
        h: ValueId,
        params: &HashMap<String, ValueId>,
    ) -> Result<ValueId, ModelError> {
        let pre = format!("model.layers.{layer}.mlp");
        let h = tp.enter(b, h)?;
        let y = mlp_at(b, h, params, &pre, self.0.hidden_act)?;
        let bias = ParamsAt { all: params, pre: &pre }.bias("down_proj");
        b.scoped("down_proj", |b| tp.exit(b, y, bias))
    }
}

/// Appends the parameters of a gated MLP under `pre` (`{pre}.gate_proj`, `up_proj` `[f, d]`,
/// `down_proj` `[d, f]`, with biases when `bias`).
pub(crate) fn mlp_parameters(out: &mut Vec<(String, Vec<usize>)>, pre: &str, d: usize, f: usize, bias: bool) {
    projection(out, format!("{pre}.gate_proj"), f, d, bias);
    projection(out, format!("{pre}.up_proj"), f, d, bias);
    projection(out, format!("{pre}.down_proj"), d, f, bias);
}

/// The gated MLP whose parameters [`mlp_parameters`] names under `pre`, on `x` (biases used
/// where `params` holds them, except `down_proj`'s: the caller adds it, after the all-reduce of
/// a row-parallel projection — [`TensorShard::exit`]).
pub(crate) fn mlp_at(
    b: &mut GraphBuilder,
    x: ValueId,
    params: &HashMap<String, ValueId>,
    pre: &str,
    act: crate::config::HiddenAct,
) -> Result<ValueId, ModelError> {
    let p = ParamsAt { all: params, pre };
    let mw = MlpWeights {
        gate: p.weight("gate_proj"),
        up: p.weight("up_proj"),
        down: p.weight("down_proj"),
        gate_bias: p.bias("gate_proj"),
        up_bias: p.bias("up_proj"),
        down_bias: None,
    };
    Ok(gated_mlp(b, x, mw, act.activation())?)
}

/// Appends `{name}.weight` `[out, in]` and, with `bias`, `{name}.bias` `[out]`.
pub(crate) fn projection(
    p: &mut Vec<(String, Vec<usize>)>,
    name: String,
    out: usize,
    inp: usize,
    bias: bool,
) {
    p.push((format!("{name}.weight"), vec![out, inp]));
    if bias {
        p.push((format!("{name}.bias"), vec![out]));
    }
}

/// [`stage_parameters`] with the self-attention block `attn` and the feed-forward block `ffn`,
/// split over tensor parallelism as `spec.tp` and the blocks say ([`crate::tensor_parallel`]).
pub(crate) fn decoder_parameters(
    cfg: &LlamaConfig,
    spec: &StageSpec,
    attn: &dyn SelfAttention,
    ffn: &dyn FeedForward,
    mtp: Option<Mtp>,
) -> Vec<(String, Vec<usize>)> {
    let (d, v) = (cfg.hidden_size, cfg.vocab_size);
    let mut p = Vec::new();
    if spec.is_first() {
        p.push((EMBED.to_string(), vec![v, d]));
    }
    let layer = |p: &mut Vec<(String, Vec<usize>)>, l: usize| {
        let pre = format!("model.layers.{l}");
        p.push((format!("{pre}.input_layernorm.weight"), vec![d]));
        attn.parameters(&format!("{pre}.self_attn"), p);
        p.push((format!("{pre}.post_attention_layernorm.weight"), vec![d]));
        ffn.parameters(l, spec.ep, p);
    };
    for l in spec.layers.clone() {
        layer(&mut p, l);
    }
    if spec.is_last() {
        p.push(("model.norm.weight".to_string(), vec![d]));
        if !cfg.tie_word_embeddings {
            p.push((LM_HEAD.to_string(), vec![v, d]));
        }
        // The last stage reads the embedding table for a tied head, or for the MTP module's
        // embedding of the next tokens (shared with the first stage's: one parameter by name).
        if !spec.is_first() && (cfg.tie_word_embeddings || mtp.is_some()) {
            p.push((EMBED.to_string(), vec![v, d]));
        }
        if let Some(m) = mtp {
            let pre = format!("model.layers.{}", m.layer);
            p.push((format!("{pre}.enorm.weight"), vec![d]));
            p.push((format!("{pre}.hnorm.weight"), vec![d]));
            p.push((format!("{pre}.eh_proj.weight"), vec![d, 2 * d]));
            layer(&mut p, m.layer);
            p.push((format!("{pre}.shared_head.norm.weight"), vec![d]));
        }
    }
    shard_shapes(p, spec.tp, |n| split_of(n, attn.splits_over_tp(), cfg.kv_heads(), spec.tp.size))
}

/// Names and shapes of the buffers of every stage ([`stage_buffers`] without their values):
/// `rope.cos`, `rope.sin` `[T, hd]` and `mask` `[T, T]`.
pub fn stage_buffer_shapes(cfg: &LlamaConfig, seq: usize) -> Vec<(String, Vec<usize>)> {
    let hd = cfg.head_dim();
    vec![
        ("rope.cos".into(), vec![seq, hd]),
        ("rope.sin".into(), vec![seq, hd]),
        ("mask".into(), vec![seq, seq]),
    ]
}

/// Buffers of every stage: `rope.cos`, `rope.sin` `[T, hd]` (HF rotate-half layout, θ =
/// `rope_theta`) and the additive causal `mask` `[T, T]` (0 at or below the diagonal, −1e9 above).
/// Values in f64 row-major (`8·(T² + 2·T·hd)` bytes: check [`crate::memory`] first for large `T`);
/// cast to the stage dtype by the caller.
pub fn stage_buffers(cfg: &LlamaConfig, seq: usize) -> Vec<(String, Vec<usize>, Vec<f64>)> {
    scaled_buffers(cfg, seq, None)
}

/// [`stage_buffers`] with the RoPE frequencies and tables of YaRN when `yarn` is given
/// ([`crate::mla::Yarn::inv_freq`], the tables times [`crate::mla::Yarn::attention_factor`]).
pub(crate) fn scaled_buffers(
    cfg: &LlamaConfig,
    seq: usize,
    yarn: Option<&crate::mla::Yarn>,
) -> Vec<(String, Vec<usize>, Vec<f64>)> {
    let hd = cfg.head_dim();
    let inv_freq: Vec<f64> = match yarn {
        Some(y) => y.inv_freq(hd, cfg.rope_theta),
        None => (0..hd / 2).map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f64 / hd as f64)).collect(),
    };
    let factor = yarn.map_or(1.0, |y| y.attention_factor());
    let (mut cos, mut sin) = (Vec::with_capacity(seq * hd), Vec::with_capacity(seq * hd));
    for t in 0..seq {
        for j in 0..hd {
            let a = t as f64 * inv_freq[j % (hd / 2)];
            cos.push(a.cos() * factor);
            sin.push(a.sin() * factor);
        }
    }
    let mask = (0..seq * seq).map(|k| if k % seq > k / seq { -1e9 } else { 0.0 }).collect();
    stage_buffer_shapes(cfg, seq)
        .into_iter()
        .zip([cos, sin, mask])
        .map(|((name, shape), values)| (name, shape, values))
        .collect()
}

/// `"{n} {one}"` or `"{n} {many}"`.
fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Checks the microbatch shape against the model: `B, T >= 1` and `T <= max_position_embeddings`.
/// Errors: [`ModelError::Shape`].
pub fn check_shape(cfg: &LlamaConfig, opts: &StageOptions) -> Result<(), ModelError> {
    if opts.batch == 0 || opts.seq == 0 {
        return Err(ModelError::Shape(format!(
            "a microbatch needs at least 1 sequence of at least 1 token (B={}, T={})",
            opts.batch, opts.seq
        )));
    }
    if opts.seq > cfg.max_position_embeddings {
        return Err(ModelError::Shape(format!(
            "sequence length T={} (--seq-len) exceeds the model's max_position_embeddings {}",
            opts.seq, cfg.max_position_embeddings
        )));
    }
    Ok(())
}

/// The forward graph of one stage. Inputs, in order: parameters ([`stage_parameters`], of
/// [`StageOptions::parameter_dtype`]), buffers ([`stage_buffers`], of `opts.dtype`), `tokens`
/// `[B,T]` u32 (first stage) or `input` `[B,T,D]` (`opts.dtype`), then `targets` `[B,T]` u32
/// (last stage, unless `opts.logits`). Output: `loss` (scalar, mean over the B·T tokens) on the
/// last stage — `logits` `[B·T, V]` with `opts.logits` — both in [`DType::wide`] of `opts.dtype`
/// (f32 for bf16), else `output` `[B,T,D]` in `opts.dtype`. Only shapes are built (no tensor
/// data), so any `T` costs the same. Errors: invalid config, a shape [`check_shape`] rejects, or
/// FSDP shard sizes.
pub fn build_stage(cfg: &LlamaConfig, spec: &StageSpec, opts: &StageOptions) -> Result<Graph, ModelError> {
    cfg.validate()?;
    build_decoder(cfg, spec, opts, &GroupedQueryAttention(cfg), &DenseMlp(cfg), None)
}

/// [`build_stage`] with the self-attention block `attn` and the feed-forward block `ffn` (the
/// config validated by the caller): the stage's inputs, the token embedding (first stage), its
/// decoder layers, then the final norm, the LM head and the loss (last stage) or the stage output.
pub(crate) fn build_decoder(
    cfg: &LlamaConfig,
    spec: &StageSpec,
    opts: &StageOptions,
    attn: &dyn SelfAttention,
    ffn: &dyn FeedForward,
    mtp: Option<Mtp>,
) -> Result<Graph, ModelError> {
    check_shape(cfg, opts)?;
    if mtp.is_some() && spec.tp.is_split() {
        return Err(ModelError::Split(
            "the multi-token-prediction module is not built under tensor parallelism".into(),
        ));
    }
    if mtp.is_some() && opts.seq < 2 {
        return Err(ModelError::Shape(format!(
            "the multi-token-prediction module predicts each token's second next token: it needs \
             sequences of at least 2 tokens (--seq-len {})",
            opts.seq
        )));
    }
    let mut b = GraphBuilder::new(&format!("stage{}.fw", spec.stage), opts.dtype);
    let ins = stage_inputs(&mut b, cfg, spec, opts, (attn, ffn, mtp))?;
    // FSDP all-gathers are emitted right after the inputs (their waits precede first use).
    b.push_scope("model");
    let mut x = if !spec.is_first() {
        ins.x
    } else if spec.tp.is_split() {
        // Vocabulary-parallel: every token looked up in this rank's rows, summed over the group
        // (reduce-scattered to this rank's tokens with sequence parallelism).
        let (table, vocab) = (ins.params[EMBED], cfg.vocab_size);
        b.scoped("embed_tokens", |b| spec.tp.vocab_embedding(b, table, ins.x, (vocab, opts.dtype)))?
    } else {
        embed_tokens(&mut b, ins.params[EMBED], ins.x, opts.dtype)?
    };
    for l in spec.layers.clone() {
        x = decoder_layer(&mut b, cfg, (attn, ffn), (spec.ep, spec.tp), &ins, l, x)?;
    }
    if spec.is_last() {
        b.push_scope("norm");
        let h = rms_norm(&mut b, x, ins.params["model.norm.weight"], cfg.rms_norm_eps)?;
        b.pop_scope();
        if let (Some(m), Some(targets)) = (mtp, ins.targets) {
            mtp_loss(&mut b, cfg, (attn, ffn, m), (spec, opts), &ins, (x, targets))?;
        }
        b.pop_scope();
        lm_head_and_loss(&mut b, cfg, (opts, spec.tp), &ins, h)?;
    } else {
        b.pop_scope();
        b.output(OUTPUT, x);
    }
    Ok(b.finish()?)
}

/// The inputs of a stage graph, as [`stage_inputs`] adds them.
struct StageInputs {
    /// Every parameter of the stage by its HF name: its value cast to the stage dtype (after the
    /// FSDP all-gather), the embedding table uncast (it is cast after its row gather).
    params: HashMap<String, ValueId>,
    /// The buffers `rope.cos`, `rope.sin` and `mask`, in that order ([`stage_buffer_shapes`]).
    bufs: Vec<ValueId>,
    /// `tokens` `[B, T]` u32 (first stage) or `input` `[B, T, D]`.
    x: ValueId,
    /// `targets` `[B, T]` u32 (last stage, unless `opts.logits`).
    targets: Option<ValueId>,
}

/// Adds the stage's inputs in [`build_stage`]'s order: parameters (each but the embedding table
/// cast to `opts.dtype`), buffers, `tokens` or `input`, then `targets`. Errors: FSDP shard sizes
/// ([`ModelError::Split`]) and graph errors.
fn stage_inputs(
    b: &mut GraphBuilder,
    cfg: &LlamaConfig,
    spec: &StageSpec,
    opts: &StageOptions,
    (attn, ffn, mtp): (&dyn SelfAttention, &dyn FeedForward, Option<Mtp>),
) -> Result<StageInputs, ModelError> {
    let (bsz, t, d) = (opts.batch, opts.seq, cfg.hidden_size);
    let mut params = HashMap::new();
    for (name, shape) in decoder_parameters(cfg, spec, attn, ffn, mtp) {
        let mut v = parameter(b, &name, shape, opts)?;
        // The embedding table is cast after its row gather (see `StageOptions`).
        if name != EMBED {
            b.set_scope(name.trim_end_matches(".weight"));
            v = b.cast(v, opts.dtype)?;
            b.set_scope("");
        }
        params.insert(name, v);
    }
    let mut bufs = Vec::new();
    for (name, shape) in stage_buffer_shapes(cfg, t) {
        bufs.push(b.input(&name, InputKind::Buffer, shape)?);
    }
    // With sequence parallelism a stage hands over its own tokens only.
    let x = if spec.is_first() {
        b.input_typed(TOKENS, InputKind::Activation, TensorType::new(DType::U32, vec![bsz, t]))?
    } else {
        b.input(INPUT, InputKind::Activation, vec![bsz, spec.tp.local_seq(t), d])?
    };
    let targets = if spec.is_last() && !opts.logits {
        Some(b.input_typed(TARGETS, InputKind::Target, TensorType::new(DType::U32, vec![bsz, t]))?)
    } else {
        None
    };
    Ok(StageInputs { params, bufs, x, targets })
}

/// The token embedding: rows of the f32 `table` `[V, D]` picked by `tokens` `[B, T]`, cast to
/// `dtype` → `[B, T, D]`, under scope `embed_tokens`.
fn embed_tokens(
    b: &mut GraphBuilder,
    table: ValueId,
    tokens: ValueId,
    dtype: DType,
) -> Result<ValueId, ModelError> {
    b.push_scope("embed_tokens");
    let e = embedding(b, table, tokens)?;
    let e = b.cast(e, dtype)?;
    b.pop_scope();
    Ok(e)
}

/// Decoder layer `l` on the residual stream `x` `[B, T, D]` under scope `layers.{l}` (pre-norm):
/// `x + self_attn(input_layernorm(x))`, then that plus `ffn(post_attention_layernorm(·))`, the
/// blocks `(attn, ffn)` on a stage holding the experts `ep` and tensor-parallel shard `tp`.
fn decoder_layer(
    b: &mut GraphBuilder,
    cfg: &LlamaConfig,
    (attn, ffn): (&dyn SelfAttention, &dyn FeedForward),
    (ep, tp): (ExpertShard, TensorShard),
    ins: &StageInputs,
    l: usize,
    x: ValueId,
) -> Result<ValueId, ModelError> {
    let pre = format!("model.layers.{l}");
    let attn_pre = format!("{pre}.self_attn");
    let (layer, attn_params) =
        (ParamsAt { all: &ins.params, pre: &pre }, ParamsAt { all: &ins.params, pre: &attn_pre });
    let norm = |b: &mut GraphBuilder, name: &str, x: ValueId| {
        b.scoped(name, |b| rms_norm(b, x, layer.weight(name), cfg.rms_norm_eps))
    };
    b.scoped(&format!("layers.{l}"), |b| {
        let h = norm(b, "input_layernorm", x)?;
        let a = b.scoped("self_attn", |b| attn.build(b, h, attn_params, &ins.bufs, tp))?;
        let x = b.add2(x, a)?;
        let h = norm(b, "post_attention_layernorm", x)?;
        let m = b.scoped("mlp", |b| ffn.build(b, l, (ep, tp), h, &ins.params))?;
        Ok(b.add2(x, m)?)
    })
}

/// DeepSeek-V3's multi-token-prediction module of depth 1 (§2.2), built on the last stage as
/// decoder layer `layer` and weighted by λ = `weight` in the objective.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mtp {
    /// Its layer number `L` (the decoder's layer count): its parameters are `model.layers.{L}.*`.
    pub layer: usize,
    /// λ.
    pub weight: f64,
}

/// The multi-token-prediction loss (DeepSeek-V3 §2.2, eqs. 21–25; parameter names as its
/// checkpoints' layer `L`), output as [`MTP_LOSS`] = λ · the mean cross-entropy, on the main
/// model's last hidden states `h` `[B, T, D]` (before the final norm) and the `targets`
/// `[B, T]`, token i's next token: `h'ᵢ = eh_proj [enorm(Emb(tᵢ₊₁)); hnorm(hᵢ)]` (the shared
/// embedding; vLLM's order of the two halves), one decoder layer `L` over all T positions (causal,
/// so position i sees no later one), `shared_head.norm`, the shared LM head, and the
/// cross-entropy of positions `0..T−1` against the targets shifted by one (token i + 2; the last
/// position has none in the window).
fn mtp_loss(
    b: &mut GraphBuilder,
    cfg: &LlamaConfig,
    (attn, ffn, m): (&dyn SelfAttention, &dyn FeedForward, Mtp),
    (spec, opts): (&StageSpec, &StageOptions),
    ins: &StageInputs,
    (h, targets): (ValueId, ValueId),
) -> Result<(), ModelError> {
    let pre = format!("model.layers.{}", m.layer);
    let p = |name: &str| ins.params[&format!("{pre}.{name}.weight")];
    let eps = cfg.rms_norm_eps;
    let next = embed_tokens(b, ins.params[EMBED], targets, opts.dtype)?;
    b.push_scope(&format!("layers.{}", m.layer));
    let next = b.scoped("enorm", |b| rms_norm(b, next, p("enorm"), eps))?;
    let hn = b.scoped("hnorm", |b| rms_norm(b, h, p("hnorm"), eps))?;
    let joined = b.concat(&[next, hn], 2)?;
    let x = b.scoped("eh_proj", |b| linear(b, joined, p("eh_proj")))?;
    b.pop_scope();
    let x = decoder_layer(b, cfg, (attn, ffn), (spec.ep, spec.tp), ins, m.layer, x)?;
    b.push_scope(&format!("layers.{}.shared_head", m.layer));
    let x = b.scoped("norm", |b| rms_norm(b, x, p("shared_head.norm"), eps))?;
    let t = b.shape(x)[1];
    let x = b.slice(x, 1, 0, t - 1)?;
    let logits = head_logits(b, cfg, opts, ins, x)?;
    let shifted = b.slice(targets, 1, 1, t)?;
    let shifted = b.reshape(shifted, vec![b.shape(logits)[0]])?;
    let ce = cross_entropy(b, logits, shifted)?;
    let loss = b.scale(ce, m.weight)?;
    b.pop_scope();
    b.output(MTP_LOSS, loss);
    Ok(())
}

/// The LM head on the normalised hidden states `h` `[B, T, D]` (the embedding table when tied):
/// `logits` `[B·T, V]` in [`DType::wide`] of `opts.dtype`, then the output `loss` (their
/// cross-entropy against the targets, scope `loss`) or, without targets, the output `logits`.
/// Under tensor parallelism the head is vocabulary-parallel: `h` is gathered (replicated, or
/// all-gathered along the sequence under sequence parallelism), this rank computes the logits of
/// its `V / tp` block for every token, and the loss is
/// [`TensorShard::vocab_parallel_cross_entropy`] — the `[B·T, V]` logits are never formed.
fn lm_head_and_loss(
    b: &mut GraphBuilder,
    cfg: &LlamaConfig,
    (opts, tp): (&StageOptions, TensorShard),
    ins: &StageInputs,
    h: ValueId,
) -> Result<(), ModelError> {
    b.push_scope("lm_head");
    // Vocabulary-parallel head: every token's logits of this rank's block of the vocabulary
    // (with sequence parallelism, of the gathered sequence).
    let h = if tp.is_split() { tp.enter(b, h)? } else { h };
    let rows = b.shape(h)[0] * b.shape(h)[1];
    let logits = head_logits(b, cfg, opts, ins, h)?;
    match ins.targets {
        Some(targets) => {
            b.pop_scope();
            b.push_scope("loss");
            let tg = b.reshape(targets, vec![rows])?;
            let loss = if tp.is_split() {
                tp.vocab_parallel_cross_entropy(b, logits, tg, cfg.vocab_size)?
            } else {
                cross_entropy(b, logits, tg)?
            };
            b.pop_scope();
            b.output(LOSS, loss);
        }
        None => {
            b.pop_scope();
            b.output(LOGITS, logits);
        }
    }
    Ok(())
}

/// The LM head's logits `[B·T, V]` (this rank's vocabulary block under tensor parallelism) in
/// [`DType::wide`] of `opts.dtype`, of the hidden states `h` `[B, T, D]`: the model's head, or
/// the embedding table when tied (the f32 table, cast like every other matrix).
fn head_logits(
    b: &mut GraphBuilder,
    cfg: &LlamaConfig,
    opts: &StageOptions,
    ins: &StageInputs,
    h: ValueId,
) -> Result<ValueId, ModelError> {
    let rows = b.shape(h)[0] * b.shape(h)[1];
    let head =
        if cfg.tie_word_embeddings { b.cast(ins.params[EMBED], opts.dtype)? } else { ins.params[LM_HEAD] };
    let logits = linear(b, h, head)?;
    let logits = b.reshape(logits, vec![rows, b.shape(head)[0]])?;
    Ok(b.cast(logits, opts.dtype.wide())?)
}

/// A parameter input; with FSDP the input is this rank's shard `[out/n, …]` and the returned value
/// is its all-gather.
fn parameter(
    b: &mut GraphBuilder,
    name: &str,
    shape: Vec<usize>,
    opts: &StageOptions,
) -> Result<ValueId, ModelError> {
    let ty = |shape: Vec<usize>| TensorType::new(opts.parameter_dtype(), shape);
    let Some(group) = &opts.fsdp else { return Ok(b.input_typed(name, InputKind::Parameter, ty(shape))?) };
    if !shape[0].is_multiple_of(group.size) {
        return Err(ModelError::Split(format!(
            "{name} dim 0 = {} not divisible by FSDP group size {}",
            shape[0], group.size
        )));
    }
    let mut shard = shape;
    shard[0] /= group.size;
    let v = b.input_typed(name, InputKind::Parameter, ty(shard))?;
    b.set_scope(name.trim_end_matches(".weight").trim_end_matches(".bias"));
    b.set_region(graphpp_graph::Region::Comm(format!("{}.unshard", group.mesh_axis)));
    let g = b.collective(CollectiveKind::AllGather, group, 0, v)?;
    b.set_region(graphpp_graph::Region::Compute);
    b.set_scope("");
    Ok(g)
}

/// Deterministic initial parameters (HF `LlamaPreTrainedModel._init_weights`: normal(0,
/// `initializer_range`) for matrices, 0 for biases, 1 for norm weights), seeded per parameter
/// name so any stage split gives the same weights (and a tied embedding's copies are equal).
/// Row-major f32.
pub fn init_parameters(
    cfg: &LlamaConfig,
    spec: &StageSpec,
    seed: u64,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let whole = StageSpec { tp: TensorShard::WHOLE, ..spec.clone() };
    let values = init_values(stage_parameters(cfg, &whole), cfg.initializer_range, seed);
    shard_values(values, spec.tp, |n| split_of(n, true, cfg.kv_heads(), spec.tp.size))
}

/// Initial values of `params` as [`init_parameters`] gives them: biases 0, 1-D weights 1,
/// matrices normal(0, `range`) seeded by `seed` and the parameter's name.
pub(crate) fn init_values(
    params: Vec<(String, Vec<usize>)>,
    range: f64,
    seed: u64,
) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    params
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let data = if name.ends_with(".bias") {
                vec![0.0; n]
            } else if shape.len() == 1 {
                vec![1.0; n]
            } else {
                let mut rng = crate::rng::Rng::new(seed ^ crate::rng::hash(&name));
                (0..n).map(|_| (rng.normal() * range) as f32).collect()
            };
            (name, shape, data)
        })
        .collect()
}

/// Checkpoint scopes of a stage for [`graphpp_graph::RecomputePolicy::Checkpoints`]: the residual
/// stream after the attention and after the MLP of every layer (scope `model.layers.<l>`).
pub fn layer_checkpoints(spec: &StageSpec) -> Vec<String> {
    spec.layers.clone().map(|l| format!("model.layers.{l}")).collect()
}

/// Everything `graphpp graph --model M --stages S --stage s [--layers-per-stage …]` needs: the
/// stage's forward graph built and all its derived graphs. Errors: bad config, split or pass.
pub fn stage_graph_set(
    cfg: &LlamaConfig,
    stages: usize,
    stage: usize,
    layers_per_stage: Option<&[usize]>,
    opts: &StageOptions,
    policy: &graphpp_graph::RecomputePolicy,
) -> Result<graphpp_graph::StageGraphs, ModelError> {
    let specs = split_layers(cfg.num_hidden_layers, stages, layers_per_stage)?;
    let spec = specs
        .get(stage)
        .ok_or_else(|| ModelError::Split(format!("stage {stage} out of range 0..{stages}")))?;
    let fw = build_stage(cfg, spec, opts)?;
    Ok(graphpp_graph::stage_graphs(&fw, policy)?)
}
