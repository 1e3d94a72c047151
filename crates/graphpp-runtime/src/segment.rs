//! Kernels of the mixture-of-experts routing ops of the graph IR ([`Op::SortByExpert`],
//! [`Op::Bincount`], [`Op::SegmentMatmul`], [`Op::SegmentOuter`]): the routed rows of a layer are
//! laid out as one contiguous segment per expert, and each segment is multiplied by its expert's
//! matrix. Sizes are data-dependent only inside the kernels; every tensor the graph sees has a
//! static shape (R = tokens × experts per token rows in all).
//!
//! [`Op::SortByExpert`]: graphpp_graph::Op::SortByExpert
//! [`Op::Bincount`]: graphpp_graph::Op::Bincount
//! [`Op::SegmentMatmul`]: graphpp_graph::Op::SegmentMatmul
//! [`Op::SegmentOuter`]: graphpp_graph::Op::SegmentOuter

use candle_core::{Device, Result, Tensor};

fn ids_of(ids: &Tensor, bins: usize) -> Result<Vec<u32>> {
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
    Tensor::from_vec(counts, bins, &Device::Cpu)
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
    Tensor::from_vec(out, v.len(), &Device::Cpu)
}

/// The segment lengths; errors unless they add up to `rows`.
fn segments(counts: &Tensor, rows: usize) -> Result<Vec<usize>> {
    let c: Vec<usize> = counts.to_vec1::<u32>()?.into_iter().map(|n| n as usize).collect();
    let total: usize = c.iter().sum();
    if total != rows {
        return Err(candle_core::Error::Msg(format!("expert segments hold {total} rows, the input {rows}")));
    }
    Ok(c)
}

/// Per-segment `x_e · w[e]ᵀ` (`w [E, N, K]`, `transpose`) or `x_e · w[e]` (`w [E, K, N]`) for
/// `x [R, K]`: `[R, N]`. Errors: counts not adding up to R, candle shape errors.
pub fn segment_matmul(x: &Tensor, w: &Tensor, counts: &Tensor, transpose: bool) -> Result<Tensor> {
    let rows = x.dim(0)?;
    let n = if transpose { w.dim(1)? } else { w.dim(2)? };
    let mut parts = Vec::new();
    let mut off = 0;
    for (e, len) in segments(counts, rows)?.into_iter().enumerate() {
        if len == 0 {
            continue;
        }
        let we = w.get(e)?;
        let we = if transpose { we.t()? } else { we };
        parts.push(x.narrow(0, off, len)?.contiguous()?.matmul(&we.contiguous()?)?);
        off += len;
    }
    if parts.is_empty() {
        return Tensor::zeros((0, n), x.dtype(), &Device::Cpu);
    }
    Tensor::cat(&parts, 0)
}

/// Per-segment `a_eᵀ · b_e` for `a [R, N]`, `b [R, K]`: `[E, N, K]` (zero for an empty segment).
/// Errors: counts not adding up to R, candle shape errors.
pub fn segment_outer(a: &Tensor, b: &Tensor, counts: &Tensor) -> Result<Tensor> {
    let (n, k) = (a.dim(1)?, b.dim(1)?);
    let mut parts = Vec::new();
    let mut off = 0;
    for len in segments(counts, a.dim(0)?)? {
        let part = if len == 0 {
            Tensor::zeros((n, k), a.dtype(), &Device::Cpu)?
        } else {
            let at = a.narrow(0, off, len)?.t()?.contiguous()?;
            at.matmul(&b.narrow(0, off, len)?.contiguous()?)?
        };
        parts.push(part.unsqueeze(0)?);
        off += len;
    }
    Tensor::cat(&parts, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let e = segment_matmul(&x, &w, &u32s(&[1, 1, 0]), true).unwrap_err().to_string();
        assert!(e.contains("segments hold 2 rows, the input 3"), "{e}");
    }
}
