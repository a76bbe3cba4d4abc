//! Helpers shared by the `orrery` binary's test files.
#![allow(dead_code, clippy::expect_used)]

use std::process::Command;

/// Runs the `orrery` binary with `args`: exit status (-1 if killed), stdout, stderr.
pub fn orrery(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_orrery"))
        .args(args)
        .output()
        .expect("runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A fresh, empty folder for one test (`name` keeps tests apart, the process id runs apart).
pub fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("orrery-cli-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("creates a temporary folder");
    d
}

/// Asserts that `text` (a command's error output) mentions every one of `needles`: the
/// tests of bad input check that every problem is reported at once.
#[track_caller]
pub fn assert_mentions(text: &str, needles: &[&str]) {
    for needle in needles {
        assert!(text.contains(needle), "{needle:?} not in: {text}");
    }
}

#[path = "../../../orrery-train/tests/common/mpi_session.rs"]
pub mod mpi_session;
