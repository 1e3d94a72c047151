//! `MpiComm` across Open MPI processes (cargo feature `mpi`). Each test re-runs this test
//! binary under `mpirun -n 3`, filtered to itself; the ranks check their results against serial
//! references computed from the same seeds (bitwise) and print `rank R ok`, which the parent
//! counts.
#![cfg(feature = "mpi")]

use std::process::Command;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use graphpp_comm::mpi::MpiComm;
use graphpp_comm::{Comm, CommError, Group, Tag};

const WORLD: usize = 3;
const T: Duration = Duration::from_secs(60);
const CHILD: &str = "GRAPHPP_MPI_TEST_CHILD";

/// A fresh directory for one `mpirun`'s session files (its `TMPDIR`): concurrent `mpirun`s
/// sharing `/tmp/ompi.<host>.<uid>` raced to create it ("A call to mkdir was unable to create
/// the desired directory … File exists", seen once in `cargo test`).
fn mpi_tmpdir() -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("graphpp-mpi-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory for mpirun's session files");
    dir
}

/// In the parent: runs test `name` under `mpirun -n 3` and checks every rank reported `ok`.
/// In a rank: returns its communicator.
fn under_mpirun(name: &str) -> Option<MpiComm> {
    if std::env::var_os(CHILD).is_some() {
        return Some(MpiComm::init().expect("MPI starts"));
    }
    let exe = std::env::current_exe().unwrap();
    let out = Command::new("mpirun")
        .env("TMPDIR", mpi_tmpdir())
        .args(["--allow-run-as-root", "--oversubscribe", "-n", &WORLD.to_string(), "-x", CHILD])
        .env(CHILD, "1")
        .arg(exe)
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .output()
        .expect("mpirun runs (Debian: openmpi-bin)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for r in 0..WORLD {
        assert!(
            stdout.contains(&format!("rank {r} ok")),
            "rank {r} did not finish {name}:\n{stdout}\n{stderr}"
        );
    }
    assert!(out.status.success(), "{stdout}\n{stderr}");
    None
}

fn random(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let u = (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
            (u * 2.0 - 1.0) * 2f32.powi((s % 17) as i32 - 8)
        })
        .collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

#[test]
fn collectives_and_messages_between_processes_equal_the_serial_results() {
    let Some(c) = under_mpirun("collectives_and_messages_between_processes_equal_the_serial_results") else {
        return;
    };
    let (me, n) = (c.rank(), c.world());
    assert_eq!(n, WORLD);
    let world = Group::world(n).unwrap();
    let (rows, cols) = (6, 5);
    let input = |r: usize| random(r as u64 + 11, rows * cols);
    let x = Tensor::from_vec(input(me), (rows, cols), &Device::Cpu).unwrap();
    // All-reduce: ((x0 + x1) + x2) bitwise.
    let serial: Vec<u32> =
        (0..rows * cols).map(|i| ((input(0)[i] + input(1)[i]) + input(2)[i]).to_bits()).collect();
    assert_eq!(bits(&c.all_reduce(&world, &x).unwrap().wait(T).unwrap()), serial);
    // All-gather in group order.
    let gathered: Vec<u32> = (0..n).flat_map(|r| input(r).into_iter().map(f32::to_bits)).collect();
    assert_eq!(bits(&c.all_gather(&world, &x).unwrap().wait(T).unwrap()), gathered);
    // Reduce-scatter: my two rows of the sum.
    let mine: Vec<u32> = serial[me * 2 * cols..(me + 1) * 2 * cols].to_vec();
    assert_eq!(bits(&c.reduce_scatter(&world, &x).unwrap().wait(T).unwrap()), mine);
    // All-to-all with variable counts: rank r sends (r + j) mod 3 rows to rank j.
    let counts: Vec<usize> = (0..n).map(|j| (me + j) % 3).collect();
    let sent = Tensor::from_vec(
        input(me)[..counts.iter().sum::<usize>() * cols].to_vec(),
        (counts.iter().sum::<usize>(), cols),
        &Device::Cpu,
    )
    .unwrap();
    let got = c.all_to_all(&world, &sent, &counts).unwrap().wait(T).unwrap();
    let expect_counts: Vec<usize> = (0..n).map(|r| (r + me) % 3).collect();
    assert_eq!(got.recv_counts, expect_counts);
    let mut expect = Vec::new();
    for (r, &count) in expect_counts.iter().enumerate() {
        let before: usize = (0..me).map(|j| (r + j) % 3).sum();
        expect.extend(input(r)[before * cols..(before + count) * cols].iter().map(|v| v.to_bits()));
    }
    assert_eq!(bits(&got.data), expect);
    // A sub-group: ranks 2 and 0, in that order.
    if me != 1 {
        let g = Group::new("dp", vec![2, 0]).unwrap();
        let s = c.all_gather(&g, &Tensor::new(&[me as f32], &Device::Cpu).unwrap()).unwrap().wait(T).unwrap();
        assert_eq!(s.to_vec1::<f32>().unwrap(), vec![2.0, 0.0]);
    }
    // Large point-to-point both ways at once (4 MiB each): sends never block on the receiver.
    let big = Tensor::from_vec(random(me as u64, 1 << 20), 1 << 20, &Device::Cpu).unwrap();
    let next = (me + 1) % n;
    let prev = (me + n - 1) % n;
    for mb in 0..3 {
        c.send(next, Tag::Activation { stage: next, mb }, big.clone()).unwrap();
    }
    for mb in 0..3 {
        let got = c.recv(prev, Tag::Activation { stage: me, mb }, T).unwrap();
        assert_eq!(
            bits(&got),
            bits(&Tensor::from_vec(random(prev as u64, 1 << 20), 1 << 20, &Device::Cpu).unwrap())
        );
    }
    c.barrier(&world).unwrap().wait(T).unwrap();
    println!("rank {me} ok");
    c.finish();
}

#[test]
fn an_abort_reaches_every_process_at_once_naming_the_failed_rank() {
    let Some(c) = under_mpirun("an_abort_reaches_every_process_at_once_naming_the_failed_rank") else {
        return;
    };
    let me = c.rank();
    let world = Group::world(c.world()).unwrap();
    let x = Tensor::new(&[1f32], &Device::Cpu).unwrap();
    if me == 1 {
        std::thread::sleep(Duration::from_millis(200));
        c.abort("rank 1: loss is NaN at step 7");
        println!("rank {me} ok");
    } else {
        let t0 = Instant::now();
        let r = c.all_reduce(&world, &x).unwrap().wait(Duration::from_secs(60));
        match r {
            Err(CommError::Aborted { failed_rank: 1, reason }) => {
                assert_eq!(reason, "rank 1: loss is NaN at step 7")
            }
            other => panic!("rank {me}: {other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "rank {me} took {:?}", t0.elapsed());
        println!("rank {me} ok");
    }
    // Every rank still finalizes cleanly: the abort is graphpp's, not MPI's.
    c.finish();
}
