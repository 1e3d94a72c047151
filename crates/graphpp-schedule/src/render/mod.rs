//! Timeline renderers (docs/ARCHITECTURE.md, "Renderers"): a terminal grid, SVG, and Chrome trace JSON. Each
//! draws any [`Timeline`](crate::timeline::Timeline), simulated or measured.

mod chrome;
mod grid;
mod svg;

pub use chrome::chrome_trace;
pub use grid::{grid, GridStyle};
pub use svg::svg;

use crate::action::{Action, ComputeKind};

/// `s` with the five XML/HTML special characters (`& < > " '`) replaced by entities, for text and
/// attribute values of SVG and HTML output.
pub fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `x` with `decimals` decimals, or in scientific notation (`1.2346e12`) from 10^9 on, where fixed
/// notation stops being readable (costs are at most [`crate::costs::MAX_COST`], makespans sums of them).
pub fn fixed(x: f64, decimals: usize) -> String {
    if x.is_finite() && x.abs() >= 1e9 {
        format!("{x:.4e}")
    } else {
        format!("{x:.decimals$}")
    }
}

/// `x` in at most 4 decimals with trailing zeros dropped (`1`, `0.5`, `0.3333`), scientific from
/// 10^9 on and below 10^-3 (`1e-6`).
pub fn short(x: f64) -> String {
    if x != 0.0 && x.is_finite() && (x.abs() >= 1e9 || x.abs() < 1e-3) {
        let s = format!("{x:.3e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
        return format!("{mantissa}e{exp}");
    }
    let s = format!("{x:.4}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// `"{n} {noun}"` with the noun in the plural unless `n` is exactly 1 (`1 step`, `0 steps`,
/// `2.5 cost units`); `n` is shown with [`short`].
pub fn count(n: f64, one: &str, many: &str) -> String {
    format!("{} {}", short(n), if n == 1.0 { one } else { many })
}

/// The category of an action for colouring and trace grouping: `F`, `B`, `I`, `W`, `F&B`, `comm`
/// or `fsdp`.
pub fn category(a: &Action) -> &'static str {
    match a {
        Action::Compute { kind, .. } => match kind {
            ComputeKind::F => "F",
            ComputeKind::B => "B",
            ComputeKind::I => "I",
            ComputeKind::W => "W",
        },
        Action::Overlap { .. } => "F&B",
        Action::Comm { .. } => "comm",
        Action::StageOp { .. } => "fsdp",
    }
}

/// RGB colour per category (shared by SVG and the terminal grid).
fn rgb(category: &str) -> (u8, u8, u8) {
    match category {
        "F" => (91, 155, 213),
        "B" => (237, 125, 49),
        "I" => (255, 192, 0),
        "W" => (112, 173, 71),
        "F&B" => (165, 105, 189),
        "comm" => (180, 180, 180),
        _ => (120, 120, 120),
    }
}

/// The figures block of `graphpp schedule simulate --format text`: makespan, both bubble
/// ratios, busy and idle time per rank, peak in-flight activations per rank (M_B units); times
/// in the report's unit.
pub fn figures(r: &crate::simulate::SimReport) -> String {
    let fmt = |v: &[f64]| v.iter().map(|&x| fixed(x, 3)).collect::<Vec<_>>().join(" ");
    format!(
        "makespan            {}\n\
         bubble (in-iteration) r_bubble = {:.4}, idle fraction = {:.2}%\n\
         bubble (steady-state) r_bubble = {:.4}\n\
         busy per rank       {}\n\
         idle per rank       {}\n\
         peak activations    {} (M_B units)\n",
        fixed(r.makespan, 3),
        r.bubble_ratio,
        r.idle_fraction * 100.0,
        r.steady_bubble_ratio,
        fmt(&r.busy),
        fmt(&r.idle),
        fmt(&r.peak_activations),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_print_short_and_plurals_agree() {
        assert_eq!(fixed(27.0, 3), "27.000");
        assert_eq!(fixed(1e300, 3), "1.0000e300");
        assert_eq!(short(1.0), "1");
        assert_eq!(short(0.5), "0.5");
        assert_eq!(short(1.0 / 3.0), "0.3333");
        assert_eq!(short(1e300), "1e300");
        assert_eq!(short(2.5e-6), "2.5e-6");
        assert_eq!(count(1.0, "cost unit", "cost units"), "1 cost unit");
        assert_eq!(count(27.0, "cost unit", "cost units"), "27 cost units");
        assert_eq!(count(0.0, "step", "steps"), "0 steps");
    }
}
