//! `orrery collect --comm mpi`: the whole world collected from a real run, one process per
//! rank, as the reference an emulation with one real rank is compared with.
//!
//! Needs an MPI library and its launcher (`mpirun`, or the one named by `ORRERY_MPIRUN`), so
//! it is compiled only with the `mpi` feature:
//! `cargo test -p orrery-cli --features mpi --test collect_mpi`. Open MPI's settings travel
//! as environment variables, as in orrery-train's MPI test.
#![cfg(feature = "mpi")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{orrery, temp_dir};
use orrery_emulate::drive::{communication, peak_and_compute};
use orrery_emulate::file::CollectionFile;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A healthy launch takes seconds; one still running by then has hung.
const TIMEOUT: Duration = Duration::from_secs(300);

/// The tiny model of `orrery-emulate`'s drive tests, on TP 2 x PP 2.
const TRAIN: &str = r#"
batch_size = 8
steps = 4
warmup_steps = 1
lr = 0.01
eval_every = 0
eval_batches = 1
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
dp = 1
micro_batches = 4
"#;

/// Runs `mpirun -n ranks orrery args...`: exit status and stdout (stderr goes to a log in
/// `dir`, shown on failure).
/// `orrery collect CONFIG --ranks RANKS --comm mpi --out OUT`, then `extra`.
fn mpi_collect(config: &Path, ranks: &str, out: &Path, extra: &[&str]) -> Vec<String> {
    let head = [
        "collect",
        config.to_str().unwrap(),
        "--ranks",
        ranks,
        "--comm",
        "mpi",
        "--out",
        out.to_str().unwrap(),
    ];
    head.iter().chain(extra).map(|a| a.to_string()).collect()
}

/// The arguments as `&str`s, as [`mpirun`] takes them.
fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

fn mpirun(ranks: usize, args: &[&str], dir: &Path) -> (i32, String) {
    mpirun_apps(&[(ranks, args)], dir)
}

/// Runs one MPI job of several programs (`mpirun -n a orrery A : -n b orrery B`), each
/// `(ranks, args)`, as [`mpirun`] does.
fn mpirun_apps(apps: &[(usize, &[&str])], dir: &Path) -> (i32, String) {
    let launcher = std::env::var("ORRERY_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    let log = dir.join("mpirun.log");
    let out = dir.join("mpirun.out");
    let session = common::mpi_session::mpi_session_dir();
    let mut command = Command::new(&launcher);
    for (i, (ranks, args)) in apps.iter().enumerate() {
        if i > 0 {
            command.arg(":");
        }
        command
            .args(["-n", &ranks.to_string()])
            .arg(env!("CARGO_BIN_EXE_orrery"))
            .args(*args);
    }
    let mut child = command
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // More ranks than this machine's cores.
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        // Loopback TCP: works in any container (shared memory often does not).
        .env("OMPI_MCA_btl", "self,tcp")
        .env("OMPI_MCA_btl_tcp_if_include", "lo")
        .env("OMPI_MCA_oob_tcp_if_include", "lo")
        // Its own session folder: parallel launches race on a shared one.
        .env("TMPDIR", &session)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {launcher}: {e}"));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "mpirun hung; its log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = std::fs::remove_dir_all(&session);
    let code = status.code().unwrap_or(-1);
    if code != 0 {
        eprintln!("{}", std::fs::read_to_string(&log).unwrap_or_default());
    }
    (code, std::fs::read_to_string(&out).unwrap_or_default())
}

/// `config` reading its corpus from a file that does not exist: every rank fails to load it.
fn without_corpus(config: &str) -> String {
    config.replace(
        "[model]",
        "[data]\npath = \"/nonexistent/orrery-corpus\"\n[model]",
    )
}

fn peak(file: &CollectionFile, rank: u32) -> u64 {
    let record = file.records.iter().find(|r| r.rank == rank).unwrap();
    peak_and_compute(record).0
}

#[test]
fn a_real_world_collected_over_mpi_is_the_reference_of_an_emulation() {
    let dir = temp_dir("collect-mpi");
    let config = dir.join("train.toml");
    std::fs::write(&config, TRAIN).unwrap();
    let c = config.to_str().unwrap();
    let reference = dir.join("reference.collection");
    let args = mpi_collect(&config, "4", &reference, &["--json"]);
    let (code, stdout) = mpirun(4, &strs(&args), &dir);
    assert_eq!(code, 0, "{stdout}");
    // Rank 0 alone reports (one JSON document): what each rank of the real run measured,
    // as its record in the file says.
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["world_size"], 4);
    assert_eq!(v["ranks_collected"], 4);
    let reference = CollectionFile::from_bytes(&std::fs::read(&reference).unwrap()).unwrap();
    assert_eq!(reference.records.len(), 4);
    let measured = v["real_run"].as_array().unwrap();
    assert_eq!(measured.len(), 4);
    for (rank, m) in measured.iter().enumerate() {
        assert_eq!(m["rank"], rank);
        let (peak, compute) = peak_and_compute(&reference.records[rank]);
        assert_eq!(m["peak_memory_bytes"], peak);
        assert_eq!(m["compute_ps"], compute.0);
        // The step holds its compute and its communication.
        assert!(m["step_ps"].as_u64().unwrap() >= compute.0);
    }

    // The representatives collected among virtual peers issue every real rank's
    // collectives and transfers, in the same order, with the same sizes.
    let among_virtual = dir.join("virtual.collection");
    let (code, _, stderr) = orrery(&[
        "collect",
        c,
        "--ranks",
        "4",
        "--out",
        among_virtual.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    let among_virtual =
        CollectionFile::from_bytes(&std::fs::read(&among_virtual).unwrap()).unwrap();
    for record in &among_virtual.records {
        let real = &reference.records[record.rank as usize];
        assert_eq!(
            communication(record),
            communication(real),
            "rank {}",
            record.rank
        );
    }

    // One real rank among virtual ones, replayed from the real run's collection, peaks where
    // the same rank peaked in the real run. Each measurement has a process to itself (the
    // emulation's real rank is its only thread using burn). On this 650 KB model the peaks
    // of two real runs of the same rank differ by up to about 0.8% (with the address-space
    // layout: fixed by `setarch -R`, they repeat); the bound leaves room for that.
    for rank in ["0", "3"] {
        let (code, stdout, stderr) = orrery(&[
            "emulate",
            "--train",
            c,
            "--ranks",
            "4",
            "--graph",
            dir.join("reference.collection").to_str().unwrap(),
            "--real-ranks",
            rank,
            "--json",
        ]);
        assert_eq!(code, 0, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        let emulated = v["real_ranks"][0]["peak_memory_bytes"].as_u64().unwrap();
        let real = peak(&reference, rank.parse().unwrap());
        let error = (emulated as f64 - real as f64) / real as f64;
        eprintln!(
            "rank {rank}: peak {emulated} B emulated, {real} B in the real run ({:+.3}%)",
            100.0 * error
        );
        assert!(error.abs() < 0.02, "rank {rank}: {:+.3}%", 100.0 * error);
    }
    // The real run timed its collectives and its pipeline's transfers: an emulation can
    // take those times for its virtual ranks' (--calibrate) instead of the cluster model's.
    let (code, stdout, stderr) = orrery(&[
        "emulate",
        "--train",
        c,
        "--ranks",
        "4",
        "--graph",
        dir.join("reference.collection").to_str().unwrap(),
        "--real-ranks",
        "0",
        "--calibrate",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let network = v["network"].as_str().unwrap();
    assert!(network.starts_with("collectives ("), "{network}");
    assert!(network.contains("point-to-point transfers ("), "{network}");
    assert!(!network.contains("(0 sizes)"), "{network}");
}

#[test]
fn mpi_collection_refuses_a_world_of_another_size() {
    let dir = temp_dir("collect-mpi-size");
    let config = dir.join("train.toml");
    std::fs::write(&config, TRAIN).unwrap();
    let out = dir.join("never.collection");
    let (code, _) = mpirun(2, &strs(&mpi_collect(&config, "4", &out, &[])), &dir);
    assert_eq!(code, 2);
    let log = std::fs::read_to_string(dir.join("mpirun.log")).unwrap();
    assert!(log.contains("the MPI job has 2 processes"), "{log}");
    assert!(!out.exists());
}

#[test]
fn one_failing_rank_ends_the_job_its_peers_wait_in() {
    // Rank 1 cannot read its corpus while rank 0 trains and then waits for rank 1 in a
    // collective: the job ends (MPI_Abort) with rank 1's error and status 2, instead of
    // hanging. Two ranks of pure data parallelism, one program each.
    let dir = temp_dir("collect-mpi-one-fails");
    let dp = TRAIN.split("[parallel]").next().unwrap();
    let good = dir.join("good.toml");
    std::fs::write(&good, dp).unwrap();
    let broken = dir.join("broken.toml");
    std::fs::write(&broken, without_corpus(dp)).unwrap();
    let out = dir.join("never.collection");
    let (a, b) = (
        mpi_collect(&good, "2", &out, &[]),
        mpi_collect(&broken, "2", &out, &[]),
    );
    let (code, _) = mpirun_apps(&[(1, &strs(&a)), (1, &strs(&b))], &dir);
    assert_eq!(code, 2);
    let log = std::fs::read_to_string(dir.join("mpirun.log")).unwrap();
    assert!(log.contains("orrery-corpus"), "{log}");
    assert!(!out.exists());
}

#[test]
fn a_rank_that_fails_ends_the_whole_job_with_its_error() {
    // Every rank fails to read its corpus: an input error, so status 2.
    let dir = temp_dir("collect-mpi-fail");
    let config = dir.join("train.toml");
    std::fs::write(&config, without_corpus(TRAIN)).unwrap();
    let out = dir.join("never.collection");
    let (code, _) = mpirun(4, &strs(&mpi_collect(&config, "4", &out, &[])), &dir);
    assert_eq!(code, 2);
    let log = std::fs::read_to_string(dir.join("mpirun.log")).unwrap();
    assert!(log.contains("error: collection failed"), "{log}");
    assert!(log.contains("orrery-corpus"), "{log}");
    assert!(!out.exists());
}
