use super::*;

/// Deterministic values in [−1, 1) (a linear congruential sequence).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn tensor(dims: &[usize], seed: u64, amp: f32) -> Tensor {
    let n = dims.iter().product();
    Tensor::from_vec(values(n, seed).into_iter().map(|x| x * amp).collect::<Vec<_>>(), dims, &Device::Cpu)
        .unwrap()
}

/// A `[t, t]` mask hiding with `hide` where `hidden(query, key)`.
fn mask(t: usize, hide: f32, hidden: impl Fn(usize, usize) -> bool) -> Tensor {
    let m: Vec<f32> = (0..t * t).map(|i| if hidden(i / t, i % t) { hide } else { 0.0 }).collect();
    Tensor::from_vec(m, (t, t), &Device::Cpu).unwrap()
}

fn causal(t: usize) -> Tensor {
    mask(t, -1e9, |q, k| k > q)
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.to_dtype(CDType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// Largest |a − b| over the largest |b|; infinite where only one of a pair is NaN (f64::max
/// would skip it).
fn relative(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (f64s(a), f64s(b));
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs()));
    let gap = |x: f64, y: f64| if x.is_nan() != y.is_nan() { f64::INFINITY } else { (x - y).abs() };
    a.iter().zip(&b).fold(0f64, |m, (&x, &y)| m.max(gap(x, y))) / scale
}

struct Case {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    mask: Tensor,
}

fn case(b: usize, h: usize, t: usize, e: usize, mask: Tensor) -> Case {
    let d = [b, h, t, e];
    Case { q: tensor(&d, 1, 2.0), k: tensor(&d, 2, 2.0), v: tensor(&d, 3, 1.0), g: tensor(&d, 4, 1.0), mask }
}

/// The f32 kernels against the composition in f64, forward and backward.
fn check(c: &Case, scale: f64) {
    check_in(c, scale, CDType::F64)
}

/// The f32 kernels against the composition in `dtype`, forward and backward.
fn check_in(c: &Case, scale: f64, dtype: CDType) {
    let wide = |x: &Tensor| x.to_dtype(dtype).unwrap();
    let o = attention(&c.q, &c.k, &c.v, &c.mask, scale).unwrap();
    let want = composition(&wide(&c.q), &wide(&c.k), &wide(&c.v), &wide(&c.mask), scale).unwrap();
    let err = relative(&o, &want);
    assert!(err < 1e-6, "forward {:?}: {err:e}", c.q.dims());
    let d = attention_backward(&c.q, &c.k, &c.v, &c.mask, &o, &c.g, scale).unwrap();
    let want =
        composition_backward(&wide(&c.q), &wide(&c.k), &wide(&c.v), &wide(&c.mask), &wide(&c.g), scale)
            .unwrap();
    // dq, dk, dv along the heads: H, KV, KV.
    let (h, kv) = (c.q.dims()[1], c.k.dims()[1]);
    for (i, (at, n)) in [(0, h), (h, kv), (h + kv, kv)].into_iter().enumerate() {
        let err = relative(&d.narrow(1, at, n).unwrap(), &want.narrow(1, at, n).unwrap());
        assert!(err < 1e-5, "gradient {i} of {:?}: {err:e}", c.q.dims());
    }
}

#[test]
fn kernels_match_the_composition_in_one_tile_and_across_tiles() {
    // One whole tile, less than one, and ragged tiles after one or two whole ones.
    for (t, e) in [(BQ, 32), (5, 4), (BK + 36, 8), (2 * BK + 22, 16)] {
        check(&case(2, 3, t, e, causal(t)), 1.0 / (e as f64).sqrt());
    }
}

#[test]
fn grouped_query_heads_read_their_key_value_head() {
    // 6 query heads over 2 and 3 key/value heads, and 1 (multi-query), across tiles: against
    // the composition (which repeats k and v); and against the kernel on k, v repeated by
    // hand, whose dk, dv summed over each group must be the grouped kernel's.
    let (b, h, t, e) = (2, 6, BK + 36, 8);
    for kv in [2, 3, 1] {
        let mut c = case(b, h, t, e, causal(t));
        c.k = tensor(&[b, kv, t, e], 5, 2.0);
        c.v = tensor(&[b, kv, t, e], 6, 1.0);
        check(&c, 0.35);
        let (kr, vr) = (repeat_kv(&c.k, h).unwrap(), repeat_kv(&c.v, h).unwrap());
        let o = attention(&c.q, &c.k, &c.v, &c.mask, 0.35).unwrap();
        let or = attention(&c.q, &kr, &vr, &c.mask, 0.35).unwrap();
        assert_eq!(f64s(&o), f64s(&or), "kv {kv}: the forward reads the same rows");
        let d = attention_backward(&c.q, &c.k, &c.v, &c.mask, &o, &c.g, 0.35).unwrap();
        let dr = attention_backward(&c.q, &kr, &vr, &c.mask, &or, &c.g, 0.35).unwrap();
        assert_eq!(d.dims(), [b, h + 2 * kv, t, e]);
        assert_eq!(f64s(&d.narrow(1, 0, h).unwrap()), f64s(&dr.narrow(1, 0, h).unwrap()));
        for (at, rat) in [(h, h), (h + kv, 2 * h)] {
            // Each query head's partial, summed in query-head order: the same values.
            let summed = sum_kv(&dr.narrow(1, rat, h).unwrap(), kv).unwrap();
            assert_eq!(f64s(&d.narrow(1, at, kv).unwrap()), f64s(&summed), "kv {kv}");
        }
    }
    // KV must divide H.
    let c = case(1, 6, 8, 4, causal(8));
    assert!(attention(&c.q, &tensor(&[1, 4, 8, 4], 1, 1.0), &tensor(&[1, 4, 8, 4], 2, 1.0), &c.mask, 1.0)
        .is_err());
}

#[test]
fn kernels_match_the_composition_under_other_masks() {
    let t = 3 * BK + 10;
    // A sliding window of 40 keys: whole key tiles hidden on both sides of the diagonal.
    check(&case(1, 2, t, 8, mask(t, -1e9, |q, k| k > q || q - k >= 40)), 0.3);
    // Rows 70..80 see no key: their query tile keeps every key tile. In f32 their scores all
    // round to −1e9 (a uniform softmax), in f64 they do not: the reference is f32's.
    check_in(&case(1, 2, t, 8, mask(t, -1e9, |q, k| k > q || (70..80).contains(&q))), 0.3, CDType::F32);
    // The same window hidden with −∞: a live tile in which one row sees nothing yet.
    check(&case(1, 2, t, 8, mask(t, f32::NEG_INFINITY, |q, k| k > q || q - k >= 40)), 0.3);
    // No mask at all.
    check(&case(2, 1, t, 8, mask(t, 0.0, |_, _| false)), 0.3);
}

#[test]
fn skipping_hidden_tiles_changes_no_bit() {
    // −1e7 hides a key as exactly as −1e9 (e^x is +0.0 below −104) but is above HIDDEN, so
    // its tiles are computed: the outputs must be the same bits. Causal (every span starts
    // at key 0) and a sliding window of 40 keys over three query tiles (the last tile's
    // spans start in the second key tile: its rows skip the first and meet their first
    // visible key with nothing seen yet).
    let bits = |x: &Tensor| {
        x.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    };
    let run = |c: &Case| {
        let o = attention(&c.q, &c.k, &c.v, &c.mask, 0.25).unwrap();
        let d = attention_backward(&c.q, &c.k, &c.v, &c.mask, &o, &c.g, 0.25).unwrap();
        (bits(&o), bits(&d))
    };
    // (T, whether a key is hidden from a query, the span of row 0 or, past two tiles, of the
    // last tile's first row)
    type Hides<'a> = (usize, &'a dyn Fn(usize, usize) -> bool, Range<usize>);
    let causal_hides = |q: usize, k: usize| k > q;
    let window_hides = |q: usize, k: usize| k > q || q - k >= 40;
    let hides: [Hides; 2] = [(BK + 22, &causal_hides, 0..1), (2 * BK + 22, &window_hides, 217..257)];
    for (t, hidden, last_tile_first_row) in hides {
        let (skipped, computed) =
            (case(2, 2, t, 16, mask(t, -1e9, hidden)), case(2, 2, t, 16, mask(t, -1e7, hidden)));
        let span = |m: &Tensor, r: usize| {
            let m = m.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            Spans::of(View { data: &m, rs: t }, t).rows[r].clone()
        };
        let r = if t > 2 * BK { 2 * BK } else { 0 };
        assert_eq!(span(&skipped.mask, r), last_tile_first_row);
        assert_eq!(span(&computed.mask, r), 0..t);
        assert_eq!(run(&skipped), run(&computed), "T = {t}");
    }
}

#[test]
fn results_do_not_depend_on_the_threads() {
    // Multi-head, and grouped-query (2 key/value heads for 4 query heads).
    let mut gqa = case(2, 4, BK + 36, 8, causal(BK + 36));
    gqa.k = tensor(&[2, 2, BK + 36, 8], 5, 2.0);
    gqa.v = tensor(&[2, 2, BK + 36, 8], 6, 1.0);
    for c in [case(2, 4, BK + 36, 8, causal(BK + 36)), gqa] {
        let run = || {
            let o = attention(&c.q, &c.k, &c.v, &c.mask, 0.5).unwrap();
            let d = attention_backward(&c.q, &c.k, &c.v, &c.mask, &o, &c.g, 0.5).unwrap();
            (f64s(&o), f64s(&d))
        };
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(run);
        let two = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap().install(run);
        assert_eq!(one, two);
    }
}

#[test]
fn strided_operands_give_their_copies_bits() {
    // Heads split from [B, T, H, E] (rows H·E apart: read in place) and a k stored
    // transposed (columns not contiguous: copied) against contiguous copies of the same.
    let (b, h, t, e) = (2, 3, BK + 36, 8);
    let split = |seed| tensor(&[b, t, h, e], seed, 1.0).permute((0, 2, 1, 3)).unwrap();
    let (q, v, g) = (split(1), split(3), split(4));
    let k = tensor(&[b, h, e, t], 2, 1.0).transpose(2, 3).unwrap();
    assert!(!q.is_contiguous() && q.stride()[3] == 1 && k.stride()[3] != 1);
    let c = |x: &Tensor| x.contiguous().unwrap();
    let mask = causal(t);
    let bits = |x: &Tensor| {
        x.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    };
    let o = attention(&q, &k, &v, &mask, 0.3).unwrap();
    let oc = attention(&c(&q), &c(&k), &c(&v), &mask, 0.3).unwrap();
    assert_eq!(bits(&o), bits(&oc));
    let d = attention_backward(&q, &k, &v, &mask, &o, &g, 0.3).unwrap();
    let dc = attention_backward(&c(&q), &c(&k), &c(&v), &mask, &oc, &c(&g), 0.3).unwrap();
    assert_eq!(bits(&d), bits(&dc));
}

#[test]
fn transposes_match_element_by_element() {
    // Whole 8 × 8 blocks (AVX2 shuffles) beside ragged edges; rows 5 longer than E (strided).
    for (t, e) in [(16, 8), (21, 19), (5, 3), (64, 32)] {
        let rs = e + 5;
        let x = values(t * rs, 9);
        let mut dst = vec![f32::NAN; t * e];
        transpose(View { data: &x, rs }, (t, e), &mut dst);
        for c in 0..t {
            for j in 0..e {
                assert_eq!(dst[j * t + c].to_bits(), x[c * rs + j].to_bits(), "{t}×{e} at ({c}, {j})");
            }
        }
    }
}

#[test]
fn spans_bound_what_each_row_and_key_sees() {
    // A sliding window of 3 keys, and row 5 seeing nothing (all of its keys, as the
    // composition's uniform softmax over them).
    let t = 8;
    let m: Vec<f32> = (0..t * t)
        .map(|i| {
            let (q, k) = (i / t, i % t);
            if k > q || q - k >= 3 || q == 5 {
                -1e9
            } else {
                0.0
            }
        })
        .collect();
    let spans = Spans::of(View { data: &m, rs: t }, t);
    assert_eq!(spans.rows[0], 0..1);
    assert_eq!(spans.rows[4], 2..5);
    assert_eq!(spans.rows[5], 0..t);
    assert_eq!(spans.rows[7], 5..8);
    // Key 0: rows 0–2 and 5; key 7: rows 5 and 7.
    assert_eq!(spans.keys[0], 0..6);
    assert_eq!(spans.keys[7], 5..8);
    assert_eq!(Spans::hull(&spans.rows, 0..2, 1..8), 0..1);
    assert_eq!(Spans::hull(&spans.rows, 0..1, 1..8), 0..0);
}

/// Values of a width apart from q·k's (multi-head latent attention's d_v ≠ d_nope + d_rope),
/// narrower and wider, with grouped-query heads, across tiles: the kernels against the
/// composition in f64, and against the kernels on zero-padded operands (the padding the
/// attention of MLA did before), whose columns they must give; the backward's narrower
/// gradients are zero past their width.
#[test]
fn values_may_be_narrower_or_wider_than_queries_and_keys() {
    let (b, h, kv, t) = (2, 4, 2, BK + 36);
    for (e, ev) in [(24, 16), (8, 20)] {
        let c = Case {
            q: tensor(&[b, h, t, e], 1, 2.0),
            k: tensor(&[b, kv, t, e], 2, 2.0),
            v: tensor(&[b, kv, t, ev], 3, 1.0),
            g: tensor(&[b, h, t, ev], 4, 1.0),
            mask: causal(t),
        };
        let scale = 1.0 / (e as f64).sqrt();
        check(&c, scale);
        let o = attention(&c.q, &c.k, &c.v, &c.mask, scale).unwrap();
        assert_eq!(o.dims(), [b, h, t, ev]);
        let d = attention_backward(&c.q, &c.k, &c.v, &c.mask, &o, &c.g, scale).unwrap();
        let w = e.max(ev);
        assert_eq!(d.dims(), [b, h + 2 * kv, t, w]);
        let zeros = |heads: (usize, usize), from: usize| {
            let tail = d.narrow(1, heads.0, heads.1).unwrap().narrow(3, from, w - from).unwrap();
            f64s(&tail).iter().all(|&x| x == 0.0)
        };
        assert!(zeros((0, h + kv), e) && zeros((h + kv, kv), ev), "padding past each width");
        // The padded run: q, k and v widened to w with zero columns.
        let pad = |x: &Tensor| x.pad_with_zeros(3, 0, w - x.dims()[3]).unwrap();
        let (qp, kp, vp, gp) = (pad(&c.q), pad(&c.k), pad(&c.v), pad(&c.g));
        let op = attention(&qp, &kp, &vp, &c.mask, scale).unwrap();
        let err = relative(&o, &op.narrow(3, 0, ev).unwrap());
        assert!(err < 1e-6, "forward against the padded run: {err:e}");
        let dp = attention_backward(&qp, &kp, &vp, &c.mask, &op, &gp, scale).unwrap();
        let err = relative(&d, &dp);
        assert!(err < 1e-5, "backward against the padded run: {err:e}");
    }
}

#[test]
fn bad_shapes_are_errors() {
    let c = case(1, 1, 8, 4, causal(8));
    let short = tensor(&[1, 1, 7, 4], 5, 1.0);
    assert!(attention(&c.q, &short, &c.v, &c.mask, 1.0).is_err());
    assert!(attention(&c.q, &c.k, &c.v, &causal(7), 1.0).is_err());
    assert!(attention_backward(&c.q, &c.k, &c.v, &c.mask, &short, &c.g, 1.0).is_err());
    // k must have q's width; o and g v's.
    let wide = tensor(&[1, 1, 8, 6], 6, 1.0);
    assert!(attention(&c.q, &wide, &c.v, &c.mask, 1.0).is_err());
    assert!(attention_backward(&c.q, &c.k, &wide, &c.mask, &c.q, &c.g, 1.0).is_err());
}

/// bf16 q, k, v, g: within bf16 rounding of the f64 composition of the same (bf16) values,
/// forward and backward — the scores and the softmax in f32, each result rounded once — and
/// closer to it than the bf16 composition (which rounds the probabilities to bf16 before
/// `P v`).
#[test]
fn bf16_runs_the_f32_kernel_and_rounds_once() {
    let (b, h, t, e) = (2, 3, BK + 36, 16);
    let c = case(b, h, t, e, causal(t));
    let half = |x: &Tensor| x.to_dtype(CDType::BF16).unwrap();
    let f64 = |x: &Tensor| x.to_dtype(CDType::F64).unwrap();
    let (q, k, v, g) = (half(&c.q), half(&c.k), half(&c.v), half(&c.g));
    let scale = 1.0 / (e as f64).sqrt();
    let o = attention(&q, &k, &v, &c.mask, scale).unwrap();
    assert_eq!(o.dtype(), CDType::BF16);
    let want = composition(&f64(&q), &f64(&k), &f64(&v), &f64(&c.mask), scale).unwrap();
    let err = relative(&o, &want);
    assert!(err < 2f64.powi(-8), "forward: {err:e}");
    let old = composition(&q, &k, &v, &c.mask, scale).unwrap();
    assert!(
        err < relative(&old, &want),
        "forward: {err:e} vs the bf16 composition's {:e}",
        relative(&old, &want)
    );
    let d = attention_backward(&q, &k, &v, &c.mask, &o, &g, scale).unwrap();
    assert_eq!(d.dtype(), CDType::BF16);
    let want = composition_backward(&f64(&q), &f64(&k), &f64(&v), &f64(&c.mask), &f64(&g), scale).unwrap();
    for (i, at) in [0, h, 2 * h].into_iter().enumerate() {
        let err = relative(&d.narrow(1, at, h).unwrap(), &want.narrow(1, at, h).unwrap());
        // The backward reads the rounded output o: a few bf16 ulps.
        assert!(err < 2f64.powi(-6), "gradient {i}: {err:e}");
    }
}
