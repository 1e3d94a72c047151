//! DualPipe (bidirectional, two parameter copies) and DualPipeV (DualPipe folded onto one V-shaped
//! pipeline), both built from the same 8 phases (docs/ARCHITECTURE.md, "DualPipe / DualPipeV phases"; the
//! reference is `step()` of deepseek-ai/DualPipe `dualpipe.py` / `dualpipev.py`, and PyTorch's
//! `ScheduleDualPipeV`).
//!
//! **Stages.** Both kinds use `S = 2p` stages in V placement (rank `k` holds stages `k` and
//! `2p-1-k`), so both need `stages_per_rank = 2`.
//! - DualPipeV: every microbatch visits all `2p` stages, down the ranks and back up.
//! - DualPipe: microbatches `0..m/2` flow "down" through stages `0..p` (stage `s` on rank `s`);
//!   microbatches `m/2..m` flow "up" through stages `p..2p` (stage `p+i` on rank `p-1-i`, holding a
//!   copy of the layers of stage `i`). Each microbatch visits only its direction's `p` stages
//!   ([`Schedule::route`] infers this).
//!
//! **Chunks.** Rank `k` sees chunk A first and chunk D second. DualPipeV: A = stage `k`, D = stage
//! `2p-1-k`, `h = p`, `r = k`, `n = m`. DualPipe: ranks in the first half (`k < p/2`) have A = the down
//! stage `k`, the others A = the up stage `2p-1-k`; `h = p/2`, `r = min(k, p-1-k)`, `n = m/2`.
//!
//! Deferred W's (from I's) run oldest first. Full backwards inside OVERLAP_F_B are B, never I.

use std::collections::VecDeque;

use super::{require, GenerateError, Kind, Shape};
use crate::action::{Action, MicrobatchId, StageId, Task};
use crate::schedule::Schedule;

/// DualPipe for `p` ranks, `2p` stages (V placement, see the module docs) and `m` microbatches.
///
/// # Errors
/// [`GenerateError::Constraint`] unless `stages_per_rank = 2`, `p` is even, `m` is even and
/// `m >= 2p` (docs/ARCHITECTURE.md table; `dualpipe.py` asserts the same).
pub fn generate_dualpipe(shape: &Shape) -> Result<Schedule, GenerateError> {
    let kind = Kind::DualPipe;
    let (p, m) = (shape.ranks, shape.microbatches);
    require_two_stages_per_rank(kind, shape)?;
    require(p % 2 == 0, kind, shape, || format!("needs an even number of ranks (p={p})"))?;
    require(m % 2 == 0, kind, shape, || format!("needs an even number of microbatches (m={m})"))?;
    require(m >= 2 * p, kind, shape, || format!("needs m >= 2p (m={m}, 2p={})", 2 * p))?;
    let programs = (0..p)
        .map(|k| {
            let down = Chunk { stage: k, mb0: 0 };
            let up = Chunk { stage: 2 * p - 1 - k, mb0: m / 2 };
            let (a, d) = if k < p / 2 { (down, up) } else { (up, down) };
            Phases { h: p / 2, r: k.min(p - 1 - k), n: m / 2 }.program(a, d)
        })
        .collect();
    Ok(Schedule::from_programs(programs))
}

/// DualPipeV for `p` ranks, `2p` stages (V placement) and `m` microbatches.
///
/// # Errors
/// [`GenerateError::Constraint`] unless `stages_per_rank = 2` and `m >= 2p` (docs/ARCHITECTURE.md table;
/// PyTorch's `ScheduleDualPipeV` asserts the same).
pub fn generate_dualpipev(shape: &Shape) -> Result<Schedule, GenerateError> {
    let kind = Kind::DualPipeV;
    let (p, m) = (shape.ranks, shape.microbatches);
    require_two_stages_per_rank(kind, shape)?;
    require(m >= 2 * p, kind, shape, || format!("needs m >= 2p (m={m}, 2p={})", 2 * p))?;
    let programs = (0..p)
        .map(|k| {
            let a = Chunk { stage: k, mb0: 0 };
            let d = Chunk { stage: 2 * p - 1 - k, mb0: 0 };
            Phases { h: p, r: k, n: m }.program(a, d)
        })
        .collect();
    Ok(Schedule::from_programs(programs))
}

fn require_two_stages_per_rank(kind: Kind, shape: &Shape) -> Result<(), GenerateError> {
    let v = shape.stages_per_rank;
    require(v == 2, kind, shape, || format!("needs stages-per-rank = 2 (2p stages in V placement), got {v}"))
}

/// One of a rank's two chunks: its stage and the first microbatch that visits it.
#[derive(Clone, Copy)]
struct Chunk {
    stage: StageId,
    mb0: MicrobatchId,
}

/// The phase counts of one rank: `h` half-pipeline length, `r` the rank's distance from the
/// pipeline's end, `n` microbatches per chunk.
struct Phases {
    h: usize,
    r: usize,
    n: usize,
}

impl Phases {
    /// Rank program for chunks `a` (seen first) and `d`, phases 1–8 of docs/ARCHITECTURE.md.
    fn program(&self, a: Chunk, d: Chunk) -> Vec<Action> {
        let (h, r, n) = (self.h, self.r, self.n);
        let mut e = Emitter::new([a, d]);
        let (ca, cd) = (0, 1);
        // 1. 2(h−r−1) × F_A
        for _ in 0..2 * (h - r - 1) {
            e.f(ca);
        }
        // 2. (r+1) × [F_A, F_D]
        for _ in 0..=r {
            e.f(ca);
            e.f(cd);
        }
        // 3. (h−r−1) × [I_D, W(oldest), F_D]
        for _ in 0..h - r - 1 {
            e.backward(cd, true);
            e.w();
            e.f(cd);
        }
        // 4. (n−2h+r+1) × [OVERLAP(F_A; B_D), OVERLAP(F_D; B_A)]; the first pair runs un-overlapped
        //    on the rank(s) next to the pipeline's turning point (r = h−1).
        for i in 0..n + r + 1 - 2 * h {
            if i == 0 && r == h - 1 {
                e.f(ca);
                e.backward(cd, false);
            } else {
                e.overlap(ca, cd);
            }
            e.overlap(cd, ca);
        }
        // 5. (h−r−1) × [B_D, OVERLAP(F_D; B_A)]
        for _ in 0..h - r - 1 {
            e.backward(cd, false);
            e.overlap(cd, ca);
        }
        // 6. (r+1) × [B_D, B_A], switching to I (W deferred) at iteration ⌊(r+1)/2⌋.
        let mut zb = false;
        for i in 0..=r {
            let switch = i == r.div_ceil(2);
            zb |= switch && r % 2 == 1;
            e.backward(cd, zb);
            zb |= switch && r % 2 == 0;
            e.backward(ca, zb);
        }
        // 7. (h−r−1) × [W(oldest), I_A]
        for _ in 0..h - r - 1 {
            e.w();
            e.backward(ca, true);
        }
        // 8. (r+1) × W(oldest)
        for _ in 0..=r {
            e.w();
        }
        e.prog
    }
}

/// Emits one rank's actions, keeping per-chunk F/B counters and the FIFO of deferred W's.
struct Emitter {
    chunks: [Chunk; 2],
    next_f: [usize; 2],
    next_b: [usize; 2],
    deferred_w: VecDeque<Task>,
    prog: Vec<Action>,
}

impl Emitter {
    fn new(chunks: [Chunk; 2]) -> Self {
        Emitter { chunks, next_f: [0; 2], next_b: [0; 2], deferred_w: VecDeque::new(), prog: Vec::new() }
    }

    fn take_f(&mut self, c: usize) -> Task {
        let t = Task::new(self.chunks[c].stage, self.chunks[c].mb0 + self.next_f[c]);
        self.next_f[c] += 1;
        t
    }

    fn take_b(&mut self, c: usize) -> Task {
        let t = Task::new(self.chunks[c].stage, self.chunks[c].mb0 + self.next_b[c]);
        self.next_b[c] += 1;
        t
    }

    fn f(&mut self, c: usize) {
        let t = self.take_f(c);
        self.prog.push(Action::f(t.stage, t.mb));
    }

    /// A full B, or (`split`) an I whose W is deferred.
    fn backward(&mut self, c: usize, split: bool) {
        let t = self.take_b(c);
        if split {
            self.prog.push(Action::i(t.stage, t.mb));
            self.deferred_w.push_back(t);
        } else {
            self.prog.push(Action::b(t.stage, t.mb));
        }
    }

    /// The oldest deferred W; nothing when none is pending (never happens in the 8 phases).
    fn w(&mut self) {
        if let Some(t) = self.deferred_w.pop_front() {
            self.prog.push(Action::w(t.stage, t.mb));
        }
    }

    fn overlap(&mut self, cf: usize, cb: usize) {
        let f = self.take_f(cf);
        let b = self.take_b(cb);
        self.prog.push(Action::overlap(f, b));
    }
}
