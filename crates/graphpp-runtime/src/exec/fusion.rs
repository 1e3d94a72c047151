//! Elementwise fusion of the compiled executor (docs/ARCHITECTURE.md "Runtime" → Compiled
//! executor).
//!
//! [`plan`] groups the float elementwise nodes of a graph (unary, affine, binary, broadcast,
//! `full`, and casts between f32 and bf16) into [`FusedGroup`]s: each group has one *anchor* (its last node, the only one whose value
//! leaves the group) and members whose every reader is in the group, all of the anchor's shape.
//! [`FusedGroup::eval`] computes the anchor from the group's external operands in one pass over the
//! output, in blocks of [`BLOCK`] elements held in L1-sized registers: no member value is ever
//! allocated, and operands are read through their own strides (a broadcast or permuted operand
//! is never copied; a contiguous one is read in place). The block loop is compiled for AVX-512
//! or AVX2 where the CPU has it, and a group of 256k elements or more (bf16: 64k) is split over
//! the current rayon pool (the rank's, [`crate::kernels::threads`]).
//!
//! Each member is computed with the same f32 arithmetic, in the same order, as the interpreter's
//! candle kernel for that op (`v * mul + add` for affine, `1 / (e^(−x) + 1)` for sigmoid,
//! candle's `erf_f32`), so a fused group's value is bitwise the interpreter's. A bf16 member is
//! computed as the interpreter computes a bf16 elementwise op — on its operands widened to f32,
//! the result rounded to bf16 once ([`crate::exec::kernel`]) — so its register holds f32 values
//! that are bf16 values, a bf16 operand is widened as it is loaded, and a bf16 anchor is
//! written as bf16: a mixed-precision chain (RMSNorm's casts, SwiGLU) runs as one pass with no
//! cast of its own.

use crate::kernels::tensor::{round_bf16, widen_bf16};
use candle_core::{CpuStorage, Device, Tensor};
use graphpp_graph::{BinaryOp, DType, Graph, Op, UnaryOp, ValueId};
use rayon::prelude::*;
use std::collections::BinaryHeap;
use std::mem::MaybeUninit;

/// Elements per block: one register is `BLOCK` f32 (1 KiB), so a group of 32 values stays in L1.
pub const BLOCK: usize = 256;

/// Most readers an inlined node may have ([`plan`]): the SwiGLU backward's recomputed values
/// have up to three.
const INLINE_READERS: usize = 4;

/// Groups of fewer output elements than this run on one thread. A group's operands are mostly
/// hot in the cache of the core that produced them, and another core must fetch its half
/// through the shared cache, so splitting a small group costs more than it saves.
/// (measured: docs/PERFORMANCE.md, "Fused elementwise groups")
const PARALLEL_MIN: usize = 1 << 18;

/// [`PARALLEL_MIN`] for a bf16 group, which splits from 64k elements: it reads and writes half
/// the bytes of an f32 group for the same math plus a rounding per member, so the other core's
/// fetch costs it less against what the split saves (measured: docs/PERFORMANCE.md, "Fused
/// elementwise groups"; the same threshold made f32 groups slower).
const PARALLEL_MIN_BF16: usize = 1 << 16;

/// One instruction over a block. Instruction `r` defines register `r` (emission order), so
/// every source register is below its destination.
#[derive(Clone, Debug, PartialEq)]
enum Instr {
    /// The external operand `input` (index into [`FusedGroup::inputs`]).
    Load { input: usize },
    /// `value` everywhere.
    Const { value: f32 },
    /// `f(x)`.
    Unary { f: UnaryOp, x: usize },
    /// `x * mul + add`.
    Affine { mul: f32, add: f32, x: usize },
    /// `a f b`.
    Binary { f: BinaryOp, a: usize, b: usize },
    /// `x` rounded to the nearest bf16 (kept as f32): a bf16 member's result.
    Round { x: usize },
}

/// A fused elementwise group: computes the value of node `anchor` from `inputs`.
#[derive(Clone, Debug, PartialEq)]
pub struct FusedGroup {
    /// The node whose value the group produces.
    pub anchor: usize,
    /// Member node ids, ascending (the anchor last).
    pub members: Vec<usize>,
    /// External operands, in load order.
    pub inputs: Vec<ValueId>,
    shape: Vec<usize>,
    /// The anchor's dtype (f32 or bf16): what [`FusedGroup::eval`] returns.
    dtype: DType,
    /// `code[r]` defines register `r`; the last register is the anchor.
    code: Vec<Instr>,
}

/// The groups of a graph and, per node, the group it belongs to.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fusion {
    /// The groups, ascending by anchor.
    pub groups: Vec<FusedGroup>,
    /// `member_of[node]` = index into `groups` (for a node inlined into several groups, one of
    /// them).
    pub member_of: Vec<Option<usize>>,
}

/// Whether node `i` can be a group member: an f32 or bf16 elementwise op on operands of its
/// dtype, or a cast between f32 and bf16.
fn fusible(g: &Graph, i: usize) -> bool {
    let n = &g.nodes[i];
    let float = |d: DType| matches!(d, DType::F32 | DType::BF16);
    let operands = |same: bool| {
        n.inputs
            .iter()
            .all(|x| float(g.nodes[x.0].ty.dtype) && (!same || g.nodes[x.0].ty.dtype == n.ty.dtype))
    };
    float(n.ty.dtype)
        && match n.op {
            Op::Cast { .. } => operands(false),
            _ => {
                operands(true)
                    && (n.op.is_pointwise() || matches!(n.op, Op::Broadcast { .. } | Op::Full { .. }))
            }
        }
}

/// Groups the fusible nodes of `g` (module doc). A member other than the anchor has the anchor's
/// shape, is not a graph output and is read only by members; anything else a member reads is an
/// external operand (any shape that broadcasts to the anchor's, by NumPy rules). An *inlined*
/// node ([`inlined`]) is a member of every group that reads it, computed in each and never on
/// its own (`member_of` names one of them); a node read by an inlined node is a member of no
/// group but its own (as an anchor, or a view for a broadcast), so that every group that loads
/// it finds it computed.
pub fn plan(g: &Graph) -> Fusion {
    let n = g.nodes.len();
    let users = g.users();
    let mut is_output = vec![false; n];
    for o in &g.outputs {
        is_output[o.value.0] = true;
    }
    let inline = inlined(g, &users, &is_output);
    let mut member_of: Vec<Option<usize>> = vec![None; n];
    let mut groups = Vec::new();
    for anchor in (0..n).rev() {
        // A broadcast read by no fusible node stays a view (the interpreter's): as a group of
        // its own it would be copied to full size.
        let lone_view = matches!(g.nodes[anchor].op, Op::Broadcast { .. });
        if member_of[anchor].is_some() || !fusible(g, anchor) || lone_view || inline[anchor] {
            continue;
        }
        let gid = groups.len();
        let shape = &g.nodes[anchor].ty.shape;
        member_of[anchor] = Some(gid);
        let mut members = vec![anchor];
        // Candidates largest id first: every reader of a candidate has a larger id, so it has
        // been decided by the time the candidate is.
        let mut heap: BinaryHeap<usize> = g.nodes[anchor].inputs.iter().map(|x| x.0).collect();
        while let Some(x) = heap.pop() {
            if heap.peek() == Some(&x) {
                continue;
            }
            let joins = inline[x]
                || (member_of[x].is_none()
                    && fusible(g, x)
                    && !is_output[x]
                    && &g.nodes[x].ty.shape == shape
                    // An inlined reader is in other groups too, which would load x: x must run.
                    && users[x].iter().all(|u| member_of[u.0] == Some(gid) && !inline[u.0]));
            if joins {
                member_of[x].get_or_insert(gid);
                members.push(x);
                heap.extend(g.nodes[x].inputs.iter().map(|v| v.0));
            }
        }
        members.sort_unstable();
        groups.push(emit(g, anchor, members, &member_of, gid));
    }
    // Renumber ascending by anchor (the loop above found them descending).
    groups.reverse();
    let last = groups.len().saturating_sub(1);
    for m in member_of.iter_mut().flatten() {
        *m = last - *m;
    }
    Fusion { groups, member_of }
}

/// The nodes computed inside each group that reads them instead of once: f32 unary, affine,
/// binary, broadcast and full nodes (not outputs) read by at most [`INLINE_READERS`] nodes, all
/// unary, affine or binary of their own shape — so every reader is in a group that can recompute
/// them and they are never written to memory (a broadcast or a constant costs nothing in a
/// group: a load through broadcast strides, a constant register). The bound keeps the repeated
/// arithmetic small (a node is computed once in each group that reads it, directly or through
/// other inlined nodes). A pointwise value the backward recomputes from a saved operand
/// ([`graphpp_graph::RecomputePolicy::Pointwise`]: the SwiGLU's `g·σ(g)`, the norms' `x·r`)
/// costs its arithmetic once per group that reads it instead of a write and the groups' reads.
/// Except a [`transcendental`] node whose readers end in more than one group (the backward's
/// `σ(g)`): it is computed once, in a group of its own, and read back by the groups — its
/// exponent costs more than a write and reads of a value still in cache (measured:
/// docs/PERFORMANCE.md, "Activation recomputation"). (Read only through nodes that all end in
/// one group — the forward's σ(g), read by g·σ(g) — it is inlined: computed once there.)
fn inlined(g: &Graph, users: &[Vec<ValueId>], is_output: &[bool]) -> Vec<bool> {
    // Not casts: a value read by a cast (a bf16 residual stream read by its norm's widening
    // cast) would be recomputed along its whole chain in every group that reads the cast.
    let pointwise = |i: usize| g.nodes[i].op.is_pointwise() && fusible(g, i);
    let cheap = |i: usize| matches!(g.nodes[i].op, Op::Broadcast { .. } | Op::Full { .. }) && fusible(g, i);
    let n = g.nodes.len();
    let mut inline = vec![false; n];
    // reaches[i]: the one node, not inlined, that every chain of readers from i ends at (through
    // inlined readers), if there is one — then inlining i computes it in one group only.
    let mut reaches: Vec<Option<usize>> = vec![None; n];
    // Readers come after what they read: deciding from the last node back, every reader of a
    // node is decided before it.
    for i in (0..n).rev() {
        let mut ends = users[i].iter().map(|u| if inline[u.0] { reaches[u.0] } else { Some(u.0) });
        let first = ends.next().flatten();
        reaches[i] = first.filter(|&f| ends.all(|e| e == Some(f)));
        inline[i] = (pointwise(i) || cheap(i))
            && !is_output[i]
            && (1..=INLINE_READERS).contains(&users[i].len())
            && users[i].iter().all(|u| pointwise(u.0) && g.nodes[u.0].ty.shape == g.nodes[i].ty.shape)
            && (reaches[i].is_some() || !transcendental(&g.nodes[i].op));
    }
    inline
}

/// Whether `op` is an exponential, logarithm, sigmoid or erf: computing one costs more than
/// writing a value a group just computed and reading it back while it stays in cache (exp is
/// [`crate::kernels::expf`]'s; log and erf are libm's, classed with exp and sigmoid without a
/// measurement of their own). (measured: docs/PERFORMANCE.md, "Fused elementwise groups")
fn transcendental(op: &Op) -> bool {
    matches!(op, Op::Unary { f: UnaryOp::Exp | UnaryOp::Log | UnaryOp::Sigmoid | UnaryOp::Erf })
}

/// The code of the group `gid` with `members` (ascending).
fn emit(
    g: &Graph,
    anchor: usize,
    members: Vec<usize>,
    member_of: &[Option<usize>],
    gid: usize,
) -> FusedGroup {
    let mut code = Vec::new();
    let mut inputs: Vec<ValueId> = Vec::new();
    let mut reg_of = std::collections::HashMap::new();
    let mut operand =
        |x: ValueId, code: &mut Vec<Instr>, reg_of: &mut std::collections::HashMap<usize, usize>| {
            if let Some(&r) = reg_of.get(&x.0) {
                return r;
            }
            debug_assert!(member_of[x.0] != Some(gid), "members are emitted before their readers");
            let input = inputs.iter().position(|&v| v == x).unwrap_or_else(|| {
                inputs.push(x);
                inputs.len() - 1
            });
            code.push(Instr::Load { input });
            reg_of.insert(x.0, code.len() - 1);
            code.len() - 1
        };
    for &m in &members {
        let node = &g.nodes[m];
        let ins: Vec<usize> = node.inputs.iter().map(|&x| operand(x, &mut code, &mut reg_of)).collect();
        let bf16 = node.ty.dtype == DType::BF16;
        let instr = match &node.op {
            Op::Unary { f } => Instr::Unary { f: *f, x: ins[0] },
            Op::Affine { mul, add } => Instr::Affine { mul: *mul as f32, add: *add as f32, x: ins[0] },
            Op::Binary { f } => Instr::Binary { f: *f, a: ins[0], b: ins[1] },
            // A broadcast member reads its operand with broadcast strides, and a widening cast's
            // operand is already widened in its register: the load is the value.
            // The anchor's bf16 output is rounded as it is written (`Out::BF16`), so a narrowing
            // cast there is its operand too.
            Op::Broadcast { .. } | Op::Cast { dtype: DType::F32 } => {
                reg_of.insert(m, ins[0]);
                continue;
            }
            Op::Cast { .. } if m == anchor => {
                reg_of.insert(m, ins[0]);
                continue;
            }
            Op::Cast { .. } => Instr::Round { x: ins[0] },
            // The interpreter's `zeros + value` (so −0.0 gives +0.0); in bf16, candle's
            // `bf16::from_f64(value)`.
            Op::Full { value, .. } if bf16 => {
                Instr::Const { value: 0.0 + half::bf16::from_f64(*value).to_f32() }
            }
            Op::Full { value, .. } => Instr::Const { value: 0.0 + *value as f32 },
            other => unreachable!("{} is not fusible", other.mnemonic()),
        };
        // A bf16 member rounds its register for its readers; the anchor is rounded on the way out.
        let rounds = bf16 && node.op.is_pointwise() && m != anchor;
        code.push(instr);
        if rounds {
            code.push(Instr::Round { x: code.len() - 1 });
        }
        reg_of.insert(m, code.len() - 1);
    }
    // The anchor's register must be the last: an anchor whose value is an earlier register gets
    // a copy.
    let last = reg_of[&anchor];
    if last + 1 != code.len() {
        code.push(Instr::Affine { mul: 1.0, add: 0.0, x: last });
    }
    let (shape, dtype) = (g.nodes[anchor].ty.shape.clone(), g.nodes[anchor].ty.dtype);
    FusedGroup { anchor, members, inputs, shape, dtype, code }
}

/// An operand's elements: f32, or bf16 (widened as they are loaded).
#[derive(Clone, Copy)]
enum Data<'a> {
    F32(&'a [f32]),
    BF16(&'a [half::bf16]),
}

/// An operand as the kernel reads it: its elements and, per (coalesced) output dim, its stride.
struct Operand<'a> {
    data: Data<'a>,
    offset: usize,
    strides: Vec<usize>,
}

impl FusedGroup {
    /// The anchor's value from the external operands `args` (in [`FusedGroup::inputs`] order, f32
    /// or bf16 tensors on the CPU of shapes that broadcast to the anchor's), in the anchor's
    /// dtype. Splits the output over the
    /// current rayon pool's threads when it has at least 256k elements (`PARALLEL_MIN`; bf16:
    /// 64k, `PARALLEL_MIN_BF16`).
    ///
    /// # Errors
    /// candle's, for an operand that is not a CPU f32 or bf16 tensor or does not broadcast.
    pub fn eval(&self, args: &[&Tensor]) -> candle_core::Result<Tensor> {
        if args.len() != self.inputs.len() {
            candle_core::bail!(
                "fused group of node %{}: {} operands for {} inputs",
                self.anchor,
                args.len(),
                self.inputs.len()
            )
        }
        let guards: Vec<_> = args.iter().map(|t| t.storage_and_layout()).collect();
        let mut ops = Vec::with_capacity(args.len());
        for (t, (storage, layout)) in args.iter().zip(&guards) {
            let data = match storage_cpu(storage)? {
                CpuStorage::F32(v) => Data::F32(v),
                CpuStorage::BF16(v) => Data::BF16(v),
                _ => candle_core::bail!(
                    "fused group of node %{}: operand is {:?}, not f32 or bf16",
                    self.anchor,
                    t.dtype()
                ),
            };
            let strides = broadcast_strides(t.dims(), layout.stride(), &self.shape).ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "fused group of node %{}: operand {:?} does not broadcast to {:?}",
                    self.anchor,
                    t.dims(),
                    self.shape
                ))
            })?;
            ops.push(Operand { data, offset: layout.start_offset(), strides });
        }
        let (dims, ops) = coalesce(&self.shape, ops);
        let shape = self.shape.clone();
        match self.dtype {
            DType::BF16 => Tensor::from_vec(self.fill(&dims, &ops, |o| Out::BF16(o)), shape, &Device::Cpu),
            _ => Tensor::from_vec(self.fill(&dims, &ops, |o| Out::F32(o)), shape, &Device::Cpu),
        }
    }

    /// Every output element, in a vector of `T` that `wrap` views as an [`Out`]: split over the
    /// current pool's threads for a large group (`PARALLEL_MIN`, `PARALLEL_MIN_BF16`).
    fn fill<T: Send>(
        &self,
        dims: &[usize],
        ops: &[Operand],
        wrap: impl for<'o> Fn(&'o mut [MaybeUninit<T>]) -> Out<'o> + Sync,
    ) -> Vec<T> {
        let numel: usize = self.shape.iter().product();
        let threads = rayon::current_num_threads();
        // Not zeroed: every element is written once. Zeroing first is a pass over the output:
        // under an allocator whose blocks come back cold (glibc's) it pays for itself as a fast
        // fill ahead of the writes, but mimalloc's blocks come back hot (`crate::malloc`) and
        // the pass is pure cost (measured: docs/PERFORMANCE.md, "Fused elementwise groups").
        let mut out: Vec<T> = Vec::with_capacity(numel);
        let spare = &mut out.spare_capacity_mut()[..numel];
        let min = if self.dtype == DType::BF16 { PARALLEL_MIN_BF16 } else { PARALLEL_MIN };
        if threads > 1 && numel >= min {
            let chunk = numel.div_ceil(threads).next_multiple_of(BLOCK);
            spare
                .par_chunks_mut(chunk)
                .enumerate()
                .for_each(|(c, o)| self.dispatch(dims, ops, c * chunk, wrap(o)));
        } else {
            self.dispatch(dims, ops, 0, wrap(spare));
        }
        // SAFETY: `run` wrote every one of the `numel` elements (its blocks tile `out`).
        unsafe { out.set_len(numel) };
        out
    }

    /// [`FusedGroup::run`] compiled for AVX-512 F, else AVX2, where the CPU has it (16 or 8 lanes
    /// instead of SSE2's 4; the same operations in the same order, so the same bits: Rust never
    /// fuses a multiply and an add on its own). AVX-512 over AVX2: `small`'s non-matmul time
    /// 0.5–1.6 ms less a fwbw in f32 and 1.2–1.9 in bf16 (per alternation), of 40 and 46 (docs/PERFORMANCE.md,
    /// "Fused elementwise groups").
    fn dispatch(&self, dims: &[usize], ops: &[Operand], start: usize, out: Out) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F (checked just above).
            return unsafe { self.run_avx512(dims, ops, start, out) };
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { self.run_avx2(dims, ops, start, out) };
        }
        self.run(dims, ops, start, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn run_avx512(&self, dims: &[usize], ops: &[Operand], start: usize, out: Out) {
        self.run(dims, ops, start, out)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn run_avx2(&self, dims: &[usize], ops: &[Operand], start: usize, out: Out) {
        self.run(dims, ops, start, out)
    }

    /// Computes output elements `start .. start + out.len()` (row-major over `dims`) into `out`,
    /// block by block. A block is up to [`BLOCK`] elements:
    /// part of one row of the innermost dim, or — when that dim is shorter — whole rows of it,
    /// consecutive along the next one, so short rows (a head's 32 elements) do not each pay the
    /// per-block setup.
    #[inline(always)]
    fn run(&self, dims: &[usize], ops: &[Operand], start: usize, mut out: Out) {
        let nd = dims.len();
        let inner = dims[nd - 1];
        let next = if nd >= 2 { dims[nd - 2] } else { 1 };
        // Scratch registers, never read before the block's instruction writes them.
        let mut regs: Box<[MaybeUninit<f32>]> = Box::new_uninit_slice(self.code.len() * BLOCK);
        let mut base = vec![0usize; ops.len()];
        let end = start + out.len();
        let mut p = start;
        while p < end {
            let (outer, i) = (p / inner, p % inner);
            // Whole rows when the block starts a row and rows are short; else part of one row.
            let rows = if i == 0 && inner < BLOCK {
                (BLOCK / inner).min(next - outer % next).min((end - p) / inner).max(1)
            } else {
                1
            };
            let cols = if rows > 1 { inner } else { BLOCK.min(inner - i).min(end - p) };
            // Each operand's offset at output position p.
            let mut rest = outer;
            for (b, op) in base.iter_mut().zip(ops) {
                *b = op.offset + i * op.strides[nd - 1];
            }
            for d in (0..nd - 1).rev() {
                let idx = rest % dims[d];
                rest /= dims[d];
                for (b, op) in base.iter_mut().zip(ops) {
                    *b += idx * op.strides[d];
                }
            }
            let shape = Block { rows, cols, outer: nd - 1 };
            let len = rows * cols;
            self.block(ops, &base, shape, &mut regs, out.part(p - start, len));
            p += len;
        }
    }

    /// Runs the code over one block whose operands start at `base`; the last instruction writes
    /// `out` (an f32 one directly, a bf16 one through its register, rounded). A load that is
    /// one contiguous run of the operand is not copied: its readers read the operand in place.
    #[inline(always)]
    fn block(
        &self,
        ops: &[Operand],
        base: &[usize],
        blk: Block,
        regs: &mut [MaybeUninit<f32>],
        mut out: Out,
    ) {
        let len = blk.rows * blk.cols;
        let last = self.code.len() - 1;
        for (r, instr) in self.code.iter().enumerate() {
            let (lo, hi) = regs.split_at_mut(r * BLOCK);
            let d = match &mut out {
                Out::F32(o) if r == last => &mut **o,
                _ => &mut hi[..len],
            };
            let reg = |x: usize| -> &[f32] {
                if let Instr::Load { input } = self.code[x] {
                    if let Some(run) = ops[input].run_in_place(blk, base[input], len) {
                        return run;
                    }
                }
                // SAFETY: register x < r was written in full (`len` elements) by its
                // instruction earlier in this block: every instruction but an in-place load
                // (handled above) writes all of its `d`.
                unsafe { assume_init(&lo[x * BLOCK..x * BLOCK + len]) }
            };
            match *instr {
                // Read in place by its readers unless it is the group's value (or widened).
                Instr::Load { input } if ops[input].in_place(blk) && r != last => {}
                Instr::Load { input } => ops[input].load(base[input], blk, d),
                Instr::Const { value } => d.iter_mut().for_each(|v| {
                    v.write(value);
                }),
                Instr::Unary { f, x } => unary(f, reg(x), d),
                Instr::Affine { mul, add, x } => map(reg(x), d, |x| x * mul + add),
                Instr::Binary { f, a, b } => binary(f, reg(a), reg(b), d),
                Instr::Round { x } => map(reg(x), d, |v| widen_bf16(round_bf16(v))),
            }
        }
        if let Out::BF16(o) = out {
            // SAFETY: the last instruction wrote its register in full (`len` elements).
            let values = unsafe { assume_init(&regs[last * BLOCK..last * BLOCK + len]) };
            for (o, &v) in o.iter_mut().zip(values) {
                o.write(round_bf16(v));
            }
        }
    }
}

/// Where a group writes its output elements: the anchor's dtype.
enum Out<'a> {
    F32(&'a mut [MaybeUninit<f32>]),
    BF16(&'a mut [MaybeUninit<half::bf16>]),
}

impl Out<'_> {
    fn len(&self) -> usize {
        match self {
            Out::F32(o) => o.len(),
            Out::BF16(o) => o.len(),
        }
    }

    /// Elements `at .. at + len`.
    fn part(&mut self, at: usize, len: usize) -> Out<'_> {
        match self {
            Out::F32(o) => Out::F32(&mut o[at..at + len]),
            Out::BF16(o) => Out::BF16(&mut o[at..at + len]),
        }
    }
}

/// `s` read as initialised values.
///
/// # Safety
/// Every element of `s` has been written.
#[inline(always)]
unsafe fn assume_init(s: &[MaybeUninit<f32>]) -> &[f32] {
    // SAFETY: `MaybeUninit<f32>` has f32's layout; the caller guarantees initialisation.
    unsafe { &*(s as *const [MaybeUninit<f32>] as *const [f32]) }
}

/// The extent of a block: `rows` consecutive indices of output dim `outer - 1` (1 when the
/// block is part of one row) × `cols` of the innermost dim `outer`.
#[derive(Clone, Copy)]
struct Block {
    rows: usize,
    cols: usize,
    outer: usize,
}

impl Operand<'_> {
    /// The (row, column) strides of a block.
    fn block_strides(&self, blk: Block) -> (usize, usize) {
        let row = if blk.rows > 1 { self.strides[blk.outer - 1] } else { 0 };
        (row, self.strides[blk.outer])
    }

    /// Whether the block is one contiguous run of this operand.
    fn contiguous(&self, blk: Block) -> bool {
        let (row, col) = self.block_strides(blk);
        col == 1 && (blk.rows == 1 || row == blk.cols)
    }

    /// Whether the block is read in place: one contiguous run of f32 elements.
    fn in_place(&self, blk: Block) -> bool {
        matches!(self.data, Data::F32(_)) && self.contiguous(blk)
    }

    /// The block's `len` elements from `base`, where it is read in place ([`Operand::in_place`]).
    #[inline(always)]
    fn run_in_place(&self, blk: Block, base: usize, len: usize) -> Option<&[f32]> {
        match self.data {
            Data::F32(data) if self.contiguous(blk) => Some(&data[base..base + len]),
            _ => None,
        }
    }

    /// Copies the block starting at `base` into `d` (every element written; bf16 widened).
    #[inline(always)]
    fn load(&self, base: usize, blk: Block, d: &mut [MaybeUninit<f32>]) {
        match self.data {
            Data::F32(data) => Self::copy(data, base, blk, self.block_strides(blk), d, |x| x),
            Data::BF16(data) => Self::copy(data, base, blk, self.block_strides(blk), d, widen_bf16),
        }
    }

    /// [`Operand::load`] of `data` on (row, column) strides, each element through `f`.
    #[inline(always)]
    fn copy<T: Copy>(
        data: &[T],
        base: usize,
        blk: Block,
        (row, col): (usize, usize),
        d: &mut [MaybeUninit<f32>],
        f: impl Fn(T) -> f32,
    ) {
        for (r, out) in d.chunks_mut(blk.cols).enumerate() {
            let b = base + r * row;
            match col {
                0 => out.iter_mut().for_each(|v| {
                    v.write(f(data[b]));
                }),
                1 => out.iter_mut().zip(&data[b..b + blk.cols]).for_each(|(v, &x)| {
                    v.write(f(x));
                }),
                _ => out.iter_mut().enumerate().for_each(|(k, v)| {
                    v.write(f(data[b + k * col]));
                }),
            }
        }
    }
}

/// The CPU storage of a tensor (every graphpp tensor is on the CPU).
fn storage_cpu(s: &candle_core::Storage) -> candle_core::Result<&CpuStorage> {
    match s {
        candle_core::Storage::Cpu(c) => Ok(c),
        _ => candle_core::bail!("the compiled executor runs on the CPU"),
    }
}

/// `d[i] = f(x[i])` for every element of `d`.
#[inline(always)]
fn map(x: &[f32], d: &mut [MaybeUninit<f32>], f: impl Fn(f32) -> f32) {
    d.iter_mut().zip(x).for_each(|(v, &x)| {
        v.write(f(x));
    });
}

#[inline(always)]
fn unary(f: UnaryOp, x: &[f32], d: &mut [MaybeUninit<f32>]) {
    match f {
        UnaryOp::Neg => map(x, d, |x| -x),
        UnaryOp::Exp => crate::kernels::expf::exp_into(x, d, false),
        UnaryOp::Log => map(x, d, f32::ln),
        UnaryOp::Sqrt => map(x, d, f32::sqrt),
        UnaryOp::Recip => map(x, d, |x| 1.0 / x),
        UnaryOp::Sigmoid => {
            crate::kernels::expf::exp_into(x, d, true);
            d.iter_mut().for_each(|v| {
                // SAFETY: `exp_into` wrote every element of `d`.
                let e = unsafe { v.assume_init() };
                v.write(1.0 / (e + 1.0));
            });
        }
        UnaryOp::Erf => map(x, d, candle_core::cpu::erf::erf_f32),
    }
}

#[inline(always)]
fn binary(f: BinaryOp, a: &[f32], b: &[f32], d: &mut [MaybeUninit<f32>]) {
    // One loop per op (each monomorphised, so each vectorises).
    fn zip(a: &[f32], b: &[f32], d: &mut [MaybeUninit<f32>], op: impl Fn(f32, f32) -> f32) {
        d.iter_mut().zip(a.iter().zip(b)).for_each(|(v, (&a, &b))| {
            v.write(op(a, b));
        });
    }
    match f {
        BinaryOp::Add => zip(a, b, d, |a, b| a + b),
        BinaryOp::Sub => zip(a, b, d, |a, b| a - b),
        BinaryOp::Mul => zip(a, b, d, |a, b| a * b),
        BinaryOp::Div => zip(a, b, d, |a, b| a / b),
        BinaryOp::Eq => zip(a, b, d, |a, b| if a == b { 1.0 } else { 0.0 }),
    }
}

/// The strides (elements) with which an operand of `dims` and `strides` is read at each index of
/// `shape` under NumPy broadcasting (aligned right; 0 along a broadcast dim); `None` when it does
/// not broadcast.
fn broadcast_strides(dims: &[usize], strides: &[usize], shape: &[usize]) -> Option<Vec<usize>> {
    let lead = shape.len().checked_sub(dims.len())?;
    let mut out = vec![0; shape.len()];
    for (k, (&d, &s)) in dims.iter().zip(strides).enumerate() {
        match d {
            _ if d == shape[lead + k] => out[lead + k] = s,
            1 => {}
            _ => return None,
        }
    }
    Some(out)
}

/// Merges adjacent output dims that every operand reads as one (stride of the outer = inner
/// stride × inner size), so the innermost loop is as long as the layouts allow.
fn coalesce<'a>(shape: &[usize], mut ops: Vec<Operand<'a>>) -> (Vec<usize>, Vec<Operand<'a>>) {
    let mut dims: Vec<usize> = Vec::with_capacity(shape.len());
    let mut keep: Vec<Vec<usize>> = vec![Vec::new(); ops.len()];
    for (k, &size) in shape.iter().enumerate() {
        let merge = !dims.is_empty()
            && ops.iter().zip(&keep).all(|(op, kept)| kept.last() == Some(&(op.strides[k] * size)));
        if merge {
            *dims.last_mut().expect("not empty") *= size;
            for (op, kept) in ops.iter().zip(keep.iter_mut()) {
                *kept.last_mut().expect("not empty") = op.strides[k];
            }
        } else {
            dims.push(size);
            for (op, kept) in ops.iter().zip(keep.iter_mut()) {
                kept.push(op.strides[k]);
            }
        }
    }
    for (op, kept) in ops.iter_mut().zip(keep) {
        op.strides = kept;
    }
    if dims.is_empty() {
        dims.push(1);
        for op in ops.iter_mut() {
            op.strides.push(0);
        }
    }
    (dims, ops)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The loop compiled for each vector width this CPU has (AVX-512 F, AVX2) and the portable one
    /// give the same bits, those of each op's f32 arithmetic in order.
    #[test]
    fn every_compiled_loop_gives_the_portable_loops_bits() {
        // x [3, 40] (rows shorter than a block), y [40] broadcast: z = sigmoid(x) * y / x + 0.5
        let mut b = graphpp_graph::GraphBuilder::new("g", DType::F32);
        let x = b.input("x", graphpp_graph::InputKind::Activation, vec![3, 40]).unwrap();
        let y = b.input("y", graphpp_graph::InputKind::Activation, vec![40]).unwrap();
        let s = b.sigmoid(x).unwrap();
        let m = b.mul(s, y).unwrap();
        let d = b.div(m, x).unwrap();
        let z = b.affine(d, 1.0, 0.5).unwrap();
        b.output("z", z);
        let g = b.finish().unwrap();
        let group = &plan(&g).groups[0];
        let xs: Vec<f32> = (0..120).map(|i| (i as f32 - 59.5) * 0.037).collect();
        let ys: Vec<f32> = (0..40).map(|i| 1.0 + i as f32 * 0.01).collect();
        let ops = || {
            vec![
                Operand { data: Data::F32(&xs), offset: 0, strides: vec![40, 1] },
                Operand { data: Data::F32(&ys), offset: 0, strides: vec![0, 1] },
            ]
        };
        let (dims, a) = coalesce(&[3, 40], ops());
        let bits = |run: &dyn Fn(Out)| {
            let mut out = [MaybeUninit::new(f32::NAN); 120];
            run(Out::F32(&mut out));
            // SAFETY: initialised (NaN) above, then overwritten by the kernel.
            out.map(|v| unsafe { v.assume_init() }.to_bits()).to_vec()
        };
        let portable = bits(&|o| group.run(&dims, &a, 0, o));
        assert_eq!(bits(&|o| group.dispatch(&dims, &a, 0, o)), portable);
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512 F (checked just above).
                assert_eq!(bits(&|o| unsafe { group.run_avx512(&dims, &a, 0, o) }), portable, "AVX-512");
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked just above).
                assert_eq!(bits(&|o| unsafe { group.run_avx2(&dims, &a, 0, o) }), portable, "AVX2");
            }
        }
        let portable: Vec<f32> = portable.into_iter().map(f32::from_bits).collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let expect: Vec<f32> =
            (0..120).map(|i| (1.0 / ((-xs[i]).exp() + 1.0)) * ys[i % 40] / xs[i] * 1.0 + 0.5).collect();
        assert_eq!(bits(&portable), bits(&expect), "each op's f32 arithmetic, in order");
    }

    #[test]
    fn broadcast_strides_align_right() {
        assert_eq!(broadcast_strides(&[4, 1], &[1, 1], &[2, 4, 3]), Some(vec![0, 1, 0]));
        assert_eq!(broadcast_strides(&[2, 3], &[3, 1], &[2, 3]), Some(vec![3, 1]));
        assert_eq!(broadcast_strides(&[5], &[1], &[2, 3]), None);
    }

    #[test]
    fn coalesce_merges_contiguous_dims_only() {
        let data = [0f32; 24];
        let contiguous = Operand { data: Data::F32(&data), offset: 0, strides: vec![12, 4, 1] };
        let (dims, ops) = coalesce(&[2, 3, 4], vec![contiguous]);
        assert_eq!((dims, ops[0].strides.clone()), (vec![24], vec![1]));
        // A row broadcast along the middle dim keeps it apart.
        let a = Operand { data: Data::F32(&data), offset: 0, strides: vec![12, 4, 1] };
        let b = Operand { data: Data::F32(&data), offset: 0, strides: vec![4, 0, 1] };
        let (dims, ops) = coalesce(&[2, 3, 4], vec![a, b]);
        assert_eq!(dims, vec![2, 3, 4]);
        assert_eq!(ops[1].strides, vec![4, 0, 1]);
    }
}
