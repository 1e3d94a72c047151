//! The executor's live-byte accounting (module doc of [`crate::exec`]): each value counted from
//! when its node runs until its last use, state and values of state alone not at all.

use graphpp_graph::{Graph, InputKind, Op, ValueId};

/// The peak live bytes a run of `graph` reports ([`ExecReport::peak_live_bytes`]), from the
/// value types alone: the same accounting (module doc), without running anything. Exact for
/// every graph whose value shapes are static (all of graphpp's); a compiled [`Program`] runs
/// the nodes in another order only where that order peaks exactly as high ([`crate::exec::pairs`]).
pub fn peak_live_bytes(graph: &Graph) -> usize {
    let n = graph.nodes.len();
    peak_in_order(graph, &(0..n).collect::<Vec<_>>(), &vec![None; n])
}

/// [`peak_live_bytes`] over the nodes run in `order` (every node once, a topological order),
/// where `partner[i] = Some(j)` runs `j` beside `i` ([`crate::exec::pairs`]): both values exist before
/// either node's operands are released, as [`exec`] holds them.
pub(super) fn peak_in_order(graph: &Graph, order: &[usize], partner: &[Option<usize>]) -> usize {
    let mut live = Liveness::new(graph);
    let mut deferred = None;
    for &i in order {
        live.produce(i);
        for k in released(i, partner, &mut deferred) {
            live.release(k, &graph.nodes[k].inputs, |_| {});
        }
    }
    live.peak
}

/// The executor's live-byte accounting (module doc): each value counted from when its node runs
/// until its last use (outputs to the end), state and values of state alone not at all.
pub(super) struct Liveness {
    /// Remaining uses of each value (`usize::MAX` for an output: never freed).
    uses: Vec<usize>,
    /// Bytes each value counts while it lives.
    bytes: Vec<usize>,
    live: usize,
    /// Largest `live` so far.
    pub(super) peak: usize,
}

impl Liveness {
    pub(super) fn new(graph: &Graph) -> Self {
        let mut uses = vec![0usize; graph.nodes.len()];
        for node in &graph.nodes {
            for x in &node.inputs {
                uses[x.0] += 1;
            }
        }
        for o in &graph.outputs {
            uses[o.value.0] = usize::MAX;
        }
        let state = state_derived(graph);
        let bytes =
            graph.nodes.iter().zip(&state).map(|(n, &s)| if s { 0 } else { n.ty.size_bytes() }).collect();
        Liveness { uses, bytes, live: 0, peak: 0 }
    }

    /// Node `i`'s value now lives; whether that makes a new peak.
    #[inline]
    pub(super) fn produce(&mut self, i: usize) -> bool {
        self.live += self.bytes[i];
        let new_peak = self.live > self.peak;
        self.peak = self.peak.max(self.live);
        new_peak
    }

    /// After node `i` (reading `inputs`) ran: frees it if nothing reads it and each input it
    /// was the last use of, calling `free` with each freed value.
    #[inline]
    pub(super) fn release(&mut self, i: usize, inputs: &[ValueId], mut free: impl FnMut(usize)) {
        if self.uses[i] == 0 {
            free(i);
            self.live -= self.bytes[i];
        }
        for x in inputs {
            if self.uses[x.0] != usize::MAX {
                self.uses[x.0] -= 1;
                if self.uses[x.0] == 0 {
                    free(x.0);
                    self.live -= self.bytes[x.0];
                }
            }
        }
    }
}

/// Values computed only from parameters and buffers (no constants, no collectives).
fn state_derived(g: &Graph) -> Vec<bool> {
    let mut s = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        s[i] = match &n.op {
            Op::Input { kind, .. } => matches!(kind, InputKind::Parameter | InputKind::Buffer),
            Op::Full { .. } | Op::CollectiveStart { .. } | Op::CollectiveWait => false,
            _ => n.inputs.iter().all(|x| s[x.0]),
        };
    }
    s
}

/// The nodes whose operands are released once node `i` has run: none after the first of a pair
/// (kept in `deferred`), both after its partner, else `i` — a pair's two values exist at once
/// ([`crate::exec::pairs`]). The one rule of the run ([`super::program`]) and its accounting ([`peak_in_order`]).
pub(super) fn released(
    i: usize,
    partner: &[Option<usize>],
    deferred: &mut Option<usize>,
) -> impl Iterator<Item = usize> {
    if partner[i].is_some() {
        *deferred = Some(i);
        None.into_iter().chain(None)
    } else {
        deferred.take().into_iter().chain(Some(i))
    }
}
