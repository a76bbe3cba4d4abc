//! Scenario files: valid ones build topologies and flows; invalid ones list every problem.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use orrery_net::scenario::{load_scenario, SimModel};
use orrery_net::Routing;

#[test]
fn a_ring_on_a_rail_optimised_fabric_loads() {
    let s = load_scenario(
        r#"
        name = "ring"
        [topology]
        kind = "rail_optimized"
        hosts = 4
        gpus_per_host = 8
        link_gbps = 400
        [simulator]
        model = "flow"
        [[collectives]]
        kind = "all_reduce"
        algorithm = "ring"
        channels = 8
        ranks = { first = 0, count = 32 }
        bytes = 1048576
        [[flows]]
        src = 0
        dst = 31
        bytes = 4096
        start_us = 5.0
        "#,
    )
    .unwrap();
    assert_eq!(s.graph.num_endpoints(), 32);
    assert_eq!(s.model, SimModel::Flow);
    assert_eq!(s.flows.collectives.len(), 2);
    assert!(s.flows.check().is_ok());
    assert_eq!(s.graph.routing(), Routing::Ecmp);
}

#[test]
fn a_topology_may_pin_its_paths() {
    let s = load_scenario(
        r#"
        [topology]
        kind = "fat_tree"
        hosts = 8
        routing = "pinned"
        [[flows]]
        src = 0
        dst = 63
        bytes = 4096
        "#,
    )
    .unwrap();
    assert_eq!(s.graph.routing(), Routing::Pinned);
    // A misspelt policy is refused by name.
    let e = load_scenario("[topology]\nkind = \"fat_tree\"\nhosts = 8\nrouting = \"spray\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("routing") && e.contains("spray"), "{e}");
}

#[test]
fn every_problem_is_reported_with_its_path() {
    let err = load_scenario(
        r#"
        [topology]
        kind = "single_switch"
        endpoints = 4
        link_gbps = -1
        [[flows]]
        src = 0
        dst = 9
        [[collectives]]
        kind = "all_reduce"
        algorithm = "zigzag"
        ranks = [0, 1, 1]
        bytes = 10
        "#,
    )
    .unwrap_err();
    // The wrong speed does not hide the endpoint that does not exist: the topology's
    // counts number its endpoints whatever its speeds.
    let paths = problem_paths(&err);
    assert_eq!(
        paths,
        [
            "topology.link_gbps",
            "flows[0].bytes",
            "flows[0].dst",
            "collectives[0].algorithm",
            "collectives[0].ranks",
        ],
        "{err}"
    );
}

#[test]
fn wrong_speeds_do_not_hide_the_traffics_endpoint_problems() {
    // Every speed of a rail-optimized fabric wrong, and ranks past its 16 GPUs: all are
    // reported in one pass, the ranks against the GPUs the counts give.
    let err = load_scenario(
        r#"
        [topology]
        kind = "rail_optimized"
        hosts = 2
        gpus_per_host = 8
        link_gbps = 0
        nvlink_gbytes = -5
        [[collectives]]
        kind = "all_reduce"
        ranks = { first = 8, count = 9 }
        bytes = 1000
        "#,
    )
    .unwrap_err();
    let paths = problem_paths(&err);
    assert_eq!(
        paths,
        [
            "topology.link_gbps",
            "topology.nvlink_gbytes",
            "collectives[0].ranks",
        ],
        "{err}"
    );
    assert!(err.to_string().contains("the topology has 16"), "{err}");
    // A wrong kind or count still leaves the endpoints unknown, and nothing is said of
    // the traffic's.
    let err = load_scenario(
        "[topology]\nkind = \"single_switch\"\nendpoints = 0\n[[flows]]\nsrc = 0\ndst = 7\nbytes = 1\n",
    )
    .unwrap_err();
    let paths = problem_paths(&err);
    assert_eq!(paths, ["topology.endpoints"], "{err}");
}

#[test]
fn syntax_errors_and_unknown_fields_are_errors() {
    assert!(load_scenario("[topology\n").is_err());
    let e = load_scenario("[topology]\nkind = \"single_switch\"\nendpoint = 3\n").unwrap_err();
    assert!(e.to_string().contains("endpoint"), "{e}");
    let e = load_scenario("[topology]\nkind = \"single_switch\"\nendpoints = 2\n").unwrap_err();
    assert!(e.to_string().contains("no traffic"), "{e}");
}

#[test]
fn every_mistyped_or_unknown_field_is_reported_at_once() {
    let err = load_scenario(
        r#"
        colour = "blue"
        [topology]
        kind = "ring_of_fire"
        endpoints = "four"
        [[flows]]
        src = 0
        dst = "one"
        bytes = 10
        [[flows]]
        src = 1
        destination = 0
        [[collectives]]
        kind = "all_reduce"
        channels = -1
        "#,
    )
    .unwrap_err();
    let paths = problem_paths(&err);
    assert_eq!(
        paths,
        [
            "collectives[0].channels",
            "colour",
            "flows[0].dst",
            "flows[1].destination",
            "topology.endpoints",
            "topology.kind",
        ],
        "{err}"
    );
}

#[test]
fn a_pxn_all_to_all_loads_with_its_relayed_blocks() {
    let text = |algorithm: &str| {
        format!(
            r#"
            name = "a2a"
            [topology]
            kind = "rail_optimized"
            hosts = 2
            gpus_per_host = 4
            [[collectives]]
            kind = "all_to_all"
            algorithm = "{algorithm}"
            ranks = {{ first = 0, count = 8 }}
            bytes = 8000
            "#
        )
    };
    let direct = load_scenario(&text("direct")).unwrap();
    let pxn = load_scenario(&text("direct_pxn")).unwrap();
    assert_eq!(direct.flows.flows.len(), 56);
    // Each GPU's blocks to the three GPUs of the other host on other rails are relayed.
    assert_eq!(pxn.flows.flows.len(), 56 + 8 * 3);
    assert!(pxn.flows.check().is_ok());
}

/// The paths of a scenario's problems, in the order reported.
fn problem_paths(err: &orrery_net::scenario::ScenarioError) -> Vec<&str> {
    err.0.iter().map(|p| p.path.as_str()).collect()
}
