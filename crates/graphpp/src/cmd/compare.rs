//! Formats `graphpp schedule compare` as a text table.

use std::fmt::Write;

use graphpp_schedule::compare::compare;
use graphpp_schedule::render::fixed;
use graphpp_schedule::{Costs, GenerateError, Memory};

/// The comparison table for `p` ranks and `m` microbatches.
///
/// # Errors
/// [`GenerateError::TooLarge`] when some kind's schedule would be too large to build.
pub fn table(p: usize, m: usize, costs: &Costs, memory: &Memory) -> Result<String, GenerateError> {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "p={p} m={m} costs {costs}, M_W = {} M_B; bubble = in-iteration r_bubble (idle fraction)",
        memory.m_w / memory.m_b
    );
    let _ = writeln!(
        out,
        "{:<20} {:>2} {:>9} {:>17} {:>10} {:>9}  constraints",
        "schedule", "v", "makespan", "bubble", "peak act", "msgs/mb"
    );
    for row in compare(p, m, costs, memory)? {
        let c = row.kind.constraints();
        match row.result {
            Ok(f) => {
                let _ = writeln!(
                    out,
                    "{:<20} {:>2} {:>9} {:>8.3} ({:>5.1}%) {:>10.2} {:>9.1}  {c}",
                    row.kind.name(),
                    row.stages_per_rank,
                    fixed(f.makespan, 2),
                    f.bubble_ratio,
                    f.idle_fraction * 100.0,
                    f.peak_activations,
                    f.messages_per_microbatch
                );
            }
            Err(e) => {
                let _ = writeln!(out, "{:<20} {:>2} unavailable: {e}", row.kind.name(), row.stages_per_rank);
            }
        }
    }
    Ok(out)
}
