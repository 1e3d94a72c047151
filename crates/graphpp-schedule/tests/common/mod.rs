//! Test-side checks computed directly from a schedule's programs: completeness and per-stage order,
//! per-rank in-flight peaks, and a small as-soon-as-possible timing replay (docs/ARCHITECTURE.md "Simulation"
//! rule: an action starts at max(its rank is free, its dependencies finished); c = 0).
//!
//! The replay is independent of the generators so that the figure checks can fail.

#![allow(dead_code)]

use std::collections::HashMap;

use graphpp_schedule::{Action, ComputeKind, Schedule, Task};

/// Asserts docs/ARCHITECTURE.md's validation rules for a compute-only schedule over `m` microbatches: every
/// (stage, mb) of the microbatch's route has exactly one F and either one B (possibly inside
/// OVERLAP_F_B) or one I plus one W, all on one rank, F before B/I and I before W in program order;
/// no action names a (stage, mb) outside its route.
pub fn assert_complete(s: &Schedule, m: usize) -> Result<(), String> {
    // (stage, mb) -> list of (kind, rank, position)
    let mut seen: HashMap<Task, Vec<(ComputeKind, usize, usize)>> = HashMap::new();
    for (r, prog) in (0..s.num_ranks()).map(|r| (r, s.program(r))) {
        for (pos, a) in prog.iter().enumerate() {
            if !a.is_compute() {
                return Err(format!("rank {r} step {pos}: non-compute action {a}"));
            }
            for (k, t) in a.computes() {
                seen.entry(t).or_default().push((k, r, pos));
            }
        }
    }
    for mb in 0..m {
        let route = s.route(mb).ok_or(format!("microbatch {mb} never appears"))?;
        for stage in route.clone() {
            let t = Task::new(stage, mb);
            let acts = seen.remove(&t).ok_or(format!("{t:?} has no action"))?;
            let of = |k: ComputeKind| acts.iter().filter(|a| a.0 == k).collect::<Vec<_>>();
            let (f, b, i, w) =
                (of(ComputeKind::F), of(ComputeKind::B), of(ComputeKind::I), of(ComputeKind::W));
            if f.len() != 1 {
                return Err(format!("{t:?}: {} F's", f.len()));
            }
            let ranks: Vec<usize> = acts.iter().map(|a| a.1).collect();
            if ranks.iter().any(|&r| r != ranks[0]) {
                return Err(format!("{t:?}: actions on several ranks {ranks:?}"));
            }
            match (b.len(), i.len(), w.len()) {
                (1, 0, 0) => {
                    if b[0].2 <= f[0].2 {
                        return Err(format!("{t:?}: B not after F"));
                    }
                }
                (0, 1, 1) => {
                    if i[0].2 <= f[0].2 {
                        return Err(format!("{t:?}: I before F"));
                    }
                    if w[0].2 <= i[0].2 {
                        return Err(format!("{t:?}: W before I"));
                    }
                }
                other => return Err(format!("{t:?}: (B, I, W) counts {other:?}")),
            }
        }
    }
    if let Some(t) = seen.keys().next() {
        return Err(format!("{t:?} is outside its microbatch's route or beyond m={m}"));
    }
    Ok(())
}

/// Per-rank peak number of (stage, mb) in flight (F done, B/I not yet), counted after each
/// action; inside OVERLAP_F_B the F counts before the B (both graphs are live at once).
pub fn in_flight_peaks(s: &Schedule) -> Vec<usize> {
    (0..s.num_ranks())
        .map(|r| {
            let (mut cur, mut peak) = (0usize, 0usize);
            for a in s.program(r) {
                for (k, _) in a.computes() {
                    match k {
                        ComputeKind::F => {
                            cur += 1;
                            peak = peak.max(cur);
                        }
                        ComputeKind::B | ComputeKind::I => cur -= 1,
                        ComputeKind::W => {}
                    }
                }
            }
            peak
        })
        .collect()
}

/// Activation memory peak per rank with F +M_B, I −(M_B−M_W), W −M_W, B −M_B (M_B = 1).
pub fn memory_peaks(s: &Schedule, m_w: f64) -> Vec<f64> {
    (0..s.num_ranks())
        .map(|r| {
            let (mut cur, mut peak) = (0.0f64, 0.0f64);
            for a in s.program(r) {
                for (k, _) in a.computes() {
                    cur += match k {
                        ComputeKind::F => 1.0,
                        ComputeKind::I => -(1.0 - m_w),
                        ComputeKind::W => -m_w,
                        ComputeKind::B => -1.0,
                    };
                    peak = peak.max(cur);
                }
            }
            peak
        })
        .collect()
}

/// Durations for the replay.
#[derive(Clone, Copy)]
pub struct Unit {
    pub f: f64,
    pub b: f64,
    pub i: f64,
    pub w: f64,
}

/// T_F = T_I = T_W = 1, T_B = 2 (docs/ARCHITECTURE.md reference costs).
pub const UNIT: Unit = Unit { f: 1.0, b: 2.0, i: 1.0, w: 1.0 };

/// Per-rank timeline of the replay: (start, end) of each action in program order.
pub struct Timeline {
    pub spans: Vec<Vec<(f64, f64)>>,
    pub busy: Vec<f64>,
}

impl Timeline {
    pub fn makespan(&self) -> f64 {
        self.spans.iter().flatten().map(|x| x.1).fold(0.0, f64::max)
    }
    /// In-iteration idle of rank r: makespan − busy.
    pub fn idle(&self, r: usize) -> f64 {
        self.makespan() - self.busy[r]
    }
    /// Steady-state bubble of rank r: first start → last end, minus busy.
    pub fn steady_bubble(&self, r: usize) -> f64 {
        let sp = &self.spans[r];
        match (sp.first(), sp.last()) {
            (Some(a), Some(b)) => b.1 - a.0 - self.busy[r],
            _ => 0.0,
        }
    }
}

/// As-soon-as-possible replay: F(s,j) waits for F of the previous stage on j's route; B/I(s,j) for
/// B/I of the next stage on the route, or its own F on the route's last stage; W for its own I.
/// OVERLAP_F_B lasts T_F + T_B and waits for both halves' dependencies. Errors on a deadlock.
pub fn replay(s: &Schedule, u: Unit) -> Result<Timeline, String> {
    let p = s.num_ranks();
    let progs: Vec<Vec<Action>> = (0..p).map(|r| s.program(r)).collect();
    let m = s.num_microbatches();
    let routes: Vec<std::ops::Range<usize>> = (0..m).map(|j| s.route(j).unwrap_or(0..0)).collect();
    let mut done: HashMap<(ComputeKind, Task), f64> = HashMap::new();
    let mut next = vec![0usize; p];
    let mut free = vec![0.0f64; p];
    let mut spans = vec![Vec::new(); p];
    let mut busy = vec![0.0; p];
    let bwd_done = |done: &HashMap<(ComputeKind, Task), f64>, t: Task| {
        done.get(&(ComputeKind::B, t)).or(done.get(&(ComputeKind::I, t))).copied()
    };
    loop {
        let mut progress = false;
        for r in 0..p {
            while let Some(a) = progs[r].get(next[r]) {
                let mut ready = free[r];
                let mut ok = true;
                for (k, t) in a.computes() {
                    let route = &routes[t.mb];
                    let dep = match k {
                        ComputeKind::F if t.stage > route.start => {
                            done.get(&(ComputeKind::F, Task::new(t.stage - 1, t.mb))).copied()
                        }
                        ComputeKind::F => Some(0.0),
                        ComputeKind::B | ComputeKind::I if t.stage + 1 < route.end => {
                            bwd_done(&done, Task::new(t.stage + 1, t.mb))
                        }
                        ComputeKind::B | ComputeKind::I => done.get(&(ComputeKind::F, t)).copied(),
                        ComputeKind::W => done.get(&(ComputeKind::I, t)).copied(),
                    };
                    match dep {
                        Some(d) => ready = ready.max(d),
                        None => ok = false,
                    }
                }
                if !ok {
                    break;
                }
                let dur: f64 = a
                    .computes()
                    .map(|(k, _)| match k {
                        ComputeKind::F => u.f,
                        ComputeKind::B => u.b,
                        ComputeKind::I => u.i,
                        ComputeKind::W => u.w,
                    })
                    .sum();
                let end = ready + dur;
                for (k, t) in a.computes() {
                    done.insert((k, t), end);
                }
                spans[r].push((ready, end));
                busy[r] += dur;
                free[r] = end;
                next[r] += 1;
                progress = true;
            }
        }
        if (0..p).all(|r| next[r] == progs[r].len()) {
            return Ok(Timeline { spans, busy });
        }
        if !progress {
            let stuck: Vec<String> =
                (0..p).filter_map(|r| progs[r].get(next[r]).map(|a| format!("rank {r} at {a}"))).collect();
            return Err(format!("deadlock: {}", stuck.join(", ")));
        }
    }
}
