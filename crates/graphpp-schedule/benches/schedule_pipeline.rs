//! generate + lower + validate + simulate at p = 64, v = 2, m = 1024 (issue target: < 100 ms in
//! release), for ZB-V and interleaved 1F1B. Run: `cargo bench -p graphpp-schedule`.

use criterion::{criterion_group, criterion_main, Criterion};
use graphpp_schedule::{
    generate, lower, validated, Costs, Kind, LowerOptions, Memory, Options, Shape, ValidateOptions,
};

/// The pipeline; the simulation runs on the validation's walk ([`graphpp_schedule::Validated`]).
fn full(kind: Kind, shape: &Shape) -> f64 {
    let s = generate(kind, shape, &Options::default()).expect("shape is valid");
    let lowered = lower(&s, &LowerOptions::default()).expect("lowering succeeds");
    let checked = validated(&lowered, &ValidateOptions::default()).expect("lowered schedule is valid");
    checked.simulate(&Costs::default(), &Memory::default()).expect("costs are valid").makespan
}

fn bench(c: &mut Criterion) {
    let shape = Shape::new(64, 2, 1024);
    let mut g = c.benchmark_group("p64_v2_m1024");
    g.sample_size(10);
    for kind in [Kind::Zbv, Kind::Interleaved1F1B] {
        g.bench_function(format!("{kind}/generate"), |b| {
            b.iter(|| generate(kind, &shape, &Options::default()).expect("valid"))
        });
        g.bench_function(format!("{kind}/generate+lower+validate+simulate"), |b| {
            b.iter(|| full(kind, &shape))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
