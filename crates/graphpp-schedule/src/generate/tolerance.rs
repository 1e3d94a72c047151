//! Time comparisons for the cost-aware generators (zb-auto, zbv-auto) that do not depend on
//! floating-point rounding.
//!
//! A heuristic that asks "does this W fit into the gap before the next input arrives?" must give
//! the same answer for costs `F=1, c=0.1` and for the same costs ×10. In `f64`, `9.3` and
//! `9.299999999999999` (the sum of the same costs in another order) compare unequal, and the
//! zero-bubble reference heuristics take different schedules for the two units (for
//! example p=2, m=4, F=I=W=1, c=0.1 gives 14.3 vs 13.4). Here two times closer than
//! `1e-9 × (T_F + T_I + T_W + c)` are equal: far above the rounding error of any sum of ≤ 10^6
//! costs, far below any difference a schedule can make, and scaled with the cost unit.
//!
//! What a tie means is then a choice, not an accident: by default an exact fit fits (`le` holds,
//! `lt` does not); [`Tolerance::ties_lose`] turns every tie the other way, so a heuristic can try
//! both and keep the better schedule.

/// Comparisons of times within a tolerance proportional to the costs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tolerance {
    eps: f64,
    ties_fit: bool,
}

impl Tolerance {
    /// The tolerance for these per-action costs and hop latency (cost units); ties fit.
    pub fn for_costs(f: f64, i: f64, w: f64, c: f64) -> Self {
        Tolerance { eps: 1e-9 * (f + i + w + c), ties_fit: true }
    }

    /// The tolerance for memory amounts in units of `m_b` (M_B): `1e-9 · M_B`, whatever the costs.
    pub fn for_memory(m_b: f64) -> Self {
        Tolerance { eps: 1e-9 * m_b.abs(), ties_fit: true }
    }

    /// The same tolerance with every tie decided the other way (`le` false, `lt` true on a tie).
    pub fn ties_lose(self) -> Self {
        Tolerance { ties_fit: false, ..self }
    }

    /// `a ≤ b`; a tie (equal within the tolerance) holds unless ties lose.
    pub fn le(self, a: f64, b: f64) -> bool {
        if self.ties_fit {
            a <= b + self.eps
        } else {
            a < b - self.eps
        }
    }

    /// `a < b`; a tie does not hold unless ties lose.
    pub fn lt(self, a: f64, b: f64) -> bool {
        !self.le(b, a)
    }

    /// When an action whose rank is free at `free` and whose input arrives at `ready` starts:
    /// `ready` only if it is later by more than the tolerance, so an exact fit adds no bubble
    /// (whichever way ties are decided).
    pub fn start(self, free: f64, ready: f64) -> f64 {
        if ready > free + self.eps {
            ready
        } else {
            free
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_noise_is_equality_and_scales_with_the_unit() {
        let t = Tolerance::for_costs(1.0, 1.0, 1.0, 0.1);
        let a = 9.3;
        let b = 0.1 + 0.1 + 0.1 + 3.0 + 3.0 + 3.0; // 9.299999999999999 or 9.3, by summation order
        assert!(t.le(a, b) && t.le(b, a) && !t.lt(b, a) && !t.lt(a, b));
        assert_eq!(t.start(a, b), a);
        assert!(t.lt(9.2, 9.3));
        let t10 = Tolerance::for_costs(10.0, 10.0, 10.0, 1.0);
        assert!(t10.lt(92.0, 93.0) && t10.le(93.0, 93.0 + 1e-12));
        let lose = t.ties_lose();
        assert!(!lose.le(a, b) && lose.lt(a, b) && lose.le(9.2, 9.3) && !lose.lt(9.3, 9.2));
    }
}
