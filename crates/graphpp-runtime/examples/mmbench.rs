use std::time::Instant;
fn main() {
    let threads: usize = std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(1);
    let copies: usize = std::env::args().nth(2).map(|s| s.parse().unwrap()).unwrap_or(1);
    let pool = graphpp_runtime::threads::rank_pool(0, threads).unwrap();
    graphpp_runtime::threads::install_hot(&pool, true, || {
        for &(m, k, n, ta, tb) in &[
            (128usize, 256usize, 688usize, false, false),
            (128, 256, 688, false, true),
            (256, 128, 688, true, false),
            (128, 256, 256, false, true),
            (128, 688, 256, false, true),
        ] {
            let dev = candle_core::Device::Cpu;
            let mk = |r: usize, c: usize, t: bool, s: usize| {
                let v: Vec<f32> = (0..r * c).map(|i| (((i + s) * 7 % 13) as f32) * 0.1).collect();
                if t {
                    candle_core::Tensor::from_vec(v, (c, r), &dev).unwrap().t().unwrap()
                } else {
                    candle_core::Tensor::from_vec(v, (r, c), &dev).unwrap()
                }
            };
            let a: Vec<_> = (0..copies).map(|s| mk(m, k, ta, s)).collect();
            let b: Vec<_> = (0..copies).map(|s| mk(k, n, tb, s)).collect();
            let r = 400;
            for i in 0..50 {
                a[i % copies].matmul(&b[i % copies]).unwrap();
            }
            let t = Instant::now();
            for i in 0..r {
                a[i % copies].matmul(&b[i % copies]).unwrap();
            }
            let dc = t.elapsed().as_secs_f64() / r as f64;
            println!(
                "{m}x{k}x{n} ta={ta} tb={tb} copies={copies}: candle {:.3} ms {:.1} GFLOP/s",
                dc * 1e3,
                2.0 * (m * n * k) as f64 / dc / 1e9
            );
        }
    });
}
