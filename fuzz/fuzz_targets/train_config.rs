//! `orrery train` configuration parsing must never panic: any text is a configuration, a
//! list of problems with their paths, or the TOML parser's message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use orrery_train::config::{ConfigLoadError, TrainConfig};

fuzz_target!(|text: &str| {
    match TrainConfig::from_toml_str(text) {
        Ok(config) => assert!(config.validate().is_ok()),
        Err(ConfigLoadError::Invalid(e)) => assert!(!e.problems.is_empty()),
        Err(ConfigLoadError::Parse(_)) => {}
    }
});
