//! Llama-3 style grouped interleaving (Llama 3 paper §3.3.2; tutorial seed `001_…`, "深度优先 vs 广度
//! 优先"): interleaved 1F1B over `v` chunks per rank (loop placement, chunk `c` of rank `r` is stage
//! `c·p + r`) where each chunk runs `N` consecutive microbatches before the rank moves on to its next
//! chunk. `N = p` is Megatron's depth-first interleaving; `N = m` is breadth-first: every microbatch
//! goes through a chunk before any enters the next one.

use super::{require, GenerateError, Kind, Options, Shape};
use crate::action::Action;
use crate::placement::Placement;
use crate::schedule::Schedule;

/// Grouped interleaved 1F1B with `N = opts.group` (default `p`).
///
/// The `k`-th forward of rank `r` (`k = 0..m·v`) is chunk `(k / N) mod v`, microbatch
/// `(k / (N·v))·N + k mod N`; the `k`-th backward uses the same order with the chunks reversed
/// (chunk `v−1−(k / N) mod v`). Rank `r` runs `min(m·v, (v−1)·N + 2(p−1−r))` warm-up forwards —
/// Megatron's warm-up with the round size `p` replaced by `N` (`p−1−r`, i.e. 1F1B, when `v = 1`) —
/// then alternates [F, B], then runs the remaining backwards. Peak in flight on rank `r` is
/// `(v−1)·N + 2(p−1−r) + 1` (stage, mb) pairs, growing with `N` (5.5 full-stage units on rank 0 for
/// `p = 4, v = 2, N = p`, docs/ARCHITECTURE.md). With `N = m` the forwards are breadth-first, but backwards
/// still start once the first microbatch is back (1F1B inside the last chunk): the peak is
/// `(v−1)·m + 2(p−1−r) + 1`, not the `m·v` of looped BFS's all-forward-then-all-backward.
///
/// # Errors
/// [`GenerateError::Constraint`] unless `p <= N <= m` and `N` divides `m` (the tutorial seed's
/// simulator rule; with `N < p` the first microbatch cannot come back to rank 0 in time). Without a
/// group (`N = p`) the message says `p <= m` and `p` divides `m`, for commands with no `--group`.
pub fn generate(shape: &Shape, opts: &Options) -> Result<Schedule, GenerateError> {
    let kind = Kind::GroupedInterleaved;
    let (p, v, m) = (shape.ranks, shape.stages_per_rank, shape.microbatches);
    let Some(n) = opts.group else {
        // The group defaults to p: say the rules in terms of p and m, the flags every command has.
        require(p <= m, kind, shape, || {
            format!("needs at least as many microbatches as ranks (m={m}, p={p}): each chunk runs p consecutive microbatches")
        })?;
        require(m % p == 0, kind, shape, || {
            format!("needs microbatches m to be a multiple of ranks p (m={m}, p={p}): each chunk runs p consecutive microbatches")
        })?;
        return Ok(Schedule::from_programs((0..p).map(|r| rank_program(r, p, v, m, p)).collect()));
    };
    require(n >= p, kind, shape, || format!("needs group N >= p (N={n}, p={p})"))?;
    require(n <= m, kind, shape, || format!("needs group N <= m (N={n}, m={m})"))?;
    require(m % n == 0, kind, shape, || format!("needs m to be a multiple of group N (m={m}, N={n})"))?;
    let programs = (0..p).map(|r| rank_program(r, p, v, m, n)).collect();
    Ok(Schedule::from_programs(programs))
}

/// Rank `r`'s program; see [`generate`].
fn rank_program(r: usize, p: usize, v: usize, m: usize, n: usize) -> Vec<Action> {
    let stages = Placement::Loop.stages_of(r, p, v);
    let total = m * v;
    // Megatron's interleaved warm-up; with one chunk per rank the schedule is plain 1F1B.
    let warmup = if v == 1 { p - 1 - r } else { (v - 1) * n + 2 * (p - 1 - r) }.min(total);
    // (chunk, microbatch) of the k-th forward/backward.
    let slot = |k: usize| ((k / n) % v, (k / (n * v)) * n + k % n);
    let fwd = |k: usize| {
        let (c, mb) = slot(k);
        Action::f(stages[c], mb)
    };
    let bwd = |k: usize| {
        let (c, mb) = slot(k);
        Action::b(stages[v - 1 - c], mb)
    };
    let mut prog: Vec<Action> = (0..warmup).map(fwd).collect();
    for k in 0..total - warmup {
        prog.push(fwd(warmup + k));
        prog.push(bwd(k));
    }
    prog.extend((total - warmup..total).map(bwd));
    prog
}
