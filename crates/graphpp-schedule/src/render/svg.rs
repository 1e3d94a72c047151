//! SVG timeline: one lane per rank, one rectangle per action coloured by kind, labelled with its
//! action text.

use std::fmt::Write;

use super::{category, rgb, xml_escape};
use crate::timeline::Timeline;

const LANE: f64 = 28.0;
const LEFT: f64 = 70.0;
const WIDTH: f64 = 1200.0;

/// Renders `t` as a standalone SVG document (width 1200 px + margin, 28 px per rank lane).
pub fn svg(t: &Timeline) -> String {
    let makespan = t.makespan().max(1e-12);
    let scale = WIDTH / makespan;
    let height = LANE * t.ranks as f64 + 40.0;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" font-family="monospace" font-size="10">"#,
        w = WIDTH + LEFT + 10.0
    );
    for r in 0..t.ranks {
        let y = r as f64 * LANE + 10.0;
        let _ = writeln!(out, r#"<text x="4" y="{}">rank {r}</text>"#, y + LANE / 2.0 + 3.0);
    }
    for i in &t.intervals {
        let (x, w) = (LEFT + i.start * scale, ((i.end - i.start) * scale).max(0.5));
        let y = i.rank as f64 * LANE + 10.0;
        let (r, g, b) = rgb(category(&i.action));
        let _ = writeln!(
            out,
            r#"<g><title>{a} [{s}, {e}] {u}</title><rect x="{x:.2}" y="{y}" width="{w:.2}" height="{h}" fill="rgb({r},{g},{b})" stroke="white" stroke-width="0.5"/>"#,
            a = xml_escape(&i.action.to_string()),
            s = i.start,
            e = i.end,
            u = xml_escape(&t.unit),
            h = LANE - 4.0
        );
        if w > 18.0 {
            let _ = writeln!(
                out,
                r#"<text x="{:.2}" y="{}">{}</text>"#,
                x + 2.0,
                y + LANE / 2.0 + 1.0,
                xml_escape(&i.action.to_string())
            );
        }
        out.push_str("</g>\n");
    }
    let _ = writeln!(
        out,
        r#"<text x="{LEFT}" y="{}">makespan {} {}</text>"#,
        height - 8.0,
        t.makespan(),
        xml_escape(&t.unit)
    );
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::Action;
    use crate::timeline::Interval;

    #[test]
    fn one_rect_per_interval_scaled_to_width() {
        let t = Timeline {
            ranks: 1,
            comm: Vec::new(),
            unit: "unit".into(),
            intervals: vec![
                Interval { rank: 0, start: 0.0, end: 1.0, action: Action::f(0, 0) },
                Interval { rank: 0, start: 1.0, end: 4.0, action: Action::b(0, 0) },
            ],
        };
        let s = svg(&t);
        assert_eq!(s.matches("<rect").count(), 2);
        assert!(s.contains(r#"x="370.00" y="10" width="900.00""#), "{s}");
        assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
    }

    #[test]
    fn the_unit_is_escaped() {
        let t = Timeline {
            ranks: 1,
            comm: Vec::new(),
            unit: "<s&'\"".into(),
            intervals: vec![Interval { rank: 0, start: 0.0, end: 1.0, action: Action::f(0, 0) }],
        };
        let s = svg(&t);
        assert!(s.contains("makespan 1 &lt;s&amp;&#39;&quot;</text>"), "{s}");
    }
}
