//! docs/ARCHITECTURE.md's reference figures ("Schedules and reference figures"), reproduced by the simulator
//! from generated schedules. Unit costs T_F = T_I = T_W = 1 (T_B = 2), c = 0 unless said.

use graphpp_schedule::{generate, simulate, Costs, Kind, Memory, Options, Schedule, Shape, SimReport};

fn gen(kind: Kind, p: usize, v: usize, m: usize) -> Schedule {
    generate(kind, &Shape::new(p, v, m), &Options::default()).unwrap_or_else(|e| panic!("{e}"))
}

fn sim(s: &Schedule, costs: Costs) -> SimReport {
    simulate(s, &costs, &Memory::default()).unwrap_or_else(|e| panic!("{e}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9
}

#[test]
fn gpipe_and_1f1b_makespan_22() {
    // (m+p−1)(t_f+t_b) with p=4, m=8, t_f=t_b=1.
    let c = Costs { f: 1.0, b: 1.0, ..Costs::default() };
    for kind in [Kind::Gpipe, Kind::OneFOneB] {
        assert_eq!(sim(&gen(kind, 4, 1, 8), c).makespan, 22.0, "{kind}");
    }
}

#[test]
fn one_f_one_b_programs_of_stage_0_and_3() {
    let s = gen(Kind::OneFOneB, 4, 1, 8);
    let text = |r: usize| s.program(r).iter().map(|a| a.to_string()).collect::<Vec<_>>().join(" ");
    assert_eq!(text(0), "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7");
    assert_eq!(text(3), "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7");
}

#[test]
fn one_f_one_b_bubble_ratios() {
    // r_bubble = (p−1)/m: p=8, m=8 → 0.875 (idle 47%); m=32 → ≈0.22 (18%); m=64 → 10% idle.
    let r = sim(&gen(Kind::OneFOneB, 8, 1, 8), Costs::default());
    assert!(close(r.bubble_ratio, 0.875));
    assert_eq!((r.idle_fraction * 100.0).round(), 47.0);
    let r = sim(&gen(Kind::OneFOneB, 8, 1, 32), Costs::default());
    assert!(close(r.bubble_ratio, 7.0 / 32.0));
    assert_eq!((r.idle_fraction * 100.0).round(), 18.0);
    let r = sim(&gen(Kind::OneFOneB, 8, 1, 64), Costs::default());
    assert_eq!((r.idle_fraction * 100.0).round(), 10.0);
}

#[test]
fn peak_in_flight_gpipe_m_and_1f1b_p_minus_r() {
    let r = sim(&gen(Kind::Gpipe, 4, 1, 8), Costs::default());
    assert_eq!(r.peak_in_flight, vec![8, 8, 8, 8]);
    let r = sim(&gen(Kind::OneFOneB, 4, 1, 8), Costs::default());
    assert_eq!(r.peak_in_flight, vec![4, 3, 2, 1]);
}

#[test]
fn interleaved_stage0_peak_5_5() {
    // Stage 0 holds p + (p−1)/v full-stage units: 5.5 for p=4, v=2.
    let r = sim(&gen(Kind::Interleaved1F1B, 4, 2, 8), Costs::default());
    assert!(close(r.peak_activations[0], 5.5), "{:?}", r.peak_activations);
}

#[test]
fn interleaved_bubble_is_divided_by_v() {
    // (p−1)(t_f+t_b)/v per rank: p=4, v=2, T_F=1, T_B=2 → 4.5 idle (stage costs halve with v, so
    // a chunk's F costs 1/2 here).
    let c = Costs { f: 0.5, b: 1.0, i: 0.5, w: 0.5, ..Costs::default() };
    let r = sim(&gen(Kind::Interleaved1F1B, 4, 2, 8), c);
    for idle in r.idle {
        assert!(close(idle, 4.5), "{idle}");
    }
}

#[test]
fn zb_h1_idle_3_vs_1f1b_9() {
    // ZB-H1 (p−1)(T_F+T_I−T_W) = 3 idle per rank vs 9 for 1F1B, 24 units of work each (p=4, m=8).
    let r1 = sim(&gen(Kind::OneFOneB, 4, 1, 8), Costs::default());
    let rz = sim(&gen(Kind::ZbH1, 4, 1, 8), Costs::default());
    for r in 0..4 {
        assert_eq!(r1.busy[r], 24.0);
        assert_eq!(rz.busy[r], 24.0);
        assert_eq!(r1.idle[r], 9.0);
        assert_eq!(rz.idle[r], 3.0, "rank {r}");
    }
    // Peak p·M_B.
    assert!(rz.peak_in_flight.iter().all(|&n| n <= 4));
}

#[test]
fn zb_h2_and_zbv_zero_steady_state_bubble() {
    let r = sim(&gen(Kind::ZbH2, 4, 1, 8), Costs::default());
    assert!(r.steady_idle.iter().all(|&x| close(x, 0.0)), "zb-h2 {:?}", r.steady_idle);
    assert!(r.peak_in_flight.iter().zip(0..).all(|(&n, r)| n < 2 * (4 - r)), "{:?}", r.peak_in_flight);
    for (p, m) in [(4, 8), (4, 12), (2, 4)] {
        let r = sim(&gen(Kind::Zbv, p, 2, m), Costs::default());
        assert!(r.steady_idle.iter().all(|&x| close(x, 0.0)), "zbv p={p} m={m} {:?}", r.steady_idle);
    }
}

#[test]
fn zb_auto_2p_zero_bubble_with_unit_costs() {
    let opts = Options { mem_cap: Some(8.0), ..Options::default() };
    let s = generate(Kind::ZbAuto, &Shape::new(4, 1, 8), &opts).unwrap();
    let r = sim(&s, Costs::default());
    assert!(r.steady_idle.iter().all(|&x| close(x, 0.0)), "{:?}", r.steady_idle);
    assert!(r.peak_activations.iter().all(|&x| x <= 8.0 + 1e-9));
}

#[test]
fn dualpipev_bubble_closed_form() {
    // DualPipe: (p/2−1)(T_F&B + T_B − 3T_W) per rank; DualPipeV: p ↦ 2p stages, i.e.
    // (p−1)(T_F&B + T_B − 3T_W). With T_F&B = 3, T_B = 2, T_W = 1: 2(p−1).
    for (p, m) in [(4, 8), (4, 10), (2, 4), (8, 16)] {
        let r = sim(&gen(Kind::DualPipeV, p, 2, m), Costs::default());
        let expect = (p as f64 - 1.0) * (3.0 + 2.0 - 3.0);
        for idle in &r.idle {
            assert!(close(*idle, expect), "p={p} m={m}: idle {idle} vs closed form {expect}");
        }
    }
}

#[test]
fn dualpipe_bubble_closed_form() {
    for (p, m) in [(4, 8), (8, 16)] {
        let r = sim(&gen(Kind::DualPipe, p, 2, m), Costs::default());
        let expect = (p as f64 / 2.0 - 1.0) * (3.0 + 2.0 - 3.0);
        for idle in &r.idle {
            assert!(close(*idle, expect), "p={p} m={m}: idle {idle} vs closed form {expect}");
        }
        assert!(r.peak_in_flight.iter().all(|&n| n <= p + 1), "{:?}", r.peak_in_flight);
    }
}
