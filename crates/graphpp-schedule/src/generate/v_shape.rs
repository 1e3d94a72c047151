//! V-Half and V-Min (`v-half`, `v-min`): schedules that repeat a V-shape building block whose
//! lifespan bounds the activation memory, to about 1/2 and 1/3 of 1F1B's.
//!
//! Source: Qi, Wan, Amar, Lin, "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024,
//! arXiv 2405.15362): the V-Shape building blocks V-Min and V-Half (Figure 4, V-Shape full
//! schedules; V-ZB is [`Kind::Zbv`]) and the squeezing of a repeated block into a schedule; the
//! authors' `zbv_greedy.py` in sail-sg/zero-bubble-pipeline-parallelism (commit 39f2c186:
//! `stable_pattern_v_min`, `stable_pattern_v_half`, `put_w`, `reorder`), which this follows step
//! by step, so both kinds produce the reference's order (checked on 1024 shapes, p ≤ 18;
//! tests/gen_controllable_memory.rs).
//!
//! **Layout.** As ZB-V: `p` ranks, `2p` stages in V placement; rank `r` holds chunk 0 = stage `r`
//! and chunk 1 = stage `2p−1−r`. Per microbatch a rank runs six unit passes: F of chunk 0, F of
//! chunk 1, I (the papers' B) of chunk 1, I of chunk 0, and one W per chunk.
//!
//! **Block.** Time is cut into unit slots (T_F = T_I = T_W). The block fixes the slots of rank
//! `r`'s four F/I passes of microbatch 0; microbatch `j` runs them `6j` slots later.
//! - V-Min: F0 at `r`, F1 at `2p−1−r`, I1 at `2p+d+r`, I0 at `4p+d−1−r`, `d = 2` when 3 divides
//!   `p`, else 0. A microbatch lives about `4p` slots on each rank: `4p/6` chunk activations,
//!   `p/3` M_B.
//! - V-Half: F0 at `2r`, F1 at `3p−2−r`, I1 at `3p+d+2r−1`, I0 at `6p+d−2−r`, `d = 3` when `p`
//!   is even, else 0: lifespan about `6p` slots, `p/2` M_B.
//!
//! `d` keeps a rank's four passes in distinct slots modulo 6.
//!
//! **Squeezing.** W's take each rank's free slots in order (a W once an I of its rank has run,
//! chunk 1's first; those left over follow the last pass). Twice, every pass is visited in slot
//! order, and a pass of the warm-up (before rank 0's first chunk-0 I; first time only, W's
//! included) or of the cool-down (from rank 0's last chunk-0 F on) moves to the earliest free slot
//! after its inputs — the same pass one rank up or down the V, the rank's previous pass of the
//! microbatch, its own previous microbatch; the k-th W after the rank's k-th I — where the rank's
//! peak memory stays at most the largest peak at the start of that squeeze (an activation is held
//! from F to W; the second time, without W passes, every free slot frees one whose I has run).
//! After each squeeze every rank's passes are re-timed as soon as possible in slot order with unit
//! durations. Last, the W's are placed again, per chunk.

use super::{require, GenerateError, Kind, Shape};
use crate::action::Action;
use crate::schedule::Schedule;

/// F of chunk 0 (stage `r`).
const F0: usize = 0;
/// F of chunk 1 (stage `2p−1−r`).
const F1: usize = 1;
/// I of chunk 1.
const I1: usize = 2;
/// I of chunk 0.
const I0: usize = 3;
/// A W of either chunk, while squeezing (the k-th W of the rank).
const W: usize = 4;

/// Slots between microbatch `j` and `j + 1` of the block: six unit passes per rank.
const PERIOD: usize = 6;

/// The slot of each pass of one rank: `[type][microbatch]` for F0, F1, I1, I0, and the rank's
/// W's in order (`W`; empty outside a squeeze).
type Passes = [Vec<usize>; 5];

/// The building block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Block {
    Half,
    Min,
}

impl Block {
    /// Slots of rank `r`'s F0, F1, I1, I0 of microbatch 0 (module docs).
    fn offsets(self, p: usize, r: usize) -> [usize; 4] {
        match self {
            Block::Min => {
                let d = if p.is_multiple_of(3) { 2 } else { 0 };
                [r, 2 * p - 1 - r, 2 * p + d + r, 4 * p + d - 1 - r]
            }
            Block::Half => {
                let d = if p.is_multiple_of(2) { 3 } else { 0 };
                [2 * r, 3 * p - 2 - r, 3 * p + d + 2 * r - 1, 6 * p + d - 2 - r]
            }
        }
    }
}

/// V-Half for `shape` (`p` ranks, `v = 2`, any `m ≥ 1`): the V-Half building block (peak about
/// half of 1F1B's, `⌊(p+2)/2⌋` M_B with activations held from F to W) repeated and squeezed (module
/// docs; Qi et al. 2024, V-Half). Emits F, I, W.
///
/// # Errors
/// [`GenerateError::Constraint`] unless `stages_per_rank = 2` (V placement).
pub fn generate_v_half(shape: &Shape) -> Result<Schedule, GenerateError> {
    build(Kind::VHalf, Block::Half, shape)
}

/// V-Min for `shape` (`p` ranks, `v = 2`, any `m ≥ 1`): the V-Min building block (peak about a
/// third of 1F1B's, `⌊(p+4)/3⌋` M_B with activations held from F to W) repeated and squeezed
/// (module docs; Qi et al. 2024, V-Min). Emits F, I, W.
///
/// # Errors
/// [`GenerateError::Constraint`] unless `stages_per_rank = 2` (V placement).
pub fn generate_v_min(shape: &Shape) -> Result<Schedule, GenerateError> {
    build(Kind::VMin, Block::Min, shape)
}

fn build(kind: Kind, block: Block, shape: &Shape) -> Result<Schedule, GenerateError> {
    let v = shape.stages_per_rank;
    require(v == 2, kind, shape, || {
        format!("needs stages-per-rank = 2 (2p stages in V placement), got {v}")
    })?;
    let (p, m) = (shape.ranks, shape.microbatches);
    let mut ranks: Vec<Passes> = (0..p)
        .map(|r| {
            let o = block.offsets(p, r);
            let at = |t: usize| (0..m).map(|j| o[t] + PERIOD * j).collect();
            [at(F0), at(F1), at(I1), at(I0), Vec::new()]
        })
        .collect();
    squeeze(&mut ranks, m, true);
    squeeze(&mut ranks, m, false);
    Ok(Schedule::from_programs(ranks.iter().enumerate().map(|(r, s)| program(p, r, s)).collect()))
}

/// Rank `r`'s program: its passes in slot order, with the W's placed per chunk.
fn program(p: usize, r: usize, s: &Passes) -> Vec<Action> {
    let (lo, hi) = (r, 2 * p - 1 - r);
    let [w1, w0] = place_ws(s, true);
    let mut timed: Vec<(usize, Action)> = Vec::with_capacity(6 * s[F0].len());
    let mut add = |slots: &[usize], make: &dyn Fn(usize) -> Action| {
        timed.extend(slots.iter().enumerate().map(|(j, &slot)| (slot, make(j))));
    };
    add(&s[F0], &|j| Action::f(lo, j));
    add(&s[F1], &|j| Action::f(hi, j));
    add(&s[I1], &|j| Action::i(hi, j));
    add(&s[I0], &|j| Action::i(lo, j));
    add(&w1, &|j| Action::w(hi, j));
    add(&w0, &|j| Action::w(lo, j));
    timed.sort_unstable_by_key(|&(slot, _)| slot);
    timed.into_iter().map(|(_, a)| a).collect()
}

/// A slot's pass, `microbatch << 3 | type`, or [`FREE`] (the size limit keeps microbatches
/// below 2^29).
type Slot = u32;
/// No pass in the slot.
const FREE: Slot = Slot::MAX;

fn pack(t: usize, j: usize) -> Slot {
    (j as Slot) << 3 | t as Slot
}

fn type_of(x: Slot) -> Option<usize> {
    (x != FREE).then_some((x & 7) as usize)
}

/// Which pass of rank `s` takes each slot up to its last pass, counting the first `types` types.
fn occupancy(s: &Passes, types: usize) -> Vec<Slot> {
    let end = s[..types].iter().filter_map(|v| v.last()).max().map_or(0, |&x| x + 1);
    let mut occ = vec![FREE; end];
    for (t, slots) in s[..types].iter().enumerate() {
        for (j, &slot) in slots.iter().enumerate() {
            debug_assert!(occ[slot] == FREE, "two passes in slot {slot}");
            occ[slot] = pack(t, j);
        }
    }
    occ
}

/// Slots for one rank's W's: each free slot, in order, takes a W whose I has run (chunk 1's
/// first); those left over follow the last pass. `split`: `[chunk 1, chunk 0]`; else all in the
/// first list.
fn place_ws(s: &Passes, split: bool) -> [Vec<usize>; 2] {
    let occ = occupancy(s, 4);
    let (mut pending, mut out) = ([0usize; 2], [Vec::new(), Vec::new()]);
    for (slot, &pass) in occ.iter().enumerate() {
        match type_of(pass) {
            Some(t @ (I1 | I0)) => pending[if split { t - I1 } else { 0 }] += 1,
            Some(_) => {}
            None => {
                if let Some(c) = (0..2).find(|&c| pending[c] > 0) {
                    pending[c] -= 1;
                    out[c].push(slot);
                }
            }
        }
    }
    let mut next = occ.len();
    for (c, n) in pending.into_iter().enumerate() {
        out[c].extend(next..next + n);
        next += n;
    }
    out
}

/// One rank's slots and activation memory during a squeeze, in chunk activations: an F holds one
/// until its W. With `implicit_w` (no W passes) every free slot frees one whose I has run.
struct RankMemory {
    occ: Vec<Slot>,
    /// (held, freeable) after each slot.
    after: Vec<(i32, i32)>,
    implicit_w: bool,
}

impl RankMemory {
    fn new(occ: Vec<Slot>, implicit_w: bool) -> Self {
        let mut mem = RankMemory { after: vec![(0, 0); occ.len()], occ, implicit_w };
        let mut state = (0, 0);
        for slot in 0..mem.occ.len() {
            state = mem.step(state, mem.occ[slot]);
            mem.after[slot] = state;
        }
        mem
    }

    fn step(&self, (held, owed): (i32, i32), pass: Slot) -> (i32, i32) {
        match type_of(pass) {
            Some(F0 | F1) => (held + 1, owed),
            Some(W) => (held - 1, owed),
            Some(_) => (held, owed + i32::from(self.implicit_w)),
            None if owed > 0 => (held - 1, owed - 1),
            None => (held, owed),
        }
    }

    fn peak(&self) -> i32 {
        self.after.iter().map(|s| s.0).fold(0, i32::max)
    }

    /// Moves the pass in slot `from` to the free slot `to < from` if the memory stays at most
    /// `cap` in every slot; else nothing moves and the error is the first slot above `cap`. Only
    /// slots from `to` until the memory is back to its old course change.
    fn try_move(&mut self, from: usize, to: usize, cap: i32) -> Result<(), usize> {
        let pass = self.occ[from];
        let at = |s: usize| {
            if s == to {
                pass
            } else if s == from {
                FREE
            } else {
                self.occ[s]
            }
        };
        let mut state = if to == 0 { (0, 0) } else { self.after[to - 1] };
        let mut end = self.occ.len();
        for s in to..self.occ.len() {
            state = self.step(state, at(s));
            if state.0 > cap {
                return Err(s);
            }
            if s >= from && state == self.after[s] {
                end = s;
                break;
            }
        }
        let mut state = if to == 0 { (0, 0) } else { self.after[to - 1] };
        for s in to..end {
            state = self.step(state, at(s));
            self.after[s] = state;
        }
        self.occ[to] = pass;
        self.occ[from] = FREE;
        Ok(())
    }

    /// The first slot in `lo..from` the pass in slot `from` can move to ([`try_move`]), moving
    /// it there. With W passes, a move that puts slot `s` above the cap puts it there from every
    /// earlier slot too, so the search resumes after `s`.
    ///
    /// [`try_move`]: RankMemory::try_move
    fn move_earliest(&mut self, from: usize, lo: usize, cap: i32) -> Option<usize> {
        let mut to = lo;
        while to < from {
            if self.occ[to] == FREE {
                match self.try_move(from, to, cap) {
                    Ok(()) => return Some(to),
                    Err(s) if !self.implicit_w => to = s,
                    Err(_) => {}
                }
            }
            to += 1;
        }
        None
    }
}

/// The squeeze phases, in slot order.
#[derive(PartialEq)]
enum Phase {
    /// Until rank 0's first chunk-0 I.
    WarmUp,
    /// Until rank 0's last chunk-0 F.
    Steady,
    /// The rest.
    CoolDown,
}

/// One squeeze (module docs): `with_w` is the first, which places the W's and moves them and
/// the warm-up's passes too. Leaves the W list empty.
fn squeeze(ranks: &mut [Passes], m: usize, with_w: bool) {
    let types = if with_w { 5 } else { 4 };
    if with_w {
        for s in ranks.iter_mut() {
            [s[W], _] = place_ws(s, false);
        }
    }
    let order = slot_order(ranks, types);
    let mut mem: Vec<RankMemory> =
        ranks.iter().map(|s| RankMemory::new(occupancy(s, types), !with_w)).collect();
    let cap = mem.iter().map(RankMemory::peak).max().unwrap_or(0);
    let mut phase = Phase::WarmUp;
    for (slot, r, t, j) in order {
        if phase == Phase::WarmUp && t == I0 && r == 0 {
            phase = Phase::Steady;
        }
        if phase == Phase::Steady {
            if t == F0 && j + 1 == m {
                phase = Phase::CoolDown;
            }
            continue;
        }
        if phase == Phase::WarmUp && !with_w {
            continue;
        }
        let lo = earliest(ranks, r, t, j);
        debug_assert!(lo <= slot);
        if let Some(to) = mem[r].move_earliest(slot, lo, cap) {
            ranks[r][t][j] = to;
        }
    }
    if !with_w {
        for s in ranks.iter_mut() {
            [s[W], _] = place_ws(s, false);
        }
    }
    retime(ranks);
    for s in ranks.iter_mut() {
        s[W].clear();
    }
}

/// Every pass of the first `types` types as (slot, rank, type, microbatch), sorted (by slot,
/// then rank: a rank has one pass per slot).
fn slot_order(ranks: &[Passes], types: usize) -> Vec<(usize, usize, usize, usize)> {
    let occ: Vec<Vec<Slot>> = ranks.iter().map(|s| occupancy(s, types)).collect();
    let len = occ.iter().map(Vec::len).max().unwrap_or(0);
    let mut order =
        Vec::with_capacity(ranks.iter().map(|s| s[..types].iter().map(Vec::len).sum::<usize>()).sum());
    for slot in 0..len {
        for (r, o) in occ.iter().enumerate() {
            if let Some(&x) = o.get(slot).filter(|&&x| x != FREE) {
                order.push((slot, r, (x & 7) as usize, (x >> 3) as usize));
            }
        }
    }
    order
}

/// The passes whose slot (while squeezing) or end (re-timing) the pass `(r, t, j)` follows: the
/// same pass one rank before it on the V, the rank's previous pass of the microbatch, and the
/// same type's previous microbatch. (W's follow their I through [`earliest`] only.)
fn inputs(p: usize, r: usize, t: usize, j: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    let along = match t {
        F0 | I1 if r > 0 => Some((r - 1, t, j)),
        F1 | I0 if r + 1 < p => Some((r + 1, t, j)),
        _ => None,
    };
    let before = (F1..W).contains(&t).then(|| (r, t - 1, j));
    let previous = (j > 0).then(|| (r, t, j - 1));
    along.into_iter().chain(before).chain(previous)
}

/// The earliest slot pass `(r, t, j)` may move to: after its [`inputs`]; the k-th W after the
/// rank's k-th I.
fn earliest(ranks: &[Passes], r: usize, t: usize, j: usize) -> usize {
    let mut lo = inputs(ranks.len(), r, t, j).map(|(r, t, j)| ranks[r][t][j] + 1).max().unwrap_or(0);
    if t == W {
        lo = lo.max(nth_merged(&ranks[r][I1], &ranks[r][I0], j) + 1);
    }
    lo
}

/// The `n`-th smallest (0-based) of two sorted lists together.
fn nth_merged(a: &[usize], b: &[usize], n: usize) -> usize {
    let (mut i, mut k) = (0, 0);
    loop {
        let x = if k >= b.len() || (i < a.len() && a[i] <= b[k]) {
            i += 1;
            a[i - 1]
        } else {
            k += 1;
            b[k - 1]
        };
        if i + k > n {
            return x;
        }
    }
}

/// Re-times every pass as soon as possible in slot order with unit durations: it starts when its
/// rank is free and its [`inputs`] have ended; its new slot is its start.
fn retime(ranks: &mut [Passes]) {
    let p = ranks.len();
    let order = slot_order(ranks, 5);
    let mut end: Vec<[Vec<usize>; 5]> = ranks.iter().map(|s| s.clone().map(|v| vec![0; v.len()])).collect();
    let mut free = vec![0; p];
    for (_, r, t, j) in order {
        let start = inputs(p, r, t, j).map(|(r, t, j)| end[r][t][j]).fold(free[r], usize::max);
        end[r][t][j] = start + 1;
        free[r] = start + 1;
        ranks[r][t][j] = start;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_passes_are_in_distinct_slots_modulo_the_period() {
        for p in 1..60 {
            for block in [Block::Half, Block::Min] {
                for r in 0..p {
                    let mut seen = [false; PERIOD];
                    for o in block.offsets(p, r) {
                        assert!(!std::mem::replace(&mut seen[o % PERIOD], true), "{block:?} p={p} r={r}");
                    }
                }
            }
        }
    }

    #[test]
    fn w_fill_takes_free_slots_chunk_one_first_then_trails() {
        // Slots 0 F0, 1 F1, 2 I1, 3 I0; W1 takes slot 4; W0 trails at 5.
        let s: Passes = [vec![0], vec![1], vec![2], vec![3], vec![]];
        assert_eq!(place_ws(&s, true), [vec![4], vec![5]]);
        let s: Passes = [vec![0], vec![1], vec![2], vec![4], vec![]];
        assert_eq!(place_ws(&s, true), [vec![3], vec![5]]);
        assert_eq!(place_ws(&s, false), [vec![3, 5], vec![]]);
    }

    #[test]
    fn nth_of_two_sorted_lists() {
        let (a, b) = ([1, 4, 9], [2, 3, 10]);
        let all: Vec<usize> = (0..6).map(|n| nth_merged(&a, &b, n)).collect();
        assert_eq!(all, [1, 2, 3, 4, 9, 10]);
    }

    #[test]
    fn rejects_v_other_than_two() {
        let e = generate_v_min(&Shape::new(4, 1, 8)).unwrap_err();
        assert!(e.to_string().contains("needs stages-per-rank = 2"), "{e}");
    }
}
