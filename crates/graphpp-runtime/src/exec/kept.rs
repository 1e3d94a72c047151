//! Values a compiled [`crate::Program`] computes from one parameter and keeps across runs: a
//! parameter changes only at an optimizer step, so such a value is made once a step and read by
//! every microbatch's forward and backward. Two kinds:
//!
//! - **Transposed weights, row-major.** A linear layer's forward is `x · Wᵀ` with `W` stored
//!   `[out, in]`: its rhs is a transposed view, which gemm reads more slowly than a row-major
//!   matrix (measured: docs/PERFORMANCE.md, "Matmul pairs and transposed weights"). Every f32
//!   matmul therefore reads its rhs row-major — the interpreter copies a transposed one first
//!   (`kernels::matmul`), so both executors compute the same bits — and a program keeps the copy
//!   of a transposed *parameter* (a graph input of kind parameter, permuted to swap its last two
//!   axes, read only as a matmul's rhs).
//! - **bf16 weights.** Under mixed precision each f32 master weight is cast to bf16 in the graph
//!   (`graphpp_models::StageOptions::mixed`); a program keeps the cast of a parameter (a fused
//!   group of that one cast, [`crate::exec::fusion`]), so the bf16 copy is made once a step, as
//!   Megatron's and FSDP's mixed precision do, not once per microbatch.
//!
//! A value is keyed by what it is — the parameter's name and the derivation (the cast's dtype,
//! the permutation) — and stamped with the source tensor's [`candle_core::TensorId`], which is
//! never reused (the optimizer makes new tensors: a new id, a new value). The programs of one
//! stage share one [`KeptStore`] (`Program::compile_with`), so the forward's and the backward's
//! casts of a weight are one value made once a step, not once per program; each key holds one
//! value, replaced when its source changes; [`Cache::clear`] drops them all (a stage's RESHARD
//! does, so that FSDP keeps no full-size copy of a resharded stage). Under FSDP the full
//! parameters are new tensors at each UNSHARD, so a transposed copy or a cast is made once per
//! UNSHARD rather than once a step.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{Tensor, TensorId};
use graphpp_graph::{Graph, InputKind, Op};

/// How a kept value is made from its parameter.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Derivation {
    /// Cast to a dtype.
    Cast(graphpp_graph::DType),
    /// Permuted (the last two axes swapped) and made row-major.
    Permute(Vec<usize>),
}

/// What a kept value is: the parameter's name and its derivation.
type Key = (String, Derivation);

/// Per key, its kept value and its source's id.
type Copies = HashMap<Key, (TensorId, Tensor)>;

/// The kept values of the programs that share it (a stage's: `Program::compile_with`).
#[derive(Clone, Debug, Default)]
pub struct KeptStore(Arc<Mutex<Copies>>);

/// The nodes whose value a [`Cache`] keeps, and the values.
#[derive(Clone, Debug, Default)]
pub struct Cache {
    /// `kept[i]`: what node i's kept value is, when it is kept ([`Cache::plan`]).
    kept: Vec<Option<Key>>,
    /// The values, shared by the program's clones and the programs of its stage.
    copies: KeptStore,
}

impl Cache {
    /// The nodes of `graph` whose values are kept in `store`: a permute that swaps the last two
    /// axes of a parameter input, every reader of which is a matmul reading it as its rhs; and
    /// a cast of a parameter input that `lone_group` says runs as a fused group of its own.
    pub fn plan(graph: &Graph, lone_group: impl Fn(usize) -> bool, store: KeptStore) -> Cache {
        let users = graph.users();
        // The parameter a node's one operand is.
        let parameter = |n: &graphpp_graph::Node| match &graph.nodes[n.inputs[0].0].op {
            Op::Input { kind: InputKind::Parameter, name, .. } => Some(name.clone()),
            _ => None,
        };
        let kept = (0..graph.nodes.len())
            .map(|i| {
                let n = &graph.nodes[i];
                if graph.outputs.iter().any(|o| o.value.0 == i) {
                    return None;
                }
                let derivation = match &n.op {
                    Op::Cast { dtype } if lone_group(i) => Derivation::Cast(*dtype),
                    Op::Permute { perm } => {
                        let r = perm.len();
                        let swaps_last = r >= 2
                            && perm[..r - 2].iter().enumerate().all(|(j, &p)| p == j)
                            && perm[r - 2..] == [r - 1, r - 2];
                        let rhs_only = !users[i].is_empty()
                            && users[i].iter().all(|u| {
                                let reader = &graph.nodes[u.0];
                                matches!(reader.op, Op::Matmul)
                                    && reader.inputs[1].0 == i
                                    && reader.inputs[0].0 != i
                            });
                        if !(swaps_last && rhs_only) {
                            return None;
                        }
                        Derivation::Permute(perm.clone())
                    }
                    _ => return None,
                };
                parameter(n).map(|name| (name, derivation))
            })
            .collect();
        Cache { kept, copies: store }
    }

    /// Whether node `i`'s value is kept.
    pub fn keeps(&self, i: usize) -> bool {
        self.kept.get(i).is_some_and(Option::is_some)
    }

    /// Node `i`'s value from its one operand `source`: the value made from this source if
    /// there is one (by this program or another sharing the store), else `make(source)` (kept in
    /// place of the key's last one). A node that is not kept is made, and nothing is kept.
    ///
    /// # Errors
    /// `make`'s.
    pub fn get(
        &self,
        i: usize,
        source: &Tensor,
        make: impl FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let Some(Some(key)) = self.kept.get(i) else { return make(source) };
        let id = source.id();
        if let Some((_, t)) = self.lock().get(key).filter(|(k, _)| *k == id) {
            return Ok(t.clone());
        }
        // Made outside the lock (it may run on the pool).
        let t = make(source)?;
        self.lock().insert(key.clone(), (id, t.clone()));
        Ok(t)
    }

    /// Node `i`'s value: `source` permuted by `perm`, row-major ([`Cache::get`]).
    ///
    /// # Errors
    /// candle's, from the permute or the copy.
    pub fn transposed(&self, i: usize, source: &Tensor, perm: &[usize]) -> candle_core::Result<Tensor> {
        self.get(i, source, |s| s.permute(perm.to_vec())?.contiguous())
    }

    /// Drops every copy (their sources are going away: a RESHARD).
    pub fn clear(&self) {
        self.lock().clear();
    }

    /// The copies. A poisoned lock only means another run panicked while holding it: the map
    /// is still whole.
    fn lock(&self) -> std::sync::MutexGuard<'_, Copies> {
        self.copies.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use graphpp_graph::{DType, GraphBuilder};

    fn linear_graph() -> Graph {
        let mut b = GraphBuilder::new("g", DType::F32);
        let x = b.input("x", InputKind::Activation, vec![4, 3]).unwrap();
        let w = b.input("w", InputKind::Parameter, vec![5, 3]).unwrap();
        let a = b.input("a", InputKind::Activation, vec![5, 3]).unwrap();
        let wt = b.transpose_last(w).unwrap();
        let y = b.matmul(x, wt).unwrap();
        let at = b.transpose_last(a).unwrap();
        let z = b.matmul(x, at).unwrap();
        let s = b.add2(y, z).unwrap();
        b.output("s", s);
        b.finish().unwrap()
    }

    #[test]
    fn keeps_a_transposed_parameter_read_as_rhs_only() {
        let g = linear_graph();
        let c = Cache::plan(&g, |_| true, KeptStore::default());
        let kept: Vec<usize> = (0..g.nodes.len()).filter(|&i| c.keeps(i)).collect();
        assert_eq!(kept.len(), 1, "{kept:?}");
        let node = &g.nodes[kept[0]];
        assert!(matches!(g.nodes[node.inputs[0].0].op, Op::Input { kind: InputKind::Parameter, .. }));
    }

    /// Under mixed precision: the cast of a parameter that runs as a group of its own is kept,
    /// a cast of an activation is not, nor one that runs inside a larger group.
    #[test]
    fn keeps_the_bf16_cast_of_a_parameter_run_alone() {
        let mut b = GraphBuilder::new("g", DType::BF16);
        let x = b.input("x", InputKind::Activation, vec![4, 3]).unwrap();
        let w = b
            .input_typed("w", InputKind::Parameter, graphpp_graph::TensorType::new(DType::F32, vec![5, 3]))
            .unwrap();
        let wb = b.cast(w, DType::BF16).unwrap();
        let wt = b.transpose_last(wb).unwrap();
        let y = b.matmul(x, wt).unwrap();
        let yf = b.cast(y, DType::F32).unwrap();
        b.output("y", yf);
        let g = b.finish().unwrap();
        let plan = Cache::plan(&g, |_| true, KeptStore::default());
        let kept: Vec<usize> = (0..g.nodes.len()).filter(|&i| plan.keeps(i)).collect();
        assert_eq!(kept, [wb.0], "the weight's cast only");
        assert!(
            !Cache::plan(&g, |i| i != wb.0, KeptStore::default()).keeps(wb.0),
            "not when it runs inside a larger group"
        );
    }

    #[test]
    fn copies_follow_the_source_one_per_key() {
        let g = linear_graph();
        let c = Cache::plan(&g, |_| true, KeptStore::default());
        let node = (0..g.nodes.len()).find(|&i| c.keeps(i)).unwrap();
        let w = Tensor::arange(0f32, 15.0, &Device::Cpu).unwrap().reshape((5, 3)).unwrap();
        let first = c.transposed(node, &w, &[1, 0]).unwrap();
        assert!(first.is_contiguous());
        assert_eq!(first.to_vec2::<f32>().unwrap(), w.t().unwrap().to_vec2::<f32>().unwrap());
        // The same source gives the copy made (same storage), a new source a new copy.
        assert_eq!(c.transposed(node, &w, &[1, 0]).unwrap().id(), first.id());
        let w2 = (&w + 1.0).unwrap();
        assert_eq!(c.transposed(node, &w2, &[1, 0]).unwrap().to_vec2::<f32>().unwrap()[0][0], 1.0);
        for k in 0..10 {
            c.transposed(node, &(&w + f64::from(k)).unwrap(), &[1, 0]).unwrap();
        }
        assert_eq!(c.lock().len(), 1);
        // The first source's copy is gone: asking again makes a new one.
        assert_ne!(c.transposed(node, &w, &[1, 0]).unwrap().id(), first.id());
        // A node that is not kept is made each time and keeps nothing.
        let other = (0..g.nodes.len()).find(|&i| !c.keeps(i)).unwrap();
        let made = c.transposed(other, &w, &[1, 0]).unwrap();
        assert_ne!(c.transposed(other, &w, &[1, 0]).unwrap().id(), made.id());
        assert_eq!(c.lock().len(), 1);
        c.clear();
        assert!(c.lock().is_empty());
    }

    /// Two programs of a stage sharing a store (its forward and its backward) keep one value of
    /// a weight's derivation: the second reads the first's.
    #[test]
    fn programs_sharing_a_store_make_a_value_once() {
        let (g, store) = (linear_graph(), KeptStore::default());
        let (fw, bw) = (Cache::plan(&g, |_| true, store.clone()), Cache::plan(&g, |_| true, store));
        let node = (0..g.nodes.len()).find(|&i| fw.keeps(i)).unwrap();
        let w = Tensor::arange(0f32, 15.0, &Device::Cpu).unwrap().reshape((5, 3)).unwrap();
        let made = fw.transposed(node, &w, &[1, 0]).unwrap();
        assert_eq!(bw.transposed(node, &w, &[1, 0]).unwrap().id(), made.id());
        assert_eq!(bw.lock().len(), 1);
    }
}
