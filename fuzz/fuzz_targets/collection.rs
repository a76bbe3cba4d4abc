//! A collection file (`orrery collect`) must be rejected or read without panicking on any
//! bytes; what is read must stitch or fail cleanly.
#![no_main]

use libfuzzer_sys::fuzz_target;
use orrery_emulate::file::CollectionFile;
use orrery_graph::collect::stitch;
use orrery_graph::Layout;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(f) = CollectionFile::from_bytes(bytes) {
        // Keep worlds small: the layout's tables grow with the world.
        if f.tp.max(1) * f.dp.max(1) * f.pp.max(1) <= 64 && f.ep >= 1 && f.dp % f.ep == 0 {
            let layout = Layout::from_dims(f.tp, 1, f.dp, f.pp, f.ep, 8);
            let _ = stitch(layout, &f.records);
        }
    }
});
