//! Chrome trace JSON (the Trace Event Format's complete events, `ph: "X"`), which opens in
//! Perfetto and chrome://tracing. One thread per rank.

use serde_json::json;

use super::category;
use crate::timeline::Timeline;

/// Renders `t` as a Chrome trace. Timestamps are microseconds: a measured timeline in seconds is
/// scaled by 1e6; a simulated one maps one cost unit to 1 ms (1000 µs).
pub fn chrome_trace(t: &Timeline) -> String {
    let scale = if t.unit == "s" { 1e6 } else { 1e3 };
    let mut events: Vec<serde_json::Value> = (0..t.ranks)
        .map(|r| json!({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": format!("rank {r}")}}))
        .collect();
    for i in &t.intervals {
        events.push(json!({
            "name": i.action.to_string(),
            "cat": category(&i.action),
            "ph": "X",
            "pid": 0,
            "tid": i.rank,
            "ts": i.start * scale,
            "dur": (i.end - i.start) * scale,
        }));
    }
    serde_json::to_string(
        &json!({"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"unit": t.unit}}),
    )
    .expect("json values serialise")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::Action;
    use crate::timeline::Interval;

    #[test]
    fn complete_events_in_microseconds() {
        let t = Timeline {
            ranks: 2,
            unit: "s".into(),
            intervals: vec![Interval { rank: 1, start: 0.5, end: 0.75, action: Action::w(3, 2) }],
        };
        let v: serde_json::Value = serde_json::from_str(&chrome_trace(&t)).unwrap();
        let ev = &v["traceEvents"][2];
        assert_eq!(ev["name"], "3W2");
        assert_eq!(ev["cat"], "W");
        assert_eq!(ev["tid"], 1);
        assert_eq!(ev["ts"], 500000.0);
        assert_eq!(ev["dur"], 250000.0);
    }
}
