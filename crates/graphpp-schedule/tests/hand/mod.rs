//! Hand-made schedules and an independent execution oracle for the validation/lowering tests.
//! The builders follow docs/ARCHITECTURE.md's rules ("Schedules and reference figures"), written out
//! directly here so that the tests do not depend on the generators.

#![allow(dead_code)]

use graphpp_schedule::{Action, ComputeKind, Schedule, Task};

/// GPipe: rank r runs F(r, 0..m) then B(r, 0..m); one stage per rank.
pub fn gpipe(p: usize, m: usize) -> Schedule {
    Schedule::from_programs(
        (0..p)
            .map(|r| (0..m).map(|j| Action::f(r, j)).chain((0..m).map(|j| Action::b(r, j))).collect())
            .collect(),
    )
}

/// 1F1B (docs/ARCHITECTURE.md): w = min(m, p-1-r) warm-up F, then (F, B) pairs, then the w remaining B.
pub fn one_f_one_b(p: usize, m: usize) -> Schedule {
    Schedule::from_programs((0..p).map(|r| one_f_one_b_rank(p, m, r, false)).collect())
}

fn one_f_one_b_rank(p: usize, m: usize, r: usize, split: bool) -> Vec<Action> {
    let w = m.min(p - 1 - r);
    let mut out: Vec<Action> = (0..w).map(|j| Action::f(r, j)).collect();
    let bw = |j: usize| if split { Action::i(r, j) } else { Action::b(r, j) };
    for k in 0..m - w {
        out.push(Action::f(r, w + k));
        out.push(bw(k));
    }
    out.extend((m - w..m).map(bw));
    out
}

/// ZB-style: 1F1B with each B split into I, and rank r's W's held back by r (the W of microbatch
/// j runs after the I of microbatch j + r), the rest drained at the end.
pub fn zb(p: usize, m: usize) -> Schedule {
    let programs = (0..p)
        .map(|r| {
            let mut out = Vec::new();
            let mut next_w = 0;
            for a in one_f_one_b_rank(p, m, r, true) {
                out.push(a);
                if let Action::Compute { kind: ComputeKind::I, task } = a {
                    if task.mb >= r {
                        out.push(Action::w(r, next_w));
                        next_w += 1;
                    }
                }
            }
            out.extend((next_w..m).map(|j| Action::w(r, j)));
            out
        })
        .collect();
    Schedule::from_programs(programs)
}

/// Looped BFS over `v` chunks with loop placement (stage c·p + r on rank r): all chunks' F
/// breadth-first, then B in reverse chunk order.
pub fn looped_bfs(p: usize, v: usize, m: usize) -> Schedule {
    let programs = (0..p)
        .map(|r| {
            let f = (0..v).flat_map(|c| (0..m).map(move |j| Action::f(c * p + r, j)));
            let b = (0..v).rev().flat_map(|c| (0..m).map(move |j| Action::b(c * p + r, j)));
            f.chain(b).collect()
        })
        .collect();
    Schedule::from_programs(programs)
}

/// GPipe over a V placement (rank r holds stages r and 2p-1-r): F of the first chunk, F of the
/// second, B of the second, B of the first.
pub fn v_gpipe(p: usize, m: usize) -> Schedule {
    let programs = (0..p)
        .map(|r| {
            let (a, d) = (r, 2 * p - 1 - r);
            let all =
                |s: usize, b: bool| (0..m).map(move |j| if b { Action::b(s, j) } else { Action::f(s, j) });
            all(a, false).chain(all(d, false)).chain(all(d, true)).chain(all(a, true)).collect()
        })
        .collect();
    Schedule::from_programs(programs)
}

/// Which hand-made family.
#[derive(Debug, Clone, Copy)]
pub enum Family {
    Gpipe,
    OneFOneB,
    Zb,
    LoopedBfs,
    VGpipe,
}

pub const FAMILIES: [Family; 5] =
    [Family::Gpipe, Family::OneFOneB, Family::Zb, Family::LoopedBfs, Family::VGpipe];

/// Builds a family's schedule; `looped_bfs` uses v = 2.
pub fn build(f: Family, p: usize, m: usize) -> Schedule {
    match f {
        Family::Gpipe => gpipe(p, m),
        Family::OneFOneB => one_f_one_b(p, m),
        Family::Zb => zb(p, m),
        Family::LoopedBfs => looped_bfs(p, 2, m),
        Family::VGpipe => v_gpipe(p, m),
    }
}

/// Number of stages of a family at p.
pub fn stages(f: Family, p: usize) -> usize {
    match f {
        Family::LoopedBfs | Family::VGpipe => 2 * p,
        _ => p,
    }
}

/// The rank of `stage` in a family at p.
pub fn rank_of(f: Family, p: usize, stage: usize) -> usize {
    match f {
        Family::VGpipe if stage >= p => 2 * p - 1 - stage,
        _ => stage % p,
    }
}

/// Independent oracle: runs every rank's compute program in order, one ready action at a time,
/// with docs/ARCHITECTURE.md's dependency rules on full routes `0..S` (F(s,j) needs F(s-1,j); B/I(s,j) needs
/// F(s,j) and B/I(s+1,j) unless s is last; W(s,j) needs I(s,j)). True when every rank finishes.
pub fn runs_to_completion(s: &Schedule, stages: usize) -> bool {
    use std::collections::HashSet;
    let programs: Vec<Vec<Action>> = (0..s.num_ranks()).map(|r| s.program(r)).collect();
    let mut pc = vec![0usize; programs.len()];
    let mut done: HashSet<(ComputeKind, Task)> = HashSet::new();
    let bw_done = |d: &HashSet<(ComputeKind, Task)>, t: Task| {
        d.contains(&(ComputeKind::B, t)) || d.contains(&(ComputeKind::I, t))
    };
    loop {
        let mut progressed = false;
        for r in 0..programs.len() {
            while let Some(a) = programs[r].get(pc[r]) {
                let ready = a.computes().all(|(k, t)| match k {
                    ComputeKind::F => {
                        t.stage == 0 || done.contains(&(ComputeKind::F, Task::new(t.stage - 1, t.mb)))
                    }
                    ComputeKind::B | ComputeKind::I => {
                        done.contains(&(ComputeKind::F, t))
                            && (t.stage + 1 == stages || bw_done(&done, Task::new(t.stage + 1, t.mb)))
                    }
                    ComputeKind::W => done.contains(&(ComputeKind::I, t)),
                });
                if !ready {
                    break;
                }
                done.extend(a.computes());
                pc[r] += 1;
                progressed = true;
            }
        }
        if pc.iter().zip(&programs).all(|(&i, p)| i == p.len()) {
            return true;
        }
        if !progressed {
            return false;
        }
    }
}
