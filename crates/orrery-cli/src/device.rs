//! Where the real training program computes: a check made once, before any rank starts.
//!
//! A build without the feature `cuda` refuses `device = "cuda"` when it validates the
//! configuration (`orrery_train::CUDA_UNAVAILABLE`). A build with it loads the CUDA driver
//! only when the first rank touches the GPU, on a thread of cubecl's own; on a machine
//! without a driver or a device that thread panics, and then so does the rank that waited
//! for it. Every rank would report a panic and a backtrace, not what was wrong. So commands
//! that run the program on the GPU start it here first, and a failure becomes an error that
//! names `device` and exits with status 2.

use anyhow::Result;
use orrery_train::DeviceKind;

/// Starts the GPU when `device` is `cuda` (see the module docs); if it cannot be started, an
/// error naming `input`, where the user asked for the GPU (`device = "cuda"`, a flag).
/// Nothing to do on the CPU, or in a build without the feature, whose configuration check
/// already refused `cuda`.
pub fn check_device(device: DeviceKind, input: &str) -> Result<()> {
    #[cfg(feature = "cuda")]
    if device == DeviceKind::Cuda {
        if let Err(why) = quietly(orrery_train::start_cuda) {
            // cudarc's message goes on with every library name it tried; its first clause
            // says what failed.
            let why = why.split(" - ").next().unwrap_or_default();
            return Err(crate::bad(format!(
                "{input}: the GPU could not be started: {why} (is there an NVIDIA GPU on this \
                 machine, with its driver's libcuda.so where the loader or LD_LIBRARY_PATH \
                 finds it?)"
            )));
        }
    }
    let _ = (device, input);
    Ok(())
}

/// The longest part of a panic's message kept in an error (cudarc's list of the library
/// names it tried runs to some thousand characters).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const MESSAGE_CHARS: usize = 300;

/// Runs `f`; a panic, in `f` or first on a thread `f` waits for, becomes the first panic's
/// message (its first line, at most [`MESSAGE_CHARS`] characters), printed nowhere.
///
/// The panic hook is the process's: while `f` runs, a panic on any other thread is also
/// kept quiet (and its message may be the one returned). Callers run this before they start
/// threads of their own.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn quietly<T>(f: impl FnOnce() -> T + std::panic::UnwindSafe) -> Result<T, String> {
    use std::sync::{Arc, Mutex, PoisonError};
    let first: Arc<Mutex<Option<String>>> = Arc::default();
    let seen = first.clone();
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        let line = message.lines().next().unwrap_or_default();
        let mut slot = seen.lock().unwrap_or_else(PoisonError::into_inner);
        slot.get_or_insert_with(|| line.chars().take(MESSAGE_CHARS).collect());
    }));
    let result = std::panic::catch_unwind(f);
    std::panic::set_hook(previous);
    result.map_err(|_| {
        first
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_needs_no_check() {
        assert!(check_device(DeviceKind::Cpu, "device = \"cpu\"").is_ok());
    }

    #[test]
    fn a_panic_on_a_waited_for_thread_becomes_its_first_message() {
        // As cubecl does without a driver: its thread panics, and the caller then panics on
        // the channel the dead thread left.
        let got = quietly(|| {
            let (tx, rx) = std::sync::mpsc::channel::<u32>();
            let worker = std::thread::spawn(move || {
                let _tx = tx;
                panic!("Unable to load the driver\nsecond line");
            });
            let _ = worker.join();
            rx.recv().expect("the worker sends nothing")
        });
        assert_eq!(got, Err("Unable to load the driver".to_string()));
        // A long message is cut.
        let got = quietly(|| -> u32 { panic!("{}", "x".repeat(1000)) });
        assert_eq!(got.map_err(|m| m.len()), Err(MESSAGE_CHARS));
        // What does not panic passes through, and the previous hook is back.
        assert_eq!(quietly(|| 7), Ok(7));
    }
}
