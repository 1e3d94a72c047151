//! Graph builder: appends primitive nodes with inferred types under the current scope, phase and
//! region. Composite layers live in [`crate::layers`].

use crate::check::check_graph;
use crate::dtype::{DType, Dims, TensorType};
use crate::error::{GraphError, Result};
use crate::graph::{Graph, Node, NodeMeta, Phase, Region, ValueId};
use crate::infer::infer;
use crate::op::{BinaryOp, CollectiveKind, CommGroup, InputKind, Op, UnaryOp};

/// Builds one graph. Every method checks its operands and returns a typed
/// [`GraphError::Shape`] naming the op and the scope on bad input.
#[derive(Clone, Debug)]
pub struct GraphBuilder {
    graph: Graph,
    scopes: Vec<String>,
    meta: NodeMeta,
    /// Float dtype of new inputs and constants.
    pub dtype: DType,
}

impl GraphBuilder {
    /// A builder for an empty graph whose float values have type `dtype`.
    pub fn new(name: &str, dtype: DType) -> Self {
        Self::from_graph(Graph::new(name), dtype)
    }

    /// A builder that appends to an existing graph.
    pub fn from_graph(graph: Graph, dtype: DType) -> Self {
        GraphBuilder { graph, scopes: Vec::new(), meta: NodeMeta::default(), dtype }
    }

    /// The graph so far.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Type of value `v`.
    pub fn ty(&self, v: ValueId) -> &TensorType {
        &self.graph.node(v).ty
    }

    /// Shape of value `v`.
    pub fn shape(&self, v: ValueId) -> Dims {
        self.ty(v).shape.clone()
    }

    /// Enters a sub-scope (`model` then `layers.0` gives `model.layers.0`).
    pub fn push_scope(&mut self, name: &str) {
        self.scopes.push(name.to_string());
        self.meta.scope = self.scopes.join(".");
    }

    /// Leaves the innermost scope.
    pub fn pop_scope(&mut self) {
        self.scopes.pop();
        self.meta.scope = self.scopes.join(".");
    }

    /// Builds `f`'s nodes under the sub-scope `name` ([`GraphBuilder::push_scope`], then
    /// [`GraphBuilder::pop_scope`], also when `f` fails).
    pub fn scoped<R, E>(
        &mut self,
        name: &str,
        f: impl FnOnce(&mut Self) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E> {
        self.push_scope(name);
        let r = f(self);
        self.pop_scope();
        r
    }

    /// Sets the full scope of the nodes that follow (used by passes that copy nodes).
    pub fn set_scope(&mut self, scope: &str) {
        self.scopes = if scope.is_empty() { vec![] } else { vec![scope.to_string()] };
        self.meta.scope = scope.to_string();
    }

    /// Sets the phase of the nodes that follow.
    pub fn set_phase(&mut self, phase: Phase) {
        self.meta.phase = phase;
    }

    /// Sets the region of the nodes that follow.
    pub fn set_region(&mut self, region: Region) {
        self.meta.region = region;
    }

    /// Appends `op(inputs)` after inferring its type. Errors: [`GraphError::Shape`].
    pub fn add(&mut self, op: Op, inputs: &[ValueId]) -> Result<ValueId> {
        let tys: Vec<&TensorType> = inputs.iter().map(|&v| self.ty(v)).collect();
        let ty = infer(&op, &tys).map_err(|reason| GraphError::Shape {
            op: op.mnemonic(),
            at: format!("%{} ({})", self.graph.nodes.len(), self.meta.scope),
            reason,
        })?;
        Ok(self.graph.push(Node { op, inputs: inputs.to_vec(), ty, meta: self.meta.clone() }))
    }

    /// A graph input of the builder's float dtype.
    pub fn input(&mut self, name: &str, kind: InputKind, shape: Dims) -> Result<ValueId> {
        self.input_typed(name, kind, TensorType::new(self.dtype, shape))
    }

    /// A graph input of any type. Errors: a duplicate name.
    pub fn input_typed(&mut self, name: &str, kind: InputKind, ty: TensorType) -> Result<ValueId> {
        if self.graph.input_by_name(name).is_some() {
            return Err(GraphError::Shape {
                op: "input".into(),
                at: name.into(),
                reason: "duplicate input name".into(),
            });
        }
        self.add(Op::Input { name: name.into(), kind, ty }, &[])
    }

    /// Constant `value` of the builder's float dtype.
    pub fn full(&mut self, value: f64, shape: Dims) -> Result<ValueId> {
        let ty = TensorType::new(self.dtype, shape);
        self.add(Op::Full { value, ty }, &[])
    }

    /// Constant of the same type as `like`.
    pub fn full_like(&mut self, value: f64, like: ValueId) -> Result<ValueId> {
        let ty = self.ty(like).clone();
        self.add(Op::Full { value, ty }, &[])
    }

    fn unary(&mut self, f: UnaryOp, x: ValueId) -> Result<ValueId> {
        self.add(Op::Unary { f }, &[x])
    }
    /// `-x`
    pub fn neg(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Neg, x)
    }
    /// `e^x`
    pub fn exp(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Exp, x)
    }
    /// `ln x`
    pub fn log(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Log, x)
    }
    /// `√x`
    pub fn sqrt(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Sqrt, x)
    }
    /// `1/x`
    pub fn recip(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Recip, x)
    }
    /// Logistic sigmoid.
    pub fn sigmoid(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Sigmoid, x)
    }
    /// Gauss error function `erf x`.
    pub fn erf(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Erf, x)
    }
    /// `x * mul + add`
    pub fn affine(&mut self, x: ValueId, mul: f64, add: f64) -> Result<ValueId> {
        self.add(Op::Affine { mul, add }, &[x])
    }
    /// `x * s`
    pub fn scale(&mut self, x: ValueId, s: f64) -> Result<ValueId> {
        self.affine(x, s, 0.0)
    }

    fn binary(&mut self, f: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.add(Op::Binary { f }, &[a, b])
    }
    /// `a + b` (broadcasting)
    pub fn add2(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.binary(BinaryOp::Add, a, b)
    }
    /// `a - b` (broadcasting)
    pub fn sub(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.binary(BinaryOp::Sub, a, b)
    }
    /// `a * b` (broadcasting)
    pub fn mul(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.binary(BinaryOp::Mul, a, b)
    }
    /// `a / b` (broadcasting)
    pub fn div(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.binary(BinaryOp::Div, a, b)
    }
    /// `1.0` where `a == b` else `0.0` (broadcasting)
    pub fn eq(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.binary(BinaryOp::Eq, a, b)
    }

    /// Sum over `axis`.
    pub fn sum(&mut self, x: ValueId, axis: usize, keepdim: bool) -> Result<ValueId> {
        self.add(Op::Sum { axis, keepdim }, &[x])
    }
    /// Max over `axis`.
    pub fn max(&mut self, x: ValueId, axis: usize, keepdim: bool) -> Result<ValueId> {
        self.add(Op::Max { axis, keepdim }, &[x])
    }
    /// Softmax over `axis` ([`Op::Softmax`] with scale 1 and no mask).
    pub fn softmax(&mut self, x: ValueId, axis: usize) -> Result<ValueId> {
        self.add(Op::Softmax { axis, scale: 1.0 }, &[x])
    }
    /// Softmax over `axis` of `scale · x + mask` ([`Op::Softmax`]).
    pub fn softmax_masked(&mut self, x: ValueId, mask: ValueId, scale: f64, axis: usize) -> Result<ValueId> {
        self.add(Op::Softmax { axis, scale }, &[x, mask])
    }
    /// `scale · y ⊙ (g − Σ_axis g ⊙ y)` ([`Op::SoftmaxBackward`]).
    pub fn softmax_backward(&mut self, y: ValueId, g: ValueId, axis: usize, scale: f64) -> Result<ValueId> {
        self.add(Op::SoftmaxBackward { axis, scale }, &[y, g])
    }
    /// `softmax(scale · q kᵀ + mask) v` ([`Op::Attention`]): q `[B, H, T, E]`, k `[B, KV, T, E]`,
    /// v `[B, KV, T, E_v]` (KV dividing H), mask `[T, T]` of q's wide dtype → `[B, H, T, E_v]`.
    pub fn attention(
        &mut self,
        q: ValueId,
        k: ValueId,
        v: ValueId,
        mask: ValueId,
        scale: f64,
    ) -> Result<ValueId> {
        self.add(Op::Attention { scale }, &[q, k, v, mask])
    }
    /// The gradients of q, k, v along the heads, `[B, H + 2·KV, T, max(E, E_v)]` (the narrower
    /// zero-padded), of an [`Op::Attention`] with output `o` and output gradient `g`
    /// ([`Op::AttentionBackward`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        &mut self,
        q: ValueId,
        k: ValueId,
        v: ValueId,
        mask: ValueId,
        o: ValueId,
        g: ValueId,
        scale: f64,
    ) -> Result<ValueId> {
        self.add(Op::AttentionBackward { scale }, &[q, k, v, mask, o, g])
    }
    /// RoPE's rotate-half along the last axis ([`Op::RotateHalf`]).
    pub fn rotate_half(&mut self, x: ValueId) -> Result<ValueId> {
        self.add(Op::RotateHalf, &[x])
    }
    /// Log-softmax over `axis` ([`Op::LogSoftmax`]).
    pub fn log_softmax(&mut self, x: ValueId, axis: usize) -> Result<ValueId> {
        self.add(Op::LogSoftmax { axis }, &[x])
    }
    /// `g − exp(y) ⊙ Σ_axis g` ([`Op::LogSoftmaxBackward`]).
    pub fn log_softmax_backward(&mut self, y: ValueId, g: ValueId, axis: usize) -> Result<ValueId> {
        self.add(Op::LogSoftmaxBackward { axis }, &[y, g])
    }
    /// Mean over `axis` (sum × 1/n).
    pub fn mean(&mut self, x: ValueId, axis: usize, keepdim: bool) -> Result<ValueId> {
        let n = self.shape(x).get(axis).copied().unwrap_or(1).max(1);
        let s = self.sum(x, axis, keepdim)?;
        self.scale(s, 1.0 / n as f64)
    }
    /// Batched matmul.
    pub fn matmul(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.add(Op::Matmul, &[a, b])
    }
    /// Reshape.
    pub fn reshape(&mut self, x: ValueId, shape: Dims) -> Result<ValueId> {
        if self.shape(x) == shape {
            return Ok(x);
        }
        self.add(Op::Reshape { shape }, &[x])
    }
    /// Permute axes.
    pub fn permute(&mut self, x: ValueId, perm: Vec<usize>) -> Result<ValueId> {
        self.add(Op::Permute { perm }, &[x])
    }
    /// Swap the last two axes.
    pub fn transpose_last(&mut self, x: ValueId) -> Result<ValueId> {
        let r = self.shape(x).len();
        let mut perm: Vec<usize> = (0..r).collect();
        if r < 2 {
            return Err(GraphError::Shape {
                op: "permute".into(),
                at: self.meta.scope.clone(),
                reason: "transpose needs rank ≥ 2".into(),
            });
        }
        perm.swap(r - 1, r - 2);
        self.permute(x, perm)
    }
    /// Broadcast to `shape` (no node if already that shape).
    pub fn broadcast(&mut self, x: ValueId, shape: Dims) -> Result<ValueId> {
        if self.shape(x) == shape {
            return Ok(x);
        }
        self.add(Op::Broadcast { shape }, &[x])
    }
    /// Slice `start..end` along `axis`.
    pub fn slice(&mut self, x: ValueId, axis: usize, start: usize, end: usize) -> Result<ValueId> {
        self.add(Op::Slice { axis, start, end }, &[x])
    }
    /// Concatenate along `axis`.
    pub fn concat(&mut self, xs: &[ValueId], axis: usize) -> Result<ValueId> {
        self.add(Op::Concat { axis }, xs)
    }
    /// Index-select along `axis` with 1-D u32 `ids`.
    pub fn index_select(&mut self, src: ValueId, ids: ValueId, axis: usize) -> Result<ValueId> {
        self.add(Op::IndexSelect { axis }, &[src, ids])
    }
    /// Index-add of `src` into `dst` at `ids` along `axis`.
    pub fn index_add(&mut self, dst: ValueId, ids: ValueId, src: ValueId, axis: usize) -> Result<ValueId> {
        self.add(Op::IndexAdd { axis }, &[dst, ids, src])
    }
    /// Gather along `axis`.
    pub fn gather(&mut self, src: ValueId, idx: ValueId, axis: usize) -> Result<ValueId> {
        self.add(Op::Gather { axis }, &[src, idx])
    }
    /// Scatter-add along `axis`.
    pub fn scatter_add(&mut self, dst: ValueId, idx: ValueId, src: ValueId, axis: usize) -> Result<ValueId> {
        self.add(Op::ScatterAdd { axis }, &[dst, idx, src])
    }
    /// Indices of the top `k` along the last axis.
    pub fn topk(&mut self, x: ValueId, k: usize) -> Result<ValueId> {
        self.add(Op::TopK { k }, &[x])
    }
    /// The permutation that sorts the 1-D u32 `ids` by expert (stable; see [`Op::SortByExpert`]).
    pub fn sort_by_expert(&mut self, ids: ValueId, experts: usize) -> Result<ValueId> {
        self.add(Op::SortByExpert { experts }, &[ids])
    }
    /// Counts of each of `bins` values in the 1-D u32 `ids`.
    pub fn bincount(&mut self, ids: ValueId, bins: usize) -> Result<ValueId> {
        self.add(Op::Bincount { bins }, &[ids])
    }
    /// Per-expert matmul over contiguous row segments (see [`Op::SegmentMatmul`]).
    pub fn segment_matmul(
        &mut self,
        x: ValueId,
        w: ValueId,
        counts: ValueId,
        transpose: bool,
    ) -> Result<ValueId> {
        self.add(Op::SegmentMatmul { transpose }, &[x, w, counts])
    }
    /// Per-expert `aᵀ·b` over contiguous row segments (see [`Op::SegmentOuter`]).
    pub fn segment_outer(&mut self, a: ValueId, b: ValueId, counts: ValueId) -> Result<ValueId> {
        self.add(Op::SegmentOuter, &[a, b, counts])
    }
    /// Cast to `dtype`.
    pub fn cast(&mut self, x: ValueId, dtype: DType) -> Result<ValueId> {
        if self.ty(x).dtype == dtype {
            return Ok(x);
        }
        self.add(Op::Cast { dtype }, &[x])
    }
    /// Starts a collective; read its result through [`Self::wait`].
    pub fn collective_start(
        &mut self,
        kind: CollectiveKind,
        group: &CommGroup,
        axis: usize,
        x: ValueId,
    ) -> Result<ValueId> {
        self.add(Op::CollectiveStart { kind, group: *group, axis }, &[x])
    }
    /// Completes a collective.
    pub fn wait(&mut self, start: ValueId) -> Result<ValueId> {
        self.add(Op::CollectiveWait, &[start])
    }
    /// Start immediately followed by wait.
    pub fn collective(
        &mut self,
        kind: CollectiveKind,
        group: &CommGroup,
        axis: usize,
        x: ValueId,
    ) -> Result<ValueId> {
        let s = self.collective_start(kind, group, axis, x)?;
        self.wait(s)
    }

    /// A variable-count all-to-all along axis 0 ([`CollectiveKind::AllToAllV`]), started and
    /// waited for: `x [R, …]` sent in pieces of `send_counts` (u32 `[G]`), the `recv_counts`
    /// pieces received into a `[rows, …]` result padded with zeros.
    pub fn all_to_all_v(
        &mut self,
        group: &CommGroup,
        x: ValueId,
        send_counts: ValueId,
        recv_counts: ValueId,
        rows: usize,
    ) -> Result<ValueId> {
        let op = Op::CollectiveStart { kind: CollectiveKind::AllToAllV { rows }, group: *group, axis: 0 };
        let s = self.add(op, &[x, send_counts, recv_counts])?;
        self.wait(s)
    }

    /// Sums `x` down to `shape` (the inverse of broadcasting: leading axes summed away, axes where
    /// `shape` has 1 summed with keepdim). Used by the VJPs of broadcasting ops.
    pub fn sum_to(&mut self, x: ValueId, shape: &[usize]) -> Result<ValueId> {
        let mut v = x;
        while self.shape(v).len() > shape.len() {
            v = self.sum(v, 0, false)?;
        }
        for (axis, &d) in shape.iter().enumerate() {
            if d == 1 && self.shape(v)[axis] != 1 {
                v = self.sum(v, axis, true)?;
            }
        }
        Ok(v)
    }

    /// Declares an output.
    pub fn output(&mut self, name: &str, v: ValueId) {
        self.graph.add_output(name, v);
    }

    /// The finished graph, verified. Errors: [`GraphError::Malformed`].
    pub fn finish(self) -> Result<Graph> {
        check_graph(&self.graph)?;
        Ok(self.graph)
    }
}
