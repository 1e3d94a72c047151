//! Chrome trace JSON (the Trace Event Format's complete events, `ph: "X"`), which opens in
//! Perfetto and chrome://tracing. Two threads per rank: `rank r` for its compute actions and
//! `rank r comm` for its SEND/RECV, WAIT and FSDP/REDUCE_GRAD actions, so the time a rank spends
//! waiting for or handing over data shows as its own track.

use serde_json::json;

use super::category;
use crate::timeline::Timeline;

/// Renders `t` as a Chrome trace. Timestamps are microseconds: a measured timeline in seconds is
/// scaled by 1e6; a simulated one maps one cost unit to 1 ms (1000 µs).
pub fn chrome_trace(t: &Timeline) -> String {
    let scale = if t.unit == "s" { 1e6 } else { 1e3 };
    let name = |tid: usize| {
        let (r, comm) = (tid % t.ranks.max(1), tid >= t.ranks);
        json!({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
               "args": {"name": if comm { format!("rank {r} comm") } else { format!("rank {r}") }}})
    };
    let mut events: Vec<serde_json::Value> = (0..2 * t.ranks).map(name).collect();
    for i in &t.intervals {
        let tid = if i.action.is_compute() { i.rank } else { t.ranks + i.rank };
        events.push(json!({
            "name": i.action.to_string(),
            "cat": category(&i.action),
            "ph": "X",
            "pid": 0,
            "tid": tid,
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
        let ev = &v["traceEvents"][4];
        assert_eq!(ev["name"], "3W2");
        assert_eq!(ev["cat"], "W");
        assert_eq!(ev["tid"], 1);
        assert_eq!(ev["ts"], 500000.0);
        assert_eq!(ev["dur"], 250000.0);
    }

    #[test]
    fn communication_has_its_own_track_per_rank() {
        let t = Timeline {
            ranks: 2,
            unit: "s".into(),
            intervals: vec![
                Interval { rank: 1, start: 0.0, end: 0.1, action: "1RECV_F0".parse().unwrap() },
                Interval { rank: 1, start: 0.1, end: 0.2, action: Action::f(1, 0) },
            ],
        };
        let v: serde_json::Value = serde_json::from_str(&chrome_trace(&t)).unwrap();
        let ev = v["traceEvents"].as_array().unwrap();
        assert_eq!(ev[3]["args"]["name"], "rank 1 comm");
        assert_eq!((ev[4]["name"].as_str(), ev[4]["tid"].as_u64()), (Some("1RECV_F0"), Some(3)));
        assert_eq!((ev[5]["name"].as_str(), ev[5]["tid"].as_u64()), (Some("1F0"), Some(1)));
    }
}
