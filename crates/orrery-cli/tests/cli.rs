//! End-to-end tests of the `orrery` binary: golden reports, exit codes, written files.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{assert_mentions, orrery, temp_dir};
use expect_test::expect;
use std::process::Command;

const SMALL_JOB: &str = r#"
name = "small test job"
[model]
layers = 8
hidden = 1024
heads = 16
kv_heads = 4
ffn = 4096
vocab = 32000
seq_len = 2048
activation = "swiglu"
[training]
global_batch = 32
micro_batch = 1
recompute = "selective"
zero_stage = 1
[parallel]
tp = 2
pp = 2
vpp = 2
sp = true
[cluster]
gpu = "H100-SXM"
gpus_per_node = 8
nodes = 2
"#;

#[test]
fn golden_report_for_a_small_job() {
    let dir = temp_dir("golden");
    let job = dir.join("job.toml");
    std::fs::write(&job, SMALL_JOB).unwrap();
    let (code, stdout, stderr) = orrery(&["predict", job.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    expect![[r#"
        orrery predict: small test job
        16 x H100-SXM, network model: analytical

        Step
        --------------------------------
          step time              0.020 s
          tokens / step            65536
          tokens / s             3275607
          model TFLOP/s per GPU    230.9
          MFU                      23.3%

        Where the time goes (stage 0, the last to finish)
        -------------------------------------------------
          compute: forward     3.9 ms   19.4%
          compute: backward    6.9 ms   34.5%
          compute: recompute   0.0 ms    0.0%
          optimizer            0.1 ms    0.7%
          exposed TP comm      2.4 ms   12.0%
          exposed CP comm      0.0 ms    0.0%
          exposed EP comm      0.0 ms    0.0%
          exposed PP comm      0.5 ms    2.5%
          exposed DP comm      0.4 ms    2.1%
          pipeline bubble      5.8 ms   28.8%
          total               20.0 ms  100.0%

        Peak memory per pipeline stage (GiB at peak by category)
        --------------------------------------------------------
          stage  0 (rank 0)  0.78 / 76.60 GiB  fits  [weights 0.1, gradients 0.2, optimizer 0.1, activations 0.4]
          stage  1 (rank 8)  0.75 / 76.60 GiB  fits  [weights 0.1, gradients 0.2, optimizer 0.1, activations 0.2, temporary 0.1]

        Verdict: every rank fits in memory.
        Replayed 2410 ops in 2410 events: 2 symmetry classes standing for 16 ranks.
    "#]].assert_eq(&stdout);
}

#[test]
fn default_job_runs_and_prints_the_full_report() {
    let (code, stdout, stderr) = orrery(&["predict"]);
    assert_eq!(code, 0, "{stderr}");
    for needle in [
        "Llama-3 70B",
        "step time",
        "MFU",
        "Where the time goes",
        "pipeline bubble",
        "Peak memory",
        "Verdict",
    ] {
        assert!(stdout.contains(needle), "missing {needle}:\n{stdout}");
    }
}

#[test]
fn bad_spec_lists_every_problem_and_exits_2() {
    let dir = temp_dir("bad");
    let job = dir.join("bad.toml");
    std::fs::write(&job, SMALL_JOB).unwrap();
    let (code, _, stderr) = orrery(&[
        "predict",
        job.to_str().unwrap(),
        "--set",
        "parallel.tp=3",
        "--set",
        "parallel.dp=4",
        "--set",
        "training.global_batch=33",
        "--set",
        "cluster.gpu=Z100",
    ]);
    assert_eq!(code, 2);
    for path in [
        "parallel.tp",
        "parallel.dp",
        "training.global_batch",
        "cluster.gpu",
    ] {
        assert!(stderr.contains(path), "missing {path}:\n{stderr}");
    }
}

#[test]
fn unknown_preset_missing_file_and_bad_override_exit_2() {
    assert_eq!(orrery(&["predict", "--preset", "no-such-job"]).0, 2);
    assert_eq!(orrery(&["predict", "/no/such/file.toml"]).0, 2);
    assert_eq!(orrery(&["predict", "--set", "parallel.tp"]).0, 2);
    let (code, _, stderr) = orrery(&["predict", "--set", "parallel.tensor=2"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("tensor"), "{stderr}");
}

#[test]
fn json_trace_plots_and_chakra_are_written() {
    let dir = temp_dir("outputs");
    let job = dir.join("job.toml");
    std::fs::write(&job, SMALL_JOB).unwrap();
    let trace = dir.join("trace.json");
    let plots = dir.join("plots");
    let chakra = dir.join("et/job");
    std::fs::create_dir_all(dir.join("et")).unwrap();
    let (code, stdout, stderr) = orrery(&[
        "predict",
        job.to_str().unwrap(),
        "--json",
        "--trace",
        trace.to_str().unwrap(),
        "--plot",
        plots.to_str().unwrap(),
        "--chakra",
        chakra.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert!(v["step_time"].as_u64().unwrap() > 0);
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    assert!(!t["traceEvents"].as_array().unwrap().is_empty());
    assert!(std::fs::read_to_string(plots.join("memory.svg"))
        .unwrap()
        .starts_with("<svg"));
    assert!(std::fs::read_to_string(plots.join("breakdown.svg"))
        .unwrap()
        .starts_with("<svg"));
    for r in 0..16 {
        assert!(dir.join(format!("et/job.{r}.et")).exists(), "rank {r}");
    }
    let groups: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("et/job.groups.json")).unwrap()).unwrap();
    assert!(groups.as_object().is_some_and(|g| !g.is_empty()));
}

#[test]
fn exported_chakra_traces_replay_to_the_predicted_step_time() {
    let dir = temp_dir("replay");
    let job = dir.join("job.toml");
    std::fs::write(&job, SMALL_JOB).unwrap();
    let prefix = dir.join("job");
    let (code, stdout, stderr) = orrery(&[
        "predict",
        job.to_str().unwrap(),
        "--json",
        "--all-ranks",
        "--chakra",
        prefix.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let predicted: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let (code, stdout, stderr) = orrery(&["replay", prefix.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{stderr}");
    let replayed: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(replayed["ranks"], 16);
    assert_eq!(replayed["step_time"], predicted["step_time"]);
    // Every corrupt rank is named, with the flags' problems, at once.
    let good = std::fs::read(dir.join("job.2.et")).unwrap();
    for rank in [2, 7] {
        std::fs::write(dir.join(format!("job.{rank}.et")), b"junk").unwrap();
    }
    let (code, _, stderr) = orrery(&[
        "replay",
        prefix.to_str().unwrap(),
        "--gpu",
        "nope",
        "--gpus-per-node",
        "0",
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert_mentions(
        &stderr,
        &["job.2.et", "job.7.et", "--gpu", "--gpus-per-node"],
    );
    std::fs::write(dir.join("job.2.et"), &good).unwrap();
    std::fs::remove_file(dir.join("job.7.et")).unwrap();
    // A missing rank is bad input, reported with exit status 2.
    std::fs::remove_file(dir.join("job.5.et")).unwrap();
    assert_eq!(orrery(&["replay", prefix.to_str().unwrap()]).0, 2);
    assert_eq!(
        orrery(&["replay", dir.join("nothing").to_str().unwrap()]).0,
        2
    );
}

/// The published shape of Llama-3-8B's config.json.
const LLAMA3_8B_CONFIG: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "num_attention_heads": 32,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "vocab_size": 128256,
  "max_position_embeddings": 8192,
  "hidden_act": "silu",
  "tie_word_embeddings": false,
  "rms_norm_eps": 1e-05,
  "rope_theta": 500000.0,
  "torch_dtype": "bfloat16"
}"#;

#[test]
fn hf_config_replaces_the_model() {
    let dir = temp_dir("hf");
    let job = dir.join("job.toml");
    std::fs::write(&job, SMALL_JOB).unwrap();
    let config = dir.join("config.json");
    std::fs::write(&config, LLAMA3_8B_CONFIG).unwrap();
    let (code, stdout, stderr) = orrery(&[
        "predict",
        job.to_str().unwrap(),
        "--hf-config",
        config.to_str().unwrap(),
        "--set",
        "model.seq_len=4096",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    // 32 sequences of the job's 4096 tokens (the config's 8192 is its maximum context).
    assert_eq!(v["tokens_per_step"], 32 * 4096);
    // A config that is not JSON is bad input.
    std::fs::write(&config, "{ not json").unwrap();
    let (code, _, stderr) = orrery(&[
        "predict",
        job.to_str().unwrap(),
        "--hf-config",
        config.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{stderr}");
}

/// An output path that names a FIFO (or a device such as `/dev/null`) is written in place:
/// the atomic write's rename would have put a regular file where it was. (Once, on a CI
/// machine, `/dev/null` held a compiler's complaint, and cargo read it as source code.)
#[cfg(unix)]
#[test]
fn outputs_to_a_fifo_are_written_through_it_not_renamed_over_it() {
    use std::os::unix::fs::FileTypeExt;
    let dir = temp_dir("fifo-out");
    let fifo = dir.join("out.json");
    let made = Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        eprintln!("mkfifo is not available here; nothing to check");
        return;
    }
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read_to_string(fifo).unwrap())
    };
    let scenario = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/scenarios/incast.toml"
    );
    let (code, _, stderr) = orrery(&["netsim", scenario, "--out", fifo.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    let kind = std::fs::symlink_metadata(&fifo).unwrap().file_type();
    assert!(kind.is_fifo(), "the FIFO was replaced: {kind:?}");
    let written: serde_json::Value = serde_json::from_str(&reader.join().unwrap()).unwrap();
    assert_eq!(written["flows"].as_array().map(Vec::len), Some(8));
}

#[test]
fn netsim_runs_a_scenario_at_flow_packet_and_fluid_level() {
    let dir = temp_dir("netsim");
    let scenario = dir.join("incast.toml");
    std::fs::write(
        &scenario,
        r#"
        name = "incast"
        [topology]
        kind = "single_switch"
        endpoints = 5
        link_gbps = 100
        [[flows]]
        src = 1
        dst = 0
        bytes = 262144
        [[flows]]
        src = 2
        dst = 0
        bytes = 262144
        [[flows]]
        src = 3
        dst = 0
        bytes = 262144
        [[flows]]
        src = 4
        dst = 0
        bytes = 262144
        "#,
    )
    .unwrap();
    // `netsim` on the scenario with `--json` and these arguments, which must succeed.
    let netsim_json = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["netsim", scenario.to_str().unwrap(), "--json"];
        args.extend_from_slice(extra);
        let (code, stdout, stderr) = orrery(&args);
        assert_eq!(code, 0, "{stderr}");
        serde_json::from_str(&stdout).unwrap()
    };
    for model in ["flow", "packet", "fluid"] {
        let v = netsim_json(&["--model", model]);
        assert_eq!(v["model"], model);
        assert_eq!(v["fct"]["count"], 4);
        assert_eq!(v["bytes_delivered"], v["bytes_sent"]);
        assert_eq!(v["drops"], 0);
        assert_eq!(v.get("calm_skip").is_some(), model == "fluid");
    }
    // The fluid model stepping every flow gives the same flows (the calm skip's
    // equivalence, which tests/fluid.rs checks in depth).
    let fluid_out = |extra: &[&str]| {
        let out = dir.join("fluid.json");
        let mut args = vec![
            "netsim",
            scenario.to_str().unwrap(),
            "--model",
            "fluid",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let (code, _, stderr) = orrery(&args);
        assert_eq!(code, 0, "{stderr}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
        assert_eq!(v["flows"].as_array().map(Vec::len), Some(4));
        v["flows"].clone()
    };
    assert_eq!(fluid_out(&[]), fluid_out(&["--fluid-every-step"]));
    // The flag is taken (this scenario has no symmetry to reduce; the training step's
    // test below compares a reduced run with a full one).
    assert_eq!(fluid_out(&[]), fluid_out(&["--fluid-no-symmetry"]));
    // The fluid model's step: the default or the one asked for, never longer than the
    // shortest delay of a link the flows use (every link here has the default 1 us).
    let step_ps = |extra: &[&str]| {
        let args = [&["--model", "fluid"], extra].concat();
        netsim_json(&args)["fluid_step_ps"].as_u64()
    };
    assert_eq!(step_ps(&[]), Some(500_000));
    assert_eq!(step_ps(&["--fluid-step-ns", "125"]), Some(125_000));
    assert_eq!(step_ps(&["--fluid-step-ns", "5000"]), Some(1_000_000));
    // Links stepped once every few steps: the 1 us cables every 1 us with 500 ns steps.
    let v = netsim_json(&["--model", "fluid", "--fluid-link-step-ns", "1000"]);
    assert_eq!(v["fluid_step_ps"].as_u64(), Some(500_000));
    assert_eq!(v["fluid_link_step_ps"].as_u64(), Some(1_000_000));
    assert_eq!(v["fct"]["count"], 4);
    // The steps between the cables' transmissions are skipped, and taken with
    // `--fluid-no-gap-skip`, for the same flows.
    assert!(v["fluid_gap_skipped_steps"].as_u64() > Some(0), "{v}");
    let strided = ["--fluid-link-step-ns", "1000"];
    assert_eq!(
        fluid_out(&strided),
        fluid_out(&[&strided[..], &["--fluid-no-gap-skip"]].concat())
    );
    // 0: every link every step (no link is strided, so the field is left out).
    let v = netsim_json(&["--model", "fluid", "--fluid-link-step-ns", "0"]);
    assert_eq!(v["fluid_step_ps"].as_u64(), Some(500_000));
    assert!(v.get("fluid_link_step_ps").is_none(), "{v}");
    assert!(v.get("fluid_gap_skipped_steps").is_none(), "{v}");
    // A Perfetto trace of the run, with every model: a slice per flow on its sender's
    // track, and one per collective.
    for model in ["flow", "packet", "fluid"] {
        let trace = dir.join(format!("trace-{model}.json"));
        let (code, _, stderr) = orrery(&[
            "netsim",
            scenario.to_str().unwrap(),
            "--model",
            model,
            "--trace",
            trace.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{stderr}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
        let slices = |cat: &str| {
            v["traceEvents"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["ph"] == "X" && e["cat"] == cat)
                .count()
        };
        assert_eq!(slices("flow"), 4, "{model}");
        assert!(slices("collective") >= 1, "{model}");
        assert_eq!(v["otherData"]["model"], model);
    }
    // A queue-depth trace of the receiver's link (switch -> endpoint 0 is link 1).
    let trace = dir.join("queue.csv");
    let (code, _, stderr) = orrery(&[
        "netsim",
        scenario.to_str().unwrap(),
        "--queue-trace",
        "1",
        "--queue-trace-out",
        trace.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let csv = std::fs::read_to_string(&trace).unwrap();
    assert!(csv.starts_with("time_us,queue_bytes\n"));
    let peak = csv
        .lines()
        .skip(1)
        .filter_map(|l| l.split(',').nth(1)?.parse::<u64>().ok())
        .max();
    assert!(
        peak.unwrap_or(0) > 0,
        "an incast must queue at the receiver's port"
    );
    assert_eq!(
        orrery(&["netsim", scenario.to_str().unwrap(), "--queue-trace", "999"]).0,
        2
    );
    // A broken scenario is bad input: exit status 2 with the problem's path.
    std::fs::write(&scenario, "[topology]\nkind = \"single_switch\"\nendpoints = 2\n[[flows]]\nsrc = 0\ndst = 7\nbytes = 1\n").unwrap();
    let (code, _, stderr) = orrery(&["netsim", scenario.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(stderr.contains("flows[0].dst"), "{stderr}");
    // Every problem of the file at once: a wrong speed does not hide the endpoint that
    // does not exist, nor do both hide the [packet] table's.
    std::fs::write(
        &scenario,
        "[topology]\nkind = \"single_switch\"\nendpoints = 2\nlink_gbps = 0\n\
         [packet.accel]\nwindow = 0\n[[flows]]\nsrc = 0\ndst = 7\nbytes = 1\n",
    )
    .unwrap();
    let (code, _, stderr) = orrery(&["netsim", scenario.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert_mentions(
        &stderr,
        &["topology.link_gbps", "flows[0].dst", "packet.accel.window"],
    );
    // The packet model's switches are refused at flow level, with the file's problems.
    let (code, _, stderr) = orrery(&[
        "netsim",
        scenario.to_str().unwrap(),
        "--model",
        "flow",
        "--no-memo",
        "--queue-trace",
        "1",
    ]);
    assert_eq!(code, 2);
    assert_mentions(&stderr, &["--no-memo, --queue-trace apply", "flows[0].dst"]);
    // And in the fluid model, which has no packets to accelerate or trace.
    let (code, _, stderr) = orrery(&[
        "netsim",
        scenario.to_str().unwrap(),
        "--model",
        "fluid",
        "--reference",
    ]);
    assert_eq!(code, 2);
    assert_mentions(&stderr, &["--reference", "fluid model", "flows[0].dst"]);
    // The fluid model's own switches are refused with the packet model, and a step that
    // is not a positive time with any model.
    let (code, _, stderr) = orrery(&[
        "netsim",
        scenario.to_str().unwrap(),
        "--fluid-every-step",
        "--fluid-no-symmetry",
        "--fluid-no-gap-skip",
        "--fluid-step-ns",
        "0",
        "--fluid-link-step-ns=-1",
    ]);
    assert_eq!(code, 2);
    assert_mentions(
        &stderr,
        &[
            "--fluid-every-step applies to the fluid model",
            "--fluid-no-symmetry applies to the fluid model",
            "--fluid-no-gap-skip applies to the fluid model",
            "--fluid-step-ns applies to the fluid model",
            "--fluid-step-ns must be",
            "--fluid-link-step-ns applies to the fluid model",
            "--fluid-link-step-ns must be 0 (every link every step) or",
            "flows[0].dst",
        ],
    );
    // Outputs into folders that do not exist are refused before anything runs, all named.
    let nowhere = dir.join("no-such-folder");
    let (code, stdout, stderr) = orrery(&[
        "netsim",
        scenario.to_str().unwrap(),
        "--out",
        nowhere.join("out.json").to_str().unwrap(),
        "--memo-cache",
        nowhere.join("memo.bin").to_str().unwrap(),
        "--trace",
        nowhere.join("trace.json").to_str().unwrap(),
    ]);
    assert_eq!(code, 2);
    assert!(stdout.is_empty(), "{stdout}");
    assert_mentions(
        &stderr,
        &[
            "--out: cannot write",
            "--memo-cache: cannot write",
            "--trace: cannot write",
        ],
    );
    // The [packet] table alone.
    std::fs::write(
        &scenario,
        "[topology]\nkind = \"single_switch\"\nendpoints = 2\n\
         [packet.accel]\nwindow = 0\n[[flows]]\nsrc = 0\ndst = 1\nbytes = 1\n",
    )
    .unwrap();
    let (code, _, stderr) = orrery(&["netsim", scenario.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(stderr.contains("packet.accel.window"), "{stderr}");
}

#[test]
fn netsim_takes_a_jobs_step_as_traffic_released_by_each_rule() {
    let dir = temp_dir("netsim-job");
    std::fs::write(dir.join("job.toml"), SMALL_JOB).unwrap();
    let scenario = dir.join("step.toml");
    let with_release = |release: &str| {
        std::fs::write(
            &scenario,
            format!(
                "[simulator]\nmodel = \"flow\"\n[job]\nfile = \"job.toml\"\ntraffic = [\"dp\", \"pp\"]\n{release}"
            ),
        )
        .unwrap();
        orrery(&["netsim", scenario.to_str().unwrap(), "--json"])
    };
    let mut sent = Vec::new();
    for release in [
        "",
        "release = \"replay\"",
        "release = \"dependencies\"",
        "release = \"rendezvous\"",
    ] {
        let (code, stdout, stderr) = with_release(release);
        assert_eq!(code, 0, "{release}: {stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(v["bytes_delivered"], v["bytes_sent"]);
        sent.push((
            v["fct"]["count"].clone(),
            v["bytes_sent"].clone(),
            v["end"].clone(),
        ));
    }
    // Rendezvous is the default; every rule releases the same flows.
    assert_eq!(sent[0], sent[3]);
    for other in &sent[1..] {
        assert_eq!(sent[0].0, other.0);
        assert_eq!(sent[0].1, other.1);
    }
    let (code, _, stderr) = with_release("release = \"later\"");
    assert_eq!(code, 2);
    assert!(stderr.contains("job.release"), "{stderr}");
    // Every problem of the table at once.
    let (code, _, stderr) = with_release("release = \"later\"\nmax_traffic_gib = -1");
    assert_eq!(code, 2);
    assert!(stderr.contains("job.release"), "{stderr}");
    assert!(stderr.contains("job.max_traffic_gib"), "{stderr}");
    // With the job's own problems and the [packet] table's.
    let (code, _, stderr) =
        with_release("release = \"later\"\nset = [\"parallel.pp=0\"]\n[packet.accel]\nwindow = 0");
    assert_eq!(code, 2);
    assert_mentions(
        &stderr,
        &["parallel.pp", "job.release", "packet.accel.window"],
    );
    // A step whose flows outgrow the memory allowed for them is refused with its size,
    // as bad input, not simulated until the memory runs out.
    let (code, _, stderr) = with_release("max_traffic_gib = 0.000001");
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("outgrew"), "{stderr}");
    assert!(
        stderr.contains("job.max_traffic_gib, now 0.000001"),
        "{stderr}"
    );
}

#[test]
fn netsim_says_which_collectives_the_packet_events_belonged_to() {
    let dir = temp_dir("netsim-owners");
    let scenario = dir.join("ring.toml");
    std::fs::write(
        &scenario,
        "[topology]\nkind = \"single_switch\"\nendpoints = 4\nlink_gbps = 100\n\
         [[collectives]]\nkind = \"all_reduce\"\nalgorithm = \"ring\"\nchannels = 1\n\
         ranks = { first = 0, count = 4 }\nbytes = 1048576\n",
    )
    .unwrap();
    let run = |args: &[&str]| {
        let mut all = vec!["netsim", scenario.to_str().unwrap(), "--json"];
        all.extend_from_slice(args);
        let (code, stdout, stderr) = orrery(&all);
        assert_eq!(code, 0, "{stderr}");
        serde_json::from_str::<serde_json::Value>(&stdout).unwrap()
    };
    // The reference simulates every flow, and the ring's 24 flows own their events.
    let v = run(&["--model", "packet", "--reference"]);
    let ring = &v["collectives"][0];
    assert_eq!(ring["flows"], 24);
    assert_eq!(ring["simulated_flows"], 24);
    let o = &v["event_owners"];
    assert_eq!(o["collectives"], ring["events"]);
    assert_eq!(o["point_to_point"], 0);
    let n = |x: &serde_json::Value| x.as_u64().unwrap();
    // The rest holds at least the 24 releases and the ports' events, as many as arrivals.
    assert!(n(&o["collectives"]) > 0 && n(&o["other"]) > 24, "{o}");
    // The flow model has no events of that kind and says nothing of them.
    let v = run(&["--model", "flow"]);
    assert!(v.get("event_owners").is_none(), "{v}");
    assert!(v["collectives"][0].get("simulated_flows").is_none());
    let (code, text, stderr) = orrery(&[
        "netsim",
        scenario.to_str().unwrap(),
        "--model",
        "packet",
        "--reference",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(text.contains("Where the events went"), "{text}");
    assert!(text.contains("24 of     24 flows simulated"), "{text}");
    // The full report describes every flow: endpoints, size, collective, dependencies,
    // times and its own events, which add up to the collective's.
    let full = dir.join("full.json");
    let v = run(&[
        "--model",
        "packet",
        "--reference",
        "--out",
        full.to_str().unwrap(),
    ]);
    let f: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&full).unwrap()).unwrap();
    let flows = f["flows"].as_array().unwrap();
    assert_eq!(flows.len(), 24);
    assert_eq!(f["events"], v["events"]);
    let events: u64 = flows.iter().map(|x| n(&x["events"])).sum();
    assert_eq!(events, n(&v["collectives"][0]["events"]));
    // The ring's first step: rank i sends a quarter of the buffer to rank i + 1, depending
    // on nothing; every later flow waits for another.
    for x in flows {
        assert_eq!(x["collective"], v["collectives"][0]["name"], "{x}");
        assert!(n(&x["finish"]) > n(&x["start"]), "{x}");
        assert_eq!(n(&x["bytes"]), 1048576 / 4, "{x}");
        assert_eq!((n(&x["src"]) + 1) % 4, n(&x["dst"]), "{x}");
    }
    assert!(flows[..4]
        .iter()
        .all(|x| x["deps"] == serde_json::json!([])));
    assert!(flows[4..]
        .iter()
        .all(|x| !x["deps"].as_array().unwrap().is_empty()));
}

#[test]
fn netsim_acceleration_skips_events_without_changing_the_answer() {
    let dir = temp_dir("fastforward");
    let scenario = dir.join("long.toml");
    // Two long flows on disjoint paths, then the same pair again after both finished: the
    // first round fast-forwards, the second is found in the memo cache.
    std::fs::write(
        &scenario,
        "[topology]\nkind = \"single_switch\"\nendpoints = 4\nlink_gbps = 100\n[packet]\ndcqcn = false\n\
         [[flows]]\nsrc = 0\ndst = 1\nbytes = 16777216\n[[flows]]\nsrc = 2\ndst = 3\nbytes = 16777216\n\
         [[flows]]\nsrc = 0\ndst = 1\nbytes = 16777216\nstart_us = 2000\n\
         [[flows]]\nsrc = 2\ndst = 3\nbytes = 16777216\nstart_us = 2000\n",
    )
    .unwrap();
    // Without symmetry: a strided shift maps the pair 0 -> 1 onto 2 -> 3, which would leave
    // one episode per round to fast-forward and look up.
    let run = |extra: &[&str]| {
        let mut args = vec![
            "netsim",
            scenario.to_str().unwrap(),
            "--json",
            "--no-symmetry",
        ];
        args.extend_from_slice(extra);
        let (code, stdout, stderr) = orrery(&args);
        assert_eq!(code, 0, "{stderr}");
        (
            serde_json::from_str::<serde_json::Value>(&stdout).unwrap(),
            stderr,
        )
    };
    let (full, _) = run(&["--reference"]);
    let (fast, _) = run(&[]);
    let (e_full, e_fast) = (full["end"].as_f64().unwrap(), fast["end"].as_f64().unwrap());
    assert!(
        (e_fast - e_full).abs() / e_full < 0.01,
        "{e_fast} vs {e_full}"
    );
    assert!(fast["events"].as_u64().unwrap() < full["events"].as_u64().unwrap() / 2);
    // Who the events belonged to: here only point-to-point flows and ports, adding up to
    // every event; fast-forwarding and the memo leave the flows fewer of their own.
    let owners = |v: &serde_json::Value| {
        let o = &v["event_owners"];
        let n = |k: &str| o[k].as_u64().unwrap();
        assert_eq!(n("collectives"), 0, "{o}");
        assert_eq!(
            n("point_to_point") + n("other"),
            v["events"].as_u64().unwrap()
        );
        n("point_to_point")
    };
    assert!(owners(&fast) < owners(&full) / 2);
    let stats = &fast["packet_stats"];
    assert!(stats["fast_forwards"].as_u64().unwrap() > 0);
    assert_eq!(stats["memo_hits"].as_u64().unwrap(), 2, "{stats}");
    assert_eq!(full["packet_stats"]["memo_lookups"].as_u64().unwrap(), 0);
    let (no_memo, _) = run(&["--no-memo"]);
    assert_eq!(no_memo["packet_stats"]["memo_lookups"].as_u64().unwrap(), 0);
    // A cache file carries the episodes to the next run, which then finds all of them.
    let cache = dir.join("memo.bin");
    let (first, _) = run(&["--memo-cache", cache.to_str().unwrap()]);
    assert_eq!(first["packet_stats"]["memo_hits"].as_u64().unwrap(), 2);
    let (second, _) = run(&["--memo-cache", cache.to_str().unwrap()]);
    assert_eq!(second["packet_stats"]["memo_hits"].as_u64().unwrap(), 4);
    // A corrupt cache is reported and ignored, never trusted.
    let mut bytes = std::fs::read(&cache).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&cache, &bytes).unwrap();
    let (third, stderr) = run(&["--memo-cache", cache.to_str().unwrap()]);
    assert!(stderr.contains("ignoring memo cache"), "{stderr}");
    assert!(stderr.contains("checksum"), "{stderr}");
    assert_eq!(third["packet_stats"]["memo_hits"].as_u64().unwrap(), 2);
}

#[test]
fn predict_and_emulate_run_on_the_flow_level_and_fluid_networks() {
    let dir = temp_dir("network");
    let job = dir.join("job.toml");
    std::fs::write(&job, SMALL_JOB).unwrap();
    for network in ["flow", "fluid"] {
        let (code, stdout, stderr) = orrery(&[
            "predict",
            job.to_str().unwrap(),
            "--network",
            network,
            "--json",
        ]);
        assert_eq!(code, 0, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(v["network_model"], network);
        assert!(v["step_time"].as_u64().unwrap() > 0);
        assert!(
            v["warnings"].as_array().unwrap().is_empty(),
            "{}",
            v["warnings"]
        );
    }
    // Emulation replays its virtual ranks on the fluid network too.
    let (code, stdout, stderr) = orrery(&[
        "emulate",
        job.to_str().unwrap(),
        "--real-ranks",
        "0",
        "--network",
        "fluid",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert!(v["step_time"].as_u64().unwrap() > 0);
}

/// `predict --network packet` runs the accelerated packet model and takes the same
/// switches as `netsim`; `--reference` turns every mechanism off, and the step barely moves.
/// The switches are refused, by name and with status 2, where no packet model runs.
#[test]
fn predict_on_the_packet_network_takes_the_acceleration_switches() {
    let dir = temp_dir("packet-switches");
    let job = dir.join("job.toml");
    std::fs::write(&job, SMALL_JOB).unwrap();
    let job = job.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["predict", job, "--network", "packet", "--json"];
        args.extend_from_slice(extra);
        let (code, stdout, stderr) = orrery(&args);
        assert_eq!(code, 0, "{stderr}");
        serde_json::from_str::<serde_json::Value>(&stdout).unwrap()
    };
    let fast = run(&[]);
    let full = run(&["--reference"]);
    let sim = |v: &serde_json::Value, k: &str| v["network_simulation"][k].as_u64().unwrap();
    let accel =
        |v: &serde_json::Value, k: &str| v["network_simulation"]["accel"][k].as_u64().unwrap();
    assert!(
        accel(&fast, "skipped_events") > 0,
        "{}",
        fast["network_simulation"]
    );
    assert_eq!(accel(&full, "skipped_events"), 0);
    assert_eq!(accel(&full, "memo_lookups"), 0);
    assert!(sim(&full, "events") > sim(&fast, "events"));
    let step = |v: &serde_json::Value| v["step_time"].as_f64().unwrap();
    assert!(
        (step(&fast) - step(&full)).abs() / step(&full) < 0.01,
        "{} vs {}",
        step(&fast),
        step(&full)
    );
    let no_memo = run(&["--no-memo"]);
    assert_eq!(accel(&no_memo, "memo_lookups"), 0);
    for (command, flag) in [("predict", "--no-memo"), ("emulate", "--no-symmetry")] {
        let mut args = vec![command, job, flag];
        if command == "emulate" {
            args.extend(["--real-ranks", "0"]);
        }
        let (code, _, stderr) = orrery(&args);
        assert_eq!(code, 2, "{command} {flag}: {stderr}");
        assert!(
            stderr.contains(flag) && stderr.contains("--network packet"),
            "{stderr}"
        );
    }
    // A refused switch does not hide the job's problems, nor they the other flags': all
    // at once.
    let missing = dir.join("missing.json");
    let missing = missing.to_str().unwrap();
    let (code, _, stderr) = orrery(&[
        "predict",
        job,
        "--no-memo",
        "--set",
        "parallel.tp=0",
        "--hf-config",
        missing,
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert_mentions(&stderr, &["--no-memo", "parallel.tp", "missing.json"]);
    let (code, _, stderr) = orrery(&[
        "emulate",
        "--preset",
        "nope",
        "--no-memo",
        "--real-ranks",
        "x",
        "--slow",
        "5",
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert_mentions(&stderr, &["--no-memo", "nope", "--real-ranks", "--slow"]);
}

/// `--memo-cache` carries the packet model's memo from one `predict` (or `emulate`) to
/// the next, as it does for `netsim`: the second prediction of the same step finds every
/// episode in the file and gives the same step. A corrupt file is reported and ignored,
/// and without the packet model the flag is refused.
#[test]
fn predict_keeps_the_packet_memo_cache_between_runs() {
    let dir = temp_dir("predict-memo-cache");
    let job = dir.join("job.toml");
    std::fs::write(&job, SMALL_JOB).unwrap();
    let job = job.to_str().unwrap();
    let cache = dir.join("memo.bin");
    let cache = cache.to_str().unwrap();
    let run_with = |command: &str, cache: &str| {
        let mut args = vec![command, job, "--network", "packet", "--json"];
        args.extend(["--memo-cache", cache]);
        if command == "emulate" {
            args.extend(["--real-ranks", "0"]);
        }
        let (code, stdout, stderr) = orrery(&args);
        assert_eq!(code, 0, "{stderr}");
        let v = serde_json::from_str::<serde_json::Value>(&stdout).unwrap();
        (v, stderr)
    };
    let run = |command: &str| run_with(command, cache);
    let accel =
        |v: &serde_json::Value, k: &str| v["network_simulation"]["accel"][k].as_u64().unwrap();
    let events = |v: &serde_json::Value| v["network_simulation"]["events"].as_u64().unwrap();
    let step = |v: &serde_json::Value| v["step_time"].as_f64().unwrap();
    let (cold, _) = run("predict");
    assert!(std::path::Path::new(cache).exists());
    let (warm, _) = run("predict");
    assert!(accel(&cold, "memo_lookups") > 0);
    assert!(
        accel(&warm, "memo_hits") > accel(&cold, "memo_hits"),
        "{} against {}",
        warm["network_simulation"],
        cold["network_simulation"]
    );
    assert!(events(&warm) < events(&cold));
    assert!(
        (step(&warm) - step(&cold)).abs() / step(&cold) < 0.01,
        "{} vs {}",
        step(&warm),
        step(&cold)
    );
    // The emulator writes its own file and reads it back, to the same step.
    let emulate_cache = dir.join("emulate.bin");
    let emulate_cache = emulate_cache.to_str().unwrap();
    let (cold_emulation, _) = run_with("emulate", emulate_cache);
    assert!(std::path::Path::new(emulate_cache).exists());
    let (warm_emulation, stderr) = run_with("emulate", emulate_cache);
    assert!(!stderr.contains("ignoring memo cache"), "{stderr}");
    assert!(
        (step(&warm_emulation) - step(&cold_emulation)).abs() / step(&cold_emulation) < 0.01,
        "{} vs {}",
        step(&warm_emulation),
        step(&cold_emulation)
    );
    // A corrupt cache is reported and ignored: the run is a cold one.
    let mut bytes = std::fs::read(cache).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(cache, &bytes).unwrap();
    let (again, stderr) = run("predict");
    assert!(stderr.contains("ignoring memo cache"), "{stderr}");
    assert_eq!(accel(&again, "memo_hits"), accel(&cold, "memo_hits"));
    assert_eq!(events(&again), events(&cold));
    // Without the packet model there is no cache to keep.
    let (code, _, stderr) = orrery(&["predict", job, "--memo-cache", cache]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--memo-cache") && stderr.contains("--network packet"),
        "{stderr}"
    );
}

#[test]
fn a_closed_pipe_ends_quietly() {
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_orrery"))
        .arg("presets")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes away before the program writes (like `orrery presets | head -0`).
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
}

#[test]
fn validate_prints_errors_and_mape() {
    let (code, stdout, stderr) = orrery(&["validate"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("step-time MAPE"), "{stdout}");
    assert!(stdout.contains("model-state memory: max error"), "{stdout}");
}

const TINY_TRAIN: &str = r#"
steps = 6
batch_size = 4
warmup_steps = 1
eval_every = 3
eval_batches = 1
checkpoint_every = 3
[model]
context = 16
d_model = 16
n_layers = 1
n_heads = 2
n_kv_heads = 1
d_ff = 32
"#;

#[test]
fn train_writes_metrics_and_checkpoints_resumes_and_rejects_bad_options() {
    let dir = temp_dir("train");
    let config = dir.join("tiny.toml");
    std::fs::write(&config, TINY_TRAIN).unwrap();
    let out = dir.join("run");
    let (code, stdout, stderr) = orrery(&[
        "train",
        config.to_str().unwrap(),
        "--json",
        "--out",
        out.to_str().unwrap(),
        "--steps",
        "3",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let steps: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(steps.len(), 3);
    assert!(steps[2]["val_loss"].as_f64().is_some(), "{stdout}");
    for f in ["metrics.jsonl", "loss.svg", "checkpoint.ckpt"] {
        assert!(out.join(f).exists(), "{f}");
    }
    // Resuming continues from step 4 to the configured 6.
    let (code, stdout, stderr) = orrery(&[
        "train",
        config.to_str().unwrap(),
        "--json",
        "--out",
        out.to_str().unwrap(),
        "--resume",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let first: serde_json::Value = serde_json::from_str(stdout.lines().next().unwrap()).unwrap();
    assert_eq!(first["step"].as_u64(), Some(4), "{stdout}");
    // The flags override the file before it is validated: a file that asks for no steps
    // trains the steps --steps gives.
    let zero = dir.join("zero.toml");
    std::fs::write(&zero, TINY_TRAIN.replace("steps = 6", "steps = 0")).unwrap();
    let (code, stdout, stderr) = orrery(&[
        "train",
        zero.to_str().unwrap(),
        "--json",
        "--steps",
        "1",
        "--out",
        dir.join("zero").to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    // A damaged checkpoint to resume from is bad input: status 2, naming it.
    let damaged = dir.join("damaged.ckpt");
    std::fs::write(&damaged, b"not a checkpoint").unwrap();
    let (code, _, stderr) = orrery(&[
        "train",
        config.to_str().unwrap(),
        "--resume",
        damaged.to_str().unwrap(),
        "--out",
        dir.join("from-damaged").to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert_mentions(&stderr, &["cannot resume from", "damaged.ckpt"]);
    // Bad input: exit status 2 naming the problem.
    let (code, _, stderr) = orrery(&["train", config.to_str().unwrap(), "--async"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("soap and shampoo"), "{stderr}");
    std::fs::write(&config, "[model]\nn_heads = 3\nd_model = 16\n").unwrap();
    let (code, _, stderr) = orrery(&["train", config.to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(stderr.contains("model."), "{stderr}");
    let (code, _, stderr) = orrery(&["train", "--device-budget", "lots"]);
    assert_eq!(code, 2, "{stderr}");
    // The configuration's problems and every flag's at once, none of them trained on.
    let (code, _, stderr) = orrery(&[
        "train",
        config.to_str().unwrap(),
        "--optimizer",
        "adamw",
        "--async",
        "--workers",
        "0",
        "--ranks",
        "0",
        "--basis-threshold=-1",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert_mentions(
        &stderr,
        &[
            "model.",
            "soap and shampoo, not adamw",
            "--ranks must be at least 1",
            "--workers must be at least 1",
            "--basis-threshold",
        ],
    );
}

#[test]
fn netsim_runs_the_ring_across_pods_example_periodic_after_its_first_steps() {
    // The example's claim: with the period allowed 5%, the ring goes periodic once, early,
    // and most of its 2,016 simulated flows (the pod swap halves 4,032) are virtual; with
    // 1% only 896 were.
    let scenario = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/scenarios/ring-across-pods.toml"
    );
    let (code, stdout, stderr) = orrery(&["netsim", scenario, "--json"]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let stat = |k: &str| v["packet_stats"][k].as_u64().unwrap();
    assert_eq!(stat("periodic_starts"), 1);
    assert_eq!(stat("periodic_aborts"), 0);
    assert_eq!(stat("symmetry_order"), 2);
    assert!(stat("periodic_flows") > 1500, "{}", stat("periodic_flows"));
}

/// The README's training-step scenario.
const GPT_STEP_128: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../examples/scenarios/gpt-step-128.toml"
);

/// `orrery netsim SCENARIO --json` with `extra` flags, which must succeed, as JSON.
fn netsim_json_of(scenario: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["netsim", scenario, "--json"];
    args.extend_from_slice(extra);
    let (code, stdout, stderr) = orrery(&args);
    assert_eq!(code, 0, "{stderr}");
    serde_json::from_str(&stdout).unwrap()
}

#[test]
fn netsim_exempts_the_gradient_norm_from_the_symmetry_check_unless_told_not_to() {
    // The README's training-step scenario: the GPU shift of the tensor ranks holds exactly;
    // the shift of a pipeline stage's hosts, and then the strided shift of the
    // data-parallel ranks inside a host, hold once the norm's one-packet flows are left
    // out of the check.
    let scenario = GPT_STEP_128;
    let loose = netsim_json_of(scenario, &[]);
    let strict = netsim_json_of(scenario, &["--strict-symmetry"]);
    let stat = |v: &serde_json::Value, k: &str| v["packet_stats"][k].as_u64().unwrap();
    assert_eq!(stat(&loose, "symmetry_order"), 32);
    assert!(stat(&loose, "symmetry_exempt_flows") > 0);
    assert!(stat(&loose, "symmetry_late_flows") > 0);
    assert_eq!(stat(&strict, "symmetry_order"), 2);
    assert_eq!(stat(&strict, "symmetry_exempt_flows"), 0);
    // The rotations, outermost first: the tensor pairs, a stage's hosts, then every other
    // GPU of a host.
    let shifts = |v: &serde_json::Value| {
        v["symmetry"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["across_hosts"].as_bool().unwrap(),
                    s["block"].as_u64().unwrap(),
                    s["stride"].as_u64().unwrap(),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(shifts(&loose), [(false, 2, 1), (true, 4, 1), (false, 8, 2)]);
    assert_eq!(shifts(&strict), [(false, 2, 1)]);
    assert!(loose["events"].as_u64().unwrap() < strict["events"].as_u64().unwrap());
    assert_eq!(loose["bytes_delivered"], strict["bytes_delivered"]);
    let end = |v: &serde_json::Value| v["end"].as_f64().unwrap();
    assert!((end(&loose) - end(&strict)).abs() < 0.001 * end(&strict));
    let (code, text, stderr) = orrery(&["netsim", scenario]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        text.contains("one-packet flows exempt from the check"),
        "{text}"
    );
    assert!(
        text.contains("symmetry: hosts 1 place on in blocks of 4 (x4)"),
        "{text}"
    );
}

#[test]
fn netsim_fluid_steps_one_copy_of_the_training_step() {
    // The fluid model finds the packet model's rotations on the README's training step and
    // steps one copy per orbit; with `--fluid-no-symmetry` it steps them all, to nearly the
    // same flows (the gradient norm's one-packet flows are stepped apart from their copies'
    // frames, and the flows after it are timed through their own dependencies).
    let scenario = GPT_STEP_128;
    let reduced = netsim_json_of(scenario, &["--model", "fluid"]);
    let full = netsim_json_of(scenario, &["--model", "fluid", "--fluid-no-symmetry"]);
    assert_eq!(reduced["symmetry"].as_array().map(Vec::len), Some(3));
    let stepped = reduced["fluid_simulated_flows"].as_u64().unwrap();
    let flows = reduced["fct"]["count"].as_u64().unwrap();
    // 1,828 of 51,296 when written: the exempt flows are each stepped on their own.
    assert!(16 * stepped < flows, "{stepped} of {flows}");
    assert!(full.get("symmetry").is_none() && full.get("fluid_simulated_flows").is_none());
    assert_eq!(reduced["bytes_delivered"], full["bytes_delivered"]);
    let end = |v: &serde_json::Value| v["end"].as_f64().unwrap();
    assert!((end(&reduced) - end(&full)).abs() < 0.001 * end(&full));
    let (code, text, stderr) = orrery(&["netsim", scenario, "--model", "fluid"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(text.contains("flows stepped, each for 32 copies"), "{text}");
}
