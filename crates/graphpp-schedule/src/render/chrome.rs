//! Chrome trace JSON (the Trace Event Format's complete events, `ph: "X"`), which opens in
//! Perfetto and chrome://tracing. Two threads per rank: `rank r` for its compute actions and
//! `rank r comm` for its SEND/RECV, WAIT and FSDP/REDUCE_GRAD actions, so the time a rank spends
//! waiting for or handing over data shows as its own track. A measured timeline's in-graph
//! collectives ([`crate::CommSpan`], e.g. expert parallelism's all-to-all) are async slices
//! (`b`/`e` events, named `<label> (rank r)`: Perfetto gives each name its own track under the
//! process), from start to completion, so one in flight across compute — and two in flight at
//! once — are visible; their `blocked` argument is the part the rank waited.

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
    for (id, c) in t.comm.iter().enumerate() {
        let tid = t.ranks + c.rank;
        let args = json!({"action": c.action.to_string(), "blocked": c.blocked() * scale});
        for (ph, ts) in [("b", c.start), ("e", c.end)] {
            events.push(json!({
                "name": format!("{} (rank {})", c.label, c.rank), "cat": "comm", "ph": ph, "id": id, "pid": 0, "tid": tid,
                "ts": ts * scale, "args": args,
            }));
        }
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
            comm: Vec::new(),
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
            comm: Vec::new(),
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

    /// Two in-graph collectives in flight at once (an overlapped F&B's) are async slices named
    /// with their rank, each from its start to its completion, with the blocked part.
    #[test]
    fn in_graph_collectives_are_async_slices_on_the_comm_track() {
        let f = "(1F2;1B0)OVERLAP_F_B".parse().unwrap();
        let span = |start, wait, end, label: &str| crate::CommSpan {
            rank: 1,
            action: f,
            start,
            wait,
            end,
            label: label.into(),
        };
        let t = Timeline {
            ranks: 2,
            intervals: vec![Interval { rank: 1, start: 0.0, end: 0.5, action: f }],
            comm: vec![span(0.1, 0.3, 0.35, "ep.dispatch"), span(0.2, 0.4, 0.4, "ep.combine")],
            unit: "s".into(),
        };
        let v: serde_json::Value = serde_json::from_str(&chrome_trace(&t)).unwrap();
        let ev = &v["traceEvents"].as_array().unwrap()[5..];
        let got: Vec<_> = ev
            .iter()
            .map(|e| (e["name"].as_str().unwrap(), e["ph"].as_str().unwrap(), e["ts"].as_f64().unwrap()))
            .collect();
        assert_eq!(
            got,
            [
                ("ep.dispatch (rank 1)", "b", 1e5),
                ("ep.dispatch (rank 1)", "e", 3.5e5),
                ("ep.combine (rank 1)", "b", 2e5),
                ("ep.combine (rank 1)", "e", 4e5)
            ]
        );
        assert!(ev.iter().all(|e| e["tid"] == 3 && e["cat"] == "comm"));
        assert_eq!((ev[0]["id"].as_u64(), ev[2]["id"].as_u64()), (Some(0), Some(1)));
        assert!((ev[0]["args"]["blocked"].as_f64().unwrap() - 5e4).abs() < 1e-6);
        assert_eq!(ev[0]["args"]["action"], "(1F2;1B0)OVERLAP_F_B");
    }
}
