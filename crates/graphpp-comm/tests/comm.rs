//! Every communicator with ranks as threads — `ThreadComm`, and `LinkComm` over in-process
//! channels (`loopback`: every message through its byte form, as between MPI processes), each
//! test run on both: collectives against serial references (bitwise), matching
//! by group and sequence number, start/compute/wait overlap, abort, and typed errors.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use graphpp_comm::loopback;
use graphpp_comm::Mesh;
use graphpp_comm::{Awaited, CollectiveOp, Comm, CommError, Group, Tag, TensorDesc, ThreadComm};

/// Generous: nothing in these tests should come near it.
const T: Duration = Duration::from_secs(20);

/// Builds an `n`-rank world of one communicator kind.
type World = fn(usize) -> Vec<Box<dyn Comm>>;

fn threads(n: usize) -> Vec<Box<dyn Comm>> {
    ThreadComm::world(n).into_iter().map(|c| Box::new(c) as Box<dyn Comm>).collect()
}

fn link(n: usize) -> Vec<Box<dyn Comm>> {
    loopback(n).into_iter().map(|c| Box::new(c) as Box<dyn Comm>).collect()
}

/// Each test function `name(world)` runs as `threads::name` and `link::name`.
macro_rules! on_every_comm {
    ($($name:ident),* $(,)?) => {
        mod on_threads {
            $(#[test] fn $name() { super::$name(super::threads) })*
        }
        mod on_link {
            $(#[test] fn $name() { super::$name(super::link) })*
        }
    };
}

on_every_comm!(
    all_reduce_is_the_serial_sum_bitwise_on_every_rank_whatever_the_timing,
    bf16_and_f64_all_reduce_sum_in_group_order,
    all_gather_of_reduce_scatter_equals_all_reduce_bitwise,
    reduce_scatter_of_all_gather_is_group_size_times_own_shard,
    all_to_all_with_variable_counts_delivers_exactly_the_rows_sent,
    all_to_all_that_receives_nothing_keeps_dtype_and_trailing_dims,
    concurrent_collectives_on_disjoint_groups_do_not_mix,
    groups_with_the_same_ranks_but_different_names_are_independent,
    start_then_point_to_point_then_wait_overlaps,
    successive_collectives_on_one_group_match_by_sequence_number,
    abort_fails_every_pending_wait_and_recv_at_once_naming_the_failed_rank,
    mismatched_contributions_are_typed_errors_naming_both_ranks,
    bad_peers_groups_and_inputs_are_typed_errors,
);

/// Runs `f` on every rank of a fresh `n`-rank `world`, one thread per rank; results by rank.
fn ranks<R: Send>(world: World, n: usize, f: impl Fn(Box<dyn Comm>) -> R + Sync) -> Vec<R> {
    let f = &f;
    std::thread::scope(|s| {
        let hs: Vec<_> = world(n).into_iter().map(|c| s.spawn(move || f(c))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// xorshift64*: reproducible random numbers without a dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1) times a random power of two in [2^-8, 2^8], so that sums round.
    fn f32(&mut self) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
        u * 2f32.powi((self.next() % 17) as i32 - 8)
    }
    fn sleep(&mut self, max_ms: u64) {
        std::thread::sleep(Duration::from_micros(self.next() % (max_ms * 1000)));
    }
}

fn random(seed: u64, n: usize) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.f32()).collect()
}

fn t2(v: &[f32], rows: usize, cols: usize) -> Tensor {
    Tensor::from_vec(v.to_vec(), (rows, cols), &Device::Cpu).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn all_reduce_is_the_serial_sum_bitwise_on_every_rank_whatever_the_timing(world: World) {
    let (rows, cols) = (3, 17);
    for iter in 0..6u64 {
        let inputs: Vec<Vec<f32>> = (0..4).map(|r| random(100 * iter + r, rows * cols)).collect();
        // ((x0 + x1) + x2) + x3, element by element, in f32.
        let serial: Vec<u32> = (0..rows * cols)
            .map(|i| (((inputs[0][i] + inputs[1][i]) + inputs[2][i]) + inputs[3][i]).to_bits())
            .collect();
        let results = ranks(world, 4, |c| {
            let mut rng = Rng::new(7 * iter + c.rank() as u64 + 1000);
            let g = Group::world(4).unwrap();
            rng.sleep(3);
            let h = c.all_reduce(&g, &t2(&inputs[c.rank()], rows, cols)).unwrap();
            rng.sleep(3);
            bits(&h.wait(T).unwrap())
        });
        for (r, got) in results.iter().enumerate() {
            assert_eq!(got, &serial, "iteration {iter}, rank {r}");
        }
    }
}

fn bf16_and_f64_all_reduce_sum_in_group_order(world: World) {
    let inputs: Vec<Vec<f32>> = (0..4).map(|r| random(r + 17, 40)).collect();
    // bf16: widened to f32, summed in order, rounded once.
    let rounded: Vec<Vec<f32>> =
        inputs.iter().map(|v| v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()).collect();
    let want_bf16: Vec<u16> = (0..40)
        .map(|i| {
            half::bf16::from_f32(((rounded[0][i] + rounded[1][i]) + rounded[2][i]) + rounded[3][i]).to_bits()
        })
        .collect();
    let want_f64: Vec<u64> = (0..40)
        .map(|i| {
            let x = |r: usize| inputs[r][i] as f64 / 3.0;
            (((x(0) + x(1)) + x(2)) + x(3)).to_bits()
        })
        .collect();
    let results = ranks(world, 4, |c| {
        let g = Group::world(4).unwrap();
        let x = t2(&inputs[c.rank()], 4, 10);
        let b = c.all_reduce(&g, &x.to_dtype(DType::BF16).unwrap()).unwrap();
        let v64: Vec<f64> = inputs[c.rank()].iter().map(|&v| v as f64 / 3.0).collect();
        let x64 = Tensor::from_vec(v64, (4, 10), &Device::Cpu).unwrap();
        let d = c.all_reduce(&g, &x64).unwrap();
        let b = b.wait(T).unwrap();
        let d = d.wait(T).unwrap();
        assert_eq!((b.dtype(), d.dtype()), (DType::BF16, DType::F64));
        let b: Vec<u16> = b
            .flatten_all()
            .unwrap()
            .to_vec1::<half::bf16>()
            .unwrap()
            .into_iter()
            .map(|v| v.to_bits())
            .collect();
        let d: Vec<u64> =
            d.flatten_all().unwrap().to_vec1::<f64>().unwrap().into_iter().map(f64::to_bits).collect();
        (b, d)
    });
    for (r, (b, d)) in results.into_iter().enumerate() {
        assert_eq!(b, want_bf16, "bf16, rank {r}");
        assert_eq!(d, want_f64, "f64, rank {r}");
    }
}

fn all_gather_of_reduce_scatter_equals_all_reduce_bitwise(world: World) {
    let inputs: Vec<Vec<f32>> = (0..4).map(|r| random(r + 40, 8 * 5)).collect();
    let results = ranks(world, 4, |c| {
        let g = Group::world(4).unwrap();
        let x = t2(&inputs[c.rank()], 8, 5);
        // Both in flight on one group at once: sequence numbers keep them apart.
        let ar = c.all_reduce(&g, &x).unwrap();
        let rs = c.reduce_scatter(&g, &x).unwrap();
        let shard = rs.wait(T).unwrap();
        assert_eq!(shard.dims(), &[2, 5]);
        let gathered = c.all_gather(&g, &shard).unwrap().wait(T).unwrap();
        (bits(&ar.wait(T).unwrap()), bits(&gathered), flat(&shard))
    });
    let serial: Vec<f32> =
        (0..40).map(|i| ((inputs[0][i] + inputs[1][i]) + inputs[2][i]) + inputs[3][i]).collect();
    for (r, (ar, ag, shard)) in results.iter().enumerate() {
        assert_eq!(ar, ag, "rank {r}: all_gather(reduce_scatter(x)) != all_reduce(x)");
        assert_eq!(ar, &serial.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "rank {r}");
        // Group rank r keeps rows [2r, 2r + 2) of the sum.
        assert_eq!(shard, &serial[r * 10..(r + 1) * 10].to_vec(), "rank {r}");
    }
}

fn reduce_scatter_of_all_gather_is_group_size_times_own_shard(world: World) {
    // Integer-valued floats: the sums are exact.
    let shard = |r: usize| (0..6).map(|i| (10 * r + i) as f32).collect::<Vec<f32>>();
    let results = ranks(world, 4, |c| {
        let g = Group::world(4).unwrap();
        let full = c.all_gather(&g, &t2(&shard(c.rank()), 2, 3)).unwrap().wait(T).unwrap();
        let back = c.reduce_scatter(&g, &full).unwrap().wait(T).unwrap();
        (flat(&full), flat(&back), back.dims().to_vec())
    });
    let want_full: Vec<f32> = (0..4).flat_map(shard).collect();
    for (r, (full, back, dims)) in results.into_iter().enumerate() {
        assert_eq!(full, want_full, "rank {r}");
        assert_eq!(back, shard(r).iter().map(|v| 4.0 * v).collect::<Vec<_>>(), "rank {r}");
        assert_eq!(dims, vec![2, 3]);
    }
}

fn all_to_all_with_variable_counts_delivers_exactly_the_rows_sent(world: World) {
    // Rank i sends i + j rows to rank j; row k of that piece is [i, j, k].
    let piece = |i: usize, j: usize| (0..i + j).flat_map(move |k| [i as f32, j as f32, k as f32]);
    let results = ranks(world, 4, |c| {
        let i = c.rank();
        let g = Group::world(4).unwrap();
        let data: Vec<f32> = (0..4).flat_map(|j| piece(i, j)).collect();
        let counts: Vec<usize> = (0..4).map(|j| i + j).collect();
        let x = t2(&data, counts.iter().sum(), 3);
        let out = c.all_to_all(&g, &x, &counts).unwrap().wait(T).unwrap();
        (flat(&out.data), out.data.dims().to_vec(), out.recv_counts)
    });
    for (j, (data, dims, recv_counts)) in results.into_iter().enumerate() {
        let want: Vec<f32> = (0..4).flat_map(|i| piece(i, j)).collect();
        assert_eq!(recv_counts, (0..4).map(|i| i + j).collect::<Vec<_>>(), "rank {j}");
        assert_eq!(dims, vec![recv_counts.iter().sum::<usize>(), 3], "rank {j}");
        assert_eq!(data, want, "rank {j}");
    }
}

fn all_to_all_that_receives_nothing_keeps_dtype_and_trailing_dims(world: World) {
    let results = ranks(world, 2, |c| {
        let g = Group::world(2).unwrap();
        // Rank 0 sends its 2 rows to rank 1; rank 1 sends nothing.
        let (x, counts) = match c.rank() {
            0 => (Tensor::ones((2, 4), DType::F64, &Device::Cpu).unwrap(), vec![0, 2]),
            _ => (Tensor::zeros((0, 4), DType::F64, &Device::Cpu).unwrap(), vec![0, 0]),
        };
        let out = c.all_to_all(&g, &x, &counts).unwrap().wait(T).unwrap();
        (out.data.dims().to_vec(), out.data.dtype(), out.recv_counts)
    });
    assert_eq!(results[0], (vec![0, 4], DType::F64, vec![0, 0]));
    assert_eq!(results[1], (vec![2, 4], DType::F64, vec![2, 0]));
}

fn concurrent_collectives_on_disjoint_groups_do_not_mix(world: World) {
    let mesh = Mesh::new(2, 2).unwrap();
    for iter in 0..4u64 {
        let results = ranks(world, 4, |c| {
            let mut rng = Rng::new(iter * 10 + c.rank() as u64);
            let r = c.rank();
            let dp = mesh.data_parallel_group(r).unwrap();
            let pp = mesh.pipeline_group(r).unwrap();
            let one = |v: f32| Tensor::new(&[v], &Device::Cpu).unwrap();
            rng.sleep(2);
            let a = c.all_reduce(&dp, &one((r + 1) as f32)).unwrap();
            rng.sleep(2);
            let b = c.all_reduce(&dp, &one(10.0 * (r + 1) as f32)).unwrap();
            let g = c.all_gather(&pp, &one(r as f32)).unwrap();
            rng.sleep(2);
            // Waited in the reverse order of the starts.
            let g = flat(&g.wait(T).unwrap());
            let b = flat(&b.wait(T).unwrap())[0];
            let a = flat(&a.wait(T).unwrap())[0];
            (a, b, g)
        });
        // dp groups [0,2] and [1,3]; pipelines [0,1] and [2,3].
        assert_eq!(results[0], (4.0, 40.0, vec![0.0, 1.0]));
        assert_eq!(results[1], (6.0, 60.0, vec![0.0, 1.0]));
        assert_eq!(results[2], (4.0, 40.0, vec![2.0, 3.0]));
        assert_eq!(results[3], (6.0, 60.0, vec![2.0, 3.0]));
    }
}

fn groups_with_the_same_ranks_but_different_names_are_independent(world: World) {
    let results = ranks(world, 2, |c| {
        let a = Group::new("a", vec![0, 1]).unwrap();
        let b = Group::new("b", vec![0, 1]).unwrap();
        let one = |v: f32| Tensor::new(&[v], &Device::Cpu).unwrap();
        let r = c.rank() as f32;
        // Opposite start orders on the two ranks.
        let (ha, hb) = if c.rank() == 0 {
            let ha = c.all_reduce(&a, &one(1.0 + r)).unwrap();
            (ha, c.all_reduce(&b, &one(100.0 + r)).unwrap())
        } else {
            let hb = c.all_reduce(&b, &one(100.0 + r)).unwrap();
            (c.all_reduce(&a, &one(1.0 + r)).unwrap(), hb)
        };
        (flat(&ha.wait(T).unwrap())[0], flat(&hb.wait(T).unwrap())[0])
    });
    assert_eq!(results, vec![(3.0, 201.0), (3.0, 201.0)]);
}

fn start_then_point_to_point_then_wait_overlaps(world: World) {
    // Rank r > 0 starts the all-reduce only after a token from rank r - 1, so rank 0's handle
    // cannot be complete while rank 0 still has to send the first token: the start did not
    // block, and point-to-point traffic flows while the collective is in flight.
    let tag = |mb| Tag::Activation { stage: 0, mb };
    let results = ranks(world, 4, |c| {
        let r = c.rank();
        let g = Group::world(4).unwrap();
        let x = Tensor::new(&[r as f32 + 1.0], &Device::Cpu).unwrap();
        let token = Tensor::new(&[r as f32], &Device::Cpu).unwrap();
        let h = if r == 0 {
            let h = c.all_reduce(&g, &x).unwrap();
            assert!(!h.is_ready(), "nobody else can have started yet");
            c.send(1, tag(0), token).unwrap();
            // Compute while the collective is in flight.
            let m = Tensor::ones((64, 64), DType::F32, &Device::Cpu).unwrap();
            assert_eq!(flat(&m.matmul(&m).unwrap())[0], 64.0);
            // Rank 3 started last; its message means everyone has started.
            assert_eq!(flat(&c.recv(3, tag(1), T).unwrap()), vec![3.0]);
            assert!(h.is_ready());
            h
        } else {
            assert_eq!(flat(&c.recv(r - 1, tag(0), T).unwrap()), vec![(r - 1) as f32]);
            let h = c.all_reduce(&g, &x).unwrap();
            let (peer, t) = if r < 3 { (r + 1, tag(0)) } else { (0, tag(1)) };
            c.send(peer, t, token).unwrap();
            h
        };
        flat(&h.wait(T).unwrap())[0]
    });
    assert_eq!(results, vec![10.0; 4]);
}

fn successive_collectives_on_one_group_match_by_sequence_number(world: World) {
    let results = ranks(world, 2, |c| {
        let g = Group::world(2).unwrap();
        let scale = if c.rank() == 0 { 1.0 } else { 10.0 };
        let hs: Vec<_> = (1..=3)
            .map(|k| c.all_reduce(&g, &Tensor::new(&[k as f32 * scale], &Device::Cpu).unwrap()).unwrap())
            .collect();
        assert_eq!(hs.iter().map(|h| h.seq()).collect::<Vec<_>>(), vec![0, 1, 2]);
        let barrier = c.barrier(&g).unwrap();
        assert_eq!((barrier.op(), barrier.seq()), (CollectiveOp::Barrier, 3));
        let mut hs = hs.into_iter().map(Some).collect::<Vec<_>>();
        let mut out = [0.0; 3];
        for k in [2, 0, 1] {
            out[k] = flat(&hs[k].take().unwrap().wait(T).unwrap())[0];
        }
        barrier.wait(T).unwrap();
        out
    });
    assert_eq!(results, vec![[11.0, 22.0, 33.0]; 2]);
}

fn abort_fails_every_pending_wait_and_recv_at_once_naming_the_failed_rank(world: World) {
    let timeout = Duration::from_secs(30);
    let results = ranks(world, 4, |c| {
        let g = Group::world(4).unwrap();
        let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
        let t0 = Instant::now();
        let r = match c.rank() {
            3 => {
                std::thread::sleep(Duration::from_millis(50));
                c.abort("loss is NaN at step 7");
                return None;
            }
            1 => c.recv(3, Tag::Gradient { stage: 1, mb: 0 }, timeout).map(|_| ()),
            _ => c.all_reduce(&g, &x).unwrap().wait(timeout).map(|_| ()),
        };
        let elapsed = t0.elapsed();
        // Later calls fail too.
        let later_send = c.send(0, Tag::Activation { stage: 0, mb: 0 }, x.clone());
        let later_start = c.barrier(&g).map(|_| ());
        Some((r, elapsed, later_send, later_start))
    });
    for (rank, res) in results.into_iter().enumerate().take(3) {
        let (r, elapsed, later_send, later_start) = res.unwrap();
        for e in [r, later_send, later_start] {
            match e {
                Err(CommError::Aborted { failed_rank: 3, reason }) => {
                    assert_eq!(reason, "loss is NaN at step 7")
                }
                other => panic!("rank {rank}: expected Aborted by rank 3, got {other:?}"),
            }
        }
        assert!(elapsed < Duration::from_secs(5), "rank {rank} took {elapsed:?} to notice the abort");
    }
}

fn mismatched_contributions_are_typed_errors_naming_both_ranks(world: World) {
    let results = ranks(world, 4, |c| {
        let g = Group::world(4).unwrap();
        let shape = if c.rank() == 2 { (3, 2) } else { (2, 3) };
        let x = Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap();
        let shapes = c.all_reduce(&g, &x).unwrap().wait(T).unwrap_err();
        let y = Tensor::zeros(4, if c.rank() == 1 { DType::F64 } else { DType::F32 }, &Device::Cpu).unwrap();
        let dtypes = c.all_gather(&g, &y).unwrap().wait(T).unwrap_err();
        // Rank 3 calls a barrier where the others all-gather.
        let ops = if c.rank() == 3 {
            c.barrier(&g).unwrap().wait(T)
        } else {
            c.all_gather(&g, &y).unwrap().wait(T).map(|_| ())
        };
        (shapes, dtypes, ops.unwrap_err())
    });
    for (r, (shapes, dtypes, ops)) in results.into_iter().enumerate() {
        match shapes {
            CommError::Mismatch {
                op: CollectiveOp::AllReduce,
                ref group,
                seq: 0,
                rank: 0,
                ref desc,
                other_rank: 2,
                ref other_desc,
            } => {
                assert_eq!(group, "world[0,1,2,3]");
                assert_eq!(desc, &TensorDesc { dtype: DType::F32, shape: vec![2, 3] });
                assert_eq!(other_desc, &TensorDesc { dtype: DType::F32, shape: vec![3, 2] });
                assert_eq!(
                    shapes.to_string(),
                    "all_reduce #0 on group world[0,1,2,3]: rank 0 contributed f32[2, 3] but rank 2 contributed f32[3, 2]"
                );
            }
            other => panic!("rank {r}: {other:?}"),
        }
        match dtypes {
            CommError::Mismatch {
                op: CollectiveOp::AllGather,
                seq: 1,
                rank: 0,
                other_rank: 1,
                ref other_desc,
                ..
            } => {
                assert_eq!(other_desc.dtype, DType::F64)
            }
            other => panic!("rank {r}: {other:?}"),
        }
        match ops {
            CommError::OpMismatch {
                seq: 2,
                rank: 0,
                op: CollectiveOp::AllGather,
                other_rank: 3,
                other_op: CollectiveOp::Barrier,
                ..
            } => {}
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[test]
fn timeouts_name_what_was_awaited() {
    let comms = ThreadComm::world(4);
    let g = Group::world(4).unwrap();
    let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
    // Ranks 0..3 start (starting never blocks); rank 3 never does.
    let hs: Vec<_> = comms[..3].iter().map(|c| c.all_reduce(&g, &x).unwrap()).collect();
    let e = hs.into_iter().next().unwrap().wait(Duration::from_millis(30)).unwrap_err();
    match &e {
        CommError::Timeout { rank: 0, awaited: Awaited::Collective { op, group, seq, missing }, waited } => {
            assert_eq!(
                (*op, group.as_str(), *seq, missing),
                (CollectiveOp::AllReduce, "world[0,1,2,3]", 0, &vec![3])
            );
            assert_eq!(*waited, Duration::from_millis(30));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        e.to_string(),
        "rank 0: timed out after 0.03 s waiting for all_reduce #0 on group world[0,1,2,3] (not started by ranks [3])"
    );
    let tag = Tag::Gradient { stage: 2, mb: 5 };
    match comms[2].recv(1, tag, Duration::from_millis(10)).unwrap_err() {
        CommError::Timeout { rank: 2, awaited: Awaited::Message { peer: 1, tag: t }, .. } => {
            assert_eq!(t, tag)
        }
        other => panic!("{other:?}"),
    }
}

fn bad_peers_groups_and_inputs_are_typed_errors(world: World) {
    let comms = world(4);
    let c = &comms[1];
    let x = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
    let tag = Tag::Activation { stage: 0, mb: 0 };
    assert!(matches!(c.send(4, tag, x.clone()), Err(CommError::BadPeer { rank: 1, peer: 4, world: 4 })));
    assert!(matches!(c.recv(9, tag, T), Err(CommError::BadPeer { rank: 1, peer: 9, world: 4 })));
    let others = Group::new("dp", vec![0, 2]).unwrap();
    match c.all_reduce(&others, &x) {
        Err(CommError::NotInGroup { rank: 1, group }) => assert_eq!(group, "dp[0,2]"),
        other => panic!("{other:?}"),
    }
    let too_big = Group::new("dp", vec![1, 7]).unwrap();
    assert!(matches!(c.barrier(&too_big), Err(CommError::BadPeer { rank: 1, peer: 7, world: 4 })));
    assert!(matches!(Group::new("dp", vec![]), Err(CommError::EmptyGroup { .. })));
    assert!(matches!(Group::new("dp", vec![1, 3, 1]), Err(CommError::DuplicateRank { rank: 1, .. })));
    let g = Group::world(4).unwrap();
    let ints = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
    assert!(matches!(
        c.all_reduce(&g, &ints),
        Err(CommError::Dtype { rank: 1, op: CollectiveOp::AllReduce, dtype: DType::U32 })
    ));
    assert!(matches!(
        c.reduce_scatter(&g, &x),
        Err(CommError::Indivisible { rank: 1, rows: 2, group_size: 4 })
    ));
    assert!(matches!(
        c.all_to_all(&g, &x, &[1, 1]),
        Err(CommError::Counts { rank: 1, rows: 2, group_size: 4, .. })
    ));
    let scalar = Tensor::new(1f32, &Device::Cpu).unwrap();
    assert!(matches!(
        c.all_gather(&g, &scalar),
        Err(CommError::Scalar { rank: 1, op: CollectiveOp::AllGather })
    ));
    // A rejected start consumes no sequence number.
    assert_eq!(c.barrier(&g).unwrap().seq(), 0);
}
