//! The device mesh: which world ranks form each pipeline, data-parallel, expert-parallel and
//! tensor-parallel group, from the degrees pp (pipeline ranks), dp (pipeline replicas) and tp
//! (tensor-parallel ranks per pipeline position) (docs/ARCHITECTURE.md, "Runtime": Mesh).
//!
//! # Rank order
//!
//! `rank = (dp_index · pp + pp_index) · tp + tp_index`: the tp index varies fastest, then the pp
//! index, so a tensor-parallel group is a block of tp consecutive ranks, each pipeline replica a
//! block of `pp · tp` consecutive ranks, and a data-parallel group is strided. With pp = 2,
//! dp = 2 (tp = 1): pipelines `[0,1]` and `[2,3]`, data-parallel groups `[0,2]` and `[1,3]`; with
//! pp = 2, tp = 2 (dp = 1): tp groups `[0,1]` and `[2,3]`, pipelines `[0,2]` and `[1,3]`.
//!
//! This is Megatron-LM's order `"tp-cp-pp-ep-dp"` (one of its two tested orders; its default
//! `"tp-cp-ep-dp-pp"` puts pp slowest) and TorchTitan's mesh with tp innermost: (1) the tensor-
//! parallel all-reduces, several per layer and on the critical path, stay on the fastest links
//! (`mpirun` fills hosts with consecutive ranks); (2) with tp = dp = 1 the world rank *is* the
//! pipeline rank, so every schedule keeps its rank numbering; (3) a replica's per-microbatch
//! activation and gradient messages (latency-bound, many per step) stay inside a host while the
//! data-parallel gradient reduction (one per stage per step, started early and overlapped with
//! compute) crosses hosts. Changing the order means changing [`Mesh::rank_of`] and
//! [`Mesh::coords`] only.
//!
//! # Expert parallelism
//!
//! Expert parallelism (ep, [`Mesh::with_ep`]) splits each data-parallel group into blocks of ep
//! consecutive replicas, as DeepSeek-V3 and Megatron-LM's expert-data-parallel layout do: the
//! replicas of one block share a layer's routed experts (replica `d` holds block `d mod ep` of
//! them) and exchange tokens by all-to-all (group `ep`); the replicas holding the same experts
//! (`d ≡ d' mod ep`, dp / ep of them) reduce those experts' gradients (group `edp`). With
//! pp = 2, dp = 4, ep = 2: rank 0 (dp 0) has ep group `[0, 2]` and edp group `[0, 4]`.
//!
//! # Tensor parallelism
//!
//! The tp ranks of one (replica, pipeline position) split that position's matrices (Megatron's
//! column- and row-parallel projections, [`Mesh::with_tp`]): they read the same microbatches and
//! run the same schedule. Every other group is taken among the ranks of one tp index, so each tp
//! index sees today's pp × dp mesh.
//!
//! # Graph groups
//!
//! A graph's collectives name a [`CommGroup`] (mesh axis + size); [`Mesh::resolve`] maps it, for one
//! rank, to the world ranks it runs over: `pp` → the rank's pipeline, `dp` and `fsdp` → its
//! data-parallel group (FSDP shards over the replicas), `ep` and `edp` → its expert-parallel
//! and expert-data-parallel groups, `tp` → its tensor-parallel group, `world` → every rank.

use graphpp_graph::CommGroup;
pub use graphpp_graph::MeshAxis;

use crate::Group;

/// Bad mesh degrees or a rank outside the mesh.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    /// A degree of 0.
    #[error("mesh degree {axis} must be at least 1, got 0")]
    ZeroDegree {
        /// `pp`, `dp` or `tp`.
        axis: MeshAxis,
    },
    /// pp × dp × tp overflows.
    #[error("mesh pp = {pp} × dp = {dp} × tp = {tp} is too large")]
    TooLarge {
        /// Pipeline degree.
        pp: usize,
        /// Data-parallel degree.
        dp: usize,
        /// Tensor-parallel degree.
        tp: usize,
    },
    /// An expert-parallel degree that does not divide dp.
    #[error("expert-parallel degree ep = {ep} must divide the data-parallel degree dp = {dp} (ep groups are made of data-parallel replicas)")]
    EpNotDividing {
        /// Expert-parallel degree.
        ep: usize,
        /// Data-parallel degree.
        dp: usize,
    },
    /// The world size is not pp × dp × tp.
    #[error("world size {world} does not equal pp × dp × tp = {pp} × {dp} × {tp} = {}", pp.saturating_mul(*dp).saturating_mul(*tp))]
    WorldMismatch {
        /// Number of ranks present.
        world: usize,
        /// Pipeline degree.
        pp: usize,
        /// Data-parallel degree.
        dp: usize,
        /// Tensor-parallel degree.
        tp: usize,
    },
    /// A rank outside `0..world`.
    #[error("rank {rank} is outside the mesh (world size {world})")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// pp × dp × tp.
        world: usize,
    },
    /// A coordinate beyond its degree.
    #[error("{axis} index {index} is outside the mesh ({axis} = {degree})")]
    CoordOutOfRange {
        /// The axis.
        axis: MeshAxis,
        /// The index given.
        index: usize,
        /// The axis's degree.
        degree: usize,
    },
    /// A graph group whose size differs from the mesh group it names.
    #[error("graph group `{axis}` has size {graph_size} but the mesh's {axis} group of rank {rank} is {mesh_group}")]
    GroupSize {
        /// The graph group's mesh axis.
        axis: MeshAxis,
        /// Its size in the graph.
        graph_size: usize,
        /// The rank resolving it.
        rank: usize,
        /// The mesh group, as `name[ranks]`.
        mesh_group: String,
    },
}

/// A rank's position in the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Coords {
    /// Which pipeline replica (`0..dp`).
    pub dp: usize,
    /// Which rank of its pipeline (`0..pp`).
    pub pp: usize,
    /// Which rank of its tensor-parallel group (`0..tp`).
    pub tp: usize,
}

impl Coords {
    /// Pipeline position `pp` of replica `dp`, tensor-parallel index 0.
    pub fn at(dp: usize, pp: usize) -> Coords {
        Coords { dp, pp, tp: 0 }
    }
}

/// pp pipeline ranks × dp replicas × tp tensor-parallel ranks; world size = pp · dp · tp; the
/// replicas form expert-parallel groups of ep. See the module doc for the rank order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Mesh {
    pp: usize,
    dp: usize,
    ep: usize,
    tp: usize,
}

impl Mesh {
    /// The mesh of `pp` pipeline ranks and `dp` replicas.
    ///
    /// # Errors
    /// [`MeshError::ZeroDegree`]; [`MeshError::TooLarge`] when pp · dp overflows.
    pub fn new(pp: usize, dp: usize) -> Result<Mesh, MeshError> {
        for (axis, d) in [(MeshAxis::Pipeline, pp), (MeshAxis::DataParallel, dp)] {
            if d == 0 {
                return Err(MeshError::ZeroDegree { axis });
            }
        }
        pp.checked_mul(dp).ok_or(MeshError::TooLarge { pp, dp, tp: 1 })?;
        Ok(Mesh { pp, dp, ep: 1, tp: 1 })
    }

    /// This mesh with tensor-parallel degree `tp` (see the module doc).
    ///
    /// # Errors
    /// [`MeshError::ZeroDegree`]; [`MeshError::TooLarge`] when pp · dp · tp overflows.
    pub fn with_tp(self, tp: usize) -> Result<Mesh, MeshError> {
        if tp == 0 {
            return Err(MeshError::ZeroDegree { axis: MeshAxis::Tensor });
        }
        let (pp, dp) = (self.pp, self.dp);
        (pp * dp).checked_mul(tp).ok_or(MeshError::TooLarge { pp, dp, tp })?;
        Ok(Mesh { tp, ..self })
    }

    /// Tensor-parallel degree (1: none).
    pub fn tp(&self) -> usize {
        self.tp
    }

    /// `rank`'s position in its tensor-parallel group: which shard of its stages' matrices it
    /// holds.
    ///
    /// # Errors
    /// [`MeshError::RankOutOfRange`].
    pub fn tp_index(&self, rank: usize) -> Result<usize, MeshError> {
        Ok(self.coords(rank)?.tp)
    }

    /// This mesh with expert-parallel degree `ep` (see the module doc).
    ///
    /// # Errors
    /// [`MeshError::EpNotDividing`] when ep is 0 or does not divide dp.
    pub fn with_ep(self, ep: usize) -> Result<Mesh, MeshError> {
        if ep == 0 || !self.dp.is_multiple_of(ep) {
            return Err(MeshError::EpNotDividing { ep, dp: self.dp });
        }
        Ok(Mesh { ep, ..self })
    }

    /// Expert-parallel degree (1: none).
    pub fn ep(&self) -> usize {
        self.ep
    }

    /// `rank`'s position in its expert-parallel group (`dp index mod ep`): which block of the
    /// routed experts it holds.
    ///
    /// # Errors
    /// [`MeshError::RankOutOfRange`].
    pub fn ep_index(&self, rank: usize) -> Result<usize, MeshError> {
        Ok(self.coords(rank)?.dp % self.ep)
    }

    /// The replicas `rank` exchanges tokens with (`ep[…]`: its block of ep consecutive dp
    /// indices, same pp index), in dp order.
    ///
    /// # Errors
    /// [`MeshError::RankOutOfRange`].
    pub fn expert_parallel_group(&self, rank: usize) -> Result<Group, MeshError> {
        self.group(MeshAxis::Expert, rank)
    }

    /// The replicas holding the same routed experts as `rank` (`edp[…]`: dp indices ≡ its own
    /// mod ep, same pp index): its experts' gradients are reduced over them.
    ///
    /// # Errors
    /// [`MeshError::RankOutOfRange`].
    pub fn expert_data_parallel_group(&self, rank: usize) -> Result<Group, MeshError> {
        self.group(MeshAxis::ExpertDataParallel, rank)
    }

    /// The mesh of `pp` × `dp` × `tp` for a run of `world` ranks (e.g. `mpirun -n world`).
    ///
    /// # Errors
    /// As [`Mesh::new`] and [`Mesh::with_tp`]; [`MeshError::WorldMismatch`] when
    /// `world ≠ pp · dp · tp`.
    pub fn for_world(world: usize, pp: usize, dp: usize, tp: usize) -> Result<Mesh, MeshError> {
        let m = Mesh::new(pp, dp)?.with_tp(tp)?;
        if m.world() != world {
            return Err(MeshError::WorldMismatch { world, pp, dp, tp });
        }
        Ok(m)
    }

    /// Pipeline degree.
    pub fn pp(&self) -> usize {
        self.pp
    }

    /// Data-parallel degree.
    pub fn dp(&self) -> usize {
        self.dp
    }

    /// Number of ranks, pp · dp · tp.
    pub fn world(&self) -> usize {
        self.pp * self.dp * self.tp
    }

    /// The world rank at `c`: `(c.dp · pp + c.pp) · tp + c.tp`.
    ///
    /// # Errors
    /// [`MeshError::CoordOutOfRange`].
    pub fn rank_of(&self, c: Coords) -> Result<usize, MeshError> {
        for (axis, index, degree) in [
            (MeshAxis::Pipeline, c.pp, self.pp),
            (MeshAxis::DataParallel, c.dp, self.dp),
            (MeshAxis::Tensor, c.tp, self.tp),
        ] {
            if index >= degree {
                return Err(MeshError::CoordOutOfRange { axis, index, degree });
            }
        }
        Ok((c.dp * self.pp + c.pp) * self.tp + c.tp)
    }

    /// The coordinates of world rank `rank`.
    ///
    /// # Errors
    /// [`MeshError::RankOutOfRange`].
    pub fn coords(&self, rank: usize) -> Result<Coords, MeshError> {
        if rank >= self.world() {
            return Err(MeshError::RankOutOfRange { rank, world: self.world() });
        }
        let position = rank / self.tp;
        Ok(Coords { dp: position / self.pp, pp: position % self.pp, tp: rank % self.tp })
    }

    /// The group along `axis` through `rank` (see the module doc), named after the axis, members
    /// in index order along the axis (group rank = the pp, dp or tp index, or the world rank).
    ///
    /// # Errors
    /// [`MeshError::RankOutOfRange`].
    pub fn group(&self, axis: MeshAxis, rank: usize) -> Result<Group, MeshError> {
        let c = self.coords(rank)?;
        let at = |dp: usize, pp: usize, tp: usize| (dp * self.pp + pp) * self.tp + tp;
        let replica = |d: usize| at(d, c.pp, c.tp);
        let ranks: Vec<usize> = match axis {
            MeshAxis::Pipeline => (0..self.pp).map(|p| at(c.dp, p, c.tp)).collect(),
            MeshAxis::DataParallel | MeshAxis::Fsdp => (0..self.dp).map(replica).collect(),
            MeshAxis::Expert => {
                let first = c.dp - c.dp % self.ep;
                (first..first + self.ep).map(replica).collect()
            }
            MeshAxis::ExpertDataParallel => (c.dp % self.ep..self.dp).step_by(self.ep).map(replica).collect(),
            MeshAxis::Tensor => (0..self.tp).map(|t| at(c.dp, c.pp, t)).collect(),
            MeshAxis::World => (0..self.world()).collect(),
        };
        // Non-empty and duplicate-free by construction (degrees ≥ 1, distinct indices).
        Ok(Group::checked_by_caller(axis.name(), ranks))
    }

    /// The pipeline `rank` belongs to: the ranks of its replica and tp index, in pipeline order
    /// (`pp[d·pp, …, d·pp + pp − 1]` when tp = 1).
    ///
    /// # Errors
    /// [`MeshError::RankOutOfRange`].
    pub fn pipeline_group(&self, rank: usize) -> Result<Group, MeshError> {
        self.group(MeshAxis::Pipeline, rank)
    }

    /// The tensor-parallel group of `rank`: `tp[…]`, the tp consecutive ranks of its pipeline
    /// position.
    ///
    /// # Errors
    /// [`MeshError::RankOutOfRange`].
    pub fn tensor_parallel_group(&self, rank: usize) -> Result<Group, MeshError> {
        self.group(MeshAxis::Tensor, rank)
    }

    /// The ranks holding the same pipeline position (and tp index) as `rank` in every replica:
    /// `dp[p, p + pp, …]` when tp = 1 (gradients are reduced over it).
    ///
    /// # Errors
    /// [`MeshError::RankOutOfRange`].
    pub fn data_parallel_group(&self, rank: usize) -> Result<Group, MeshError> {
        self.group(MeshAxis::DataParallel, rank)
    }
}

impl Mesh {
    /// The world ranks that `rank` runs the graph group `group`'s collectives over (see the
    /// module doc), as a [`Group`] named after the graph group's axis — so collectives of
    /// different axes (`dp`, `fsdp`) keep separate call sequences even over the same ranks.
    ///
    /// # Errors
    /// [`MeshError::RankOutOfRange`]; [`MeshError::GroupSize`] when the graph was built for
    /// another degree.
    pub fn resolve(&self, group: &CommGroup, rank: usize) -> Result<Group, MeshError> {
        let g = self.group(group.mesh_axis, rank)?;
        if g.size() != group.size {
            return Err(MeshError::GroupSize {
                axis: group.mesh_axis,
                graph_size: group.size,
                rank,
                mesh_group: g.to_string(),
            });
        }
        Ok(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranks(g: Result<Group, MeshError>) -> (String, Vec<usize>) {
        let g = g.unwrap();
        (g.name().to_string(), g.ranks().to_vec())
    }

    #[test]
    fn pp2_dp2_groups() {
        let m = Mesh::for_world(4, 2, 2, 1).unwrap();
        let pp = [vec![0, 1], vec![0, 1], vec![2, 3], vec![2, 3]];
        let dp = [vec![0, 2], vec![1, 3], vec![0, 2], vec![1, 3]];
        for r in 0..4 {
            assert_eq!(ranks(m.pipeline_group(r)), ("pp".into(), pp[r].clone()), "rank {r}");
            assert_eq!(ranks(m.data_parallel_group(r)), ("dp".into(), dp[r].clone()), "rank {r}");
        }
        assert_eq!(m.coords(3).unwrap(), Coords::at(1, 1));
        assert_eq!(m.coords(2).unwrap(), Coords::at(1, 0));
        assert_eq!(m.rank_of(Coords::at(1, 0)).unwrap(), 2);
    }

    #[test]
    fn pp4_dp1_groups() {
        let m = Mesh::new(4, 1).unwrap();
        for r in 0..4 {
            assert_eq!(ranks(m.pipeline_group(r)).1, vec![0, 1, 2, 3]);
            assert_eq!(ranks(m.data_parallel_group(r)).1, vec![r]);
            assert_eq!(m.coords(r).unwrap(), Coords::at(0, r));
        }
    }

    #[test]
    fn pp2_dp3_round_trips_coords() {
        let m = Mesh::new(2, 3).unwrap();
        assert_eq!(ranks(m.data_parallel_group(5)).1, vec![1, 3, 5]);
        assert_eq!(ranks(m.pipeline_group(5)).1, vec![4, 5]);
        for r in 0..6 {
            assert_eq!(m.rank_of(m.coords(r).unwrap()).unwrap(), r);
        }
    }

    #[test]
    fn graph_groups_resolve_to_world_ranks() {
        let m = Mesh::new(2, 3).unwrap();
        let cg = |name: &str, size| CommGroup::new(name.parse().unwrap(), size);
        assert_eq!(ranks(m.resolve(&cg("dp", 3), 3)), ("dp".into(), vec![1, 3, 5]));
        assert_eq!(ranks(m.resolve(&cg("fsdp", 3), 4)), ("fsdp".into(), vec![0, 2, 4]));
        assert_eq!(ranks(m.resolve(&cg("pp", 2), 3)), ("pp".into(), vec![2, 3]));
        assert_eq!(ranks(m.resolve(&cg("world", 6), 0)).1, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!("cp".parse::<MeshAxis>(), Err(graphpp_graph::UnknownMeshAxis("cp".into())));
        assert_eq!(m.resolve(&cg("world", 6), 6), Err(MeshError::RankOutOfRange { rank: 6, world: 6 }));
        let e = m.resolve(&cg("dp", 2), 1).unwrap_err();
        assert_eq!(
            e,
            MeshError::GroupSize {
                axis: MeshAxis::DataParallel,
                graph_size: 2,
                rank: 1,
                mesh_group: "dp[1,3,5]".into()
            }
        );
        assert_eq!(
            e.to_string(),
            "graph group `dp` has size 2 but the mesh's dp group of rank 1 is dp[1,3,5]"
        );
    }

    /// pp = 2, dp = 4, ep = 2: ep groups are pairs of consecutive replicas, edp groups the
    /// replicas two apart.
    #[test]
    fn expert_groups_split_the_replicas() {
        let m = Mesh::new(2, 4).unwrap().with_ep(2).unwrap();
        let cg = |name: &str, size| CommGroup::new(name.parse().unwrap(), size);
        // Rank 5 = dp 2, pp 1.
        assert_eq!(ranks(m.expert_parallel_group(5)), ("ep".into(), vec![5, 7]));
        assert_eq!(ranks(m.expert_data_parallel_group(5)), ("edp".into(), vec![1, 5]));
        assert_eq!(ranks(m.resolve(&cg("ep", 2), 0)).1, vec![0, 2]);
        assert_eq!(ranks(m.resolve(&cg("edp", 2), 6)).1, vec![2, 6]);
        assert_eq!((m.ep_index(5).unwrap(), m.ep_index(7).unwrap(), m.ep_index(3).unwrap()), (0, 1, 1));
        // ep = dp: one expert-parallel group per stage, no expert replicas.
        let m = Mesh::new(2, 2).unwrap().with_ep(2).unwrap();
        assert_eq!(ranks(m.expert_parallel_group(3)).1, vec![1, 3]);
        assert_eq!(ranks(m.expert_data_parallel_group(3)).1, vec![3]);
        assert_eq!(Mesh::new(2, 4).unwrap().with_ep(3), Err(MeshError::EpNotDividing { ep: 3, dp: 4 }));
        assert_eq!(Mesh::new(2, 4).unwrap().with_ep(0), Err(MeshError::EpNotDividing { ep: 0, dp: 4 }));
        // Without ep, every replica holds every expert: ep groups of one.
        assert_eq!(ranks(Mesh::new(2, 2).unwrap().expert_parallel_group(2)).1, vec![2]);
    }

    #[test]
    fn bad_degrees_and_ranks_are_typed_errors() {
        assert_eq!(Mesh::new(0, 2), Err(MeshError::ZeroDegree { axis: MeshAxis::Pipeline }));
        assert_eq!(Mesh::new(2, 0), Err(MeshError::ZeroDegree { axis: MeshAxis::DataParallel }));
        assert_eq!(
            Mesh::for_world(3, 2, 2, 1),
            Err(MeshError::WorldMismatch { world: 3, pp: 2, dp: 2, tp: 1 })
        );
        assert_eq!(Mesh::new(usize::MAX, 2), Err(MeshError::TooLarge { pp: usize::MAX, dp: 2, tp: 1 }));
        assert_eq!(
            Mesh::new(2, 2).unwrap().with_tp(0),
            Err(MeshError::ZeroDegree { axis: MeshAxis::Tensor })
        );
        let m = Mesh::new(2, 2).unwrap();
        assert_eq!(m.pipeline_group(4), Err(MeshError::RankOutOfRange { rank: 4, world: 4 }));
        assert_eq!(
            m.rank_of(Coords::at(2, 0)),
            Err(MeshError::CoordOutOfRange { axis: MeshAxis::DataParallel, index: 2, degree: 2 })
        );
        assert_eq!(
            Mesh::for_world(3, 2, 2, 1).unwrap_err().to_string(),
            "world size 3 does not equal pp × dp × tp = 2 × 2 × 1 = 4"
        );
    }

    /// pp = 2, dp = 2, tp = 2: tp groups are pairs of consecutive ranks, every other group is
    /// taken within one tp index.
    #[test]
    fn tensor_parallel_groups_are_innermost() {
        let m = Mesh::for_world(8, 2, 2, 2).unwrap();
        // Rank 5 = dp 1, pp 0, tp 1.
        assert_eq!(m.coords(5).unwrap(), Coords { dp: 1, pp: 0, tp: 1 });
        assert_eq!(ranks(m.tensor_parallel_group(5)), ("tp".into(), vec![4, 5]));
        assert_eq!(ranks(m.pipeline_group(5)).1, vec![5, 7]);
        assert_eq!(ranks(m.data_parallel_group(5)).1, vec![1, 5]);
        let cg = |name: &str, size| CommGroup::new(name.parse().unwrap(), size);
        assert_eq!(ranks(m.resolve(&cg("tp", 2), 2)).1, vec![2, 3]);
        for r in 0..8 {
            assert_eq!(m.rank_of(m.coords(r).unwrap()).unwrap(), r);
            assert_eq!(m.tp_index(r).unwrap(), r % 2);
        }
        assert_eq!(
            Mesh::for_world(4, 2, 1, 4).unwrap_err().to_string(),
            "world size 4 does not equal pp × dp × tp = 2 × 1 × 4 = 8"
        );
    }
}
