//! A memo cache file (`orrery netsim --memo-cache`) must be read or refused without
//! panicking on any bytes, both as a whole file and as the body of a file whose header and
//! checksum are valid (so the fuzzer reaches the body's parser); what is read writes back
//! to the same cache.
#![no_main]

use libfuzzer_sys::fuzz_target;
use orrery_net::packet::MemoCache;

fuzz_target!(|bytes: &[u8]| {
    let _ = MemoCache::from_bytes(bytes);
    // The magic and version of this build's files, from an empty cache's image (the frame
    // layout is `orrery_units::frame`'s).
    let empty = MemoCache::new().to_bytes();
    let magic: [u8; 8] = empty[..8].try_into().unwrap();
    let version = u32::from_le_bytes(empty[8..12].try_into().unwrap());
    let file = orrery_units::frame::frame(&magic, version, bytes);
    if let Ok(cache) = MemoCache::from_bytes(&file) {
        assert_eq!(MemoCache::from_bytes(&cache.to_bytes()).unwrap(), cache);
    }
});
