//! A training checkpoint (`orrery train --checkpoint-dir`, `--resume`) must be read or
//! refused without panicking on any bytes, both as a whole file and as the payload of a
//! file whose header and checksum are valid (the layout in `orrery_train::checkpoint`'s
//! docs, which is `orrery_units::frame`'s), so the fuzzer reaches the payload's parser;
//! what is read encodes to a file that reads back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use orrery_train::checkpoint::Checkpoint;

fuzz_target!(|bytes: &[u8]| {
    let _ = Checkpoint::decode(bytes);
    let file = orrery_units::frame::frame(b"ORRYCKPT", 1, bytes);
    if let Ok(c) = Checkpoint::decode(&file) {
        // Compared as files: parameter values are bit patterns, and NaN is not equal to
        // itself as a float.
        let image = c.encode().unwrap();
        let again = Checkpoint::decode(&image).unwrap();
        assert_eq!(again.encode().unwrap(), image);
    }
});
