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
/// Next-token logits `[B·T, V]` of an inference graph's last stage (no targets, no loss).
pub const LOGITS: &str = "logits";
