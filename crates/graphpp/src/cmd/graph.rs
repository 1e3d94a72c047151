//! `graphpp graph`: show one stage's graphs (fw, full_bw, bw_di, bw_dw, overlap) of a model as
//! text, DOT or JSON, with `--stats` for node counts, FLOPs and saved-activation bytes.

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use graphpp_graph::print::{render, stats, Format};
use graphpp_graph::{Graph, GraphKind, InputKind, StageGraphs};
use graphpp_models::{split_layers, Model, Recompute, StageOptions};

use crate::cmd::value::count;

/// Arguments of `graphpp graph`.
#[derive(Args)]
pub struct GraphArgs {
    /// Model: a preset or a JSON config file (as for `graphpp train`).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Number of pipeline stages S.
    #[arg(long, default_value_t = 1, allow_hyphen_values = true, value_parser = count::<usize>)]
    stages: usize,
    /// Which stage to show (0-based).
    #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = count::<usize>)]
    stage: usize,
    /// Uneven split: decoder layers per stage, comma-separated (must sum to the model's layers).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true, value_parser = count::<usize>)]
    layers_per_stage: Option<Vec<usize>>,
    /// Which graph: fw, full_bw, bw_di, bw_dw, overlap.
    #[arg(long, default_value = "fw")]
    show: GraphKind,
    /// Output format.
    #[arg(long, value_enum, default_value_t = GraphFormat::Text)]
    format: GraphFormat,
    /// Print statistics of every graph of the stage instead of one graph.
    #[arg(long)]
    stats: bool,
    /// Sequences per microbatch B.
    #[arg(long, default_value_t = 1, allow_hyphen_values = true, value_parser = count::<usize>)]
    microbatch_size: usize,
    /// Tokens per sequence T.
    #[arg(long, default_value_t = 64, allow_hyphen_values = true, value_parser = count::<usize>)]
    seq_len: usize,
    /// Activation checkpointing: pointwise, save-all, stage-inputs, matmuls, layers.
    #[arg(long, default_value = "pointwise")]
    recompute: Recompute,
}

/// Graph output formats.
#[derive(Clone, Copy, ValueEnum)]
pub enum GraphFormat {
    /// One line per node: `%12 = matmul(%3, %7) : f32[4,64,256]  # scope`.
    Text,
    /// Graphviz DOT.
    Dot,
    /// JSON.
    Json,
}

fn saved_bytes(g: &Graph) -> usize {
    g.outputs
        .iter()
        .filter(|o| graphpp_graph::names::is_saved(&o.name))
        .map(|o| g.node(o.value).ty.size_bytes())
        .sum()
}

/// Bytes W holds from I to W: `bw_dw`'s inputs that are not stage state (the stash and the
/// saved values it reads), and their count.
fn held_for_w(dw: &Graph) -> (usize, usize) {
    let held: Vec<usize> = dw
        .input_specs()
        .iter()
        .filter(|i| !matches!(i.kind, InputKind::Parameter | InputKind::Buffer))
        .map(|i| i.ty.size_bytes())
        .collect();
    (held.len(), held.iter().sum())
}

fn all_stats(sg: &StageGraphs) -> Result<String> {
    let values = sg.saved.len();
    let m_b = saved_bytes(&sg.fw);
    let mut out = format!(
        "saved activations (fw → bw): {values} value{}, {m_b} bytes per microbatch\n",
        if values == 1 { "" } else { "s" },
    );
    if let Some((_, dw)) = &sg.di_dw {
        let (n, bytes) = held_for_w(dw);
        // The simulator's --m-w is a fraction of M_B in [0, 1]; a recompute policy under which
        // F saves less than W holds (or nothing) has no such fraction to suggest.
        let ratio = bytes as f64 / m_b as f64;
        let m_w = if m_b == 0 {
            "F saves nothing under this recompute policy: no M_W / M_B".to_string()
        } else if ratio <= 1.0 {
            format!("M_W / M_B = {ratio:.3}: `graphpp schedule simulate --m-w {ratio:.3}`")
        } else {
            format!("M_W / M_B = {ratio:.3}, more than the simulator's --m-w takes (at most 1): W holds values F does not save under this recompute policy")
        };
        out.push_str(&format!(
            "held for W (I → W): {n} value{}, {bytes} bytes per microbatch ({m_w})\n",
            if n == 1 { "" } else { "s" },
        ));
    }
    for kind in GraphKind::ALL {
        match sg.select(kind) {
            Ok(g) => out.push_str(&stats(&g)),
            Err(e) => out.push_str(&format!("graph {}: {e}\n", kind.name())),
        }
    }
    Ok(out)
}

/// Runs `graphpp graph`.
pub fn run(a: GraphArgs) -> Result<()> {
    let cfg = crate::cmd::model::load_config(&a.model)?;
    let lps = a.layers_per_stage.as_deref();
    let specs = split_layers(cfg.num_layers(), a.stages, lps)?;
    let spec =
        specs.get(a.stage).with_context(|| format!("stage {} out of range 0..{}", a.stage, a.stages))?;
    let policy = a.recompute.policy(spec);
    let opts = StageOptions::new(a.microbatch_size, a.seq_len);
    let sg = graphpp_graph::stage_graphs(&cfg.build_stage(spec, &opts)?, &policy)?;
    if a.stats {
        return crate::cmd::emit(&all_stats(&sg)?);
    }
    let g = sg.select(a.show)?;
    let format = match a.format {
        GraphFormat::Text => Format::Text,
        GraphFormat::Dot => Format::Dot,
        GraphFormat::Json => Format::Json,
    };
    crate::cmd::emit(&render(&g, format))
}
