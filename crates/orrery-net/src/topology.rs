//! Topologies: endpoints (GPUs with their NICs), switches and directed links, and routing.
//!
//! A [`NetGraph`] is an arena of nodes and directed links. Every physical cable is two
//! links, one per direction, so each direction has its own bandwidth, delay and (in the
//! packet model) its own egress queue at the sending node. Endpoint `i` (a GPU) is
//! `graph.endpoint(i)`; ranks of a job map to endpoints one to one.
//!
//! Routing is shortest-path with equal-cost multi-path: among all shortest paths from a
//! source to a destination, a flow takes the one chosen hop by hop by a deterministic hash
//! of the flow's identity (its `flow_hash`) and the hop's index, like switch ECMP hashing on
//! the 5-tuple. The same flow always takes the same path; different flows spread.
//!
//! What this module does not do: adaptive routing, failures, or per-packet spraying.

use orrery_units::{Bandwidth, LinkId, NodeId, Picos};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

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
}

/// A network topology: nodes, directed links, and the endpoints in rank order.
#[derive(Debug, Clone, PartialEq)]
pub struct NetGraph {
    kinds: Vec<NodeKind>,
    links: Vec<Link>,
    out_links: Vec<Vec<LinkId>>,
    endpoints: Vec<NodeId>,
    /// Hosts: the endpoint index range of each host (`endpoints_per_host` each), if the
    /// topology has hosts; used to tell intra-host from inter-host traffic.
    endpoints_per_host: usize,
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
            endpoints,
            endpoints_per_host: endpoints_per_host.max(1),
        })
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
        let mut into: Vec<Vec<NodeId>> = vec![Vec::new(); n];
        for l in &self.links {
            into[l.to.index()].push(l.from);
        }
        let mut dist = vec![u32::MAX; n];
        let mut q = VecDeque::new();
        dist[dst.index()] = 0;
        q.push_back(dst);
        while let Some(v) = q.pop_front() {
            // Endpoints other than the destination do not forward.
            if v != dst && self.kinds[v.index()] == NodeKind::Endpoint {
                continue;
            }
            for &u in &into[v.index()] {
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
        let no_route = TopologyError::NoRoute {
            from: src.0,
            to: dst.0,
        };
        if dist.get(src.index()).copied().unwrap_or(u32::MAX) == u32::MAX {
            return Err(no_route);
        }
        let mut path = Vec::new();
        let mut at = src;
        let mut hop = 0u64;
        while at != dst {
            let here = dist[at.index()];
            let next: Vec<LinkId> = self.out_links[at.index()]
                .iter()
                .copied()
                .filter(|&l| dist[self.links[l.index()].to.index()] == here.wrapping_sub(1))
                .collect();
            if next.is_empty() {
                return Err(no_route);
            }
            let pick = (mix(flow_hash ^ hop.wrapping_mul(0x9e37_79b9_7f4a_7c15))
                % next.len() as u64) as usize;
            let l = next[pick];
            path.push(l);
            at = self.links[l.index()].to;
            hop += 1;
        }
        Ok(path)
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
