//! docs/ARCHITECTURE.md ("Lowering passes"): early RECV placement deadlocked real Interleaved1F1B runs.
//! `add_send_recv` puts each RECV right before its consumer; moving every RECV just one compute
//! action earlier turns the generated Interleaved1F1B (p = 4, v = 2, m = 8) into a deadlock, and
//! the validator names a cycle through all four ranks.

use graphpp_schedule::lower::add_send_recv;
use graphpp_schedule::{
    generate, validate, Action, CommKind, Kind, Options, Schedule, Shape, ValidateOptions, ValidationError,
};

/// Every RECV moved before the compute action that precedes it on its rank.
fn recvs_one_compute_earlier(s: &Schedule) -> Schedule {
    let programs = (0..s.num_ranks())
        .map(|r| {
            let mut prog = s.program(r);
            for i in 0..prog.len() {
                if matches!(prog[i], Action::Comm { kind: CommKind::RecvF | CommKind::RecvB, .. }) {
                    let a = prog.remove(i);
                    let j = prog[..i].iter().rposition(Action::is_compute).unwrap_or(0);
                    prog.insert(j, a);
                }
            }
            prog
        })
        .collect();
    Schedule::from_programs(programs)
}

#[test]
fn early_recvs_deadlock_interleaved_1f1b() {
    let s = generate(Kind::Interleaved1F1B, &Shape::new(4, 2, 8), &Options::default()).unwrap();
    let lowered = add_send_recv(&s).unwrap();
    assert!(validate(&lowered, &ValidateOptions::default()).is_ok());
    let e = validate(&recvs_one_compute_earlier(&lowered), &ValidateOptions::default()).unwrap_err();
    let ValidationError::Deadlock { cycle } = &e else { panic!("expected a deadlock, got {e}") };
    let mut ranks: Vec<usize> = cycle.iter().map(|w| w.at.rank).collect();
    for (k, w) in cycle.iter().enumerate() {
        // Each waiting action is a blocked RECV whose SEND sits on the next rank of the cycle.
        assert!(matches!(w.at.action, Action::Comm { kind: CommKind::RecvF | CommKind::RecvB, .. }), "{e}");
        assert!(matches!(w.on.action, Action::Comm { kind: CommKind::SendF | CommKind::SendB, .. }), "{e}");
        assert_eq!(w.on.rank, cycle[(k + 1) % cycle.len()].at.rank, "{e}");
    }
    ranks.sort();
    assert_eq!(ranks, vec![0, 1, 2, 3], "{e}");
}
