//! Recorded ranks (hybrid emulation's graph collection) must parse and stitch without
//! panicking on any bytes, and what stitches must be well-formed graphs.
#![no_main]

use libfuzzer_sys::fuzz_target;
use orrery_graph::collect::{stitch, RankRecord};
use orrery_graph::Layout;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(records) = serde_json::from_slice::<Vec<RankRecord>>(bytes) {
        // TP 2 x DP 2 x PP 2: every role and both pipeline directions exist.
        if let Ok(c) = stitch(Layout::from_dims(2, 1, 2, 2, 1, 4), &records) {
            for g in &c.graphs.classes {
                assert!(g.check().is_ok());
            }
            assert_eq!(c.measured.len(), c.graphs.classes.len());
        }
    }
});
