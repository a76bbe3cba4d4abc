//! A session folder per `mpirun`, for the MPI tests of this crate and of `orrery-cli`
//! (which includes this file by path: the two crates' tests share no module otherwise).

/// A fresh folder with a short path for one `mpirun` to keep its session files in (pass it
/// as `TMPDIR`). Open MPI's launcher creates `$TMPDIR/ompi.<host>.<uid>` with a check
/// then a `mkdir`, so two launched at once (tests run in parallel) can race on the shared
/// folder, and the loser fails ("A call to mkdir was unable to create the desired
/// directory ... File exists"). Short, because Open MPI puts Unix sockets under it.
pub fn mpi_session_dir() -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("om{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("creates a session folder for mpirun");
    d
}
