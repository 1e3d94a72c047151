//! CSV as spreadsheets and PyTorch write it: a schedule printed to CSV and then edited the way a
//! spreadsheet saves it (every cell quoted, `\r\n` line ends, a UTF-8 byte-order mark) or the way
//! people type overlapped pairs (`(0F3; 3B1)OVERLAP_F_B`) parses back to the same schedule; junk
//! stays an error naming the rank and cell.

use graphpp_schedule::{
    generate, lower, Action, CommKind, ComputeKind, CsvProblem, Kind, LowerOptions, Options, Schedule, Shape,
    StageOpKind, Task,
};
use proptest::prelude::*;

/// How a CSV text is edited before it is parsed again.
#[derive(Debug, Clone, Copy)]
struct Edit {
    quote: bool,
    crlf: bool,
    bom: bool,
    overlap_spaces: bool,
}

/// `csv` (as [`Schedule::to_csv`] writes it) after `e`.
fn edited(csv: &str, e: Edit) -> String {
    let mut out = String::new();
    if e.bom {
        out.push('\u{feff}');
    }
    for line in csv.lines() {
        let cells: Vec<String> = line
            .split(',')
            .map(|c| {
                let c = if e.overlap_spaces {
                    c.replace('(', "( ").replace(';', " ;  ").replace(')', "\t)")
                } else {
                    c.to_string()
                };
                if e.quote {
                    format!("\"{}\"", c.replace('"', "\"\""))
                } else {
                    c
                }
            })
            .collect();
        out.push_str(&cells.join(","));
        out.push_str(if e.crlf { "\r\n" } else { "\n" });
    }
    out
}

fn edit() -> impl Strategy<Value = Edit> {
    (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>())
        .prop_map(|(quote, crlf, bom, overlap_spaces)| Edit { quote, crlf, bom, overlap_spaces })
}

fn action() -> impl Strategy<Value = Action> {
    let kinds = [ComputeKind::F, ComputeKind::B, ComputeKind::I, ComputeKind::W];
    let comms = [CommKind::SendF, CommKind::RecvF, CommKind::SendB, CommKind::RecvB];
    let ops = [StageOpKind::Unshard, StageOpKind::Reshard, StageOpKind::ReduceGrad];
    prop_oneof![
        (prop::sample::select(kinds.to_vec()), 0usize..40, 0usize..40)
            .prop_map(|(k, s, m)| Action::compute(k, s, m)),
        (0usize..40, 0usize..40, 0usize..40, 0usize..40)
            .prop_map(|(a, b, c, d)| Action::overlap(Task::new(a, b), Task::new(c, d))),
        (prop::sample::select(comms.to_vec()), 0usize..40, 0usize..40)
            .prop_map(|(k, s, m)| Action::comm(k, s, m)),
        (prop::sample::select(ops.to_vec()), 0usize..40).prop_map(|(k, s)| Action::stage_op(k, s)),
    ]
}

/// Any schedule CSV can hold: rows of actions and idle steps, every row with one action at least
/// (a row of one idle step is an empty line, which ends the file when it comes last).
fn schedule() -> impl Strategy<Value = Schedule> {
    let row = (
        prop::collection::vec(prop::option::weighted(0.8, action()), 0..8),
        action(),
        any::<prop::sample::Index>(),
    )
        .prop_map(|(mut cells, a, at)| {
            let i = at.index(cells.len() + 1);
            cells.insert(i, Some(a));
            cells
        });
    prop::collection::vec(row, 1..6).prop_map(|ranks| Schedule { ranks })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn edited_csv_parses_back_to_the_same_schedule(s in schedule(), e in edit()) {
        let text = edited(&s.to_csv(), e);
        prop_assert_eq!(Schedule::from_csv(&text).unwrap(), s.clone(), "{:?}: {:?}", e, text);
        prop_assert_eq!(Schedule::parse(&text).unwrap(), s);
    }

    #[test]
    fn generated_schedules_survive_a_spreadsheet(
        k in prop::sample::select(Kind::ALL.to_vec()),
        p in 1usize..5,
        m in 1usize..12,
        lowered in any::<bool>(),
        e in edit(),
    ) {
        let Ok(s) = generate(k, &Shape::new(p, k.default_stages_per_rank(), m), &Options::default()) else {
            return Ok(());
        };
        let s = if lowered { lower(&s, &LowerOptions::default()).unwrap() } else { s };
        prop_assert_eq!(Schedule::parse(&edited(&s.to_csv_with(",", "\n"), e)).unwrap(), s);
    }
}

/// DualPipeV's overlapped pairs as a person types them in a spreadsheet, quoted, with a BOM.
#[test]
fn dualpipev_with_spaced_overlaps_quoted_and_bom() {
    let s = generate(Kind::DualPipeV, &Shape::new(2, 2, 4), &Options::default()).unwrap();
    assert!(s.actions().any(|(_, a)| matches!(a, Action::Overlap { .. })), "the case has overlaps");
    let e = Edit { quote: true, crlf: true, bom: true, overlap_spaces: true };
    let text = edited(&s.to_csv(), e);
    assert!(text.starts_with("\u{feff}\"") && text.contains("\"( 0F"), "{text}");
    assert_eq!(Schedule::parse(&text).unwrap(), s);
}

/// Trailing junk keeps its error with row and column, quoted or not, with or without a BOM.
#[test]
fn junk_is_still_an_error_with_row_and_cell() {
    for text in ["0F0,0B0\n1F0,1BW0\n", "\u{feff}\"0F0\",\"0B0\"\r\n\"1F0\",\"1BW0\"\r\n"] {
        let e = Schedule::from_csv(text).unwrap_err();
        assert_eq!((e.row, e.line, e.column), (1, 2, 2), "{text:?}");
        let CsvProblem::Action(a) = &e.problem else { panic!("{e:?}") };
        assert_eq!((a.column, a.text.as_str()), (3, "1BW0"));
        // The message has no invisible character from the BOM.
        assert!(!e.to_string().contains('\u{feff}') && !a.to_string().contains('\u{feff}'));
    }
}
