//! A job's training-step communication as flows: every collective instance and pipeline send
//! appears once, with the algorithm the replay costed, released by each rule (the replay's
//! times, or after what each rank waits for as simulated), and the flows simulate to
//! completion.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::small_job;
use orrery_graph::OpKind;
use orrery_net::flow_model::FlowLevelSimulator;
use orrery_net::sim::FlowSimulator;
use orrery_predict::traffic::{
    job_traffic, job_traffic_limited, job_traffic_with, Release, TrafficError, TrafficSelection,
};

#[test]
fn every_send_and_collective_instance_becomes_flows() {
    let job = small_job(&["parallel.dp=2", "training.global_batch=8"]);
    let (graph, flows) = job_traffic(&job, TrafficSelection::ALL).unwrap();
    assert_eq!(graph.num_endpoints() as u64, job.parallel().world_size());
    assert!(flows.check().is_ok());
    // Pipeline sends: one flow per send op of every rank.
    let graphs = orrery_graph::build(&job);
    let layout = &graphs.layout;
    let sends: usize = (0..layout.world_size())
        .map(|r| {
            let g = graphs.class(layout.class_of(orrery_units::RankId(r)));
            g.ops()
                .iter()
                .filter(|o| matches!(o.kind, OpKind::Send { .. }))
                .count()
        })
        .sum();
    let p2p = flows
        .collectives
        .iter()
        .filter(|c| c.kind.is_none())
        .count();
    assert_eq!(p2p, sends);
    // Collective instances: each group's collectives once, not once per member.
    // Collective instances: each group's collectives once, not once per member, so the
    // instances are the members' collective ops divided by the group sizes.
    let member_ops: f64 = (0..layout.world_size())
        .map(|r| {
            let g = graphs.class(layout.class_of(orrery_units::RankId(r)));
            g.ops()
                .iter()
                .filter_map(|o| match o.kind {
                    OpKind::Collective { group, .. } => Some(f64::from(layout.group_size(group))),
                    _ => None,
                })
                .map(|size| 1.0 / size)
                .sum::<f64>()
        })
        .sum();
    let collectives = flows
        .collectives
        .iter()
        .filter(|c| c.kind.is_some())
        .count();
    assert_eq!(collectives, member_ops.round() as usize);
    // The traffic simulates to completion.
    let report = FlowLevelSimulator::default()
        .simulate(&graph, &flows)
        .unwrap();
    assert_eq!(report.bytes_delivered, report.bytes_sent);
    assert!(report.end.0 > 0);
}

#[test]
fn selection_filters_the_traffic() {
    let job = small_job(&["parallel.dp=2", "training.global_batch=8"]);
    let pp_only = TrafficSelection::from_names(&["pp"]).unwrap();
    let (_, flows) = job_traffic(&job, pp_only).unwrap();
    assert!(!flows.flows.is_empty());
    assert!(flows.collectives.iter().all(|c| c.kind.is_none()));
    assert_eq!(
        TrafficSelection::from_names(&["dp", "xx"]).unwrap_err(),
        vec!["xx".to_string()]
    );
}

/// The flows of `set` as (collective name, source, destination, bytes), sorted: what the
/// step sends, whatever the release rule.
fn sent(set: &orrery_net::flows::FlowSet) -> Vec<(String, u32, u32, u64)> {
    let mut v: Vec<_> = set
        .flows
        .iter()
        .map(|f| {
            let name = set.collectives[f.collective as usize].name.clone();
            (name, f.src, f.dst, f.bytes.0)
        })
        .collect();
    v.sort();
    v
}

#[test]
fn released_after_dependencies_the_step_sends_the_same_flows() {
    let job = small_job(&["parallel.dp=2", "training.global_batch=8"]);
    let (_, replay) = job_traffic_with(&job, TrafficSelection::ALL, Release::Replay).unwrap();
    let (_, deps) = job_traffic_with(&job, TrafficSelection::ALL, Release::Dependencies).unwrap();
    assert!(deps.check().is_ok());
    assert_eq!(sent(&deps), sent(&replay));
    let (_, together) = job_traffic_with(&job, TrafficSelection::ALL, Release::Rendezvous).unwrap();
    assert!(together.check().is_ok());
    assert_eq!(sent(&together), sent(&replay));
    // Replay releases every collective's first flows at fixed times; with dependencies,
    // those of every op with a gate wait for other collectives' flows instead.
    let waiting = |set: &orrery_net::flows::FlowSet| {
        set.flows
            .iter()
            .filter(|f| {
                f.deps
                    .iter()
                    .any(|d| set.flows[d.index()].collective != f.collective)
            })
            .count()
    };
    assert_eq!(waiting(&replay), 0);
    assert!(waiting(&deps) > deps.flows.len() / 20, "{}", waiting(&deps));
    assert!(waiting(&together) > together.flows.len() / 20);
}

/// When each collective named `name` starts and ends at each rank in a simulation: the
/// first release of a flow the rank sends, the last finish of a flow touching it.
fn spans_at(
    set: &orrery_net::flows::FlowSet,
    report: &orrery_net::sim::SimReport,
    name: &str,
) -> std::collections::BTreeMap<(u32, usize), (u64, u64)> {
    let mut spans = std::collections::BTreeMap::new();
    for (f, out) in set.flows.iter().zip(&report.flows) {
        let c = f.collective as usize;
        if !set.collectives[c].name.contains(name) {
            continue;
        }
        for (rank, sends) in [(f.src, true), (f.dst, false)] {
            let e = spans.entry((rank, c)).or_insert((u64::MAX, 0u64));
            if sends {
                e.0 = e.0.min(out.start.0);
            }
            e.1 = e.1.max(out.finish.0);
        }
    }
    spans
}

/// The small job's two hosts on a fabric a hundred times slower than the replay assumed.
fn slow_fabric() -> orrery_net::topology::NetGraph {
    orrery_net::topology::NetGraph::rail_optimized(&orrery_net::topology::RailOptimizedSpec {
        gpus_per_host: 4,
        nvlink: orrery_units::Bandwidth::from_gbytes_per_sec(3.0),
        nic: orrery_units::Bandwidth::from_gbits_per_sec(2.0),
        uplink: orrery_units::Bandwidth::from_gbits_per_sec(2.0),
        ..orrery_net::topology::RailOptimizedSpec::dgx_h100(2)
    })
    .unwrap()
}

/// Tied embeddings on two stages: the first and last stage all-reduce the embedding's
/// gradient, then every data-parallel group all-reduces the gradient norm.
fn tied_job() -> orrery_spec::Job {
    small_job(&[
        "parallel.dp=2",
        "training.global_batch=8",
        "model.tied_embeddings=true",
    ])
}

/// The data-parallel traffic of `job` released by `release`, simulated at flow level on
/// [`slow_fabric`].
fn on_slow_fabric(
    job: &orrery_spec::Job,
    release: Release,
) -> (orrery_net::flows::FlowSet, orrery_net::sim::SimReport) {
    let dp = TrafficSelection::from_names(&["dp"]).unwrap();
    let (_, set) = job_traffic_with(job, dp, release).unwrap();
    let report = FlowLevelSimulator::default()
        .simulate(&slow_fabric(), &set)
        .unwrap();
    (set, report)
}

#[test]
fn released_after_dependencies_a_collective_waits_for_the_slow_one_it_follows() {
    let job = tied_job();
    // On a fabric a hundred times slower than the one the replay assumed, what the replay
    // put after the embedding all-reduce comes before the simulated one has finished.
    // Ranks whose gradient-norm all-reduce starts before their embedding all-reduce has
    // finished there, in the simulation:
    let early = |release: Release| {
        let (set, report) = on_slow_fabric(&job, release);
        let embedding = spans_at(&set, &report, "embedding-grad-allreduce");
        let norm = spans_at(&set, &report, "grad-norm");
        assert!(!embedding.is_empty() && !norm.is_empty());
        let mut early = 0;
        let mut checked = 0;
        for (&(rank, _), &(_, emb_end)) in &embedding {
            for (_, &(norm_start, _)) in norm.range((rank, 0)..(rank, usize::MAX)) {
                if norm_start == u64::MAX {
                    continue; // a rank that sends nothing in it
                }
                checked += 1;
                if norm_start < emb_end {
                    early += 1;
                }
            }
        }
        assert!(checked > 0);
        early
    };
    assert!(
        early(Release::Replay) > 0,
        "the open loop should overlap them"
    );
    assert_eq!(early(Release::Dependencies), 0);
    assert_eq!(early(Release::Rendezvous), 0);
}

#[test]
fn at_a_rendezvous_a_collective_starts_on_all_its_members_at_once() {
    // On a slow fabric the members' gates end at different times.
    let job = tied_job();
    // Per collective, the earliest and the latest release of its first flows (those that
    // wait for nothing of their own collective), and whether they wait for another's.
    let starts = |release: Release| {
        let (set, report) = on_slow_fabric(&job, release);
        let mut span: std::collections::BTreeMap<u32, (u64, u64, bool)> = Default::default();
        for (f, out) in set.flows.iter().zip(&report.flows) {
            if f.deps
                .iter()
                .any(|d| set.flows[d.index()].collective == f.collective)
            {
                continue;
            }
            let gated = !f.deps.is_empty();
            let e = span.entry(f.collective).or_insert((u64::MAX, 0, gated));
            e.0 = e.0.min(out.start.0);
            e.1 = e.1.max(out.start.0);
            if release == Release::Rendezvous {
                assert_eq!(e.2, gated, "all members gated or none");
            }
            e.2 |= gated;
        }
        span
    };
    let apart = |release: Release| {
        starts(release)
            .values()
            .filter(|&&(first, last, gated)| gated && first != last)
            .count()
    };
    let gated = starts(Release::Rendezvous).values().filter(|v| v.2).count();
    assert!(gated > 0);
    assert_eq!(apart(Release::Rendezvous), 0);
    assert!(
        apart(Release::Dependencies) > 0,
        "members should start apart"
    );
}

/// A collective's ranks and the (source, destination) pairs of its flows.
type Pairs = (Vec<u32>, Vec<(u32, u32)>);

/// The [`Pairs`] of every collective whose name contains `name`.
fn pairs_of(set: &orrery_net::flows::FlowSet, name: &str) -> Vec<Pairs> {
    let mut out = Vec::new();
    for (c, info) in set.collectives.iter().enumerate() {
        if info.kind.is_none() || !info.name.contains(name) {
            continue;
        }
        let pairs = set
            .flows
            .iter()
            .filter(|f| f.collective as usize == c)
            .map(|f| (f.src, f.dst))
            .collect();
        out.push((info.ranks.clone(), pairs));
    }
    out
}

/// The [`Pairs`] of the data-parallel collectives named `name` in a step of the small job
/// with `overrides` (and a global batch of 16).
fn dp_pairs(overrides: &[&str], name: &str) -> Vec<Pairs> {
    let mut all = overrides.to_vec();
    all.push("training.global_batch=16");
    let dp = TrafficSelection::from_names(&["dp"]).unwrap();
    let (_, set) = job_traffic(&small_job(&all), dp).unwrap();
    pairs_of(&set, name)
}

#[test]
fn a_small_all_reduce_across_nodes_runs_the_tree_the_replay_costed() {
    // One GPU of each data-parallel group per node: the analytical model costs the
    // gradient norm's four-byte all-reduce as a tree (4 latency-bound steps across four
    // nodes, against the ring's 6), so its flows must be a tree's, not a ring's.
    let norms = dp_pairs(
        &[
            "cluster.gpus_per_node=2",
            "cluster.nodes=8",
            "parallel.dp=4",
        ],
        "grad-norm",
    );
    assert!(!norms.is_empty());
    for (ranks, pairs) in norms {
        let n = ranks.len();
        assert_eq!(n, 4);
        let position = |r: u32| ranks.iter().position(|&x| x == r).unwrap();
        // A ring only ever sends to the next member; a tree's parents and children are not
        // all neighbours in that order, and it sends fewer flows than the ring's 2n(n-1).
        let off_ring = pairs
            .iter()
            .filter(|&&(s, d)| position(d) != (position(s) + 1) % n)
            .count();
        assert!(off_ring > 0, "{pairs:?}");
        assert!(pairs.len() < 2 * n * (n - 1), "{}", pairs.len());
    }
}

#[test]
fn gradients_of_several_gpus_per_node_run_the_hierarchy_the_replay_costed() {
    // Four members of each data-parallel group on each of two nodes: the analytical model
    // costs the gradient all-reduce hierarchically (inside each node, then across nodes
    // between GPUs of the same local index, then inside again), so no flow may cross
    // nodes between GPUs of different local indices, as a multi-channel ring's do.
    let grads = dp_pairs(
        &[
            "cluster.gpus_per_node=8",
            "cluster.nodes=4",
            "parallel.dp=8",
        ],
        "grad-reduce",
    );
    assert!(!grads.is_empty());
    for (ranks, pairs) in grads {
        assert_eq!(ranks.len(), 8);
        let node = |r: u32| r / 8;
        let local = |r: u32| {
            ranks
                .iter()
                .filter(|&&x| node(x) == node(r) && x < r)
                .count()
        };
        let crossing: Vec<_> = pairs.iter().filter(|&&(s, d)| node(s) != node(d)).collect();
        assert!(!crossing.is_empty());
        for &&(s, d) in &crossing {
            assert_eq!(
                local(s),
                local(d),
                "{s} -> {d} crosses nodes between local indices"
            );
        }
    }
}

#[test]
fn a_step_larger_than_its_memory_limit_is_refused_with_its_size() {
    let job = small_job(&["parallel.dp=2", "training.global_batch=8"]);
    let (_, all) = job_traffic(&job, TrafficSelection::ALL).unwrap();
    let record = std::mem::size_of::<orrery_net::flows::FlowSpec>() as u64;
    // Room for exactly the step's flows (their records, and the dependencies that do not
    // fit in them): the same flows as without a limit.
    let spilled: u64 = all
        .flows
        .iter()
        .filter(|f| f.deps.spilled())
        .map(|f| f.deps.capacity() as u64 * 4)
        .sum();
    assert!(spilled > 0);
    let exact = all.flows.len() as u64 * record + spilled;
    let (_, within) =
        job_traffic_limited(&job, TrafficSelection::ALL, Release::default(), exact).unwrap();
    assert_eq!(within.flows, all.flows);
    // One flow's record less: refused after the instance that crossed it, and nothing
    // about the step is hidden.
    match job_traffic_limited(&job, TrafficSelection::ALL, Release::default(), exact - 1) {
        Err(TrafficError::TooLarge {
            limit_bytes,
            done,
            instances,
            flows,
            bytes,
            ..
        }) => {
            assert_eq!(limit_bytes, exact - 1);
            assert_eq!(done, instances);
            assert_eq!(flows, all.flows.len());
            assert_eq!(bytes, exact);
        }
        other => panic!("{:?}", other.map(|(_, f)| f.flows.len())),
    }
    // A limit of one record stops at the first instance.
    match job_traffic_limited(&job, TrafficSelection::ALL, Release::default(), record) {
        Err(e @ TrafficError::TooLarge { done: 1, .. }) => {
            let text = e.to_string();
            assert!(text.contains("after 1 of its"), "{text}");
            assert!(text.contains("select fewer kinds"), "{text}");
        }
        other => panic!("{:?}", other.map(|(_, f)| f.flows.len())),
    }
}
