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
