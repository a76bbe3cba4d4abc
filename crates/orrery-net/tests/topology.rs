#![allow(clippy::unwrap_used)]
//! Rail-optimised and fat-tree builders: shapes, routes, ECMP spread, oversubscription,
//! reachability and spec validation.

use orrery_net::topology::{FatTreeSpec, RailOptimizedSpec, Routing, TopologyError};
use orrery_net::{NetGraph, NodeKind};
use orrery_units::{Bandwidth, LinkId, NodeId, Picos};
use proptest::prelude::*;
use std::collections::BTreeSet;

fn gbps(x: f64) -> Bandwidth {
    Bandwidth::from_gbits_per_sec(x)
}

/// 4 hosts x 4 GPUs, 2 hosts per pod (2 pods), 4 spines.
fn small_rail() -> RailOptimizedSpec {
    RailOptimizedSpec {
        hosts: 4,
        gpus_per_host: 4,
        nvlink: Bandwidth::from_gbytes_per_sec(450.0),
        nvlink_delay: Picos::from_nanos(200),
        nic: gbps(400.0),
        link_delay: Picos::from_micros(1),
        hosts_per_pod: 2,
        spines: 4,
        uplink: gbps(400.0),
        spine_oversubscription: 1.0,
    }
}

fn small_fat_tree(tiers: u8) -> FatTreeSpec {
    FatTreeSpec {
        hosts: 8,
        gpus_per_host: 2,
        nvlink: Bandwidth::from_gbytes_per_sec(450.0),
        nvlink_delay: Picos::from_nanos(200),
        nic: gbps(100.0),
        link_delay: Picos::from_micros(1),
        tiers,
        hosts_per_leaf: 2,
        spines: 2,
        oversubscription: 1.0,
        leaves_per_pod: 2,
        cores: 4,
        core_oversubscription: 1.0,
    }
}

/// The kinds of the nodes a path passes through (excluding its two endpoints).
fn transit(g: &NetGraph, path: &[LinkId]) -> Vec<NodeKind> {
    path[..path.len() - 1]
        .iter()
        .map(|&l| g.kind(g.link(l).to))
        .collect()
}

fn assert_path_connects(g: &NetGraph, path: &[LinkId], src: usize, dst: usize) {
    assert_eq!(g.link(path[0]).from, g.endpoint(src).unwrap());
    assert_eq!(g.link(*path.last().unwrap()).to, g.endpoint(dst).unwrap());
    for w in path.windows(2) {
        assert_eq!(g.link(w[0]).to, g.link(w[1]).from);
    }
}

#[test]
fn rail_optimized_has_the_expected_shape() {
    let spec = small_rail();
    let g = NetGraph::rail_optimized(&spec).unwrap();
    assert_eq!(g.num_endpoints(), 16);
    assert_eq!(g.endpoints_per_host(), 4);
    assert_eq!(g.nodes_of_kind(NodeKind::NvSwitch).len(), 4);
    assert_eq!(g.nodes_of_kind(NodeKind::Leaf).len(), 2 * 4);
    assert_eq!(g.nodes_of_kind(NodeKind::Spine).len(), 4);
    // Endpoint index = host * gpus_per_host + local GPU; endpoint i is node i.
    for i in 0..16 {
        assert_eq!(g.endpoint(i).unwrap(), NodeId::from_index(i));
        let kinds: BTreeSet<_> = g
            .out_links(g.endpoint(i).unwrap())
            .iter()
            .map(|&l| format!("{:?}", g.kind(g.link(l).to)))
            .collect();
        assert_eq!(kinds.into_iter().collect::<Vec<_>>(), ["Leaf", "NvSwitch"]);
    }
    // A leaf sees one GPU of each host of its pod, all with the same local index (rail).
    for leaf in g.nodes_of_kind(NodeKind::Leaf) {
        let gpus: Vec<usize> = g
            .out_links(leaf)
            .iter()
            .map(|&l| g.link(l).to)
            .filter(|&n| g.kind(n) == NodeKind::Endpoint)
            .map(NodeId::index)
            .collect();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0] % 4, gpus[1] % 4, "one rail per leaf");
        assert_eq!(gpus[0] / 8, gpus[1] / 8, "one pod per leaf");
    }
    // Same spec, same graph.
    assert_eq!(g, NetGraph::rail_optimized(&spec).unwrap());
}

#[test]
fn rail_intra_host_traffic_uses_nvlink_only() {
    let g = NetGraph::rail_optimized(&small_rail()).unwrap();
    for host in 0..4 {
        for a in 0..4 {
            for b in 0..4 {
                if a == b {
                    continue;
                }
                let (src, dst) = (host * 4 + a, host * 4 + b);
                for hash in 0..20 {
                    let p = g.route(src, dst, hash).unwrap();
                    assert_path_connects(&g, &p, src, dst);
                    assert_eq!(transit(&g, &p), [NodeKind::NvSwitch]);
                    assert_eq!(
                        g.link(p[0]).bandwidth,
                        Bandwidth::from_gbytes_per_sec(450.0)
                    );
                    assert_eq!(g.link(p[0]).delay, Picos::from_nanos(200));
                }
            }
        }
    }
}

#[test]
fn rail_same_rail_in_a_pod_stays_on_the_leaf() {
    let g = NetGraph::rail_optimized(&small_rail()).unwrap();
    // Hosts 0 and 1 share pod 0; GPU 2 of each is on rail 2.
    for hash in 0..200 {
        let p = g.route(2, 4 + 2, hash).unwrap();
        assert_path_connects(&g, &p, 2, 6);
        assert_eq!(transit(&g, &p), [NodeKind::Leaf]);
    }
}

#[test]
fn rail_across_pods_or_rails_crosses_one_spine() {
    let g = NetGraph::rail_optimized(&small_rail()).unwrap();
    // Same rail, different pods (host 0 -> host 2).
    let p = g.route(1, 2 * 4 + 1, 9).unwrap();
    assert_path_connects(&g, &p, 1, 9);
    assert_eq!(
        transit(&g, &p),
        [NodeKind::Leaf, NodeKind::Spine, NodeKind::Leaf]
    );
    // Different rails, same pod (host 0 GPU 0 -> host 1 GPU 3): no NVLink detour.
    let p = g.route(0, 4 + 3, 9).unwrap();
    assert_eq!(
        transit(&g, &p),
        [NodeKind::Leaf, NodeKind::Spine, NodeKind::Leaf]
    );
}

#[test]
fn ecmp_spreads_flows_over_every_spine() {
    let spec = small_rail();
    let g = NetGraph::rail_optimized(&spec).unwrap();
    let dist = g.distances_to(g.endpoint(4 + 1).unwrap());
    let src = g.endpoint(0).unwrap();
    let dst = g.endpoint(4 + 1).unwrap();
    let mut spines = BTreeSet::new();
    let mut per_spine = [0u32; 4];
    let spine_ids = g.nodes_of_kind(NodeKind::Spine);
    for hash in 0..1000u64 {
        let p = g.route_with(src, dst, hash, &dist).unwrap();
        let spine = g.link(p[1]).to;
        assert_eq!(g.kind(spine), NodeKind::Spine);
        spines.insert(spine);
        per_spine[spine_ids.iter().position(|&s| s == spine).unwrap()] += 1;
    }
    assert_eq!(spines.len(), spec.spines);
    // Roughly even: each spine gets 250 +- 30% of the flows.
    for c in per_spine {
        assert!((175..=325).contains(&c), "uneven ECMP: {per_spine:?}");
    }
}

#[test]
fn rail_uplinks_are_split_into_port_speed_cables() {
    // A leaf has 8 hosts x 400G down; at 2:1 over 2 spines that is 800G per leaf-spine
    // pair, carried by 4 cables of 200G each (port speed 200G).
    let spec = RailOptimizedSpec {
        hosts: 8,
        gpus_per_host: 2,
        hosts_per_pod: 8,
        spines: 2,
        uplink: gbps(200.0),
        spine_oversubscription: 2.0,
        ..small_rail()
    };
    let g = NetGraph::rail_optimized(&spec).unwrap();
    let leaf = g.nodes_of_kind(NodeKind::Leaf)[0];
    let up: Vec<_> = g
        .out_links(leaf)
        .iter()
        .map(|&l| g.link(l))
        .filter(|l| g.kind(l.to) == NodeKind::Spine)
        .collect();
    assert_eq!(up.len(), 2 * 4);
    for l in &up {
        assert!((l.bandwidth.0 - gbps(200.0).0).abs() < 1.0);
    }
    let total_up: f64 = up.iter().map(|l| l.bandwidth.0).sum();
    assert!((total_up * 2.0 - 8.0 * gbps(400.0).0).abs() < 1.0);
    // A capacity that is not a multiple of the port speed: 3:1 gives 533.3G per pair,
    // on 3 cables of 177.8G.
    let g = NetGraph::rail_optimized(&RailOptimizedSpec {
        spine_oversubscription: 3.0,
        ..spec
    })
    .unwrap();
    let leaf = g.nodes_of_kind(NodeKind::Leaf)[0];
    let up: Vec<f64> = g
        .out_links(leaf)
        .iter()
        .map(|&l| g.link(l))
        .filter(|l| g.kind(l.to) == NodeKind::Spine)
        .map(|l| l.bandwidth.0)
        .collect();
    assert_eq!(up.len(), 2 * 3);
    assert!((up.iter().sum::<f64>() * 3.0 - 8.0 * gbps(400.0).0).abs() < 1.0);
}

#[test]
fn dgx_h100_defaults_build() {
    let spec = RailOptimizedSpec::dgx_h100(64);
    spec.validate().unwrap();
    let g = NetGraph::rail_optimized(&spec).unwrap();
    assert_eq!(g.num_endpoints(), 512);
    assert_eq!(spec.pods(), 2);
    assert_eq!(g.nodes_of_kind(NodeKind::Leaf).len(), 16);
    // 32 hosts x 400G over 16 spines at 1:1: two 400G cables per leaf-spine pair.
    let leaf = g.nodes_of_kind(NodeKind::Leaf)[0];
    let up = g
        .out_links(leaf)
        .iter()
        .filter(|&&l| g.kind(g.link(l).to) == NodeKind::Spine)
        .count();
    assert_eq!(up, 32);
    NetGraph::fat_tree(&FatTreeSpec::two_tier(64)).unwrap();
    NetGraph::fat_tree(&FatTreeSpec::three_tier(300)).unwrap();
}

#[test]
fn fat_tree_two_tier_hop_counts() {
    let g = NetGraph::fat_tree(&small_fat_tree(2)).unwrap();
    assert_eq!(g.num_endpoints(), 16);
    assert_eq!(g.nodes_of_kind(NodeKind::Leaf).len(), 4);
    assert_eq!(g.nodes_of_kind(NodeKind::Spine).len(), 2);
    assert!(g.nodes_of_kind(NodeKind::Core).is_empty());
    for hash in 0..50 {
        // Same host: NVLink, even though the shared leaf is as short.
        let p = g.route(0, 1, hash).unwrap();
        assert_eq!(transit(&g, &p), [NodeKind::NvSwitch]);
        // Same leaf (hosts 0 and 1), different hosts.
        let p = g.route(0, 2, hash).unwrap();
        assert_eq!(transit(&g, &p), [NodeKind::Leaf]);
        // Different leaves.
        let p = g.route(0, 15, hash).unwrap();
        assert_path_connects(&g, &p, 0, 15);
        assert_eq!(
            transit(&g, &p),
            [NodeKind::Leaf, NodeKind::Spine, NodeKind::Leaf]
        );
    }
}

#[test]
fn fat_tree_three_tier_hop_counts() {
    let spec = small_fat_tree(3);
    let g = NetGraph::fat_tree(&spec).unwrap();
    // 4 leaves in 2 pods of 2, 2 aggregation switches per pod, 4 cores in 2 planes.
    assert_eq!(spec.pods(), 2);
    assert_eq!(g.nodes_of_kind(NodeKind::Leaf).len(), 4);
    assert_eq!(g.nodes_of_kind(NodeKind::Spine).len(), 4);
    assert_eq!(g.nodes_of_kind(NodeKind::Core).len(), 4);
    // Same pod, different leaves: host 0 (leaf 0) -> host 2 (leaf 1).
    let p = g.route(0, 4, 3).unwrap();
    assert_eq!(
        transit(&g, &p),
        [NodeKind::Leaf, NodeKind::Spine, NodeKind::Leaf]
    );
    // Different pods: host 0 -> host 7 (leaf 3, pod 1), through a core.
    let mut cores = BTreeSet::new();
    for hash in 0..400 {
        let p = g.route(0, 15, hash).unwrap();
        assert_path_connects(&g, &p, 0, 15);
        assert_eq!(
            transit(&g, &p),
            [
                NodeKind::Leaf,
                NodeKind::Spine,
                NodeKind::Core,
                NodeKind::Spine,
                NodeKind::Leaf
            ]
        );
        cores.insert(g.link(p[2]).to);
    }
    assert_eq!(cores.len(), 4, "ECMP uses every core");
}

#[test]
fn fat_tree_uplinks_are_oversubscribed() {
    // Leaf: 2 hosts x 2 GPUs x 100G = 400G down; 4:1 over 2 spines = 50G per uplink.
    let spec = FatTreeSpec {
        oversubscription: 4.0,
        core_oversubscription: 2.0,
        ..small_fat_tree(3)
    };
    assert!((spec.leaf_uplink().0 - gbps(50.0).0).abs() < 1.0);
    // Aggregation: 2 leaves x 50G = 100G down; 2:1 over 2 cores per plane = 25G.
    assert!((spec.core_uplink().0 - gbps(25.0).0).abs() < 1.0);
    let g = NetGraph::fat_tree(&spec).unwrap();
    let mut leaf_up = 0;
    let mut core_up = 0;
    for l in g.links() {
        match (g.kind(l.from), g.kind(l.to)) {
            (NodeKind::Leaf, NodeKind::Spine) | (NodeKind::Spine, NodeKind::Leaf) => {
                assert!((l.bandwidth.0 - gbps(50.0).0).abs() < 1.0);
                leaf_up += 1;
            }
            (NodeKind::Spine, NodeKind::Core) | (NodeKind::Core, NodeKind::Spine) => {
                assert!((l.bandwidth.0 - gbps(25.0).0).abs() < 1.0);
                core_up += 1;
            }
            (NodeKind::Endpoint, NodeKind::Leaf) => assert_eq!(l.bandwidth, gbps(100.0)),
            _ => {}
        }
    }
    // 4 leaves x 2 aggregation switches, 2 pods x 2 aggregation x 2 cores; both ways.
    assert_eq!(leaf_up, 2 * 8);
    assert_eq!(core_up, 2 * 8);
    // 2-tier: the same formula.
    let two = FatTreeSpec {
        oversubscription: 2.0,
        ..small_fat_tree(2)
    };
    let g = NetGraph::fat_tree(&two).unwrap();
    let l = g
        .links()
        .iter()
        .find(|l| g.kind(l.from) == NodeKind::Leaf && g.kind(l.to) == NodeKind::Spine)
        .unwrap();
    assert!((l.bandwidth.0 - gbps(100.0).0).abs() < 1.0);
}

#[test]
fn one_gpu_per_host_has_no_nvlink_domain() {
    let g = NetGraph::rail_optimized(&RailOptimizedSpec {
        gpus_per_host: 1,
        ..small_rail()
    })
    .unwrap();
    assert!(g.nodes_of_kind(NodeKind::NvSwitch).is_empty());
    assert_eq!(g.route(0, 1, 0).unwrap().len(), 2);
    let g = NetGraph::fat_tree(&FatTreeSpec {
        gpus_per_host: 1,
        ..small_fat_tree(2)
    })
    .unwrap();
    assert!(g.nodes_of_kind(NodeKind::NvSwitch).is_empty());
}

fn assert_all_pairs_reachable(g: &NetGraph) {
    let n = g.num_endpoints();
    for dst in 0..n {
        let d = g.endpoint(dst).unwrap();
        let dist = g.distances_to(d);
        for src in 0..n {
            if src == dst {
                continue;
            }
            let s = g.endpoint(src).unwrap();
            let p = g.route_with(s, d, (src * n + dst) as u64, &dist).unwrap();
            assert_path_connects(g, &p, src, dst);
            // Endpoints never forward.
            assert!(!transit(g, &p).contains(&NodeKind::Endpoint));
            assert!(p.len() <= 6);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn every_rail_endpoint_reaches_every_other(
        hosts in 1usize..7,
        gpus in 1usize..5,
        per_pod in 1usize..4,
        spines in 1usize..4,
        oversub in 0.5f64..4.0,
    ) {
        let g = NetGraph::rail_optimized(&RailOptimizedSpec {
            hosts,
            gpus_per_host: gpus,
            hosts_per_pod: per_pod,
            spines,
            spine_oversubscription: oversub,
            ..small_rail()
        })
        .unwrap();
        prop_assert_eq!(g.num_endpoints(), hosts * gpus);
        assert_all_pairs_reachable(&g);
    }

    #[test]
    fn every_fat_tree_endpoint_reaches_every_other(
        three in any::<bool>(),
        hosts in 1usize..9,
        gpus in 1usize..4,
        per_leaf in 1usize..4,
        spines in 1usize..4,
        leaves_per_pod in 1usize..3,
        planes in 1usize..3,
    ) {
        let g = NetGraph::fat_tree(&FatTreeSpec {
            hosts,
            gpus_per_host: gpus,
            tiers: if three { 3 } else { 2 },
            hosts_per_leaf: per_leaf,
            spines,
            leaves_per_pod,
            cores: spines * planes,
            ..small_fat_tree(2)
        })
        .unwrap();
        prop_assert_eq!(g.num_endpoints(), hosts * gpus);
        assert_all_pairs_reachable(&g);
    }
}

#[test]
fn bad_rail_specs_name_every_bad_field() {
    let e = NetGraph::rail_optimized(&RailOptimizedSpec {
        hosts: 0,
        hosts_per_pod: 0,
        nic: Bandwidth(-1.0),
        uplink: Bandwidth(f64::NAN),
        spine_oversubscription: 0.0,
        spines: 0,
        ..small_rail()
    })
    .unwrap_err();
    assert_eq!(
        e.fields(),
        [
            "hosts",
            "hosts_per_pod",
            "spines",
            "nic",
            "uplink",
            "spine_oversubscription"
        ]
    );
    let msg = e.to_string();
    assert!(msg.contains("hosts_per_pod: must be at least 1"), "{msg}");
    assert!(msg.contains("nic: bandwidth must be positive"), "{msg}");

    let e = NetGraph::rail_optimized(&RailOptimizedSpec {
        gpus_per_host: 0,
        nvlink: Bandwidth(0.0),
        ..small_rail()
    })
    .unwrap_err();
    assert_eq!(e.fields(), ["gpus_per_host", "nvlink"]);

    // Absurd sizes are errors, not allocations.
    let e = NetGraph::rail_optimized(&RailOptimizedSpec {
        hosts: usize::MAX,
        ..small_rail()
    })
    .unwrap_err();
    assert_eq!(e.fields(), ["hosts"]);
    let e = NetGraph::rail_optimized(&RailOptimizedSpec {
        uplink: Bandwidth(1.0),
        ..small_rail()
    })
    .unwrap_err();
    assert_eq!(e.fields(), ["uplink"]);
}

#[test]
fn bad_fat_tree_specs_name_every_bad_field() {
    let e = NetGraph::fat_tree(&FatTreeSpec {
        tiers: 4,
        hosts_per_leaf: 0,
        oversubscription: f64::INFINITY,
        ..small_fat_tree(2)
    })
    .unwrap_err();
    assert_eq!(e.fields(), ["tiers", "hosts_per_leaf", "oversubscription"]);
    assert!(e.to_string().contains("tiers: must be 2 or 3, not 4"));

    let e = NetGraph::fat_tree(&FatTreeSpec {
        cores: 3,
        leaves_per_pod: 0,
        core_oversubscription: -1.0,
        ..small_fat_tree(3)
    })
    .unwrap_err();
    assert_eq!(
        e.fields(),
        ["leaves_per_pod", "core_oversubscription", "cores"]
    );
    // The 3-tier fields do not matter for 2 tiers.
    NetGraph::fat_tree(&FatTreeSpec {
        cores: 3,
        leaves_per_pod: 0,
        ..small_fat_tree(2)
    })
    .unwrap();
    assert!(matches!(
        NetGraph::fat_tree(&FatTreeSpec {
            gpus_per_host: 1 << 40,
            ..small_fat_tree(2)
        }),
        Err(TopologyError::InvalidSpec { .. })
    ));
}

/// The links above the leaves (leaf to spine, spine to leaf) a route crosses.
fn spine_links(g: &NetGraph, path: &[LinkId]) -> Vec<LinkId> {
    let above = |n: NodeId| matches!(g.kind(n), NodeKind::Spine | NodeKind::Core);
    path.iter()
        .copied()
        .filter(|&l| above(g.link(l).from) || above(g.link(l).to))
        .collect()
}

/// Links some two of `routes` share above the leaves.
fn shared_spine_links(g: &NetGraph, routes: &[Vec<LinkId>]) -> usize {
    let mut seen = BTreeSet::new();
    let mut shared = BTreeSet::new();
    for r in routes {
        for l in spine_links(g, r) {
            if !seen.insert(l) {
                shared.insert(l);
            }
        }
    }
    shared.len()
}

#[test]
fn pinned_routes_are_shortest_and_the_same_for_every_hash() {
    for spec_graph in [
        NetGraph::rail_optimized(&small_rail()).unwrap(),
        NetGraph::fat_tree(&small_fat_tree(2)).unwrap(),
        NetGraph::fat_tree(&small_fat_tree(3)).unwrap(),
    ] {
        let pinned = spec_graph.clone().with_routing(Routing::Pinned);
        assert_eq!(pinned.routing(), Routing::Pinned);
        let n = pinned.num_endpoints();
        for src in 0..n {
            for dst in (0..n).filter(|&d| d != src) {
                let p = pinned.route(src, dst, 0).unwrap();
                assert_path_connects(&pinned, &p, src, dst);
                assert_eq!(p.len(), spec_graph.route(src, dst, 0).unwrap().len());
                let (s, d) = (pinned.endpoint(src).unwrap(), pinned.endpoint(dst).unwrap());
                let dist = pinned.distances_to(d);
                for hash in [1, 77, u64::MAX] {
                    assert_eq!(pinned.route_with(s, d, hash, &dist).unwrap(), p);
                }
                // Nothing a hash could change: callers may keep the route for every
                // connection between the two.
                assert!(!pinned.route_and_choice(s, d, 5, &dist).unwrap().1);
            }
        }
    }
}

#[test]
fn pinned_routes_down_to_their_destinations_never_oversubscribe_a_link() {
    // Destination-mod-k: the links from the top of a route down to its destination depend
    // on the destination alone, and the destinations a link leads down to fit in it at
    // their own link speed (one per link where a tier has as many links down as it has
    // endpoints, two per link of twice the speed where it has half as many).
    for g in [
        NetGraph::rail_optimized(&small_rail()).unwrap(),
        NetGraph::rail_optimized(&RailOptimizedSpec::dgx_h100(64)).unwrap(),
        NetGraph::fat_tree(&small_fat_tree(2)).unwrap(),
        NetGraph::fat_tree(&small_fat_tree(3)).unwrap(),
        // Two pods of eight leaves, so routes cross the cores.
        NetGraph::fat_tree(&FatTreeSpec {
            leaves_per_pod: 8,
            ..FatTreeSpec::three_tier(64)
        })
        .unwrap(),
    ] {
        let g = g.with_routing(Routing::Pinned);
        let n = g.num_endpoints();
        let mut down: std::collections::BTreeMap<LinkId, BTreeSet<usize>> = Default::default();
        let mut last_link = vec![None; n];
        // Sources spread over the fabric (every 7th endpoint) keep the large graphs quick.
        for src in (0..n).step_by(7) {
            for dst in (0..n).filter(|&d| d != src) {
                let p = g.route(src, dst, 0).unwrap();
                let top = p
                    .iter()
                    .position(|&l| tier(g.kind(g.link(l).to)) < tier(g.kind(g.link(l).from)))
                    .unwrap();
                for &l in &p[top..] {
                    down.entry(l).or_default().insert(dst);
                }
                // Over NVLink or the NIC, the destination's own link down is one of its
                // links; the NIC's is the one a spine route ends on.
                if p.len() > 2 {
                    last_link[dst] = Some(*p.last().unwrap());
                }
            }
        }
        for (l, dsts) in &down {
            if dsts.len() < 2 {
                continue;
            }
            let fits: f64 = dsts
                .iter()
                .map(|&d| g.link(last_link[d].unwrap()).bandwidth.0)
                .sum();
            assert!(
                fits <= g.link(*l).bandwidth.0 * (1.0 + 1e-9),
                "link {l:?} goes down to {dsts:?}"
            );
        }
    }
}

fn tier(k: NodeKind) -> u8 {
    match k {
        NodeKind::Endpoint => 0,
        NodeKind::NvSwitch | NodeKind::Leaf | NodeKind::Switch => 1,
        NodeKind::Spine => 2,
        NodeKind::Core => 3,
    }
}

/// Every GPU of rail `rail` in pod `from` sends to the GPU of the same rail on host
/// `perm[i]` of pod `to` (DGX H100 pods of 32 hosts): the routes of the 32 flows.
fn pod_to_pod_routes(
    g: &NetGraph,
    rail: usize,
    from: usize,
    to: usize,
    perm: &[usize],
) -> Vec<Vec<LinkId>> {
    (0..32)
        .map(|i| {
            let (src, dst) = ((from * 32 + i) * 8 + rail, (to * 32 + perm[i]) * 8 + rail);
            let hash = orrery_net::flow_model::flow_hash(src as u32, dst as u32, 0);
            g.route(src, dst, hash).unwrap()
        })
        .collect()
}

#[test]
fn ecmp_collides_where_pinned_paths_do_not() {
    // 32 hosts of pod 0 each send to one host of pod 3 on rail 0: hashing puts flows
    // together on uplinks, pinning never (the 1,024-GPU GPT step's embedding all-reduce).
    let ecmp = NetGraph::rail_optimized(&RailOptimizedSpec::dgx_h100(128)).unwrap();
    let pinned = ecmp.clone().with_routing(Routing::Pinned);
    let same: Vec<usize> = (0..32).collect();
    assert!(shared_spine_links(&ecmp, &pod_to_pod_routes(&ecmp, 0, 0, 3, &same)) > 0);
    assert_eq!(
        shared_spine_links(&pinned, &pod_to_pod_routes(&pinned, 0, 0, 3, &same)),
        0
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn pinned_pod_to_pod_permutations_share_no_link_above_the_leaves(
        perm in Just((0..32usize).collect::<Vec<_>>()).prop_shuffle(),
        rail in 0..8usize,
        from in 0..4usize,
        step in 1..4usize,
    ) {
        let g = NetGraph::rail_optimized(&RailOptimizedSpec::dgx_h100(128))
            .unwrap()
            .with_routing(Routing::Pinned);
        let routes = pod_to_pod_routes(&g, rail, from, (from + step) % 4, &perm);
        prop_assert_eq!(shared_spine_links(&g, &routes), 0);
    }
}
