//! Text form (one line per node, `%12 = matmul(%3, %7) : f32[4,64,256]  # layers.0.attn.q_proj`),
//! DOT export and JSON (docs/ARCHITECTURE.md "Graph IR").

use crate::graph::{Graph, Phase, Region};
use crate::op::Op;
use std::fmt::Write;

fn meta_suffix(phase: Phase, region: &Region) -> String {
    let mut tags = Vec::new();
    if phase != Phase::Forward {
        tags.push(format!("{phase:?}").to_lowercase());
    }
    if let Region::Comm(name) = region {
        tags.push(format!("comm:{name}"));
    }
    if tags.is_empty() {
        String::new()
    } else {
        format!(" [{}]", tags.join(", "))
    }
}

/// The text form: a header line, one line per node, one `return` line listing the outputs.
/// Phase and region appear in brackets after the scope when not forward/compute.
pub fn to_text(g: &Graph) -> String {
    let mut s = format!("graph {} {{\n", g.name);
    for (i, n) in g.nodes.iter().enumerate() {
        let mut args: Vec<String> = n.inputs.iter().map(|v| format!("%{}", v.0)).collect();
        args.extend(n.op.attrs());
        let _ = write!(s, "%{i} = {}({}) : {}", n.op.mnemonic(), args.join(", "), n.ty);
        if !n.meta.scope.is_empty() || n.meta.phase != Phase::Forward || n.meta.region != Region::Compute {
            let _ = write!(s, "  # {}{}", n.meta.scope, meta_suffix(n.meta.phase, &n.meta.region));
        }
        s.push('\n');
    }
    let outs: Vec<String> = g.outputs.iter().map(|o| format!("{}=%{}", o.name, o.value.0)).collect();
    let _ = writeln!(s, "return {}\n}}", outs.join(", "));
    s
}

/// Graphviz DOT: one box per node (inputs as ellipses, collectives as hexagons, backward nodes
/// shaded), edges labelled with nothing, outputs as plain text nodes.
pub fn to_dot(g: &Graph) -> String {
    let mut s =
        format!("digraph \"{}\" {{\n  rankdir=TB;\n  node [fontname=monospace, fontsize=10];\n", g.name);
    for (i, n) in g.nodes.iter().enumerate() {
        let shape = match n.op {
            Op::Input { .. } => "ellipse",
            Op::CollectiveStart { .. } | Op::CollectiveWait => "hexagon",
            _ => "box",
        };
        let fill = match n.meta.phase {
            Phase::Forward => "white",
            Phase::Backward => "lightblue",
            Phase::Recompute => "khaki",
        };
        let label = format!("%{i} {}\\n{}\\n{}", n.op.mnemonic(), n.ty, n.meta.scope).replace('"', "'");
        let _ = writeln!(s, "  n{i} [label=\"{label}\", shape={shape}, style=filled, fillcolor={fill}];");
        for v in &n.inputs {
            let _ = writeln!(s, "  n{} -> n{i};", v.0);
        }
    }
    for (k, o) in g.outputs.iter().enumerate() {
        let _ = writeln!(s, "  out{k} [label=\"{}\", shape=plaintext];\n  n{} -> out{k};", o.name, o.value.0);
    }
    s.push_str("}\n");
    s
}

/// JSON form (serde), round-trippable with [`from_json`].
pub fn to_json(g: &Graph) -> String {
    serde_json::to_string_pretty(g).expect("graph serializes (plain data)")
}

/// Parses the JSON form. Errors: the serde message.
pub fn from_json(s: &str) -> Result<Graph, serde_json::Error> {
    serde_json::from_str(s)
}

/// Output format of [`render`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// One line per node.
    Text,
    /// Graphviz DOT.
    Dot,
    /// serde JSON.
    Json,
}

/// The graph in `format`.
pub fn render(g: &Graph, format: Format) -> String {
    match format {
        Format::Text => to_text(g),
        Format::Dot => to_dot(g),
        Format::Json => to_json(g),
    }
}

/// Summary for `--stats`: node count, inputs by kind, outputs, matmul FLOPs, and bytes of the
/// values of each phase, plus op counts.
pub fn stats(g: &Graph) -> String {
    let n = |count: usize, noun: &str| format!("{count} {noun}{}", if count == 1 { "" } else { "s" });
    let mut s = format!(
        "graph {}: {}, {}, {}\n",
        g.name,
        n(g.nodes.len(), "node"),
        n(g.inputs.len(), "input"),
        n(g.outputs.len(), "output")
    );
    let mut by_kind: std::collections::BTreeMap<String, (usize, usize)> = Default::default();
    for spec in g.input_specs() {
        let e = by_kind.entry(spec.kind.name().to_string()).or_default();
        e.0 += 1;
        e.1 += spec.ty.size_bytes();
    }
    for (k, (n, bytes)) in by_kind {
        let _ = writeln!(s, "  inputs {k}: {n} ({bytes} bytes)");
    }
    let _ = writeln!(s, "  matmul FLOPs: {}", g.matmul_flops());
    for p in [Phase::Forward, Phase::Backward, Phase::Recompute] {
        let n = g.nodes.iter().filter(|n| n.meta.phase == p && !matches!(n.op, Op::Input { .. })).count();
        if n > 0 {
            let _ = writeln!(s, "  {} nodes: {n}", format!("{p:?}").to_lowercase());
        }
    }
    let ops: Vec<String> = g.op_counts().into_iter().map(|(o, n)| format!("{o}={n}")).collect();
    let _ = writeln!(s, "  ops: {}", ops.join(" "));
    s
}
