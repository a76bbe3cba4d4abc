//! `orrery emulate`: the golden report, JSON, the trace's real and virtual tracks, and bad
//! input.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{assert_mentions, orrery, temp_dir};
use expect_test::expect;

const JOB: &str = r#"
name = "small emulated job"
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
zero_stage = 1
[parallel]
tp = 2
pp = 2
[cluster]
gpu = "H100-SXM"
gpus_per_node = 8
nodes = 2
"#;

fn job_file(name: &str) -> std::path::PathBuf {
    let job = temp_dir(&format!("emulate-{name}")).join("job.toml");
    std::fs::write(&job, JOB).unwrap();
    job
}

#[test]
fn golden_report_with_a_straggler() {
    let job = job_file("golden");
    let (code, stdout, stderr) = orrery(&[
        "emulate",
        job.to_str().unwrap(),
        "--real-ranks",
        "0,9",
        "--slow",
        "9:1.5",
    ]);
    assert_eq!(code, 0, "{stderr}");
    expect![[r#"
        orrery emulate: small emulated job, 16 GPUs, real ranks 0, 9
          the real ranks' compute is the cost model's (with --train the training program runs them)
          8 participants for 16 ranks (one per class of ranks with identical timelines; real and perturbed ranks on their own)
          perturbation: ranks 9 compute 1.5x slower from 0.000 ms

        step time: emulated 28.627 ms, predicted 20.706 ms (+38.26%)

            rank  stage     kind       step end        compute  peak memory
               0      0     real      28.627 ms      10.913 ms     0.70 GiB
               1      0  virtual      28.627 ms      10.913 ms     0.70 GiB
               8      1  virtual      27.522 ms      15.977 ms     0.67 GiB
               9      1     real      27.597 ms      23.966 ms     0.67 GiB
              2*      0  virtual      28.627 ms              -     0.70 GiB   (and 2 more like it)
              3*      0  virtual      28.627 ms              -     0.70 GiB   (and 2 more like it)
             10*      1  virtual      27.522 ms              -     0.67 GiB   (and 2 more like it)
             11*      1  virtual      27.597 ms              -     0.67 GiB   (and 2 more like it)
    "#]]
    .assert_eq(&stdout);
}

#[test]
fn unperturbed_emulation_matches_the_prediction_and_writes_tracks() {
    let job = job_file("json");
    let trace = job.with_file_name("trace.json");
    let (code, stdout, stderr) = orrery(&[
        "emulate",
        job.to_str().unwrap(),
        "--real-ranks",
        "3",
        "--json",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let rep: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(rep["step_time"], rep["predicted_step_time"]);
    assert_eq!(rep["pruned"], true);
    let real: Vec<&serde_json::Value> = rep["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["real"] == true)
        .collect();
    assert_eq!(real.len(), 1);
    assert_eq!(real[0]["rank"], 3);
    assert_eq!(real[0]["compute"], real[0]["modelled_compute"]);
    // Every rank is accounted for once.
    let shared: u64 = rep["shared"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["ranks"].as_u64().unwrap())
        .sum();
    assert_eq!(shared + rep["ranks"].as_array().unwrap().len() as u64, 16);
    let text = std::fs::read_to_string(&trace).unwrap();
    let t: serde_json::Value = serde_json::from_str(&text).unwrap();
    let names: Vec<String> = t["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names.len(), rep["participants"].as_u64().unwrap() as usize);
    assert!(
        names.contains(&"real rank 3 (stage 0)".to_string()),
        "{names:?}"
    );
    assert!(
        names.iter().any(|n| n.contains("virtual ranks like rank")),
        "{names:?}"
    );
}

#[test]
fn bad_perturbations_exit_2_naming_the_flag() {
    let job = job_file("bad");
    let path = job.to_str().unwrap();
    for (args, needle) in [
        (vec!["--real-ranks", "0", "--slow", "2"], "--slow"),
        (vec!["--real-ranks", "x"], "--real-ranks"),
        (
            vec!["--real-ranks", "0", "--degrade-link", "1:y"],
            "--degrade-link",
        ),
        (
            vec!["--real-ranks", "0,16"],
            "real ranks: rank 16 is outside a world of 16",
        ),
        (vec!["--real-ranks", "0", "--slow", "1:-2"], "slow.factor"),
    ] {
        let mut all = vec!["emulate", path];
        all.extend(args);
        let (code, _, stderr) = orrery(&all);
        assert_eq!(code, 2, "{all:?}: {stderr}");
        assert!(stderr.contains(needle), "{needle} not in {stderr}");
    }
}

#[test]
fn the_emulation_bench_replays_as_many_participants_at_any_world_size() {
    let (code, stdout, stderr) = orrery(&[
        "bench",
        "--emulate",
        "--runs",
        "1",
        "--emulate-gpus",
        "64,128",
    ]);
    assert_eq!(code, 0, "{stderr}");
    // GPUs, participants, events per row: the same participants and events at both sizes.
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.first().is_some_and(|g| *g == "64" || *g == "128"))
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert_eq!(rows[0][1..3], rows[1][1..3], "{stdout}");
    assert!(
        stdout.contains("unpruned, 64 GPUs (once): 64 participants"),
        "{stdout}"
    );
    let (code, _, stderr) = orrery(&["bench", "--emulate", "--emulate-gpus", "33"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--emulate-gpus"), "{stderr}");
}

const TRAIN: &str = r#"
batch_size = 8
steps = 4
warmup_steps = 1
[model]
context = 16
d_model = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
d_ff = 64
[parallel]
tp = 2
pp = 2
dp = 2
micro_batches = 4
"#;

#[test]
fn collect_then_emulate_the_real_program() {
    let job = job_file("train");
    let config = job.with_file_name("train.toml");
    std::fs::write(&config, TRAIN).unwrap();
    let coll = job.with_file_name("collection.bin");
    let (c, p) = (config.to_str().unwrap(), coll.to_str().unwrap());
    let prefix = job.with_file_name("collected");
    let (code, stdout, stderr) = orrery(&[
        "collect",
        c,
        "--ranks",
        "8",
        "--slots",
        "2",
        "--out",
        p,
        "--chakra",
        prefix.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("collected 2 ranks of 8"), "{stdout}");
    // The Chakra export replays: `orrery replay` reads the eight ranks back.
    let (code, stdout, stderr) = orrery(&["replay", prefix.to_str().unwrap(), "--measured"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("8 ranks"), "{stdout}");
    let trace = job.with_file_name("train-trace.json");
    let (code, stdout, stderr) = orrery(&[
        "emulate",
        "--train",
        c,
        "--ranks",
        "8",
        "--graph",
        p,
        "--real-ranks",
        "5",
        "--json",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let names: Vec<String> = t["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["args"]["name"].as_str().unwrap().to_string())
        .collect();
    assert!(
        names.contains(&"real rank 5 (stage 1)".to_string()),
        "{names:?}"
    );
    assert!(
        names.iter().any(|n| n.contains("virtual ranks like rank")),
        "{names:?}"
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["world_size"], 8);
    assert_eq!(v["real_ranks"][0]["rank"], 5);
    assert!(v["step_time_ps"].as_u64().unwrap() > 0);
    assert!(v["collected_step_time_ps"].as_u64().unwrap() > 0);
    assert!(v["real_ranks"][0]["peak_memory_bytes"].as_u64().unwrap() > 0);
    // A collection among virtual peers measured no communication to calibrate on.
    let (code, _, stderr) = orrery(&[
        "emulate",
        "--train",
        c,
        "--ranks",
        "8",
        "--graph",
        p,
        "--real-ranks",
        "5",
        "--calibrate",
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--calibrate"), "{stderr}");
    // A collection of another world and a damaged file are refused.
    let (code, _, stderr) = orrery(&[
        "emulate",
        "--train",
        c,
        "--ranks",
        "4",
        "--graph",
        p,
        "--real-ranks",
        "1",
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("the collection is of a world of 8"),
        "{stderr}"
    );
    let mut bytes = std::fs::read(&coll).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    let damaged = job.with_file_name("damaged.bin");
    std::fs::write(&damaged, &bytes).unwrap();
    let (code, _, stderr) = orrery(&[
        "emulate",
        "--train",
        c,
        "--ranks",
        "8",
        "--graph",
        damaged.to_str().unwrap(),
        "--real-ranks",
        "1",
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("checksum mismatch"), "{stderr}");
    // A configuration of the same size but another layout is refused.
    let other = job.with_file_name("other.toml");
    std::fs::write(
        &other,
        TRAIN
            .replace("pp = 2", "pp = 1")
            .replace("dp = 2", "dp = 4")
            .replace("micro_batches = 4", "micro_batches = 1"),
    )
    .unwrap();
    let (code, _, stderr) = orrery(&[
        "emulate",
        "--train",
        other.to_str().unwrap(),
        "--ranks",
        "8",
        "--graph",
        p,
        "--real-ranks",
        "1",
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--graph: the collection is of tp 2 x dp 2 x pp 2"),
        "{stderr}"
    );
    let interleaved = job.with_file_name("interleaved.toml");
    std::fs::write(
        &interleaved,
        TRAIN
            .replace("micro_batches = 4", "micro_batches = 4\nvirtual_stages = 2")
            .replace("n_layers = 2", "n_layers = 4"),
    )
    .unwrap();
    // Interleaved 1F1B collects and emulates too: its tagged messages meet by tag.
    let interleaved_coll = job.with_file_name("interleaved.bin");
    let (code, stdout, stderr) = orrery(&[
        "collect",
        interleaved.to_str().unwrap(),
        "--ranks",
        "8",
        "--out",
        interleaved_coll.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("collected 2 ranks of 8"), "{stdout}");
    let (code, stdout, stderr) = orrery(&[
        "emulate",
        "--train",
        interleaved.to_str().unwrap(),
        "--ranks",
        "8",
        "--graph",
        interleaved_coll.to_str().unwrap(),
        "--real-ranks",
        "6",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["real_ranks"][0]["rank"], 6);
    assert!(v["step_time_ps"].as_u64().unwrap() > 0);
}

#[test]
fn collecting_over_mpi_outside_an_mpi_job_exits_2() {
    // Without the `mpi` feature `--comm mpi` is refused; with it, a process that no launcher
    // started cannot join a job. Either way: status 2, naming the flag, and no file.
    let job = job_file("collect-mpi");
    let config = job.with_file_name("train.toml");
    std::fs::write(&config, TRAIN).unwrap();
    let out = job.with_file_name("never.bin");
    let (code, _, stderr) = orrery(&[
        "collect",
        config.to_str().unwrap(),
        "--ranks",
        "8",
        "--comm",
        "mpi",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--comm mpi"), "{stderr}");
    assert!(!out.exists());
}

#[test]
fn collection_flags_and_input_errors_exit_2() {
    let job = job_file("collect-flags");
    let config = job.with_file_name("train.toml");
    std::fs::write(&config, TRAIN).unwrap();
    let out = job.with_file_name("never.bin");
    let (c, o) = (config.to_str().unwrap(), out.to_str().unwrap());
    let pure_dp = job.with_file_name("dp.toml");
    // No [parallel] section: pure data parallelism over --ranks, which must divide the batch.
    std::fs::write(&pure_dp, TRAIN.split("[parallel]").next().unwrap()).unwrap();
    for (args, expected) in [
        (
            vec![
                "collect", c, "--ranks", "8", "--comm", "mpi", "--slots", "2",
            ],
            "--slots applies to --comm threads",
        ),
        (
            vec!["collect", c, "--ranks", "8", "--timeout", "0"],
            "--timeout must be between 1 and",
        ),
        (
            vec![
                "collect",
                c,
                "--ranks",
                "8",
                "--timeout",
                "18446744073709551615",
            ],
            "--timeout must be between 1 and",
        ),
        (
            vec!["collect", c, "--ranks", "8", "--slots", "0"],
            "--slots must be at least 1",
        ),
        (
            vec!["collect", pure_dp.to_str().unwrap(), "--ranks", "3"],
            "batch_size 8 is not divisible",
        ),
    ] {
        let mut args = args;
        args.extend(["--out", o]);
        let (code, _, stderr) = orrery(&args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!out.exists());
    }
    // A wrong configuration and wrong flags are reported at once, for collection and for
    // emulation of the training program alike.
    let broken = job.with_file_name("broken.toml");
    std::fs::write(&broken, "[model]\nn_layers = 0\n").unwrap();
    let b = broken.to_str().unwrap();
    let (code, _, stderr) = orrery(&[
        "collect",
        b,
        "--ranks",
        "8",
        "--slots",
        "0",
        "--timeout",
        "0",
        "--out",
        o,
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert_mentions(
        &stderr,
        &["model.n_layers", "--slots must be", "--timeout must be"],
    );
    // The packet model's switches are refused with --train, whose virtual ranks do not
    // replay on it.
    let (code, _, stderr) = orrery(&[
        "emulate",
        "--train",
        c,
        "--ranks",
        "8",
        "--real-ranks",
        "0",
        "--no-memo",
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert_mentions(
        &stderr,
        &["--no-memo applies to the packet model", "--train"],
    );
    let (code, _, stderr) = orrery(&[
        "emulate",
        "--train",
        b,
        "--real-ranks",
        "0,x",
        "--timeout",
        "0",
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert_mentions(
        &stderr,
        &[
            "model.n_layers",
            "--train needs --ranks",
            "--timeout must be",
            "--real-ranks",
        ],
    );
    assert!(!out.exists());
}
