//! `orrery bench --train` on a tiny model: the report's structure and fields, in JSON and as a
//! table, and its refusal of bad input; `orrery bench --accel`'s JSON report on a small ring.
//! Timings are printed by the benchmarks, never asserted.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{orrery, temp_dir};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// `orrery bench --train` on the fixture with `steps`, evaluating every 2 steps, and `extra`.
fn bench(config: &Path, corpus: &Path, steps: &str, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec![
        "bench",
        "--train",
        "--config",
        config.to_str().unwrap(),
        "--data",
        corpus.to_str().unwrap(),
        "--steps",
        steps,
        "--eval-every",
        "2",
    ];
    args.extend_from_slice(extra);
    orrery(&args)
}

/// A folder with a tiny configuration and a small corpus of its own, so the test neither
/// depends on the Shakespeare download nor pays for tokenizing it.
fn fixture(name: &str) -> (PathBuf, PathBuf) {
    let dir = temp_dir(&format!("bench-train-{name}"));
    let config = dir.join("tiny.toml");
    std::fs::write(
        &config,
        "batch_size = 4\nwarmup_steps = 1\neval_batches = 1\n[model]\ncontext = 16\n\
         d_model = 16\nn_layers = 1\nn_heads = 2\nn_kv_heads = 1\nd_ff = 32\n",
    )
    .unwrap();
    let corpus = dir.join("corpus.txt");
    let line = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.\n";
    std::fs::write(&corpus, line.repeat(60)).unwrap();
    (config, corpus)
}

#[test]
fn json_report_has_every_optimizer_seed_and_the_tiered_run() {
    let (config, corpus) = fixture("json");
    let (code, stdout, stderr) = bench(&config, &corpus, "6", &["--seeds", "0,1", "--json"]);
    assert_eq!(code, 0, "{stderr}");
    let r: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(r["corpus"]["source"], corpus.to_str().unwrap());
    assert!(r["corpus"]["train_tokens"].as_u64().unwrap() > 0);
    assert!(r["params"].as_u64().unwrap() > 0);
    assert_eq!(r["steps"], 6);
    assert_eq!(r["eval_every"], 2);
    assert_eq!(r["seeds"], serde_json::json!([0, 1]));
    let names: Vec<&str> = r["optimizers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["adamw", "soap", "soap-async", "shampoo"]);
    for o in r["optimizers"].as_array().unwrap() {
        // Without --lr every optimizer trains at the configuration's default rate.
        assert_eq!(o["lr"], 3e-3, "{}", o["name"]);
        let m = &o["medians"];
        for field in [
            "final_val_loss",
            "step_ms_median",
            "step_ms_p99",
            "step_ms_max",
            "spikes",
            "step_time_ratio",
            "optimizer_ms_median",
            "optimizer_wait_s",
            "state_device_bytes",
        ] {
            assert!(m[field].is_number(), "{} medians.{field}: {m}", o["name"]);
        }
        for field in ["steps_to_target", "steps_ratio", "seconds_to_target"] {
            assert!(m.get(field).is_some(), "{} medians.{field}", o["name"]);
        }
        let seeds = o["seeds"].as_array().unwrap();
        assert_eq!(seeds.len(), 2);
        for (s, want) in seeds.iter().zip([0, 1]) {
            assert_eq!(s["seed"], want);
            // Evaluations at steps 2, 4 and 6.
            let steps: Vec<u64> = s["val_curve"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| p[0].as_u64().unwrap())
                .collect();
            assert_eq!(steps, [2, 4, 6]);
            assert!(s["target_val_loss"].is_number());
            assert!(s["state_bytes"]["device"].as_u64().unwrap() > 0, "{s}");
            if o["name"] == "adamw" {
                // AdamW is the reference: it reaches its own final loss, at ratio 1.
                assert_eq!(s["target_val_loss"], s["final_val_loss"]);
                assert_eq!(s["steps_ratio"], 1.0);
                assert_eq!(s["step_time_ratio"], 1.0);
            }
        }
    }
    // SOAP with a device budget below its state still trains, spills, and gives the resident
    // run's bits.
    let t = &r["tiering"];
    assert_eq!(t["steps"], 6);
    assert!(t["final_val_loss"].is_number());
    assert!(t["state_bytes"]["device"].as_u64() <= t["device_budget"].as_u64());
    assert!(t["device_budget"].as_u64() < t["untiered_device_bytes"].as_u64());
    assert!(t["state_bytes"]["disk"].as_u64().unwrap() > 0, "{t}");
    assert_eq!(t["matches_resident"], true);
    let _ = std::fs::remove_dir_all(config.parent().unwrap());
}

#[test]
fn table_names_the_corpus_and_every_row() {
    let (config, corpus) = fixture("table");
    let (code, stdout, stderr) = bench(
        &config,
        &corpus,
        "4",
        &["--seeds", "3", "--optimizers", "adamw,soap-async"],
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains(&format!("corpus: {}", corpus.display())),
        "{stdout}"
    );
    for needle in [
        "optimizer",
        "\nadamw ",
        "\nsoap-async ",
        "tiered SOAP (seed 3, lr 3e-3)",
    ] {
        assert!(stdout.contains(needle), "{needle}: {stdout}");
    }
    assert!(!stdout.contains("\nshampoo "), "{stdout}");
    let _ = std::fs::remove_dir_all(config.parent().unwrap());
}

/// Each optimizer of a JSON report: its name, `lr` and first seed's final validation loss.
fn lrs_and_losses(report: &Value) -> Vec<(String, f64, f64)> {
    report["optimizers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| {
            (
                o["name"].as_str().unwrap().to_string(),
                o["lr"].as_f64().unwrap(),
                o["seeds"][0]["final_val_loss"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// The JSON report of AdamW, SOAP and Shampoo trained 4 steps on seed 0, with `extra`
/// options; the run must succeed.
fn three_optimizers_json(config: &Path, corpus: &Path, extra: &[&str]) -> Value {
    let mut args = vec![
        "--seeds",
        "0",
        "--optimizers",
        "adamw,soap,shampoo",
        "--json",
    ];
    args.extend_from_slice(extra);
    let (code, stdout, stderr) = bench(config, corpus, "4", &args);
    assert_eq!(code, 0, "{stderr}");
    serde_json::from_str::<Value>(&stdout).unwrap()
}

#[test]
fn per_optimizer_learning_rates_train_and_are_reported() {
    let (config, corpus) = fixture("lr");
    let run = |extra: &[&str]| three_optimizers_json(&config, &corpus, extra);
    let base = run(&[]);
    let tuned = run(&["--lr", "soap=2e-2", "--lr", "adamw=1e-2"]);
    let base_rows = lrs_and_losses(&base);
    let tuned_rows = lrs_and_losses(&tuned);
    let lrs: Vec<(&str, f64)> = tuned_rows
        .iter()
        .map(|(n, lr, _)| (n.as_str(), *lr))
        .collect();
    assert_eq!(lrs, [("adamw", 1e-2), ("soap", 2e-2), ("shampoo", 3e-3)]);
    // The rate is what trained, not only what is printed: the retuned optimizers end
    // elsewhere, while Shampoo, untouched, repeats its bits (training is deterministic).
    for ((name, _, before), (_, _, after)) in base_rows.iter().zip(&tuned_rows) {
        if name == "shampoo" {
            assert_eq!(before, after, "{name}");
        } else {
            assert_ne!(before, after, "{name}");
        }
    }
    // The tiered SOAP run trains at SOAP's rate: otherwise it could not match the resident
    // run.
    assert_eq!(tuned["tiering"]["lr"], 2e-2);
    assert_eq!(tuned["tiering"]["matches_resident"], true);
    let _ = std::fs::remove_dir_all(config.parent().unwrap());
}

#[test]
fn table_shows_each_optimizers_learning_rate() {
    let (config, corpus) = fixture("lr-table");
    let (code, stdout, stderr) = bench(
        &config,
        &corpus,
        "2",
        &[
            "--seeds",
            "0",
            "--optimizers",
            "adamw,soap-async",
            "--lr",
            "soap=2e-2",
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    let row = |name: &str| {
        stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no {name} row: {stdout}"))
            .split_whitespace()
            .nth(1)
            .unwrap()
            .to_string()
    };
    assert_eq!(row("adamw"), "3e-3", "{stdout}");
    // soap-async takes soap's rate when it has none of its own.
    assert_eq!(row("soap-async"), "0.02", "{stdout}");
    assert!(stdout.contains("tiered SOAP (seed 0, lr 0.02)"), "{stdout}");
    let _ = std::fs::remove_dir_all(config.parent().unwrap());
}

#[test]
fn soap_hyper_parameters_train_and_are_reported() {
    let (config, corpus) = fixture("soap-hyper");
    let run = |extra: &[&str]| three_optimizers_json(&config, &corpus, extra);
    let base = run(&["--no-tiering"]);
    // Defaults: the published frequency, the configuration's betas and weight decay, and the
    // statistics decaying at beta2.
    let h = &base["soap"];
    assert_eq!(h["precondition_frequency"], 10);
    assert_eq!(h["beta1"].as_f64().unwrap() as f32, 0.9);
    assert_eq!(h["beta2"].as_f64().unwrap() as f32, 0.95);
    assert_eq!(h["shampoo_beta"].as_f64().unwrap() as f32, 0.95);
    assert_eq!(h["weight_decay"].as_f64().unwrap() as f32, 0.1);
    assert!(
        base["tiering"].is_null(),
        "--no-tiering skips the tiered run"
    );
    // A refresh every step (4 steps: refreshes the default frequency never reaches) and other
    // betas change what SOAP trains to, and nothing else.
    let tuned = run(&[
        "--soap",
        "frequency=1",
        "--soap",
        "beta1=0.95",
        "--soap",
        "shampoo_beta=0.9",
        "--soap",
        "weight_decay=0.01",
    ]);
    let h = &tuned["soap"];
    assert_eq!(h["precondition_frequency"], 1);
    assert_eq!(h["beta1"].as_f64().unwrap() as f32, 0.95);
    assert_eq!(h["beta2"].as_f64().unwrap() as f32, 0.95);
    assert_eq!(h["shampoo_beta"].as_f64().unwrap() as f32, 0.9);
    assert_eq!(h["weight_decay"].as_f64().unwrap() as f32, 0.01);
    for ((name, _, before), (_, _, after)) in
        lrs_and_losses(&base).iter().zip(&lrs_and_losses(&tuned))
    {
        if name == "soap" {
            assert_ne!(before, after, "{name}");
        } else {
            assert_eq!(before, after, "{name}");
        }
    }
    // The tiered run trains SOAP as configured: otherwise it could not match the resident run.
    assert_eq!(tuned["tiering"]["matches_resident"], true);
    let (code, stdout, stderr) = bench(
        &config,
        &corpus,
        "2",
        &[
            "--seeds",
            "0",
            "--optimizers",
            "adamw,soap-async",
            "--soap",
            "frequency=2",
            "--no-tiering",
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains(
            "soap, soap-async: precondition frequency 2, betas (0.9, 0.95), shampoo beta 0.95, weight decay 0.1"
        ),
        "{stdout}"
    );
    assert!(stdout.contains("tiered SOAP run skipped"), "{stdout}");
    let _ = std::fs::remove_dir_all(config.parent().unwrap());
}

#[test]
fn bad_options_exit_with_status_2() {
    for (args, needle) in [
        (&["bench", "--train", "--optimizers", "soap"][..], "adamw"),
        (&["bench", "--train", "--seeds", "1,1"][..], "twice"),
        (&["bench", "--train", "--eval-every", "0"][..], "eval-every"),
        (&["bench", "--train", "--steps", "0"][..], "steps"),
        (&["bench", "--train", "--optimizers", "lion"][..], "lion"),
        (&["bench", "--train", "--accel"][..], "--accel"),
        (&["bench", "--accel", "--release", "later"][..], "--release"),
        (&["bench", "--steps", "5"][..], "--train"),
        (&["bench", "--lr", "soap=1e-2"][..], "--train"),
        (&["bench", "--train", "--lr", "lion=1e-2"][..], "lion"),
        (&["bench", "--train", "--lr", "soap"][..], "--lr"),
        (&["bench", "--train", "--lr", "soap=0"][..], "--lr"),
        (&["bench", "--train", "--lr", "soap=-1e-2"][..], "--lr"),
        (&["bench", "--train", "--lr", "soap=inf"][..], "--lr"),
        (&["bench", "--train", "--lr", "soap=NaN"][..], "--lr"),
        (&["bench", "--train", "--lr", "soap=fast"][..], "--lr"),
        (
            &["bench", "--train", "--lr", "soap=1e-2", "--lr", "soap=2e-2"][..],
            "--lr",
        ),
        (
            &[
                "bench",
                "--train",
                "--optimizers",
                "adamw,soap",
                "--lr",
                "shampoo=1e-2",
            ][..],
            "--lr",
        ),
        (
            &["bench", "--train", "--data", "/nonexistent/corpus"][..],
            "/nonexistent/corpus",
        ),
        (&["bench", "--runs", "0"][..], "--runs"),
        (
            &["bench", "--emulate", "--emulate-gpus", "33,40"][..],
            "40 is not a multiple of 32",
        ),
        (
            &[
                "bench",
                "--accel",
                "--ring-mib",
                "0",
                "--gpt-gpus",
                "100",
                "--moe-gpus",
                "65",
            ][..],
            "65 is not a multiple of 64",
        ),
        (
            &["bench", "--accel", "--ring-mib", "0", "--gpt-gpus", "100"][..],
            "100 is not a multiple of 8",
        ),
        (&["bench", "--soap", "frequency=2"][..], "--train"),
        (&["bench", "--no-tiering"][..], "--train"),
        (&["bench", "--json"][..], "--json"),
        (&["bench", "--emulate", "--json"][..], "--json"),
        (
            &["bench", "--accel", "--emulate", "--json"][..],
            "--emulate",
        ),
        (
            &["bench", "--accel", "--emulate-fidelity"][..],
            "--emulate-fidelity",
        ),
        (&["bench", "--device", "cuda"][..], "--emulate-fidelity"),
        (
            &["bench", "--emulate-fidelity", "--device", "gpu"][..],
            "--device",
        ),
        (&["bench", "--train", "--soap", "frequency"][..], "--soap"),
        (&["bench", "--train", "--soap", "frequency=0"][..], "--soap"),
        (
            &["bench", "--train", "--soap", "frequency=2.5"][..],
            "--soap",
        ),
        (&["bench", "--train", "--soap", "beta1=1"][..], "--soap"),
        (&["bench", "--train", "--soap", "beta2=-0.1"][..], "--soap"),
        (
            &["bench", "--train", "--soap", "shampoo_beta=NaN"][..],
            "--soap",
        ),
        (
            &["bench", "--train", "--soap", "weight_decay=-1"][..],
            "--soap",
        ),
        (
            &["bench", "--train", "--soap", "momentum=0.9"][..],
            "momentum",
        ),
        (
            &[
                "bench",
                "--train",
                "--soap",
                "frequency=2",
                "--soap",
                "frequency=5",
            ][..],
            "--soap",
        ),
        (
            &[
                "bench",
                "--train",
                "--optimizers",
                "adamw,shampoo",
                "--soap",
                "frequency=2",
            ][..],
            "--soap",
        ),
    ] {
        let (code, _, stderr) = orrery(args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
    }
    // GPT 13B GPU counts that are not 32 times a divisor of 256, and Llama pipeline ones
    // that are not multiples of 128.
    for (flag, gpus) in [
        ("--gpt13b-gpus", "48"),
        ("--gpt13b-gpus", "96"),
        ("--llama-pp-gpus", "64"),
        ("--llama-pp-gpus", "200"),
    ] {
        let args = [
            "bench",
            "--accel",
            "--ring-mib",
            "0",
            "--gpt-gpus",
            "0",
            "--no-moe",
            flag,
            gpus,
        ];
        let (code, _, stderr) = orrery(&args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(
            stderr.contains(&format!("{flag}: {gpus}")),
            "{args:?}: {stderr}"
        );
    }
}

/// Ranks on a GPU in a build without the GPU backend are refused by their flag before any
/// rank starts, with the command that builds one.
#[cfg(not(feature = "cuda"))]
#[test]
fn fidelity_on_cuda_without_the_feature_is_refused_naming_the_flag() {
    let (code, stdout, stderr) = orrery(&["bench", "--emulate-fidelity", "--device", "cuda"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--device cuda") && stderr.contains("--features cuda"),
        "{stderr}"
    );
    // Refused before the table's header, so before any world ran.
    assert!(stdout.is_empty(), "{stdout}");
}

/// `bench --accel --seed-spread --label-spread --json` on the smallest scenario (a 1 MiB ring
/// all-reduce on 128 GPUs, reference included): one row whose figures agree with each other,
/// whose errors are within the bounds, with the reference's spread across seeds and
/// flow numberings.
#[test]
fn accel_json_report_has_the_row_and_its_errors() {
    let (code, stdout, stderr) = orrery(&[
        "bench",
        "--accel",
        "--ring-mib",
        "1",
        "--gpt-gpus",
        "0",
        "--no-moe",
        "--seed-spread",
        "--label-spread",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let rows: Value = serde_json::from_str(&stdout).expect("the report is JSON");
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{stdout}");
    let r = &rows[0];
    assert_eq!(r["scenario"], "ring all-reduce 1 MiB");
    assert!(r.get("release").is_none(), "not a job step: {r}");
    assert_eq!(r["gpus"], 128);
    assert_eq!(r["reference_events_estimated"], false);
    let (reference, events) = (
        r["reference_events"].as_f64().unwrap(),
        r["events"].as_f64().unwrap(),
    );
    assert!(events > 0.0 && reference > events, "{r}");
    let ratio = r["event_ratio"].as_f64().unwrap();
    assert!((ratio - reference / events).abs() < 1e-9 * ratio, "{r}");
    let wall = r["wall_speedup"].as_f64().unwrap();
    let secs = r["reference_secs"].as_f64().unwrap() / r["accelerated_secs"].as_f64().unwrap();
    assert!((wall - secs).abs() < 1e-9 * wall, "{r}");
    // A short accelerated run is repeated (each repeat must give the same report) and its
    // median taken.
    let runs = r["accelerated_runs"].as_u64().unwrap();
    assert!((1..=5).contains(&runs), "{r}");
    assert_eq!(r["drops"], 0, "{r}");
    assert_eq!(r["reference_drops"], 0, "{r}");
    let hits = r["memo_hits"].as_f64().unwrap();
    let lookups = r["memo_lookups"].as_f64().unwrap();
    assert!(hits <= lookups, "{r}");
    let jumps = r["fast_forwards"].as_u64().unwrap();
    assert!(r["quiet_jumps"].as_u64().unwrap() <= jumps, "{r}");
    // Each partitioned jump is counted, once for every flow of the partition that took it.
    assert!(r["ff_held"]["jumped"].as_u64().unwrap() >= jumps, "{r}");
    // And every sample of the quotient's partitions is counted under some reason.
    let held: u64 = (r["ff_held"].as_object().unwrap().values())
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert!(held > 0, "{r}");
    let e = &r["errors"];
    assert!(e["mean_fct"].as_f64().unwrap() < 0.01, "{r}");
    assert!(e["p99_fct"].as_f64().unwrap() < 0.05, "{r}");
    assert!(e["collective"].as_f64().unwrap() < 0.01, "{r}");
    assert!(e["collective_time"].as_f64().unwrap() < 0.01, "{r}");
    assert!(
        !stdout.contains("orrery bench --accel:"),
        "no table heading in JSON"
    );
    // The reference against itself with the next seed, and on its flows renumbered:
    // errors of the same kind.
    for spread in ["reference_seed_spread", "reference_label_spread"] {
        for key in [
            "mean_fct",
            "p99_fct",
            "end",
            "collective",
            "collective_time",
        ] {
            let x = r[spread][key].as_f64().unwrap_or(f64::NAN);
            assert!(x.is_finite() && x >= 0.0, "{spread} {key}: {r}");
        }
    }
    // The ring is alike on every host and GPU: one GPU's flows simulated, 128 copies.
    assert_eq!(r["symmetry_copies"], 128, "{r}");
}

/// `bench --accel --routing pinned` runs the same traffic on a fabric with pinned paths
/// (named in the row) within the bounds; an unknown policy is refused with status 2.
#[test]
fn accel_bench_runs_its_scenarios_on_pinned_paths() {
    let (code, stdout, stderr) = orrery(&[
        "bench",
        "--accel",
        "--ring-mib",
        "0",
        "--cross-pod-mib",
        "2",
        "--gpt-gpus",
        "0",
        "--no-moe",
        "--routing",
        "pinned",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let rows: Value = serde_json::from_str(&stdout).expect("the report is JSON");
    let r = &rows.as_array().unwrap()[0];
    assert_eq!(r["scenario"], "2 rings across 2 pods 2 MiB, pinned", "{r}");
    let e = &r["errors"];
    assert!(e["mean_fct"].as_f64().unwrap() < 0.01, "{r}");
    assert!(e["collective"].as_f64().unwrap() < 0.01, "{r}");
    assert!(e["collective_time"].as_f64().unwrap() < 0.01, "{r}");

    let (code, _, stderr) = orrery(&["bench", "--accel", "--routing", "spray"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--routing") && stderr.contains("spray"),
        "{stderr}"
    );
}
