use graphpp_schedule::*;
use std::time::Instant;
fn main() {
    let shape = Shape::new(64, 2, 1024);
    let t = Instant::now();
    let s = generate(Kind::Zbv, &shape, &Options::default()).unwrap();
    eprintln!("generate {:?}", t.elapsed());
    let t = Instant::now();
    validate(&s, &ValidateOptions::default()).unwrap();
    eprintln!("validate compute-only {:?}", t.elapsed());
    let t = Instant::now();
    let l = lower::add_send_recv(&s).unwrap();
    eprintln!("add_send_recv {:?}", t.elapsed());
    let t = Instant::now();
    validate(&l, &ValidateOptions::default()).unwrap();
    eprintln!("validate lowered {:?}", t.elapsed());
    let t = Instant::now();
    let g = deps::DepGraph::build(&l).unwrap();
    eprintln!("depgraph {:?}", t.elapsed());
    let t = Instant::now();
    g.topo_order().unwrap();
    eprintln!("topo {:?}", t.elapsed());
    let t = Instant::now();
    simulate(&l, &Costs::default(), &Memory::default()).unwrap();
    eprintln!("simulate {:?}", t.elapsed());
}
