//! Microbatch routes: the contiguous range of stages each microbatch visits, read off a sequence
//! of actions. Every schedule but DualPipe routes all microbatches through `0..S`; DualPipe's
//! two directions are stages `0..p` and `p..2p`.

use std::ops::Range;

use crate::action::{Action, Task};

/// The route of every microbatch (index = microbatch; see [`crate::Schedule::route`]) over any
/// sequence of actions (e.g. a schedule's cells, idle steps skipped), in one pass; `None` for a
/// microbatch that no action names.
pub fn routes_of<'a>(actions: impl IntoIterator<Item = &'a Action>) -> Vec<Option<Range<usize>>> {
    let mut r: Vec<Option<Range<usize>>> = Vec::new();
    for t in actions.into_iter().flat_map(tasks_of) {
        widen_route(&mut r, t);
    }
    r
}

/// Widens `routes[t.mb]` (growing `routes` as needed) to include stage `t.stage`.
pub(crate) fn widen_route(routes: &mut Vec<Option<Range<usize>>>, t: Task) {
    if routes.len() <= t.mb {
        routes.resize(t.mb + 1, None);
    }
    match &mut routes[t.mb] {
        Some(x) => {
            x.start = x.start.min(t.stage);
            x.end = x.end.max(t.stage + 1);
        }
        r => *r = Some(t.stage..t.stage + 1),
    }
}

/// The (stage, microbatch) tasks an action names.
#[inline]
pub fn tasks_of(a: &Action) -> impl Iterator<Item = Task> {
    let (x, y) = match *a {
        Action::Compute { task, .. } | Action::Comm { task, .. } => (Some(task), None),
        Action::Overlap { f, b } => (Some(f), Some(b)),
        Action::StageOp { .. } => (None, None),
    };
    x.into_iter().chain(y)
}
