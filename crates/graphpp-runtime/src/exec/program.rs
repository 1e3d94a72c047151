//! The compiled executor: a graph compiled once into a [`Program`] (fusion groups, an order with
//! matmuls side by side, the values released after each node) and the one run loop ([`exec`])
//! the interpreter and the program share.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use graphpp_graph::{Graph, Op, TensorType, ValueId};

use super::collective::{collective_error, complete, start, CollectiveSpan, GraphComm, InFlight, Value};
use super::fusion::Fusion;
use super::kernel::{eval, kernel_error};
use super::liveness::{peak_in_order, released, Liveness};
use super::{ordered_inputs, ExecError, ExecReport, ExecResult, RunOptions};
use crate::kernels::matmul::{compiled_matmul, compiled_matmul_transposed_widened, Threads};
use crate::kernels::tensor::candle_dtype;

/// A graph compiled once for many runs (docs/ARCHITECTURE.md "Runtime" → Compiled executor): its
/// f32 elementwise chains fused into single-pass kernels ([`crate::exec::fusion`]), an execution
/// order with independent matmuls side by side ([`crate::exec::pairs`]) and, per node, the values the
/// run drops after it. [`Program::run_named_with`] computes bitwise what the interpreter
/// ([`run_named_with`]) computes and reports the same peak live bytes (the logical accounting
/// of the module doc, which the memory model predicts: a pair is kept only where its order
/// peaks exactly as the graph's; a fused group's inner values are never allocated, so the
/// memory actually held is at most that). With [`RunOptions::time_nodes`] a group's time is
/// its anchor's (its members read zero) and a pair's is its first product's (the second reads
/// about zero), and [`RunOptions::trace_peak`] lists only the values the run held.
#[derive(Clone, Debug)]
pub struct Program {
    /// Node count of the graph compiled (a run checks it).
    nodes: usize,
    fusion: Fusion,
    /// `frees[i]`: the values no node after `i` reads.
    frees: Vec<Vec<usize>>,
    /// Values of parameters kept across runs: transposed copies and bf16 casts
    /// ([`crate::exec::kept`]).
    kept: crate::exec::kept::Cache,
    /// The execution order and the matmuls that run side by side ([`crate::exec::pairs`]).
    pairs: crate::exec::pairs::Pairs,
    /// The bf16 weight-gradient products computed with their transpose and cast
    /// ([`TransposedProducts`]).
    transposed: TransposedProducts,
}

impl Program {
    /// Compiles `graph`: the fusion plan, the pairs (each candidate pair costs one pass of the
    /// live-byte accounting over the graph) and the frees; nothing is run. Its kept values are
    /// its own ([`Program::compile_with`] shares them).
    pub fn compile(graph: &Graph) -> Program {
        Program::compile_with(graph, crate::exec::kept::KeptStore::default())
    }

    /// [`Program::compile`], keeping parameters' derived values (transposed copies, bf16 casts:
    /// [`crate::exec::kept`]) in `kept`, which the other programs of the stage share: a weight's
    /// cast is made once a step for the forward and the backward together.
    pub fn compile_with(graph: &Graph, kept: crate::exec::kept::KeptStore) -> Program {
        let fusion = crate::exec::fusion::plan(graph);
        let n = graph.nodes.len();
        // A fused group's inner member is never computed on its own.
        let runs: Vec<bool> =
            (0..n).map(|i| fusion.member_of[i].is_none_or(|g| fusion.groups[g].anchor == i)).collect();
        let pairs = crate::exec::pairs::plan(graph, &runs, |p| peak_in_order(graph, &p.order, &p.partner));
        // Each value is freed after its last reader in the execution order.
        let mut last_read: Vec<Option<usize>> = vec![None; n];
        for &i in pairs.order.iter().filter(|&&i| runs[i]) {
            let reads = match fusion.member_of[i] {
                Some(g) => &fusion.groups[g].inputs,
                None => &graph.nodes[i].inputs,
            };
            for x in reads {
                last_read[x.0] = Some(i);
            }
        }
        let mut freed = runs;
        for o in &graph.outputs {
            freed[o.value.0] = false; // kept to the end: never freed
        }
        let mut frees = vec![Vec::new(); n];
        for v in (0..n).filter(|&v| freed[v]) {
            frees[last_read[v].unwrap_or(v)].push(v);
        }
        let lone = |i: usize| fusion.member_of[i].is_some_and(|g| fusion.groups[g].members == [i]);
        let kept = crate::exec::kept::Cache::plan(graph, lone, kept);
        let transposed = TransposedProducts::plan(graph, lone);
        Program { nodes: n, fusion, frees, kept, pairs, transposed }
    }

    /// The execution order and its side-by-side matmuls ([`crate::exec::pairs`]).
    pub fn pairs(&self) -> &crate::exec::pairs::Pairs {
        &self.pairs
    }

    /// Whether matmul `i` computes the f32 cast of its transpose in one pass (a bf16 weight
    /// gradient; see [`TransposedProducts`]).
    pub fn lays_out_transposed(&self, i: usize) -> bool {
        self.transposed.products.get(i).copied().unwrap_or(false)
    }

    /// The fusion groups.
    pub fn fusion(&self) -> &Fusion {
        &self.fusion
    }

    /// Whether node `i`'s value is kept from one run to the next ([`crate::exec::kept`]).
    pub fn keeps(&self, i: usize) -> bool {
        self.kept.keeps(i)
    }

    /// Drops the values of parameters this program keeps across runs ([`crate::exec::kept`]):
    /// their sources are going away (a stage's RESHARD).
    pub fn clear_kept(&self) {
        self.kept.clear();
    }

    /// [`run_named_with`] through this program; `graph` must be the graph it was compiled from.
    /// Inputs on a device other than the CPU (or any under `GRAPHPP_KERNELS=composed`:
    /// [`crate::kernels::device`]) run through the interpreter's loop on candle's kernels: the
    /// program's fused groups and products read CPU storage.
    ///
    /// # Errors
    /// Those of [`run_named_with`]; [`ExecError::Input`] when `graph` has another node count
    /// than the graph compiled.
    pub fn run_named_with(
        &self,
        graph: &Graph,
        inputs: &HashMap<String, Tensor>,
        opts: &RunOptions,
        comm: Option<&GraphComm>,
    ) -> ExecResult<ExecReport> {
        debug_assert_eq!(
            crate::exec::fusion::plan(graph),
            self.fusion,
            "a program runs the graph it was compiled from"
        );
        if graph.nodes.len() != self.nodes {
            return Err(ExecError::Input {
                graph: graph.name.clone(),
                name: "*".into(),
                reason: format!("compiled for {} nodes, the graph has {}", self.nodes, graph.nodes.len()),
            });
        }
        let inputs = ordered_inputs(graph, inputs)?;
        // The compiled kernels read CPU storage: a run on another device (or with the
        // compositions forced) is the interpreter's, on candle's kernels.
        let compiled = inputs.first().is_none_or(|x| !crate::kernels::device::composed(x));
        exec(graph, &inputs, opts, comm, compiled.then_some(self))
    }
}

/// Runs `graph` on `inputs` (in its input order): the interpreter's run loop (every node in graph
/// order, each value dropped after its last use) or, with `program`, the compiled one (its order,
/// fusion groups, pairs and frees). Per node: an input is checked against its type, any other
/// node computed by [`Run::compute`]; then its value lives until [`Run::release`] drops it.
///
/// # Errors
/// [`ExecError::Input`] for a wrong input count, type or shape; kernel and collective failures.
pub(super) fn exec(
    graph: &Graph,
    inputs: &[Tensor],
    opts: &RunOptions,
    comm: Option<&GraphComm>,
    program: Option<&Program>,
) -> ExecResult<ExecReport> {
    if cfg!(debug_assertions) {
        graphpp_graph::check_graph(graph)?;
    }
    if inputs.len() != graph.inputs.len() {
        return Err(ExecError::Input {
            graph: graph.name.clone(),
            name: "*".into(),
            reason: format!("expected {} inputs, got {}", graph.inputs.len(), inputs.len()),
        });
    }
    let n = graph.nodes.len();
    let device = inputs.first().map_or(candle_core::Device::Cpu, |x| x.device().clone());
    let mut run = Run::new(graph, comm, program, device);
    let mut times = opts.time_nodes.then(|| vec![Duration::ZERO; n]);
    let mut next_input = 0;
    let mut at_peak = Vec::new();
    let graph_order: Vec<usize>;
    let order = match program {
        Some(p) => &p.pairs.order,
        None => {
            graph_order = (0..n).collect();
            &graph_order
        }
    };
    for &i in order {
        let t0 = Instant::now();
        let value = if let Op::Input { name, ty, .. } = &graph.nodes[i].op {
            let value = input_value(graph, name, ty, &inputs[next_input])?;
            next_input += 1;
            value
        } else {
            match run.compute(i)? {
                Some(value) => value,
                // A fused group's inner member: counted, never computed.
                None => continue,
            }
        };
        if run.live.produce(i) && opts.trace_peak {
            at_peak = (0..n).filter(|&j| run.vals[j].is_some() || j == i).map(ValueId).collect();
        }
        run.vals[i] = Some(value);
        run.release(i);
        if let Some(t) = times.as_mut() {
            t[i] = t0.elapsed();
        }
    }
    let outputs = run.outputs()?;
    let live_at_peak = opts.trace_peak.then_some(at_peak);
    Ok(ExecReport {
        outputs,
        peak_live_bytes: run.live.peak,
        node_times: times,
        live_at_peak,
        collectives: run.spans,
    })
}

/// The state of one run of [`exec`]: what it reads (graph, communicator, program) and the values
/// it holds, borrowed by the steps of its loop.
struct Run<'a> {
    graph: &'a Graph,
    comm: Option<&'a GraphComm<'a>>,
    program: Option<&'a Program>,
    /// The live-byte accounting.
    live: Liveness,
    /// `vals[i]`: node `i`'s value while it lives (a collective start's while in flight).
    vals: Vec<Option<Value>>,
    /// Every collective completed, in completion order.
    spans: Vec<CollectiveSpan>,
    /// The value of a pair's second matmul, computed beside the first (it comes next in the
    /// order).
    early: Option<(usize, Tensor)>,
    /// A pair's first matmul, whose operands are released with the second's.
    deferred: Option<usize>,
    /// The device of the run's inputs, where a node without operands makes its value.
    device: candle_core::Device,
}

impl<'a> Run<'a> {
    /// A run of `graph` that holds no value yet.
    fn new(
        graph: &'a Graph,
        comm: Option<&'a GraphComm<'a>>,
        program: Option<&'a Program>,
        device: candle_core::Device,
    ) -> Self {
        let n = graph.nodes.len();
        Run {
            graph,
            comm,
            program,
            live: Liveness::new(graph),
            vals: (0..n).map(|_| None).collect(),
            spans: Vec::new(),
            early: None,
            deferred: None,
            device,
        }
    }

    /// The value of node `i` (not an input): a pair's second product computed beside the first,
    /// a fused group's (at its anchor), a collective started, or its kernel's, once every
    /// collective in flight it reads is complete. `None` for a fused group's inner member, which
    /// is never computed: it is only counted as produced and released.
    fn compute(&mut self, i: usize) -> ExecResult<Option<Value>> {
        if let Some((_, t)) = self.early.take_if(|(j, _)| *j == i) {
            // A pair's second value, computed beside the first.
            return Ok(Some(Value::Ready(t)));
        }
        let (graph, program) = (self.graph, self.program);
        let node = &graph.nodes[i];
        let group = program.and_then(|p| p.fusion.member_of[i].map(|g| &p.fusion.groups[g]));
        let reads = match group {
            // A fused group's inner value is never computed (its anchor computes the group).
            Some(g) if g.anchor != i => {
                self.live.produce(i);
                self.live.release(i, &node.inputs, |_| {});
                return Ok(None);
            }
            Some(g) => &g.inputs,
            None => &node.inputs,
        };
        self.complete_reads(reads)?;
        let args = operands(&self.vals, reads);
        Ok(Some(match (&node.op, group) {
            // A weight gradient's cast, whose operand its product computed already cast (when
            // the product ran that way: its value is f32).
            (_, Some(_))
                if program.is_some_and(|p| p.transposed.casts[i])
                    && args[0].dtype() == candle_core::DType::F32 =>
            {
                Value::Ready(args[0].clone())
            }
            (_, Some(g)) if program.is_some_and(|p| p.kept.keeps(i)) => {
                let p = program.expect("matched above");
                Value::Ready(
                    p.kept.get(i, args[0], |_| g.eval(&args)).map_err(|e| kernel_error(graph, i, e))?,
                )
            }
            (_, Some(g)) => Value::Ready(g.eval(&args).map_err(|e| kernel_error(graph, i, e))?),
            (Op::CollectiveStart { kind, group, axis }, None) => {
                start(self.comm, *kind, group, *axis, &args, i).map_err(|e| collective_error(graph, i, e))?
            }
            (Op::Permute { perm }, None) if program.is_some_and(|p| p.kept.keeps(i)) => {
                let p = program.expect("matched above");
                Value::Ready(p.kept.transposed(i, args[0], perm).map_err(|e| kernel_error(graph, i, e))?)
            }
            (Op::Matmul, None) if program.is_some() => {
                let p = program.expect("matched above");
                Value::Ready(program_matmul(graph, p, i, &args, &self.vals, &mut self.early)?)
            }
            (op, None) => Value::Ready(eval(graph, i, op, &args, &self.device)?),
        }))
    }

    /// Completes each collective in flight among `reads` (a collective completes when a node first
    /// reads it, normally its wait), recording its span.
    fn complete_reads(&mut self, reads: &[ValueId]) -> ExecResult<()> {
        for x in reads {
            if let Some(Value::InFlight(_)) = self.vals[x.0] {
                let Some(Value::InFlight(f)) = self.vals[x.0].take() else { unreachable!("matched above") };
                let t = finish(self.graph, f, self.comm, &mut self.spans)?;
                self.vals[x.0] = Some(Value::Ready(t));
            }
        }
        Ok(())
    }

    /// After node `i` ran: releases the operands whose last use it was (with a program, those of
    /// the nodes [`released`] names and the values its frees list; else `i`'s own).
    fn release(&mut self, i: usize) {
        match self.program {
            Some(p) => {
                for k in released(i, &p.pairs.partner, &mut self.deferred) {
                    self.live.release(k, &self.graph.nodes[k].inputs, |_| {});
                    for &j in &p.frees[k] {
                        self.vals[j] = None;
                    }
                }
            }
            None => self.live.release(i, &self.graph.nodes[i].inputs, |j| self.vals[j] = None),
        }
    }

    /// The graph's outputs in order, an output read straight from a collective start completed
    /// here.
    fn outputs(&mut self) -> ExecResult<Vec<Tensor>> {
        let graph = self.graph;
        let mut outputs = Vec::with_capacity(graph.outputs.len());
        for o in &graph.outputs {
            let t = match self.vals[o.value.0].take() {
                Some(Value::Ready(t)) => t,
                // An output read straight from a start: complete it here.
                Some(Value::InFlight(f)) => finish(graph, f, self.comm, &mut self.spans)?,
                None => unreachable!("outputs are kept"),
            };
            self.vals[o.value.0] = Some(Value::Ready(t.clone()));
            outputs.push(t);
        }
        Ok(outputs)
    }
}

/// Input node `name` of type `ty` given `t`: `t` when its shape and dtype are `ty`'s.
/// Errors: [`ExecError::Input`] otherwise.
fn input_value(graph: &Graph, name: &str, ty: &TensorType, t: &Tensor) -> ExecResult<Value> {
    let t = t.clone();
    if t.dims() != ty.shape.as_slice() || t.dtype() != candle_dtype(ty.dtype) {
        return Err(ExecError::Input {
            graph: graph.name.clone(),
            name: name.to_string(),
            reason: format!("expected {ty}, got {:?} {:?}", t.dtype(), t.dims()),
        });
    }
    Ok(Value::Ready(t))
}

/// The bf16 weight-gradient chains `cast(permute(a · b, [1, 0]), f32)` of a graph — a rank-2
/// bf16 matmul read only by its transpose, read only by a cast to f32 that runs alone (a group of
/// its own), none of them an output but the cast — which a program computes in one pass: the
/// product writes the cast's f32 values laid out transposed
/// ([`compiled_matmul_transposed_widened`]: the same bits as the three steps), the transpose of
/// that is the cast's value in order, and the cast passes it on. The cast had read the
/// transposed view one element per cache line, and under two threads from the other core's cache
/// (5.8 of `small`'s 52 ms of bf16 non-matmul time on one thread: docs/PERFORMANCE.md "bf16").
/// The product's value is then f32 where the graph (and so the live-byte accounting,
/// [`Liveness`]) has bf16: until the cast passes it on, it holds 2 bytes an element more than
/// the report counts.
#[derive(Clone, Debug, Default)]
struct TransposedProducts {
    /// Per node: a chain's matmul.
    products: Vec<bool>,
    /// Per node: a chain's cast, which passes its operand on.
    casts: Vec<bool>,
}

impl TransposedProducts {
    /// The chains of `graph`; `lone(c)`: node `c` is a fused group of its own.
    fn plan(graph: &Graph, lone: impl Fn(usize) -> bool) -> TransposedProducts {
        let n = graph.nodes.len();
        let users = graph.users();
        let outputs: std::collections::HashSet<usize> = graph.outputs.iter().map(|o| o.value.0).collect();
        let only_reader = |i: usize| match users[i].as_slice() {
            [u] if !outputs.contains(&i) => Some(u.0),
            _ => None,
        };
        let mut plan = TransposedProducts { products: vec![false; n], casts: vec![false; n] };
        for (i, node) in graph.nodes.iter().enumerate() {
            let product = matches!(node.op, Op::Matmul)
                && node.ty.shape.len() == 2
                && node.ty.dtype == graphpp_graph::DType::BF16;
            let transpose = only_reader(i)
                .filter(|&t| matches!(&graph.nodes[t].op, Op::Permute { perm } if perm == &[1, 0]));
            let cast = transpose.and_then(only_reader);
            if let Some(c) = cast.filter(|&c| {
                product
                    && matches!(graph.nodes[c].op, Op::Cast { dtype: graphpp_graph::DType::F32 })
                    && lone(c)
            }) {
                (plan.products[i], plan.casts[c]) = (true, true);
            }
        }
        plan
    }
}

/// The product of `p`'s matmul `i` from its `args`: beside its partner `j` where it has one
/// (`j`'s product, from its operands in `vals`, goes to `early` for when `j` comes next in the
/// order), else alone on the whole pool.
fn program_matmul(
    graph: &Graph,
    p: &Program,
    i: usize,
    args: &[&Tensor],
    vals: &[Option<Value>],
    early: &mut Option<(usize, Tensor)>,
) -> ExecResult<Tensor> {
    match p.pairs.partner[i] {
        Some(j) => {
            let args = [args, &operands(vals, &graph.nodes[j].inputs)];
            let (vi, vj) = matmul_pair(graph, p, [i, j], args)?;
            *early = Some((j, vj));
            Ok(vi)
        }
        None => program_product(p, i, args, Threads::Pool).map_err(|e| kernel_error(graph, i, e)),
    }
}

/// Matmul `i` of `p` from `args` on `threads`: where `p` computes its chain in one pass
/// ([`TransposedProducts`]) the transposed f32 values viewed in the product's shape, else
/// [`compiled_matmul`].
fn program_product(p: &Program, i: usize, args: &[&Tensor], threads: Threads) -> candle_core::Result<Tensor> {
    if p.transposed.products[i] {
        if let Some(t) = compiled_matmul_transposed_widened(args[0], args[1], threads)? {
            return t.t();
        }
    }
    compiled_matmul(args[0], args[1], threads)
}

/// Completes `f` (waiting at most the communicator's timeout) and records its span.
fn finish(
    graph: &Graph,
    f: InFlight,
    comm: Option<&GraphComm>,
    spans: &mut Vec<CollectiveSpan>,
) -> ExecResult<Tensor> {
    let (node, start, wait) = (f.node, f.started, Instant::now());
    let timeout = comm.map_or(Duration::ZERO, |c| c.timeout);
    let t = complete(f, timeout).map_err(|e| collective_error(graph, node, e))?;
    spans.push(CollectiveSpan { node, start, wait, end: Instant::now() });
    Ok(t)
}

/// The values `reads`, each computed and complete (an operand in flight is completed before it
/// is read; a pair's second node reads only values computed before the first).
fn operands<'a>(vals: &'a [Option<Value>], reads: &[ValueId]) -> Vec<&'a Tensor> {
    reads
        .iter()
        .map(|x| match &vals[x.0] {
            Some(Value::Ready(t)) => t,
            _ => unreachable!("live operand, completed before it is read"),
        })
        .collect()
}

/// The products of matmuls `nodes` from their `args`, side by side on one thread each where the
/// pool has two or more ([`crate::exec::pairs`]), else one after the other.
fn matmul_pair(
    graph: &Graph,
    p: &Program,
    nodes: [usize; 2],
    args: [&[&Tensor]; 2],
) -> ExecResult<(Tensor, Tensor)> {
    let product = |k: usize, threads: Threads| {
        program_product(p, nodes[k], args[k], threads).map_err(|e| kernel_error(graph, nodes[k], e))
    };
    let (a, b) = if rayon::current_num_threads() > 1 {
        rayon::join(|| product(0, Threads::One), || product(1, Threads::One))
    } else {
        (product(0, Threads::Pool), product(1, Threads::Pool))
    };
    Ok((a?, b?))
}
