//! A map keyed by (slot, stage, microbatch), the lookup table of the validator, the lowering
//! passes and the dependency graph.
//!
//! Stages and microbatches are small dense ranges in real schedules, so the map is a flat vector
//! indexed by `(slot · S + stage) · m + mb`. When the key ranges are far larger than the number of
//! entries expected (bad input such as stage 10^12) it is a hash map instead, so that no input can
//! make it allocate more than a few slots per action.
//!
//! A dense cell is one `u64` ([`Packed`]), 0 meaning empty: the zeroed table comes from the
//! allocator as untouched zero pages, so slots a schedule never uses (e.g. B in a ZB schedule, the
//! comm kinds of a compute-only one) cost no page faults.

use std::collections::HashMap;

use crate::action::Task;

/// A value stored in a dense [`TaskMap`] cell as a non-zero `u64`.
pub(crate) trait Packed: Copy {
    /// The value as a non-zero `u64`.
    fn pack(self) -> u64;
    /// The value of a non-zero `u64` from [`Packed::pack`].
    fn unpack(x: u64) -> Self;
}

impl Packed for usize {
    #[inline]
    fn pack(self) -> u64 {
        self as u64 + 1
    }
    #[inline]
    fn unpack(x: u64) -> Self {
        (x - 1) as usize
    }
}

impl Packed for u32 {
    #[inline]
    fn pack(self) -> u64 {
        u64::from(self) + 1
    }
    #[inline]
    fn unpack(x: u64) -> Self {
        (x - 1) as u32
    }
}

/// Packs two `u32`s (e.g. rank and step) as a non-zero `u64`: `(a + 1) · 2^32 + b`.
#[inline]
pub(crate) fn pack_pair(a: u32, b: u32) -> u64 {
    ((u64::from(a) + 1) << 32) | u64::from(b)
}

/// The two `u32`s of [`pack_pair`].
#[inline]
pub(crate) fn unpack_pair(x: u64) -> (u32, u32) {
    (((x >> 32) - 1) as u32, x as u32)
}

/// Values keyed by (slot, [`Task`]); `slot` is a small kind index (e.g. a [`crate::ComputeKind`]).
#[derive(Debug, Clone)]
pub(crate) enum TaskMap<V> {
    /// `slots × stages × mbs` cells, 0 = empty, else [`Packed::pack`] of the value.
    Dense { stages: usize, mbs: usize, cells: Vec<u64> },
    /// Any key.
    Sparse(HashMap<(usize, Task), V>),
}

impl<V: Packed> TaskMap<V> {
    /// A map for keys with `slot < slots`, `stage < stages` and `mb < mbs`, expected to hold about
    /// `entries` values; dense unless the key space is more than 16 times that (plus 2^16): a
    /// compute-only schedule fills only 2–3 of the 4 + 6 slots of the dependency walk's producer
    /// tables (`deps::Index`), so a smaller factor (4) sent the common case (interleaved 1F1B at
    /// p = 64, v = 2, m = 1024) to the hash map, several times slower to validate than the dense
    /// table (measured: docs/PERFORMANCE.md, "Schedule toolchain"). Untouched dense cells are
    /// zero pages.
    pub fn new(slots: usize, stages: usize, mbs: usize, entries: usize) -> Self {
        let keys = slots.saturating_mul(stages).saturating_mul(mbs);
        if keys <= entries.saturating_mul(16).saturating_add(1 << 16) {
            TaskMap::Dense { stages, mbs, cells: vec![0; keys] }
        } else {
            TaskMap::Sparse(HashMap::new())
        }
    }

    /// A map keyed by stage only (slot 0, microbatch 0).
    pub fn by_stage(stages: usize, entries: usize) -> Self {
        Self::new(1, stages, 1, entries)
    }

    #[inline(always)]
    fn index(&self, slot: usize, t: Task) -> Option<usize> {
        match self {
            TaskMap::Dense { stages, mbs, cells } => {
                let i = (t.stage < *stages && t.mb < *mbs).then(|| (slot * stages + t.stage) * mbs + t.mb);
                i.filter(|&i| i < cells.len())
            }
            TaskMap::Sparse(_) => None,
        }
    }

    /// The value at (slot, t).
    #[inline(always)]
    pub fn get(&self, slot: usize, t: Task) -> Option<V> {
        match self {
            TaskMap::Dense { cells, .. } => {
                self.index(slot, t).map(|i| cells[i]).filter(|&x| x != 0).map(V::unpack)
            }
            TaskMap::Sparse(map) => map.get(&(slot, t)).copied(),
        }
    }

    /// The value of `stage` in a [`TaskMap::by_stage`] map.
    #[inline]
    pub fn of_stage(&self, stage: usize) -> Option<V> {
        self.get(0, Task::new(stage, 0))
    }

    /// Sets (slot, t) to `v` unless it holds a value; returns the value it held.
    ///
    /// A dense map ignores keys outside its ranges (callers size it to hold every key).
    #[inline(always)]
    pub fn first(&mut self, slot: usize, t: Task, v: V) -> Option<V> {
        let i = self.index(slot, t);
        match self {
            TaskMap::Dense { cells, .. } => {
                let cell = &mut cells[i?];
                if *cell != 0 {
                    return Some(V::unpack(*cell));
                }
                *cell = v.pack();
                None
            }
            TaskMap::Sparse(map) => {
                let old = map.get(&(slot, t)).copied();
                map.entry((slot, t)).or_insert(v);
                old
            }
        }
    }

    /// Sets (slot, t) to `v`.
    #[inline]
    pub fn set(&mut self, slot: usize, t: Task, v: V) {
        let i = self.index(slot, t);
        match self {
            TaskMap::Dense { cells, .. } => {
                if let Some(i) = i {
                    cells[i] = v.pack();
                }
            }
            TaskMap::Sparse(map) => {
                map.insert((slot, t), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_and_sparse_agree() {
        let dense: TaskMap<u32> = TaskMap::new(2, 3, 4, 24);
        let sparse: TaskMap<u32> = TaskMap::new(2, 1 << 40, 1 << 20, 24);
        assert!(matches!(dense, TaskMap::Dense { .. }));
        assert!(matches!(sparse, TaskMap::Sparse(_)));
        for mut m in [dense, sparse] {
            assert_eq!(m.first(1, Task::new(2, 3), 7), None);
            assert_eq!(m.first(1, Task::new(2, 3), 8), Some(7));
            assert_eq!(m.get(1, Task::new(2, 3)), Some(7));
            assert_eq!(m.get(0, Task::new(2, 3)), None);
            assert_eq!(m.get(1, Task::new(3, 2)), None);
            m.set(1, Task::new(2, 3), 9);
            assert_eq!(m.get(1, Task::new(2, 3)), Some(9));
        }
    }
}
