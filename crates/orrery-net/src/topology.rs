//! Topologies: endpoints (GPUs with their NICs), switches and directed links, and routing.
//!
//! A [`NetGraph`] is an arena of nodes and directed links. Every physical cable is two
//! links, one per direction, so each direction has its own bandwidth, delay and (in the
//! packet model) its own egress queue at the sending node. Endpoint `i` (a GPU) is
//! `graph.endpoint(i)`; ranks of a job map to endpoints one to one.
//!
//! Routing is shortest-path with equal-cost multi-path: among all shortest paths from a
//! source to a destination, a flow takes the one chosen hop by hop by a deterministic hash
//! of the flow's identity (its `flow_hash`: its ends and its connection, the queue pair
//! that carries it, see [`crate::flow_model::connection_numbers`]) and the hop's index,
//! like switch ECMP hashing on the 5-tuple. The same connection always takes the same
//! path; different ones spread. One
//! tie-break overrides the hash: where an NVLink switch is among the equal-cost next hops,
//! it is taken (GPUs of one host that also share a leaf talk over NVLink, as NCCL does).
//!
//! A graph may instead *pin* paths by destination ([`Routing::Pinned`], set with
//! [`NetGraph::with_routing`]): every equal-cost choice is made from the destination's
//! *slot* (its port on its own leaf, with the leaf's number above it) rather than from a
//! hash, the "destination-mod-k" rule of InfiniBand fat-tree routing and of the path
//! pinning Meta ran on its first RoCE training clusters (Gangidi et al., SIGCOMM 2024:
//! "routed packets to specific paths based on the destination slice, the index of the
//! rack switch's downlink"). Flows to different slots of one leaf then never share a
//! link above their sources' leaves, where a uniform hash of 32 flows over 32 uplinks
//! puts two or more on about a quarter of them (`1 - (31/32)^32 - (31/32)^31`), so that
//! three flows in five share one (arithmetic, not a measurement). It was their first answer to ECMP collisions
//! and works while every slot of a leaf belongs to one job; a leaf half used by a job
//! leaves half the paths idle, which this model reproduces.
//!
//! Builders: [`NetGraph::single_switch`] and [`NetGraph::dumbbell`] for tests,
//! [`NetGraph::rail_optimized`] ([`RailOptimizedSpec`]) and [`NetGraph::fat_tree`]
//! ([`FatTreeSpec`]) for clusters. Spec builders validate every field and report every
//! problem at once, each with the field's name ([`TopologyError::InvalidSpec`]).
//!
//! What this module does not do: adaptive routing, failures, or per-packet spraying.

use orrery_units::{Bandwidth, LinkId, NodeId, Picos};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// How a flow's path is chosen among equal-cost shortest paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// Equal-cost multi-path by a hash of the flow's identity and the hop (the default).
    #[default]
    Ecmp,
    /// Paths pinned by the destination's slot (see the module docs).
    Pinned,
}

/// What a node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeKind {
    /// A GPU with its NIC: where flows start and end.
    Endpoint,
    /// The NVLink switch domain inside a host.
    NvSwitch,
    /// A top-of-rack / leaf / rail switch.
    Leaf,
    /// A spine (aggregation) switch.
    Spine,
    /// A core switch of a three-tier fabric.
    Core,
    /// A generic switch (single-switch and dumbbell test topologies).
    Switch,
}

impl NodeKind {
    pub fn is_switch(self) -> bool {
        !matches!(self, NodeKind::Endpoint)
    }
}

/// A directed link.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub from: NodeId,
    pub to: NodeId,
    pub bandwidth: Bandwidth,
    /// Propagation delay.
    pub delay: Picos,
}

/// Why a topology could not be built or a route found.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TopologyError {
    #[error("link {link} names node {node}, but the topology has {nodes} nodes")]
    BadNode {
        link: usize,
        node: u32,
        nodes: usize,
    },
    #[error("link {link} has a non-positive or non-finite bandwidth")]
    BadBandwidth { link: usize },
    #[error("{what} must be at least 1")]
    Zero { what: &'static str },
    #[error("no route from node {from} to node {to}")]
    NoRoute { from: u32, to: u32 },
    #[error("endpoint {index} does not exist (the topology has {endpoints})")]
    NoEndpoint { index: usize, endpoints: usize },
    /// A topology spec (rail-optimised or fat-tree) is invalid; every problem is listed,
    /// each with the name of the field it concerns.
    #[error("invalid topology spec: {}", join_problems(problems))]
    InvalidSpec { problems: Vec<SpecProblem> },
}

/// One problem with one field of a topology spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SpecProblem {
    /// The field's name as written in the spec struct (`hosts_per_pod`, `nic`, ...).
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

impl TopologyError {
    /// The fields named by an [`TopologyError::InvalidSpec`] (empty for other errors).
    pub fn fields(&self) -> Vec<&'static str> {
        match self {
            TopologyError::InvalidSpec { problems } => problems.iter().map(|p| p.field).collect(),
            _ => Vec::new(),
        }
    }
}

fn join_problems(problems: &[SpecProblem]) -> String {
    problems
        .iter()
        .map(|p| format!("{}: {}", p.field, p.reason))
        .collect::<Vec<_>>()
        .join("; ")
}

/// A network topology: nodes, directed links, and the endpoints in rank order.
#[derive(Debug, Clone, PartialEq)]
pub struct NetGraph {
    kinds: Vec<NodeKind>,
    links: Vec<Link>,
    out_links: Vec<Vec<LinkId>>,
    /// The links into each node, for the searches towards a destination
    /// ([`NetGraph::distances_to`] runs once per destination: on the 8,192-GPU fabric,
    /// rebuilding this in each took about a tenth of a packet-level step's run).
    in_links: Vec<Vec<LinkId>>,
    endpoints: Vec<NodeId>,
    /// Hosts: the endpoint index range of each host (`endpoints_per_host` each), if the
    /// topology has hosts; used to tell intra-host from inter-host traffic.
    endpoints_per_host: usize,
    routing: Routing,
    /// With [`Routing::Pinned`], each node's pinning key (see [`NetGraph::with_routing`];
    /// zero for switches), else empty.
    pin_key: Vec<u64>,
}

impl NetGraph {
    /// Builds a graph from raw parts. Endpoints are the `Endpoint` nodes in id order.
    pub fn from_parts(
        kinds: Vec<NodeKind>,
        links: Vec<Link>,
        endpoints_per_host: usize,
    ) -> Result<NetGraph, TopologyError> {
        let n = kinds.len();
        let mut out_links = vec![Vec::new(); n];
        let mut in_links = vec![Vec::new(); n];
        for (i, l) in links.iter().enumerate() {
            for node in [l.from, l.to] {
                if node.index() >= n {
                    return Err(TopologyError::BadNode {
                        link: i,
                        node: node.0,
                        nodes: n,
                    });
                }
            }
            if !(l.bandwidth.0.is_finite() && l.bandwidth.0 > 0.0) {
                return Err(TopologyError::BadBandwidth { link: i });
            }
            out_links[l.from.index()].push(LinkId::from_index(i));
            in_links[l.to.index()].push(LinkId::from_index(i));
        }
        let endpoints = kinds
            .iter()
            .enumerate()
            .filter(|(_, k)| **k == NodeKind::Endpoint)
            .map(|(i, _)| NodeId::from_index(i))
            .collect();
        Ok(NetGraph {
            kinds,
            links,
            out_links,
            in_links,
            endpoints,
            endpoints_per_host: endpoints_per_host.max(1),
            routing: Routing::Ecmp,
            pin_key: Vec::new(),
        })
    }

    /// The graph with `routing` as its path choice. For [`Routing::Pinned`] each endpoint
    /// gets its key: its *leaf* is the first switch it is cabled to other than its NVLink
    /// domain, its *slot* is its place among the endpoints that leaf's links lead to (in
    /// link order), and its key is `leaf number * (most endpoints on a leaf) + slot`, leaves
    /// numbered in node order. An endpoint with no such switch has key 0.
    pub fn with_routing(mut self, routing: Routing) -> NetGraph {
        self.routing = routing;
        self.pin_key = Vec::new();
        if routing == Routing::Pinned {
            let leaf_of = |e: NodeId| {
                self.out_links[e.index()]
                    .iter()
                    .map(|&l| self.links[l.index()].to)
                    .find(|&to| !matches!(self.kinds[to.index()], NodeKind::NvSwitch))
                    .filter(|&to| self.kinds[to.index()].is_switch())
            };
            let mut slot = vec![0u64; self.kinds.len()];
            let mut leaf_number = vec![u64::MAX; self.kinds.len()];
            let mut leaves = 0u64;
            let mut widest = 1u64;
            for (node, kind) in self.kinds.iter().enumerate() {
                if !kind.is_switch() {
                    continue;
                }
                let mut n = 0u64;
                for &l in &self.out_links[node] {
                    let to = self.links[l.index()].to;
                    if self.kinds[to.index()] == NodeKind::Endpoint
                        && leaf_of(to) == Some(NodeId::from_index(node))
                    {
                        slot[to.index()] = n;
                        n += 1;
                    }
                }
                if n > 0 {
                    leaf_number[node] = leaves;
                    leaves += 1;
                    widest = widest.max(n);
                }
            }
            let mut key = vec![0u64; self.kinds.len()];
            for &e in &self.endpoints {
                if let Some(leaf) = leaf_of(e) {
                    key[e.index()] = leaf_number[leaf.index()] * widest + slot[e.index()];
                }
            }
            self.pin_key = key;
        }
        self
    }

    /// How paths are chosen among equal-cost ones.
    pub fn routing(&self) -> Routing {
        self.routing
    }

    /// `n` endpoints on one switch, each with a link of `bandwidth` and `delay` each way.
    pub fn single_switch(
        n: usize,
        bandwidth: Bandwidth,
        delay: Picos,
    ) -> Result<NetGraph, TopologyError> {
        if n == 0 {
            return Err(TopologyError::Zero { what: "endpoints" });
        }
        let mut kinds = vec![NodeKind::Endpoint; n];
        kinds.push(NodeKind::Switch);
        let sw = NodeId::from_index(n);
        let mut links = Vec::new();
        for i in 0..n {
            let e = NodeId::from_index(i);
            links.push(Link {
                from: e,
                to: sw,
                bandwidth,
                delay,
            });
            links.push(Link {
                from: sw,
                to: e,
                bandwidth,
                delay,
            });
        }
        NetGraph::from_parts(kinds, links, 1)
    }

    /// A dumbbell: `left` and `right` endpoints on two switches joined by one bottleneck
    /// link (each way) of `bottleneck` bandwidth; edge links have `edge` bandwidth.
    pub fn dumbbell(
        left: usize,
        right: usize,
        edge: Bandwidth,
        bottleneck: Bandwidth,
        delay: Picos,
    ) -> Result<NetGraph, TopologyError> {
        if left == 0 || right == 0 {
            return Err(TopologyError::Zero {
                what: "endpoints on each side",
            });
        }
        let n = left + right;
        let mut kinds = vec![NodeKind::Endpoint; n];
        kinds.push(NodeKind::Switch);
        kinds.push(NodeKind::Switch);
        let (sl, sr) = (NodeId::from_index(n), NodeId::from_index(n + 1));
        let mut links = Vec::new();
        for i in 0..n {
            let e = NodeId::from_index(i);
            let sw = if i < left { sl } else { sr };
            links.push(Link {
                from: e,
                to: sw,
                bandwidth: edge,
                delay,
            });
            links.push(Link {
                from: sw,
                to: e,
                bandwidth: edge,
                delay,
            });
        }
        links.push(Link {
            from: sl,
            to: sr,
            bandwidth: bottleneck,
            delay,
        });
        links.push(Link {
            from: sr,
            to: sl,
            bandwidth: bottleneck,
            delay,
        });
        NetGraph::from_parts(kinds, links, 1)
    }

    pub fn num_nodes(&self) -> usize {
        self.kinds.len()
    }
    pub fn kind(&self, n: NodeId) -> NodeKind {
        self.kinds[n.index()]
    }
    pub fn links(&self) -> &[Link] {
        &self.links
    }
    pub fn link(&self, l: LinkId) -> &Link {
        &self.links[l.index()]
    }
    pub fn out_links(&self, n: NodeId) -> &[LinkId] {
        &self.out_links[n.index()]
    }
    pub fn num_endpoints(&self) -> usize {
        self.endpoints.len()
    }
    /// The node of endpoint (rank) `i`.
    pub fn endpoint(&self, i: usize) -> Result<NodeId, TopologyError> {
        self.endpoints
            .get(i)
            .copied()
            .ok_or(TopologyError::NoEndpoint {
                index: i,
                endpoints: self.endpoints.len(),
            })
    }
    pub fn endpoints_per_host(&self) -> usize {
        self.endpoints_per_host
    }
    /// Whether endpoints `a` and `b` share a host.
    pub fn same_host(&self, a: usize, b: usize) -> bool {
        a / self.endpoints_per_host == b / self.endpoints_per_host
    }

    /// Hop distances from every node to `dst` (`u32::MAX` where unreachable), by BFS over
    /// reversed links. Switch-to-endpoint-to-switch transit is not allowed: endpoints only
    /// originate and terminate traffic.
    pub fn distances_to(&self, dst: NodeId) -> Vec<u32> {
        let n = self.kinds.len();
        let mut dist = vec![u32::MAX; n];
        let mut q = VecDeque::new();
        dist[dst.index()] = 0;
        q.push_back(dst);
        while let Some(v) = q.pop_front() {
            // Endpoints other than the destination do not forward.
            if v != dst && self.kinds[v.index()] == NodeKind::Endpoint {
                continue;
            }
            for &l in &self.in_links[v.index()] {
                let u = self.links[l.index()].from;
                if dist[u.index()] == u32::MAX {
                    dist[u.index()] = dist[v.index()] + 1;
                    q.push_back(u);
                }
            }
        }
        dist
    }

    /// The links of the ECMP shortest path a flow with `flow_hash` takes from `src` to
    /// `dst`. `dist` must be `distances_to(dst)` (callers cache it per destination).
    pub fn route_with(
        &self,
        src: NodeId,
        dst: NodeId,
        flow_hash: u64,
        dist: &[u32],
    ) -> Result<Vec<LinkId>, TopologyError> {
        self.route_and_choice(src, dst, flow_hash, dist)
            .map(|(path, _)| path)
    }

    /// [`NetGraph::route_with`], and whether the hash chose anything on the way: `false`
    /// when every hop had a single next hop, or when paths are pinned, so that every hash
    /// takes this same route (callers that route many connections between the same two
    /// nodes keep such a route for all of them).
    pub fn route_and_choice(
        &self,
        src: NodeId,
        dst: NodeId,
        flow_hash: u64,
        dist: &[u32],
    ) -> Result<(Vec<LinkId>, bool), TopologyError> {
        let no_route = TopologyError::NoRoute {
            from: src.0,
            to: dst.0,
        };
        if dist.get(src.index()).copied().unwrap_or(u32::MAX) == u32::MAX {
            return Err(no_route);
        }
        let mut path = Vec::new();
        let mut chose = false;
        let mut at = src;
        let mut hop = 0u64;
        let mut pin = Pin {
            key: self.pin_key.get(dst.index()).copied().unwrap_or(0),
            stride: 1,
        };
        while at != dst {
            let Some((l, choices)) = self.next_hop_of(at, dst, flow_hash, hop, dist, &mut pin)
            else {
                return Err(no_route);
            };
            chose |= choices > 1 && self.routing == Routing::Ecmp;
            path.push(l);
            at = self.links[l.index()].to;
            hop += 1;
        }
        Ok((path, chose))
    }

    /// The link a flow with `flow_hash` takes out of node `at` at hop `hop` of its ECMP
    /// shortest path to `dst` (`dist` as in [`NetGraph::route_with`]), or `None` if no link
    /// leads closer. It counts the candidates in one pass and takes the picked one in a
    /// second, instead of collecting them (routing every flow of a large job allocated a
    /// vector per hop). With the link comes the number of equal next hops it was picked
    /// among.
    ///
    /// With [`Routing::Pinned`] the pick is `(key / stride) % count` and the stride then
    /// grows by `count` (destination-mod-k: each level of choices reads the next digit of
    /// the destination's key), except among parallel cables to one next node, where the
    /// pick is `key % count` and the stride stays: a path that went up on cable `c` of a
    /// leaf-spine pair comes down on cable `c` of a spine-leaf pair, so two destinations
    /// whose keys differ below `count` never meet on the way down (the rail-optimised
    /// builder lists a leaf's uplinks spine by spine, cables within each).
    fn next_hop_of(
        &self,
        at: NodeId,
        dst: NodeId,
        flow_hash: u64,
        hop: u64,
        dist: &[u32],
        pin: &mut Pin,
    ) -> Option<(LinkId, u64)> {
        let here = dist[at.index()];
        // Endpoints do not forward: a neighbouring endpoint other than `dst` may have a
        // distance that fits (it is one NVLink hop from `dst`), but it is no next hop.
        let candidate = |l: LinkId| {
            let to = self.links[l.index()].to;
            dist[to.index()] == here.wrapping_sub(1)
                && (to == dst || self.kinds[to.index()] != NodeKind::Endpoint)
        };
        let to_nvswitch =
            |l: LinkId| self.kinds[self.links[l.index()].to.index()] == NodeKind::NvSwitch;
        let links = &self.out_links[at.index()];
        let (mut n, mut nv) = (0u64, 0u64);
        for &l in links.iter().filter(|&&l| candidate(l)) {
            n += 1;
            nv += u64::from(to_nvswitch(l));
        }
        // Among equal-cost next hops, the NVLink domain wins: GPUs of one host that also
        // share a leaf (fat-trees) talk over NVLink, never through their NICs.
        let nvlink_only = n > 1 && nv > 0;
        let count = if nvlink_only { nv } else { n };
        if count == 0 {
            return None;
        }
        let eligible = |l: &LinkId| candidate(*l) && (!nvlink_only || to_nvswitch(*l));
        let pick = match self.routing {
            Routing::Ecmp => mix(flow_hash ^ hop.wrapping_mul(0x9e37_79b9_7f4a_7c15)) % count,
            Routing::Pinned if count == 1 => 0,
            Routing::Pinned => {
                let mut ends = links
                    .iter()
                    .filter(|l| eligible(l))
                    .map(|&l| self.links[l.index()].to);
                let first = ends.next();
                if ends.all(|to| Some(to) == first) {
                    pin.key % count
                } else {
                    let pick = (pin.key / pin.stride) % count;
                    pin.stride = pin.stride.saturating_mul(count);
                    pick
                }
            }
        };
        links
            .iter()
            .copied()
            .filter(eligible)
            .nth(pick as usize)
            .map(|l| (l, count))
    }

    /// The ECMP shortest path from endpoint `src` to endpoint `dst` for `flow_hash`.
    pub fn route(
        &self,
        src: usize,
        dst: usize,
        flow_hash: u64,
    ) -> Result<Vec<LinkId>, TopologyError> {
        let (s, d) = (self.endpoint(src)?, self.endpoint(dst)?);
        self.route_with(s, d, flow_hash, &self.distances_to(d))
    }
}

/// Where a pinned route is in its destination's key (see [`NetGraph::next_hop_of`]).
struct Pin {
    key: u64,
    stride: u64,
}

/// The most endpoints a spec-built topology may have (bad input must not exhaust memory).
pub const MAX_SPEC_ENDPOINTS: usize = 1 << 22;
/// The most directed links a spec-built topology may have.
pub const MAX_SPEC_LINKS: usize = 1 << 25;
/// The most parallel cables between one leaf and one spine of a rail-optimised fabric.
pub const MAX_PARALLEL_UPLINKS: usize = 64;

/// A rail-optimised multi-tier GPU cluster (the DGX SuperPOD shape).
///
/// Inside each host, every GPU has an NVLink link each way to the host's NVLink switch
/// domain (one [`NodeKind::NvSwitch`] node standing for all of the host's NVSwitch chips).
/// Across hosts, GPU `l` of every host has its own NIC, cabled to the *rail-`l` leaf* of
/// its pod: a pod is `hosts_per_pod` consecutive hosts sharing one leaf per rail, so a leaf
/// sees exactly one GPU of each host of its pod. Every leaf of every pod is cabled to
/// every spine; pods are joined through that spine layer (a two-level Clos of leaves and
/// spines, with rails as the leaf grouping).
///
/// Endpoint index = `host * gpus_per_host + local_gpu`; the graph's
/// [`NetGraph::endpoints_per_host`] is `gpus_per_host`.
///
/// Routing is the graph's shortest path (ECMP among equals), which gives:
/// - two GPUs of one host: NVLink, GPU -> NvSwitch -> GPU (2 links); the NIC path is at
///   least 4 links (the two GPUs sit on different rails), so it is never taken;
/// - same rail, same pod: GPU -> rail leaf -> GPU (2 links), never a spine;
/// - same rail, different pods: leaf -> spine -> leaf (4 links), ECMP over the spines and
///   over parallel cables;
/// - different rails, any hosts: leaf -> spine -> leaf (4 links) as well. Real NCCL with
///   PXN instead moves the data over NVLink to the GPU on the destination's rail and
///   sends from there; endpoints never forward in this model, so a collective that wants
///   rail-aligned traffic pairs ranks on the same rail (ring orders that step host to
///   host at the same local index, the hierarchical algorithm) or relays through such a
///   rank in flows of its own ([`crate::flows::FlowAlgorithm::DirectPxn`]).
///
/// Leaf-spine capacity: a leaf has `hosts_per_pod` NIC-facing ports of `nic`; its uplink
/// capacity towards each spine is `C = hosts_per_pod * nic / spine_oversubscription /
/// spines`, carried on `k = ceil(C / uplink)` parallel cables of `C / k` each, so no cable
/// is faster than the `uplink` port speed and the oversubscription ratio is exact. The
/// capacity is sized for full pods even when the last pod is partly filled.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RailOptimizedSpec {
    /// Number of hosts (servers). At least 1.
    pub hosts: usize,
    /// GPUs per host, each with its own NIC and its own rail. At least 1; with 1 there is
    /// no NVLink domain.
    pub gpus_per_host: usize,
    /// NVLink bandwidth between one GPU and the host's NVLink switch, per direction.
    pub nvlink: Bandwidth,
    /// Propagation (and switching) delay of an NVLink hop.
    pub nvlink_delay: Picos,
    /// NIC bandwidth per GPU, per direction.
    pub nic: Bandwidth,
    /// Propagation delay of every cable in the scale-out fabric (NIC-leaf, leaf-spine).
    pub link_delay: Picos,
    /// Hosts under one set of rail leaves (one leaf per rail per pod). At least 1.
    pub hosts_per_pod: usize,
    /// Spine switches; every leaf is cabled to every spine. At least 1 (with no spine,
    /// different rails of different hosts could not reach each other).
    pub spines: usize,
    /// Port speed of one leaf-spine cable, per direction.
    pub uplink: Bandwidth,
    /// Leaf downlink capacity over leaf uplink capacity (1.0 = full bisection, 2.0 = the
    /// spines carry half of what the leaves can take in). Positive and finite.
    pub spine_oversubscription: f64,
}

impl RailOptimizedSpec {
    /// A DGX-H100-like cluster of `hosts` hosts, with each default chosen as follows:
    /// - 8 GPUs per host (DGX/HGX H100);
    /// - NVLink 450 GB/s per direction per GPU (NVLink 4: 18 links x 25 GB/s), 200 ns per
    ///   NVLink hop (sub-microsecond NVSwitch port-to-port latency; per-step software
    ///   latency of several microseconds dominates it anyway);
    /// - NIC 400 Gb/s per GPU (ConnectX-7 NDR), 1 us per scale-out hop (the per-link delay
    ///   the RDMA simulation literature, e.g. the HPCC ns-3 setups, uses for cable plus
    ///   switch pipeline);
    /// - 32 hosts per pod (a SuperPOD scalable unit: 32 nodes, one 64-port 400G leaf per
    ///   rail with 32 ports down and 32 up);
    /// - 16 spines of 400 Gb/s ports at 1:1 (each leaf reaches every spine through 2 of its
    ///   32 uplinks: full bisection).
    pub fn dgx_h100(hosts: usize) -> RailOptimizedSpec {
        RailOptimizedSpec {
            hosts,
            gpus_per_host: 8,
            nvlink: Bandwidth::from_gbytes_per_sec(450.0),
            nvlink_delay: Picos::from_nanos(200),
            nic: Bandwidth::from_gbits_per_sec(400.0),
            link_delay: Picos::from_micros(1),
            hosts_per_pod: 32,
            spines: 16,
            uplink: Bandwidth::from_gbits_per_sec(400.0),
            spine_oversubscription: 1.0,
        }
    }

    /// Number of pods (`ceil(hosts / hosts_per_pod)`).
    pub fn pods(&self) -> usize {
        self.hosts.div_ceil(self.hosts_per_pod.max(1))
    }

    /// Checks every field; lists every problem at once.
    pub fn validate(&self) -> Result<(), TopologyError> {
        self.plan().map(|_| ())
    }

    /// Validates and works out the leaf-spine cabling: (parallel cables per leaf-spine
    /// pair, bandwidth of each).
    fn plan(&self) -> Result<(usize, Bandwidth), TopologyError> {
        let mut p = Problems::default();
        p.at_least_one("hosts", self.hosts);
        p.at_least_one("gpus_per_host", self.gpus_per_host);
        p.at_least_one("hosts_per_pod", self.hosts_per_pod);
        p.at_least_one("spines", self.spines);
        p.rate("nvlink", self.nvlink);
        p.rate("nic", self.nic);
        p.rate("uplink", self.uplink);
        p.ratio("spine_oversubscription", self.spine_oversubscription);
        p.finish()?;
        let endpoints = checked_endpoints(self.hosts, self.gpus_per_host)?;
        let capacity = self.hosts_per_pod as f64 * self.nic.0
            / self.spine_oversubscription
            / self.spines as f64;
        let k = parallel_cables(capacity, self.uplink.0);
        if k > MAX_PARALLEL_UPLINKS as f64 {
            return Err(TopologyError::InvalidSpec {
                problems: vec![SpecProblem {
                    field: "uplink",
                    reason: format!(
                        "each leaf-spine pair would need {k} parallel cables (at most \
                         {MAX_PARALLEL_UPLINKS}); raise the port speed or add spines"
                    ),
                }],
            });
        }
        let k = k as usize;
        let host_links = if self.gpus_per_host > 1 { 2 } else { 1 };
        let leaves = self.pods() as u128 * self.gpus_per_host as u128;
        let links = 2 * (endpoints as u128 * host_links + leaves * self.spines as u128 * k as u128);
        check_links(links, "spines")?;
        Ok((k, Bandwidth(capacity / k as f64)))
    }
}

/// A 2- or 3-tier fat-tree (folded Clos) of GPU hosts, the NICs of each host on one leaf.
///
/// Inside each host, GPUs are joined by an NVLink domain exactly as in
/// [`RailOptimizedSpec`]. Every GPU has its own NIC of `nic` bandwidth; all NICs of a host
/// go to the same leaf (top-of-rack) switch, `hosts_per_leaf` hosts per leaf. Endpoint
/// index = `host * gpus_per_host + local_gpu`.
///
/// - **2 tiers**: `ceil(hosts / hosts_per_leaf)` leaves, each cabled to every one of
///   `spines` spines ([`NodeKind::Spine`]).
/// - **3 tiers**: leaves are grouped in pods of `leaves_per_pod`; each pod has `spines`
///   aggregation switches ([`NodeKind::Spine`]), each cabled to every leaf of its pod; the
///   `cores` core switches ([`NodeKind::Core`]) are split into `spines` planes of
///   `cores / spines`, and aggregation switch `a` of every pod is cabled to every core of
///   plane `a` (the classic k-ary fat-tree wiring).
///
/// Oversubscription is applied to uplinks: each leaf-to-spine cable carries
/// `hosts_per_leaf * gpus_per_host * nic / oversubscription / spines`; in a 3-tier tree each
/// aggregation-to-core cable carries `leaves_per_pod * (leaf uplink) /
/// core_oversubscription / (cores / spines)`. Capacities are sized for full leaves and pods
/// even when the last ones are partly filled.
///
/// Hop counts (links, endpoint to endpoint): same host 2 (NVLink; preferred over the
/// equally short path through the shared leaf), same leaf 2, same pod (or any two leaves
/// of a 2-tier tree) 4, different pods 6.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FatTreeSpec {
    /// Number of hosts. At least 1.
    pub hosts: usize,
    /// GPUs (each with a NIC) per host. At least 1; with 1 there is no NVLink domain.
    pub gpus_per_host: usize,
    /// NVLink bandwidth between one GPU and the host's NVLink switch, per direction.
    pub nvlink: Bandwidth,
    /// Delay of an NVLink hop.
    pub nvlink_delay: Picos,
    /// NIC bandwidth per GPU, per direction.
    pub nic: Bandwidth,
    /// Propagation delay of every cable of the scale-out fabric.
    pub link_delay: Picos,
    /// 2 (leaf-spine) or 3 (leaf-aggregation-core).
    pub tiers: u8,
    /// Hosts per leaf switch. At least 1.
    pub hosts_per_leaf: usize,
    /// 2 tiers: number of spines. 3 tiers: aggregation switches per pod. At least 1.
    pub spines: usize,
    /// Leaf downlink over leaf uplink capacity (1.0 = full bisection). Positive, finite.
    pub oversubscription: f64,
    /// 3 tiers only: leaves per pod. At least 1 (ignored for 2 tiers).
    pub leaves_per_pod: usize,
    /// 3 tiers only: core switches, a positive multiple of `spines` (ignored for 2 tiers).
    pub cores: usize,
    /// 3 tiers only: aggregation downlink over uplink capacity. Positive, finite (ignored
    /// for 2 tiers).
    pub core_oversubscription: f64,
}

impl FatTreeSpec {
    /// A 2-tier fat-tree of 64-port 400 Gb/s switches, with each default chosen as follows:
    /// - 8 GPUs per host with H100 NVLink (450 GB/s, 200 ns per hop) and a 400 Gb/s NIC per
    ///   GPU, 1 us per scale-out hop (see [`RailOptimizedSpec::dgx_h100`]);
    /// - 4 hosts per leaf: 32 NIC ports down, leaving 32 ports up;
    /// - 32 spines, one 400 Gb/s cable from each leaf to each (full bisection, 1:1);
    ///   64-port spines then take up to 64 leaves (256 hosts, 2048 GPUs).
    ///
    /// The 3-tier fields are preset for [`FatTreeSpec::three_tier`]'s geometry.
    pub fn two_tier(hosts: usize) -> FatTreeSpec {
        FatTreeSpec {
            hosts,
            gpus_per_host: 8,
            nvlink: Bandwidth::from_gbytes_per_sec(450.0),
            nvlink_delay: Picos::from_nanos(200),
            nic: Bandwidth::from_gbits_per_sec(400.0),
            link_delay: Picos::from_micros(1),
            tiers: 2,
            hosts_per_leaf: 4,
            spines: 32,
            oversubscription: 1.0,
            leaves_per_pod: 32,
            cores: 1024,
            core_oversubscription: 1.0,
        }
    }

    /// A 3-tier fat-tree of 64-port switches (the k = 64 fat-tree): as
    /// [`FatTreeSpec::two_tier`], with pods of 32 leaves and 32 aggregation switches (32
    /// ports down, 32 up each) and 1024 cores in 32 planes of 32, all 1:1.
    pub fn three_tier(hosts: usize) -> FatTreeSpec {
        FatTreeSpec {
            tiers: 3,
            ..FatTreeSpec::two_tier(hosts)
        }
    }

    /// Number of leaves (`ceil(hosts / hosts_per_leaf)`).
    pub fn leaves(&self) -> usize {
        self.hosts.div_ceil(self.hosts_per_leaf.max(1))
    }

    /// Number of pods of a 3-tier tree (`ceil(leaves / leaves_per_pod)`); 1 for 2 tiers.
    pub fn pods(&self) -> usize {
        if self.tiers == 3 {
            self.leaves().div_ceil(self.leaves_per_pod.max(1))
        } else {
            1
        }
    }

    /// Bandwidth of one leaf-to-spine (or leaf-to-aggregation) cable.
    pub fn leaf_uplink(&self) -> Bandwidth {
        Bandwidth(
            self.hosts_per_leaf as f64 * self.gpus_per_host as f64 * self.nic.0
                / self.oversubscription
                / self.spines.max(1) as f64,
        )
    }

    /// Bandwidth of one aggregation-to-core cable (3 tiers).
    pub fn core_uplink(&self) -> Bandwidth {
        let per_plane = (self.cores / self.spines.max(1)).max(1);
        Bandwidth(
            self.leaves_per_pod as f64 * self.leaf_uplink().0
                / self.core_oversubscription
                / per_plane as f64,
        )
    }

    /// Checks every field; lists every problem at once.
    pub fn validate(&self) -> Result<(), TopologyError> {
        let mut p = Problems::default();
        if self.tiers != 2 && self.tiers != 3 {
            p.push("tiers", format!("must be 2 or 3, not {}", self.tiers));
        }
        p.at_least_one("hosts", self.hosts);
        p.at_least_one("gpus_per_host", self.gpus_per_host);
        p.at_least_one("hosts_per_leaf", self.hosts_per_leaf);
        p.at_least_one("spines", self.spines);
        p.rate("nvlink", self.nvlink);
        p.rate("nic", self.nic);
        p.ratio("oversubscription", self.oversubscription);
        if self.tiers == 3 {
            p.at_least_one("leaves_per_pod", self.leaves_per_pod);
            p.ratio("core_oversubscription", self.core_oversubscription);
            if self.cores == 0 || (self.spines > 0 && !self.cores.is_multiple_of(self.spines)) {
                p.push(
                    "cores",
                    format!(
                        "must be a positive multiple of spines ({}), not {}",
                        self.spines, self.cores
                    ),
                );
            }
        }
        p.finish()?;
        let endpoints = checked_endpoints(self.hosts, self.gpus_per_host)?;
        let host_links = if self.gpus_per_host > 1 { 2 } else { 1 };
        let mut links =
            endpoints as u128 * host_links + self.leaves() as u128 * self.spines as u128;
        if self.tiers == 3 {
            // Core nodes exist whether or not a second pod uses them.
            links += self.pods() as u128 * self.cores as u128 + self.cores as u128;
        }
        check_links(2 * links, "hosts")
    }
}

impl NetGraph {
    /// Builds a rail-optimised cluster (see [`RailOptimizedSpec`] for the shape, the node
    /// order and what shortest-path routing implies).
    ///
    /// Node order: endpoints (`host * gpus_per_host + gpu`), then one NvSwitch per host
    /// (when `gpus_per_host > 1`), then leaves (`pod * gpus_per_host + rail`), then spines.
    pub fn rail_optimized(spec: &RailOptimizedSpec) -> Result<NetGraph, TopologyError> {
        let (k, uplink) = spec.plan()?;
        let (h, g) = (spec.hosts, spec.gpus_per_host);
        let mut w = Wiring::new(h * g);
        w.add_nvswitches(h, g, spec.nvlink, spec.nvlink_delay);
        let pods = spec.pods();
        let leaf0 = w.add(NodeKind::Leaf, pods * g);
        let spine0 = w.add(NodeKind::Spine, spec.spines);
        for host in 0..h {
            let pod = host / spec.hosts_per_pod;
            for gpu in 0..g {
                let leaf = leaf0 + pod * g + gpu;
                w.cable(host * g + gpu, leaf, spec.nic, spec.link_delay);
            }
        }
        for leaf in leaf0..leaf0 + pods * g {
            for spine in spine0..spine0 + spec.spines {
                for _ in 0..k {
                    w.cable(leaf, spine, uplink, spec.link_delay);
                }
            }
        }
        NetGraph::from_parts(w.kinds, w.links, g)
    }

    /// Builds a 2- or 3-tier fat-tree (see [`FatTreeSpec`]).
    ///
    /// Node order: endpoints (`host * gpus_per_host + gpu`), then one NvSwitch per host
    /// (when `gpus_per_host > 1`), then leaves, then spines (2 tiers) or aggregation
    /// switches (`pod * spines + a`, 3 tiers), then cores (`plane * cores / spines + c`).
    pub fn fat_tree(spec: &FatTreeSpec) -> Result<NetGraph, TopologyError> {
        spec.validate()?;
        let (h, g) = (spec.hosts, spec.gpus_per_host);
        let mut w = Wiring::new(h * g);
        w.add_nvswitches(h, g, spec.nvlink, spec.nvlink_delay);
        let leaves = spec.leaves();
        let leaf0 = w.add(NodeKind::Leaf, leaves);
        for host in 0..h {
            let leaf = leaf0 + host / spec.hosts_per_leaf;
            for gpu in 0..g {
                w.cable(host * g + gpu, leaf, spec.nic, spec.link_delay);
            }
        }
        let leaf_up = spec.leaf_uplink();
        if spec.tiers == 2 {
            let spine0 = w.add(NodeKind::Spine, spec.spines);
            for leaf in leaf0..leaf0 + leaves {
                for spine in spine0..spine0 + spec.spines {
                    w.cable(leaf, spine, leaf_up, spec.link_delay);
                }
            }
        } else {
            let pods = spec.pods();
            let aggs = spec.spines;
            let agg0 = w.add(NodeKind::Spine, pods * aggs);
            let core0 = w.add(NodeKind::Core, spec.cores);
            let per_plane = spec.cores / aggs;
            let core_up = spec.core_uplink();
            for leaf in 0..leaves {
                let pod = leaf / spec.leaves_per_pod;
                for a in 0..aggs {
                    w.cable(
                        leaf0 + leaf,
                        agg0 + pod * aggs + a,
                        leaf_up,
                        spec.link_delay,
                    );
                }
            }
            for pod in 0..pods {
                for a in 0..aggs {
                    for c in 0..per_plane {
                        w.cable(
                            agg0 + pod * aggs + a,
                            core0 + a * per_plane + c,
                            core_up,
                            spec.link_delay,
                        );
                    }
                }
            }
        }
        NetGraph::from_parts(w.kinds, w.links, g)
    }

    /// The nodes of one kind, in id order.
    pub fn nodes_of_kind(&self, kind: NodeKind) -> Vec<NodeId> {
        self.kinds
            .iter()
            .enumerate()
            .filter(|(_, k)| **k == kind)
            .map(|(i, _)| NodeId::from_index(i))
            .collect()
    }
}

/// Collects spec problems so that all are reported at once.
#[derive(Debug, Default)]
struct Problems(Vec<SpecProblem>);

impl Problems {
    fn push(&mut self, field: &'static str, reason: String) {
        self.0.push(SpecProblem { field, reason });
    }
    fn at_least_one(&mut self, field: &'static str, v: usize) {
        if v == 0 {
            self.push(field, "must be at least 1".to_string());
        }
    }
    fn rate(&mut self, field: &'static str, b: Bandwidth) {
        if !(b.0.is_finite() && b.0 > 0.0) {
            self.push(
                field,
                format!("bandwidth must be positive and finite, not {} B/s", b.0),
            );
        }
    }
    fn ratio(&mut self, field: &'static str, x: f64) {
        if !(x.is_finite() && x > 0.0) {
            self.push(field, format!("must be positive and finite, not {x}"));
        }
    }
    fn finish(self) -> Result<(), TopologyError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(TopologyError::InvalidSpec { problems: self.0 })
        }
    }
}

fn checked_endpoints(hosts: usize, gpus_per_host: usize) -> Result<usize, TopologyError> {
    match hosts.checked_mul(gpus_per_host) {
        Some(n) if n <= MAX_SPEC_ENDPOINTS => Ok(n),
        _ => Err(TopologyError::InvalidSpec {
            problems: vec![SpecProblem {
                field: "hosts",
                reason: format!(
                    "{hosts} hosts x {gpus_per_host} GPUs is more than {MAX_SPEC_ENDPOINTS} \
                     endpoints"
                ),
            }],
        }),
    }
}

fn check_links(links: u128, field: &'static str) -> Result<(), TopologyError> {
    if links > MAX_SPEC_LINKS as u128 {
        return Err(TopologyError::InvalidSpec {
            problems: vec![SpecProblem {
                field,
                reason: format!(
                    "the topology would have {links} directed links, more than {MAX_SPEC_LINKS}"
                ),
            }],
        });
    }
    Ok(())
}

/// `ceil(capacity / port)` parallel cables (at least 1), tolerant of float round-off.
fn parallel_cables(capacity: f64, port: f64) -> f64 {
    (capacity / port * (1.0 - 1e-12)).ceil().max(1.0)
}

/// Node kinds and links under construction, with nodes addressed by index.
#[derive(Debug)]
struct Wiring {
    kinds: Vec<NodeKind>,
    links: Vec<Link>,
}

impl Wiring {
    /// Starts with `endpoints` endpoint nodes (ids `0..endpoints`).
    fn new(endpoints: usize) -> Wiring {
        Wiring {
            kinds: vec![NodeKind::Endpoint; endpoints],
            links: Vec::new(),
        }
    }
    /// Adds `count` nodes of `kind`; returns the first one's index.
    fn add(&mut self, kind: NodeKind, count: usize) -> usize {
        let first = self.kinds.len();
        self.kinds.extend(std::iter::repeat_n(kind, count));
        first
    }
    /// One NvSwitch per host cabled to each of its GPUs (none with one GPU per host).
    fn add_nvswitches(&mut self, hosts: usize, gpus: usize, bw: Bandwidth, delay: Picos) -> usize {
        if gpus < 2 {
            return self.kinds.len();
        }
        let first = self.add(NodeKind::NvSwitch, hosts);
        for host in 0..hosts {
            for gpu in 0..gpus {
                self.cable(host * gpus + gpu, first + host, bw, delay);
            }
        }
        first
    }
    /// A cable between nodes `a` and `b`: one link each way.
    fn cable(&mut self, a: usize, b: usize, bandwidth: Bandwidth, delay: Picos) {
        let (a, b) = (NodeId::from_index(a), NodeId::from_index(b));
        self.links.push(Link {
            from: a,
            to: b,
            bandwidth,
            delay,
        });
        self.links.push(Link {
            from: b,
            to: a,
            bandwidth,
            delay,
        });
    }
}

/// A 64-bit mixing function (the SplitMix64 finaliser) for ECMP hashing.
pub fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gbps(x: f64) -> Bandwidth {
        Bandwidth::from_gbits_per_sec(x)
    }

    #[test]
    fn single_switch_routes_through_the_switch() {
        let g = NetGraph::single_switch(4, gbps(100.0), Picos::from_nanos(500)).unwrap();
        let p = g.route(0, 3, 7).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(g.link(p[0]).from, g.endpoint(0).unwrap());
        assert_eq!(g.link(p[1]).to, g.endpoint(3).unwrap());
    }

    /// The next hop as it was first written, collecting the candidates into a vector:
    /// the slow path of [`NetGraph::next_hop_of`].
    fn next_hop_by_collecting(
        g: &NetGraph,
        at: NodeId,
        dst: NodeId,
        flow_hash: u64,
        hop: u64,
        dist: &[u32],
    ) -> Option<LinkId> {
        let here = dist[at.index()];
        let to = |l: LinkId| g.links[l.index()].to;
        let mut next: Vec<LinkId> = g.out_links[at.index()]
            .iter()
            .copied()
            .filter(|&l| {
                dist[to(l).index()] == here.wrapping_sub(1)
                    && (to(l) == dst || g.kinds[to(l).index()] != NodeKind::Endpoint)
            })
            .collect();
        if next.len() > 1
            && next
                .iter()
                .any(|&l| g.kinds[to(l).index()] == NodeKind::NvSwitch)
        {
            next.retain(|&l| g.kinds[to(l).index()] == NodeKind::NvSwitch);
        }
        let pick =
            mix(flow_hash ^ hop.wrapping_mul(0x9e37_79b9_7f4a_7c15)) % next.len().max(1) as u64;
        next.get(pick as usize).copied()
    }

    /// Small fabrics with equal-cost choices: a rail-optimised one of two pods over three
    /// spines, and a two- and a three-tier fat-tree.
    fn ecmp_fabrics() -> [NetGraph; 3] {
        let rail = RailOptimizedSpec {
            hosts_per_pod: 2,
            spines: 3,
            ..RailOptimizedSpec::dgx_h100(4)
        };
        [
            NetGraph::rail_optimized(&rail).unwrap(),
            NetGraph::fat_tree(&FatTreeSpec::two_tier(4)).unwrap(),
            NetGraph::fat_tree(&FatTreeSpec::three_tier(8)).unwrap(),
        ]
    }

    #[test]
    fn every_next_hop_is_the_one_collecting_the_candidates_picks() {
        let graphs = ecmp_fabrics();
        let mut hops = 0;
        for g in &graphs {
            let n = g.num_endpoints();
            for d in (0..n).step_by(3) {
                let dst = g.endpoint(d).unwrap();
                let dist = g.distances_to(dst);
                for s in 0..n {
                    for hash in [0, 1, 7, 0xdead_beef, u64::MAX] {
                        let (mut at, mut hop) = (g.endpoint(s).unwrap(), 0);
                        while at != dst {
                            let mut pin = Pin { key: 0, stride: 1 };
                            let fast = g
                                .next_hop_of(at, dst, hash, hop, &dist, &mut pin)
                                .map(|(l, _)| l);
                            assert_eq!(fast, next_hop_by_collecting(g, at, dst, hash, hop, &dist));
                            at = g.link(fast.unwrap()).to;
                            hop += 1;
                            hops += 1;
                        }
                    }
                }
            }
        }
        assert!(hops > 10_000, "{hops}");
    }

    /// Routes on which the hash chose nothing are shared by every connection between their
    /// ends (`Routes::compute`), so that must hold for every hash; and a route that did
    /// choose must be one that other hashes change.
    #[test]
    fn a_route_the_hash_chose_nothing_on_is_every_hashs() {
        let graphs = ecmp_fabrics();
        let (mut fixed, mut chosen) = (0, 0);
        for g in &graphs {
            let n = g.num_endpoints();
            for d in (0..n).step_by(5) {
                let dst = g.endpoint(d).unwrap();
                let dist = g.distances_to(dst);
                for s in (0..n).filter(|&s| s != d) {
                    let src = g.endpoint(s).unwrap();
                    let (route, chose) = g.route_and_choice(src, dst, 0, &dist).unwrap();
                    let others: Vec<Vec<LinkId>> = (1..64u64)
                        .map(|h| {
                            g.route_with(src, dst, h.wrapping_mul(0x9e37_79b9), &dist)
                                .unwrap()
                        })
                        .collect();
                    if chose {
                        chosen += 1;
                        assert!(others.iter().any(|r| *r != route), "{s} -> {d}");
                    } else {
                        fixed += 1;
                        assert!(others.iter().all(|r| *r == route), "{s} -> {d}");
                    }
                }
            }
        }
        assert!(
            fixed > 100 && chosen > 100,
            "{fixed} fixed, {chosen} chosen"
        );
    }

    #[test]
    fn dumbbell_crosses_the_bottleneck() {
        let g = NetGraph::dumbbell(2, 2, gbps(100.0), gbps(10.0), Picos::from_nanos(1000)).unwrap();
        let p = g.route(0, 3, 1).unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!(g.link(p[1]).bandwidth, gbps(10.0));
        assert!(g.route(0, 1, 1).unwrap().len() == 2);
    }

    #[test]
    fn bad_parts_are_errors() {
        let l = Link {
            from: NodeId(0),
            to: NodeId(5),
            bandwidth: gbps(1.0),
            delay: Picos::ZERO,
        };
        assert!(NetGraph::from_parts(vec![NodeKind::Endpoint], vec![l], 1).is_err());
        assert!(NetGraph::single_switch(0, gbps(1.0), Picos::ZERO).is_err());
        let g = NetGraph::single_switch(2, gbps(1.0), Picos::ZERO).unwrap();
        assert!(g.route(0, 9, 0).is_err());
    }
}
