//! The rank grid: which rank holds which coordinates, groups, pipeline neighbours, classes.
//!
//! Ranks are numbered in Megatron-LM's default order, tensor-parallel fastest:
//! `rank = tp + TP * (cp + CP * (dp + DP * pp))`. Expert-parallel groups are runs of `ep`
//! consecutive ranks of the combined data- and context-parallel index, and expert
//! data-parallel groups join the ranks that hold the same experts.

use crate::ir::{GroupRole, PeerStage};
use orrery_spec::Job;
use orrery_units::{ClassId, GroupId, RankId};
use serde::Serialize;

/// A rank's position on each parallel axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Coords {
    pub tp: u32,
    pub cp: u32,
    pub dp: u32,
    pub pp: u32,
}

/// Where a group's members sit on the nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Placement {
    pub size: u32,
    pub nodes: u32,
    pub max_per_node: u32,
}

/// The rank grid of a job and all of its communication groups.
#[derive(Debug, Clone, Serialize)]
pub struct Layout {
    pub tp: u32,
    pub cp: u32,
    pub dp: u32,
    pub pp: u32,
    pub ep: u32,
    pub gpus_per_node: u32,
    /// `groups[role][g]` lists the members of group `g` of `role`, in rank order.
    groups: Vec<Vec<Vec<RankId>>>,
    /// `group_of[role][rank]` is the index of the rank's group of `role`.
    group_of: Vec<Vec<u32>>,
}

impl Layout {
    pub fn new(job: &Job) -> Layout {
        let p = job.parallel();
        let to32 = |x: u64| u32::try_from(x).unwrap_or(u32::MAX);
        Layout::from_dims(
            to32(p.tp),
            to32(p.cp),
            to32(p.dp),
            to32(p.pp),
            to32(p.ep),
            to32(job.cluster().gpus_per_node),
        )
    }

    /// A layout from raw dimensions. `ep` must divide `dp * cp` (the spec checks this).
    pub fn from_dims(tp: u32, cp: u32, dp: u32, pp: u32, ep: u32, gpus_per_node: u32) -> Layout {
        let mut layout = Layout {
            tp: tp.max(1),
            cp: cp.max(1),
            dp: dp.max(1),
            pp: pp.max(1),
            ep: ep.max(1),
            gpus_per_node: gpus_per_node.max(1),
            groups: Vec::new(),
            group_of: Vec::new(),
        };
        for role in GroupRole::ALL {
            // Groups are numbered in order of their lowest rank; the map only finds a
            // key's number, so its own order does not matter.
            let mut keys: std::collections::HashMap<(u32, u32, u32, u32), u32> = Default::default();
            let mut groups: Vec<Vec<RankId>> = Vec::new();
            let mut of = Vec::with_capacity(layout.world_size() as usize);
            for r in 0..layout.world_size() {
                let key = layout.group_key(role, layout.coords(RankId(r)));
                let next = groups.len() as u32;
                let g = *keys.entry(key).or_insert(next);
                if g == next {
                    groups.push(Vec::new());
                }
                groups[g as usize].push(RankId(r));
                of.push(g);
            }
            layout.groups.push(groups);
            layout.group_of.push(of);
        }
        layout
    }

    /// The coordinates that stay fixed across a group of `role` (its identity).
    fn group_key(&self, role: GroupRole, c: Coords) -> (u32, u32, u32, u32) {
        let x = c.cp + self.cp * c.dp; // combined data- and context-parallel index
        match role {
            GroupRole::Tp => (u32::MAX, c.cp, c.dp, c.pp),
            GroupRole::Cp => (c.tp, u32::MAX, c.dp, c.pp),
            GroupRole::Dp => (c.tp, c.cp, u32::MAX, c.pp),
            GroupRole::DpCp => (c.tp, u32::MAX, u32::MAX, c.pp),
            GroupRole::Ep => (c.tp, x / self.ep, u32::MAX, c.pp),
            GroupRole::ExpertDp => (c.tp, x % self.ep, u32::MAX, c.pp),
            // The first and last stage pair up; a middle stage is a group of its own.
            GroupRole::Embedding if c.pp == 0 || c.pp + 1 == self.pp => {
                (c.tp, c.cp, c.dp, u32::MAX)
            }
            GroupRole::Embedding => (c.tp, c.cp, c.dp, c.pp),
            GroupRole::World => (u32::MAX, u32::MAX, u32::MAX, u32::MAX),
        }
    }

    pub fn world_size(&self) -> u32 {
        self.tp * self.cp * self.dp * self.pp
    }

    pub fn coords(&self, rank: RankId) -> Coords {
        let r = rank.0;
        Coords {
            tp: r % self.tp,
            cp: (r / self.tp) % self.cp,
            dp: (r / (self.tp * self.cp)) % self.dp,
            pp: r / (self.tp * self.cp * self.dp),
        }
    }

    pub fn rank(&self, c: Coords) -> RankId {
        RankId(c.tp + self.tp * (c.cp + self.cp * (c.dp + self.dp * c.pp)))
    }

    /// Global id of the rank's group of `role` (unique across roles).
    pub fn group_id(&self, rank: RankId, role: GroupRole) -> GroupId {
        let offset: usize = self.groups[..role.index()].iter().map(Vec::len).sum();
        GroupId::from_index(offset + self.group_of[role.index()][rank.index()] as usize)
    }

    /// Members of the rank's group of `role`.
    pub fn group_members(&self, rank: RankId, role: GroupRole) -> &[RankId] {
        let g = self.group_of[role.index()][rank.index()] as usize;
        &self.groups[role.index()][g]
    }

    /// Every group of every role, with its global id, in id order.
    pub fn all_groups(&self) -> impl Iterator<Item = (GroupId, GroupRole, &[RankId])> {
        let mut next = 0usize;
        GroupRole::ALL.into_iter().flat_map(move |role| {
            let start = next;
            next += self.groups[role.index()].len();
            self.groups[role.index()]
                .iter()
                .enumerate()
                .map(move |(i, m)| (GroupId::from_index(start + i), role, m.as_slice()))
        })
    }

    /// Size of the groups of `role` (all groups of a role have the same size, except that
    /// embedding groups pair the first and last stage and are groups of one elsewhere: this
    /// returns the pair's size, the one that issues collectives).
    pub fn group_size(&self, role: GroupRole) -> u32 {
        match role {
            GroupRole::Tp => self.tp,
            GroupRole::Cp => self.cp,
            GroupRole::Dp => self.dp,
            GroupRole::DpCp => self.dp * self.cp,
            GroupRole::Ep => self.ep,
            GroupRole::ExpertDp => self.dp * self.cp / self.ep,
            GroupRole::Embedding => self.pp.min(2),
            GroupRole::World => self.world_size(),
        }
    }

    /// How a set of ranks spreads over nodes.
    ///
    /// Every group lists its members in rank order, so their nodes never decrease and a node's
    /// members are one run: counted in one pass with no allocation (emulation reads every
    /// group's placement, so this runs over the whole world). Members in any other order are
    /// counted per node.
    pub fn placement_of(&self, members: &[RankId]) -> Placement {
        let node = |m: &RankId| m.0 / self.gpus_per_node;
        let size = members.len() as u32;
        if members.windows(2).all(|w| node(&w[0]) <= node(&w[1])) {
            let (mut nodes, mut max_per_node, mut run) = (0, 0, 0);
            let mut last = None;
            for m in members {
                let n = node(m);
                if last == Some(n) {
                    run += 1;
                } else {
                    nodes += 1;
                    run = 1;
                    last = Some(n);
                }
                max_per_node = max_per_node.max(run);
            }
            return Placement {
                size,
                nodes,
                max_per_node,
            };
        }
        let mut per_node: std::collections::BTreeMap<u32, u32> = Default::default();
        for m in members {
            *per_node.entry(node(m)).or_default() += 1;
        }
        Placement {
            size,
            nodes: per_node.len() as u32,
            max_per_node: per_node.values().copied().max().unwrap_or(0),
        }
    }

    /// Placement of the rank's group of `role`.
    pub fn placement(&self, rank: RankId, role: GroupRole) -> Placement {
        self.placement_of(self.group_members(rank, role))
    }

    /// The rank's pipeline neighbour.
    pub fn peer(&self, rank: RankId, peer: PeerStage) -> RankId {
        let mut c = self.coords(rank);
        c.pp = match peer {
            PeerStage::Prev => (c.pp + self.pp - 1) % self.pp,
            PeerStage::Next => (c.pp + 1) % self.pp,
        };
        self.rank(c)
    }

    /// Whether two ranks share a node.
    pub fn same_node(&self, a: RankId, b: RankId) -> bool {
        a.0 / self.gpus_per_node == b.0 / self.gpus_per_node
    }

    /// Number of symmetry classes: one per pipeline stage.
    pub fn num_classes(&self) -> u32 {
        self.pp
    }

    /// The symmetry class of a rank: its pipeline stage. All ranks of a stage run the same
    /// ops in the same order; only the concrete groups and peers differ.
    pub fn class_of(&self, rank: RankId) -> ClassId {
        ClassId(self.coords(rank).pp)
    }

    /// The representative rank of a class (coordinates zero except the stage).
    pub fn representative(&self, class: ClassId) -> RankId {
        self.rank(Coords {
            tp: 0,
            cp: 0,
            dp: 0,
            pp: class.0,
        })
    }

    /// Whether every group of each role has the same placement as the representative's, in
    /// which case class replay is exact. Irregular layouts (a TP*CP block straddling node
    /// boundaries, say) are replayed with the representative's placement, an approximation.
    pub fn is_regular(&self) -> bool {
        GroupRole::ALL.iter().all(|&role| {
            let first = self.placement(RankId(0), role);
            // Embedding groups of one (middle stages) issue nothing and do not count.
            self.groups[role.index()]
                .iter()
                .filter(|m| m.len() as u32 == first.size)
                .all(|m| self.placement_of(m) == first)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_rank_order() {
        let l = Layout::from_dims(2, 1, 2, 2, 1, 8);
        assert_eq!(l.world_size(), 8);
        assert_eq!(
            l.coords(RankId(5)),
            Coords {
                tp: 1,
                cp: 0,
                dp: 0,
                pp: 1
            }
        );
        assert_eq!(
            l.group_members(RankId(5), GroupRole::Tp),
            &[RankId(4), RankId(5)]
        );
        assert_eq!(
            l.group_members(RankId(5), GroupRole::Dp),
            &[RankId(5), RankId(7)]
        );
        assert_eq!(l.peer(RankId(1), PeerStage::Next), RankId(5));
        assert_eq!(l.peer(RankId(1), PeerStage::Prev), RankId(5));
        for r in 0..8 {
            assert_eq!(l.rank(l.coords(RankId(r))), RankId(r));
        }
    }

    #[test]
    fn expert_groups_partition_the_data_parallel_ranks() {
        let l = Layout::from_dims(1, 2, 4, 1, 4, 8);
        // x = cp + 2*dp; EP groups are runs of 4 x values.
        assert_eq!(l.group_members(RankId(0), GroupRole::Ep).len(), 4);
        assert_eq!(l.group_members(RankId(0), GroupRole::ExpertDp).len(), 2);
        let ep0 = l.group_members(RankId(0), GroupRole::Ep);
        let edp0 = l.group_members(RankId(0), GroupRole::ExpertDp);
        // An EP group and an expert-DP group meet in exactly one rank.
        assert_eq!(ep0.iter().filter(|r| edp0.contains(r)).count(), 1);
    }

    #[test]
    fn placement_counts_nodes() {
        let l = Layout::from_dims(8, 1, 4, 1, 1, 8);
        let dp = l.placement(RankId(3), GroupRole::Dp);
        assert_eq!(
            dp,
            Placement {
                size: 4,
                nodes: 4,
                max_per_node: 1
            }
        );
        let tp = l.placement(RankId(3), GroupRole::Tp);
        assert_eq!(
            tp,
            Placement {
                size: 8,
                nodes: 1,
                max_per_node: 8
            }
        );
        assert!(l.is_regular());
        // TP 3 on nodes of 8 straddles node boundaries.
        assert!(!Layout::from_dims(3, 1, 4, 1, 1, 8).is_regular());
    }

    #[test]
    fn group_ids_are_unique_and_dense() {
        let l = Layout::from_dims(2, 2, 2, 2, 2, 4);
        let ids: Vec<GroupId> = l.all_groups().map(|(g, _, _)| g).collect();
        for (i, g) in ids.iter().enumerate() {
            assert_eq!(g.index(), i);
        }
        for r in 0..l.world_size() {
            for role in GroupRole::ALL {
                let g = l.group_id(RankId(r), role);
                let (_, grole, members) = l.all_groups().nth(g.index()).unwrap();
                assert_eq!(grole, role);
                assert!(members.contains(&RankId(r)));
            }
        }
    }

    /// The placement as it was first written: a count per node.
    fn placement_by_node_counts(gpus_per_node: u32, members: &[RankId]) -> Placement {
        let mut per_node: std::collections::BTreeMap<u32, u32> = Default::default();
        for m in members {
            *per_node.entry(m.0 / gpus_per_node).or_default() += 1;
        }
        Placement {
            size: members.len() as u32,
            nodes: per_node.len() as u32,
            max_per_node: per_node.values().copied().max().unwrap_or(0),
        }
    }

    proptest::proptest! {
        /// The one-pass count of sorted members, and the per-node count of unsorted ones,
        /// agree with counting per node.
        #[test]
        fn placements_are_counts_per_node(
            gpus_per_node in 1u32..9,
            mut ranks in proptest::collection::vec(0u32..64, 0..24),
            sort in proptest::bool::ANY,
        ) {
            let layout = Layout::from_dims(1, 1, 1, 1, 1, gpus_per_node);
            if sort {
                ranks.sort_unstable();
            }
            let members: Vec<RankId> = ranks.into_iter().map(RankId).collect();
            proptest::prop_assert_eq!(
                layout.placement_of(&members),
                placement_by_node_counts(gpus_per_node, &members)
            );
        }
    }
}
