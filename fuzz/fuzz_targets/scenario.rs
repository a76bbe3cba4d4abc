//! `orrery netsim` scenario parsing must never panic: any text is a scenario or a list of
//! problems with their paths.
#![no_main]

use libfuzzer_sys::fuzz_target;
use orrery_net::scenario::load_scenario;

fuzz_target!(|text: &str| {
    match load_scenario(text) {
        Ok(s) => {
            // A loaded scenario's flows are well formed.
            assert!(s.flows.check().is_ok());
        }
        Err(e) => assert!(!e.0.is_empty()),
    }
});
