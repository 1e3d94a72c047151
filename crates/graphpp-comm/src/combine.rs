//! Backend-independent halves of every collective: the checks a rank makes on its own input when
//! it starts one (before anything is posted), and the combination of all members' contributions
//! when it waits — in group-rank order, so every rank computes the bitwise-same result whatever
//! the arrival order. A backend only moves [`Contribution`]s between ranks.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::{AllToAllOutput, CollectiveOp, CommError, Group, TensorDesc};

/// One member's contribution to one collective call.
#[derive(Clone, Debug)]
pub(crate) enum Contribution {
    /// All-reduce input.
    AllReduce(Tensor),
    /// All-gather input.
    AllGather(Tensor),
    /// Reduce-scatter input (whole tensor; each receiver takes its chunk).
    ReduceScatter(Tensor),
    /// All-to-all input cut into one piece per group rank.
    AllToAll {
        /// The whole tensor sent (for error messages).
        desc: TensorDesc,
        /// `pieces[j]` goes to group rank j.
        pieces: Vec<Tensor>,
    },
    /// Arrival at a barrier.
    Barrier,
}

impl Contribution {
    /// The collective this contributes to.
    pub(crate) fn op(&self) -> CollectiveOp {
        match self {
            Contribution::AllReduce(_) => CollectiveOp::AllReduce,
            Contribution::AllGather(_) => CollectiveOp::AllGather,
            Contribution::ReduceScatter(_) => CollectiveOp::ReduceScatter,
            Contribution::AllToAll { .. } => CollectiveOp::AllToAll,
            Contribution::Barrier => CollectiveOp::Barrier,
        }
    }

    fn tensor(&self) -> Option<&Tensor> {
        match self {
            Contribution::AllReduce(t) | Contribution::AllGather(t) | Contribution::ReduceScatter(t) => {
                Some(t)
            }
            Contribution::AllToAll { .. } | Contribution::Barrier => None,
        }
    }
}

/// One rank's view of one collective call.
#[derive(Clone, Debug)]
pub(crate) struct Call {
    /// The rank combining.
    pub(crate) rank: usize,
    /// Its position in the group.
    pub(crate) index: usize,
    /// The group.
    pub(crate) group: Group,
    /// Sequence number of the call on the group.
    pub(crate) seq: u64,
    /// What this rank called.
    pub(crate) op: CollectiveOp,
}

/// How a finished call's contributions (in group order) become this rank's result.
pub(crate) type Finish<T> = fn(&Call, &[Contribution]) -> Result<T, CommError>;

/// Checks that `x` can be summed. Errors: [`CommError::Dtype`].
pub(crate) fn check_summable(rank: usize, op: CollectiveOp, x: &Tensor) -> Result<(), CommError> {
    match x.dtype() {
        DType::F32 | DType::F64 | DType::BF16 | DType::F16 => Ok(()),
        dtype => Err(CommError::Dtype { rank, op, dtype }),
    }
}

/// Length of dim 0 of `x`. Errors: [`CommError::Scalar`].
pub(crate) fn rows(rank: usize, op: CollectiveOp, x: &Tensor) -> Result<usize, CommError> {
    x.dims().first().copied().ok_or(CommError::Scalar { rank, op })
}

/// Checks a reduce-scatter input: summable, rows divisible by the group size.
pub(crate) fn check_reduce_scatter(rank: usize, group_size: usize, x: &Tensor) -> Result<(), CommError> {
    let op = CollectiveOp::ReduceScatter;
    check_summable(rank, op, x)?;
    let rows = rows(rank, op, x)?;
    if rows % group_size != 0 {
        return Err(CommError::Indivisible { rank, rows, group_size });
    }
    Ok(())
}

/// Cuts `x` along dim 0 into consecutive pieces of `counts[j]` rows. Errors: [`CommError::Scalar`],
/// [`CommError::Counts`] (not one count per member, or not adding up to the rows of `x`).
pub(crate) fn split_rows(
    rank: usize,
    group_size: usize,
    x: &Tensor,
    counts: &[usize],
) -> Result<Contribution, CommError> {
    let op = CollectiveOp::AllToAll;
    let rows = rows(rank, op, x)?;
    let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c));
    if counts.len() != group_size || total != Some(rows) {
        return Err(CommError::Counts { rank, counts: counts.to_vec(), rows, group_size });
    }
    let mut pieces = Vec::with_capacity(counts.len());
    let mut start = 0;
    for &c in counts {
        pieces.push(x.narrow(0, start, c).map_err(|e| kernel(rank, op, e))?);
        start += c;
    }
    Ok(Contribution::AllToAll { desc: TensorDesc::of(x), pieces })
}

/// All-reduce: the sum in group order.
pub(crate) fn finish_all_reduce(call: &Call, cs: &[Contribution]) -> Result<Tensor, CommError> {
    let xs = same_tensors(call, cs)?;
    sum_in_order(call, &xs)
}

/// All-gather: the concatenation along dim 0 in group order.
pub(crate) fn finish_all_gather(call: &Call, cs: &[Contribution]) -> Result<Tensor, CommError> {
    let xs = same_tensors(call, cs)?;
    Tensor::cat(&xs, 0).map_err(|e| kernel(call.rank, call.op, e))
}

/// Reduce-scatter: chunk `call.index` of the sum (each member's chunk summed in group order).
pub(crate) fn finish_reduce_scatter(call: &Call, cs: &[Contribution]) -> Result<Tensor, CommError> {
    let xs = same_tensors(call, cs)?;
    let n = xs[0].dims()[0] / cs.len();
    let chunks = xs
        .iter()
        .map(|x| x.narrow(0, call.index * n, n))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| kernel(call.rank, call.op, e))?;
    sum_in_order(call, &chunks.iter().collect::<Vec<_>>())
}

/// All-to-all: the pieces every member cut for this rank, concatenated in group order.
pub(crate) fn finish_all_to_all(call: &Call, cs: &[Contribution]) -> Result<AllToAllOutput, CommError> {
    same_op(call, cs)?;
    let mut mine = Vec::with_capacity(cs.len());
    let mut first: Option<&TensorDesc> = None;
    for (i, c) in cs.iter().enumerate() {
        let Contribution::AllToAll { desc, pieces } = c else {
            return Err(op_mismatch(call, cs, i));
        };
        if let Some(f) = first {
            if f.dtype != desc.dtype || f.shape[1..] != desc.shape[1..] {
                return Err(mismatch(call, f, i, desc));
            }
        } else {
            first = Some(desc);
        }
        mine.push(&pieces[call.index]);
    }
    let recv_counts: Vec<usize> = mine.iter().map(|p| p.dims()[0]).collect();
    let nonempty: Vec<&Tensor> = mine.iter().copied().filter(|p| p.dims()[0] > 0).collect();
    let data = match nonempty.as_slice() {
        // Nothing received: the (zero-row) piece from the first member has the right dtype and dims.
        [] => mine[0].clone(),
        [one] => (*one).clone(),
        many => Tensor::cat(many, 0).map_err(|e| kernel(call.rank, call.op, e))?,
    };
    Ok(AllToAllOutput { data, recv_counts })
}

/// Barrier: every member arrived.
pub(crate) fn finish_barrier(call: &Call, cs: &[Contribution]) -> Result<(), CommError> {
    same_op(call, cs)
}

/// Checks every member called the same collective as the first member.
fn same_op(call: &Call, cs: &[Contribution]) -> Result<(), CommError> {
    match cs.iter().position(|c| c.op() != cs[0].op()) {
        Some(i) => Err(op_mismatch(call, cs, i)),
        None => Ok(()),
    }
}

fn op_mismatch(call: &Call, cs: &[Contribution], i: usize) -> CommError {
    CommError::OpMismatch {
        group: call.group.to_string(),
        seq: call.seq,
        rank: call.group.ranks()[0],
        op: cs[0].op(),
        other_rank: call.group.ranks()[i],
        other_op: cs[i].op(),
    }
}

fn mismatch(call: &Call, first: &TensorDesc, i: usize, other: &TensorDesc) -> CommError {
    CommError::Mismatch {
        op: call.op,
        group: call.group.to_string(),
        seq: call.seq,
        rank: call.group.ranks()[0],
        desc: first.clone(),
        other_rank: call.group.ranks()[i],
        other_desc: other.clone(),
    }
}

/// The members' tensors, checked to be the same collective with the same dtype and shape.
fn same_tensors<'c>(call: &Call, cs: &'c [Contribution]) -> Result<Vec<&'c Tensor>, CommError> {
    same_op(call, cs)?;
    let mut xs = Vec::with_capacity(cs.len());
    for (i, c) in cs.iter().enumerate() {
        xs.push(c.tensor().ok_or_else(|| op_mismatch(call, cs, i))?);
    }
    let first = TensorDesc::of(xs[0]);
    for (i, x) in xs.iter().enumerate().skip(1) {
        let d = TensorDesc::of(x);
        if d != first {
            return Err(mismatch(call, &first, i, &d));
        }
    }
    Ok(xs)
}

/// `((x₀ + x₁) + x₂) + …` in f64 for f64 tensors, in f32 otherwise, rounded back to the dtype.
fn sum_in_order(call: &Call, xs: &[&Tensor]) -> Result<Tensor, CommError> {
    let err = |e| kernel(call.rank, call.op, e);
    let dtype = xs[0].dtype();
    let acc_dtype = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let mut acc = xs[0].to_dtype(acc_dtype).map_err(err)?;
    for x in &xs[1..] {
        acc = acc.add(&x.to_dtype(acc_dtype).map_err(err)?).map_err(err)?;
    }
    acc.to_dtype(dtype).map_err(err)
}

fn kernel(rank: usize, op: CollectiveOp, e: candle_core::Error) -> CommError {
    CommError::Tensor { rank, op, source: Arc::new(e) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn call(op: CollectiveOp, index: usize) -> Call {
        Call { rank: index, index, group: Group::new("g", vec![0, 1, 2]).unwrap(), seq: 5, op }
    }

    #[test]
    fn bf16_sums_in_f32_and_rounds_once() {
        // 256 + 1 + 1: in bf16 step by step 256 + 1 rounds back to 256 (8 bits of mantissa), twice;
        // in f32 the sum is 258, which bf16 represents exactly.
        let t = |v: f32| Tensor::new(&[v], &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        let cs = [t(256.0), t(1.0), t(1.0)].map(Contribution::AllReduce);
        let s = finish_all_reduce(&call(CollectiveOp::AllReduce, 0), &cs).unwrap();
        assert_eq!(s.dtype(), DType::BF16);
        assert_eq!(s.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(), vec![258.0]);
    }

    #[test]
    fn f32_sum_follows_group_order() {
        // (1e8 + 1) - 1e8 = 0 in f32 (1e8 + 1 rounds to 1e8); (1e8 - 1e8) + 1 = 1.
        let t = |v: f32| Tensor::new(&[v], &Device::Cpu).unwrap();
        let a = [t(1e8), t(1.0), t(-1e8)].map(Contribution::AllReduce);
        let b = [t(1e8), t(-1e8), t(1.0)].map(Contribution::AllReduce);
        let c = call(CollectiveOp::AllReduce, 0);
        assert_eq!(finish_all_reduce(&c, &a).unwrap().to_vec1::<f32>().unwrap(), vec![0.0]);
        assert_eq!(finish_all_reduce(&c, &b).unwrap().to_vec1::<f32>().unwrap(), vec![1.0]);
    }

    #[test]
    fn integer_sums_are_rejected_and_counts_checked() {
        let x = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
        assert!(matches!(
            check_summable(3, CollectiveOp::AllReduce, &x),
            Err(CommError::Dtype { rank: 3, dtype: DType::U32, .. })
        ));
        assert!(matches!(
            split_rows(1, 3, &x, &[1, 0, 0]),
            Err(CommError::Counts { rank: 1, rows: 2, group_size: 3, .. })
        ));
        let s = Tensor::new(1f32, &Device::Cpu).unwrap();
        assert!(matches!(check_reduce_scatter(0, 2, &s), Err(CommError::Scalar { rank: 0, .. })));
        let y = Tensor::zeros((5, 2), DType::F32, &Device::Cpu).unwrap();
        assert!(matches!(
            check_reduce_scatter(0, 2, &y),
            Err(CommError::Indivisible { rows: 5, group_size: 2, .. })
        ));
    }
}
