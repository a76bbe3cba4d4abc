//! Partitions maintained incrementally (issue 4, mechanism 1).
//!
//! A *partition* is a connected component of the bipartite graph of member flows and the
//! directed links they use. [`Partitions`] keeps them from one fast-forward sample to the
//! next instead of recomputing them from every member's path at each sample:
//!
//! - a flow that **joins** takes the partitions its links already belong to and merges
//!   them (the smaller ones relabelled into the largest, so between splits a link
//!   changes partition O(log n) times), claiming its free links;
//! - a flow that **leaves** only marks its own partition for a *split check*: at the next
//!   [`Partitions::update`] that partition alone is recomputed from its remaining
//!   members (a union-find over their links), and comes back as one or more partitions;
//!   no other partition is looked at.
//!
//! The engine reads partitions only at its samples, so it hands the member set of each
//! sample to [`Partitions::update`], which applies the leaves, the split checks and then
//! the joins. The cost of a sample is O(members) to find who joined and who left, plus
//! O(path length) per join or leave, plus the size of the partitions that lost a member,
//! where recomputing cost O(members times path length) every sample.
//!
//! The order partitions are listed in is the recomputation's: by their smallest link,
//! each one's flows in increasing order, so the engine's decisions (and its output) do not
//! depend on which way the partitions were found. The property test below checks the
//! partitions against a recomputation after every step of random member histories, and
//! every debug run of the engine checks them against its old per-sample recomputation.
//!
//! What this does not do: give each partition its own event queue. A partition's events
//! stay in the engine's one calendar queue, and a jump reschedules them; see the
//! `accel` module's essay for why.

const NONE: u32 = u32::MAX;

/// One partition: its member flows and the links they use.
#[derive(Debug, Default)]
pub(super) struct Part {
    /// Member flows, in increasing order after [`Partitions::listing`]. Inside
    /// [`Partitions::update`] it may still list flows that just left (their `flow_part` no
    /// longer names it) until its split check drops them, which comes before any join.
    flows: Vec<u32>,
    /// The links of the member flows, each once.
    links: Vec<u32>,
    /// The smallest link: the partition's place in the listing.
    min_link: u32,
    /// `flows` is in increasing order.
    sorted: bool,
    /// A member left since the last update: split check due.
    dirty: bool,
    alive: bool,
}

/// The partitions of the member flows (see the module essay).
#[derive(Debug)]
pub(super) struct Partitions {
    /// The partition each link belongs to, or `NONE` when no member uses it.
    link_part: Vec<u32>,
    /// The partition of each member flow, `NONE` for non-members and for members without
    /// links (they touch nothing and belong to no partition).
    flow_part: Vec<u32>,
    member: Vec<bool>,
    /// The members at the last update.
    members: Vec<u32>,
    parts: Vec<Part>,
    free: Vec<u32>,
    /// Partitions waiting for a split check.
    dirty: Vec<u32>,
    /// Scratch: a union-find over links for split checks, reset after each use.
    uf: Vec<u32>,
    /// Scratch: membership in the set handed to the current update.
    in_now: Vec<bool>,
}

impl Partitions {
    pub fn new(flows: usize, links: usize) -> Partitions {
        Partitions {
            link_part: vec![NONE; links],
            flow_part: vec![NONE; flows],
            member: vec![false; flows],
            members: Vec::new(),
            parts: Vec::new(),
            free: Vec::new(),
            dirty: Vec::new(),
            uf: (0..links as u32).collect(),
            in_now: vec![false; flows],
        }
    }

    /// Makes `members` (any order; a flow listed twice counts once) the member set: flows
    /// no longer listed leave, their partitions are split-checked, and new flows join.
    /// `links_of(f)` lists flow `f`'s links; a flow's links must not change while it is a
    /// member.
    pub fn update<I>(&mut self, members: &[u32], links_of: impl Fn(u32) -> I)
    where
        I: Iterator<Item = u32>,
    {
        for &f in members {
            self.in_now[f as usize] = true;
        }
        for k in 0..self.members.len() {
            let f = self.members[k];
            if !self.in_now[f as usize] {
                self.leave(f);
            }
        }
        while let Some(id) = self.dirty.pop() {
            self.split(id, &links_of);
        }
        for &f in members {
            self.in_now[f as usize] = false;
            if !self.member[f as usize] {
                self.join(f, links_of(f));
            }
        }
        self.members.clear();
        self.members.extend_from_slice(members);
    }

    /// The live partitions by increasing smallest link, each one's flows sorted.
    pub fn listing(&mut self) -> Vec<u32> {
        let mut order: Vec<(u32, u32)> = Vec::new();
        for (id, part) in self.parts.iter_mut().enumerate() {
            if !part.alive {
                continue;
            }
            if !part.sorted {
                part.flows.sort_unstable();
                part.sorted = true;
            }
            order.push((part.min_link, id as u32));
        }
        order.sort_unstable();
        order.into_iter().map(|(_, id)| id).collect()
    }

    /// The member flows of partition `id` (sorted after [`Partitions::listing`]).
    pub fn flows(&self, id: u32) -> &[u32] {
        &self.parts[id as usize].flows
    }

    /// The links of partition `id`.
    pub fn links(&self, id: u32) -> &[u32] {
        &self.parts[id as usize].links
    }

    /// The partition member flow `f` belongs to, if it is a member.
    pub fn of_flow(&self, f: u32) -> Option<u32> {
        let id = *self.flow_part.get(f as usize)?;
        (id != NONE).then_some(id)
    }

    /// The partition link `l` belongs to, if a member uses it.
    pub fn of_link(&self, l: u32) -> Option<u32> {
        let id = self.link_part[l as usize];
        (id != NONE).then_some(id)
    }

    /// One past the largest partition id in use (ids index per-partition arrays).
    pub fn id_bound(&self) -> usize {
        self.parts.len()
    }

    fn new_part(&mut self) -> u32 {
        let part = Part {
            alive: true,
            sorted: true,
            min_link: NONE,
            ..Part::default()
        };
        match self.free.pop() {
            Some(id) => {
                self.parts[id as usize] = part;
                id
            }
            None => {
                self.parts.push(part);
                (self.parts.len() - 1) as u32
            }
        }
    }

    fn free_part(&mut self, id: u32) {
        let part = &mut self.parts[id as usize];
        part.alive = false;
        part.flows = Vec::new();
        part.links = Vec::new();
        self.free.push(id);
    }

    fn leave(&mut self, f: u32) {
        self.member[f as usize] = false;
        let id = std::mem::replace(&mut self.flow_part[f as usize], NONE);
        if id == NONE {
            return;
        }
        let part = &mut self.parts[id as usize];
        if !part.dirty {
            part.dirty = true;
            self.dirty.push(id);
        }
    }

    /// Flow `f` joins: the partitions of its links merge into the largest, which also
    /// takes its free links.
    fn join(&mut self, f: u32, links: impl Iterator<Item = u32>) {
        self.member[f as usize] = true;
        let links: Vec<u32> = links.collect();
        if links.is_empty() {
            return;
        }
        let mut touched: Vec<u32> = links
            .iter()
            .map(|&l| self.link_part[l as usize])
            .filter(|&id| id != NONE)
            .collect();
        touched.sort_unstable();
        touched.dedup();
        let size = |p: &Part| p.flows.len() + p.links.len();
        let target = match touched
            .iter()
            .max_by_key(|&&id| size(&self.parts[id as usize]))
        {
            Some(&id) => id,
            None => self.new_part(),
        };
        for &id in &touched {
            if id != target {
                self.merge_into(id, target);
            }
        }
        let part = &mut self.parts[target as usize];
        for &l in &links {
            if self.link_part[l as usize] == NONE {
                self.link_part[l as usize] = target;
                part.links.push(l);
                part.min_link = part.min_link.min(l);
            }
        }
        part.flows.push(f);
        part.sorted = false;
        self.flow_part[f as usize] = target;
    }

    /// Moves partition `from` into `into` and frees it.
    fn merge_into(&mut self, from: u32, into: u32) {
        let src = std::mem::take(&mut self.parts[from as usize]);
        for &l in &src.links {
            self.link_part[l as usize] = into;
        }
        // Joins come after every split check of the update, so no partition that merges
        // still lists a flow that left.
        debug_assert!(!src.dirty, "a partition merges before its split check");
        for &g in &src.flows {
            self.flow_part[g as usize] = into;
        }
        let dst = &mut self.parts[into as usize];
        dst.links.extend_from_slice(&src.links);
        dst.flows.extend_from_slice(&src.flows);
        dst.min_link = dst.min_link.min(src.min_link);
        dst.sorted = false;
        // `src` was taken whole; its slot is marked free.
        self.parts[from as usize].alive = false;
        self.free.push(from);
    }

    /// The split check of partition `id`: its remaining members' components.
    fn split<I>(&mut self, id: u32, links_of: &impl Fn(u32) -> I)
    where
        I: Iterator<Item = u32>,
    {
        let part = &mut self.parts[id as usize];
        if !part.alive || !part.dirty {
            return;
        }
        part.dirty = false;
        let mut flows = std::mem::take(&mut part.flows);
        let old_links = std::mem::take(&mut part.links);
        flows.retain(|&g| self.flow_part[g as usize] == id);
        for &l in &old_links {
            self.link_part[l as usize] = NONE;
        }
        if flows.is_empty() {
            self.free_part(id);
            return;
        }
        let keyed = components(&mut self.uf, &flows, links_of);
        for &l in &old_links {
            self.uf[l as usize] = l;
        }
        let mut current = NONE;
        let mut root = NONE;
        let mut first = true;
        for (r, g) in keyed {
            if r != root {
                root = r;
                current = if first { id } else { self.new_part() };
                if first {
                    let part = &mut self.parts[id as usize];
                    part.alive = true;
                    part.sorted = true;
                }
                first = false;
                self.parts[current as usize].min_link = r;
            }
            self.flow_part[g as usize] = current;
            let part = &mut self.parts[current as usize];
            part.flows.push(g);
            for l in links_of(g) {
                if self.link_part[l as usize] == NONE {
                    self.link_part[l as usize] = current;
                    part.links.push(l);
                }
            }
        }
    }
}

/// The components of `flows` by a union-find over their links, as (root, flow) pairs in
/// increasing order, where each root is its component's smallest link; flows without
/// links are left out. `uf` must hold every link as its own root; it is left holding the
/// components (callers reset the links they used).
pub(super) fn components<I>(
    uf: &mut [u32],
    flows: &[u32],
    links_of: &impl Fn(u32) -> I,
) -> Vec<(u32, u32)>
where
    I: Iterator<Item = u32>,
{
    for &g in flows {
        let mut first: Option<u32> = None;
        for l in links_of(g) {
            let r = find(uf, l);
            match first {
                None => first = Some(r),
                Some(a) => {
                    let a = find(uf, a);
                    if a != r {
                        // The smaller root wins, so each root stays its set's smallest link.
                        let (lo, hi) = if a < r { (a, r) } else { (r, a) };
                        uf[hi as usize] = lo;
                    }
                }
            }
        }
    }
    let mut keyed: Vec<(u32, u32)> = flows
        .iter()
        .filter_map(|&g| Some((find(uf, links_of(g).next()?), g)))
        .collect();
    keyed.sort_unstable();
    keyed
}

/// The root of link `x`'s set, halving the path on the way.
pub(super) fn find(uf: &mut [u32], mut x: u32) -> u32 {
    while uf[x as usize] != x {
        let up = uf[uf[x as usize] as usize];
        uf[x as usize] = up;
        x = up;
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    /// The slow path: components of `members` recomputed from scratch, as (smallest link,
    /// sorted flows, sorted links), by smallest link.
    fn recompute(members: &[u32], paths: &[Vec<u32>]) -> Vec<(u32, Vec<u32>, Vec<u32>)> {
        let mut comps: Vec<(BTreeSet<u32>, BTreeSet<u32>)> = Vec::new();
        for &f in members {
            let links: BTreeSet<u32> = paths[f as usize].iter().copied().collect();
            if links.is_empty() {
                continue;
            }
            let mut merged = (BTreeSet::from([f]), links);
            comps.retain(|c| {
                if c.1.is_disjoint(&merged.1) {
                    true
                } else {
                    merged.0.extend(&c.0);
                    merged.1.extend(&c.1);
                    false
                }
            });
            comps.push(merged);
        }
        let mut out: Vec<_> = comps
            .into_iter()
            .map(|(f, l)| {
                (
                    *l.first().unwrap(),
                    f.into_iter().collect(),
                    l.into_iter().collect(),
                )
            })
            .collect();
        out.sort();
        out
    }

    fn listed(p: &mut Partitions) -> Vec<(u32, Vec<u32>, Vec<u32>)> {
        p.listing()
            .into_iter()
            .map(|id| {
                let mut links = p.links(id).to_vec();
                links.sort_unstable();
                for &l in &links {
                    assert_eq!(p.of_link(l), Some(id), "link {l} names its partition");
                }
                (p.parts[id as usize].min_link, p.flows(id).to_vec(), links)
            })
            .collect()
    }

    #[test]
    fn a_leaving_bridge_splits_its_partition_and_a_join_merges_it_back() {
        // Flows 0 and 1 share nothing; flow 2 bridges them.
        let paths = [vec![0, 1], vec![5, 6], vec![1, 5], vec![9]];
        let links = |f: u32| paths[f as usize].clone().into_iter();
        let mut p = Partitions::new(4, 10);
        p.update(&[0, 1, 2, 3], links);
        assert_eq!(
            listed(&mut p),
            vec![(0, vec![0, 1, 2], vec![0, 1, 5, 6]), (9, vec![3], vec![9])]
        );
        p.update(&[0, 1, 3], links);
        assert_eq!(
            listed(&mut p),
            vec![
                (0, vec![0], vec![0, 1]),
                (5, vec![1], vec![5, 6]),
                (9, vec![3], vec![9])
            ]
        );
        p.update(&[3, 2, 0], links);
        assert_eq!(
            listed(&mut p),
            vec![(0, vec![0, 2], vec![0, 1, 5]), (9, vec![3], vec![9])]
        );
        assert_eq!(p.of_link(6), None, "a link no member uses belongs nowhere");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        /// After every update the partitions are exactly the recomputed components.
        #[test]
        fn updates_match_recomputation(
            paths in prop::collection::vec(prop::collection::vec(0u32..24, 0..4), 1..16),
            steps in prop::collection::vec(prop::collection::vec(any::<bool>(), 16), 1..12),
        ) {
            let n = paths.len();
            let links = |f: u32| paths[f as usize].clone().into_iter();
            let mut p = Partitions::new(n, 24);
            for step in &steps {
                let members: Vec<u32> = (0..n as u32).filter(|&f| step[f as usize]).collect();
                // Listed backwards and some twice: the order and repeats must not matter.
                let listed_twice: Vec<u32> =
                    members.iter().rev().chain(members.iter().step_by(3)).copied().collect();
                p.update(&listed_twice, links);
                prop_assert_eq!(listed(&mut p), recompute(&members, &paths));
            }
        }
    }
}
