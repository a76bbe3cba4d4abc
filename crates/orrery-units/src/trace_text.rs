//! The text of the trace-event files orrery writes by hand (the predictor's step trace, the
//! network simulators' flow trace): times as microseconds printed exactly from integer
//! picoseconds, and JSON string literals. Both writers build their lines in a `String`
//! rather than through a JSON tree, so that a trace of millions of events streams out in
//! bounded memory and comes out byte-identical from identical runs.

use crate::Picos;
use std::fmt::Write as _;

/// Appends `t` as microseconds with exactly six decimals (exact: 1 us = 10^6 ps).
pub fn push_micros(buf: &mut String, t: Picos) {
    let _ = write!(buf, "{}.{:06}", t.0 / 1_000_000, t.0 % 1_000_000);
}

/// Appends `s` as a JSON string literal.
pub fn push_json_str(buf: &mut String, s: &str) {
    buf.push('"');
    for c in s.chars() {
        match c {
            '"' => buf.push_str("\\\""),
            '\\' => buf.push_str("\\\\"),
            '\n' => buf.push_str("\\n"),
            '\r' => buf.push_str("\\r"),
            '\t' => buf.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(buf, "\\u{:04x}", u32::from(c));
            }
            c => buf.push(c),
        }
    }
    buf.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_exact_and_strings_escaped() {
        let mut s = String::new();
        push_micros(&mut s, Picos(1_234_567_890));
        s.push(' ');
        push_micros(&mut s, Picos(5));
        s.push(' ');
        push_json_str(&mut s, "a \"b\" \\ c\n\t\r\u{1} · é");
        assert_eq!(s, r#"1234.567890 0.000005 "a \"b\" \\ c\n\t\r\u0001 · é""#);
    }
}
