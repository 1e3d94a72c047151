//! Conventional names of stage-graph inputs and outputs: the interface the pipeline runtime binds
//! values by (docs/ARCHITECTURE.md "Runtime" → Stage).

/// Stage input activation `[B, T, D]` (every stage but the first); its gradient is `grad.input`.
pub const INPUT: &str = "input";
/// Token ids `[B, T]` u32 (first stage).
pub const TOKENS: &str = "tokens";
/// Target token ids `[B, T]` u32 (last stage).
pub const TARGETS: &str = "targets";
/// Stage output activation `[B, T, D]` (every stage but the last); its gradient input is `grad.output`.
pub const OUTPUT: &str = "output";
/// Scalar loss, mean over the microbatch's tokens (last stage).
pub const LOSS: &str = crate::autodiff::LOSS;
/// Prefix of a MoE layer's forward output `expert_load.<layer>`: how many of the microbatch's
/// routed token copies each expert received, u32 `[E]` (no gradient; the trainer sums it over a
/// step to balance the experts and to report their load).
pub const EXPERT_LOAD: &str = "expert_load.";
/// Prefix of a MoE layer's forward output `aux_loss.<layer>` (when the model has a sequence-wise
/// auxiliary balance loss): the layer's weighted balance loss, a scalar in the wide dtype, part
/// of the training objective. Its gradient input `grad.aux_loss.<layer>` is the seed the runtime
/// gives it: d objective / d aux = 1 per microbatch, before the 1/m of the microbatch mean.
pub const AUX_LOSS: &str = "aux_loss.";
/// The multi-token-prediction loss (DeepSeek-V3 §2.2): λ times its cross-entropy, a scalar in
/// the wide dtype, an [`AUX_LOSS`] output (seeded and summed as the others are) that the runtime
/// reports apart.
pub const MTP_LOSS: &str = "aux_loss.mtp";
/// Next-token logits `[B·T, V]` of an inference graph's last stage (no targets, no loss).
pub const LOGITS: &str = "logits";

/// Prefix of a gradient's name: `grad.<x>` is d loss / d `x` for a parameter or activation input
/// `x` of the forward (an output of the backward), or the tangent input d loss / d `x` of a float
/// output `x` other than the loss (docs/ARCHITECTURE.md "Graph IR" → Autodiff).
pub const GRAD: &str = "grad.";

/// The name of the gradient of input or output `name`: `grad.<name>`.
pub fn grad_of(name: &str) -> String {
    format!("{GRAD}{name}")
}

/// The input or output a gradient name is of (`grad.<x>` → `x`); `None` for any other name.
pub fn grad_target(name: &str) -> Option<&str> {
    name.strip_prefix(GRAD)
}

/// Prefix of a saved activation: the forward's output `saved.<k>` is the k-th value the
/// backward reads from the forward (see [`crate::partition`]), an input of the backward.
pub const SAVED: &str = "saved.";

/// The name of the `k`-th saved activation: `saved.<k>`.
pub fn saved(k: usize) -> String {
    format!("{SAVED}{k}")
}

/// Whether `name` is a saved activation's name.
pub fn is_saved(name: &str) -> bool {
    name.starts_with(SAVED)
}

/// The two sides of a multiplexed F&B graph ([`crate::passes::multiplex`]): every input and
/// output of the forward graph is renamed `f.<name>`, every one of the backward `b.<name>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The forward microbatch's side, prefix `f.`.
    Fw,
    /// The backward microbatch's side, prefix `b.`.
    Bw,
}

impl Side {
    /// Both sides, forward first.
    pub const BOTH: [Side; 2] = [Side::Fw, Side::Bw];

    /// The prefix of this side's names.
    pub fn prefix(self) -> &'static str {
        match self {
            Side::Fw => "f.",
            Side::Bw => "b.",
        }
    }

    /// `name` on this side: `f.<name>` or `b.<name>`.
    pub fn name(self, name: &str) -> String {
        format!("{}{name}", self.prefix())
    }

    /// The side a multiplexed name is on and the name without its prefix; `None` for a name of
    /// neither side.
    pub fn split(name: &str) -> Option<(Side, &str)> {
        Side::BOTH.into_iter().find_map(|s| name.strip_prefix(s.prefix()).map(|n| (s, n)))
    }
}
