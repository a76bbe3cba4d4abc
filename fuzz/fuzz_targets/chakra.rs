//! Chakra trace import must never panic on any bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(rank) = orrery_graph::chakra::import_rank(bytes) {
        assert!(rank.graph.check().is_ok());
    }
});
