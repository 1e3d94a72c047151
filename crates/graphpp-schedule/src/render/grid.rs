//! Terminal grid: one row per rank, one column per time quantum, each cell labelled with the
//! microbatch (and coloured by kind with ANSI 24-bit colour when asked).

use std::fmt::Write;

use super::{category, count, rgb, short};
use crate::action::{Action, CommKind};
use crate::timeline::Timeline;

/// How to draw the grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GridStyle {
    /// ANSI colours (for a TTY).
    pub color: bool,
    /// At most this many columns; longer timelines are scaled down (several quanta per column).
    pub max_columns: usize,
}

impl Default for GridStyle {
    fn default() -> Self {
        GridStyle { color: false, max_columns: 400 }
    }
}

/// Short cell label: kind letter and microbatch, e.g. `F3`, `I12`, `7&3` for an overlap of F7 and B3,
/// `s`/`r`/`w` for SEND/RECV/WAIT_SEND, `g` for stage-level actions.
fn label(a: &Action) -> String {
    match a {
        Action::Compute { kind, task } => format!("{kind}{}", task.mb),
        Action::Overlap { f, b } => format!("{}&{}", f.mb, b.mb),
        Action::Comm { kind, .. } => match kind {
            CommKind::SendF | CommKind::SendB => "s",
            CommKind::RecvF | CommKind::RecvB => "r",
            CommKind::WaitSendF | CommKind::WaitSendB => "w",
        }
        .into(),
        Action::StageOp { .. } => "g".into(),
    }
}

/// Renders `t` as text. The quantum is the shortest non-zero interval, scaled up so the grid has at
/// most `style.max_columns` columns; zero-length actions (SEND/RECV) are not drawn. A legend line
/// gives the quantum. Each row is `rank r |cells|`.
pub fn grid(t: &Timeline, style: &GridStyle) -> String {
    let makespan = t.makespan();
    let mut quantum =
        t.intervals.iter().map(|i| i.end - i.start).filter(|d| *d > 1e-12).fold(f64::INFINITY, f64::min);
    if !quantum.is_finite() {
        return "(empty timeline)\n".into();
    }
    let mut cols = (makespan / quantum).ceil() as usize;
    if cols > style.max_columns {
        quantum = makespan / style.max_columns as f64;
        cols = style.max_columns;
    }
    let width = t.intervals.iter().map(|i| label(&i.action).len()).max().unwrap_or(1).max(1);
    let mut out = String::new();
    for (r, row) in t.by_rank().iter().enumerate() {
        let mut cells: Vec<Option<Action>> = vec![None; cols];
        for i in row.iter().filter(|i| i.end > i.start) {
            let a = (i.start / quantum + 1e-9).floor() as usize;
            let b = ((i.end / quantum) - 1e-9).ceil() as usize;
            for c in cells.iter_mut().take(b.min(cols)).skip(a) {
                *c = Some(i.action);
            }
        }
        let _ = write!(out, "rank {r:>2} |");
        for c in cells {
            match c {
                Some(a) => {
                    let text = format!("{:<width$}", label(&a));
                    if style.color {
                        let (rr, gg, bb) = rgb(category(&a));
                        let _ = write!(out, "\x1b[48;2;{rr};{gg};{bb}m\x1b[30m{text}\x1b[0m");
                    } else {
                        out.push_str(&text);
                    }
                }
                None => out.push_str(&format!("{:<width$}", ".")),
            }
            out.push('|');
        }
        out.push('\n');
    }
    let amount = |x: f64| {
        if t.unit == "unit" {
            count(x, "cost unit", "cost units")
        } else {
            format!("{} {}", short(x), t.unit)
        }
    };
    let _ = writeln!(out, "one column = {}; makespan {}", amount(quantum), amount(makespan));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::Interval;

    #[test]
    fn cells_follow_durations() {
        let t = Timeline {
            ranks: 2,
            comm: Vec::new(),
            unit: "unit".into(),
            intervals: vec![
                Interval { rank: 0, start: 0.0, end: 1.0, action: Action::f(0, 0) },
                Interval { rank: 0, start: 3.0, end: 5.0, action: Action::b(0, 0) },
                Interval { rank: 1, start: 1.0, end: 2.0, action: Action::f(1, 0) },
                Interval {
                    rank: 1,
                    start: 2.0,
                    end: 3.0,
                    action: Action::comm(crate::CommKind::SendB, 1, 0),
                },
            ],
        };
        let g = grid(&t, &GridStyle::default());
        let lines: Vec<&str> = g.lines().collect();
        assert_eq!(lines[0], "rank  0 |F0|. |. |B0|B0|");
        assert_eq!(lines[1], "rank  1 |. |F0|s |. |. |");
        assert_eq!(lines[2], "one column = 1 cost unit; makespan 5 cost units");
    }
}
