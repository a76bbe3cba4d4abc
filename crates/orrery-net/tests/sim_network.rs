//! The simulated network models behind the predictor's trait agree with the analytical model
//! where there is nothing for them to add (uncongested single collectives).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use orrery_net::flow_model::FlowLevelSimulator;
use orrery_net::{
    AlgorithmChoice, AnalyticalNetwork, CollectiveKind, CollectiveRequest, Fabric, GroupPlacement,
    LinkClass, NetworkModel, SimNetwork, Topology,
};
use orrery_units::{Bandwidth, Bytes, Picos};

fn fabric() -> Fabric {
    Fabric {
        gpus_per_node: 8,
        nodes: 16,
        intra_node: LinkClass {
            bandwidth: Bandwidth::from_gbytes_per_sec(450.0),
            efficiency: 0.8,
            latency: Picos::from_nanos(1_500),
        },
        inter_node: LinkClass {
            bandwidth: Bandwidth::from_gbits_per_sec(400.0),
            efficiency: 0.77,
            latency: Picos::from_nanos(5_000),
        },
        topology: Topology::RailOptimized,
    }
}

fn rel(a: Picos, b: Picos) -> f64 {
    (a.as_secs_f64() - b.as_secs_f64()).abs() / b.as_secs_f64()
}

/// The flow model sees exactly the ring's steps; the analytical model charges the same
/// bandwidth and per-step latency, so large collectives agree closely. The stated tolerance
/// is 10%: the flow model also pays each step's wire propagation (up to 4 hops of 1 us when
/// a ring wraps across rails through a spine), which the alpha-beta form folds into alpha.
#[test]
fn flow_model_agrees_with_alpha_beta_on_uncongested_rings() {
    let analytical = AnalyticalNetwork::new(
        fabric(),
        AlgorithmChoice::Fixed(orrery_net::Algorithm::Ring),
    );
    let flow = SimNetwork::new(FlowLevelSimulator::default(), fabric());
    for placement in [
        GroupPlacement::single_node(8),
        GroupPlacement {
            size: 8,
            nodes: 8,
            max_per_node: 1,
        },
        GroupPlacement {
            size: 16,
            nodes: 2,
            max_per_node: 8,
        },
    ] {
        for kind in [
            CollectiveKind::AllReduce,
            CollectiveKind::AllGather,
            CollectiveKind::ReduceScatter,
        ] {
            let req = CollectiveRequest {
                kind,
                bytes: Bytes(256 << 20),
                placement,
            };
            let a = analytical.collective(&req).time;
            let f = flow.collective(&req).time;
            assert!(
                rel(f, a) < 0.10,
                "{kind:?} on {placement:?}: flow {f} vs analytical {a}"
            );
        }
    }
    assert!(flow.failures().is_empty(), "{:?}", flow.failures());
    // Repeated questions are answered from the cache.
    let shapes = flow.simulated_shapes();
    let _ = flow.collective(&CollectiveRequest {
        kind: CollectiveKind::AllReduce,
        bytes: Bytes(256 << 20),
        placement: GroupPlacement::single_node(8),
    });
    assert_eq!(flow.simulated_shapes(), shapes);
}

#[test]
fn point_to_point_matches_the_link() {
    let flow = SimNetwork::new(FlowLevelSimulator::default(), fabric());
    let analytical = AnalyticalNetwork::new(fabric(), AlgorithmChoice::Auto);
    for same in [true, false] {
        let f = flow.point_to_point(Bytes(64 << 20), same);
        let a = analytical.point_to_point(Bytes(64 << 20), same);
        assert!(rel(f, a) < 0.05, "same node {same}: {f} vs {a}");
    }
    assert_eq!(flow.point_to_point(Bytes(0), false), Picos::ZERO);
}

/// PXN moves each host's blocks onto the destination's rail without adding to any NIC's
/// load: every NIC still sends what one GPU's share of the blocks between hosts is. On a
/// fabric that does not congest, the relayed all-to-all therefore takes about as long as
/// the direct one (within 2%: the NVLink feeds run beside the rail flows and the spine
/// hops' wire delay is gone).
#[test]
fn pxn_all_to_all_takes_about_as_long_as_direct_where_nothing_congests() {
    let pxn = SimNetwork::new(FlowLevelSimulator::default(), fabric());
    let direct = SimNetwork::new(FlowLevelSimulator::default(), fabric()).with_pxn(false);
    for (size, nodes) in [(8, 2), (16, 2), (16, 4)] {
        let request = CollectiveRequest {
            kind: CollectiveKind::AllToAll,
            bytes: Bytes(256 << 20),
            placement: GroupPlacement {
                size,
                nodes,
                max_per_node: size / nodes,
            },
        };
        let (p, d) = (
            pxn.collective(&request).time,
            direct.collective(&request).time,
        );
        assert!(
            rel(p, d) < 0.02,
            "{size} ranks on {nodes} hosts: PXN {p:?}, direct {d:?}"
        );
    }
    assert!(pxn.failures().is_empty() && direct.failures().is_empty());
}
