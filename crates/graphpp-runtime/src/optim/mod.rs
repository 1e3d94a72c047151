//! AdamW on named f32 parameters: Adam with decoupled weight decay (Loshchilov & Hutter, "Decoupled
//! Weight Decay Regularization", ICLR 2019, Algorithm 2), with the exact update order of PyTorch's
//! `torch.optim.AdamW` (single-tensor path) so that runs match PyTorch step for step.
//!
//! The optimizer state (first moment `m`, second moment `v` per parameter, and the step count) exports
//! to named tensors (`adam.m.<param>`, `adam.v.<param>`, `adam.step`) for checkpoints (docs/ARCHITECTURE.md,
//! "Models, data, training": resume continues the exact loss sequence).

pub mod clip;
pub mod lr;

use candle_core::{DType, Tensor};
use rayon::prelude::*;
use std::collections::{BTreeMap, HashMap};

/// Key prefix of the first-moment tensors in [`AdamW::state_dict`].
pub const M_PREFIX: &str = "adam.m.";
/// Key prefix of the second-moment tensors in [`AdamW::state_dict`].
pub const V_PREFIX: &str = "adam.v.";
/// Key of the step count (i64 scalar) in [`AdamW::state_dict`].
pub const STEP_KEY: &str = "adam.step";

/// Errors of the optimizer and of gradient clipping ([`crate::optim::clip`]).
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A hyperparameter is out of its range.
    #[error("AdamW hyperparameter {name} = {value}: {reason}")]
    Hyper { name: &'static str, value: f64, reason: &'static str },
    /// The learning rate handed to a step is negative or not finite.
    #[error("learning rate {lr} must be finite and >= 0")]
    BadLr { lr: f64 },
    /// A parameter has no gradient.
    #[error("parameter `{name}` has no gradient")]
    MissingGrad { name: String },
    /// A gradient names no parameter.
    #[error("gradient `{name}` matches no parameter")]
    ExtraGrad { name: String },
    /// Gradient and parameter shapes differ.
    #[error("gradient `{name}` has shape {grad:?} but the parameter has shape {param:?}")]
    ShapeMismatch { name: String, param: Vec<usize>, grad: Vec<usize> },
    /// A tensor has a dtype the operation does not take.
    #[error("`{name}` has dtype {dtype:?}; expected {expected}")]
    DType { name: String, dtype: DType, expected: &'static str },
    /// The parameters differ from those the optimizer state was built for.
    #[error("parameter `{name}`: {reason}")]
    StateMismatch { name: String, reason: &'static str },
    /// An entry of an imported state dict is malformed.
    #[error("optimizer state entry `{key}`: {reason}")]
    BadState { key: String, reason: String },
    /// The clipping threshold is not a finite positive number.
    #[error("max_norm {max_norm} must be finite and > 0")]
    BadMaxNorm { max_norm: f64 },
    /// The (global) gradient norm is NaN or infinite: some gradient overflowed.
    #[error("squared gradient norm {sq_norm} is not finite and >= 0")]
    NonFiniteNorm { sq_norm: f64 },
    /// A scaling factor is NaN, infinite or negative.
    #[error("gradient scale {scale} must be finite and >= 0")]
    BadScale { scale: f32 },
    /// A tensor kernel failed.
    #[error("tensor op on `{name}`: {source}")]
    Kernel { name: String, source: Box<candle_core::Error> },
}

/// Wraps a candle error with the name of the tensor it concerns.
pub(crate) fn kernel(name: &str) -> impl Fn(candle_core::Error) -> OptimError + '_ {
    move |e| OptimError::Kernel { name: name.to_string(), source: Box::new(e) }
}

/// AdamW hyperparameters; defaults are PyTorch's (`betas=(0.9, 0.999)`, `eps=1e-8`,
/// `weight_decay=0.01`). The learning rate is passed to each [`AdamW::step`] (see [`crate::optim::lr`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Decay of the first moment, in `[0, 1)`.
    pub beta1: f64,
    /// Decay of the second moment, in `[0, 1)`.
    pub beta2: f64,
    /// Added to `sqrt(v̂)` in the denominator, `>= 0`.
    pub eps: f64,
    /// Decoupled weight decay coefficient λ, `>= 0`: each step first does `p -= lr·λ·p`.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

impl AdamWConfig {
    /// Checks the ranges; errors: [`OptimError::Hyper`] naming the first bad field.
    pub fn validate(&self) -> Result<(), OptimError> {
        let unit = |name, value: f64| {
            if (0.0..1.0).contains(&value) {
                Ok(())
            } else {
                Err(OptimError::Hyper { name, value, reason: "must be in [0, 1)" })
            }
        };
        let nonneg = |name, value: f64| {
            if value.is_finite() && value >= 0.0 {
                Ok(())
            } else {
                Err(OptimError::Hyper { name, value, reason: "must be finite and >= 0" })
            }
        };
        unit("beta1", self.beta1)?;
        unit("beta2", self.beta2)?;
        nonneg("eps", self.eps)?;
        nonneg("weight_decay", self.weight_decay)
    }
}

/// AdamW optimizer over named f32 parameters.
///
/// Step `t` (1-based) with learning rate `lr`, gradient `g`, in this order (PyTorch
/// `torch.optim.AdamW`, `_single_tensor_adam`; Loshchilov & Hutter 2019, Algorithm 2):
/// ```text
/// p  ← p · (1 − lr·λ)                       decoupled weight decay, before the Adam update
/// m  ← m + (1 − β1)·(g − m)
/// v  ← β2·v + (1 − β2)·g²
/// p  ← p − (lr / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + ε)
/// ```
/// so ε is added after the square root of the bias-corrected second moment. `m` and `v` start at
/// zero on the first step; the step count is shared by all parameters.
#[derive(Clone, Debug)]
pub struct AdamW {
    cfg: AdamWConfig,
    step: u64,
    /// Per parameter: (m, v), same shape and device as the parameter, f32.
    moments: BTreeMap<String, (Tensor, Tensor)>,
}

impl AdamW {
    /// A fresh optimizer (step 0, no moments). Errors: [`OptimError::Hyper`].
    pub fn new(cfg: AdamWConfig) -> Result<Self, OptimError> {
        cfg.validate()?;
        Ok(AdamW { cfg, step: 0, moments: BTreeMap::new() })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// Number of steps taken (the `t` of the last step; 0 before the first).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// One AdamW step on every parameter with learning rate `lr` (see the type's docs).
    ///
    /// `params` and `grads` are keyed by parameter name; every tensor must be f32 and each gradient
    /// must have its parameter's shape. After the first step the parameter names must stay those
    /// the state was built for. Everything is checked before anything changes, so on error neither
    /// the parameters nor the state are modified. Errors: [`OptimError::BadLr`],
    /// [`OptimError::MissingGrad`], [`OptimError::ExtraGrad`], [`OptimError::ShapeMismatch`],
    /// [`OptimError::DType`], [`OptimError::StateMismatch`], [`OptimError::Kernel`].
    pub fn step(
        &mut self,
        params: &mut HashMap<String, Tensor>,
        grads: &HashMap<String, Tensor>,
        lr: f64,
    ) -> Result<(), OptimError> {
        if !lr.is_finite() || lr < 0.0 {
            return Err(OptimError::BadLr { lr });
        }
        check_grads(params, grads)?;
        self.check_state(params)?;
        let t = self.step + 1;
        let mut updates = Vec::with_capacity(params.len());
        let mut names: Vec<&String> = params.keys().collect();
        names.sort();
        for name in names {
            let (p, g) = (&params[name], &grads[name]);
            let (m, v) = match self.moments.get(name) {
                Some((m, v)) => (m.clone(), v.clone()),
                None => {
                    let z = p.zeros_like().map_err(kernel(name))?;
                    (z.clone(), z)
                }
            };
            let (p, m, v) = self.update(p, g, &m, &v, lr, t).map_err(kernel(name))?;
            updates.push((name.clone(), p, m, v));
        }
        for (name, p, m, v) in updates {
            params.insert(name.clone(), p);
            self.moments.insert(name, (m, v));
        }
        self.step = t;
        Ok(())
    }

    /// The update of one parameter at step `t`; returns the new (p, m, v), in one pass
    /// ([`Fused`]) over the operands (a non-contiguous one, such as a transposed weight
    /// gradient kept as the backward gave it, copied first).
    fn update(
        &self,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
        lr: f64,
        t: u64,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let fused = Fused::new(&self.cfg, lr, t);
        if crate::kernels::device::composed(p) {
            return fused.composed(p, g, m, v);
        }
        let [p, g, m, v] = [p, g, m, v].map(|x| x.contiguous());
        fused.apply(&p?, &g?, &m?, &v?)
    }

    /// After the first step the parameter names must equal those in the state.
    fn check_state(&self, params: &HashMap<String, Tensor>) -> Result<(), OptimError> {
        if self.moments.is_empty() {
            return Ok(());
        }
        if let Some(name) = params.keys().find(|n| !self.moments.contains_key(*n)) {
            return Err(OptimError::StateMismatch {
                name: name.clone(),
                reason: "has no optimizer state (it was not present at earlier steps)",
            });
        }
        if let Some(name) = self.moments.keys().find(|n| !params.contains_key(*n)) {
            return Err(OptimError::StateMismatch {
                name: name.clone(),
                reason: "has optimizer state but was not passed to this step",
            });
        }
        for (name, p) in params {
            if self.moments[name].0.dims() != p.dims() {
                return Err(OptimError::StateMismatch {
                    name: name.clone(),
                    reason: "shape differs from its optimizer state",
                });
            }
        }
        Ok(())
    }

    /// The state as named tensors for a checkpoint: `adam.m.<param>` and `adam.v.<param>` (f32,
    /// the parameter's shape and device) for every parameter, and `adam.step` (i64 scalar on the
    /// CPU, steps taken).
    /// Hyperparameters are not included (they belong to the run's config).
    pub fn state_dict(&self) -> Result<HashMap<String, Tensor>, OptimError> {
        let step = i64::try_from(self.step).unwrap_or(i64::MAX);
        let step = Tensor::new(step, &candle_core::Device::Cpu).map_err(kernel(STEP_KEY))?;
        let mut out = HashMap::from([(STEP_KEY.to_string(), step)]);
        for (name, (m, v)) in &self.moments {
            out.insert(format!("{M_PREFIX}{name}"), m.clone());
            out.insert(format!("{V_PREFIX}{name}"), v.clone());
        }
        Ok(out)
    }

    /// Replaces the state with one exported by [`AdamW::state_dict`]; keys not starting with
    /// `adam.` are ignored (a checkpoint may hold parameters in the same file). Moments are used on
    /// the device they come on: move them to the parameters' device first. Errors:
    /// [`OptimError::BadState`] for a missing or non-integer `adam.step`, an unknown `adam.` key,
    /// an `m` without its `v` (or the reverse), differing shapes, or a non-f32 moment.
    pub fn load_state_dict(&mut self, state: &HashMap<String, Tensor>) -> Result<(), OptimError> {
        let bad = |key: &str, reason: &str| OptimError::BadState { key: key.into(), reason: reason.into() };
        let step = state.get(STEP_KEY).ok_or_else(|| bad(STEP_KEY, "missing"))?;
        let step = step
            .to_dtype(DType::I64)
            .and_then(|s| s.to_scalar::<i64>())
            .map_err(|e| bad(STEP_KEY, &format!("not an integer scalar: {e}")))?;
        let step = u64::try_from(step).map_err(|_| bad(STEP_KEY, "negative"))?;
        let mut moments = BTreeMap::new();
        for (key, m) in state {
            if key == STEP_KEY || !key.starts_with("adam.") {
                continue;
            }
            if let Some(name) = key.strip_prefix(V_PREFIX) {
                if !state.contains_key(&format!("{M_PREFIX}{name}")) {
                    return Err(bad(key, "second moment without a first moment"));
                }
                continue;
            }
            let name = key.strip_prefix(M_PREFIX).ok_or_else(|| bad(key, "unknown optimizer key"))?;
            let vkey = format!("{V_PREFIX}{name}");
            let v = state.get(&vkey).ok_or_else(|| bad(key, "first moment without a second moment"))?;
            for (k, x) in [(key.as_str(), m), (vkey.as_str(), v)] {
                if x.dtype() != DType::F32 {
                    return Err(bad(k, &format!("dtype {:?}, expected f32", x.dtype())));
                }
            }
            if m.dims() != v.dims() {
                return Err(bad(key, &format!("shape {:?} but `{vkey}` has {:?}", m.dims(), v.dims())));
            }
            moments.insert(name.to_string(), (m.clone(), v.clone()));
        }
        if step > 0 && moments.is_empty() {
            return Err(bad(STEP_KEY, "steps were taken but no moments are present"));
        }
        self.step = step;
        self.moments = moments;
        Ok(())
    }
}

/// `(1 − β1^t, sqrt(1 − β2^t))`, Adam's bias corrections at step `t` (1-based).
fn bias_corrections(c: &AdamWConfig, t: u64) -> (f64, f64) {
    let t = i32::try_from(t).unwrap_or(i32::MAX);
    (1.0 - c.beta1.powi(t), (1.0 - c.beta2.powi(t)).sqrt())
}

/// Elements from which a fused update splits over the current rayon pool.
const PARALLEL_MIN: usize = 1 << 16;

/// One AdamW step of a parameter in one pass (as PyTorch's `fused=True` AdamW
/// does): reads p, g, m, v once and writes new p, m, v, where the composition makes a tensor per
/// operation (thirteen passes, each making a tensor; `tests::composed`). The constants are
/// candle's: each f64 hyperparameter rounded to f32 as its affine rounds it, and `x · a + b`
/// computed as a multiply, then an add (no fused multiply-add), so every element is the
/// composition's bit for bit (`tests::fused_update_is_the_composition`).
struct Fused {
    /// 1 − lr·λ.
    decay: f32,
    /// 1 − β1.
    one_minus_beta1: f32,
    beta2: f32,
    /// 1 − β2.
    one_minus_beta2: f32,
    /// 1 / sqrt(1 − β2^t).
    inv_bias2_sqrt: f32,
    eps: f32,
    /// lr / (1 − β1^t).
    step_size: f32,
}

impl Fused {
    fn new(c: &AdamWConfig, lr: f64, t: u64) -> Fused {
        let (bias1, bias2_sqrt) = bias_corrections(c, t);
        Fused {
            decay: (1.0 - lr * c.weight_decay) as f32,
            one_minus_beta1: (1.0 - c.beta1) as f32,
            beta2: c.beta2 as f32,
            one_minus_beta2: (1.0 - c.beta2) as f32,
            inv_bias2_sqrt: (1.0 / bias2_sqrt) as f32,
            eps: c.eps as f32,
            step_size: (lr / bias1) as f32,
        }
    }

    /// The new (p, m, v) of contiguous CPU f32 operands of one shape.
    ///
    /// # Errors
    /// An operand of another dtype, device, shape or layout.
    fn apply(
        &self,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let all = [p, g, m, v];
        if let Some(x) = all.iter().find(|x| x.dims() != p.dims()) {
            candle_core::bail!("AdamW: an operand of shape {:?} for a parameter of {:?}", x.dims(), p.dims())
        }
        let n = p.elem_count();
        let (mut po, mut mo, mut vo) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        {
            let slices: Vec<_> = all.iter().map(|x| x.storage_and_layout()).collect();
            let mut ins = Vec::with_capacity(4);
            for (storage, layout) in &slices {
                let (candle_core::Storage::Cpu(candle_core::CpuStorage::F32(data)), Some((a, b))) =
                    (&**storage, layout.contiguous_offsets())
                else {
                    candle_core::bail!("AdamW: operands must be contiguous CPU f32 tensors")
                };
                ins.push(&data[a..b]);
            }
            let threads = rayon::current_num_threads();
            let chunk = if threads > 1 && n >= PARALLEL_MIN { n.div_ceil(threads) } else { n.max(1) };
            po.par_chunks_mut(chunk)
                .zip(mo.par_chunks_mut(chunk))
                .zip(vo.par_chunks_mut(chunk))
                .enumerate()
                .for_each(|(c, ((po, mo), vo))| {
                    let r = c * chunk..c * chunk + po.len();
                    let at = |i: usize| &ins[i][r.clone()];
                    self.run([at(0), at(1), at(2), at(3)], po, mo, vo);
                });
        }
        let shape = p.dims();
        let t = |x: Vec<f32>| Tensor::from_vec(x, shape, p.device());
        Ok((t(po)?, t(mo)?, t(vo)?))
    }

    /// [`Fused::apply`]'s update as candle operations on the operands' device (a GPU's, or the
    /// CPU's under `GRAPHPP_KERNELS=composed`): the same formula, each operation rounded to f32.
    ///
    /// # Errors
    /// candle's, for operands of another dtype, device or shape.
    fn composed(
        &self,
        p: &Tensor,
        g: &Tensor,
        m: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let f = |x: f32| f64::from(x);
        let m1 = ((g - m)?.affine(f(self.one_minus_beta1), 0.0)? + m)?;
        let v1 = (v.affine(f(self.beta2), 0.0)? + g.sqr()?.affine(f(self.one_minus_beta2), 0.0)?)?;
        let denom = v1.sqrt()?.affine(f(self.inv_bias2_sqrt), f(self.eps))?;
        let p1 = (p.affine(f(self.decay), 0.0)? - (m1.clone() / denom)?.affine(f(self.step_size), 0.0)?)?;
        Ok((p1, m1, v1))
    }

    /// The update over one run of elements: `[p, g, m, v]` in, new p, m, v out.
    #[inline(always)]
    fn run(&self, [p, g, m, v]: [&[f32]; 4], po: &mut [f32], mo: &mut [f32], vo: &mut [f32]) {
        let n = po.len();
        let (p, g, m, v, mo, vo) = (&p[..n], &g[..n], &m[..n], &v[..n], &mut mo[..n], &mut vo[..n]);
        for i in 0..n {
            let (p, g, m, v) = (p[i], g[i], m[i], v[i]);
            let decayed = p * self.decay + 0.0;
            let m1 = ((g - m) * self.one_minus_beta1 + 0.0) + m;
            let v1 = (v * self.beta2 + 0.0) + ((g * g) * self.one_minus_beta2 + 0.0);
            let denom = v1.sqrt() * self.inv_bias2_sqrt + self.eps;
            po[i] = decayed - ((m1 / denom) * self.step_size + 0.0);
            mo[i] = m1;
            vo[i] = v1;
        }
    }
}

/// Every parameter has an f32 gradient of its shape, and every gradient names a parameter.
fn check_grads(params: &HashMap<String, Tensor>, grads: &HashMap<String, Tensor>) -> Result<(), OptimError> {
    let mut names: Vec<&String> = params.keys().collect();
    names.sort();
    for name in names {
        let p = &params[name];
        let g = grads.get(name).ok_or_else(|| OptimError::MissingGrad { name: name.clone() })?;
        for (what, x) in [(name.clone(), p), (format!("gradient of {name}"), g)] {
            if x.dtype() != DType::F32 {
                return Err(OptimError::DType { name: what, dtype: x.dtype(), expected: "f32" });
            }
        }
        if p.dims() != g.dims() {
            return Err(OptimError::ShapeMismatch {
                name: name.clone(),
                param: p.dims().to_vec(),
                grad: g.dims().to_vec(),
            });
        }
    }
    let mut extra: Vec<&String> = grads.keys().filter(|n| !params.contains_key(*n)).collect();
    extra.sort();
    match extra.first() {
        Some(name) => Err(OptimError::ExtraGrad { name: (*name).clone() }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn t(data: &[f32]) -> Tensor {
        Tensor::from_slice(data, data.len(), &Device::Cpu).unwrap()
    }
    fn vals(x: &Tensor) -> Vec<f32> {
        x.to_vec1::<f32>().unwrap()
    }
    fn map(pairs: &[(&str, &[f32])]) -> HashMap<String, Tensor> {
        pairs.iter().map(|(n, d)| (n.to_string(), t(d))).collect()
    }
    fn no_wd(eps: f64) -> AdamW {
        AdamW::new(AdamWConfig { weight_decay: 0.0, eps, ..Default::default() }).unwrap()
    }

    /// With bias correction, step 1 moves every element by lr·g/(|g| + ε) — exactly lr·sign(g) for
    /// ε = 0, whatever |g|. Without correction it would be lr·(1−β1)/sqrt(1−β2)·sign(g) ≈ 3.16·lr.
    #[test]
    fn first_step_moves_by_lr_times_sign() {
        let mut opt = no_wd(0.0);
        let mut p = map(&[("w", &[1.0, 1.0, 1.0, 1.0])]);
        let g = map(&[("w", &[3.0, -0.001, 250.0, -7.5])]);
        opt.step(&mut p, &g, 0.01).unwrap();
        let want = [0.99, 1.01, 0.99, 1.01];
        for (a, b) in vals(&p["w"]).iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        assert_eq!(opt.step_count(), 1);
    }

    /// ε goes after the square root of the bias-corrected second moment: with g = 2, ε = 1 the first
    /// update is lr·2/(2 + 1). (ε inside the root gives 2/sqrt(5); ε before bias correction
    /// 2/(2 + 1/sqrt(1−β2)).)
    #[test]
    fn eps_is_added_after_corrected_sqrt() {
        let mut opt = no_wd(1.0);
        let mut p = map(&[("w", &[1.0])]);
        opt.step(&mut p, &map(&[("w", &[2.0])]), 0.1).unwrap();
        let want = 1.0 - 0.1 * 2.0 / 3.0;
        assert!((vals(&p["w"])[0] as f64 - want).abs() < 1e-7);
    }

    /// Decoupled decay with a zero gradient shrinks p by exactly (1 − lr·λ) (the Adam part is 0/ε).
    /// L2-coupled decay (g += λp) would instead move p by ≈ lr·sign(p) at step 1.
    #[test]
    fn weight_decay_is_decoupled() {
        let cfg = AdamWConfig { weight_decay: 0.5, ..Default::default() };
        let mut opt = AdamW::new(cfg).unwrap();
        let mut p = map(&[("w", &[2.0, -4.0])]);
        opt.step(&mut p, &map(&[("w", &[0.0, 0.0])]), 0.1).unwrap();
        assert_eq!(vals(&p["w"]), vec![2.0 * 0.95, -4.0 * 0.95]);
    }

    /// Step 2 with g1 = 1, g2 = −1 (β1 = 0.9, β2 = 0.999, ε = 0): m = 0.9·0.1 − 0.1 = −0.01,
    /// v = 0.001·0.999 + 0.001 = 0.001999, m̂ = −0.01/0.19, v̂ = 0.001999/(1 − 0.999²).
    #[test]
    fn second_step_uses_step_two_corrections() {
        let mut opt = no_wd(0.0);
        let mut p = map(&[("w", &[0.0])]);
        opt.step(&mut p, &map(&[("w", &[1.0])]), 0.1).unwrap();
        opt.step(&mut p, &map(&[("w", &[-1.0])]), 0.1).unwrap();
        let m_hat = -0.01 / (1.0 - 0.81);
        let v_hat = 0.001999 / (1.0 - 0.999f64 * 0.999);
        let want = -0.1 - 0.1 * m_hat / v_hat.sqrt();
        assert!((vals(&p["w"])[0] as f64 - want).abs() < 1e-6, "{:?} vs {want}", vals(&p["w"]));
    }

    /// The one-pass update is the candle composition ([`Fused::composed`], what a GPU runs) bit
    /// for bit on the CPU: three steps (the first from
    /// one zero tensor for both moments, as `step` passes them) over values that round, ±0, tiny
    /// and huge gradients, weight decay, odd hyperparameters, at 1 and 3 threads (70,001
    /// elements: split over the pool), and with a transposed gradient (copied first).
    #[test]
    fn fused_update_is_the_composition() {
        let n = 70_001;
        let cfg = AdamWConfig { beta1: 0.87, beta2: 0.9993, eps: 3e-8, weight_decay: 0.013 };
        let opt = AdamW::new(cfg).unwrap();
        let wave = |k: usize| -> Tensor {
            let v: Vec<f32> = (0..n)
                .map(|i| match (i + k) % 11 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => 1e-30,
                    3 => -7e5,
                    _ => ((i * 37 + k * 11) % 1009) as f32 * 0.0137 - 6.9,
                })
                .collect();
            Tensor::from_vec(v, n, &Device::Cpu).unwrap()
        };
        let bits = |x: &Tensor| -> Vec<u32> {
            x.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
        };
        let same = |got: &(Tensor, Tensor, Tensor), want: &(Tensor, Tensor, Tensor), case: &str| {
            for (what, a, b) in [("p", &got.0, &want.0), ("m", &got.1, &want.1), ("v", &got.2, &want.2)] {
                assert_eq!(bits(a), bits(b), "{what}, {case}");
            }
        };
        for threads in [1, 3] {
            let pool = crate::kernels::threads::rank_pool(0, threads).unwrap();
            let z = wave(0).zeros_like().unwrap();
            let (mut p, mut m, mut v) = (wave(0), z.clone(), z);
            for t in 1..=3 {
                let (g, lr) = (wave(t as usize), 1e-3 * t as f64);
                let want = Fused::new(&cfg, lr, t).composed(&p, &g, &m, &v).unwrap();
                // The fused CPU update, also under GRAPHPP_KERNELS=composed.
                let fused =
                    || crate::kernels::device::with_composed(false, || opt.update(&p, &g, &m, &v, lr, t));
                let got = pool.install(fused).unwrap();
                same(&got, &want, &format!("step {t}, {threads} threads"));
                (p, m, v) = got;
            }
        }
        let square = |k| wave(k).narrow(0, 0, 100 * 100).unwrap().reshape((100, 100)).unwrap();
        let (p, g) = (square(0), square(1).t().unwrap());
        let z = p.zeros_like().unwrap();
        assert!(Fused::new(&cfg, 1e-3, 1).apply(&p, &g, &z, &z).is_err(), "apply takes contiguous operands");
        let got =
            crate::kernels::device::with_composed(false, || opt.update(&p, &g, &z, &z, 1e-3, 1)).unwrap();
        same(&got, &Fused::new(&cfg, 1e-3, 1).composed(&p, &g, &z, &z).unwrap(), "a transposed gradient");
    }

    #[test]
    fn gradient_errors_name_the_parameter_and_change_nothing() {
        let mut opt = no_wd(1e-8);
        let mut p = map(&[("a", &[1.0]), ("b", &[1.0, 2.0])]);
        let before = p.clone();
        let e = opt.step(&mut p, &map(&[("a", &[1.0])]), 0.1).unwrap_err();
        assert!(matches!(&e, OptimError::MissingGrad { name } if name == "b"), "{e}");
        let e = opt.step(&mut p, &map(&[("a", &[1.0]), ("b", &[1.0, 1.0]), ("c", &[1.0])]), 0.1);
        assert!(matches!(e, Err(OptimError::ExtraGrad { name }) if name == "c"));
        let e = opt.step(&mut p, &map(&[("a", &[1.0]), ("b", &[1.0, 1.0, 1.0])]), 0.1).unwrap_err();
        assert!(
            matches!(&e, OptimError::ShapeMismatch { name, param, grad }
            if name == "b" && param == &[2] && grad == &[3]),
            "{e}"
        );
        let mut g = map(&[("a", &[1.0]), ("b", &[1.0, 1.0])]);
        g.insert("a".into(), t(&[1.0]).to_dtype(DType::F64).unwrap());
        assert!(matches!(opt.step(&mut p, &g, 0.1), Err(OptimError::DType { .. })));
        let g = map(&[("a", &[1.0]), ("b", &[1.0, 1.0])]);
        assert!(matches!(opt.step(&mut p, &g, f64::NAN), Err(OptimError::BadLr { .. })));
        assert!(matches!(opt.step(&mut p, &g, -1.0), Err(OptimError::BadLr { .. })));
        assert_eq!(opt.step_count(), 0);
        for (n, x) in &before {
            assert_eq!(vals(x), vals(&p[n]));
        }
        // After a step the parameter set is fixed.
        opt.step(&mut p, &g, 0.1).unwrap();
        p.insert("c".into(), t(&[0.0]));
        let mut g2 = g.clone();
        g2.insert("c".into(), t(&[0.0]));
        assert!(
            matches!(opt.step(&mut p, &g2, 0.1), Err(OptimError::StateMismatch { name, .. }) if name == "c")
        );
    }

    #[test]
    fn bad_hyperparameters_are_rejected() {
        for cfg in [
            AdamWConfig { beta1: 1.0, ..Default::default() },
            AdamWConfig { beta2: -0.1, ..Default::default() },
            AdamWConfig { eps: f64::NAN, ..Default::default() },
            AdamWConfig { weight_decay: -1.0, ..Default::default() },
        ] {
            assert!(matches!(AdamW::new(cfg), Err(OptimError::Hyper { .. })), "{cfg:?}");
        }
    }

    /// Export after 3 steps, import into a fresh optimizer, 2 more steps: bitwise the same
    /// parameters as 5 uninterrupted steps (resume continues exactly).
    #[test]
    fn state_round_trip_resumes_exactly() {
        let grads: Vec<_> = (0..5)
            .map(|i| {
                let i = i as f32;
                map(&[("a", &[i - 2.0, 0.5 * i]), ("b.c", &[1.0 / (i + 1.0)])])
            })
            .collect();
        let cfg = AdamWConfig { weight_decay: 0.1, beta2: 0.95, ..Default::default() };
        let init = map(&[("a", &[0.3, -0.7]), ("b.c", &[1.5])]);
        let (mut straight, mut p1) = (AdamW::new(cfg).unwrap(), init.clone());
        for g in &grads {
            straight.step(&mut p1, g, 0.05).unwrap();
        }
        let (mut first, mut p2) = (AdamW::new(cfg).unwrap(), init);
        for g in &grads[..3] {
            first.step(&mut p2, g, 0.05).unwrap();
        }
        let state = first.state_dict().unwrap();
        let mut keys: Vec<_> = state.keys().cloned().collect();
        keys.sort();
        assert_eq!(keys, ["adam.m.a", "adam.m.b.c", "adam.step", "adam.v.a", "adam.v.b.c"]);
        assert_eq!(state["adam.step"].to_scalar::<i64>().unwrap(), 3);
        let mut resumed = AdamW::new(cfg).unwrap();
        let mut with_params = state.clone();
        with_params.insert("a".into(), t(&[9.0])); // non-`adam.` keys are ignored
        resumed.load_state_dict(&with_params).unwrap();
        for g in &grads[3..] {
            resumed.step(&mut p2, g, 0.05).unwrap();
        }
        assert_eq!(resumed.step_count(), 5);
        for n in ["a", "b.c"] {
            assert_eq!(vals(&p1[n]), vals(&p2[n]), "{n}");
        }
    }

    #[test]
    fn malformed_state_is_rejected() {
        let mut opt = no_wd(1e-8);
        let step = Tensor::new(2i64, &Device::Cpu).unwrap();
        let base = HashMap::from([("adam.step".to_string(), step), ("adam.m.w".to_string(), t(&[0.0]))]);
        let e = opt.load_state_dict(&base).unwrap_err();
        assert!(matches!(&e, OptimError::BadState { key, .. } if key == "adam.m.w"), "{e}");
        let mut s = base.clone();
        s.insert("adam.v.w".into(), t(&[0.0, 0.0]));
        assert!(matches!(opt.load_state_dict(&s), Err(OptimError::BadState { .. })));
        let mut s = base.clone();
        s.insert("adam.v.w".into(), t(&[0.0]));
        s.insert("adam.x.w".into(), t(&[0.0]));
        let e = opt.load_state_dict(&s).unwrap_err();
        assert!(matches!(&e, OptimError::BadState { key, .. } if key == "adam.x.w"), "{e}");
        s.remove("adam.x.w");
        s.remove("adam.step");
        assert!(
            matches!(opt.load_state_dict(&s), Err(OptimError::BadState { key, .. }) if key == "adam.step")
        );
        assert_eq!(opt.step_count(), 0);
    }
}
