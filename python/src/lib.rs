//! `graphpp._graphpp`: graphpp's schedule toolchain (crate `graphpp-schedule`) as a Python
//! extension module. The Python package `graphpp` (python/graphpp/__init__.py) re-exports it;
//! `graphpp.torch` builds on it. Every function here is a thin wrapper over the crate's own: the
//! CSV a generator gives is the CLI's byte for byte, and every error carries the CLI's message.

use std::path::PathBuf;

use graphpp_schedule::bytes::{ByteModel, StageBytes};
use graphpp_schedule::compare::{scale_costs, schedule_chunk_factor};
use graphpp_schedule::error_text::with_causes as message;
use graphpp_schedule::measured::measured_vs_predicted as measured_vs_predicted_rs;
use graphpp_schedule::render::{chrome_trace, figures, grid, svg, GridStyle};
use graphpp_schedule::simulate::simulate_with;
use graphpp_schedule::textfile::read_text;
use graphpp_schedule::{
    Action, Costs as CostsRs, Interval, Kind, LowerOptions, Memory, Options, Schedule as ScheduleRs, Shape,
    SimReport as SimReportRs, Solver, SolverError, Timeline as TimelineRs, ValidateOptions,
};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

pyo3::create_exception!(
    graphpp,
    GraphppError,
    PyValueError,
    "Base class of graphpp's errors (a ValueError)."
);
pyo3::create_exception!(
    graphpp,
    ScheduleParseError,
    GraphppError,
    "A CSV or JSON schedule that does not parse: the message names rank, line and cell."
);
pyo3::create_exception!(
    graphpp,
    GenerateError,
    GraphppError,
    "A generator cannot serve the shape or options (the message names the kind's rule), or an unknown kind."
);
pyo3::create_exception!(
    graphpp,
    ValidationError,
    GraphppError,
    "A schedule the validator refuses: missing or duplicate actions, wrong order, bad lowering, or a \
     deadlock; the message names rank, step and action."
);
pyo3::create_exception!(graphpp, LowerError, GraphppError, "A schedule the lowering passes cannot lower.");
pyo3::create_exception!(
    graphpp,
    SimulateError,
    GraphppError,
    "A schedule or cost model the simulator cannot run: bad costs, a missing producer, a deadlock."
);
pyo3::create_exception!(graphpp, CostError, GraphppError, "A malformed or out-of-range cost.");

/// Maps a Rust error to the Python exception `kind` with [`message`].
fn err<E: std::error::Error>(kind: fn(String) -> PyErr) -> impl Fn(E) -> PyErr {
    move |e| kind(message(&e))
}

/// Action costs of one (stage, microbatch), in any time unit: `F`, `B` (the full backward,
/// `I + W`), `I` (input gradient), `W` (weight gradient), `OVERLAP` (one OVERLAP_F_B, default
/// `F + B`) and `C` (the latency of one cross-rank hop, default 0).
///
/// `Costs(F=1, I=1, W=2)` or `Costs.parse("F=1,I=1,W=2")`: the CLI's `--costs` rules (two of
/// B, I, W give the third; B alone is split evenly; every value finite, >= 0). The reference
/// costs are F = I = W = 1, B = 2 (docs/ARCHITECTURE.md). Raises `CostError`.
#[pyclass(module = "graphpp", name = "Costs", frozen, eq)]
#[derive(Clone, PartialEq)]
struct Costs(CostsRs);

#[pymethods]
impl Costs {
    #[new]
    #[pyo3(signature = (F=None, B=None, I=None, W=None, OVERLAP=None, C=None))]
    #[allow(non_snake_case)]
    fn new(
        F: Option<f64>,
        B: Option<f64>,
        I: Option<f64>,
        W: Option<f64>,
        OVERLAP: Option<f64>,
        C: Option<f64>,
    ) -> PyResult<Self> {
        let given: Vec<String> = [("F", F), ("B", B), ("I", I), ("W", W), ("OVERLAP", OVERLAP), ("C", C)]
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| format!("{k}={v:?}")))
            .collect();
        if given.is_empty() {
            return Ok(Costs(CostsRs::default()));
        }
        Costs::parse(&given.join(","))
    }

    /// Parses the CLI's `--costs` text, e.g. `"F=1,B=2,I=1,W=1,C=0.1"`.
    #[staticmethod]
    fn parse(text: &str) -> PyResult<Self> {
        text.parse().map(Costs).map_err(err(CostError::new_err))
    }

    /// T_F.
    #[getter(F)]
    fn f(&self) -> f64 {
        self.0.f
    }
    /// T_B = T_I + T_W.
    #[getter(B)]
    fn b(&self) -> f64 {
        self.0.b
    }
    /// T_I.
    #[getter(I)]
    fn i(&self) -> f64 {
        self.0.i
    }
    /// T_W.
    #[getter(W)]
    fn w(&self) -> f64 {
        self.0.w
    }
    /// T_overlap of one OVERLAP_F_B (T_F + T_B unless given).
    #[getter(OVERLAP)]
    fn overlap(&self) -> f64 {
        self.0.overlap()
    }
    /// c, the latency of one cross-rank hop.
    #[getter(C)]
    fn c(&self) -> f64 {
        self.0.comm
    }

    /// These costs with every action duration times `factor` (c kept): a whole stage's costs
    /// to one of its `v` chunks' is `scaled(1 / v)`.
    fn scaled(&self, factor: f64) -> PyResult<Self> {
        let c = scale_costs(&self.0, factor);
        c.check().map_err(err(CostError::new_err))?;
        Ok(Costs(c))
    }

    /// `Costs(F=…, I=…, W=…, C=…)`, with `OVERLAP=…` when given: it evaluates to these costs.
    fn __repr__(&self) -> String {
        let c = &self.0;
        let overlap = c.overlap.map_or(String::new(), |o| format!(", OVERLAP={o:?}"));
        format!("Costs(F={:?}, I={:?}, W={:?}{overlap}, C={:?})", c.f, c.i, c.w, c.comm)
    }

    fn __str__(&self) -> String {
        self.0.to_string()
    }
}

/// Costs from `None` (the reference costs), a `Costs`, or `--costs` text.
fn costs_arg(obj: Option<&Bound<'_, PyAny>>) -> PyResult<CostsRs> {
    match obj {
        None => Ok(CostsRs::default()),
        Some(o) => {
            if let Ok(c) = o.extract::<PyRef<'_, Costs>>() {
                Ok(c.0)
            } else if let Ok(text) = o.extract::<String>() {
                Ok(Costs::parse(&text)?.0)
            } else {
                Err(CostError::new_err(format!(
                    "costs must be a graphpp.Costs or text such as \"F=1,B=2\", not {}",
                    o.get_type().name()?
                )))
            }
        }
    }
}

/// The memory model with M_B = 1 and M_W = `m_w` (a fraction of M_B in [0, 1], as the CLI's
/// `--m-w`).
fn memory_arg(m_w: Option<f64>) -> PyResult<Memory> {
    let m_w = m_w.unwrap_or(0.5);
    Memory::with_m_w(m_w).ok_or_else(|| CostError::new_err(format!("m_w must be within [0, 1] (got {m_w})")))
}

/// A schedule: per rank, its actions in execution order (`None` for an idle step). Actions are
/// written as in PyTorch's CSV: `0F3` (stage 0, forward, microbatch 3), `1B2`, `2I0`, `2W0`,
/// `0F1&3B0` (OVERLAP_F_B), `1SEND_F0`, `0RECV_B1`, `0UNSHARD`, …
///
/// Made by `graphpp.generate`, or read with `Schedule.from_csv`, `Schedule.from_json`,
/// `Schedule.parse` (either) or `Schedule.load(path)`. Immutable.
#[pyclass(module = "graphpp", name = "Schedule", frozen)]
#[derive(Clone)]
struct Schedule {
    inner: ScheduleRs,
    kind: Option<Kind>,
}

#[pymethods]
impl Schedule {
    /// Reads CSV text (one row per rank, an empty cell for an idle step; PyTorch's
    /// `_load_csv` format). Raises `ScheduleParseError` naming rank, line and cell.
    #[staticmethod]
    fn from_csv(text: &str) -> PyResult<Self> {
        let inner = ScheduleRs::from_csv(text)
            .map_err(|e| ScheduleParseError::new_err(format!("bad CSV schedule: {}", message(&e))))?;
        Ok(Schedule { inner, kind: None })
    }

    /// Reads JSON text, `{"ranks": [["0F0", null, …], …]}`. Raises `ScheduleParseError`.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<Self> {
        let inner = ScheduleRs::from_json(text)
            .map_err(|e| ScheduleParseError::new_err(format!("bad JSON schedule: {}", message(&e))))?;
        Ok(Schedule { inner, kind: None })
    }

    /// Reads CSV or JSON text (JSON when the first non-blank character is `{` or `[`).
    #[staticmethod]
    fn parse(text: &str) -> PyResult<Self> {
        let inner = ScheduleRs::parse(text).map_err(err(ScheduleParseError::new_err))?;
        Ok(Schedule { inner, kind: None })
    }

    /// Reads a CSV or JSON schedule file (at most 64 MiB, as the CLI). Raises `OSError` for a
    /// file that cannot be read (missing, too long, not UTF-8), `ScheduleParseError` naming the
    /// file for one that does not parse.
    #[staticmethod]
    fn load(path: PathBuf) -> PyResult<Self> {
        let shown = path.display().to_string();
        let text = read_text(&path).map_err(|e| PyOSError::new_err(format!("cannot read {shown}: {e}")))?;
        let inner = ScheduleRs::parse(&text)
            .map_err(|e| ScheduleParseError::new_err(format!("{shown}: {}", message(&e))))?;
        Ok(Schedule { inner, kind: None })
    }

    /// The CSV text (what `graphpp schedule generate --format csv` prints).
    fn to_csv(&self) -> String {
        self.inner.to_csv()
    }

    /// The JSON text, `{"ranks": [[…], …]}` (no trailing newline).
    fn to_json(&self) -> String {
        self.inner.to_json()
    }

    /// Writes the CSV text to `path` (JSON when the name ends in `.json`).
    fn save(&self, path: PathBuf) -> PyResult<()> {
        let json = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"));
        let text = if json { self.inner.to_json() + "\n" } else { self.inner.to_csv() };
        std::fs::write(&path, text)
            .map_err(|e| PyOSError::new_err(format!("cannot write {}: {e}", path.display())))
    }

    /// Per rank, its steps: the action's text, or `None` for an idle step.
    #[getter]
    fn ranks(&self) -> Vec<Vec<Option<String>>> {
        self.inner
            .ranks
            .iter()
            .map(|row| row.iter().map(|a| a.as_ref().map(Action::to_string)).collect())
            .collect()
    }

    /// p: rows (ranks).
    #[getter]
    fn num_ranks(&self) -> usize {
        self.inner.num_ranks()
    }

    /// S: stages the actions name (largest + 1).
    #[getter]
    fn num_stages(&self) -> usize {
        self.inner.num_stages()
    }

    /// m: microbatches the actions name (largest + 1).
    #[getter]
    fn num_microbatches(&self) -> usize {
        self.inner.num_microbatches()
    }

    /// The stages `rank`'s compute actions name, ascending: the `PipelineStage` objects that rank
    /// must hold (the V kinds place stages `r` and `S-1-r` on rank `r`). Empty for a rank out
    /// of range.
    fn stages_on(&self, rank: usize) -> Vec<usize> {
        self.inner
            .placement()
            .into_iter()
            .filter(|(_, ranks)| ranks.contains(&rank))
            .map(|(s, _)| s)
            .collect()
    }

    /// The route of `microbatch`: the stages from the lowest to the highest that any action
    /// names for it (OVERLAP_F_B's halves included), ascending — the stages it visits, in a valid
    /// schedule. Every schedule of one parameter copy routes each microbatch through all stages;
    /// DualPipe's two copies split the microbatches between the directions. Empty for a
    /// microbatch the schedule does not name.
    fn route(&self, microbatch: usize) -> Vec<usize> {
        self.inner.route(microbatch).map_or_else(Vec::new, |r| r.collect())
    }

    /// The kind's name when `graphpp.generate` made it, else `None`.
    #[getter]
    fn kind(&self) -> Option<&'static str> {
        self.kind.map(Kind::name)
    }

    /// The schedule without its SEND/RECV, FSDP and wait actions (and without idle steps).
    fn compute_only(&self) -> Self {
        Schedule { inner: self.inner.compute_only(), kind: self.kind }
    }

    fn __eq__(&self, other: &Schedule) -> bool {
        self.inner == other.inner
    }

    /// One line per rank, `.` for an idle step (`graphpp schedule generate`'s text).
    fn __str__(&self) -> String {
        self.inner.to_string()
    }

    fn __repr__(&self) -> String {
        let kind = self.kind.map_or(String::new(), |k| format!("{k} "));
        format!(
            "<graphpp.Schedule {kind}ranks={} stages={} microbatches={}>",
            self.inner.num_ranks(),
            self.inner.num_stages(),
            self.inner.num_microbatches()
        )
    }
}

/// What `graphpp.validate` found: the shape, the placement, the actions by kind.
#[pyclass(module = "graphpp", name = "Summary", frozen)]
struct Summary {
    /// p.
    #[pyo3(get)]
    ranks: usize,
    /// S.
    #[pyo3(get)]
    stages: usize,
    /// m.
    #[pyo3(get)]
    microbatches: usize,
    /// `"loop"`, `"V"`, or `None` for another placement.
    #[pyo3(get)]
    placement: Option<&'static str>,
    /// True when the schedule holds SEND/RECV, FSDP or wait actions.
    #[pyo3(get)]
    lowered: bool,
    /// Ranks without a compute action (only when no rank count was expected).
    #[pyo3(get)]
    idle_ranks: Vec<usize>,
    /// Actions by kind: `F`, `B`, `I`, `W`, `OVERLAP_F_B`, `SEND`, `RECV`, `UNSHARD`, `RESHARD`,
    /// `REDUCE_GRAD`, `WAIT_SEND`, `WAIT_REDUCE_GRAD`.
    #[pyo3(get)]
    counts: Vec<(&'static str, usize)>,
    text: String,
}

#[pymethods]
impl Summary {
    /// `valid: 4 ranks, 8 stages (V placement), 8 microbatches, compute-only; 64 F, …`
    /// (`graphpp schedule validate`'s line).
    fn __str__(&self) -> String {
        self.text.clone()
    }

    fn __repr__(&self) -> String {
        format!("<graphpp.Summary {}>", self.text)
    }
}

/// A timeline: what each rank ran and when. `intervals` are `(rank, start, end, action)` with
/// the action as text; `unit` is `"unit"` for simulated cost units, `"s"` for seconds measured.
///
/// `Timeline(ranks, intervals, unit="s")` builds one from a measured run (graphpp.torch's step
/// recorder does); raises `ScheduleParseError` for an action that does not parse and
/// `GraphppError` for a rank out of range or an interval that ends before it starts.
#[pyclass(module = "graphpp", name = "Timeline", frozen)]
#[derive(Clone)]
struct Timeline(TimelineRs);

#[pymethods]
impl Timeline {
    #[new]
    #[pyo3(signature = (ranks, intervals, unit="s"))]
    fn new(ranks: usize, intervals: Vec<(usize, f64, f64, String)>, unit: &str) -> PyResult<Self> {
        let mut out = Vec::with_capacity(intervals.len());
        for (i, (rank, start, end, text)) in intervals.into_iter().enumerate() {
            let action: Action = text.parse().map_err(|e| {
                ScheduleParseError::new_err(format!("interval {i}: action `{text}`: {}", message(&e)))
            })?;
            if rank >= ranks {
                return Err(GraphppError::new_err(format!(
                    "interval {i}: rank {rank} but the timeline has {ranks} ranks"
                )));
            }
            if !(start.is_finite() && end.is_finite() && end >= start) {
                return Err(GraphppError::new_err(format!(
                    "interval {i} ({text} on rank {rank}): start {start} and end {end} must be finite with end >= start"
                )));
            }
            out.push(Interval { rank, start, end, action });
        }
        Ok(Timeline(TimelineRs { ranks, intervals: out, comm: Vec::new(), unit: unit.to_string() }))
    }

    /// Rows (ranks).
    #[getter]
    fn ranks(&self) -> usize {
        self.0.ranks
    }

    /// `"unit"` (simulated) or `"s"` (measured).
    #[getter]
    fn unit(&self) -> String {
        self.0.unit.clone()
    }

    /// `(rank, start, end, action)` per interval, rank by rank in step order.
    #[getter]
    fn intervals(&self) -> Vec<(usize, f64, f64, String)> {
        self.0
            .by_rank()
            .into_iter()
            .flatten()
            .map(|i| (i.rank, i.start, i.end, i.action.to_string()))
            .collect()
    }

    /// End of the last interval.
    #[getter]
    fn makespan(&self) -> f64 {
        self.0.makespan()
    }

    /// A Chrome trace (JSON text for Perfetto or chrome://tracing).
    fn chrome_trace(&self) -> String {
        chrome_trace(&self.0)
    }

    /// An SVG drawing of the timeline.
    fn svg(&self) -> String {
        svg(&self.0)
    }

    /// A terminal grid, one row per rank (at most `max_columns` wide).
    #[pyo3(signature = (max_columns=400))]
    fn grid(&self, max_columns: usize) -> String {
        grid(&self.0, &GridStyle { color: false, max_columns: max_columns.max(1) })
    }

    fn __repr__(&self) -> String {
        format!(
            "<graphpp.Timeline ranks={} intervals={} makespan={} {}>",
            self.0.ranks,
            self.0.intervals.len(),
            self.0.makespan(),
            self.0.unit
        )
    }
}

/// The simulator's figures for one schedule (times in the costs' unit, activations in M_B
/// units of one full stage; docs/ARCHITECTURE.md, "Simulation").
#[pyclass(module = "graphpp", name = "SimReport", frozen)]
struct SimReport {
    report: SimReportRs,
    peak_bytes: Option<Vec<u64>>,
}

impl SimReport {
    fn new(report: SimReportRs, peak_bytes: Option<Vec<u64>>) -> Self {
        SimReport { report, peak_bytes }
    }
}

#[pymethods]
impl SimReport {
    /// End of the last action.
    #[getter]
    fn makespan(&self) -> f64 {
        self.report.makespan
    }
    /// In-iteration r_bubble = Σ idle / Σ busy.
    #[getter]
    fn bubble_ratio(&self) -> f64 {
        self.report.bubble_ratio
    }
    /// Σ idle / (p · makespan).
    #[getter]
    fn idle_fraction(&self) -> f64 {
        self.report.idle_fraction
    }
    /// Steady-state r_bubble (each rank from its first action to its last).
    #[getter]
    fn steady_bubble_ratio(&self) -> f64 {
        self.report.steady_bubble_ratio
    }
    /// Per rank, time running actions.
    #[getter]
    fn busy(&self) -> Vec<f64> {
        self.report.busy.clone()
    }
    /// Per rank, makespan − busy.
    #[getter]
    fn idle(&self) -> Vec<f64> {
        self.report.idle.clone()
    }
    /// Per rank, peak in-flight activations (M_B units).
    #[getter]
    fn peak_activations(&self) -> Vec<f64> {
        self.report.peak_activations.clone()
    }
    /// Per rank, peak count of (stage, microbatch) pairs between F and B/I.
    #[getter]
    fn peak_in_flight(&self) -> Vec<usize> {
        self.report.peak_in_flight.clone()
    }
    /// Per rank, peak bytes (resident + activations) when `stage_bytes` was given, else `None`.
    #[getter]
    fn peak_bytes(&self) -> Option<Vec<u64>> {
        self.peak_bytes.clone()
    }
    /// What ran when (a `Timeline`).
    #[getter]
    fn timeline(&self) -> Timeline {
        Timeline(self.report.timeline.clone())
    }

    /// The figures block `graphpp schedule simulate` prints.
    fn summary(&self) -> String {
        figures(&self.report)
    }

    /// The figures as JSON (`graphpp schedule simulate --format json`, compact). Raises
    /// `GraphppError` for a figure JSON cannot hold.
    fn to_json(&self) -> PyResult<String> {
        let value = match &self.peak_bytes {
            Some(b) => serde_json::json!({ "report": &self.report, "peak_bytes": b }),
            None => serde_json::to_value(&self.report).map_err(err(GraphppError::new_err))?,
        };
        Ok(value.to_string())
    }

    fn __str__(&self) -> String {
        figures(&self.report)
    }

    fn __repr__(&self) -> String {
        format!(
            "<graphpp.SimReport makespan={} bubble_ratio={:.4}>",
            self.report.makespan, self.report.bubble_ratio
        )
    }
}

/// Every schedule kind: its name, PyTorch's class name (or `None`), its shape constraints, its
/// default stages per rank and its placement (`"loop"` or `"V"`).
#[pyfunction]
fn kinds() -> Vec<(&'static str, Option<&'static str>, &'static str, usize, &'static str)> {
    Kind::ALL
        .iter()
        .map(|k| {
            let placement = k.placement().name();
            (k.name(), k.pytorch_name(), k.constraints(), k.default_stages_per_rank(), placement)
        })
        .collect()
}

fn kind_arg(kind: &str) -> PyResult<Kind> {
    kind.parse().map_err(err(GenerateError::new_err))
}

fn solver_arg(solver: Option<&str>, time_limit: Option<f64>) -> PyResult<Solver> {
    let ilp = match solver.map(str::to_ascii_lowercase).as_deref() {
        None | Some("heuristic") => false,
        Some("ilp") => true,
        Some(other) => {
            return Err(GenerateError::new_err(format!("unknown solver `{other}`: heuristic or ilp")))
        }
    };
    Solver::new(ilp, time_limit).map_err(|e| match e {
        SolverError::TimeLimitWithHeuristic => {
            GenerateError::new_err("time_limit applies to solver=\"ilp\" only")
        }
        SolverError::TimeLimit(secs) => {
            GenerateError::new_err(format!("time_limit must be a number of seconds in (0, 1e6], got {secs}"))
        }
    })
}

/// A count argument of [`generate`] as `usize`: `GenerateError` naming it when negative (as the
/// CLI refuses `--ranks -1`), not Python's bare `OverflowError`.
fn count_arg(name: &str, value: i64) -> PyResult<usize> {
    usize::try_from(value)
        .map_err(|_| GenerateError::new_err(format!("{name} = {value}: a count cannot be negative")))
}

/// Generates the schedule of `kind` (`"1f1b"`, `"zbv"`, `"zbv-auto"`, … or a PyTorch class name
/// such as `"ScheduleZBVZeroBubble"`) for `ranks` (p) and `microbatches` (m), as
/// `graphpp schedule generate` does.
///
/// `stages_per_rank` (v) defaults to 2 for the interleaved and V kinds, else 1; `group` is
/// grouped-interleaved's microbatches per chunk; `costs` (a `Costs` or `"F=1,B=2"` text, per
/// action), `m_w` (M_W as a fraction of M_B), `mem_cap` (activation cap per rank in M_B units,
/// default p) and `solver` (`"heuristic"` or `"ilp"`, with `time_limit` seconds) steer zb-auto
/// and zbv-auto. Raises `GenerateError` naming the kind's rule a shape breaks, `CostError`.
#[pyfunction]
#[pyo3(signature = (kind, ranks, microbatches, *, stages_per_rank=None, group=None, costs=None, m_w=None, mem_cap=None, solver=None, time_limit=None))]
#[allow(clippy::too_many_arguments)]
fn generate(
    kind: &str,
    ranks: i64,
    microbatches: i64,
    stages_per_rank: Option<i64>,
    group: Option<i64>,
    costs: Option<&Bound<'_, PyAny>>,
    m_w: Option<f64>,
    mem_cap: Option<f64>,
    solver: Option<&str>,
    time_limit: Option<f64>,
) -> PyResult<Schedule> {
    let kind = kind_arg(kind)?;
    let (ranks, microbatches) = (count_arg("ranks", ranks)?, count_arg("microbatches", microbatches)?);
    let v = stages_per_rank.map(|v| count_arg("stages_per_rank", v)).transpose()?;
    let shape = Shape::new(ranks, v.unwrap_or_else(|| kind.default_stages_per_rank()), microbatches);
    let opts = Options {
        group: group.map(|g| count_arg("group", g)).transpose()?,
        costs: costs_arg(costs)?,
        memory: memory_arg(m_w)?,
        mem_cap,
        solver: solver_arg(solver, time_limit)?,
    };
    let inner = graphpp_schedule::generate(kind, &shape, &opts).map_err(err(GenerateError::new_err))?;
    Ok(Schedule { inner, kind: Some(kind) })
}

/// Validates `schedule` (every check of `graphpp schedule validate`, the cross-rank deadlock
/// check of a lowered schedule included) against the shape given: `ranks` (p, each with a
/// compute action), `stages` (S), `microbatches` (m). Returns a `Summary`; raises
/// `ValidationError` naming rank, step and action.
#[pyfunction]
#[pyo3(signature = (schedule, *, ranks=None, stages=None, microbatches=None))]
fn validate(
    schedule: &Schedule,
    ranks: Option<usize>,
    stages: Option<usize>,
    microbatches: Option<usize>,
) -> PyResult<Summary> {
    let opts = ValidateOptions { microbatches, ranks, stages };
    let s = graphpp_schedule::validate(&schedule.inner, &opts).map_err(err(ValidationError::new_err))?;
    let counts = s.counts.named().to_vec();
    let placement = s.placement.map(graphpp_schedule::Placement::name);
    Ok(Summary {
        ranks: s.ranks,
        stages: s.stages,
        microbatches: s.microbatches,
        placement,
        lowered: s.lowered,
        idle_ranks: s.idle_ranks.clone(),
        counts,
        text: s.to_string(),
    })
}

/// Lowers a compute-only schedule as `graphpp schedule lower` does: validates it, adds FSDP's
/// UNSHARD/RESHARD (at most `fsdp_max_unsharded` stages unsharded per rank) and REDUCE_GRAD when
/// asked (`reduce_grad=True` alone: data parallelism without FSDP), then SEND/RECV. Raises
/// `LowerError` (its message holds the validator's).
#[pyfunction]
#[pyo3(signature = (schedule, *, fsdp_max_unsharded=None, reduce_grad=false))]
fn lower(schedule: &Schedule, fsdp_max_unsharded: Option<usize>, reduce_grad: bool) -> PyResult<Schedule> {
    let inner = graphpp_schedule::lower(&schedule.inner, &LowerOptions { fsdp_max_unsharded, reduce_grad })
        .map_err(err(LowerError::new_err))?;
    Ok(Schedule { inner, kind: schedule.kind })
}

/// A byte model from per-stage dicts with the keys of `StageBytes` (`held_fb`, `held_iw`,
/// `run_f`, `run_b`, `run_i`, `run_w`, `resident`; missing keys are 0).
fn byte_model(stages: &[Bound<'_, PyDict>]) -> PyResult<ByteModel> {
    const KEYS: [&str; 7] = ["held_fb", "held_iw", "run_f", "run_b", "run_i", "run_w", "resident"];
    let mut out = Vec::with_capacity(stages.len());
    for (s, d) in stages.iter().enumerate() {
        for key in d.keys() {
            let key: String = key.extract()?;
            if !KEYS.contains(&key.as_str()) {
                return Err(GraphppError::new_err(format!(
                    "stage_bytes[{s}]: unknown key `{key}`; known: {}",
                    KEYS.join(", ")
                )));
            }
        }
        let get = |k: &str| -> PyResult<u64> {
            d.get_item(k)?.map_or(Ok(0), |v| {
                v.extract::<u64>().map_err(|_| {
                    GraphppError::new_err(format!(
                        "stage_bytes[{s}][\"{k}\"] must be a whole number of bytes >= 0"
                    ))
                })
            })
        };
        out.push(StageBytes {
            held_fb: get("held_fb")?,
            held_iw: get("held_iw")?,
            run_f: get("run_f")?,
            run_b: get("run_b")?,
            run_i: get("run_i")?,
            run_w: get("run_w")?,
            resident: get("resident")?,
        });
    }
    Ok(ByteModel { stages: out, overlap: Vec::new() })
}

/// Simulates `schedule` (docs/ARCHITECTURE.md, "Simulation"): each action takes its cost, each
/// cross-rank hop adds `C`, a rank waits for what it receives. Returns a `SimReport`.
///
/// `costs` are a whole stage's, as for `graphpp schedule simulate`: each of a rank's chunks runs
/// at `chunk_factor` of them, by default the CLI's (1/v; 1 for DualPipe's two model copies;
/// 1/v for a schedule read from a file). Give `chunk_factor=1.0` when the costs are already
/// per action (graphpp.torch's measured costs are). `stage_bytes` (a dict per stage, keys as in
/// `StageBytes`: held_fb, held_iw, run_f, run_b, run_i, run_w, resident) adds per-rank peak
/// bytes. Raises `SimulateError`, `CostError`, `GraphppError` (a bad byte model).
#[pyfunction]
#[pyo3(signature = (schedule, *, costs=None, m_w=None, chunk_factor=None, stage_bytes=None))]
fn simulate(
    schedule: &Schedule,
    costs: Option<&Bound<'_, PyAny>>,
    m_w: Option<f64>,
    chunk_factor: Option<f64>,
    stage_bytes: Option<Vec<Bound<'_, PyDict>>>,
) -> PyResult<SimReport> {
    let stage_costs = costs_arg(costs)?;
    let s = &schedule.inner;
    let factor = chunk_factor.unwrap_or_else(|| schedule_chunk_factor(schedule.kind, s));
    if !(factor.is_finite() && factor > 0.0) {
        return Err(CostError::new_err(format!("chunk_factor must be a finite number > 0 (got {factor})")));
    }
    let c = scale_costs(&stage_costs, factor);
    let report = graphpp_schedule::simulate(s, &c, &memory_arg(m_w)?).map_err(err(SimulateError::new_err))?;
    let bytes = match stage_bytes {
        Some(stages) => Some(byte_model(&stages)?.peak_bytes(s).map_err(err(GraphppError::new_err))?),
        None => None,
    };
    Ok(SimReport::new(report, bytes))
}

/// Measured against predicted: fits each compute action's duration to `measured` (a
/// `Timeline` of one or more runs of `schedule`, e.g. from graphpp.torch's step recorder),
/// simulates `schedule` with those durations and a hop latency `hop` (seconds), and returns
/// `(measured, predicted)` `SimReport`s (the measured one from compute intervals only, shifted to
/// start at 0). `hop` is in the timeline's unit. Raises `SimulateError`.
#[pyfunction]
#[pyo3(signature = (schedule, measured, *, hop=0.0))]
fn measured_vs_predicted(
    schedule: &Schedule,
    measured: &Timeline,
    hop: f64,
) -> PyResult<(SimReport, SimReport)> {
    let m =
        measured_vs_predicted_rs(&schedule.inner, &measured.0, hop).map_err(err(SimulateError::new_err))?;
    Ok((SimReport::new(m.measured, None), SimReport::new(m.predicted, None)))
}

/// Simulates `schedule` with a duration per action text (`{"0F0": 1.5, …}`; an action not
/// listed takes `default`) and hop latency `hop`, all in one time unit. Returns a `SimReport`;
/// raises `ScheduleParseError` for an action that does not parse, `CostError` for a duration
/// that is not finite and >= 0, `SimulateError`.
#[pyfunction]
#[pyo3(signature = (schedule, durations, *, default=0.0, hop=0.0, m_w=None))]
fn simulate_durations(
    schedule: &Schedule,
    durations: std::collections::HashMap<String, f64>,
    default: f64,
    hop: f64,
    m_w: Option<f64>,
) -> PyResult<SimReport> {
    let mut by_action = std::collections::HashMap::with_capacity(durations.len());
    for (text, d) in durations {
        let a: Action = text
            .parse()
            .map_err(|e| ScheduleParseError::new_err(format!("action `{text}`: {}", message(&e))))?;
        graphpp_schedule::check_cost(&text, d).map_err(err(CostError::new_err))?;
        by_action.insert(a, d);
    }
    graphpp_schedule::check_cost("default", default).map_err(err(CostError::new_err))?;
    let r = simulate_with(
        &schedule.inner,
        |a| by_action.get(a).copied().unwrap_or(default),
        hop,
        &memory_arg(m_w)?,
    )
    .map_err(err(SimulateError::new_err))?;
    Ok(SimReport::new(r, None))
}

/// Every kind at `ranks` (p) and `microbatches` (m), as `graphpp schedule compare`: a dict per
/// kind with `kind`, `stages_per_rank` and either `makespan`, `bubble_ratio`, `idle_fraction`,
/// `peak_activations` (M_B units) and `messages_per_microbatch`, or `error` (why the kind cannot
/// serve the shape). `costs` are a whole stage's; each chunk runs at 1/v of them.
#[pyfunction]
#[pyo3(signature = (ranks, microbatches, *, costs=None, m_w=None))]
fn compare<'py>(
    py: Python<'py>,
    ranks: usize,
    microbatches: usize,
    costs: Option<&Bound<'py, PyAny>>,
    m_w: Option<f64>,
) -> PyResult<Vec<Bound<'py, PyDict>>> {
    if ranks == 0 || microbatches == 0 {
        return Err(GenerateError::new_err(format!(
            "ranks and microbatches must be at least 1 (got {ranks} and {microbatches})"
        )));
    }
    let rows = graphpp_schedule::compare::compare(ranks, microbatches, &costs_arg(costs)?, &memory_arg(m_w)?)
        .map_err(err(GenerateError::new_err))?;
    rows.into_iter()
        .map(|row| {
            let d = PyDict::new(py);
            d.set_item("kind", row.kind.name())?;
            d.set_item("stages_per_rank", row.stages_per_rank)?;
            match row.result {
                Ok(f) => {
                    d.set_item("makespan", f.makespan)?;
                    d.set_item("bubble_ratio", f.bubble_ratio)?;
                    d.set_item("idle_fraction", f.idle_fraction)?;
                    d.set_item("peak_activations", f.peak_activations)?;
                    d.set_item("messages_per_microbatch", f.messages_per_microbatch)?;
                }
                Err(e) => d.set_item("error", e)?,
            }
            Ok(d)
        })
        .collect()
}

/// graphpp's schedule toolchain (see the `graphpp` package's docstring).
#[pymodule]
fn _graphpp(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("GraphppError", py.get_type::<GraphppError>())?;
    m.add("ScheduleParseError", py.get_type::<ScheduleParseError>())?;
    m.add("GenerateError", py.get_type::<GenerateError>())?;
    m.add("ValidationError", py.get_type::<ValidationError>())?;
    m.add("LowerError", py.get_type::<LowerError>())?;
    m.add("SimulateError", py.get_type::<SimulateError>())?;
    m.add("CostError", py.get_type::<CostError>())?;
    m.add_class::<Costs>()?;
    m.add_class::<Schedule>()?;
    m.add_class::<Summary>()?;
    m.add_class::<Timeline>()?;
    m.add_class::<SimReport>()?;
    for f in [
        wrap_pyfunction!(kinds, m)?,
        wrap_pyfunction!(generate, m)?,
        wrap_pyfunction!(validate, m)?,
        wrap_pyfunction!(lower, m)?,
        wrap_pyfunction!(simulate, m)?,
        wrap_pyfunction!(simulate_durations, m)?,
        wrap_pyfunction!(measured_vs_predicted, m)?,
        wrap_pyfunction!(compare, m)?,
    ] {
        m.add_function(f)?;
    }
    Ok(())
}
