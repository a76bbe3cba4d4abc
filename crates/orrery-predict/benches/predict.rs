//! Prediction speed: the 8,192-GPU Llama-3-405B-shaped job (target: well under 1 s on one
//! core), the default job, and the graph builder alone.
//!
//! Run with `cargo bench -p orrery-predict`.

use orrery_spec::{load_job_spec, preset_job_text, Job};

fn main() {
    divan::main();
}

fn job(name: &str) -> Job {
    let text = preset_job_text(name).expect("preset exists");
    Job::from_spec(&load_job_spec(text, &[]).expect("preset parses")).expect("preset valid")
}

#[divan::bench(sample_count = 10)]
fn predict_llama3_405b_8192_gpus(b: divan::Bencher) {
    let j = job("llama3-405b-h100x8192");
    b.bench(|| orrery_predict::predict(divan::black_box(&j)).map(|o| o.prediction.step_time));
}

#[divan::bench(sample_count = 10)]
fn predict_llama3_70b_1024_gpus(b: divan::Bencher) {
    let j = job("llama3-70b-h100x1024");
    b.bench(|| orrery_predict::predict(divan::black_box(&j)).map(|o| o.prediction.step_time));
}

#[divan::bench(sample_count = 10)]
fn build_graphs_llama3_405b_8192_gpus(b: divan::Bencher) {
    let j = job("llama3-405b-h100x8192");
    b.bench(|| orrery_graph::build(divan::black_box(&j)).total_ops());
}
