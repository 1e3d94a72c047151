//! Composite layers built from primitives (docs/ARCHITECTURE.md "Graph IR": composite layers are built by the
//! builder, so autodiff only needs primitive VJP rules). Formulas follow the Hugging Face Llama
//! implementation (RMSNorm, rotate-half RoPE, SwiGLU MLP, causal softmax attention).

use crate::builder::GraphBuilder;
use crate::error::{GraphError, Result};
use crate::graph::ValueId;

/// `y = x · Wᵀ` with `x: [..., in]`, `w: [out, in]` (PyTorch / HF layout) → `[..., out]`.
/// Lowered as reshape to 2-D, `matmul(x2d, permute(w))`, reshape back.
pub fn linear(b: &mut GraphBuilder, x: ValueId, w: ValueId) -> Result<ValueId> {
    let xs = b.shape(x);
    let ws = b.shape(w);
    let inner = *xs.last().unwrap_or(&0);
    if ws.len() != 2 || ws[1] != inner {
        return Err(GraphError::Shape {
            op: "linear".into(),
            at: b.graph().nodes.len().to_string(),
            reason: format!("weight {ws:?} does not match input {xs:?}"),
        });
    }
    let rows: usize = xs[..xs.len() - 1].iter().product();
    let x2 = b.reshape(x, vec![rows, inner])?;
    let wt = b.permute(w, vec![1, 0])?;
    let y = b.matmul(x2, wt)?;
    let mut out = xs.clone();
    *out.last_mut().expect("rank ≥ 1") = ws[0];
    b.reshape(y, out)
}

/// [`linear_bias`] under the scope `name` (the projection's HF name: `q_proj`, `down_proj`, …).
pub fn projection(
    b: &mut GraphBuilder,
    name: &str,
    x: ValueId,
    w: ValueId,
    bias: Option<ValueId>,
) -> Result<ValueId> {
    b.scoped(name, |b| linear_bias(b, x, w, bias))
}

/// [`linear`] plus an optional `bias: [out]` added to every row (`nn.Linear(bias=True)`).
pub fn linear_bias(b: &mut GraphBuilder, x: ValueId, w: ValueId, bias: Option<ValueId>) -> Result<ValueId> {
    let y = linear(b, x, w)?;
    match bias {
        Some(bias) => b.add2(y, bias),
        None => Ok(y),
    }
}

/// Token embedding: rows of `table: [V, D]` picked by u32 `ids` of any shape → `ids.shape + [D]`.
pub fn embedding(b: &mut GraphBuilder, table: ValueId, ids: ValueId) -> Result<ValueId> {
    let ishape = b.shape(ids);
    let n: usize = ishape.iter().product();
    let flat = b.reshape(ids, vec![n])?;
    let rows = b.index_select(table, flat, 0)?;
    let mut out = ishape;
    out.push(b.shape(table)[1]);
    b.reshape(rows, out)
}

/// RMSNorm over the last axis: `x / sqrt(mean(x²) + eps) * w` (Zhang & Sennrich 2019; HF Llama).
///
/// Mixed precision: the normalisation runs in [`DType::wide`](crate::DType::wide) of `x`'s
/// dtype — for bf16 `x` is cast to f32, normalised, and cast back before the multiplication by
/// `w`, as HF's `LlamaRMSNorm` does (`hidden_states.to(float32)` … `weight *
/// hidden_states.to(input_dtype)`). For f32 and f64 no cast node is added.
pub fn rms_norm(b: &mut GraphBuilder, x: ValueId, w: ValueId, eps: f64) -> Result<ValueId> {
    let dtype = b.ty(x).dtype;
    let last = b.shape(x).len() - 1;
    let xw = b.cast(x, dtype.wide())?;
    let sq = b.mul(xw, xw)?;
    let ms = b.mean(sq, last, true)?;
    let ms = b.affine(ms, 1.0, eps)?;
    let rms = b.sqrt(ms)?;
    let inv = b.recip(rms)?;
    let xn = b.mul(xw, inv)?;
    let xn = b.cast(xn, dtype)?;
    b.mul(xn, w)
}

/// SiLU `x · sigmoid(x)`.
pub fn silu(b: &mut GraphBuilder, x: ValueId) -> Result<ValueId> {
    let s = b.sigmoid(x)?;
    b.mul(x, s)
}

/// Exact GELU (Hendrycks & Gimpel 2016; PyTorch `gelu(approximate='none')`, HF `hidden_act:
/// gelu`): `x · ½ (1 + erf(x / √2))`.
pub fn gelu(b: &mut GraphBuilder, x: ValueId) -> Result<ValueId> {
    let s = b.scale(x, std::f64::consts::FRAC_1_SQRT_2)?;
    let e = b.erf(s)?;
    let phi = b.affine(e, 0.5, 0.5)?;
    b.mul(x, phi)
}

/// Tanh-approximated GELU (PyTorch `gelu(approximate='tanh')`, HF `gelu_pytorch_tanh`):
/// `½ x (1 + tanh(u))` with `u = √(2/π) (x + 0.044715 x³)`, computed through the identity
/// `½ (1 + tanh u) = σ(2u)` as `x · σ(2√(2/π) · x · (1 + 0.044715 x²))`.
pub fn gelu_tanh(b: &mut GraphBuilder, x: ValueId) -> Result<ValueId> {
    let xx = b.mul(x, x)?;
    let p = b.affine(xx, 0.044715, 1.0)?;
    let inner = b.mul(x, p)?;
    let z = b.scale(inner, 2.0 * (2.0 / std::f64::consts::PI).sqrt())?;
    let s = b.sigmoid(z)?;
    b.mul(x, s)
}

/// Activation of the gated MLP (Hugging Face `hidden_act`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// [`silu`] (`silu`, `swish`).
    Silu,
    /// Exact [`gelu`] (`gelu`).
    Gelu,
    /// [`gelu_tanh`] (`gelu_pytorch_tanh`, `gelu_new`).
    GeluTanh,
}

/// Applies `act` elementwise.
pub fn activation(b: &mut GraphBuilder, x: ValueId, act: Activation) -> Result<ValueId> {
    match act {
        Activation::Silu => silu(b, x),
        Activation::Gelu => gelu(b, x),
        Activation::GeluTanh => gelu_tanh(b, x),
    }
}

/// Weights of a gated MLP (HF layout `[out, in]`, biases `[out]` when the config has `mlp_bias`).
#[derive(Clone, Copy, Debug)]
pub struct MlpWeights {
    /// `gate_proj.weight: [F, D]`
    pub gate: ValueId,
    /// `up_proj.weight: [F, D]`
    pub up: ValueId,
    /// `down_proj.weight: [D, F]`
    pub down: ValueId,
    /// `gate_proj.bias: [F]`
    pub gate_bias: Option<ValueId>,
    /// `up_proj.bias: [F]`
    pub up_bias: Option<ValueId>,
    /// `down_proj.bias: [D]`
    pub down_bias: Option<ValueId>,
}

/// Gated MLP (Shazeer 2020; HF `LlamaMLP`): `down(act(gate(x)) * up(x))`, scopes `gate_proj`,
/// `up_proj`, `down_proj`.
pub fn gated_mlp(b: &mut GraphBuilder, x: ValueId, w: MlpWeights, act: Activation) -> Result<ValueId> {
    let g = projection(b, "gate_proj", x, w.gate, w.gate_bias)?;
    let u = projection(b, "up_proj", x, w.up, w.up_bias)?;
    let a = activation(b, g, act)?;
    let h = b.mul(a, u)?;
    projection(b, "down_proj", h, w.down, w.down_bias)
}

/// SwiGLU MLP (Shazeer 2020; HF Llama): [`gated_mlp`] with SiLU and no biases.
pub fn swiglu_mlp(
    b: &mut GraphBuilder,
    x: ValueId,
    gate: ValueId,
    up: ValueId,
    down: ValueId,
) -> Result<ValueId> {
    let w = MlpWeights { gate, up, down, gate_bias: None, up_bias: None, down_bias: None };
    gated_mlp(b, x, w, Activation::Silu)
}

/// Rotary position embedding, rotate-half form (Su et al. 2021; HF Llama `apply_rotary_pos_emb`):
/// `x·cos + rotate_half(x)·sin`, `x: [B, H, T, hd]`, `cos`, `sin: [T, hd]`.
pub fn rope(b: &mut GraphBuilder, x: ValueId, cos: ValueId, sin: ValueId) -> Result<ValueId> {
    let rot = b.rotate_half(x)?;
    let a = b.mul(x, cos)?;
    let c = b.mul(rot, sin)?;
    b.add2(a, c)
}

/// Weights of one attention block (HF layout `[out, in]`; the head width `hd` may differ from
/// `D / H`, HF `head_dim`). Biases `[out]` when the config has `attention_bias` (HF Llama then
/// puts one on all four projections).
#[derive(Clone, Copy, Debug)]
pub struct AttentionWeights {
    /// `q_proj.weight: [H·hd, D]`
    pub q: ValueId,
    /// `k_proj.weight: [KV·hd, D]`
    pub k: ValueId,
    /// `v_proj.weight: [KV·hd, D]`
    pub v: ValueId,
    /// `o_proj.weight: [D, H·hd]`
    pub o: ValueId,
    /// `q_proj.bias: [H·hd]`
    pub q_bias: Option<ValueId>,
    /// `k_proj.bias: [KV·hd]`
    pub k_bias: Option<ValueId>,
    /// `v_proj.bias: [KV·hd]`
    pub v_bias: Option<ValueId>,
    /// `o_proj.bias: [D]`
    pub o_bias: Option<ValueId>,
}

impl AttentionWeights {
    /// Projections without biases.
    pub fn new(q: ValueId, k: ValueId, v: ValueId, o: ValueId) -> Self {
        AttentionWeights { q, k, v, o, q_bias: None, k_bias: None, v_bias: None, o_bias: None }
    }
}

/// Static sizes of an attention block.
#[derive(Clone, Copy, Debug)]
pub struct AttentionDims {
    /// Query heads `H`.
    pub heads: usize,
    /// Key/value heads `KV` (divides `H`; grouped-query attention when smaller).
    pub kv_heads: usize,
}

fn heads_split(
    b: &mut GraphBuilder,
    y: ValueId,
    bsz: usize,
    t: usize,
    h: usize,
    hd: usize,
) -> Result<ValueId> {
    let y = b.reshape(y, vec![bsz, t, h, hd])?;
    b.permute(y, vec![0, 2, 1, 3])
}

/// Causal multi-head self-attention with RoPE (Vaswani et al. 2017; HF Llama):
/// `x: [B, T, D]`, `cos`, `sin: [T, hd]`, additive `mask: [T, T]` (0 on/below the diagonal, a large
/// negative number above). `hd` = rows of `q_proj` / `H`; scores scaled by `1/sqrt(hd)`; query
/// head `h` reads key/value head `h / (H/KV)` (HF `repeat_kv`), in the attention node itself
/// (grouped-query attention: the key/value heads are never repeated in memory).
/// Scopes `q_proj` … `o_proj`. The softmax runs in [`DType::wide`](crate::DType::wide) of the
/// scores' dtype (f32 for bf16; no cast otherwise).
pub fn causal_attention(
    b: &mut GraphBuilder,
    x: ValueId,
    w: AttentionWeights,
    dims: AttentionDims,
    cos: ValueId,
    sin: ValueId,
    mask: ValueId,
) -> Result<ValueId> {
    let s = b.shape(x);
    let (bsz, t) = (s[0], s[1]);
    let hd = b.shape(w.q)[0] / dims.heads;
    let proj = |b: &mut GraphBuilder, name: &str, wt: ValueId, bias: Option<ValueId>, h: usize| {
        b.scoped(name, |b| {
            let y = linear_bias(b, x, wt, bias)?;
            heads_split(b, y, bsz, t, h, hd)
        })
    };
    let q = proj(b, "q_proj", w.q, w.q_bias, dims.heads)?;
    let k = proj(b, "k_proj", w.k, w.k_bias, dims.kv_heads)?;
    let v = proj(b, "v_proj", w.v, w.v_bias, dims.kv_heads)?;
    let q = rope(b, q, cos, sin)?;
    let k = rope(b, k, cos, sin)?;
    let o = attend(b, q, k, v, mask, 1.0 / (hd as f64).sqrt())?;
    output_projection(b, o, w.o, w.o_bias)
}

/// Scores, mask, softmax (in the wide dtype: f32 for bf16, as HF's
/// `softmax(…, dtype=torch.float32)`) and the weighted sum of v in one [`crate::Op::Attention`]
/// node, whose backward saves no `[B, H, T, T]` probabilities; the mask is cast to that dtype.
fn attend(
    b: &mut GraphBuilder,
    q: ValueId,
    k: ValueId,
    v: ValueId,
    mask: ValueId,
    scale: f64,
) -> Result<ValueId> {
    let mask = b.cast(mask, b.ty(q).dtype.wide())?;
    b.attention(q, k, v, mask, scale)
}

/// The heads' outputs `o: [B, H, T, d]` joined to `[B, T, H·d]` and projected by `o_proj`.
fn output_projection(b: &mut GraphBuilder, o: ValueId, w: ValueId, bias: Option<ValueId>) -> Result<ValueId> {
    let s = b.shape(o);
    let o = b.permute(o, vec![0, 2, 1, 3])?;
    let o = b.reshape(o, vec![s[0], s[2], s[1] * s[3]])?;
    projection(b, "o_proj", o, w, bias)
}

/// The query projection of multi-head latent attention: full rank (`q_proj`, HF `q_lora_rank`
/// null: DeepSeek-V2-Lite) or low rank (`q_a_proj`, an RMSNorm `q_a_layernorm`, `q_b_proj`:
/// DeepSeek-V2 §2.1.2, eqs. 12–13).
#[derive(Clone, Copy, Debug)]
pub enum LatentQuery {
    /// `q_proj.weight: [H·(d_nope + d_rope), D]`.
    Full {
        /// The projection.
        q: ValueId,
    },
    /// `q_a_proj.weight: [r_q, D]` (bias `[r_q]` with `attention_bias`), `q_a_layernorm.weight:
    /// [r_q]`, `q_b_proj.weight: [H·(d_nope + d_rope), r_q]`.
    LowRank {
        /// Down-projection to the query latent.
        a: ValueId,
        /// Its bias.
        a_bias: Option<ValueId>,
        /// RMSNorm weight on the latent.
        norm: ValueId,
        /// Up-projection to the heads.
        b: ValueId,
    },
}

/// Weights of one multi-head latent attention block (HF `DeepseekV3Attention` names and layout
/// `[out, in]`; `r_kv` = `kv_lora_rank`).
#[derive(Clone, Copy, Debug)]
pub struct LatentAttentionWeights {
    /// The query projection.
    pub query: LatentQuery,
    /// `kv_a_proj_with_mqa.weight: [r_kv + d_rope, D]`: the key/value latent and the one RoPE key
    /// shared by all heads.
    pub kv_a: ValueId,
    /// Its bias `[r_kv + d_rope]` (`attention_bias`).
    pub kv_a_bias: Option<ValueId>,
    /// `kv_a_layernorm.weight: [r_kv]`.
    pub kv_norm: ValueId,
    /// `kv_b_proj.weight: [H·(d_nope + d_v), r_kv]`: per head its key (no RoPE) and value.
    pub kv_b: ValueId,
    /// `o_proj.weight: [D, H·d_v]`.
    pub o: ValueId,
    /// `o_proj.bias: [D]` (`attention_bias`).
    pub o_bias: Option<ValueId>,
}

/// Static sizes and constants of multi-head latent attention.
#[derive(Clone, Copy, Debug)]
pub struct LatentAttentionDims {
    /// Heads `H` (keys and values have as many: MLA is multi-head after the up-projection).
    pub heads: usize,
    /// Key/value latent width `r_kv` (`kv_lora_rank`).
    pub kv_lora_rank: usize,
    /// Per-head query/key width without RoPE `d_nope` (`qk_nope_head_dim`).
    pub nope: usize,
    /// Per-head query/key width with RoPE `d_rope` (`qk_rope_head_dim`, even).
    pub rope: usize,
    /// Per-head value width `d_v` (`v_head_dim`).
    pub v: usize,
    /// Epsilon of the two latent RMSNorms (HF builds them with its default 1e-6).
    pub norm_eps: f64,
    /// RoPE dims stored as interleaved pairs `(x0, x1), (x2, x3), …` (HF `rope_interleave`, the
    /// DeepSeek checkpoints' layout) rather than as two halves.
    pub interleave: bool,
    /// Softmax scale: `1/√(d_nope + d_rope)`, times YaRN's `mscale²` where the config says so.
    pub scale: f64,
}

/// Multi-head latent attention (DeepSeek-V2 report §2.1, eqs. 9–19; DeepSeek-V3 report
/// §2.1.1; HF `DeepseekV3Attention`): on `x: [B, T, D]`, queries `[B, H, T, d_nope + d_rope]`
/// from [`LatentQuery`]; the key/value latent `c = RMSNorm(x W_kv_a)[.., :r_kv]` up-projected
/// per head to a key part `[B, H, T, d_nope]` and a value `[B, H, T, d_v]`; one RoPE key
/// `[B, 1, T, d_rope]` from the last `d_rope` outputs of `kv_a_proj_with_mqa`, rotated and
/// shared by every head. Each head attends causally with `q = [q_nope, rope(q_rope)]`, `k =
/// [k_nope, rope(k_rope)]` at `scale`, and `o_proj` maps the heads' `H·d_v` values back to `D`.
/// `cos`, `sin: [T, d_rope]` (rotate-half layout), `mask: [T, T]` as for
/// [`causal_attention`]. With `interleave` the RoPE dims are first gathered evens-then-odds
/// (a permutation that the scores do not see, applied alike to q and k).
///
/// The attention node takes the value width `d_v` apart from q·k's `d_nope + d_rope`, so
/// nothing is padded (Megatron-LM pads the narrower side with zeros for kernels without distinct
/// value widths). Scopes `q_proj` (or `q_a_proj`, `q_a_layernorm`, `q_b_proj`),
/// `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`.
pub fn latent_attention(
    b: &mut GraphBuilder,
    x: ValueId,
    w: &LatentAttentionWeights,
    dims: LatentAttentionDims,
    cos: ValueId,
    sin: ValueId,
    mask: ValueId,
) -> Result<ValueId> {
    let s = b.shape(x);
    let (bsz, t, h) = (s[0], s[1], dims.heads);
    let (nope, r, dv) = (dims.nope, dims.rope, dims.v);
    let qk = nope + r;
    let q = latent_query(b, x, &w.query, dims.norm_eps)?;
    let q = heads_split(b, q, bsz, t, h, qk)?;
    let q_nope = b.slice(q, 3, 0, nope)?;
    let q_rope = b.slice(q, 3, nope, qk)?;
    let ckv = projection(b, "kv_a_proj_with_mqa", x, w.kv_a, w.kv_a_bias)?;
    let c = b.slice(ckv, 2, 0, dims.kv_lora_rank)?;
    let k_rope = b.slice(ckv, 2, dims.kv_lora_rank, dims.kv_lora_rank + r)?;
    let c = b.scoped("kv_a_layernorm", |b| rms_norm(b, c, w.kv_norm, dims.norm_eps))?;
    let kv = projection(b, "kv_b_proj", c, w.kv_b, None)?;
    let kv = heads_split(b, kv, bsz, t, h, nope + dv)?;
    let k_nope = b.slice(kv, 3, 0, nope)?;
    let v = b.slice(kv, 3, nope, nope + dv)?;
    let k_rope = b.reshape(k_rope, vec![bsz, 1, t, r])?;
    let q_rope = latent_rope(b, q_rope, cos, sin, dims.interleave)?;
    let k_rope = latent_rope(b, k_rope, cos, sin, dims.interleave)?;
    let k_rope = b.broadcast(k_rope, vec![bsz, h, t, r])?;
    let q = b.concat(&[q_nope, q_rope], 3)?;
    let k = b.concat(&[k_nope, k_rope], 3)?;
    let o = attend(b, q, k, v, mask, dims.scale)?;
    output_projection(b, o, w.o, w.o_bias)
}

/// The queries of [`latent_attention`], `[B, T, H·(d_nope + d_rope)]`.
fn latent_query(b: &mut GraphBuilder, x: ValueId, q: &LatentQuery, eps: f64) -> Result<ValueId> {
    match *q {
        LatentQuery::Full { q } => projection(b, "q_proj", x, q, None),
        LatentQuery::LowRank { a, a_bias, norm, b: up } => {
            let l = projection(b, "q_a_proj", x, a, a_bias)?;
            let l = b.scoped("q_a_layernorm", |b| rms_norm(b, l, norm, eps))?;
            projection(b, "q_b_proj", l, up, None)
        }
    }
}

/// RoPE on `x: [B, heads, T, d]`; with `interleave` its pairs `(x0, x1), (x2, x3), …` are first
/// laid out as evens then odds (HF `apply_rotary_pos_emb_interleave`), then rotated by halves.
fn latent_rope(
    b: &mut GraphBuilder,
    x: ValueId,
    cos: ValueId,
    sin: ValueId,
    interleave: bool,
) -> Result<ValueId> {
    let x = if interleave {
        let s = b.shape(x);
        let d = s[3];
        let pairs = b.reshape(x, vec![s[0], s[1], s[2], d / 2, 2])?;
        let split = b.permute(pairs, vec![0, 1, 2, 4, 3])?;
        b.reshape(split, s)?
    } else {
        x
    };
    rope(b, x, cos, sin)
}

/// Cross-entropy, mean over tokens: `logits: [N, V]`, u32 `targets: [N]` → scalar
/// `mean(logsumexp(logits) − logits[target])` (as `−mean(log_softmax(logits)[target])`, one
/// [`crate::Op::LogSoftmax`] node), computed in [`DType::wide`](crate::DType::wide)
/// of the logits' dtype: bf16 logits are cast to f32 first (HF's `logits.float()` before the
/// loss), so the loss and its log-softmax are f32; f32 and f64 logits get no cast.
pub fn cross_entropy(b: &mut GraphBuilder, logits: ValueId, targets: ValueId) -> Result<ValueId> {
    let wide = b.ty(logits).dtype.wide();
    let logits = b.cast(logits, wide)?;
    let n = b.shape(logits)[0];
    let y = b.log_softmax(logits, 1)?;
    let t = b.reshape(targets, vec![n, 1])?;
    let picked = b.gather(y, t, 1)?;
    let picked = b.reshape(picked, vec![n])?;
    let total = b.sum(picked, 0, false)?;
    b.scale(total, -1.0 / n as f64)
}
