//! Chakra execution-trace (ET) export and import.
//!
//! A Chakra ET file holds one rank's work as a sequence of protobuf messages, each prefixed
//! by its length as a varint: first a `GlobalMetadata` message, then one `Node` per op. The
//! message definitions in [`proto`] follow the published `et_def.proto` of MLCommons Chakra
//! (same field numbers and enum values), written by hand so no protoc runs at build time.
//! ASTRA-sim reads one file per rank named `<prefix>.<rank>.et` plus a JSON side file that
//! lists the members of every communication group ([`comm_groups_json`]); the CLI writes
//! both, this module only writes to an [`std::io::Write`].
//!
//! # Integrity
//!
//! A trace orrery writes is sealed: its metadata carries `orrery.body_bytes` (the length of
//! everything after the metadata message) and `orrery.body_crc32` (a CRC-32 over the metadata
//! without these two attributes, then that body). Import checks both when present, so a
//! truncated or bit-flipped file is reported ([`ChakraError::Corrupt`]) instead of replayed;
//! the nodes are encoded before the metadata is written, so sealing costs one buffer. Traces
//! from other tools carry no seal and are read as they are.
//!
//! # Export: how an orrery op becomes a Chakra node
//!
//! [`export_rank`] writes one rank's materialised graph ([`crate::materialize`]), one node
//! per op, node id = op index. Every node carries the standard attributes ASTRA-sim and the
//! Chakra feeder read, and `is_cpu_op = false` (orrery models GPU work only):
//!
//! - A compute op becomes a `COMP_NODE` with `num_ops` (int64 FLOPs, rounded) and
//!   `tensor_size` (uint64 bytes moved), which is what ASTRA-sim's roofline model uses.
//! - A collective becomes a `COMM_COLL_NODE` with `comm_type` (the `CollectiveCommType`
//!   number), `comm_size` (int64 bytes, orrery's size of the collective: the full buffer)
//!   and `pg_name`, the concrete group as a decimal string. That string is the group's
//!   [`GroupId`] **plus one**, because ASTRA-sim reads group `"0"` (and `""`) as "all ranks";
//!   [`pg_name`] and [`group_of_pg_name`] convert, and [`comm_groups_json`] uses the same keys.
//! - A send or receive becomes a `COMM_SEND_NODE` / `COMM_RECV_NODE` with `comm_src` and
//!   `comm_dst` (int32 concrete ranks), `comm_size` and `comm_tag`. ASTRA-sim reads the tag
//!   as a 32-bit integer, so orrery's 64-bit tag ([`crate::build::tag`]: direction,
//!   micro-batch, virtual-stage boundary) is packed into 31 bits (direction, 20 bits of
//!   micro-batch, 10 bits of boundary); sender and receiver pack the same tag the same way.
//! - Chakra has no node type for memory bookkeeping, and its `MEM_LOAD_NODE` /
//!   `MEM_STORE_NODE` mean remote-memory transfers that ASTRA-sim would charge time for. So an
//!   allocation or a free becomes a `COMP_NODE` with `num_ops = 0` and `tensor_size = 0`
//!   (which ASTRA-sim's roofline mode skips in zero time, and its replay mode runs for one
//!   nanosecond) and the attribute `orrery.mem` (`"alloc"` or `"free"`) saying what it
//!   really is.
//!
//! Dependencies go into `data_deps`, the only list ASTRA-sim's feeder resolves by default.
//! Orrery's streams are implicit ordering (a compute op, collective or send waits for the
//! previous such op on its stream), which a Chakra consumer cannot know; so when the previous
//! op on the same stream is not already a dependency, export adds it to `data_deps` too and
//! names it in `orrery.stream_dep`, which import removes again. Times are left at zero unless
//! the caller passes them ([`export_rank_with_times`], e.g. a replay's predicted times);
//! without them ASTRA-sim should run in its roofline mode, which times a compute node from
//! `num_ops` and `tensor_size`.
//!
//! Orrery's own meaning travels in attributes prefixed `orrery.`, so that importing an
//! exported trace gives back the class graph op for op: `orrery.stream`, `orrery.phase`,
//! `orrery.microbatch` on every op; `orrery.flops` (exact double) and `orrery.compute` (the
//! [`ComputeKind`] with its shape, as JSON) on compute ops; `orrery.group` (the
//! [`GroupRole`]) and `orrery.group_id` on collectives; `orrery.peer` ([`PeerStage`]) and
//! `orrery.tag` (exact) on sends and receives; `orrery.bytes` and `orrery.category` on
//! allocations, and `orrery.alloc` (the node id of the allocation) on frees. Enum values
//! are written with their serde names (`"tp_comm"`, `"dp_cp"`, ...). The metadata message
//! carries `orrery.rank`, `orrery.world_size`, `orrery.class` and `orrery.names` (the graph's
//! name table, so name indices round-trip too).
//!
//! # Import: how a Chakra node becomes an orrery op
//!
//! [`import_rank`] reads any Chakra ET, orrery's or one converted by the upstream Chakra
//! tools from a PyTorch trace. Dependencies are `data_deps` and `ctrl_deps` together,
//! mapped from node ids to op indices. Nodes are kept in file order when every dependency
//! points backwards; otherwise they are sorted topologically, always taking the earliest
//! node (in file order) that is ready, so the result is deterministic. Nodes without an op
//! meaning (`METADATA_NODE`, `INVALID_NODE`, storage, batch and checkpoint nodes) are
//! dropped and their dependencies passed through to the nodes that depended on them.
//! Without orrery attributes:
//!
//! - `COMP_NODE` becomes a compute op with `num_ops` FLOPs and `tensor_size` bytes: a
//!   [`ComputeKind::MemoryBound`] kernel when it has no FLOPs, otherwise a
//!   [`ComputeKind::Gemm`] of the equivalent cube (`m = n = k = cbrt(num_ops / 2)`,
//!   batch 1), since the trace does not say the shape. `MEM_LOAD_NODE` / `MEM_STORE_NODE`
//!   become memory-bound kernels of `tensor_size` bytes.
//! - `COMM_COLL_NODE` becomes a collective of `comm_size` bytes over the data-parallel group
//!   (a guess: the trace names a concrete process group, kept in
//!   [`ImportedNode::comm_group`] for the caller to map). `REDUCE` is read as an all-reduce,
//!   `GATHER` as an all-gather, `SCATTER` as a broadcast, `REDUCE_SCATTER_BLOCK` as a
//!   reduce-scatter and `BARRIER` as an all-reduce (of its `comm_size`, usually zero).
//! - `COMM_SEND_NODE` / `COMM_RECV_NODE` become a send to the next stage / a receive from
//!   the previous stage with `comm_tag`, the concrete peer kept in [`ImportedNode::peer`].
//! - Ops are on the stream their kind implies, in the forward phase, with no micro-batch.
//!   `duration_micros` and `start_time_micros`, when non-zero, are kept per op in
//!   [`ImportedNode`] so that a replay can use measured times.
//!
//! Import never panics: malformed bytes give a [`ChakraError`] that says what is wrong and
//! where (a truncated length prefix, a message that cannot be decoded and its node index, a
//! dependency on an unknown node, a cycle).

use crate::build::JobGraphs;
use crate::ir::{
    CollectiveOp, ComputeKind, ExecGraph, GraphError, GroupRole, MemoryCategory, Op, OpKind,
    PeerStage, Phase, Stream,
};
use crate::materialize::{materialize, Concrete};
use orrery_units::{Bytes, Flops, GroupId, OpId, Picos, RankId};
use prost::Message;
use serde::{de::DeserializeOwned, Serialize};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

/// The Chakra ET schema version written into the metadata message.
pub const SCHEMA_VERSION: &str = "0.0.4";

/// The protobuf messages of Chakra's `et_def.proto` (package `ChakraProtoMsg`) that orrery
/// reads and writes, with the published field numbers and enum values.
pub mod proto {
    /// A named attribute of a node or of the trace.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct AttributeProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub doc_string: String,
        #[prost(
            oneof = "attribute_proto::Value",
            tags = "3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32"
        )]
        pub value: Option<attribute_proto::Value>,
    }

    pub mod attribute_proto {
        /// The value of an attribute.
        #[derive(Clone, PartialEq, prost::Oneof)]
        pub enum Value {
            #[prost(double, tag = "3")]
            DoubleVal(f64),
            #[prost(message, tag = "4")]
            DoubleList(super::DoubleList),
            #[prost(float, tag = "5")]
            FloatVal(f32),
            #[prost(message, tag = "6")]
            FloatList(super::FloatList),
            #[prost(int32, tag = "7")]
            Int32Val(i32),
            #[prost(message, tag = "8")]
            Int32List(super::Int32List),
            #[prost(int64, tag = "9")]
            Int64Val(i64),
            #[prost(message, tag = "10")]
            Int64List(super::Int64List),
            #[prost(uint32, tag = "11")]
            Uint32Val(u32),
            #[prost(message, tag = "12")]
            Uint32List(super::Uint32List),
            #[prost(uint64, tag = "13")]
            Uint64Val(u64),
            #[prost(message, tag = "14")]
            Uint64List(super::Uint64List),
            #[prost(sint32, tag = "15")]
            Sint32Val(i32),
            #[prost(message, tag = "16")]
            Sint32List(super::Sint32List),
            #[prost(sint64, tag = "17")]
            Sint64Val(i64),
            #[prost(message, tag = "18")]
            Sint64List(super::Sint64List),
            #[prost(fixed32, tag = "19")]
            Fixed32Val(u32),
            #[prost(message, tag = "20")]
            Fixed32List(super::Fixed32List),
            #[prost(fixed64, tag = "21")]
            Fixed64Val(u64),
            #[prost(message, tag = "22")]
            Fixed64List(super::Fixed64List),
            #[prost(sfixed32, tag = "23")]
            Sfixed32Val(i32),
            #[prost(message, tag = "24")]
            Sfixed32List(super::Sfixed32List),
            #[prost(sfixed64, tag = "25")]
            Sfixed64Val(i64),
            #[prost(message, tag = "26")]
            Sfixed64List(super::Sfixed64List),
            #[prost(bool, tag = "27")]
            BoolVal(bool),
            #[prost(message, tag = "28")]
            BoolList(super::BoolList),
            #[prost(string, tag = "29")]
            StringVal(String),
            #[prost(message, tag = "30")]
            StringList(super::StringList),
            #[prost(bytes = "vec", tag = "31")]
            BytesVal(Vec<u8>),
            #[prost(message, tag = "32")]
            BytesList(super::BytesList),
        }
    }

    macro_rules! list {
        ($name:ident, $kind:ident, $ty:ty) => {
            #[derive(Clone, PartialEq, prost::Message)]
            pub struct $name {
                #[prost($kind, repeated, tag = "1")]
                pub values: Vec<$ty>,
            }
        };
    }
    list!(DoubleList, double, f64);
    list!(FloatList, float, f32);
    list!(Int32List, int32, i32);
    list!(Int64List, int64, i64);
    list!(Uint32List, uint32, u32);
    list!(Uint64List, uint64, u64);
    list!(Sint32List, sint32, i32);
    list!(Sint64List, sint64, i64);
    list!(Fixed32List, fixed32, u32);
    list!(Fixed64List, fixed64, u64);
    list!(Sfixed32List, sfixed32, i32);
    list!(Sfixed64List, sfixed64, i64);
    list!(BoolList, bool, bool);
    list!(StringList, string, String);

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct BytesList {
        #[prost(bytes = "vec", repeated, tag = "1")]
        pub values: Vec<Vec<u8>>,
    }

    /// The first message of a trace.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct GlobalMetadata {
        #[prost(string, tag = "1")]
        pub version: String,
        #[prost(message, repeated, tag = "2")]
        pub attr: Vec<AttributeProto>,
    }

    /// Chakra node types.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum NodeType {
        InvalidNode = 0,
        MetadataNode = 1,
        MemLoadNode = 2,
        MemStoreNode = 3,
        CompNode = 4,
        CommSendNode = 5,
        CommRecvNode = 6,
        CommCollNode = 7,
        StorageNode = 8,
        BatchNode = 9,
        CheckpointNode = 10,
    }

    /// Chakra collective kinds (the `comm_type` attribute).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
    #[repr(i32)]
    pub enum CollectiveCommType {
        AllReduce = 0,
        Reduce = 1,
        AllGather = 2,
        Gather = 3,
        Scatter = 4,
        Broadcast = 5,
        AllToAll = 6,
        ReduceScatter = 7,
        ReduceScatterBlock = 8,
        Barrier = 9,
    }

    /// One op of the trace.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Node {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(string, tag = "2")]
        pub name: String,
        #[prost(enumeration = "NodeType", tag = "3")]
        pub r#type: i32,
        #[prost(uint64, repeated, tag = "4")]
        pub ctrl_deps: Vec<u64>,
        #[prost(uint64, repeated, tag = "5")]
        pub data_deps: Vec<u64>,
        #[prost(uint64, tag = "6")]
        pub start_time_micros: u64,
        #[prost(uint64, tag = "7")]
        pub duration_micros: u64,
        #[prost(message, optional, tag = "8")]
        pub inputs: Option<IoInfo>,
        #[prost(message, optional, tag = "9")]
        pub outputs: Option<IoInfo>,
        #[prost(message, repeated, tag = "10")]
        pub attr: Vec<AttributeProto>,
    }

    /// Input or output tensors of a node, as the PyTorch converter records them.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct IoInfo {
        #[prost(string, tag = "1")]
        pub values: String,
        #[prost(string, tag = "2")]
        pub shapes: String,
        #[prost(string, tag = "3")]
        pub types: String,
    }

    use attribute_proto::Value;

    impl AttributeProto {
        pub fn new(name: &str, value: Value) -> AttributeProto {
            AttributeProto {
                name: name.to_string(),
                doc_string: String::new(),
                value: Some(value),
            }
        }
        pub fn bool(name: &str, v: bool) -> AttributeProto {
            AttributeProto::new(name, Value::BoolVal(v))
        }
        pub fn int32(name: &str, v: i32) -> AttributeProto {
            AttributeProto::new(name, Value::Int32Val(v))
        }
        pub fn int64(name: &str, v: i64) -> AttributeProto {
            AttributeProto::new(name, Value::Int64Val(v))
        }
        pub fn uint64(name: &str, v: u64) -> AttributeProto {
            AttributeProto::new(name, Value::Uint64Val(v))
        }
        pub fn double(name: &str, v: f64) -> AttributeProto {
            AttributeProto::new(name, Value::DoubleVal(v))
        }
        pub fn string(name: &str, v: &str) -> AttributeProto {
            AttributeProto::new(name, Value::StringVal(v.to_string()))
        }
    }
}

use proto::attribute_proto::Value;
use proto::{AttributeProto, CollectiveCommType, GlobalMetadata, Node, NodeType};

/// What went wrong exporting or importing a Chakra trace.
#[derive(Debug, thiserror::Error)]
pub enum ChakraError {
    #[error("writing the trace failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("rank {rank} is not in the job (world size {world})")]
    RankOutOfRange { rank: u32, world: u32 },
    #[error("{given} op times given for a rank graph of {ops} ops")]
    TimesMismatch { given: usize, ops: usize },
    #[error("the trace is empty: it has no global metadata message")]
    Empty,
    #[error(
        "the trace is corrupt: it says orrery wrote it but its length and checksum are missing"
    )]
    Unsealed,
    #[error("the trace is corrupt: its metadata announces {expected_len} bytes with CRC-32 {expected_crc:08x} after it, but {found_len} bytes with CRC-32 {found_crc:08x} follow")]
    Corrupt {
        expected_len: u64,
        found_len: u64,
        expected_crc: u64,
        found_crc: u64,
    },
    #[error("message {message} (0 is the metadata): length prefix at byte {offset} is truncated or malformed")]
    BadLength { message: usize, offset: usize },
    #[error("message {message} (0 is the metadata) at byte {offset} claims {len} bytes but only {available} remain")]
    TruncatedMessage {
        message: usize,
        offset: usize,
        len: u64,
        available: usize,
    },
    #[error("cannot decode the global metadata: {0}")]
    Metadata(prost::DecodeError),
    #[error("cannot decode node {index}: {source}")]
    Decode {
        index: usize,
        source: prost::DecodeError,
    },
    #[error("node {index} (id {id}): {reason}")]
    BadNode {
        index: usize,
        id: u64,
        reason: String,
    },
    #[error("node id {id} is used twice (nodes {first} and {second})")]
    DuplicateId {
        id: u64,
        first: usize,
        second: usize,
    },
    #[error("node {id} depends on node {dep}, which is not in the trace")]
    UnknownDependency { id: u64, dep: u64 },
    #[error("the dependencies form a cycle through node {id}")]
    Cycle { id: u64 },
    #[error("passing dependencies through dropped metadata nodes makes more than {limit} edges")]
    TooManyDependencies { limit: usize },
    #[error("the imported graph is malformed: {0}")]
    Graph(#[from] GraphError),
}

/// The group name (`pg_name`) a trace uses for a group: its id plus one, since ASTRA-sim
/// reads `"0"` as the group of all ranks.
pub fn pg_name(group: GroupId) -> String {
    (u64::from(group.0) + 1).to_string()
}

/// The group a `pg_name` written by [`pg_name`] stands for.
pub fn group_of_pg_name(name: &str) -> Option<GroupId> {
    let n: u64 = name.parse().ok()?;
    Some(GroupId(u32::try_from(n.checked_sub(1)?).ok()?))
}

/// The comm-group side file ASTRA-sim reads: a JSON object mapping every group's
/// [`pg_name`] to its member ranks, in group-id order.
pub fn comm_groups_json(graphs: &JobGraphs) -> String {
    let groups: Vec<(GroupId, GroupRole, &[RankId])> = graphs.layout.all_groups().collect();
    let mut s = String::from("{\n");
    for (i, (g, _, members)) in groups.iter().enumerate() {
        let ranks: Vec<String> = members.iter().map(|r| r.0.to_string()).collect();
        let comma = if i + 1 < groups.len() { "," } else { "" };
        s.push_str(&format!(
            "  \"{}\": [{}]{comma}\n",
            pg_name(*g),
            ranks.join(", ")
        ));
    }
    s.push_str("}\n");
    s
}

/// Times of one op, for [`export_rank_with_times`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpTime {
    pub start: Picos,
    pub duration: Picos,
}

/// Writes rank `rank`'s graph as a Chakra ET (see the module docs for the mapping).
pub fn export_rank(
    graphs: &JobGraphs,
    rank: RankId,
    w: &mut impl std::io::Write,
) -> Result<(), ChakraError> {
    write_rank(graphs, rank, None, w)
}

/// Like [`export_rank`], with each op's start and duration (one [`OpTime`] per op of the
/// rank's graph, in op order) written as `start_time_micros` / `duration_micros`, rounded
/// to the nearest microsecond, for consumers that replay measured or predicted times.
pub fn export_rank_with_times(
    graphs: &JobGraphs,
    rank: RankId,
    times: &[OpTime],
    w: &mut impl std::io::Write,
) -> Result<(), ChakraError> {
    write_rank(graphs, rank, Some(times), w)
}

/// The serde name of a unit-like enum value (`"tp_comm"`).
fn enum_name<T: Serialize>(v: T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        _ => String::new(),
    }
}

fn parse_enum<T: DeserializeOwned>(s: &str) -> Option<T> {
    serde_json::from_value(serde_json::Value::String(s.to_string())).ok()
}

/// Packs orrery's 64-bit send/receive tag into the 31 bits ASTRA-sim reads: the direction
/// bit and 20 bits of micro-batch ([`crate::build::tag`]'s low bits), then 10 bits of the
/// virtual-stage boundary.
fn comm_tag(tag: u64) -> i32 {
    let low = tag & 0x1F_FFFF;
    let boundary = (tag >> 33) & 0x3FF;
    ((boundary << 21) | low) as i32
}

/// Whether a tag is a collected program's own (interleaved 1F1B names each message by its
/// kind, chunk and micro-batch, recorded with the top bit set), which [`comm_tag`]'s
/// packing of [`crate::build::tag`]'s layout would mangle.
fn is_wide(tag: u64) -> bool {
    tag >> 63 != 0
}

/// The 31-bit tags of a rank's wide tags ([`is_wide`]): each pair's wide tags, per direction,
/// numbered in increasing order from `1 << 30`. A send and its receive hold the same tag in
/// the two ranks' graphs, so both sides number it alike, and the numbers stay clear of
/// [`comm_tag`]'s range for a collected graph's other tags (message places, below `1 << 21`).
fn wide_tags(g: &ExecGraph, peer_of: impl Fn(usize) -> RankId) -> BTreeMap<(bool, u32, u64), i32> {
    let mut per_pair: BTreeMap<(bool, u32), BTreeSet<u64>> = BTreeMap::new();
    for (i, op) in g.ops().iter().enumerate() {
        let (send, tag) = match op.kind {
            OpKind::Send { tag, .. } => (true, tag),
            OpKind::Recv { tag, .. } => (false, tag),
            _ => continue,
        };
        if is_wide(tag) {
            per_pair
                .entry((send, peer_of(i).0))
                .or_default()
                .insert(tag);
        }
    }
    let mut out = BTreeMap::new();
    for ((send, peer), tags) in per_pair {
        for (n, tag) in tags.into_iter().enumerate() {
            let n = i32::try_from(n).unwrap_or(i32::MAX).min((1 << 30) - 1);
            out.insert((send, peer, tag), (1 << 30) | n);
        }
    }
    out
}

fn micros(p: Picos) -> u64 {
    p.0.saturating_add(500_000) / 1_000_000
}

fn rank_i32(r: RankId) -> i32 {
    i32::try_from(r.0).unwrap_or(i32::MAX)
}

fn to_i64(x: u64) -> i64 {
    i64::try_from(x).unwrap_or(i64::MAX)
}

fn write_rank(
    graphs: &JobGraphs,
    rank: RankId,
    times: Option<&[OpTime]>,
    w: &mut impl std::io::Write,
) -> Result<(), ChakraError> {
    let layout = &graphs.layout;
    let world = layout.world_size();
    let class = layout.class_of(rank);
    if rank.0 >= world || class.index() >= graphs.classes.len() {
        return Err(ChakraError::RankOutOfRange {
            rank: rank.0,
            world,
        });
    }
    let rg = materialize(graphs, rank);
    let g = rg.graph;
    if let Some(t) = times {
        if t.len() != g.len() {
            return Err(ChakraError::TimesMismatch {
                given: t.len(),
                ops: g.len(),
            });
        }
    }

    let meta = GlobalMetadata {
        version: SCHEMA_VERSION.to_string(),
        attr: vec![
            AttributeProto::string(PRODUCER, "orrery-graph"),
            AttributeProto::uint64("orrery.rank", u64::from(rank.0)),
            AttributeProto::uint64("orrery.world_size", u64::from(world)),
            AttributeProto::uint64("orrery.class", u64::from(class.0)),
            AttributeProto::new(
                "orrery.names",
                Value::StringList(proto::StringList {
                    values: g.names().to_vec(),
                }),
            ),
        ],
    };
    let mut meta = meta;
    let peer_of = |i: usize| match (rg.resolved.get(i), &g.ops()[i].kind) {
        (Some(Concrete::Peer(r)), _) => *r,
        (_, OpKind::Send { peer, .. } | OpKind::Recv { peer, .. }) => layout.peer(rank, *peer),
        _ => rank,
    };
    let wide = wide_tags(g, peer_of);
    // Nodes are encoded first so the metadata can carry their length and checksum.
    let mut body = Vec::new();
    let mut last_on_stream: [Option<usize>; Stream::ALL.len()] = [None; Stream::ALL.len()];
    for (i, op) in g.ops().iter().enumerate() {
        let mut node = Node {
            id: i as u64,
            name: g.name_of(op).to_string(),
            data_deps: op.deps.iter().map(|d| u64::from(d.0)).collect(),
            ..Node::default()
        };
        if let Some(t) = times.and_then(|t| t.get(i)) {
            node.start_time_micros = micros(t.start);
            node.duration_micros = micros(t.duration);
        }
        let attr = &mut node.attr;
        attr.push(AttributeProto::bool("is_cpu_op", false));
        let ty = match op.kind {
            OpKind::Compute { kind, flops, bytes } => {
                let ops = if flops.0.is_finite() && flops.0 > 0.0 {
                    flops.0.round() as i64
                } else {
                    0
                };
                attr.push(AttributeProto::int64("num_ops", ops));
                attr.push(AttributeProto::uint64("tensor_size", bytes.0));
                attr.push(AttributeProto::double("orrery.flops", flops.0));
                let json = serde_json::to_string(&kind).unwrap_or_default();
                attr.push(AttributeProto::string("orrery.compute", &json));
                NodeType::CompNode
            }
            OpKind::Collective {
                op: cop,
                group,
                bytes,
            } => {
                let gid = match rg.resolved.get(i) {
                    Some(Concrete::Group(gid)) => *gid,
                    _ => layout.group_id(rank, group),
                };
                let ct = match cop {
                    CollectiveOp::AllReduce => CollectiveCommType::AllReduce,
                    CollectiveOp::AllGather => CollectiveCommType::AllGather,
                    CollectiveOp::ReduceScatter => CollectiveCommType::ReduceScatter,
                    CollectiveOp::AllToAll => CollectiveCommType::AllToAll,
                    CollectiveOp::Broadcast => CollectiveCommType::Broadcast,
                };
                attr.push(AttributeProto::int64("comm_type", ct as i64));
                attr.push(AttributeProto::int64("comm_size", to_i64(bytes.0)));
                attr.push(AttributeProto::string("pg_name", &pg_name(gid)));
                attr.push(AttributeProto::string("orrery.group", &enum_name(group)));
                attr.push(AttributeProto::uint64("orrery.group_id", u64::from(gid.0)));
                NodeType::CommCollNode
            }
            OpKind::Send { peer, bytes, tag } | OpKind::Recv { peer, bytes, tag } => {
                let other = match rg.resolved.get(i) {
                    Some(Concrete::Peer(r)) => *r,
                    _ => layout.peer(rank, peer),
                };
                let send = matches!(op.kind, OpKind::Send { .. });
                let (src, dst) = if send { (rank, other) } else { (other, rank) };
                attr.push(AttributeProto::int32("comm_src", rank_i32(src)));
                attr.push(AttributeProto::int32("comm_dst", rank_i32(dst)));
                let packed = match wide.get(&(send, other.0, tag)) {
                    Some(&n) => n,
                    None => comm_tag(tag),
                };
                attr.push(AttributeProto::int32("comm_tag", packed));
                attr.push(AttributeProto::int64("comm_size", to_i64(bytes.0)));
                attr.push(AttributeProto::string("orrery.peer", &enum_name(peer)));
                attr.push(AttributeProto::uint64("orrery.tag", tag));
                if send {
                    NodeType::CommSendNode
                } else {
                    NodeType::CommRecvNode
                }
            }
            OpKind::Alloc { bytes, category } => {
                attr.push(AttributeProto::int64("num_ops", 0));
                attr.push(AttributeProto::uint64("tensor_size", 0));
                attr.push(AttributeProto::string("orrery.mem", "alloc"));
                attr.push(AttributeProto::uint64("orrery.bytes", bytes.0));
                attr.push(AttributeProto::string(
                    "orrery.category",
                    &enum_name(category),
                ));
                NodeType::CompNode
            }
            OpKind::Free { alloc } => {
                attr.push(AttributeProto::int64("num_ops", 0));
                attr.push(AttributeProto::uint64("tensor_size", 0));
                attr.push(AttributeProto::string("orrery.mem", "free"));
                attr.push(AttributeProto::uint64("orrery.alloc", u64::from(alloc.0)));
                NodeType::CompNode
            }
        };
        node.r#type = ty as i32;
        attr.push(AttributeProto::string(
            "orrery.stream",
            &enum_name(op.stream),
        ));
        attr.push(AttributeProto::string("orrery.phase", &enum_name(op.phase)));
        if let Some(mb) = op.microbatch {
            attr.push(AttributeProto::int64("orrery.microbatch", i64::from(mb)));
        }
        if op.kind.occupies_stream() {
            let s = op.stream.index();
            if let Some(prev) = last_on_stream[s] {
                if !op.deps.iter().any(|d| d.index() == prev) {
                    node.data_deps.push(prev as u64);
                    node.attr
                        .push(AttributeProto::uint64("orrery.stream_dep", prev as u64));
                }
            }
            last_on_stream[s] = Some(i);
        }
        node.encode_length_delimited(&mut body)
            .map_err(|e| ChakraError::Io(std::io::Error::other(e)))?;
    }
    let crc = raw_crc(&meta.encode_to_vec(), &body);
    meta.attr
        .push(AttributeProto::uint64(BODY_BYTES, body.len() as u64));
    meta.attr.push(AttributeProto::uint64(BODY_CRC32, crc));
    w.write_all(&meta.encode_length_delimited_to_vec())?;
    w.write_all(&body)?;
    Ok(())
}

/// Metadata attributes with which orrery's traces carry the length of everything after the
/// metadata message and a CRC-32 over the metadata (without these two attributes) and that
/// body, so a truncated or corrupted file is detected on import. Traces from other tools lack
/// them and are read unchecked.
const BODY_BYTES: &str = "orrery.body_bytes";
/// The metadata attribute naming the writer; orrery's traces must be sealed.
const PRODUCER: &str = "orrery.producer";
const BODY_CRC32: &str = "orrery.body_crc32";

/// CRC-32 of the unsealed metadata message's bytes followed by the body. Export hashes the
/// metadata's encoding before appending the seal attributes; since the seal is encoded last,
/// those bytes are exactly the written message minus its end, which import hashes.
fn raw_crc(meta_bytes: &[u8], body: &[u8]) -> u64 {
    let mut h = crc32fast::Hasher::new();
    h.update(meta_bytes);
    h.update(body);
    u64::from(h.finalize())
}

/// Checks the body length and checksum an orrery trace's metadata announces.
fn verify_body(meta: &GlobalMetadata, meta_bytes: &[u8], bytes: &[u8]) -> Result<(), ChakraError> {
    let find = |name: &str| {
        meta.attr
            .iter()
            .find(|a| a.name == name)
            .and_then(|a| a.value.as_ref())
            .and_then(as_u64)
    };
    // A trace that says orrery wrote it must carry the seal; otherwise a flipped bit in a
    // seal attribute's name would make it pass for an unsealed foreign trace.
    let claims_orrery = meta
        .attr
        .iter()
        .any(|a| a.name == PRODUCER || a.name == BODY_BYTES || a.name == BODY_CRC32);
    let (Some(expected_len), Some(expected_crc)) = (find(BODY_BYTES), find(BODY_CRC32)) else {
        return if claims_orrery {
            Err(ChakraError::Unsealed)
        } else {
            Ok(())
        };
    };
    let start = prost::encoding::encoded_len_varint(meta_bytes.len() as u64) + meta_bytes.len();
    let body = bytes.get(start..).unwrap_or_default();
    // The seal attributes are written last, so the metadata as it was hashed is the raw
    // message without their encoding at its end. Hashing the raw bytes (not a re-encoding
    // of what was decoded) also catches flips in bytes a decoder would skip.
    let seal: Vec<AttributeProto> = meta
        .attr
        .iter()
        .filter(|a| a.name == BODY_BYTES || a.name == BODY_CRC32)
        .cloned()
        .collect();
    let seal_bytes = GlobalMetadata {
        version: String::new(),
        attr: seal,
    }
    .encode_to_vec();
    let unsealed = meta_bytes.strip_suffix(seal_bytes.as_slice());
    let crc = unsealed.map_or(u64::MAX, |m| raw_crc(m, body));
    if body.len() as u64 != expected_len || crc != expected_crc {
        return Err(ChakraError::Corrupt {
            expected_len,
            found_len: body.len() as u64,
            expected_crc,
            found_crc: crc,
        });
    }
    Ok(())
}

/// One rank's graph read back from a Chakra trace.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportedRank {
    /// The ops, in file order or (if the file lists a node before one it depends on) in a
    /// deterministic topological order.
    pub graph: ExecGraph,
    /// Per op of `graph`, what the trace says concretely.
    pub nodes: Vec<ImportedNode>,
    /// The rank the trace belongs to, if it says (`orrery.rank`).
    pub rank: Option<RankId>,
    /// The schema version in the metadata message.
    pub version: String,
    /// Nodes with no op meaning (metadata, invalid, storage, batch, checkpoint) that were
    /// dropped, their dependencies passed through.
    pub skipped: usize,
}

/// What the trace says concretely about one imported op.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportedNode {
    /// The node's id in the trace.
    pub id: u64,
    /// The process group a collective names (`pg_name`, or `comm_group`).
    pub comm_group: Option<String>,
    /// The orrery group id, when the trace was written by orrery (`orrery.group_id`).
    pub group: Option<GroupId>,
    /// The other side of a send (`comm_dst`) or receive (`comm_src`).
    pub peer: Option<RankId>,
    /// `start_time_micros`, when non-zero.
    pub start: Option<Picos>,
    /// `duration_micros`, when non-zero.
    pub duration: Option<Picos>,
    /// The node's `is_cpu_op` attribute (false when absent).
    pub is_cpu_op: bool,
}

/// Reads a Chakra ET (see the module docs for the mapping). Never panics.
pub fn import_rank(bytes: &[u8]) -> Result<ImportedRank, ChakraError> {
    let messages = split_messages(bytes)?;
    let (meta_bytes, node_bytes) = messages.split_first().ok_or(ChakraError::Empty)?;
    let meta = GlobalMetadata::decode(*meta_bytes).map_err(ChakraError::Metadata)?;
    verify_body(&meta, meta_bytes, bytes)?;
    let nodes = node_bytes
        .iter()
        .enumerate()
        .map(|(index, b)| Node::decode(*b).map_err(|source| ChakraError::Decode { index, source }))
        .collect::<Result<Vec<Node>, ChakraError>>()?;

    let mut position: BTreeMap<u64, usize> = BTreeMap::new();
    for (i, n) in nodes.iter().enumerate() {
        if let Some(&first) = position.get(&n.id) {
            return Err(ChakraError::DuplicateId {
                id: n.id,
                first,
                second: i,
            });
        }
        position.insert(n.id, i);
    }

    let drafts = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| draft(i, n, &position))
        .collect::<Result<Vec<Draft>, ChakraError>>()?;

    let order = topo_order(&nodes, &drafts)?;

    let mut graph = ExecGraph::new();
    let meta_attrs = Attrs {
        list: &meta.attr,
        index: 0,
        id: 0,
    };
    if let Some(Value::StringList(names)) = meta_attrs.raw("orrery.names") {
        for n in &names.values {
            graph.intern(n);
        }
    }
    let rank = meta_attrs
        .raw("orrery.rank")
        .and_then(as_u64)
        .and_then(|r| u32::try_from(r).ok())
        .map(RankId);

    // New op index of each op node, and the ops a dropped node passes through.
    let mut new_index: Vec<Option<OpId>> = vec![None; nodes.len()];
    let mut through: Vec<Vec<OpId>> = vec![Vec::new(); nodes.len()];
    let mut out_nodes = Vec::new();
    let mut skipped = 0;
    // Passing dependencies through dropped nodes can multiply edges (a dropped node with
    // `a` dependencies and `b` dependents becomes `a * b` edges); a crafted file must not
    // make that exhaust memory.
    let input_edges: usize = drafts.iter().map(|d| d.deps.len()).sum();
    let limit = input_edges.saturating_mul(16).saturating_add(1 << 20);
    let mut produced = 0usize;
    for &p in &order {
        let d = &drafts[p];
        let mut deps: Vec<OpId> = Vec::with_capacity(d.deps.len());
        for &q in &d.deps {
            match new_index[q] {
                Some(id) => deps.push(id),
                None => {
                    produced = produced.saturating_add(through[q].len());
                    if produced > limit {
                        return Err(ChakraError::TooManyDependencies { limit });
                    }
                    deps.extend_from_slice(&through[q]);
                }
            }
        }
        let Some(op) = &d.op else {
            deps.sort_unstable();
            deps.dedup();
            through[p] = deps;
            skipped += 1;
            continue;
        };
        if !d.exact {
            deps.sort_unstable();
            deps.dedup();
        }
        let mut kind = op.kind;
        if let (OpKind::Free { .. }, Some(a)) = (kind, d.alloc) {
            let alloc = new_index[a].ok_or_else(|| ChakraError::BadNode {
                index: p,
                id: nodes[p].id,
                reason: format!("frees node {}, which is not an allocation", nodes[a].id),
            })?;
            kind = OpKind::Free { alloc };
        }
        let name = graph.intern(&nodes[p].name);
        let id = graph.push(Op {
            kind,
            stream: op.stream,
            phase: op.phase,
            deps,
            name,
            microbatch: op.microbatch,
        });
        new_index[p] = Some(id);
        out_nodes.push(op.info.clone());
    }
    graph.check()?;
    Ok(ImportedRank {
        graph,
        nodes: out_nodes,
        rank,
        version: meta.version,
        skipped,
    })
}

/// Splits a byte string into its varint-length-delimited messages.
fn split_messages(bytes: &[u8]) -> Result<Vec<&[u8]>, ChakraError> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < bytes.len() {
        let offset = pos;
        let (len, used) = read_varint(&bytes[pos..]).ok_or(ChakraError::BadLength {
            message: out.len(),
            offset,
        })?;
        pos += used;
        let available = bytes.len() - pos;
        let len_usize = usize::try_from(len).unwrap_or(usize::MAX);
        if len_usize > available {
            return Err(ChakraError::TruncatedMessage {
                message: out.len(),
                offset,
                len,
                available,
            });
        }
        out.push(&bytes[pos..pos + len_usize]);
        pos += len_usize;
    }
    Ok(out)
}

/// A protobuf varint: its value and how many bytes it took, or `None` if it is cut off or
/// longer than ten bytes.
fn read_varint(b: &[u8]) -> Option<(u64, usize)> {
    let mut v: u64 = 0;
    for (i, &byte) in b.iter().enumerate().take(10) {
        if i == 9 && byte > 1 {
            return None;
        }
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, i + 1));
        }
    }
    None
}

/// A node read but not yet placed: its op (or `None` for a node with no op meaning), its
/// dependencies and allocation reference as node positions.
struct Draft {
    op: Option<DraftOp>,
    deps: Vec<usize>,
    /// Whether the dependency list is orrery's own, to be kept in order.
    exact: bool,
    /// For a free: the position of the allocation it frees.
    alloc: Option<usize>,
}

struct DraftOp {
    kind: OpKind,
    stream: Stream,
    phase: Phase,
    microbatch: Option<u32>,
    info: ImportedNode,
}

/// A node's attributes, looked up by name (the first of a name wins).
struct Attrs<'a> {
    list: &'a [AttributeProto],
    index: usize,
    id: u64,
}

fn as_u64(v: &Value) -> Option<u64> {
    match *v {
        Value::Uint64Val(x) | Value::Fixed64Val(x) => Some(x),
        Value::Uint32Val(x) | Value::Fixed32Val(x) => Some(u64::from(x)),
        Value::Int64Val(x) | Value::Sint64Val(x) | Value::Sfixed64Val(x) => u64::try_from(x).ok(),
        Value::Int32Val(x) | Value::Sint32Val(x) | Value::Sfixed32Val(x) => u64::try_from(x).ok(),
        _ => None,
    }
}

fn as_i64(v: &Value) -> Option<i64> {
    match *v {
        Value::Int64Val(x) | Value::Sint64Val(x) | Value::Sfixed64Val(x) => Some(x),
        Value::Int32Val(x) | Value::Sint32Val(x) | Value::Sfixed32Val(x) => Some(i64::from(x)),
        Value::Uint32Val(x) | Value::Fixed32Val(x) => Some(i64::from(x)),
        Value::Uint64Val(x) | Value::Fixed64Val(x) => i64::try_from(x).ok(),
        _ => None,
    }
}

fn as_f64(v: &Value) -> Option<f64> {
    match *v {
        Value::DoubleVal(x) => Some(x),
        Value::FloatVal(x) => Some(f64::from(x)),
        _ => as_u64(v).map(|x| x as f64),
    }
}

impl<'a> Attrs<'a> {
    fn raw(&self, name: &str) -> Option<&'a Value> {
        self.list
            .iter()
            .find(|a| a.name == name)
            .and_then(|a| a.value.as_ref())
    }

    fn err(&self, reason: String) -> ChakraError {
        ChakraError::BadNode {
            index: self.index,
            id: self.id,
            reason,
        }
    }

    fn get<T>(
        &self,
        name: &str,
        conv: impl Fn(&Value) -> Option<T>,
    ) -> Result<Option<T>, ChakraError> {
        match self.raw(name) {
            None => Ok(None),
            Some(v) => conv(v)
                .map(Some)
                .ok_or_else(|| self.err(format!("attribute `{name}` has an unusable value {v:?}"))),
        }
    }

    fn u64(&self, name: &str) -> Result<Option<u64>, ChakraError> {
        self.get(name, as_u64)
    }

    fn i64(&self, name: &str) -> Result<Option<i64>, ChakraError> {
        self.get(name, as_i64)
    }

    fn str(&self, name: &str) -> Result<Option<&'a str>, ChakraError> {
        match self.raw(name) {
            None => Ok(None),
            Some(Value::StringVal(s)) => Ok(Some(s.as_str())),
            Some(v) => Err(self.err(format!("attribute `{name}` is not a string: {v:?}"))),
        }
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ChakraError> {
        self.get(name, |v| match *v {
            Value::BoolVal(b) => Some(b),
            _ => as_i64(v).map(|x| x != 0),
        })
    }

    /// A serde-named enum value.
    fn named<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, ChakraError> {
        match self.str(name)? {
            None => Ok(None),
            Some(s) => parse_enum(s)
                .map(Some)
                .ok_or_else(|| self.err(format!("attribute `{name}` has unknown value `{s}`"))),
        }
    }

    /// A rank (int32 in ASTRA-sim's convention, any integer accepted).
    fn rank(&self, name: &str) -> Result<Option<RankId>, ChakraError> {
        self.get(name, |v| {
            as_u64(v).and_then(|x| u32::try_from(x).ok()).map(RankId)
        })
    }
}

/// A compute op's kind when the trace does not give its shape.
fn guess_compute(flops: f64) -> ComputeKind {
    if flops > 0.0 {
        let side = (flops / 2.0).cbrt().round().max(1.0) as u64;
        ComputeKind::Gemm {
            m: side,
            n: side,
            k: side,
            batch: 1,
            fp8: false,
        }
    } else {
        ComputeKind::MemoryBound
    }
}

fn draft(index: usize, n: &Node, position: &BTreeMap<u64, usize>) -> Result<Draft, ChakraError> {
    let a = Attrs {
        list: &n.attr,
        index,
        id: n.id,
    };
    let ty = NodeType::try_from(n.r#type)
        .map_err(|_| a.err(format!("unknown node type {}", n.r#type)))?;
    let exact = a.raw("orrery.stream").is_some();
    let stream_dep = a.u64("orrery.stream_dep")?;
    let mut deps = Vec::with_capacity(n.data_deps.len() + n.ctrl_deps.len());
    for &dep in n.data_deps.iter().chain(&n.ctrl_deps) {
        if Some(dep) == stream_dep {
            continue;
        }
        let &p = position
            .get(&dep)
            .ok_or(ChakraError::UnknownDependency { id: n.id, dep })?;
        deps.push(p);
    }
    let micros_opt = |us: u64| (us > 0).then(|| Picos::from_micros(us));
    let mut info = ImportedNode {
        id: n.id,
        comm_group: None,
        group: None,
        peer: None,
        start: micros_opt(n.start_time_micros),
        duration: micros_opt(n.duration_micros),
        is_cpu_op: a.bool("is_cpu_op")?.unwrap_or(false),
    };
    let mut alloc = None;
    let bytes = |name: &str| -> Result<Bytes, ChakraError> { Ok(Bytes(a.u64(name)?.unwrap_or(0))) };
    let kind = match ty {
        NodeType::InvalidNode
        | NodeType::MetadataNode
        | NodeType::StorageNode
        | NodeType::BatchNode
        | NodeType::CheckpointNode => {
            return Ok(Draft {
                op: None,
                deps,
                exact,
                alloc: None,
            })
        }
        NodeType::MemLoadNode | NodeType::MemStoreNode => OpKind::Compute {
            kind: ComputeKind::MemoryBound,
            flops: Flops(0.0),
            bytes: bytes("tensor_size")?,
        },
        NodeType::CompNode => match a.str("orrery.mem")? {
            Some("alloc") => OpKind::Alloc {
                bytes: bytes("orrery.bytes")?,
                category: a
                    .named("orrery.category")?
                    .unwrap_or(MemoryCategory::Temporary),
            },
            Some("free") => {
                let target = a
                    .u64("orrery.alloc")?
                    .ok_or_else(|| a.err("a free without `orrery.alloc`".to_string()))?;
                let &p = position
                    .get(&target)
                    .ok_or(ChakraError::UnknownDependency {
                        id: n.id,
                        dep: target,
                    })?;
                alloc = Some(p);
                // Patched to the allocation's op index once it is placed.
                OpKind::Free { alloc: OpId(0) }
            }
            Some(other) => return Err(a.err(format!("unknown `orrery.mem` value `{other}`"))),
            None => {
                let flops = match a.get("orrery.flops", as_f64)? {
                    Some(f) => f,
                    None => a.get("num_ops", as_f64)?.unwrap_or(0.0),
                };
                if !flops.is_finite() || flops < 0.0 {
                    return Err(a.err(format!("FLOP count {flops} is not a non-negative number")));
                }
                let kind = match a.str("orrery.compute")? {
                    Some(json) => serde_json::from_str(json)
                        .map_err(|e| a.err(format!("bad `orrery.compute`: {e}")))?,
                    None => guess_compute(flops),
                };
                OpKind::Compute {
                    kind,
                    flops: Flops(flops),
                    bytes: bytes("tensor_size")?,
                }
            }
        },
        NodeType::CommCollNode => {
            let ct = a.i64("comm_type")?.unwrap_or(0);
            let ct = i32::try_from(ct)
                .ok()
                .and_then(|c| CollectiveCommType::try_from(c).ok())
                .ok_or_else(|| a.err(format!("unknown comm_type {ct}")))?;
            let op = match ct {
                CollectiveCommType::AllReduce
                | CollectiveCommType::Reduce
                | CollectiveCommType::Barrier => CollectiveOp::AllReduce,
                CollectiveCommType::AllGather | CollectiveCommType::Gather => {
                    CollectiveOp::AllGather
                }
                CollectiveCommType::ReduceScatter | CollectiveCommType::ReduceScatterBlock => {
                    CollectiveOp::ReduceScatter
                }
                CollectiveCommType::AllToAll => CollectiveOp::AllToAll,
                CollectiveCommType::Broadcast | CollectiveCommType::Scatter => {
                    CollectiveOp::Broadcast
                }
            };
            info.comm_group = match a.raw("pg_name").or_else(|| a.raw("comm_group")) {
                None => None,
                Some(Value::StringVal(s)) => Some(s.clone()),
                Some(v) => Some(
                    as_i64(v)
                        .ok_or_else(|| a.err(format!("unusable process group {v:?}")))?
                        .to_string(),
                ),
            };
            info.group = a
                .u64("orrery.group_id")?
                .and_then(|g| u32::try_from(g).ok())
                .map(GroupId);
            OpKind::Collective {
                op,
                group: a.named("orrery.group")?.unwrap_or(GroupRole::Dp),
                bytes: bytes("comm_size")?,
            }
        }
        NodeType::CommSendNode | NodeType::CommRecvNode => {
            let send = ty == NodeType::CommSendNode;
            info.peer = a.rank(if send { "comm_dst" } else { "comm_src" })?;
            let tag = match a.u64("orrery.tag")? {
                Some(t) => t,
                // ASTRA-sim's tags are 32-bit; keep the bits whatever the sign.
                None => a.i64("comm_tag")?.map_or(0, |t| u64::from(t as u32)),
            };
            let bytes = bytes("comm_size")?;
            let peer = a.named("orrery.peer")?;
            if send {
                OpKind::Send {
                    peer: peer.unwrap_or(PeerStage::Next),
                    bytes,
                    tag,
                }
            } else {
                OpKind::Recv {
                    peer: peer.unwrap_or(PeerStage::Prev),
                    bytes,
                    tag,
                }
            }
        }
    };
    let default_stream = match kind {
        OpKind::Collective { group, .. } => group.stream(),
        OpKind::Send { .. } | OpKind::Recv { .. } => Stream::PpComm,
        OpKind::Compute { .. } | OpKind::Alloc { .. } | OpKind::Free { .. } => Stream::Compute,
    };
    let microbatch = match a.u64("orrery.microbatch")? {
        None => None,
        Some(m) => {
            Some(u32::try_from(m).map_err(|_| a.err(format!("micro-batch {m} out of range")))?)
        }
    };
    Ok(Draft {
        op: Some(DraftOp {
            kind,
            stream: a.named("orrery.stream")?.unwrap_or(default_stream),
            phase: a.named("orrery.phase")?.unwrap_or(Phase::Forward),
            microbatch,
            info,
        }),
        deps,
        exact,
        alloc,
    })
}

/// A topological order of the nodes that always takes the earliest ready node in file
/// order, so a file whose dependencies all point backwards keeps its order.
fn topo_order(nodes: &[Node], drafts: &[Draft]) -> Result<Vec<usize>, ChakraError> {
    let n = drafts.len();
    let preds = |p: usize| drafts[p].deps.iter().chain(drafts[p].alloc.iter()).copied();
    let mut pending = vec![0usize; n];
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (p, count) in pending.iter_mut().enumerate() {
        let mut ps: Vec<usize> = preds(p).collect();
        ps.sort_unstable();
        ps.dedup();
        *count = ps.len();
        for q in ps {
            children[q].push(p);
        }
    }
    let mut ready: BinaryHeap<Reverse<usize>> =
        (0..n).filter(|&p| pending[p] == 0).map(Reverse).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(Reverse(p)) = ready.pop() {
        order.push(p);
        for &c in &children[p] {
            pending[c] -= 1;
            if pending[c] == 0 {
                ready.push(Reverse(c));
            }
        }
    }
    if order.len() == n {
        return Ok(order);
    }
    // Every node left waits on another node left; walking back from one must revisit a
    // node, and that node is on a cycle.
    let mut seen = vec![false; n];
    let mut at = (0..n).find(|&p| pending[p] > 0).unwrap_or(0);
    while !seen[at] {
        seen[at] = true;
        match preds(at).find(|&q| pending[q] > 0) {
            Some(q) => at = q,
            None => break,
        }
    }
    Err(ChakraError::Cycle {
        id: nodes.get(at).map_or(0, |x| x.id),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_framing() {
        assert_eq!(read_varint(&[0x05]), Some((5, 1)));
        assert_eq!(read_varint(&[0xac, 0x02]), Some((300, 2)));
        assert_eq!(read_varint(&[0x80]), None);
        assert_eq!(read_varint(&[]), None);
        let max = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01];
        assert_eq!(read_varint(&max), Some((u64::MAX, 10)));
        let over = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02];
        assert_eq!(read_varint(&over), None);
        assert!(matches!(
            split_messages(&[2, 1]),
            Err(ChakraError::TruncatedMessage {
                message: 0,
                len: 2,
                available: 1,
                ..
            })
        ));
        assert_eq!(
            split_messages(&[0, 1, 7]).ok(),
            Some(vec![&[][..], &[7][..]])
        );
    }

    #[test]
    fn tags_pack_into_31_bits_without_collisions() {
        use crate::schedule::Pass;
        let mut seen = std::collections::BTreeSet::new();
        for pass in [Pass::Forward, Pass::Backward] {
            for mb in [0u32, 1, 7, 1000, (1 << 20) - 1] {
                for boundary in [0u64, 1, 5, 1023] {
                    let t = comm_tag(crate::build::tag(pass, mb, boundary));
                    assert!(t >= 0);
                    assert!(seen.insert(t));
                }
            }
        }
    }

    #[test]
    fn wide_tags_are_numbered_alike_by_sender_and_receiver() {
        use crate::{Op, PeerStage, Phase, Stream};
        use orrery_units::OpId;
        let program =
            |kind: u64, chunk: u64, mb: u64| (1 << 63) | (kind << 48) | (chunk << 24) | mb;
        // The sender's order and the receiver's differ; the pair's set of tags is the same.
        let sent = [program(0, 1, 0), program(1, 0, 3), program(0, 0, 2), 6];
        let received = [program(0, 0, 2), 6, program(0, 1, 0), program(1, 0, 3)];
        let graph = |send: bool, tags: &[u64]| {
            let mut g = ExecGraph::new();
            for (i, &tag) in tags.iter().enumerate() {
                let (peer, bytes) = (PeerStage::Next, Bytes(4));
                let name = g.intern("msg");
                g.push(Op {
                    kind: if send {
                        OpKind::Send { peer, bytes, tag }
                    } else {
                        OpKind::Recv { peer, bytes, tag }
                    },
                    stream: Stream::PpComm,
                    phase: Phase::Forward,
                    deps: if i == 0 {
                        Vec::new()
                    } else {
                        vec![OpId::from_index(i - 1)]
                    },
                    name,
                    microbatch: None,
                });
            }
            g
        };
        let s = wide_tags(&graph(true, &sent), |_| RankId(1));
        let r = wide_tags(&graph(false, &received), |_| RankId(0));
        // The untagged message's place (6) is not wide and keeps `comm_tag`'s packing.
        assert_eq!(s.len(), 3);
        for &tag in &sent[..3] {
            let (a, b) = (s[&(true, 1, tag)], r[&(false, 0, tag)]);
            assert_eq!(a, b);
            assert!((1 << 30..i32::MAX).contains(&a));
        }
        let distinct: BTreeSet<i32> = s.values().copied().collect();
        assert_eq!(distinct.len(), 3);
        assert!(comm_tag(6) < 1 << 21);
    }

    #[test]
    fn pg_names_are_one_based() {
        assert_eq!(pg_name(GroupId(0)), "1");
        assert_eq!(group_of_pg_name("1"), Some(GroupId(0)));
        assert_eq!(group_of_pg_name("0"), None);
        assert_eq!(group_of_pg_name("x"), None);
    }

    #[test]
    fn enum_names_round_trip() {
        for s in Stream::ALL {
            assert_eq!(parse_enum::<Stream>(&enum_name(s)), Some(s));
        }
        for g in GroupRole::ALL {
            assert_eq!(parse_enum::<GroupRole>(&enum_name(g)), Some(g));
        }
        assert_eq!(enum_name(Stream::TpComm), "tp_comm");
    }
}
