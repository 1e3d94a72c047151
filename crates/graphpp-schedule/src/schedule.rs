//! A schedule: one program (list of steps) per rank, and its CSV / JSON / text forms.
//!
//! CSV (docs/ARCHITECTURE.md, "Schedule IR"): one row per rank, one cell per step, an empty cell is an idle
//! step; rows end in `\n` or `\r\n` (PyTorch writes `\r\n`). Cells may be quoted as spreadsheets
//! write them (RFC 4180: `"0F0"`, a `""` inside a quoted cell is one `"`, a quoted cell may hold `,`
//! and line breaks), which PyTorch's loader (`csv.reader`) reads too; a UTF-8 byte-order mark at the
//! start is skipped. JSON: `{"ranks": [["0F0", null, …], …]}`. [`Schedule::parse`] tells the two
//! apart.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use crate::action::{Action, ActionParseError, StageId};

/// Index of a rank (`0..p`).
pub type RankId = usize;

/// One step of a rank's program: an action, or `None` for an idle step.
pub type Step = Option<Action>;

/// The UTF-8 byte-order mark some editors and spreadsheets put at the start of a file.
const BOM: char = '\u{feff}';

/// A schedule: `ranks[r]` is rank `r`'s program in execution order. Its JSON form has the one
/// key `ranks`; another key is refused (a misspelt `"rank"` would otherwise read as no ranks).
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Schedule {
    /// Per-rank programs; idle steps are `None`.
    pub ranks: Vec<Vec<Step>>,
}

/// A CSV cell that did not parse: `row` is the rank (0-based), `line` the 1-based line of the file
/// the cell starts on (it differs from `row + 1` only after a quoted cell holding a line break) and
/// `column` the 1-based cell index in the row.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rank {row} (line {line}), cell {column}")]
pub struct CsvError {
    /// 0-based row, which is the rank.
    pub row: usize,
    /// 1-based line of the file where the cell starts.
    pub line: usize,
    /// 1-based cell index within the row (the step + 1).
    pub column: usize,
    /// What is wrong with the cell.
    #[source]
    pub problem: CsvProblem,
}

/// What is wrong with a CSV cell.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CsvProblem {
    /// The cell's text is not an action.
    #[error(transparent)]
    Action(#[from] ActionParseError),
    /// A quoted cell whose closing `"` never comes.
    #[error("the quoted cell has no closing `\"`")]
    UnclosedQuote,
    /// Text between a quoted cell's closing `"` and the next `,` or line end.
    #[error("text `{0}` after the closing `\"` of a quoted cell (a `\"` inside quotes is written `\"\"`)")]
    AfterQuote(String),
}

/// Why a schedule file's text did not parse, in the format [`Schedule::parse`] recognised.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleParseError {
    /// JSON text (first character `{` or `[`) that is not a JSON schedule.
    #[error("bad JSON schedule: {source}{hint}")]
    Json {
        /// serde_json's error, with line and column.
        source: serde_json::Error,
        /// Empty, or how a JSON schedule looks when the text is not a JSON object.
        hint: &'static str,
    },
    /// CSV text with a cell that does not parse.
    #[error("bad CSV schedule: {0}")]
    Csv(#[from] CsvError),
}

/// What [`ScheduleParseError::Json`] adds when the JSON is not an object.
const JSON_HINT: &str = " (a JSON schedule is an object: {\"ranks\": [[\"0F0\", null, …], …]})";

/// One cell of CSV text: its text with quotes resolved, and the 1-based line it starts on.
struct Cell<'a> {
    text: Cow<'a, str>,
    line: usize,
}

/// Splits CSV text into rows of cells (RFC 4180 quoting, `\n` or `\r\n` line ends). A final line
/// end does not start another row. Errors: (row, line, cell, problem) of a malformed quoted cell.
fn csv_cells(text: &str) -> Result<Vec<Vec<Cell<'_>>>, CsvError> {
    let mut rows = Vec::new();
    let mut row: Vec<Cell<'_>> = Vec::new();
    let mut line = 1;
    let mut rest = text;
    loop {
        let start_line = line;
        let fail = |row_cells: &Vec<Cell<'_>>, rows: &Vec<Vec<Cell<'_>>>, problem| CsvError {
            row: rows.len(),
            line: start_line,
            column: row_cells.len() + 1,
            problem,
        };
        let cell = if let Some(quoted) = rest.strip_prefix('"') {
            let mut value = String::new();
            let mut inner = quoted;
            loop {
                let Some(q) = inner.find('"') else {
                    return Err(fail(&row, &rows, CsvProblem::UnclosedQuote));
                };
                value.push_str(&inner[..q]);
                line += inner[..q].matches('\n').count();
                inner = &inner[q + 1..];
                match inner.strip_prefix('"') {
                    Some(after) => {
                        value.push('"');
                        inner = after;
                    }
                    None => break,
                }
            }
            let end = inner.find([',', '\n']).unwrap_or(inner.len());
            let junk = &inner[..end];
            let at_line_end = inner[end..].starts_with('\n') || end == inner.len();
            if !(junk.is_empty() || (junk == "\r" && at_line_end)) {
                return Err(fail(&row, &rows, CsvProblem::AfterQuote(junk.to_string())));
            }
            rest = &inner[end..];
            Cow::Owned(value)
        } else {
            let end = rest.find([',', '\n']).unwrap_or(rest.len());
            let mut value = &rest[..end];
            if !rest[end..].starts_with(',') {
                value = value.strip_suffix('\r').unwrap_or(value);
            }
            rest = &rest[end..];
            Cow::Borrowed(value)
        };
        row.push(Cell { text: cell, line: start_line });
        if let Some(after) = rest.strip_prefix(',') {
            rest = after;
        } else {
            rows.push(std::mem::take(&mut row));
            match rest.strip_prefix('\n') {
                Some(after) if !after.is_empty() => {
                    rest = after;
                    line += 1;
                }
                _ => return Ok(rows),
            }
        }
    }
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
        crate::route::routes_of(self.ranks.iter().flatten().flatten())
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

    /// Parses CSV text: one row per rank, cells separated by `,`, empty cell = idle step, quoted
    /// cells and a leading byte-order mark allowed (see the module docs). Trailing empty cells are
    /// kept as idle steps; empty lines at the end of the text are dropped.
    ///
    /// # Errors
    /// [`CsvError`] naming the row (rank), line and cell of the first cell that does not parse.
    pub fn from_csv(text: &str) -> Result<Schedule, CsvError> {
        let text = text.strip_prefix(BOM).unwrap_or(text);
        let mut rows = csv_cells(text)?;
        while rows.last().is_some_and(|r| r.len() == 1 && r[0].text.is_empty()) {
            rows.pop();
        }
        let ranks = rows
            .iter()
            .enumerate()
            .map(|(row, cells)| {
                cells
                    .iter()
                    .enumerate()
                    .map(|(col, cell)| {
                        if cell.text.trim().is_empty() {
                            Ok(None)
                        } else {
                            cell.text.parse().map(Some).map_err(|e| CsvError {
                                row,
                                line: cell.line,
                                column: col + 1,
                                problem: CsvProblem::Action(e),
                            })
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Schedule { ranks })
    }

    /// Parses a schedule file's text: JSON when its first character that is not whitespace (after
    /// a byte-order mark) is `{` or `[`, else CSV.
    ///
    /// # Errors
    /// [`ScheduleParseError::Json`] (with a hint when the JSON is not an object) or
    /// [`ScheduleParseError::Csv`].
    pub fn parse(text: &str) -> Result<Schedule, ScheduleParseError> {
        let body = text.strip_prefix(BOM).unwrap_or(text).trim_start();
        if body.starts_with(['{', '[']) {
            Schedule::from_json(body).map_err(|source| ScheduleParseError::Json {
                source,
                hint: if body.starts_with('{') { "" } else { JSON_HINT },
            })
        } else {
            Ok(Schedule::from_csv(text)?)
        }
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
        serde_json::from_str(text.strip_prefix(BOM).unwrap_or(text))
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
        assert_eq!((e.row, e.line, e.column), (1, 2, 2));
        let CsvProblem::Action(a) = &e.problem else { panic!("{e:?}") };
        assert_eq!(a.column, 3);
        // The same junk inside quotes: still an error, at the same cell.
        let e = Schedule::from_csv("\"0F0\",\"0B0\"\r\n\"1F0\",\"1BW0\"\r\n").unwrap_err();
        assert_eq!((e.row, e.line, e.column), (1, 2, 2));
        assert!(matches!(&e.problem, CsvProblem::Action(a) if a.column == 3 && a.text == "1BW0"), "{e:?}");
    }

    #[test]
    fn quoted_cells_follow_csv_rules() {
        let plain = Schedule::from_csv("0F0,0F1,,0B0\n,1F0,1B0,\n").unwrap();
        let quoted = "\"0F0\",\"0F1\",\"\",\"0B0\"\r\n\"\",\"1F0\",\"1B0\",\"\"\r\n";
        assert_eq!(Schedule::from_csv(quoted).unwrap(), plain);
        // A quoted cell may hold a comma or a line break: one cell, and lines are counted.
        let e = Schedule::from_csv("0F0,\"a,\nb\",0B0\n1F0,1X0\n").unwrap_err();
        assert_eq!((e.row, e.line, e.column), (0, 1, 2));
        assert!(matches!(&e.problem, CsvProblem::Action(a) if a.text == "a,\nb"), "{e:?}");
        let e = Schedule::from_csv("\"0F0\",\"0F1\n\"\n1F0,1X0\n").unwrap_err();
        assert_eq!((e.row, e.line, e.column), (1, 3, 2), "{e:?}");
        // `""` inside quotes is one `"`.
        let e = Schedule::from_csv("\"0F\"\"0\"\n").unwrap_err();
        assert!(matches!(&e.problem, CsvProblem::Action(a) if a.text == "0F\"0"), "{e:?}");
        // Malformed quoting names the cell.
        let e = Schedule::from_csv("0F0,\"0F1\n").unwrap_err();
        assert_eq!((e.row, e.line, e.column, e.problem), (0, 1, 2, CsvProblem::UnclosedQuote));
        let e = Schedule::from_csv("0F0\n1F0,\"1B0\"x,1F1\n").unwrap_err();
        assert_eq!((e.row, e.column), (1, 2));
        assert_eq!(e.problem, CsvProblem::AfterQuote("x".into()));
    }

    #[test]
    fn byte_order_mark_is_skipped() {
        let s = Schedule::from_csv("\u{feff}0F0,0B0\n1F0,1B0\n").unwrap();
        assert_eq!(s, Schedule::from_csv("0F0,0B0\n1F0,1B0\n").unwrap());
        assert_eq!(Schedule::parse("\u{feff}0F0,0B0\n").unwrap().ranks[0].len(), 2);
        assert_eq!(Schedule::parse(&format!("\u{feff}{}", s.to_json())).unwrap(), s);
    }

    #[test]
    fn parse_tells_json_from_csv() {
        let s = Schedule::from_csv("0F0,,0B0\n").unwrap();
        assert_eq!(Schedule::parse(&format!("  \n{}", s.to_json())).unwrap(), s);
        assert_eq!(Schedule::parse(&s.to_csv()).unwrap(), s);
        let e = Schedule::parse("[[\"0F0\", null]]").unwrap_err();
        assert!(matches!(e, ScheduleParseError::Json { hint: JSON_HINT, .. }), "{e:?}");
        let text = e.to_string();
        assert!(text.starts_with("bad JSON schedule: ") && text.contains("{\"ranks\": [["), "{text}");
        let e = Schedule::parse("{\"ranks\": [[\"0X0\"]]}").unwrap_err();
        assert!(matches!(e, ScheduleParseError::Json { hint: "", .. }), "{e:?}");
        assert!(matches!(Schedule::parse("0F0,0X0\n"), Err(ScheduleParseError::Csv(_))));
    }

    /// A key other than `ranks` is refused, naming it (it was read as no schedule at all, or
    /// beside one, silently).
    #[test]
    fn json_with_an_unknown_key_is_refused() {
        let e = Schedule::from_json(r#"{"ranks": [["0F0", "0B0"]], "microbatches": 4}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `microbatches`"), "{e}");
        let e = Schedule::parse(r#"{"rank": [["0F0", "0B0"]]}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `rank`"), "{e}");
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
