//! Chakra ET export and import: exact round trips, group ids, the comm-group side file,
//! foreign traces, and corrupt input.
#![allow(clippy::unwrap_used)]

use orrery_graph::chakra::proto::{
    attribute_proto::Value, AttributeProto, CollectiveCommType, GlobalMetadata, Node, NodeType,
};
use orrery_graph::chakra::{
    comm_groups_json, export_rank, export_rank_with_times, group_of_pg_name, import_rank, pg_name,
    ChakraError, OpTime,
};
use orrery_graph::{
    build, CollectiveOp, ComputeKind, GroupRole, JobGraphs, OpKind, PeerStage, Phase, Stream,
};
use orrery_spec::{load_job_spec, Job};
use orrery_units::{Bytes, OpId, Picos, RankId};
use proptest::prelude::*;
use prost::Message;
use std::sync::OnceLock;

/// 2 layers, TP 2 x PP 2 x DP 2 on two nodes of four GPUs.
const SMALL: &str = r#"
[model]
layers = 2
hidden = 256
heads = 4
ffn = 1024
vocab = 1024
seq_len = 128

[training]
global_batch = 8
micro_batch = 1

[parallel]
tp = 2
pp = 2
dp = 2
vpp = 1

[cluster]
gpu = "H100-SXM"
gpus_per_node = 4
nodes = 2
"#;

/// Every kind of op: MoE with expert parallelism, context parallelism, interleaved 1F1B,
/// the distributed optimizer, tied embeddings across the pipeline.
const RICH: &str = r#"
[model]
layers = 4
hidden = 256
heads = 4
ffn = 1024
vocab = 1024
seq_len = 256
tied_embeddings = true

[model.moe]
experts = 4
top_k = 2
expert_ffn = 512

[training]
global_batch = 8
micro_batch = 1
zero_stage = 1

[parallel]
tp = 2
cp = 2
pp = 2
dp = 2
ep = 2
vpp = 2

[cluster]
gpu = "H100-SXM"
gpus_per_node = 8
nodes = 2
"#;

fn graphs(text: &str) -> JobGraphs {
    let spec = load_job_spec(text, &[]).unwrap_or_else(|e| panic!("{e}"));
    let job = Job::from_spec(&spec).unwrap_or_else(|e| panic!("{e}"));
    build(&job)
}

fn export(g: &JobGraphs, rank: u32) -> Vec<u8> {
    let mut out = Vec::new();
    export_rank(g, RankId(rank), &mut out).unwrap();
    out
}

/// The messages of a trace, decoded with prost's own length-delimited reader.
fn decode(bytes: &[u8]) -> (GlobalMetadata, Vec<Node>) {
    let mut buf = bytes;
    let meta = GlobalMetadata::decode_length_delimited(&mut buf).unwrap();
    let mut nodes = Vec::new();
    while !buf.is_empty() {
        nodes.push(Node::decode_length_delimited(&mut buf).unwrap());
    }
    (meta, nodes)
}

fn encode(meta: &GlobalMetadata, nodes: &[Node]) -> Vec<u8> {
    let mut out = meta.encode_length_delimited_to_vec();
    for n in nodes {
        out.extend(n.encode_length_delimited_to_vec());
    }
    out
}

fn attr<'a>(n: &'a Node, name: &str) -> Option<&'a Value> {
    n.attr
        .iter()
        .find(|a| a.name == name)
        .and_then(|a| a.value.as_ref())
}

fn round_trip_every_rank(g: &JobGraphs) {
    let layout = &g.layout;
    for r in 0..layout.world_size() {
        let rank = RankId(r);
        let class = g.class(layout.class_of(rank));
        let bytes = export(g, r);
        let imported = import_rank(&bytes).unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(imported.rank, Some(rank));
        assert_eq!(imported.skipped, 0);
        assert_eq!(imported.nodes.len(), class.len());
        assert_eq!(imported.graph.len(), class.len());
        for (i, (a, b)) in imported.graph.ops().iter().zip(class.ops()).enumerate() {
            assert_eq!(a, b, "rank {r} op {i}");
            assert_eq!(imported.graph.name_of(a), class.name_of(b));
        }
        assert_eq!(imported.graph, *class, "rank {r}");

        // Concrete groups and peers, both as import reports them and as the raw trace
        // spells them for ASTRA-sim.
        let (_, nodes) = decode(&bytes);
        for (i, op) in class.ops().iter().enumerate() {
            let info = &imported.nodes[i];
            assert_eq!(info.id, i as u64);
            assert!(!info.is_cpu_op);
            match op.kind {
                OpKind::Collective { group, .. } => {
                    let gid = layout.group_id(rank, group);
                    assert_eq!(info.group, Some(gid));
                    assert_eq!(info.comm_group.as_deref(), Some(pg_name(gid).as_str()));
                    let Some(Value::StringVal(pg)) = attr(&nodes[i], "pg_name") else {
                        panic!("no pg_name on node {i}");
                    };
                    assert_eq!(group_of_pg_name(pg), Some(gid));
                    assert!(layout.group_members(rank, group).contains(&rank));
                }
                OpKind::Send { peer, .. } | OpKind::Recv { peer, .. } => {
                    let other = layout.peer(rank, peer);
                    assert_eq!(info.peer, Some(other));
                    let send = matches!(op.kind, OpKind::Send { .. });
                    let (src, dst) = if send { (rank, other) } else { (other, rank) };
                    assert_eq!(
                        attr(&nodes[i], "comm_src"),
                        Some(&Value::Int32Val(src.0 as i32))
                    );
                    assert_eq!(
                        attr(&nodes[i], "comm_dst"),
                        Some(&Value::Int32Val(dst.0 as i32))
                    );
                }
                _ => {
                    assert_eq!(info.group, None);
                    assert_eq!(info.peer, None);
                }
            }
        }
    }
}

#[test]
fn every_rank_round_trips_exactly() {
    round_trip_every_rank(&graphs(SMALL));
}

#[test]
fn every_kind_of_op_round_trips_exactly() {
    let g = graphs(RICH);
    let mut seen = std::collections::BTreeSet::new();
    for class in &g.classes {
        for op in class.ops() {
            let what = match op.kind {
                OpKind::Compute { kind, .. } => match kind {
                    ComputeKind::Gemm { .. } => "gemm",
                    ComputeKind::Attention { .. } => "attention",
                    ComputeKind::MemoryBound => "memory-bound",
                },
                OpKind::Collective { group, .. } => match group {
                    GroupRole::Tp => "tp",
                    GroupRole::Cp => "cp",
                    GroupRole::Dp => "dp",
                    GroupRole::DpCp => "dp-cp",
                    GroupRole::Ep => "ep",
                    GroupRole::ExpertDp => "expert-dp",
                    GroupRole::Embedding => "embedding",
                    GroupRole::World => "world",
                },
                OpKind::Send { .. } => "send",
                OpKind::Recv { .. } => "recv",
                OpKind::Alloc { .. } => "alloc",
                OpKind::Free { .. } => "free",
            };
            seen.insert(what);
        }
    }
    for want in [
        "gemm",
        "attention",
        "memory-bound",
        "tp",
        "cp",
        "dp-cp",
        "ep",
        "embedding",
        "send",
        "recv",
        "alloc",
        "free",
    ] {
        assert!(
            seen.contains(want),
            "the rich job has no {want} op: {seen:?}"
        );
    }
    round_trip_every_rank(&g);
}

#[test]
fn export_is_deterministic_and_orders_streams_for_astra_sim() {
    let g = graphs(SMALL);
    for r in [0, 5] {
        let bytes = export(&g, r);
        assert_eq!(bytes, export(&g, r));
        let (meta, nodes) = decode(&bytes);
        assert_eq!(meta.version, "0.0.4");
        let class = g.class(g.layout.class_of(RankId(r)));
        assert_eq!(nodes.len(), class.len());
        // Every op that occupies a stream waits, through data_deps (the list ASTRA-sim
        // resolves), for the previous such op on its stream.
        let mut last: [Option<usize>; 6] = [None; 6];
        for (i, op) in class.ops().iter().enumerate() {
            let n = &nodes[i];
            assert_eq!(attr(n, "is_cpu_op"), Some(&Value::BoolVal(false)));
            for d in &op.deps {
                assert!(n.data_deps.contains(&u64::from(d.0)));
            }
            let on_stream = matches!(
                op.kind,
                OpKind::Compute { .. } | OpKind::Collective { .. } | OpKind::Send { .. }
            );
            if on_stream {
                if let Some(p) = last[op.stream.index()] {
                    assert!(n.data_deps.contains(&(p as u64)), "node {i}");
                }
                last[op.stream.index()] = Some(i);
            }
            let ty = NodeType::try_from(n.r#type).unwrap();
            match op.kind {
                OpKind::Compute { flops, bytes, .. } => {
                    assert_eq!(ty, NodeType::CompNode);
                    assert_eq!(
                        attr(n, "num_ops"),
                        Some(&Value::Int64Val(flops.0.round() as i64))
                    );
                    assert_eq!(attr(n, "tensor_size"), Some(&Value::Uint64Val(bytes.0)));
                }
                OpKind::Collective { op: c, bytes, .. } => {
                    assert_eq!(ty, NodeType::CommCollNode);
                    let ct = match c {
                        CollectiveOp::AllReduce => CollectiveCommType::AllReduce,
                        CollectiveOp::AllGather => CollectiveCommType::AllGather,
                        CollectiveOp::ReduceScatter => CollectiveCommType::ReduceScatter,
                        CollectiveOp::AllToAll => CollectiveCommType::AllToAll,
                        CollectiveOp::Broadcast => CollectiveCommType::Broadcast,
                    };
                    assert_eq!(attr(n, "comm_type"), Some(&Value::Int64Val(ct as i64)));
                    assert_eq!(attr(n, "comm_size"), Some(&Value::Int64Val(bytes.0 as i64)));
                }
                OpKind::Send { .. } => assert_eq!(ty, NodeType::CommSendNode),
                OpKind::Recv { .. } => assert_eq!(ty, NodeType::CommRecvNode),
                OpKind::Alloc { .. } | OpKind::Free { .. } => {
                    assert_eq!(ty, NodeType::CompNode);
                    assert_eq!(attr(n, "tensor_size"), Some(&Value::Uint64Val(0)));
                }
            }
        }
    }
}

#[test]
fn sends_and_receives_match_across_ranks() {
    // A send on one rank and the receive on its peer carry the same comm_tag and size.
    let g = graphs(SMALL);
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for r in 0..g.layout.world_size() {
        let (_, nodes) = decode(&export(&g, r));
        for n in nodes {
            let key = (
                attr(&n, "comm_src").cloned().map(|v| format!("{v:?}")),
                attr(&n, "comm_dst").cloned().map(|v| format!("{v:?}")),
                attr(&n, "comm_tag").cloned().map(|v| format!("{v:?}")),
                attr(&n, "comm_size").cloned().map(|v| format!("{v:?}")),
            );
            match NodeType::try_from(n.r#type) {
                Ok(NodeType::CommSendNode) => sends.push(key),
                Ok(NodeType::CommRecvNode) => recvs.push(key),
                _ => {}
            }
        }
    }
    assert!(!sends.is_empty());
    sends.sort();
    recvs.sort();
    assert_eq!(sends, recvs);
}

#[test]
fn times_are_written_in_micros() {
    let g = graphs(SMALL);
    let ops = g.class(g.layout.class_of(RankId(0))).len();
    let times: Vec<OpTime> = (0..ops as u64)
        .map(|i| OpTime {
            start: Picos::from_micros(10 * i),
            duration: Picos(2_600_000),
        })
        .collect();
    let mut out = Vec::new();
    export_rank_with_times(&g, RankId(0), &times, &mut out).unwrap();
    let imported = import_rank(&out).unwrap();
    assert_eq!(imported.nodes[3].start, Some(Picos::from_micros(30)));
    assert_eq!(imported.nodes[3].duration, Some(Picos::from_micros(3)));
    assert_eq!(imported.graph, *g.class(g.layout.class_of(RankId(0))));

    let err = export_rank_with_times(&g, RankId(0), &times[1..], &mut Vec::new());
    assert!(
        matches!(err, Err(ChakraError::TimesMismatch { .. })),
        "{err:?}"
    );
    let err = export_rank(&g, RankId(8), &mut Vec::new());
    assert!(
        matches!(err, Err(ChakraError::RankOutOfRange { rank: 8, world: 8 })),
        "{err:?}"
    );
}

#[test]
fn comm_groups_json_lists_every_group() {
    let g = graphs(RICH);
    let text = comm_groups_json(&g);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let obj = v.as_object().unwrap();
    let groups: Vec<_> = g.layout.all_groups().collect();
    assert_eq!(obj.len(), groups.len());
    for (gid, _, members) in groups {
        let listed: Vec<u32> = obj[&pg_name(gid)]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let want: Vec<u32> = members.iter().map(|r| r.0).collect();
        assert_eq!(listed, want);
    }
    // No key is "0", which ASTRA-sim reads as "all ranks".
    assert!(!obj.contains_key("0"));
    // Every group a trace names is in the side file.
    for r in 0..g.layout.world_size() {
        for info in import_rank(&export(&g, r)).unwrap().nodes {
            if let Some(pg) = info.comm_group {
                assert!(obj.contains_key(&pg), "{pg}");
            }
        }
    }
}

// ---- foreign traces (standard Chakra attributes only) ----

fn node(id: u64, name: &str, ty: NodeType, data: &[u64], attr: Vec<AttributeProto>) -> Node {
    Node {
        id,
        name: name.to_string(),
        r#type: ty as i32,
        data_deps: data.to_vec(),
        attr,
        ..Node::default()
    }
}

fn foreign_meta() -> GlobalMetadata {
    GlobalMetadata {
        version: "0.0.4".to_string(),
        attr: Vec::new(),
    }
}

#[test]
fn foreign_trace_imports() {
    // Ids are not op indices, a metadata node sits in the middle, node 40 is listed before
    // node 30 it depends on, and a control dependency joins the two compute nodes.
    let mut gemm = node(
        30,
        "aten::mm",
        NodeType::CompNode,
        &[10],
        vec![
            AttributeProto::bool("is_cpu_op", false),
            AttributeProto::int64("num_ops", 2 * 64 * 64 * 64),
            AttributeProto::uint64("tensor_size", 3 * 2 * 64 * 64),
        ],
    );
    gemm.duration_micros = 12;
    let nodes = vec![
        node(
            10,
            "aten::relu",
            NodeType::CompNode,
            &[],
            vec![AttributeProto::uint64("tensor_size", 4096)],
        ),
        node(
            40,
            "nccl:all_reduce",
            NodeType::CommCollNode,
            &[20],
            vec![
                AttributeProto::bool("is_cpu_op", false),
                AttributeProto::int64("comm_type", CollectiveCommType::AllReduce as i64),
                AttributeProto::int64("comm_size", 1 << 20),
                AttributeProto::string("pg_name", "3"),
            ],
        ),
        node(
            20,
            "process_group:init",
            NodeType::MetadataNode,
            &[30],
            vec![],
        ),
        gemm,
        node(
            50,
            "send",
            NodeType::CommSendNode,
            &[40],
            vec![
                AttributeProto::int32("comm_src", 0),
                AttributeProto::int32("comm_dst", 4),
                AttributeProto::int32("comm_tag", 7),
                AttributeProto::int64("comm_size", 1000),
            ],
        ),
        Node {
            ctrl_deps: vec![50],
            ..node(
                60,
                "recv",
                NodeType::CommRecvNode,
                &[],
                vec![
                    AttributeProto::int32("comm_src", 4),
                    AttributeProto::int32("comm_dst", 0),
                    AttributeProto::int32("comm_tag", -1),
                    AttributeProto::int64("comm_size", 1000),
                ],
            )
        },
        node(
            70,
            "c10d::reduce_scatter_block",
            NodeType::CommCollNode,
            &[60],
            vec![
                AttributeProto::int64("comm_type", CollectiveCommType::ReduceScatterBlock as i64),
                AttributeProto::int64("comm_size", 64),
            ],
        ),
    ];
    let imported = import_rank(&encode(&foreign_meta(), &nodes)).unwrap();
    assert_eq!(imported.rank, None);
    assert_eq!(imported.skipped, 1);
    let g = &imported.graph;
    let ids: Vec<u64> = imported.nodes.iter().map(|n| n.id).collect();
    assert_eq!(ids, [10, 30, 40, 50, 60, 70]);
    let names: Vec<&str> = g.ops().iter().map(|o| g.name_of(o)).collect();
    assert_eq!(
        names,
        [
            "aten::relu",
            "aten::mm",
            "nccl:all_reduce",
            "send",
            "recv",
            "c10d::reduce_scatter_block"
        ]
    );
    let deps: Vec<Vec<u32>> = g
        .ops()
        .iter()
        .map(|o| o.deps.iter().map(|d| d.0).collect())
        .collect();
    // The all-reduce depends on the GEMM through the dropped metadata node.
    assert_eq!(
        deps,
        vec![vec![], vec![0], vec![1], vec![2], vec![3], vec![4]]
    );
    let ops = g.ops();
    assert_eq!(
        ops[0].kind,
        OpKind::Compute {
            kind: ComputeKind::MemoryBound,
            flops: orrery_units::Flops(0.0),
            bytes: Bytes(4096)
        }
    );
    assert_eq!(
        ops[1].kind,
        OpKind::Compute {
            kind: ComputeKind::Gemm {
                m: 64,
                n: 64,
                k: 64,
                batch: 1,
                fp8: false
            },
            flops: orrery_units::Flops((2 * 64 * 64 * 64) as f64),
            bytes: Bytes(3 * 2 * 64 * 64)
        }
    );
    assert_eq!(imported.nodes[1].duration, Some(Picos::from_micros(12)));
    assert_eq!(imported.nodes[0].duration, None);
    assert_eq!(
        ops[2].kind,
        OpKind::Collective {
            op: CollectiveOp::AllReduce,
            group: GroupRole::Dp,
            bytes: Bytes(1 << 20)
        }
    );
    assert_eq!(ops[2].stream, Stream::DpComm);
    assert_eq!(imported.nodes[2].comm_group.as_deref(), Some("3"));
    assert_eq!(imported.nodes[2].group, None);
    assert_eq!(
        ops[3].kind,
        OpKind::Send {
            peer: PeerStage::Next,
            bytes: Bytes(1000),
            tag: 7
        }
    );
    assert_eq!(imported.nodes[3].peer, Some(RankId(4)));
    assert_eq!(
        ops[4].kind,
        OpKind::Recv {
            peer: PeerStage::Prev,
            bytes: Bytes(1000),
            tag: u64::from(u32::MAX)
        }
    );
    assert_eq!(imported.nodes[4].peer, Some(RankId(4)));
    assert_eq!(ops[4].stream, Stream::PpComm);
    assert_eq!(
        ops[5].kind,
        OpKind::Collective {
            op: CollectiveOp::ReduceScatter,
            group: GroupRole::Dp,
            bytes: Bytes(64)
        }
    );
    for o in ops {
        assert_eq!(o.phase, Phase::Forward);
        assert_eq!(o.microbatch, None);
    }
    g.check().unwrap();
}

#[test]
fn forward_dependencies_are_sorted_deterministically() {
    // File order c, b, a with c -> b -> a; d is independent and stays ahead of its
    // successors in file order.
    let comp = |id, name: &str, deps: &[u64]| {
        node(
            id,
            name,
            NodeType::CompNode,
            deps,
            vec![AttributeProto::uint64("tensor_size", 1)],
        )
    };
    let nodes = vec![
        comp(3, "c", &[2]),
        comp(4, "d", &[]),
        comp(2, "b", &[1]),
        comp(1, "a", &[]),
    ];
    let bytes = encode(&foreign_meta(), &nodes);
    let a = import_rank(&bytes).unwrap();
    let names: Vec<&str> = a.graph.ops().iter().map(|o| a.graph.name_of(o)).collect();
    assert_eq!(names, ["d", "a", "b", "c"]);
    assert_eq!(a.graph.ops()[3].deps, vec![OpId(2)]);
    assert_eq!(import_rank(&bytes).unwrap(), a);
}

#[test]
fn empty_trace_with_metadata_is_an_empty_graph() {
    let a = import_rank(&encode(&foreign_meta(), &[])).unwrap();
    assert!(a.graph.is_empty());
    assert_eq!(a.version, "0.0.4");
}

// ---- corrupt input ----

#[test]
fn corrupt_inputs_are_errors() {
    let comp = |id, deps: &[u64]| node(id, "x", NodeType::CompNode, deps, vec![]);
    let meta = foreign_meta();

    assert!(matches!(import_rank(&[]), Err(ChakraError::Empty)));
    assert!(matches!(
        import_rank(&[0x80]),
        Err(ChakraError::BadLength {
            message: 0,
            offset: 0
        })
    ));
    let valid = encode(&meta, &[comp(1, &[])]);
    let mut cut = valid.clone();
    cut.pop();
    assert!(matches!(
        import_rank(&cut),
        Err(ChakraError::TruncatedMessage { message: 1, .. })
    ));
    // A node message of one byte that is not a valid field.
    let mut bad = meta.encode_length_delimited_to_vec();
    bad.extend(comp(1, &[]).encode_length_delimited_to_vec());
    bad.extend([1, 0xff]);
    assert!(
        matches!(import_rank(&bad), Err(ChakraError::Decode { index: 1, .. })),
        "{:?}",
        import_rank(&bad)
    );
    let r = import_rank(&encode(&meta, &[comp(1, &[9])]));
    assert!(
        matches!(r, Err(ChakraError::UnknownDependency { id: 1, dep: 9 })),
        "{r:?}"
    );
    let r = import_rank(&encode(
        &meta,
        &[comp(1, &[3]), comp(2, &[1]), comp(3, &[2])],
    ));
    assert!(matches!(r, Err(ChakraError::Cycle { .. })), "{r:?}");
    let r = import_rank(&encode(&meta, &[comp(1, &[1])]));
    assert!(matches!(r, Err(ChakraError::Cycle { id: 1 })), "{r:?}");
    let r = import_rank(&encode(&meta, &[comp(1, &[]), comp(1, &[])]));
    assert!(
        matches!(
            r,
            Err(ChakraError::DuplicateId {
                id: 1,
                first: 0,
                second: 1
            })
        ),
        "{r:?}"
    );
    let mut weird = comp(1, &[]);
    weird.r#type = 99;
    let r = import_rank(&encode(&meta, &[weird]));
    assert!(
        matches!(
            r,
            Err(ChakraError::BadNode {
                index: 0,
                id: 1,
                ..
            })
        ),
        "{r:?}"
    );
    let coll = node(
        1,
        "x",
        NodeType::CommCollNode,
        &[],
        vec![AttributeProto::int64("comm_type", 42)],
    );
    let r = import_rank(&encode(&meta, &[coll]));
    assert!(matches!(r, Err(ChakraError::BadNode { .. })), "{r:?}");
    let neg = node(
        1,
        "x",
        NodeType::CompNode,
        &[],
        vec![AttributeProto::int64("num_ops", -5)],
    );
    let r = import_rank(&encode(&meta, &[neg]));
    assert!(matches!(r, Err(ChakraError::BadNode { .. })), "{r:?}");
    // A free of something that is not an allocation.
    let free = node(
        2,
        "free",
        NodeType::CompNode,
        &[1],
        vec![
            AttributeProto::string("orrery.mem", "free"),
            AttributeProto::uint64("orrery.alloc", 1),
            AttributeProto::string("orrery.stream", "compute"),
        ],
    );
    let r = import_rank(&encode(&meta, &[comp(1, &[]), free]));
    assert!(matches!(r, Err(ChakraError::Graph(_))), "{r:?}");
    let bad_stream = node(
        1,
        "x",
        NodeType::CompNode,
        &[],
        vec![AttributeProto::string("orrery.stream", "warp-drive")],
    );
    let r = import_rank(&encode(&meta, &[bad_stream]));
    assert!(matches!(r, Err(ChakraError::BadNode { .. })), "{r:?}");
    // Errors print what is wrong.
    assert!(r.unwrap_err().to_string().contains("warp-drive"));
}

#[test]
fn passing_through_dropped_nodes_is_bounded() {
    // One metadata node between 1100 producers and 1100 consumers would become 1.2 million
    // edges.
    let n = 1100u64;
    let comp = |id, deps: Vec<u64>| node(id, "x", NodeType::CompNode, &deps, vec![]);
    let mut nodes: Vec<Node> = (0..n).map(|i| comp(i, vec![])).collect();
    nodes.push(node(
        n,
        "pg",
        NodeType::MetadataNode,
        &(0..n).collect::<Vec<_>>(),
        vec![],
    ));
    nodes.extend((0..n).map(|i| comp(n + 1 + i, vec![n])));
    let r = import_rank(&encode(&foreign_meta(), &nodes));
    assert!(
        matches!(r, Err(ChakraError::TooManyDependencies { .. })),
        "{:?}",
        r.map(|a| a.graph.len())
    );
}

fn valid_trace() -> &'static [u8] {
    static TRACE: OnceLock<Vec<u8>> = OnceLock::new();
    TRACE.get_or_init(|| export(&graphs(SMALL), 5))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = import_rank(&bytes);
    }

    #[test]
    fn truncated_traces_never_panic(frac in 0.0f64..1.0) {
        let t = valid_trace();
        let cut = ((t.len() as f64) * frac) as usize;
        // orrery's traces carry their body's length and checksum: any cut is an error,
        // even one at a message boundary that would otherwise parse as a shorter trace.
        prop_assert!(import_rank(&t[..cut]).is_err());
    }

    #[test]
    fn corrupted_traces_never_panic(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)
    ) {
        let mut t = valid_trace().to_vec();
        for (i, b) in flips {
            let at = i.index(t.len());
            t[at] ^= b | 1;
        }
        // Every flip of an orrery trace is caught, by framing, decoding or the checksum.
        prop_assert!(import_rank(&t).is_err());
    }
}

#[test]
fn a_flipped_value_inside_a_valid_message_is_caught_by_the_checksum() {
    let t = valid_trace();
    let (meta, mut nodes) = decode(t);
    // Change one op's FLOPs: the file still parses, only the checksum can tell.
    let flops = nodes
        .iter_mut()
        .flat_map(|n| n.attr.iter_mut())
        .find(|a| a.name == "orrery.flops")
        .unwrap();
    flops.value = Some(Value::DoubleVal(12345.0));
    let tampered = encode(&meta, &nodes);
    assert!(matches!(
        import_rank(&tampered),
        Err(ChakraError::Corrupt { .. })
    ));
    // The checksum covers the metadata too: a changed name table is caught.
    let (mut meta2, nodes2) = decode(t);
    for a in &mut meta2.attr {
        if let Some(Value::StringList(l)) = &mut a.value {
            l.values[0].push('!');
        }
    }
    assert!(matches!(
        import_rank(&encode(&meta2, &nodes2)),
        Err(ChakraError::Corrupt { .. })
    ));
    // A trace that claims orrery as its producer but lost its seal is corrupt.
    let mut stripped = meta.clone();
    stripped.attr.retain(|a| !a.name.starts_with("orrery.body"));
    assert!(matches!(
        import_rank(&encode(&stripped, &nodes)),
        Err(ChakraError::Unsealed)
    ));
    // Without orrery's producer and checksum attributes (a foreign trace) the same bytes
    // import unchecked.
    let mut foreign = meta.clone();
    foreign
        .attr
        .retain(|a| !a.name.starts_with("orrery.body") && a.name != "orrery.producer");
    assert!(import_rank(&encode(&foreign, &nodes)).is_ok());
}

/// Every single-bit flip of an orrery trace is reported, wherever it lands (a deterministic
/// sweep over every byte, one bit each, cycling through the bit positions).
#[test]
fn every_single_bit_flip_is_caught() {
    let t = valid_trace();
    for i in 0..t.len() {
        let mut c = t.to_vec();
        c[i] ^= 1 << (i % 8);
        assert!(
            import_rank(&c).is_err(),
            "flip of bit {} at byte {i} went unnoticed",
            i % 8
        );
    }
}
