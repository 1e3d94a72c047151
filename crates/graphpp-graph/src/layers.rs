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
    b.push_scope("gate_proj");
    let g = linear_bias(b, x, w.gate, w.gate_bias)?;
    b.pop_scope();
    b.push_scope("up_proj");
    let u = linear_bias(b, x, w.up, w.up_bias)?;
    b.pop_scope();
    let a = activation(b, g, act)?;
    let h = b.mul(a, u)?;
    b.push_scope("down_proj");
    let y = linear_bias(b, h, w.down, w.down_bias)?;
    b.pop_scope();
    Ok(y)
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
    let proj =
        |b: &mut GraphBuilder, name: &str, wt: ValueId, bias: Option<ValueId>, h: usize| -> Result<ValueId> {
            b.push_scope(name);
            let y = linear_bias(b, x, wt, bias)?;
            let y = heads_split(b, y, bsz, t, h, hd)?;
            b.pop_scope();
            Ok(y)
        };
    let q = proj(b, "q_proj", w.q, w.q_bias, dims.heads)?;
    let k = proj(b, "k_proj", w.k, w.k_bias, dims.kv_heads)?;
    let v = proj(b, "v_proj", w.v, w.v_bias, dims.kv_heads)?;
    let q = rope(b, q, cos, sin)?;
    let k = rope(b, k, cos, sin)?;
    // Scores, mask, softmax (in the wide dtype: f32 for bf16, as HF's
    // `softmax(…, dtype=torch.float32)`) and the weighted sum of v in one node, whose backward
    // saves no [B, H, T, T] probabilities.
    let mask = b.cast(mask, b.ty(q).dtype.wide())?;
    let o = b.attention(q, k, v, mask, 1.0 / (hd as f64).sqrt())?;
    let o = b.permute(o, vec![0, 2, 1, 3])?;
    let o = b.reshape(o, vec![bsz, t, dims.heads * hd])?;
    b.push_scope("o_proj");
    let y = linear_bias(b, o, w.o, w.o_bias)?;
    b.pop_scope();
    Ok(y)
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
