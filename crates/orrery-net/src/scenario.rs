//! `orrery netsim` scenarios: a topology and its traffic, as TOML.
//!
//! ```toml
//! [topology]
//! kind = "single_switch"          # single_switch | dumbbell | rail_optimized | fat_tree
//! endpoints = 8
//! link_gbps = 400
//! delay_ns = 1000
//!
//! [simulator]
//! model = "packet"                # packet | flow
//! seed = 1
//!
//! [[flows]]                       # point-to-point messages
//! src = 0
//! dst = 1
//! bytes = 1048576
//! start_us = 0.0
//!
//! [[collectives]]                 # collectives expanded into flows
//! kind = "all_reduce"
//! algorithm = "ring"              # ring | double_binary_tree | host_tree | halving_doubling | direct | direct_pxn | hierarchical
//! channels = 8
//! ranks = { first = 0, count = 8 } # or an explicit list: ranks = [0, 1, 2, 3]
//! bytes = 1073741824
//! ```
//!
//! Topologies: `single_switch` (`endpoints`), `dumbbell` (`endpoints` per side,
//! `bottleneck_gbps`), `rail_optimized` and `fat_tree` (`hosts`, `gpus_per_host`,
//! `nvlink_gbytes`, `hosts_per_pod`, `spines`, `oversubscription`, `tiers`); every kind
//! takes `routing` (`ecmp`, the default, or `pinned`: see [`Routing`]). Instead of a
//! topology and flows, a `[job]` table (`preset` or `file`, `set`, `traffic`) makes the
//! communication of one training step the traffic; the CLI builds that through the
//! predictor, since this crate knows nothing of jobs. A `[packet]` table overrides the
//! packet model's settings.
//!
//! Parsing reports every problem at once with its path, like job specs. The parser never
//! panics on any input (fuzzed in `fuzz/`).

use crate::flows::{collective_flows, FlowAlgorithm, FlowSet};
use crate::topology::{FatTreeSpec, NetGraph, RailOptimizedSpec, Routing, TopologyError};
use crate::CollectiveKind;
use orrery_units::{Bandwidth, Bytes, Picos};
use serde::{Deserialize, Serialize};
use std::fmt;

/// One problem in a scenario, with the dotted path of the field it concerns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ScenarioProblem {
    pub path: String,
    pub message: String,
}

/// Why a scenario could not be loaded: every problem found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
pub struct ScenarioError(pub Vec<ScenarioProblem>);

impl fmt::Display for ScenarioError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the scenario has {} problem(s):", self.0.len())?;
        for p in &self.0 {
            write!(f, "\n  {}: {}", p.path, p.message)?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TopologyKindSpec {
    SingleSwitch,
    Dumbbell,
    RailOptimized,
    FatTree,
}

/// The `[topology]` table.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologySpec {
    pub kind: Option<TopologyKindSpec>,
    /// Endpoints of a single switch, or per side of a dumbbell.
    pub endpoints: Option<u64>,
    /// Hosts and GPUs per host (rail-optimised and fat-tree).
    pub hosts: Option<u64>,
    pub gpus_per_host: Option<u64>,
    /// Endpoint (NIC) link speed, Gb/s.
    pub link_gbps: Option<f64>,
    /// Dumbbell bottleneck, Gb/s.
    pub bottleneck_gbps: Option<f64>,
    /// NVLink bandwidth per GPU per direction, GB/s.
    pub nvlink_gbytes: Option<f64>,
    /// Propagation delay of every link, ns.
    pub delay_ns: Option<u64>,
    pub hosts_per_pod: Option<u64>,
    pub spines: Option<u64>,
    pub oversubscription: Option<f64>,
    pub tiers: Option<u8>,
    /// How flows are placed on equal-cost paths: `ecmp` (the default) or `pinned`.
    pub routing: Option<Routing>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SimModel {
    Packet,
    Flow,
    /// The packet model's fabric with bytes as a fluid ([`crate::packet::FluidSimulator`]).
    Fluid,
}

/// The `[simulator]` table.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimulatorSpec {
    pub model: Option<SimModel>,
    pub seed: Option<u64>,
}

impl SimulatorSpec {
    /// The model the scenario asks for: the packet model unless it says otherwise.
    pub fn model_or_default(&self) -> SimModel {
        self.model.unwrap_or(SimModel::Packet)
    }
}

/// One `[[flows]]` entry.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FlowEntry {
    pub name: Option<String>,
    pub src: Option<u64>,
    pub dst: Option<u64>,
    pub bytes: Option<u64>,
    pub start_us: Option<f64>,
}

/// Ranks of a collective: an explicit list or a contiguous block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RankSet {
    List(Vec<u64>),
    Block { first: u64, count: u64 },
}

/// One `[[collectives]]` entry.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectiveEntry {
    pub name: Option<String>,
    pub kind: Option<CollectiveKind>,
    pub algorithm: Option<String>,
    pub channels: Option<u32>,
    pub ranks: Option<RankSet>,
    pub bytes: Option<u64>,
    /// Per-step send latency, ns (default 2000).
    pub step_latency_ns: Option<u64>,
    pub start_us: Option<f64>,
}

/// A whole scenario file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScenarioSpec {
    pub name: Option<String>,
    #[serde(default)]
    pub topology: TopologySpec,
    #[serde(default)]
    pub simulator: SimulatorSpec,
    #[serde(default)]
    pub flows: Vec<FlowEntry>,
    #[serde(default)]
    pub collectives: Vec<CollectiveEntry>,
    /// Packet-model settings (see `PacketConfig`), kept as raw TOML so this module does not
    /// depend on the packet model; the caller deserializes it.
    pub packet: Option<toml::Table>,
    /// The communication of a training job as the traffic (`preset`, `file`, `set`,
    /// `traffic`). This crate knows nothing of jobs: the CLI builds the topology and flows
    /// through the predictor; `[topology]`, `[[flows]]` and `[[collectives]]` must then be
    /// absent.
    pub job: Option<toml::Table>,
}

impl Scenario {
    /// A scenario from an already built topology and flows (job traffic).
    pub fn from_parts(
        name: &str,
        graph: NetGraph,
        flows: FlowSet,
        spec: &ScenarioSpec,
    ) -> Scenario {
        Scenario {
            name: name.to_string(),
            graph,
            flows,
            model: spec.simulator.model_or_default(),
            seed: spec.simulator.seed.unwrap_or(1),
        }
    }
}

/// A validated scenario: the topology, its traffic and the simulator choice.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: String,
    pub graph: NetGraph,
    pub flows: FlowSet,
    pub model: SimModel,
    pub seed: u64,
}

struct Problems(Vec<ScenarioProblem>);

impl Problems {
    fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(ScenarioProblem {
            path: path.into(),
            message: message.into(),
        });
    }
    fn need<T: Copy>(&mut self, path: &str, v: Option<T>) -> Option<T> {
        if v.is_none() {
            self.push(path, "is required");
        }
        v
    }
    fn positive_f64(&mut self, path: &str, v: Option<f64>, default: Option<f64>) -> Option<f64> {
        match v.or(default) {
            None => {
                self.push(path, "is required");
                None
            }
            Some(x) if x.is_finite() && x > 0.0 => Some(x),
            Some(x) => {
                self.push(path, format!("must be a positive number, got {x}"));
                None
            }
        }
    }
}

/// The speeds a topology's shape is built with where the scenario's are wrong (their
/// problems are reported; the shape only numbers the endpoints).
const DEFAULT_LINK_GBITS: f64 = 400.0;
const DEFAULT_NVLINK_GBYTES: f64 = 450.0;

/// Largest endpoint count a scenario may build.
const MAX_ENDPOINTS: u64 = 1 << 16;

/// Parses a scenario file without validating it.
pub fn parse_scenario(text: &str) -> Result<ScenarioSpec, ScenarioError> {
    let single = |m: String| {
        ScenarioError(vec![ScenarioProblem {
            path: "scenario".into(),
            message: m,
        }])
    };
    let tree: toml::Table = toml::from_str(text).map_err(|e| single(e.to_string()))?;
    let spec: ScenarioSpec = match toml::Value::Table(tree.clone()).try_into() {
        Ok(spec) => spec,
        Err(first) => {
            let problems = field_problems(&tree);
            return Err(if problems.is_empty() {
                single(first.to_string())
            } else {
                ScenarioError(problems)
            });
        }
    };
    if spec.job.is_some() {
        let mut p = Problems(Vec::new());
        if spec.topology != TopologySpec::default() {
            p.push(
                "topology",
                "a [job] scenario takes its topology from the job's cluster",
            );
        }
        if !spec.flows.is_empty() || !spec.collectives.is_empty() {
            p.push(
                "job",
                "a [job] scenario cannot also list [[flows]] or [[collectives]]",
            );
        }
        if !p.0.is_empty() {
            return Err(ScenarioError(p.0));
        }
    }
    Ok(spec)
}

/// Every field that does not deserialize, found one at a time: every field of every table is
/// optional, so a table holding only that field deserializes exactly when its name is known
/// and its value has the right type. Array entries are checked entry by entry.
fn field_problems(tree: &toml::Table) -> Vec<ScenarioProblem> {
    fn check<T: serde::de::DeserializeOwned>(
        key: &str,
        value: &toml::Value,
        path: &str,
        out: &mut Vec<ScenarioProblem>,
    ) {
        let mut single = toml::Table::new();
        single.insert(key.to_string(), value.clone());
        if let Err(e) = toml::Value::Table(single).try_into::<T>() {
            let message = e
                .to_string()
                .lines()
                .map(str::trim)
                .find(|l| !l.is_empty())
                .unwrap_or("")
                .to_string();
            out.push(ScenarioProblem {
                path: path.to_string(),
                message,
            });
        }
    }
    fn table<T: serde::de::DeserializeOwned>(
        t: &toml::Table,
        prefix: &str,
        out: &mut Vec<ScenarioProblem>,
    ) {
        for (k, v) in t {
            check::<T>(k, v, &format!("{prefix}.{k}"), out);
        }
    }
    let mut out = Vec::new();
    for (key, value) in tree {
        match (key.as_str(), value) {
            ("topology", toml::Value::Table(t)) => table::<TopologySpec>(t, "topology", &mut out),
            ("simulator", toml::Value::Table(t)) => {
                table::<SimulatorSpec>(t, "simulator", &mut out)
            }
            ("flows", toml::Value::Array(entries))
            | ("collectives", toml::Value::Array(entries)) => {
                for (i, entry) in entries.iter().enumerate() {
                    let prefix = format!("{key}[{i}]");
                    match entry {
                        toml::Value::Table(t) if key == "flows" => {
                            table::<FlowEntry>(t, &prefix, &mut out)
                        }
                        toml::Value::Table(t) => table::<CollectiveEntry>(t, &prefix, &mut out),
                        _ => out.push(ScenarioProblem {
                            path: prefix,
                            message: "must be a table".into(),
                        }),
                    }
                }
            }
            _ => check::<ScenarioSpec>(key, value, key, &mut out),
        }
    }
    out
}

/// Parses and validates a scenario whose traffic is flows and collectives (not a `[job]`).
pub fn load_scenario(text: &str) -> Result<Scenario, ScenarioError> {
    build(&parse_scenario(text)?)
}

fn micros(path: &str, v: Option<f64>, p: &mut Problems) -> Picos {
    match v {
        None => Picos::ZERO,
        Some(x) if x.is_finite() && x >= 0.0 => Picos::from_secs_f64(x * 1e-6),
        Some(x) => {
            p.push(
                path,
                format!("must be a non-negative number of microseconds, got {x}"),
            );
            Picos::ZERO
        }
    }
}

fn algorithm(name: &str, channels: u32) -> Option<FlowAlgorithm> {
    Some(match name {
        "ring" => FlowAlgorithm::Ring {
            channels: channels.max(1),
        },
        "double_binary_tree" | "tree" => FlowAlgorithm::DoubleBinaryTree,
        "host_tree" => FlowAlgorithm::HostTree,
        "halving_doubling" => FlowAlgorithm::HalvingDoubling,
        "direct" => FlowAlgorithm::Direct,
        "direct_pxn" => FlowAlgorithm::DirectPxn,
        "hierarchical" => FlowAlgorithm::Hierarchical,
        _ => return None,
    })
}

/// Validates a parsed scenario into a topology and flows.
pub fn build(spec: &ScenarioSpec) -> Result<Scenario, ScenarioError> {
    let mut p = Problems(Vec::new());
    if spec.job.is_some() {
        p.push(
            "job",
            "job traffic is built by `orrery netsim`, not by this function",
        );
        return Err(ScenarioError(p.0));
    }
    // Known wherever the topology's kind and counts are, even if a speed is wrong.
    let graph = build_topology(&spec.topology, &mut p);
    let endpoints = graph.as_ref().map(|g| g.num_endpoints() as u64);
    let per_host = graph.as_ref().map_or(1, |g| g.endpoints_per_host());
    let mut flows = FlowSet::default();
    let in_range = |p: &mut Problems, path: &str, r: u64| {
        if let Some(n) = endpoints {
            if r >= n {
                p.push(
                    path,
                    format!("endpoint {r} does not exist (the topology has {n})"),
                );
                return false;
            }
        }
        true
    };
    for (i, f) in spec.flows.iter().enumerate() {
        let path = |field: &str| format!("flows[{i}].{field}");
        let src = p.need(&path("src"), f.src);
        let dst = p.need(&path("dst"), f.dst);
        let bytes = p.need(&path("bytes"), f.bytes);
        let start = micros(&path("start_us"), f.start_us, &mut p);
        let ok_src = src.is_some_and(|s| in_range(&mut p, &path("src"), s));
        let ok_dst = dst.is_some_and(|d| in_range(&mut p, &path("dst"), d));
        if let (Some(s), Some(d)) = (src, dst) {
            if s == d {
                p.push(path("dst"), "must differ from src");
            }
        }
        if bytes == Some(0) {
            p.push(path("bytes"), "must be at least 1");
        }
        if let (true, true, Some(s), Some(d), Some(b)) = (ok_src, ok_dst, src, dst, bytes) {
            if s != d && b > 0 {
                let name = f.name.clone().unwrap_or_else(|| format!("flow {i}"));
                flows.push_p2p(&name, s as u32, d as u32, Bytes(b), start);
            }
        }
    }
    for (i, c) in spec.collectives.iter().enumerate() {
        let path = |field: &str| format!("collectives[{i}].{field}");
        let kind = p.need(&path("kind"), c.kind);
        let bytes = p.need(&path("bytes"), c.bytes);
        let alg_name = c.algorithm.clone().unwrap_or_else(|| "ring".to_string());
        let alg = algorithm(&alg_name, c.channels.unwrap_or(1));
        if alg.is_none() {
            p.push(path("algorithm"), format!("unknown algorithm `{alg_name}`; known: ring, double_binary_tree, host_tree, halving_doubling, direct, direct_pxn, hierarchical"));
        }
        let ranks: Option<Vec<u64>> = match &c.ranks {
            None => {
                p.push(path("ranks"), "is required");
                None
            }
            Some(RankSet::List(v)) => Some(v.clone()),
            Some(RankSet::Block { first, count }) => {
                if count.saturating_add(*first) > MAX_ENDPOINTS {
                    p.push(
                        path("ranks"),
                        format!("block exceeds {MAX_ENDPOINTS} endpoints"),
                    );
                    None
                } else {
                    Some((*first..first + count).collect())
                }
            }
        };
        let ranks = ranks.filter(|r| {
            let mut ok = r.len() >= 2;
            if !ok {
                p.push(path("ranks"), "needs at least 2 ranks");
            }
            let mut sorted = r.clone();
            sorted.sort_unstable();
            sorted.dedup();
            if sorted.len() != r.len() {
                p.push(path("ranks"), "lists a rank twice");
                ok = false;
            }
            for &x in r {
                ok &= in_range(&mut p, &path("ranks"), x);
            }
            ok
        });
        let start = micros(&path("start_us"), c.start_us, &mut p);
        let step = Picos::from_nanos(c.step_latency_ns.unwrap_or(2_000));
        if let (Some(kind), Some(bytes), Some(alg), Some(ranks)) = (kind, bytes, alg, ranks) {
            let ranks: Vec<u32> = ranks.iter().map(|&r| r as u32).collect();
            let name = c.name.clone().unwrap_or_else(|| format!("collective {i}"));
            let before = flows.flows.len();
            match collective_flows(
                &mut flows,
                &name,
                kind,
                alg,
                &ranks,
                Bytes(bytes),
                per_host,
                step,
            ) {
                Ok(range) => {
                    // A start time delays the collective's first flows.
                    for f in &mut flows.flows[range] {
                        if f.deps.is_empty() {
                            f.delay += start;
                        }
                    }
                }
                Err(e) => {
                    flows.flows.truncate(before);
                    p.push(path("kind"), e.to_string());
                }
            }
        }
    }
    if spec.flows.is_empty() && spec.collectives.is_empty() {
        p.push(
            "flows",
            "the scenario has no traffic: add [[flows]] or [[collectives]]",
        );
    }
    match (p.0.is_empty(), graph) {
        (true, Some(graph)) => Ok(Scenario {
            name: spec.name.clone().unwrap_or_else(|| "scenario".to_string()),
            graph,
            flows,
            model: spec.simulator.model_or_default(),
            seed: spec.simulator.seed.unwrap_or(1),
        }),
        _ => Err(ScenarioError(p.0)),
    }
}

/// The topology a scenario describes, its problems pushed to `p`. A speed that is wrong
/// is reported and replaced by the default, so the topology still numbers its endpoints
/// and the traffic's endpoints are checked in the same pass; it is `None` only where the
/// kind or a count is wrong. With any problem in `p` it is no more than that numbering.
fn build_topology(t: &TopologySpec, p: &mut Problems) -> Option<NetGraph> {
    let kind = p.need("topology.kind", t.kind)?;
    let default_link = Bandwidth::from_gbits_per_sec(DEFAULT_LINK_GBITS);
    let link = p
        .positive_f64("topology.link_gbps", t.link_gbps, Some(DEFAULT_LINK_GBITS))
        .map_or(default_link, Bandwidth::from_gbits_per_sec);
    let delay = Picos::from_nanos(t.delay_ns.unwrap_or(1_000));
    let count = |p: &mut Problems, path: &str, v: Option<u64>| -> Option<usize> {
        match v {
            None => {
                p.push(path, "is required");
                None
            }
            Some(0) => {
                p.push(path, "must be at least 1");
                None
            }
            Some(x) if x > MAX_ENDPOINTS => {
                p.push(
                    path,
                    format!("is {x}, more than the supported {MAX_ENDPOINTS}"),
                );
                None
            }
            Some(x) => Some(x as usize),
        }
    };
    // The hosts and GPUs per host of the GPU fabrics, and their NVLink speed.
    let gpu_hosts = |p: &mut Problems| {
        let hosts = count(p, "topology.hosts", t.hosts);
        let gpus = count(p, "topology.gpus_per_host", t.gpus_per_host.or(Some(8)));
        let nvl = p
            .positive_f64(
                "topology.nvlink_gbytes",
                t.nvlink_gbytes,
                Some(DEFAULT_NVLINK_GBYTES),
            )
            .unwrap_or(DEFAULT_NVLINK_GBYTES);
        (hosts.zip(gpus), Bandwidth::from_gbytes_per_sec(nvl))
    };
    let result: Option<Result<NetGraph, TopologyError>> = match kind {
        TopologyKindSpec::SingleSwitch => {
            let n = count(p, "topology.endpoints", t.endpoints);
            n.map(|n| NetGraph::single_switch(n, link, delay))
        }
        TopologyKindSpec::Dumbbell => {
            let n = count(p, "topology.endpoints", t.endpoints);
            let b = p
                .positive_f64("topology.bottleneck_gbps", t.bottleneck_gbps, None)
                .map_or(default_link, Bandwidth::from_gbits_per_sec);
            n.map(|n| NetGraph::dumbbell(n, n, link, b, delay))
        }
        TopologyKindSpec::RailOptimized => {
            let (hosts_gpus, nvl) = gpu_hosts(p);
            hosts_gpus.map(|(hosts, gpus)| {
                let base = RailOptimizedSpec::dgx_h100(hosts);
                NetGraph::rail_optimized(&RailOptimizedSpec {
                    gpus_per_host: gpus,
                    nic: link,
                    nvlink: nvl,
                    link_delay: delay,
                    hosts_per_pod: t.hosts_per_pod.map_or(base.hosts_per_pod, |x| x as usize),
                    spines: t.spines.map_or(base.spines, |x| x as usize),
                    spine_oversubscription: t.oversubscription.unwrap_or(1.0),
                    ..base
                })
            })
        }
        TopologyKindSpec::FatTree => {
            let (hosts_gpus, nvl) = gpu_hosts(p);
            hosts_gpus.map(|(hosts, gpus)| {
                let base = match t.tiers.unwrap_or(2) {
                    3 => FatTreeSpec::three_tier(hosts),
                    _ => FatTreeSpec::two_tier(hosts),
                };
                NetGraph::fat_tree(&FatTreeSpec {
                    gpus_per_host: gpus,
                    nic: link,
                    nvlink: nvl,
                    link_delay: delay,
                    tiers: t.tiers.unwrap_or(2),
                    spines: t.spines.map_or(base.spines, |x| x as usize),
                    oversubscription: t.oversubscription.unwrap_or(1.0),
                    ..base
                })
            })
        }
    };
    match result? {
        Ok(g) => Some(g.with_routing(t.routing.unwrap_or_default())),
        Err(e) => {
            p.push("topology", e.to_string());
            None
        }
    }
}
