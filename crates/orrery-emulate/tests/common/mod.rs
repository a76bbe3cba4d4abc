//! What the driven tests share: the clock their real ranks time segments on, and the H100
//! cluster models their virtual ranks are replayed on.

use orrery_net::{AlgorithmChoice, AnalyticalNetwork};
use orrery_predict::CostModel;
use orrery_train::{Clock, MonotonicClock};
use std::sync::Arc;

pub fn clock() -> Arc<dyn Clock> {
    Arc::new(MonotonicClock::new())
}

/// The cost model and network of the H100 cluster of a built-in job.
pub fn models() -> (CostModel, AnalyticalNetwork) {
    let text = orrery_spec::preset_job_text("llama3-70b-h100x1024").unwrap();
    let job = orrery_spec::Job::from_spec(&orrery_spec::load_job_spec(text, &[]).unwrap()).unwrap();
    (
        CostModel::for_gpu(&job.cluster().gpu),
        AnalyticalNetwork::new(orrery_predict::fabric_for(&job), AlgorithmChoice::Auto),
    )
}
