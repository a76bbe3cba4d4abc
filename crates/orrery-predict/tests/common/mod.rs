//! Small jobs for the integration tests.
#![allow(dead_code)]

use orrery_spec::{load_job_spec, Job};

/// A small dense GPT job with the given overrides applied on top.
pub fn small_job(overrides: &[&str]) -> Job {
    let base = r#"
        [model]
        name = "tiny"
        layers = 4
        hidden = 256
        heads = 8
        ffn = 1024
        vocab = 1000
        seq_len = 128
        activation = "gelu"
        [training]
        global_batch = 16
        micro_batch = 1
        [parallel]
        tp = 2
        pp = 2
        [cluster]
        gpu = "A100-80GB"
        gpus_per_node = 4
        nodes = 2
    "#;
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    let spec = load_job_spec(base, &overrides).expect("test job parses");
    Job::from_spec(&spec).unwrap_or_else(|e| panic!("test job invalid: {e}"))
}
