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

/// Short cell label: kind letter and microbatch, e.g. `F3`, `I12` — with the stage first
/// (`0F3`, `3F3`, as the action text) when `staged`, where a rank holds several stages —, `7&3`
/// for an overlap of F7 and B3, `s`/`r`/`w` for SEND/RECV/WAIT_SEND, `g` for stage-level actions.
fn label(a: &Action, staged: bool) -> String {
    match a {
        Action::Compute { kind, task } if staged => format!("{}{kind}{}", task.stage, task.mb),
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
/// gives the quantum. Each row is `rank r |cells|`; where a rank computes on more than one stage
/// (interleaved, V and DualPipe schedules) the cells name the stage too.
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
    let staged = several_stages_per_rank(t);
    let width = t.intervals.iter().map(|i| label(&i.action, staged).len()).max().unwrap_or(1).max(1);
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
                    let text = format!("{:<width$}", label(&a, staged));
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

/// Whether some rank of `t` computes on more than one stage.
fn several_stages_per_rank(t: &Timeline) -> bool {
    let mut first = std::collections::HashMap::new();
    t.intervals.iter().any(|i| match i.action {
        Action::Compute { task, .. } => *first.entry(i.rank).or_insert(task.stage) != task.stage,
        _ => false,
    })
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

    /// A rank holding stages 0 and 3 (a V placement) labels each cell with its stage, so F0 of
    /// stage 0 and F0 of stage 3 differ.
    #[test]
    fn cells_name_the_stage_where_a_rank_holds_several() {
        let at = |start: f64, action| Interval { rank: 0, start, end: start + 1.0, action };
        let t = Timeline {
            ranks: 1,
            comm: Vec::new(),
            unit: "unit".into(),
            intervals: vec![at(0.0, Action::f(0, 0)), at(1.0, Action::f(3, 0))],
        };
        let g = grid(&t, &GridStyle::default());
        assert_eq!(g.lines().next().unwrap(), "rank  0 |0F0|3F0|");
    }
}
