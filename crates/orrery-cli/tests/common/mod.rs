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
