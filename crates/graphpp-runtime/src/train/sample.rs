//! Next-token sampling for text generation: temperature and top-k over one row of logits
//! (temperature scaling as in Hinton et al. 2015 / nanoGPT `generate`; top-k as in Fan et al. 2018,
//! "Hierarchical Neural Story Generation", §5.4).

/// Errors of [`sample_next`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    /// No logits.
    #[error("empty logits row")]
    Empty,
    /// A logit is NaN or +∞ (−∞ is allowed: a masked token).
    #[error("logit {index} is {value}")]
    BadLogit { index: usize, value: f32 },
    /// Every logit is −∞: no token can be drawn.
    #[error("every logit is -inf")]
    AllMasked,
    /// Temperature negative or not finite.
    #[error("temperature {temperature} must be finite and >= 0")]
    BadTemperature { temperature: f32 },
}

/// Draws the next token id from one row of logits (length = vocabulary size).
///
/// * `temperature == 0`: greedy, the index of the largest logit (the lowest such index on ties);
///   `rng_state` is not advanced.
/// * otherwise: keep the `top_k` largest logits (`top_k == 0` or `>= len` keeps all; ties broken
///   by lower index), take `softmax(logit / temperature)` over them (in f64), and draw one by
///   inverse CDF with a uniform from `rng_state` (SplitMix64, Steele et al. 2014; advanced by one).
///
/// Errors: [`SampleError::Empty`], [`SampleError::BadLogit`] (NaN or +∞),
/// [`SampleError::AllMasked`], [`SampleError::BadTemperature`].
pub fn sample_next(
    logits: &[f32],
    temperature: f32,
    top_k: usize,
    rng_state: &mut u64,
) -> Result<u32, SampleError> {
    if logits.is_empty() {
        return Err(SampleError::Empty);
    }
    if let Some((index, &value)) = logits.iter().enumerate().find(|(_, x)| x.is_nan() || **x == f32::INFINITY)
    {
        return Err(SampleError::BadLogit { index, value });
    }
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(SampleError::BadTemperature { temperature });
    }
    let mut order: Vec<usize> = (0..logits.len()).filter(|&i| logits[i] > f32::NEG_INFINITY).collect();
    if order.is_empty() {
        return Err(SampleError::AllMasked);
    }
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if temperature == 0.0 {
        return Ok(order[0] as u32);
    }
    if top_k > 0 {
        order.truncate(top_k);
    }
    let top = logits[order[0]] as f64;
    let weights: Vec<f64> =
        order.iter().map(|&i| ((logits[i] as f64 - top) / temperature as f64).exp()).collect();
    let u = uniform(rng_state) * weights.iter().sum::<f64>();
    let mut acc = 0.0;
    for (&i, w) in order.iter().zip(&weights) {
        acc += w;
        if u < acc {
            return Ok(i as u32);
        }
    }
    Ok(*order.last().unwrap_or(&0) as u32)
}

/// Uniform in [0, 1) from the next SplitMix64 output (53 high bits).
fn uniform(state: &mut u64) -> f64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(logits: &[f32], temperature: f32, top_k: usize, draws: usize) -> Vec<usize> {
        let mut c = vec![0; logits.len()];
        let mut s = 42u64;
        for _ in 0..draws {
            c[sample_next(logits, temperature, top_k, &mut s).unwrap() as usize] += 1;
        }
        c
    }

    #[test]
    fn zero_temperature_is_argmax_and_keeps_the_rng() {
        let mut s = 7;
        assert_eq!(sample_next(&[0.1, 2.5, -1.0, 2.4], 0.0, 0, &mut s), Ok(1));
        assert_eq!(sample_next(&[1.0, 3.0, 3.0], 0.0, 0, &mut s), Ok(1));
        assert_eq!(sample_next(&[f32::NEG_INFINITY, -5.0], 0.0, 0, &mut s), Ok(1));
        assert_eq!(s, 7);
    }

    /// Logits ln(1..4) give probabilities 0.1, 0.2, 0.3, 0.4; 40 000 draws land within 0.01 of each
    /// (about 4 standard deviations).
    #[test]
    fn frequencies_follow_the_softmax() {
        let logits: Vec<f32> = (1..=4).map(|i| (i as f32).ln()).collect();
        let c = counts(&logits, 1.0, 0, 40_000);
        for (i, n) in c.iter().enumerate() {
            let f = *n as f64 / 40_000.0;
            assert!((f - 0.1 * (i + 1) as f64).abs() < 0.01, "{c:?}");
        }
    }

    /// Temperature 2 takes the square root of the odds: logits ln(1), ln(4) → weights 1 : 2.
    #[test]
    fn temperature_flattens() {
        let c = counts(&[0.0, 4f32.ln()], 2.0, 0, 30_000);
        let f = c[1] as f64 / 30_000.0;
        assert!((f - 2.0 / 3.0).abs() < 0.01, "{c:?}");
    }

    #[test]
    fn top_k_never_draws_outside_the_k_largest() {
        let logits = [1.0, 5.0, 0.5, 4.9, 4.8, -2.0];
        let c = counts(&logits, 5.0, 2, 5_000);
        assert_eq!(c[0] + c[2] + c[4] + c[5], 0, "{c:?}");
        assert!(c[1] > 0 && c[3] > 0, "{c:?}");
        // top_k = 1 is greedy at any temperature.
        assert_eq!(counts(&logits, 100.0, 1, 200)[1], 200);
    }

    #[test]
    fn same_state_same_token_and_state_advances() {
        let logits = [0.0f32; 50];
        let (mut a, mut b) = (99u64, 99u64);
        let x: Vec<u32> = (0..20).map(|_| sample_next(&logits, 1.0, 0, &mut a).unwrap()).collect();
        let y: Vec<u32> = (0..20).map(|_| sample_next(&logits, 1.0, 0, &mut b).unwrap()).collect();
        assert_eq!(x, y);
        assert!(x.iter().any(|&t| t != x[0]), "uniform logits should not repeat one token: {x:?}");
    }

    #[test]
    fn bad_rows_are_typed_errors() {
        let mut s = 0;
        assert_eq!(sample_next(&[], 1.0, 0, &mut s), Err(SampleError::Empty));
        assert_eq!(
            sample_next(&[0.0, f32::INFINITY], 1.0, 0, &mut s),
            Err(SampleError::BadLogit { index: 1, value: f32::INFINITY })
        );
        assert!(matches!(
            sample_next(&[f32::NAN], 1.0, 0, &mut s),
            Err(SampleError::BadLogit { index: 0, .. })
        ));
        assert_eq!(sample_next(&[f32::NEG_INFINITY; 3], 1.0, 0, &mut s), Err(SampleError::AllMasked));
        assert_eq!(
            sample_next(&[0.0], -1.0, 0, &mut s),
            Err(SampleError::BadTemperature { temperature: -1.0 })
        );
    }
}
