//! Kernels of the mixture-of-experts routing ops of the graph IR ([`Op::SortByExpert`],
//! [`Op::Bincount`], [`Op::SegmentMatmul`], [`Op::SegmentOuter`]): the routed rows of a layer are
//! laid out as one contiguous segment per expert, and each segment is multiplied by its expert's
//! matrix. Sizes are data-dependent only inside the kernels; every tensor the graph sees has a
//! static shape (R = tokens × experts per token rows in all). Under expert parallelism the rows a
//! rank receives come as one run of segments per source rank (counts `[G, E]`) followed by
//! zero padding up to the static row count.
//!
//! [`Op::SortByExpert`]: graphpp_graph::Op::SortByExpert
//! [`Op::Bincount`]: graphpp_graph::Op::Bincount
//! [`Op::SegmentMatmul`]: graphpp_graph::Op::SegmentMatmul
//! [`Op::SegmentOuter`]: graphpp_graph::Op::SegmentOuter

use candle_core::{Result, Tensor};

use super::device::count_host_read;

/// The ids as host data (a read to the host counted where `ids` lives on a device:
/// [`count_host_read`]).
fn ids_of(ids: &Tensor, bins: usize) -> Result<Vec<u32>> {
    count_host_read(ids);
    let v = ids.flatten_all()?.to_vec1::<u32>()?;
    match v.iter().find(|&&i| i as usize >= bins) {
        Some(bad) => Err(candle_core::Error::Msg(format!("expert id {bad} is not below {bins}"))),
        None => Ok(v),
    }
}

/// Counts of each id in `0..bins` (u32 `[bins]`). Errors: an id `>= bins`.
pub fn bincount(ids: &Tensor, bins: usize) -> Result<Tensor> {
    let mut counts = vec![0u32; bins];
    for i in ids_of(ids, bins)? {
        counts[i as usize] += 1;
    }
    Tensor::from_vec(counts, bins, ids.device())
}

/// The stable counting-sort permutation of `ids` by expert (u32 `[R]`: `out[j]` is the row at
/// sorted position `j`). Errors: an id `>= experts`.
pub fn sort_by_expert(ids: &Tensor, experts: usize) -> Result<Tensor> {
    let v = ids_of(ids, experts)?;
    let mut start = vec![0u32; experts + 1];
    for &i in &v {
        start[i as usize + 1] += 1;
    }
    for e in 0..experts {
        start[e + 1] += start[e];
    }
    let mut out = vec![0u32; v.len()];
    for (row, &i) in v.iter().enumerate() {
        out[start[i as usize] as usize] = row as u32;
        start[i as usize] += 1;
    }
    Tensor::from_vec(out, v.len(), ids.device())
}

/// The segments of `counts` (`[E]`, or `[G, E]`: G groups of E segments, row-major) as
/// `(expert, rows)` in row order; segment `(g, e)` belongs to expert `e`. Errors: counts of
/// another rank; `[E]` counts not adding up to `rows`, `[G, E]` ones adding up to more.
fn segments(counts: &Tensor, rows: usize) -> Result<Vec<(usize, usize)>> {
    let experts = match counts.dims() {
        [e] | [_, e] => *e,
        other => return Err(candle_core::Error::Msg(format!("expert counts of shape {other:?}"))),
    };
    count_host_read(counts);
    let c: Vec<u32> = counts.flatten_all()?.to_vec1::<u32>()?;
    let total: usize = c.iter().map(|&n| n as usize).sum();
    // Padding comes only with the rows received from G ranks (counts [G, E]).
    if total > rows || (counts.rank() == 1 && total != rows) {
        return Err(candle_core::Error::Msg(format!("expert segments hold {total} rows, the input {rows}")));
    }
    Ok(c.into_iter().enumerate().map(|(i, n)| (i % experts.max(1), n as usize)).collect())
}

/// Per-segment `x_s · w[e]ᵀ` (`w [E, N, K]`, `transpose`) or `x_s · w[e]` (`w [E, K, N]`) for
/// `x [R, K]`, where segment `s` belongs to expert `e` ([`segments`]): `[R, N]`; rows after the
/// last segment (padding) are zero. Errors: counts adding up to more than R, candle shape errors.
pub fn segment_matmul(x: &Tensor, w: &Tensor, counts: &Tensor, transpose: bool) -> Result<Tensor> {
    let rows = x.dim(0)?;
    let n = if transpose { w.dim(1)? } else { w.dim(2)? };
    let mut parts = Vec::new();
    let mut off = 0;
    for (e, len) in segments(counts, rows)? {
        if len == 0 {
            continue;
        }
        let we = w.get(e)?;
        let we = if transpose { we.t()? } else { we };
        parts.push(x.narrow(0, off, len)?.contiguous()?.matmul(&we.contiguous()?)?);
        off += len;
    }
    if off < rows {
        parts.push(Tensor::zeros((rows - off, n), x.dtype(), x.device())?);
    }
    if parts.is_empty() {
        return Tensor::zeros((0, n), x.dtype(), x.device());
    }
    Tensor::cat(&parts, 0)
}

/// Per-expert `Σ_s a_sᵀ · b_s` over the segments `s` of expert `e` ([`segments`]) for
/// `a [R, N]`, `b [R, K]`: `[E, N, K]` (zero for an expert without rows; padding rows after the
/// last segment are ignored). Errors: counts adding up to more than R, candle shape errors.
pub fn segment_outer(a: &Tensor, b: &Tensor, counts: &Tensor) -> Result<Tensor> {
    let (n, k) = (a.dim(1)?, b.dim(1)?);
    let experts = counts.dims().last().copied().unwrap_or(0);
    let mut acc: Vec<Option<Tensor>> = vec![None; experts];
    let mut off = 0;
    for (e, len) in segments(counts, a.dim(0)?)? {
        if len == 0 {
            continue;
        }
        let at = a.narrow(0, off, len)?.t()?.contiguous()?;
        let part = at.matmul(&b.narrow(0, off, len)?.contiguous()?)?;
        // Several segments of one expert (one per source rank) add up in f32, rounded once.
        acc[e] = Some(match acc[e].take() {
            None => part,
            Some(prev) => {
                (prev.to_dtype(candle_core::DType::F32)? + part.to_dtype(candle_core::DType::F32)?)?
            }
        });
        off += len;
    }
    let parts = acc
        .into_iter()
        .map(|p| {
            p.map_or_else(|| Tensor::zeros((n, k), a.dtype(), a.device()), |t| t.to_dtype(a.dtype()))?
                .unsqueeze(0)
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&parts, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn u32s(v: &[u32]) -> Tensor {
        Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
    }

    #[test]
    fn sort_is_stable_and_counts_match() {
        let ids = u32s(&[2, 0, 2, 1, 0]);
        assert_eq!(sort_by_expert(&ids, 3).unwrap().to_vec1::<u32>().unwrap(), vec![1, 4, 3, 0, 2]);
        assert_eq!(bincount(&ids, 4).unwrap().to_vec1::<u32>().unwrap(), vec![2, 1, 2, 0]);
        let e = bincount(&ids, 2).unwrap_err().to_string();
        assert!(e.contains("expert id 2 is not below 2"), "{e}");
    }

    #[test]
    fn segments_use_their_own_expert() {
        // Rows 0..2 → expert 0 (identity), row 2 → expert 1 (doubling); expert 2 gets no row.
        let x = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.]], &Device::Cpu).unwrap();
        let eye = Tensor::eye(2, candle_core::DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::stack(&[eye.clone(), (eye.clone() * 2.0).unwrap(), eye], 0).unwrap();
        let y = segment_matmul(&x, &w, &u32s(&[2, 1, 0]), true).unwrap();
        assert_eq!(y.to_vec2::<f32>().unwrap(), vec![vec![1., 2.], vec![3., 4.], vec![10., 12.]]);
        let o = segment_outer(&x, &x, &u32s(&[2, 1, 0])).unwrap();
        assert_eq!(o.get(1).unwrap().to_vec2::<f32>().unwrap(), vec![vec![25., 30.], vec![30., 36.]]);
        assert_eq!(o.get(2).unwrap().to_vec2::<f32>().unwrap(), vec![vec![0., 0.], vec![0., 0.]]);
        assert_eq!(o.get(0).unwrap().to_vec2::<f32>().unwrap(), vec![vec![10., 14.], vec![14., 20.]]);
        let e = segment_matmul(&x, &w, &u32s(&[2, 2, 0]), true).unwrap_err().to_string();
        assert!(e.contains("segments hold 4 rows, the input 3"), "{e}");
    }

    /// Counts `[G, E]` (what expert parallelism receives: per source rank, per local expert):
    /// segment (g, e) uses expert e; rows after the segments are padding.
    #[test]
    fn grouped_segments_share_experts_and_skip_padding() {
        let x = Tensor::new(&[[1f32, 2.], [3., 4.], [5., 6.], [7., 8.]], &Device::Cpu).unwrap();
        let eye = Tensor::eye(2, candle_core::DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::stack(&[eye.clone(), (eye * 2.0).unwrap()], 0).unwrap();
        // Group 0: row 0 → expert 0, row 1 → expert 1; group 1: row 2 → expert 1; row 3 padding.
        let counts = Tensor::from_slice(&[1u32, 1, 0, 1], (2, 2), &Device::Cpu).unwrap();
        let y = segment_matmul(&x, &w, &counts, true).unwrap();
        assert_eq!(
            y.to_vec2::<f32>().unwrap(),
            vec![vec![1., 2.], vec![6., 8.], vec![10., 12.], vec![0., 0.]]
        );
        // Expert 1's outer product sums rows 1 and 2; expert 0's is row 0's alone.
        let o = segment_outer(&x, &x, &counts).unwrap();
        assert_eq!(o.get(0).unwrap().to_vec2::<f32>().unwrap(), vec![vec![1., 2.], vec![2., 4.]]);
        assert_eq!(o.get(1).unwrap().to_vec2::<f32>().unwrap(), vec![vec![34., 42.], vec![42., 52.]]);
    }
}
