//! Hugging Face `config.json` import must never panic, and what it imports must validate
//! (or be rejected) without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use orrery_spec::hf::model_from_hf_config;
use orrery_spec::raw::{ClusterSpec, TrainingSpec};
use orrery_spec::{Job, JobSpec};

fuzz_target!(|text: &str| {
    if let Ok(model) = model_from_hf_config(text) {
        let spec = JobSpec {
            model,
            training: TrainingSpec {
                global_batch: Some(8),
                ..TrainingSpec::default()
            },
            cluster: ClusterSpec {
                nodes: Some(1),
                ..ClusterSpec::default()
            },
            ..JobSpec::default()
        };
        if let Ok(job) = Job::from_spec(&spec) {
            let _ = job.model().total_params();
        }
    }
});
