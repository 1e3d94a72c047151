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

    /// Parses `F=1,B=2,I=1,W=1[,OVERLAP=3][,C=0.1]` (keys case-insensitive, any subset; the rest keep
    /// their defaults, except that a given I and W without B set B = I + W).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |m: String| CostsParseError { text: s.to_string(), message: m };
        let mut c = Costs::default();
        let mut b_given = false;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| err(format!("`{part}` is not KEY=VALUE")))?;
            let v: f64 = v.trim().parse().map_err(|_| err(format!("`{v}` is not a number")))?;
            if !(v.is_finite() && v >= 0.0) {
                return Err(err(format!("`{part}`: costs must be finite and >= 0")));
            }
            match k.trim().to_ascii_uppercase().as_str() {
                "F" => c.f = v,
                "B" => {
                    c.b = v;
                    b_given = true
                }
                "I" => c.i = v,
                "W" => c.w = v,
                "OVERLAP" | "F&B" | "FB" => c.overlap = Some(v),
                "C" | "COMM" => c.comm = v,
                other => return Err(err(format!("unknown key `{other}`"))),
            }
        }
        if !b_given {
            c.b = c.i + c.w;
        }
        Ok(c)
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
        assert!("F=x".parse::<Costs>().unwrap_err().message.contains("not a number"));
        assert!("Q=1".parse::<Costs>().unwrap_err().message.contains("unknown key"));
        assert!("F=-1".parse::<Costs>().is_err());
    }
}
