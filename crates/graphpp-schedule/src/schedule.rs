//! A schedule: one program (list of steps) per rank, and its CSV / JSON / text forms.
//!
//! CSV (docs/ARCHITECTURE.md, "Schedule IR"): one row per rank, one cell per step, an empty cell is an idle
//! step; rows end in `\n` or `\r\n` (PyTorch writes `\r\n`). JSON: `{"ranks": [["0F0", null, …], …]}`.

use std::collections::BTreeMap;
use std::fmt;

use crate::action::{Action, ActionParseError, StageId};

/// Index of a rank (`0..p`).
pub type RankId = usize;

/// One step of a rank's program: an action, or `None` for an idle step.
pub type Step = Option<Action>;

/// A schedule: `ranks[r]` is rank `r`'s program in execution order.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Schedule {
    /// Per-rank programs; idle steps are `None`.
    pub ranks: Vec<Vec<Step>>,
}

/// A CSV cell that did not parse; `row` is the rank (0-based) and `column` the 1-based cell index.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rank {row} (line {}), cell {column}", .row + 1)]
pub struct CsvError {
    /// 0-based row, which is the rank.
    pub row: usize,
    /// 1-based cell index within the row (the step + 1).
    pub column: usize,
    /// The cell's parse error.
    #[source]
    pub source: ActionParseError,
}

impl Schedule {
    /// A schedule from per-rank programs without idle steps.
    pub fn from_programs(programs: Vec<Vec<Action>>) -> Self {
        Schedule { ranks: programs.into_iter().map(|p| p.into_iter().map(Some).collect()).collect() }
    }

    /// Number of ranks `p`.
    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Number of stages `S`: one more than the largest stage named by any action (0 if none).
    pub fn num_stages(&self) -> usize {
        self.actions().flat_map(|(_, a)| a.stages().collect::<Vec<_>>()).max().map_or(0, |s| s + 1)
    }

    /// Number of microbatches `m`: one more than the largest microbatch named (0 if none).
    pub fn num_microbatches(&self) -> usize {
        self.actions()
            .flat_map(|(_, a)| {
                let v: Vec<usize> = match a {
                    Action::Compute { task, .. } | Action::Comm { task, .. } => vec![task.mb],
                    Action::Overlap { f, b } => vec![f.mb, b.mb],
                    Action::StageOp { .. } => vec![],
                };
                v
            })
            .max()
            .map_or(0, |m| m + 1)
    }

    /// The route of microbatch `mb`: the contiguous range of stages it visits, from the smallest to
    /// the largest stage that any action names for it (`None` if no action names it).
    ///
    /// Every schedule but DualPipe routes all microbatches through `0..S`; DualPipe's two directions
    /// are stages `0..p` (microbatches `0..m/2`) and `p..2p` (microbatches `m/2..m`), V placement.
    pub fn route(&self, mb: usize) -> Option<std::ops::Range<StageId>> {
        self.routes().get(mb).cloned().flatten()
    }

    /// Routes of all microbatches in one pass (index = microbatch; see [`Schedule::route`]).
    pub fn routes(&self) -> Vec<Option<std::ops::Range<StageId>>> {
        crate::deps::routes_of(self.ranks.iter().flatten().flatten())
    }

    /// Every non-idle action with its rank, rank by rank in program order.
    pub fn actions(&self) -> impl Iterator<Item = (RankId, &Action)> {
        self.ranks.iter().enumerate().flat_map(|(r, p)| p.iter().flatten().map(move |a| (r, a)))
    }

    /// Rank `r`'s program without idle steps.
    pub fn program(&self, r: RankId) -> Vec<Action> {
        self.ranks[r].iter().flatten().copied().collect()
    }

    /// Rank `r`'s program as action text joined by spaces, idle steps removed (`0F0 0F1 0B0 …`).
    pub fn program_text(&self, r: RankId) -> String {
        self.ranks[r].iter().flatten().map(|a| a.to_string()).collect::<Vec<_>>().join(" ")
    }

    /// Stage → rank map as seen in the actions (stages that appear on several ranks map to all of
    /// them; [`crate::validate`] rejects that).
    pub fn placement(&self) -> BTreeMap<StageId, Vec<RankId>> {
        let mut map: BTreeMap<StageId, Vec<RankId>> = BTreeMap::new();
        for (r, a) in self.actions() {
            for s in a.stages() {
                let ranks = map.entry(s).or_default();
                if !ranks.contains(&r) {
                    ranks.push(r);
                }
            }
        }
        map
    }

    /// The same schedule with idle steps removed.
    pub fn compacted(&self) -> Schedule {
        Schedule::from_programs((0..self.num_ranks()).map(|r| self.program(r)).collect())
    }

    /// Keeps only the compute actions (F/B/I/W/OVERLAP_F_B), dropping comm and FSDP actions and idles.
    pub fn compute_only(&self) -> Schedule {
        Schedule::from_programs(
            self.ranks
                .iter()
                .map(|p| p.iter().flatten().filter(|a| a.is_compute()).copied().collect())
                .collect(),
        )
    }

    /// Parses CSV text: one row per rank, cells separated by `,`, empty cell = idle step. Trailing
    /// empty cells are kept as idle steps except on a fully empty last line (end of file).
    ///
    /// # Errors
    /// [`CsvError`] naming the row (rank) and cell of the first cell that does not parse.
    pub fn from_csv(text: &str) -> Result<Schedule, CsvError> {
        let mut lines: Vec<&str> = text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l)).collect();
        while lines.last().is_some_and(|l| l.is_empty()) {
            lines.pop();
        }
        let ranks = lines
            .iter()
            .enumerate()
            .map(|(row, line)| {
                line.split(',')
                    .enumerate()
                    .map(|(col, cell)| {
                        if cell.trim().is_empty() {
                            Ok(None)
                        } else {
                            cell.parse().map(Some).map_err(|source| CsvError { row, column: col + 1, source })
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Schedule { ranks })
    }

    /// Writes CSV with `\n` line ends (one row per rank, empty cell for idle steps).
    pub fn to_csv(&self) -> String {
        self.to_csv_with(",", "\n")
    }

    /// Writes CSV with the given separator and line end (`"\r\n"` reproduces PyTorch's files).
    pub fn to_csv_with(&self, sep: &str, eol: &str) -> String {
        let mut out = String::new();
        for p in &self.ranks {
            let cells: Vec<String> = p.iter().map(|s| s.map(|a| a.to_string()).unwrap_or_default()).collect();
            out.push_str(&cells.join(sep));
            out.push_str(eol);
        }
        out
    }

    /// JSON form `{"ranks": [["0F0", null, …], …]}`.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a schedule always serialises")
    }

    /// Parses the JSON form.
    ///
    /// # Errors
    /// The `serde_json` error (with line and column) for malformed JSON or a bad action string.
    pub fn from_json(text: &str) -> Result<Schedule, serde_json::Error> {
        serde_json::from_str(text)
    }
}

/// Text form: one line per rank, `rank r: 0F0 0F1 . 0B0` with `.` for idle steps.
impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (r, p) in self.ranks.iter().enumerate() {
            write!(f, "rank {r}:")?;
            for s in p {
                match s {
                    Some(a) => write!(f, " {a}")?,
                    None => write!(f, " .")?,
                }
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_round_trip_with_idles_and_crlf() {
        let text = "0F0,0F1,,0B0\r\n,1F0,1B0,\r\n";
        let s = Schedule::from_csv(text).unwrap();
        assert_eq!(s.ranks[0].len(), 4);
        assert_eq!(s.ranks[0][2], None);
        assert_eq!(s.ranks[1][3], None);
        assert_eq!(s.to_csv_with(",", "\r\n"), text);
        assert_eq!(Schedule::from_csv(&s.to_csv()).unwrap(), s);
        assert_eq!(s.num_stages(), 2);
        assert_eq!(s.num_microbatches(), 2);
    }

    #[test]
    fn csv_error_names_row_and_cell() {
        let e = Schedule::from_csv("0F0,0B0\n1F0,1BW0\n").unwrap_err();
        assert_eq!((e.row, e.column), (1, 2));
        assert_eq!(e.source.column, 3);
    }

    #[test]
    fn json_round_trip() {
        let s = Schedule::from_csv("0F0,,(0F1;1B0)OVERLAP_F_B\n1RECV_F0,1UNSHARD\n").unwrap();
        let j = s.to_json();
        assert!(j.contains("\"(0F1;1B0)OVERLAP_F_B\""));
        assert!(j.contains("null"));
        assert_eq!(Schedule::from_json(&j).unwrap(), s);
    }
}
