//! One rank's training step over a communicator: RankTrainers on explicit threads reproduce the
//! Trainer harness bitwise, copies of a parameter form one all-reduce group of their holders, and
//! the global gradient norm counts each copy once (it equals the one-device norm).

mod common;

use std::sync::Arc;
use std::time::Instant;

use graphpp_comm::{Mesh, ThreadComm};
use graphpp_runtime::kernels::tensor::to_f64;
use graphpp_runtime::verify::random_microbatches;
use graphpp_runtime::{RankTrainer, TrainSetup, Trainer};
use graphpp_schedule::Kind;

fn setup(kind: Kind, p: usize, v: usize, m: usize) -> TrainSetup {
    common::tiny_setup(kind, p, v, m)
}

/// Builds one RankTrainer per rank of a ThreadComm world (dp = 1).
fn rank_trainers(s: &TrainSetup) -> Vec<RankTrainer> {
    let schedule = Arc::new(s.lowered_schedule().unwrap());
    let p = schedule.num_ranks();
    let mesh = Mesh::new(p, 1).unwrap();
    ThreadComm::world(p)
        .into_iter()
        .map(|c| RankTrainer::new(s.clone(), Arc::clone(&schedule), mesh, Arc::new(c)).unwrap())
        .collect()
}

/// RankTrainers stepped on threads spawned here give every rank the same loss and norm, and the
/// losses, norms and parameters of the Trainer harness bitwise (ZB-V and DualPipe, 3 steps).
#[test]
fn rank_trainers_on_threads_equal_the_harness_bitwise() {
    for kind in [Kind::Zbv, Kind::DualPipe] {
        let s = setup(kind, 2, 2, 4);
        let mut harness = Trainer::new(s.clone()).unwrap();
        let mut ranks = rank_trainers(&s);
        for k in 0..3 {
            let data = random_microbatches(256, 4, 1, 8, k).unwrap();
            let want = harness.step(data.clone()).unwrap();
            let data = Arc::new(data);
            let start = Instant::now();
            let reports: Vec<_> = std::thread::scope(|scope| {
                let hs: Vec<_> = ranks
                    .iter_mut()
                    .map(|r| {
                        let d = Arc::clone(&data);
                        scope.spawn(move || r.step_at(d, start).unwrap())
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for r in &reports {
                assert_eq!(r.stats.step, k + 1);
                assert_eq!(r.stats.loss.to_bits(), want.stats.loss.to_bits(), "{kind} step {k}: loss");
                assert_eq!(
                    r.stats.grad_norm.to_bits(),
                    want.stats.grad_norm.to_bits(),
                    "{kind} step {k}: norm"
                );
            }
        }
        let want = harness.parameters();
        for r in &ranks {
            for (name, t) in r.parameters().unwrap() {
                assert_eq!(to_f64(&t).unwrap(), to_f64(&want[&name]).unwrap(), "{kind}: {name}");
            }
        }
    }
}

/// Under DualPipe p=2 every parameter of a rank is also on the other rank: one group
/// `copies.<name>[0,1]` per parameter name; under 1F1B (no tied embedding in the tiny model) none.
#[test]
fn copies_form_one_group_per_name_of_their_holders() {
    let ranks = rank_trainers(&setup(Kind::DualPipe, 2, 2, 4));
    for r in &ranks {
        let names = r.parameters().unwrap();
        let groups: Vec<String> = r.copy_groups().iter().map(|g| g.to_string()).collect();
        let want: Vec<String> = names.keys().map(|n| format!("copies.{n}[0,1]")).collect();
        assert_eq!(groups, want, "rank {}", r.rank());
    }
    for r in &rank_trainers(&setup(Kind::OneFOneB, 2, 1, 2)) {
        assert!(r.copy_groups().is_empty(), "rank {}: {:?}", r.rank(), r.copy_groups());
    }
    // A tied embedding: the first and the last stage hold `model.embed_tokens.weight`.
    let mut s = setup(Kind::OneFOneB, 2, 1, 2);
    s.model = Arc::new(graphpp_models::LlamaConfig {
        tie_word_embeddings: true,
        ..graphpp_models::LlamaConfig::tiny()
    });
    let mut ranks = rank_trainers(&s);
    for r in &ranks {
        let groups: Vec<String> = r.copy_groups().iter().map(|g| g.to_string()).collect();
        assert_eq!(groups, vec!["copies.model.embed_tokens.weight[0,1]".to_string()]);
    }
    // Its two copies get the summed gradient and stay bitwise equal.
    let data = Arc::new(random_microbatches(256, 2, 1, 8, 1).unwrap());
    std::thread::scope(|scope| {
        for r in ranks.iter_mut() {
            let d = Arc::clone(&data);
            scope.spawn(move || r.step(d).unwrap());
        }
    });
    let e: Vec<Vec<f64>> = ranks
        .iter()
        .map(|r| to_f64(&r.parameters().unwrap()["model.embed_tokens.weight"]).unwrap())
        .collect();
    assert_eq!(e[0], e[1]);
}

/// The global gradient norm of a pipelined step (each copy counted once) equals the norm one
/// device computes for the same batch: DualPipe p=2 (two copies of every parameter) and ZB-V.
#[test]
fn global_norm_equals_the_one_device_norm() {
    let data = random_microbatches(256, 4, 1, 8, 7).unwrap();
    let one = Trainer::new(setup(Kind::Gpipe, 1, 1, 4)).unwrap().step(data.clone()).unwrap().stats.grad_norm;
    for (kind, p, v) in [(Kind::DualPipe, 2, 2), (Kind::Zbv, 2, 2)] {
        let n = Trainer::new(setup(kind, p, v, 4)).unwrap().step(data.clone()).unwrap().stats.grad_norm;
        assert!((n - one).abs() / one < 1e-5, "{kind}: norm {n} vs one device {one}");
    }
}

/// dp = 2 × pp = 2 (each replica runs half of every microbatch's sequences) gives the losses and
/// parameters (relative L2 distance per tensor) of dp = 1 × pp = 2 on the same global batch after
/// 3 steps, for 1F1B and ZB-V.
#[test]
fn data_parallel_equals_one_replica() {
    for (kind, v) in [(Kind::OneFOneB, 1), (Kind::Zbv, 2)] {
        let run = |dp: usize| {
            let mut t = Trainer::new(TrainSetup { microbatch_size: 2, dp, ..setup(kind, 2, v, 4) }).unwrap();
            let losses: Vec<f64> = (0..3)
                .map(|k| t.step(random_microbatches(256, 4, 2, 8, 10 + k).unwrap()).unwrap().stats.loss)
                .collect();
            (losses, t.parameters(), t.rank_trainers().len())
        };
        let (l1, p1, w1) = run(1);
        let (l2, p2, w2) = run(2);
        assert_eq!((w1, w2), (2, 4), "{kind}: world sizes");
        for (a, b) in l2.iter().zip(&l1) {
            assert!((a - b).abs() / b.abs() <= 1e-5, "{kind}: losses {l2:?} vs {l1:?}");
        }
        assert_eq!(p1.len(), p2.len());
        for (name, t) in &p1 {
            let (x, y) = (to_f64(t).unwrap(), to_f64(&p2[name]).unwrap());
            // Relative L2 distance of the whole tensor: AdamW turns rounding noise in a gradient
            // entry near 0 into a step of up to lr, so single entries may differ more.
            let d = x.iter().zip(&y).map(|(p, q)| (p - q) * (p - q)).sum::<f64>().sqrt();
            let n = x.iter().map(|p| p * p).sum::<f64>().sqrt();
            assert!(d / n <= 1e-5, "{kind}: {name} differs by {:e} relative", d / n);
        }
    }
}

/// A batch that does not split over the replicas is a typed error before anything is built.
#[test]
fn dp_must_divide_the_batch() {
    let e =
        Trainer::new(TrainSetup { microbatch_size: 3, dp: 2, ..setup(Kind::OneFOneB, 2, 1, 2) }).unwrap_err();
    assert!(matches!(e, graphpp_runtime::TrainError::BatchNotDivisible { batch: 3, dp: 2 }), "{e}");
    let e = Trainer::new(TrainSetup { dp: 0, ..setup(Kind::OneFOneB, 2, 1, 2) }).unwrap_err();
    assert!(matches!(e, graphpp_runtime::TrainError::BatchNotDivisible { batch: 1, dp: 0 }), "{e}");
}

/// One `Trainer::on_comm` per rank over `loopback` (every message through its byte form, as
/// between MPI processes), DualPipe p=2 × dp=2: losses and norms equal the thread harness
/// bitwise; only the leader gets the gathered state, equal to the harness's parameters and
/// AdamW state; the leader's timeline holds every action of replica 0; peak bytes cover the
/// world on every rank; a stop flag set on one rank is seen by all.
#[test]
fn process_trainers_over_a_byte_link_equal_the_harness_and_gather_to_the_leader() {
    use graphpp_comm::{loopback, Comm};
    let s = TrainSetup { microbatch_size: 2, dp: 2, ..setup(Kind::DualPipe, 2, 2, 4) };
    let mut harness = Trainer::new(s.clone()).unwrap();
    let comms: Vec<Arc<dyn Comm>> = loopback(4).into_iter().map(|c| Arc::new(c) as Arc<dyn Comm>).collect();
    let mut trainers: Vec<Trainer> =
        comms.into_iter().map(|c| Trainer::on_comm(s.clone(), c).unwrap()).collect();
    assert_eq!(trainers.iter().map(Trainer::is_leader).collect::<Vec<_>>(), [true, false, false, false]);
    let schedule = harness.schedule().clone();
    for k in 0..2 {
        let data = random_microbatches(256, 4, 2, 8, 20 + k).unwrap();
        let want = harness.step(data.clone()).unwrap();
        let reports: Vec<_> = std::thread::scope(|scope| {
            let hs: Vec<_> = trainers
                .iter_mut()
                .map(|t| {
                    let d = data.clone();
                    scope.spawn(move || t.step(d).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, r) in reports.iter().enumerate() {
            assert_eq!(r.stats.loss.to_bits(), want.stats.loss.to_bits(), "step {k} rank {rank}: loss");
            assert_eq!(
                r.stats.grad_norm.to_bits(),
                want.stats.grad_norm.to_bits(),
                "step {k} rank {rank}: norm"
            );
            assert_eq!(r.stats.peak_bytes.len(), 4);
            assert_eq!(r.stats.peak_bytes, want.stats.peak_bytes, "step {k} rank {rank}: peaks");
        }
        let actions = |t: &graphpp_schedule::Timeline, rank: usize| {
            t.intervals.iter().filter(|i| i.rank == rank).count()
        };
        for pp in 0..2 {
            assert_eq!(
                actions(&reports[0].timeline, pp),
                schedule.program(pp).len(),
                "leader's timeline, rank {pp}"
            );
        }
        assert_eq!(actions(&reports[1].timeline, 0), 0, "rank 1 keeps only its own intervals");
    }
    let gathered: Vec<_> = std::thread::scope(|scope| {
        let hs: Vec<_> =
            trainers.iter_mut().map(|t| scope.spawn(move || t.gather_state(true).unwrap())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(gathered[1..].iter().all(Option::is_none));
    let got = gathered[0].as_ref().unwrap();
    let mut want = harness.parameters();
    want.extend(harness.optimizer_state().unwrap());
    assert_eq!(got.keys().collect::<Vec<_>>(), want.keys().collect::<Vec<_>>());
    for (name, t) in &want {
        assert!(common::same(&got[name], t), "{name} differs");
    }
    let stops: Vec<bool> = std::thread::scope(|scope| {
        let hs: Vec<_> =
            trainers.iter().enumerate().map(|(r, t)| scope.spawn(move || t.any(r == 3).unwrap())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(stops, [true; 4]);
}

/// `post_validate`: the optimistic AdamW step checked after the fact is bitwise the synchronous
/// step — never rolled back when no step clips, rolled back at every step when every step clips
/// (1F1B dp = 1 and DualPipeV dp = 2) — and a non-finite gradient fails the step like the
/// synchronous one, leaving the parameters as they were.
#[test]
fn post_validation_equals_the_synchronous_step_and_rolls_back_when_it_must() {
    for (kind, v, dp) in [(Kind::OneFOneB, 1, 1), (Kind::DualPipeV, 2, 2)] {
        for (max_norm, clips) in [(1e9, false), (1e-3, true)] {
            let base =
                TrainSetup { microbatch_size: 2, dp, grad_clip: Some(max_norm), ..setup(kind, 2, v, 4) };
            let mut sync = Trainer::new(base.clone()).unwrap();
            let mut post = Trainer::new(TrainSetup { post_validate: true, ..base }).unwrap();
            for k in 0..3 {
                let data = random_microbatches(256, 4, 2, 8, 70 + k).unwrap();
                let (a, b) = (sync.step(data.clone()).unwrap(), post.step(data).unwrap());
                assert_eq!(a.stats.loss.to_bits(), b.stats.loss.to_bits(), "{kind} step {k}: loss");
                assert_eq!(a.stats.grad_norm.to_bits(), b.stats.grad_norm.to_bits(), "{kind} step {k}: norm");
                assert!(!a.stats.rolled_back, "the synchronous step never rolls back");
                assert_eq!(
                    b.stats.rolled_back, clips,
                    "{kind} step {k}: norm {} vs max {max_norm}",
                    b.stats.grad_norm
                );
                assert_eq!(b.boundary_wait_s.len(), 2 * dp);
            }
            let (pa, pb) = (sync.parameters(), post.parameters());
            for (name, t) in &pa {
                assert!(common::same(t, &pb[name]), "{kind}: {name} differs");
            }
        }
    }
    // A NaN weight gives a NaN loss and gradient norm: both fail the step; neither applies it.
    for post_validate in [false, true] {
        let s = TrainSetup { grad_clip: None, post_validate, ..setup(Kind::OneFOneB, 2, 1, 2) };
        let mut t = Trainer::new(s).unwrap();
        let mut params: std::collections::HashMap<_, _> = t.parameters().into_iter().collect();
        let w = &params["model.norm.weight"];
        let nan = (w.ones_like().unwrap() * f64::NAN).unwrap();
        params.insert("model.norm.weight".into(), nan);
        t.load_parameters(&params).unwrap();
        let before = t.parameters();
        let e = t.step(random_microbatches(256, 2, 1, 8, 5).unwrap()).unwrap_err();
        assert!(
            e.is_skipped_step() && e.to_string().contains("not finite"),
            "post_validate={post_validate}: {e}"
        );
        for (name, p) in t.rank_trainers().iter().flat_map(|r| r.parameters().unwrap()) {
            assert!(
                to_f64(&p)
                    .unwrap()
                    .iter()
                    .zip(to_f64(&before[&name]).unwrap())
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{name} changed"
            );
        }
    }
}
