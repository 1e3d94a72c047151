//! Property tests of the validator: hand-made valid schedules validate, and single mutations
//! (drop, duplicate, swap two adjacent actions of one rank) are rejected with the error kind the
//! rules predict. The expected result is derived from the rules (and, for swaps, from the
//! independent execution oracle in `hand`), never from the validator.

mod hand;

use graphpp_schedule::{validate, Action, ComputeKind, Schedule, ValidateOptions, ValidationError};
use hand::{build, runs_to_completion, stages, Family, FAMILIES};
use proptest::prelude::*;

fn opts() -> ValidateOptions {
    ValidateOptions::default()
}

fn case(
) -> impl Strategy<Value = (Family, usize, usize, prop::sample::Index, prop::sample::Index, prop::sample::Index)>
{
    (
        prop::sample::select(FAMILIES.to_vec()),
        1usize..=5,
        1usize..=8,
        any::<prop::sample::Index>(),
        any::<prop::sample::Index>(),
        any::<prop::sample::Index>(),
    )
}

fn with_program(s: &Schedule, r: usize, prog: Vec<Action>) -> Schedule {
    let mut programs: Vec<Vec<Action>> = (0..s.num_ranks()).map(|k| s.program(k)).collect();
    programs[r] = prog;
    Schedule::from_programs(programs)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn hand_made_schedules_validate(f in prop::sample::select(FAMILIES.to_vec()), p in 1usize..=6, m in 1usize..=10) {
        let s = build(f, p, m);
        let sum = validate(&s, &ValidateOptions::microbatches(m)).unwrap();
        let st = stages(f, p);
        prop_assert_eq!((sum.ranks, sum.stages, sum.microbatches), (p, st, m));
        prop_assert_eq!(sum.counts.f, st * m);
        prop_assert_eq!(sum.counts.b + sum.counts.i, st * m);
        prop_assert_eq!(sum.counts.w, sum.counts.i);
        prop_assert!(!sum.lowered);
    }

    #[test]
    fn dropping_an_action_is_rejected((f, p, m, ri, ai, _) in case()) {
        let s = build(f, p, m);
        let r = ri.index(p);
        let mut prog = s.program(r);
        let dropped = prog.remove(ai.index(prog.len()));
        let Action::Compute { kind, task } = dropped else { unreachable!("compute-only") };
        let e = validate(&with_program(&s, r, prog), &opts()).unwrap_err();
        match kind {
            ComputeKind::I => prop_assert!(
                matches!(e, ValidationError::WWithoutI { task: t, at } if t == task && at.rank == r && at.action == Action::w(task.stage, task.mb)),
                "{e:?}"
            ),
            k => prop_assert!(matches!(e, ValidationError::MissingCompute { kind: got, task: t, rank: Some(rr) } if got == k && t == task && rr == r), "{e:?}"),
        }
    }

    #[test]
    fn duplicating_an_action_is_rejected((f, p, m, ri, ai, pos) in case()) {
        let s = build(f, p, m);
        let r = ri.index(p);
        let mut prog = s.program(r);
        let a = prog[ai.index(prog.len())];
        prog.insert(pos.index(prog.len() + 1), a);
        let e = validate(&with_program(&s, r, prog), &opts()).unwrap_err();
        let Action::Compute { kind, task } = a else { unreachable!() };
        prop_assert!(matches!(e, ValidationError::DuplicateCompute { kind: k, task: t, .. } if k == kind && t == task), "{e:?}");
    }

    #[test]
    fn swapping_adjacent_actions_follows_the_rules((f, p, m, ri, ai, _) in case()) {
        let s = build(f, p, m);
        let r = ri.index(p);
        let mut prog = s.program(r);
        prop_assume!(prog.len() >= 2);
        let i = ai.index(prog.len() - 1);
        let (a, b) = (prog[i], prog[i + 1]);
        prog.swap(i, i + 1);
        let mutated = with_program(&s, r, prog);
        let dependent = match (a, b) {
            (Action::Compute { kind: ka, task: ta }, Action::Compute { kind: kb, task: tb }) => ta == tb
                && matches!((ka, kb), (ComputeKind::F, ComputeKind::B | ComputeKind::I) | (ComputeKind::I, ComputeKind::W)),
            _ => false,
        };
        let got = match validate(&mutated, &opts()) {
            Ok(_) => "valid",
            Err(ValidationError::OrderViolation { .. }) => "order violation",
            Err(ValidationError::Deadlock { .. }) => "deadlock",
            Err(e) => return Err(TestCaseError::fail(format!("unexpected error {e}\n{mutated}"))),
        };
        let expected = if dependent {
            "order violation"
        } else if runs_to_completion(&mutated, stages(f, p)) {
            "valid"
        } else {
            "deadlock"
        };
        prop_assert_eq!(got, expected, "swap {} {} on rank {}\n{}", a, b, r, mutated);
    }
}
