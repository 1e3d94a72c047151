//! How big a generated schedule would be, from the kind and the shape alone, so that a shape too
//! large to build is refused before anything is allocated (`--microbatches 1000000000` once grew to
//! 16.9 GB in a minute; ZB-V with `--ranks 100000` never ended).
//!
//! The count is of compute actions (F, B, I, W, OVERLAP_F_B): a microbatch visits `S = p·v`
//! stages (DualPipe: the `p` stages of its direction), with two actions per visit (F, B) or three
//! (F, I, W) where the kind splits the backward. Lowering adds at most two SEND/RECV per F and per
//! backward, which take less memory per action than a simulated compute action, so the compute
//! count prices the whole chain. Some generators build more than they keep: ZB auto runs its
//! heuristic for 8 flag combinations. (ZB-V counts its padding microbatches, up to `2p − 1`,
//! without building them.)

use super::{GenerateError, Kind, Shape};

/// Most actions a generator may build: 3·10^7, about 4.8 GB at [`BYTES_PER_ACTION`] (the
/// benchmark shape p = 64, v = 2, m = 1024 of ZB-V builds 3.9·10^5).
pub const MAX_ACTIONS: u128 = 30_000_000;

/// Bytes per compute action of generating, validating and simulating a schedule at their peak,
/// rounded up from the measured peak RSS of `graphpp schedule simulate --format json` (debug
/// build): 53 MB for ZB-V p = 64, v = 2, m = 1024 (393,216 actions; 135 B each) and 70 MB for 1F1B
/// p = 64, m = 4096 (524,288 actions; 134 B each).
pub const BYTES_PER_ACTION: u128 = 160;

/// The size of a kind's schedule at a shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleSize {
    /// Compute actions of the schedule (an upper bound for DualPipe and DualPipeV, whose
    /// OVERLAP_F_B pairs count once for an F and a B).
    pub actions: u128,
    /// Actions the generator builds on the way (ZB auto's retries); at least `actions`.
    pub built: u128,
}

impl ScheduleSize {
    /// Estimated peak memory of building and simulating the schedule, in bytes.
    pub fn bytes(&self) -> u128 {
        self.built.saturating_mul(BYTES_PER_ACTION)
    }
}

/// The size of `kind`'s schedule for `shape` (saturating; no shape check).
pub fn estimate(kind: Kind, shape: &Shape) -> ScheduleSize {
    let (p, v, m) = (shape.ranks as u128, shape.stages_per_rank as u128, shape.microbatches as u128);
    let visits = match kind {
        Kind::DualPipe => p.saturating_mul(m),
        _ => p.saturating_mul(v).saturating_mul(m),
    };
    let per_visit = match kind {
        Kind::Gpipe | Kind::OneFOneB | Kind::Interleaved1F1B | Kind::LoopedBfs | Kind::GroupedInterleaved => {
            2
        }
        _ => 3,
    };
    let actions = visits.saturating_mul(per_visit);
    let built = match kind {
        Kind::ZbAuto | Kind::ZbvAuto => actions.saturating_mul(8),
        _ => actions,
    };
    ScheduleSize { actions, built: built.max(actions) }
}

/// [`estimate`], refused above [`MAX_ACTIONS`].
///
/// # Errors
/// [`GenerateError::TooLarge`] naming the shape, the estimate and the limit.
pub fn check_size(kind: Kind, shape: &Shape) -> Result<ScheduleSize, GenerateError> {
    let size = estimate(kind, shape);
    if size.built > MAX_ACTIONS {
        return Err(GenerateError::TooLarge {
            kind,
            ranks: shape.ranks,
            stages_per_rank: shape.stages_per_rank,
            microbatches: shape.microbatches,
            actions: size.built,
            bytes: size.bytes(),
        });
    }
    Ok(size)
}

/// `n` bytes in the largest unit that keeps the number at least 1 (`190 GB`, `4.8 GB`, `512 B`),
/// decimal units; `inf`-safe for `u128`.
pub fn human_bytes(n: u128) -> String {
    const UNITS: [&str; 7] = ["B", "kB", "MB", "GB", "TB", "PB", "EB"];
    let mut x = n as f64;
    let mut unit = 0;
    while x >= 1000.0 && unit + 1 < UNITS.len() {
        x /= 1000.0;
        unit += 1;
    }
    if x >= 1000.0 {
        format!("{:.1e} B", n as f64)
    } else if unit == 0 {
        format!("{n} B")
    } else if x < 10.0 {
        format!("{x:.1} {}", UNITS[unit])
    } else {
        format!("{x:.0} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{generate, Options};

    /// The estimate is the exact compute-action count for every kind but DualPipe(V), and an upper
    /// bound within a factor 3 for those (OVERLAP_F_B merges an F and a B into one action).
    #[test]
    fn estimate_counts_the_actions_generators_emit() {
        for kind in Kind::ALL {
            for (p, m) in [(1, 1), (2, 3), (4, 8), (3, 7), (4, 16), (6, 5)] {
                let shape = Shape::new(p, kind.default_stages_per_rank(), m);
                let Ok(s) = generate(kind, &shape, &Options::default()) else { continue };
                let got = s.actions().count() as u128;
                let est = estimate(kind, &shape);
                if matches!(kind, Kind::DualPipe | Kind::DualPipeV) {
                    assert!(got <= est.actions && 3 * got >= est.actions, "{kind} {p} {m}: {got} vs {est:?}");
                } else {
                    assert_eq!(got, est.actions, "{kind} p={p} m={m}");
                }
                assert!(est.built >= est.actions);
            }
        }
    }

    #[test]
    fn huge_shapes_are_refused_before_building() {
        // 1F1B, 4 ranks, 10^9 microbatches: 8·10^9 actions.
        let e = check_size(Kind::OneFOneB, &Shape::new(4, 1, 1_000_000_000)).unwrap_err();
        assert!(matches!(e, GenerateError::TooLarge { actions: 8_000_000_000, .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains("8.0e9 actions") && text.contains("1.3 TB") && text.contains("3.0e7"),
            "{text}"
        );
        // ZB-V counts its padding without building it: 10^5 ranks and 8 microbatches build the
        // 4.8·10^6 actions they keep (not 1.2·10^11); 10^6 ranks are refused.
        let z = estimate(Kind::Zbv, &Shape::new(100_000, 2, 8));
        assert_eq!((z.actions, z.built), (4_800_000, 4_800_000));
        assert!(check_size(Kind::Zbv, &Shape::new(100_000, 2, 8)).is_ok());
        assert!(check_size(Kind::Zbv, &Shape::new(1_000_000, 2, 8)).is_err());
        // Saturates instead of overflowing.
        let big = estimate(Kind::Gpipe, &Shape::new(usize::MAX, usize::MAX, usize::MAX));
        assert_eq!(big.actions, u128::MAX);
        // The benchmark shape is far below the limit.
        assert!(check_size(Kind::Zbv, &Shape::new(64, 2, 1024)).is_ok());
    }

    #[test]
    fn bytes_read_as_people_write_them() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(4_800_000_000), "4.8 GB");
        assert_eq!(human_bytes(190_000_000_000), "190 GB");
        assert_eq!(human_bytes(u128::MAX), "3.4e38 B");
    }
}
