//! Per-action costs and the activation-memory model shared by generators (ZB auto) and the simulator.
//!
//! Units are arbitrary time units (docs/ARCHITECTURE.md uses T_F = T_I = T_W = 1, so T_B = 2) and activation
//! units of one full stage's M_B.

use std::fmt;
use std::str::FromStr;

/// Durations of each action kind and the cross-rank hop latency `c`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Costs {
    /// T_F: forward of one (stage, microbatch).
    pub f: f64,
    /// T_B: full backward (input + weight gradients).
    pub b: f64,
    /// T_I: input-gradient backward.
    pub i: f64,
    /// T_W: weight-gradient backward.
    pub w: f64,
    /// T_overlap: one OVERLAP_F_B; `None` means T_F + T_B (docs/ARCHITECTURE.md, "Simulation").
    pub overlap: Option<f64>,
    /// c: latency of one cross-rank hop (SEND→RECV on different ranks).
    pub comm: f64,
    /// Duration of SEND/RECV/UNSHARD/RESHARD/REDUCE_GRAD actions themselves (default 0).
    pub comm_action: f64,
}

impl Default for Costs {
    /// T_F = T_I = T_W = 1, T_B = 2, c = 0 (docs/ARCHITECTURE.md reference costs).
    fn default() -> Self {
        Costs { f: 1.0, b: 2.0, i: 1.0, w: 1.0, overlap: None, comm: 0.0, comm_action: 0.0 }
    }
}

impl Costs {
    /// T_overlap, defaulting to T_F + T_B.
    pub fn overlap(&self) -> f64 {
        self.overlap.unwrap_or(self.f + self.b)
    }

    /// Checks every duration and the hop latency with [`check_cost`].
    ///
    /// # Errors
    /// [`CostError`] naming the first bad one by its `--costs` key (`F`, `B`, `I`, `W`, `OVERLAP`,
    /// `C`; `comm_action` is `COMM_ACTION`).
    pub fn check(&self) -> Result<(), CostError> {
        let named = [("F", self.f), ("B", self.b), ("I", self.i), ("W", self.w), ("C", self.comm)];
        for (name, v) in named.into_iter().chain(self.overlap.map(|o| ("OVERLAP", o))) {
            check_cost(name, v)?;
        }
        check_cost("COMM_ACTION", self.comm_action)?;
        Ok(())
    }

    /// These costs with the hop latency `c` set to `latency` (`--comm-latency`), checked with
    /// [`check_cost`] under the name `name`.
    ///
    /// # Errors
    /// [`CostError`] when `latency` is not a finite number in `0..=MAX_COST`.
    pub fn with_comm_latency(self, name: &str, latency: f64) -> Result<Costs, CostError> {
        Ok(Costs { comm: check_cost(name, latency)?, ..self })
    }
}

/// Largest accepted cost or latency, in cost units: 10^9 (a nanosecond clock's second). Costs are
/// relative durations, so any real ratio fits; the bound keeps makespans (at most
/// [`crate::generate::MAX_ACTIONS`] actions of this cost) far from overflow and printable.
pub const MAX_COST: f64 = 1e9;

/// A cost (`--costs` entry or `--comm-latency`) that cannot be a duration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{name} = {}: {problem}", value_text(*.value))]
pub struct CostError {
    /// The `--costs` key or the flag.
    pub name: String,
    /// The value given.
    pub value: f64,
    /// What is wrong.
    pub problem: CostProblem,
}

/// What is wrong with a cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CostProblem {
    /// NaN or ±infinity.
    #[error("a cost must be a finite number")]
    NotFinite,
    /// Below 0 (a negative latency would let an action start before its input exists).
    #[error("a cost must be >= 0 (a duration or a latency)")]
    Negative,
    /// Above [`MAX_COST`].
    #[error("a cost must be at most 1e9 cost units (costs are relative; scale them down)")]
    TooLarge,
}

/// A cost as given, in scientific notation when fixed notation would run long (`1e300`).
fn value_text(v: f64) -> String {
    if v.is_finite() && v != 0.0 && (v.abs() >= 1e9 || v.abs() < 1e-3) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// `value` if it is a usable duration or latency: finite, `>= 0` and at most [`MAX_COST`].
///
/// # Errors
/// [`CostError`] naming `name` and the [`CostProblem`].
pub fn check_cost(name: &str, value: f64) -> Result<f64, CostError> {
    let problem = if !value.is_finite() {
        CostProblem::NotFinite
    } else if value < 0.0 {
        CostProblem::Negative
    } else if value > MAX_COST {
        CostProblem::TooLarge
    } else {
        return Ok(value);
    };
    Err(CostError { name: name.to_string(), value, problem })
}

/// A malformed `--costs` string.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad costs `{text}`: {message} (expected e.g. `F=1,B=2,I=1,W=1,OVERLAP=3,C=0`)")]
pub struct CostsParseError {
    /// The whole input.
    pub text: String,
    /// What is wrong.
    pub message: String,
}

impl FromStr for Costs {
    type Err = CostsParseError;

    /// Parses `F=1,B=2,I=1,W=1[,OVERLAP=3][,C=0.1]`: keys case-insensitive, any non-empty
    /// subset, each at most once; every value must pass [`check_cost`]. The rest keep their
    /// defaults, except that the backward's three costs keep B = I + W (B is the full backward,
    /// I and W its halves): two of them give the third, B alone is split evenly, and three that
    /// disagree are refused.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |m: String| CostsParseError { text: s.to_string(), message: m };
        let mut c = Costs::default();
        let mut seen: Vec<&'static str> = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| err(format!("`{part}` is not KEY=VALUE")))?;
            let key = match k.trim().to_ascii_uppercase().as_str() {
                "F" => "F",
                "B" => "B",
                "I" => "I",
                "W" => "W",
                "OVERLAP" | "F&B" | "FB" => "OVERLAP",
                "C" | "COMM" => "C",
                other => return Err(err(format!("unknown key `{other}`"))),
            };
            if seen.contains(&key) {
                return Err(err(format!("{key} is given twice (`{part}`); give each cost once")));
            }
            seen.push(key);
            let v: f64 = v.trim().parse().map_err(|_| err(format!("`{}` is not a number", v.trim())))?;
            let v = check_cost(key, v).map_err(|e| err(e.to_string()))?;
            match key {
                "F" => c.f = v,
                "B" => c.b = v,
                "I" => c.i = v,
                "W" => c.w = v,
                "OVERLAP" => c.overlap = Some(v),
                _ => c.comm = v,
            }
        }
        if seen.is_empty() {
            return Err(err("no cost given: give at least one KEY=VALUE".into()));
        }
        let given = |k: &str| seen.contains(&k);
        c.backward_halves(given("B"), given("I"), given("W")).map_err(err)?;
        Ok(c)
    }
}

impl Costs {
    /// Makes B = I + W from the ones given (see [`Costs::from_str`]). Errors: a half larger
    /// than B, or three that disagree beyond rounding, as text.
    fn backward_halves(&mut self, b: bool, i: bool, w: bool) -> Result<(), String> {
        let too_large =
            |half: &str, v: f64| format!("{half}={v} exceeds B={}: B is the full backward, I + W", self.b);
        match (b, i, w) {
            (false, _, _) => self.b = self.i + self.w,
            (true, false, false) => (self.i, self.w) = (self.b / 2.0, self.b / 2.0),
            (true, true, false) if self.i > self.b => return Err(too_large("I", self.i)),
            (true, true, false) => self.w = self.b - self.i,
            (true, false, true) if self.w > self.b => return Err(too_large("W", self.w)),
            (true, false, true) => self.i = self.b - self.w,
            (true, true, true) => {
                let sum = self.i + self.w;
                if (self.b - sum).abs() > 1e-9 * self.b.max(sum).max(1.0) {
                    return Err(format!(
                        "B={} but I + W = {sum}: give two of B, I and W (B = I + W gives the third) or three that agree",
                        self.b
                    ));
                }
            }
        }
        Ok(())
    }
}

impl fmt::Display for Costs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "F={},B={},I={},W={},OVERLAP={},C={}",
            self.f,
            self.b,
            self.i,
            self.w,
            self.overlap(),
            self.comm
        )
    }
}

/// Activation memory of one full stage's (stage, microbatch): `m_b` held from F until B (or I),
/// `m_w` still held between I and W (`m_w < m_b`). docs/ARCHITECTURE.md glossary "M_B, M_W".
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Memory {
    /// M_B.
    pub m_b: f64,
    /// M_W.
    pub m_w: f64,
}

impl Memory {
    /// M_B = 1 and M_W = `m_w` (a fraction of M_B), or `None` when `m_w` is not within [0, 1]
    /// (the front ends word the error with their own flag names).
    pub fn with_m_w(m_w: f64) -> Option<Memory> {
        (0.0..=1.0).contains(&m_w).then_some(Memory { m_b: 1.0, m_w })
    }
}

impl Default for Memory {
    /// M_B = 1 (the unit), M_W = 0.5.
    fn default() -> Self {
        Memory { m_b: 1.0, m_w: 0.5 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_subsets_and_rejects_junk() {
        let c: Costs = "F=1,I=2,W=3".parse().unwrap();
        assert_eq!((c.f, c.b, c.i, c.w, c.overlap()), (1.0, 5.0, 2.0, 3.0, 6.0));
        let c: Costs = "f=2,b=3,c=0.5,overlap=4".parse().unwrap();
        assert_eq!((c.f, c.b, c.comm, c.overlap()), (2.0, 3.0, 0.5, 4.0));
        assert_eq!((c.i, c.w), (1.5, 1.5), "B alone is split evenly");
        assert!("F=x".parse::<Costs>().unwrap_err().message.contains("not a number"));
        assert!("Q=1".parse::<Costs>().unwrap_err().message.contains("unknown key"));
        assert!("F=-1".parse::<Costs>().is_err());
    }

    /// B = I + W whichever two are given; a half above B, three that disagree and an empty
    /// string are refused.
    #[test]
    fn the_backward_is_its_two_halves() {
        let c: Costs = "F=1,B=2,W=1.4".parse().unwrap();
        assert!((c.i - 0.6).abs() < 1e-12 && c.b == 2.0, "{c}");
        let c: Costs = "B=3,I=1".parse().unwrap();
        assert_eq!((c.b, c.i, c.w), (3.0, 1.0, 2.0));
        let c: Costs = "B=2,I=0.5,W=1.5".parse().unwrap();
        assert_eq!((c.b, c.i, c.w), (2.0, 0.5, 1.5));
        for (text, says) in [
            ("F=1,B=2,W=3", "W=3 exceeds B=2"),
            ("B=1,I=2", "I=2 exceeds B=1"),
            ("F=1,B=2,I=1,W=1.4", "B=2 but I + W = 2.4"),
            ("", "no cost given"),
            (" , ", "no cost given"),
        ] {
            let e = text.parse::<Costs>().unwrap_err();
            assert!(e.message.contains(says), "{text:?}: {e}");
        }
    }

    #[test]
    fn a_cost_given_twice_is_refused() {
        for text in ["F=1,F=2", "c=1,COMM=2", "OVERLAP=3,F&B=4", "b=2,B=2"] {
            let e = text.parse::<Costs>().unwrap_err();
            assert!(e.message.contains("given twice"), "{text}: {e}");
        }
    }

    #[test]
    fn costs_are_finite_non_negative_and_bounded() {
        let e = "F=1e300".parse::<Costs>().unwrap_err();
        assert!(e.message.starts_with("F = 1e300: ") && e.message.len() < 120, "printed short: {e}");
        for (text, problem) in [
            ("F=1e300", CostProblem::TooLarge),
            ("C=-1", CostProblem::Negative),
            ("W=nan", CostProblem::NotFinite),
            ("B=inf", CostProblem::NotFinite),
        ] {
            let e = text.parse::<Costs>().unwrap_err();
            assert!(e.message.contains(&problem.to_string()), "{text}: {e}");
        }
        assert_eq!("F=1e9".parse::<Costs>().unwrap().f, MAX_COST);
        let e = Costs::default().with_comm_latency("--comm-latency", -1.0).unwrap_err();
        assert_eq!((e.name.as_str(), e.problem), ("--comm-latency", CostProblem::Negative));
        assert_eq!(e.to_string(), "--comm-latency = -1: a cost must be >= 0 (a duration or a latency)");
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let e = Costs::default().with_comm_latency("c", bad).unwrap_err();
            assert_eq!(e.problem, CostProblem::NotFinite, "{bad}");
        }
        assert_eq!(Costs::default().with_comm_latency("c", 0.5).unwrap().comm, 0.5);
        let c = Costs { overlap: Some(f64::NAN), ..Costs::default() };
        assert_eq!(c.check().unwrap_err().name, "OVERLAP");
        assert!(Costs::default().check().is_ok());
    }
}
