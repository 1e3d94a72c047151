//! The primitive op set (docs/ARCHITECTURE.md "Graph IR": elementwise with broadcasting, reductions, batched
//! matmul, layout ops, gather/scatter, top-k, collectives as start/wait pairs). Composite layers are
//! built from these by [`crate::builder`].

use crate::dtype::{DType, TensorType};
use serde::{Deserialize, Serialize};

/// Role of a graph input (docs/ARCHITECTURE.md "Graph IR").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InputKind {
    /// A trainable weight held by the stage.
    Parameter,
    /// A non-trainable constant held by the stage (RoPE tables, causal mask).
    Buffer,
    /// The stage input activation (or token ids on the first stage).
    Activation,
    /// Targets of the loss (last stage).
    Target,
    /// A forward value saved for the backward, or a dI value stashed for dW.
    Saved,
    /// Gradient of a stage output, received from the next stage.
    Tangent,
}

impl InputKind {
    /// Lower-case name used in the text form.
    pub fn name(self) -> &'static str {
        match self {
            InputKind::Parameter => "parameter",
            InputKind::Buffer => "buffer",
            InputKind::Activation => "activation",
            InputKind::Target => "target",
            InputKind::Saved => "saved",
            InputKind::Tangent => "tangent",
        }
    }
}

/// Elementwise unary ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UnaryOp {
    /// `-x`
    Neg,
    /// `e^x`
    Exp,
    /// natural log
    Log,
    /// square root
    Sqrt,
    /// `1/x`
    Recip,
    /// `1/(1+e^-x)`
    Sigmoid,
    /// Gauss error function `erf x = 2/√π ∫₀ˣ e^(−t²) dt` (for the exact GELU of Hugging Face's
    /// `hidden_act: gelu`, which no composition of the other ops gives exactly).
    Erf,
}

/// Elementwise binary ops with NumPy broadcasting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BinaryOp {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b`
    Div,
    /// `1.0` where `a == b`, else `0.0` (same float dtype; no gradient).
    Eq,
}

/// Collective kinds; each is issued as a `CollectiveStart` and completed by a `CollectiveWait`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveKind {
    /// Concatenate the group's shards along `axis` (output axis = input axis × group size).
    AllGather,
    /// Sum over the group, then keep this rank's shard along `axis` (axis ÷ group size).
    ReduceScatter,
    /// Sum over the group (shape unchanged).
    AllReduce,
    /// No data moves: every member already holds the value (shape unchanged). It marks where a
    /// value replicated over a group that shares one loss ([`MeshAxis::shares_loss`]) is read by
    /// computations split over it, so that autodiff all-reduces the members' partial gradients
    /// there: Megatron-LM's `copy_to_tensor_model_parallel_region` (the operator f of Shoeybi
    /// et al. 2019, §3), before each column-parallel projection.
    Replicate,
    /// Split `axis` into group-size chunks, send chunk `i` to rank `i`, concatenate received chunks.
    AllToAll,
    /// All-to-all with data-dependent counts along axis 0 (expert parallelism's dispatch and
    /// combine): operands `(x [R, …], send_counts [G] u32, recv_counts [G] u32)`. The first
    /// `send_counts[0]` rows of `x` go to member 0, the next `send_counts[1]` to member 1, …
    /// (the rows after their sum are not sent); the result `[rows, …]` holds what every member
    /// sent this one, in group order (`recv_counts[j]` rows from member `j`, which must be what
    /// member `j` sends), then zeros up to the static `rows`. Its VJP is the reverse exchange:
    /// the same kind with the counts swapped and `rows = R`.
    AllToAllV {
        /// Static row count of the result (an upper bound on the rows received).
        rows: usize,
    },
}

impl CollectiveKind {
    /// Name used in the text form.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::Replicate => "replicate",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::AllToAllV { .. } => "all_to_all_v",
        }
    }
}

/// An axis of the device mesh: which of a rank's process groups a collective runs over. The
/// runtime's mesh (`graphpp_comm::Mesh`) resolves it to world ranks; its short name (`pp`, `dp`,
/// …) is what graphs print and parse, as PyTorch's device-mesh dimensions are named.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum MeshAxis {
    /// The pipeline ranks of one replica (`pp`).
    Pipeline,
    /// The data-parallel replicas of one pipeline rank (`dp`).
    DataParallel,
    /// The ranks that shard a stage's parameters under FSDP (`fsdp`): the data-parallel
    /// replicas of one pipeline rank, the same ranks as `dp`.
    Fsdp,
    /// The replicas that share a MoE layer's routed experts and exchange tokens (`ep`).
    Expert,
    /// The holders of one routed expert, over which its gradient is reduced (`edp`).
    ExpertDataParallel,
    /// The ranks that split one stage's matrices under tensor parallelism (`tp`): they read the
    /// same microbatch and compute one loss (see [`MeshAxis::shares_loss`]).
    Tensor,
    /// Every rank (`world`).
    World,
}

impl MeshAxis {
    /// Every axis, in declaration order.
    pub const ALL: [MeshAxis; 7] = [
        MeshAxis::Pipeline,
        MeshAxis::DataParallel,
        MeshAxis::Fsdp,
        MeshAxis::Expert,
        MeshAxis::ExpertDataParallel,
        MeshAxis::Tensor,
        MeshAxis::World,
    ];

    /// Whether the members of this axis's groups compute one loss from the same samples (only
    /// `tp`). It decides how an all-reduce is differentiated (Shoeybi et al., "Megatron-LM",
    /// 2019, §3, the conjugate operators f and g): where every member computes its own loss
    /// (data parallelism), the gradient of a sum over the group is the sum of the members'
    /// gradients — an all-reduce is its own adjoint; where the members compute one loss, a value
    /// after an all-reduce is replicated, its gradient is already whole on every member, and the
    /// adjoint is the identity ([`CollectiveKind::Replicate`]), whose own adjoint sums the
    /// members' partial gradients.
    pub fn shares_loss(self) -> bool {
        self == MeshAxis::Tensor
    }

    /// The axis's short name, also the name of its groups: `pp`, `dp`, `fsdp`, `ep`, `edp`,
    /// `tp`, `world`.
    pub fn name(self) -> &'static str {
        match self {
            MeshAxis::Pipeline => "pp",
            MeshAxis::DataParallel => "dp",
            MeshAxis::Fsdp => "fsdp",
            MeshAxis::Expert => "ep",
            MeshAxis::ExpertDataParallel => "edp",
            MeshAxis::Tensor => "tp",
            MeshAxis::World => "world",
        }
    }
}

impl std::fmt::Display for MeshAxis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is no [`MeshAxis`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown mesh axis `{0}` (expected one of pp, dp, fsdp, ep, edp, world)")]
pub struct UnknownMeshAxis(pub String);

impl std::str::FromStr for MeshAxis {
    type Err = UnknownMeshAxis;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        MeshAxis::ALL.into_iter().find(|a| a.name() == s).ok_or_else(|| UnknownMeshAxis(s.to_string()))
    }
}

impl TryFrom<String> for MeshAxis {
    type Error = UnknownMeshAxis;

    fn try_from(s: String) -> std::result::Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<MeshAxis> for String {
    fn from(a: MeshAxis) -> String {
        a.name().to_string()
    }
}

/// A process group a collective runs over: the group of the running rank along a mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CommGroup {
    /// The mesh axis whose group it is.
    pub mesh_axis: MeshAxis,
    /// Number of ranks in the group (≥ 1).
    pub size: usize,
}

impl CommGroup {
    /// The group along `mesh_axis` of `size` ranks.
    pub fn new(mesh_axis: MeshAxis, size: usize) -> Self {
        CommGroup { mesh_axis, size }
    }
}

impl std::fmt::Display for CommGroup {
    /// `<axis> (size <n>)`, e.g. `fsdp (size 2)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (size {})", self.mesh_axis, self.size)
    }
}

/// One primitive operation. Every node produces exactly one value (SSA).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// A graph input; `name` is unique within the graph.
    Input { name: String, kind: InputKind, ty: TensorType },
    /// A constant filled with `value`.
    Full { value: f64, ty: TensorType },
    /// Elementwise unary op.
    Unary { f: UnaryOp },
    /// `x * mul + add` with scalar `mul`, `add`.
    Affine { mul: f64, add: f64 },
    /// Elementwise binary op with broadcasting.
    Binary { f: BinaryOp },
    /// Sum over one axis (float, or u32 counts, which carry no gradient).
    Sum { axis: usize, keepdim: bool },
    /// Maximum over one axis.
    Max { axis: usize, keepdim: bool },
    /// Softmax over one axis of `z = scale · x + mask`, max-subtracted for stability:
    /// `exp(z − m) / Σ exp(z − m)` with `m` the maximum of `z` over `axis` (float; the shape is
    /// kept). Operands `[x]` or `[x, mask]`, the mask (attention's additive causal mask) of x's
    /// dtype and broadcasting to x's shape. One node instead of the seven of its composition
    /// (scale, add, max, subtract, exp, sum, divide), so the backward saves only its output
    /// ([`Op::SoftmaxBackward`]) and a runtime may compute it row by row.
    Softmax { axis: usize, scale: f64 },
    /// `(y, g)` → `scale · y ⊙ (g − Σ_axis g ⊙ y)`: the VJP of [`Op::Softmax`] with output `y`
    /// and output gradient `g` (same shape and dtype; PyTorch's `_softmax_backward_data`). Has
    /// no VJP of its own (second derivatives of softmax are refused by autodiff).
    SoftmaxBackward { axis: usize, scale: f64 },
    /// Log-softmax over one axis: `x − m − ln Σ exp(x − m)` with `m` the maximum over `axis`
    /// (float; the shape is kept): the cross-entropy's, one node instead of six, whose backward
    /// ([`Op::LogSoftmaxBackward`]) reads only its output.
    LogSoftmax { axis: usize },
    /// `(y, g)` → `g − exp(y) ⊙ Σ_axis g`: the VJP of [`Op::LogSoftmax`] with output `y` and
    /// output gradient `g` (same shape and dtype). Has no VJP of its own.
    LogSoftmaxBackward { axis: usize },
    /// Scaled dot-product self-attention in one node (Vaswani et al. 2017, eq. 1):
    /// `(q [B, H, T, E], k [B, KV, T, E], v [B, KV, T, E_v], mask [T, T])` → `o = softmax(scale ·
    /// q kᵀ + mask) v` `[B, H, T, E_v]` (the value width may differ from q·k's, as in multi-head
    /// latent attention), query head `h` reading key/value head `h / (H / KV)` (grouped-query
    /// attention, Ainslie et al. 2023; KV = H is multi-head attention), the softmax over the
    /// key axis with an additive mask (0 where a query sees a key, −1e9 where it does not: the
    /// causal mask), the products in the operands' dtype and
    /// the softmax in its [`DType::wide`] (as the composition matmul, cast, [`Op::Softmax`],
    /// cast, matmul; the mask is of the wide dtype). One node so that the `[B, H, T, T]`
    /// probabilities are never saved for the backward, which reads only q, k, v, the mask and
    /// o ([`Op::AttentionBackward`]) and a runtime may run it blocked, never holding more than a
    /// tile of the scores (FlashAttention-2: Dao 2023, Algorithm 1; the online softmax of
    /// Milakov & Gimelshein 2018). The mask takes no gradient (autodiff refuses one that would
    /// need it).
    Attention { scale: f64 },
    /// `(q, k, v, mask, o, g)` → `[B, H + 2·KV, T, max(E, E_v)]`: the gradients of q, k and v
    /// (in that order along the heads: H, KV, KV; the narrower ones zero-padded to the width) of
    /// the [`Op::Attention`] with those operands, output `o` and output gradient `g` (a
    /// key/value head's gradient sums its query heads'): with
    /// `P = softmax(scale · q kᵀ + mask)`, `dv = Pᵀ g`, `dS = scale · P ⊙ (g vᵀ − rowsum(g ⊙ o))`, `dq = dS k`, `dk = dSᵀ q` (Dao 2023,
    /// Algorithm 2, with `D = rowsum(g ⊙ o)`). Has no VJP of its own.
    AttentionBackward { scale: f64 },
    /// RoPE's rotate-half along the last axis (of even length `2h`; Hugging Face Llama's
    /// `rotate_half`): `y[…, i] = −x[…, i + h]` for `i < h`, `x[…, i − h]` for `i ≥ h`. One
    /// node instead of two slices, a negation and a concatenation; its VJP is `−rotate_half(g)`.
    RotateHalf,
    /// Batched matmul `[..., m, k] × [..., k, n] → [..., m, n]`, equal batch dims.
    Matmul,
    /// Same elements, new shape (equal element count).
    Reshape { shape: Vec<usize> },
    /// Axis permutation: output axis `i` is input axis `perm[i]`.
    Permute { perm: Vec<usize> },
    /// Broadcast (expand) to `shape` by NumPy rules.
    Broadcast { shape: Vec<usize> },
    /// `x[start..end]` along `axis`.
    Slice { axis: usize, start: usize, end: usize },
    /// Concatenate all inputs along `axis`.
    Concat { axis: usize },
    /// `(src, ids[n])`: rows of `src` along `axis` picked by the 1-D u32 `ids`.
    IndexSelect { axis: usize },
    /// `(dst, ids[n], src)`: `dst` with `src` slices added at positions `ids` along `axis`.
    IndexAdd { axis: usize },
    /// `(src, idx)`: `out[..i..] = src[..idx[..i..]..]` along `axis`; `idx` u32, same rank as `src`.
    Gather { axis: usize },
    /// `(dst, idx, src)`: `dst` with `src` added at `idx` along `axis` (inverse of gather).
    ScatterAdd { axis: usize },
    /// u32 indices of the `k` largest entries along the last axis, largest first (no gradient).
    TopK { k: usize },
    /// `ids[R]` u32 (each `< experts`) → u32 `[R]`: the stable counting-sort permutation that
    /// orders the rows by expert (`out[j]` = the row that goes to sorted position `j`); no
    /// gradient. With [`Op::Bincount`] it lays the routed rows of a mixture-of-experts layer out
    /// as one contiguous segment per expert.
    SortByExpert { experts: usize },
    /// `ids[R]` u32 → u32 `[bins]`: how many ids equal each bin (no gradient). An id `>= bins`
    /// is an execution error.
    Bincount { bins: usize },
    /// `(x[R, K], w, counts[E])` → `[R, N]`: rows `0..counts[0]` use expert 0's matrix, the next
    /// `counts[1]` rows expert 1's, …: `y_r = x_r · w[e]ᵀ` with `w[E, N, K]` when `transpose`
    /// (the Hugging Face `[out, in]` layout), else `y_r = x_r · w[e]` with `w[E, K, N]`. Counts
    /// `[G, E]` are G runs of E segments in row-major order, segment `(g, e)` using expert e
    /// (the rows expert parallelism receives from G ranks). The counts add up to at most R (an
    /// execution error otherwise); the rows after them (padding) give zeros.
    SegmentMatmul { transpose: bool },
    /// `(a[R, N], b[R, K], counts[E] or [G, E])` → `[E, N, K]`: `out[e] = Σ a_sᵀ · b_s` over
    /// expert e's segments `s` of rows, laid out as for [`Op::SegmentMatmul`] (its weight
    /// gradient); padding rows are ignored.
    SegmentOuter,
    /// Element type conversion.
    Cast { dtype: DType },
    /// Issue a collective over `group` along `axis` on its operand (an
    /// [`CollectiveKind::AllToAllV`] also reads its send and receive counts); its value is only
    /// readable through a wait.
    CollectiveStart { kind: CollectiveKind, group: CommGroup, axis: usize },
    /// Complete the collective started by its single input; yields the collective's result.
    CollectiveWait,
}

impl Op {
    /// Short mnemonic used in the text and DOT forms (`matmul`, `add`, `all_gather_start`, …).
    pub fn mnemonic(&self) -> String {
        match self {
            Op::Input { kind, .. } => format!("input.{}", kind.name()),
            Op::Full { .. } => "full".into(),
            Op::Unary { f } => format!("{f:?}").to_lowercase(),
            Op::Affine { .. } => "affine".into(),
            Op::Binary { f } => format!("{f:?}").to_lowercase(),
            Op::Sum { .. } => "sum".into(),
            Op::Max { .. } => "max".into(),
            Op::Softmax { .. } => "softmax".into(),
            Op::SoftmaxBackward { .. } => "softmax_backward".into(),
            Op::RotateHalf => "rotate_half".into(),
            Op::LogSoftmax { .. } => "log_softmax".into(),
            Op::LogSoftmaxBackward { .. } => "log_softmax_backward".into(),
            Op::Attention { .. } => "attention".into(),
            Op::AttentionBackward { .. } => "attention_backward".into(),
            Op::Matmul => "matmul".into(),
            Op::Reshape { .. } => "reshape".into(),
            Op::Permute { .. } => "permute".into(),
            Op::Broadcast { .. } => "broadcast".into(),
            Op::Slice { .. } => "slice".into(),
            Op::Concat { .. } => "concat".into(),
            Op::IndexSelect { .. } => "index_select".into(),
            Op::IndexAdd { .. } => "index_add".into(),
            Op::Gather { .. } => "gather".into(),
            Op::ScatterAdd { .. } => "scatter_add".into(),
            Op::TopK { .. } => "topk".into(),
            Op::SortByExpert { .. } => "sort_by_expert".into(),
            Op::Bincount { .. } => "bincount".into(),
            Op::SegmentMatmul { .. } => "segment_matmul".into(),
            Op::SegmentOuter => "segment_outer".into(),
            Op::Cast { .. } => "cast".into(),
            Op::CollectiveStart { kind, .. } => format!("{}_start", kind.name()),
            Op::CollectiveWait => "wait".into(),
        }
    }

    /// Attributes as `key=value` strings for the text form.
    pub fn attrs(&self) -> Vec<String> {
        let dims =
            |v: &[usize]| format!("[{}]", v.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(","));
        match self {
            Op::Input { name, .. } => vec![format!("{name:?}")],
            Op::Full { value, .. } => vec![format!("value={value}")],
            Op::Affine { mul, add } => vec![format!("mul={mul}"), format!("add={add}")],
            Op::Sum { axis, keepdim } | Op::Max { axis, keepdim } => {
                vec![format!("axis={axis}"), format!("keepdim={keepdim}")]
            }
            Op::Reshape { shape } | Op::Broadcast { shape } => vec![format!("shape={}", dims(shape))],
            Op::Permute { perm } => vec![format!("perm={}", dims(perm))],
            Op::Slice { axis, start, end } => vec![format!("axis={axis}"), format!("range={start}..{end}")],
            Op::Concat { axis }
            | Op::LogSoftmax { axis }
            | Op::LogSoftmaxBackward { axis }
            | Op::IndexSelect { axis }
            | Op::IndexAdd { axis }
            | Op::Gather { axis }
            | Op::ScatterAdd { axis } => vec![format!("axis={axis}")],
            Op::TopK { k } => vec![format!("k={k}")],
            Op::Softmax { axis, scale } | Op::SoftmaxBackward { axis, scale } => {
                vec![format!("axis={axis}"), format!("scale={scale}")]
            }
            Op::Attention { scale } | Op::AttentionBackward { scale } => vec![format!("scale={scale}")],
            Op::SortByExpert { experts } => vec![format!("experts={experts}")],
            Op::Bincount { bins } => vec![format!("bins={bins}")],
            Op::SegmentMatmul { transpose } => vec![format!("transpose={transpose}")],
            Op::Cast { dtype } => vec![format!("dtype={dtype}")],
            Op::CollectiveStart { group, axis, kind } => {
                let mut a = vec![format!("group={}/{}", group.mesh_axis, group.size), format!("axis={axis}")];
                if let CollectiveKind::AllToAllV { rows } = kind {
                    a.push(format!("rows={rows}"));
                }
                a
            }
            _ => vec![],
        }
    }

    /// Whether this op is a product whose cost is its FLOPs, as [`crate::Graph::matmul_flops`]
    /// counts them: matmuls, the MoE segment products and attention (forward and backward).
    /// What the byte model, the dI/dW cut and `--recompute matmuls` treat as heavy compute.
    pub fn is_product(&self) -> bool {
        matches!(
            self,
            Op::Matmul
                | Op::SegmentMatmul { .. }
                | Op::SegmentOuter
                | Op::Attention { .. }
                | Op::AttentionBackward { .. }
        )
    }

    /// Whether this op is pointwise — unary, affine or binary: each output element a function of
    /// the same element of its (broadcast) operands. What `RecomputePolicy::Pointwise`
    /// recomputes and a runtime's fused groups compute in registers.
    pub fn is_pointwise(&self) -> bool {
        matches!(self, Op::Unary { .. } | Op::Affine { .. } | Op::Binary { .. })
    }

    /// Whether this op starts or completes a collective.
    pub fn is_collective(&self) -> bool {
        matches!(self, Op::CollectiveStart { .. } | Op::CollectiveWait)
    }
}
