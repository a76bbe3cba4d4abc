//! Job TOML (and `--set` overrides) through loading and validation must never panic.
//!
//! The input is split at the first NUL byte: the part before it is the job text, each line
//! after it one `key=value` override.
#![no_main]

use libfuzzer_sys::fuzz_target;
use orrery_spec::{load_job_spec, Job};

fuzz_target!(|text: &str| {
    let (job_text, overrides) = match text.split_once('\0') {
        Some((job, rest)) => (job, rest.lines().map(str::to_string).collect::<Vec<_>>()),
        None => (text, Vec::new()),
    };
    if let Ok(spec) = load_job_spec(job_text, &overrides) {
        if let Ok(job) = Job::from_spec(&spec) {
            // What a validated job promises every later layer.
            let p = job.parallel();
            let c = job.cluster();
            assert_eq!(p.world_size(), c.world_size());
            let t = job.training();
            assert_eq!(t.global_batch % (t.micro_batch * p.dp), 0);
            let _ = job.microbatches();
            let _ = job.tokens_per_step();
            let _ = job.model().total_params();
        }
    }
});
