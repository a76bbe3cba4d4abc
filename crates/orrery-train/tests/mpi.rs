//! The MPI backend with real processes: `mpirun -n 2` (or 3) starts this test binary once per
//! rank, each copy runs one rank (the `rank_process` test, which does nothing unless the launching test set
//! [`MODE_VAR`]), writes its results to a shared folder, and the launching test compares them.
//!
//! Needs an MPI library and its launcher (`mpirun`, or the one named by `ORRERY_MPIRUN`), so it
//! is compiled only with the `mpi` feature: `cargo test -p orrery-train --features mpi --test mpi`.
//! Open MPI's settings travel as environment variables rather than `mpirun` flags, so other
//! launchers ignore them instead of rejecting the command line.
#![cfg(feature = "mpi")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    assert_matches_single, bits, dp_config, mp_config, run_model_parallel_rank,
    run_model_parallel_threads, run_single, run_single_with, run_threads, run_threads_with,
    temp_dir,
};
use orrery_optim::{Optimizer, Soap, SoapConfig, SplitRefresh};
use orrery_train::comm_mpi::WAIT_VAR;
use orrery_train::{
    load_corpus, make_optimizer, train_with_comm, Checkpoint, Communicator, CpuBackend, FixedClock,
    MpiComm, OptimizerSummary, RunOptions, StepMetrics, TrainObserver, Trainer, CHECKPOINT_FILE,
    LOSS_PLOT_FILE, METRICS_FILE,
};
use serde::{Deserialize, Serialize};

/// Set by the launching test: what the rank processes do (`trainer` or `api`).
const MODE_VAR: &str = "ORRERY_MPI_TEST_MODE";
/// Set by the launching test: the folder the rank processes write into.
const DIR_VAR: &str = "ORRERY_MPI_TEST_DIR";
/// A launch that has not finished by then has hung (a healthy one takes seconds).
const TIMEOUT: Duration = Duration::from_secs(300);

/// What one rank reports back.
#[derive(Debug, Serialize, Deserialize)]
struct RankResult {
    rank: usize,
    world: usize,
    history: Vec<StepMetrics>,
    /// Final weights as bit patterns (exact through JSON).
    weights: Vec<u32>,
    /// Steps that reached this rank's observer.
    observed_steps: u64,
    /// The trainer's optimizer figures (refreshes, bases sent and kept).
    optimizer: OptimizerSummary,
    /// How the rank waited for MPI (`Spin` or `Nap`).
    waiting: String,
}

/// SOAP refreshing every 2 steps, so that the 8 steps of [`dp_config`] refresh every basis 3
/// times (the first step only builds the bases), with or without a split. Only sides of at
/// most 16 are rotated: the 16-wide side of the 2 layers' key and value projections (grouped
/// heads), whose 16×16 statistics have full rank. A side wider than the gradients' rank has a
/// degenerate eigenspace whose basis vectors are arbitrary, and Adam normalises each of them,
/// so the float-level difference between averaging over 2 ranks and over 1 grows to about 1e-2
/// in the weights within a few steps — SOAP's sensitivity, with or without a split, and far
/// outside the tolerance of a data-parallel comparison. (Bit-identity of the split with every
/// side rotated is `tests/split_refresh.rs`'s.)
fn soap(split: Option<SplitRefresh>) -> Box<dyn Optimizer> {
    Box::new(Soap::new(SoapConfig {
        precondition_frequency: 2,
        max_precond_dim: 16,
        split,
        ..SoapConfig::default()
    }))
}

/// The split of the test: threshold 0, every refreshed basis sent.
const SEND_ALL: SplitRefresh = SplitRefresh {
    threshold: 0.0,
    max_kept: 0,
};

struct CountSteps(u64);

impl TrainObserver for CountSteps {
    fn on_step(&mut self, _m: &StepMetrics) {
        self.0 += 1;
    }
}

/// One rank's work; the MPI environment is already up.
fn rank_body(mode: &str, dir: &Path, comm: MpiComm) -> RankResult {
    let rank = comm.rank();
    let world = comm.world_size();
    let waiting = format!("{:?}", comm.waiting());
    let config = dp_config();
    match mode {
        // The trainer itself over MPI, as tests/data_parallel.rs drives it over threads; and
        // the same with SOAP's basis refreshes split across the ranks.
        "trainer" | "split" => {
            let optimizer = if mode == "split" {
                soap(Some(SEND_ALL))
            } else {
                make_optimizer(&config).unwrap()
            };
            let mut t = Trainer::<CpuBackend>::new(
                config.clone(),
                load_corpus(&config).unwrap(),
                optimizer,
                Box::new(comm),
                Default::default(),
            )
            .unwrap();
            let mut count = CountSteps(0);
            let s = t.run(&FixedClock, &mut count).unwrap();
            RankResult {
                rank,
                world,
                history: s.history,
                weights: bits(t.params().flat()),
                observed_steps: count.0,
                optimizer: s.optimizer,
                waiting,
            }
        }
        // The entry point `orrery train --comm mpi` uses, with an output folder: only rank 0
        // may report progress and write files.
        "api" => {
            let mut config = config;
            config.out_dir = Some(dir.join("out"));
            let options = RunOptions {
                clock: Arc::new(FixedClock),
                ..RunOptions::default()
            };
            let mut count = CountSteps(0);
            let s = train_with_comm(&config, &options, Box::new(comm), &mut count).unwrap();
            RankResult {
                rank,
                world,
                history: s.history,
                weights: Vec::new(),
                observed_steps: count.0,
                optimizer: s.optimizer,
                waiting,
            }
        }
        // Every collective of the trait, on an odd world so that buffers split unevenly; or
        // (`agree`) nothing but how the rank waits (`one_napping_rank_makes_every_rank_nap`).
        "collectives" | "agree" => {
            if mode == "collectives" {
                check_collectives(comm);
            }
            RankResult {
                rank,
                world,
                history: Vec::new(),
                weights: Vec::new(),
                observed_steps: 0,
                optimizer: OptimizerSummary::default(),
                waiting,
            }
        }
        // Tensor and pipeline parallelism (TP 2 × PP 2) with one process per rank.
        "model_parallel" | "expert_parallel" => {
            let config = if mode == "model_parallel" {
                mp_config(2, 2, 1, 2)
            } else {
                moe_config()
            };
            let corpus = load_corpus(&config).unwrap();
            let (history, weights) = run_model_parallel_rank(&config, corpus, Box::new(comm));
            RankResult {
                rank,
                world,
                history,
                weights: bits(&weights),
                observed_steps: 0,
                optimizer: OptimizerSummary::default(),
                waiting,
            }
        }
        other => panic!("unknown {MODE_VAR} `{other}`"),
    }
}

/// The trait's contract, checked on each rank of a world of 3 (mirrors the `ThreadComm` unit
/// tests in src/comm.rs).
fn check_collectives(mut c: MpiComm) {
    let world = c.world_size();
    assert_eq!(world, 3);
    let r = c.rank();
    let rf = r as f32;
    // The first element's float sum depends on the association: in rank order
    // (1 + 1e8) - 1e8 = 0, since 1e8 + 1 rounds to 1e8, whereas 1 + (1e8 - 1e8) = 1.
    let contribution = |rank: f32| {
        let first = [1.0, 1e8, -1e8][rank as usize];
        [
            first,
            1e8 * (rank - 1.0),
            0.1 * rank,
            3.0,
            -rank,
            1e-3,
            rank,
        ]
    };
    let mut buf = contribution(rf);
    c.all_reduce_sum_f32(&mut buf).unwrap();
    let mut expected = contribution(0.0);
    for rank in 1..world {
        for (e, x) in expected.iter_mut().zip(contribution(rank as f32)) {
            *e += x;
        }
    }
    assert_eq!(expected[0], 0.0);
    assert_eq!(bits(&buf), bits(&expected), "rank-order sum on rank {r}");
    // Fewer elements than ranks: some ranks sum nothing.
    let mut one = [rf + 0.5];
    c.all_reduce_sum_f32(&mut one).unwrap();
    assert_eq!(one, [((0.5f32 + 1.5) + 2.5)]);
    let mut empty: [f32; 0] = [];
    c.all_reduce_sum_f32(&mut empty).unwrap();

    let mut f = vec![rf; 5];
    c.broadcast_f32(2, &mut f).unwrap();
    assert_eq!(f, vec![2.0; 5]);
    let mut b = if r == 1 {
        b"hello".to_vec()
    } else {
        vec![9; r * 7]
    };
    c.broadcast_bytes(1, &mut b).unwrap();
    assert_eq!(b, b"hello");
    let mine = vec![r as u8; r * 2];
    let all = c.all_gather_bytes(&mine).unwrap();
    assert_eq!(all, vec![vec![], vec![1, 1], vec![2, 2, 2, 2]]);
    c.barrier().unwrap();

    // Argument errors are reported alike on every rank and leave the communicator usable.
    let mut uneven = vec![0.0f32; 1 + r];
    assert_eq!(
        c.all_reduce_sum_f32(&mut uneven),
        Err(orrery_train::CommError::LengthMismatch {
            rank: 1,
            expected: 1,
            found: 2
        })
    );
    assert!(matches!(
        c.broadcast_f32(0, &mut uneven),
        Err(orrery_train::CommError::LengthMismatch { rank: 1, .. })
    ));
    assert_eq!(
        c.broadcast_bytes(3, &mut b),
        Err(orrery_train::CommError::BadRoot { root: 3, world: 3 })
    );
    let mut again = [1.0f32];
    c.all_reduce_sum_f32(&mut again).unwrap();
    assert_eq!(again, [3.0]);

    check_point_to_point_and_groups(&mut c);
}

/// Point-to-point messages and group collectives over MPI (mirrors the `ThreadComm` unit tests
/// in src/comm.rs), on a world of 3.
fn check_point_to_point_and_groups(c: &mut MpiComm) {
    use orrery_train::{CommError, Group};
    let r = c.rank();
    // Messages of one pair arrive in order; a receive of the wrong length drains the message
    // and the next one still lines up.
    if r == 0 {
        for i in 0..3 {
            c.send_f32(1, &[i as f32; 4]).unwrap();
        }
        c.send_f32(1, &[9.0; 5]).unwrap();
        c.send_f32(1, &[10.0; 4]).unwrap();
    } else if r == 1 {
        let mut buf = [0.0f32; 4];
        for i in 0..3 {
            c.recv_f32(0, &mut buf).unwrap();
            assert_eq!(buf, [i as f32; 4]);
        }
        assert_eq!(
            c.recv_f32(0, &mut buf),
            Err(CommError::LengthMismatch {
                rank: 0,
                expected: 4,
                found: 5
            })
        );
        c.recv_f32(0, &mut buf).unwrap();
        assert_eq!(buf, [10.0; 4]);
    }
    assert_eq!(
        c.send_f32(r, &[1.0]),
        Err(CommError::BadPeer { peer: r, world: 3 })
    );
    // A ring of simultaneous exchanges far above any eager limit: send_recv must not deadlock.
    let big = vec![r as f32; 1 << 20];
    let mut got = vec![0.0f32; 1 << 20];
    c.send_recv_f32((r + 1) % 3, &big, (r + 2) % 3, &mut got)
        .unwrap();
    assert!(got.iter().all(|&x| x == ((r + 2) % 3) as f32));

    // A group of two (rank 1 sits out), summed in group order.
    if r != 1 {
        let g = Group::new(vec![2, 0], 3).unwrap();
        let mut buf = if r == 2 {
            vec![1.0f32, 1e8, 0.5]
        } else {
            vec![1e8, -1e8, 0.25]
        };
        c.group_all_reduce_sum_f32(&g, &mut buf).unwrap();
        assert_eq!(buf, vec![1.0f32 + 1e8, 0.0, 0.75]);
    }
    let g = Group::new(vec![1, 2, 0], 3).unwrap();
    let p = g.position(r).unwrap();
    let mut gathered = vec![0.0f32; 6];
    c.group_all_gather_f32(&g, &[r as f32, 10.0 * r as f32], &mut gathered)
        .unwrap();
    assert_eq!(gathered, vec![1.0, 10.0, 2.0, 20.0, 0.0, 0.0]);
    // Member p sends p + q + 1 copies of (10 r + q) to member q.
    let send_counts: Vec<usize> = (0..3).map(|q| p + q + 1).collect();
    let send: Vec<f32> = (0..3)
        .flat_map(|q| std::iter::repeat_n((10 * r + q) as f32, p + q + 1))
        .collect();
    let recv_counts: Vec<usize> = (0..3).map(|q| q + p + 1).collect();
    let mut recv = vec![0.0f32; recv_counts.iter().sum()];
    c.group_all_to_all_v_f32(&g, &send, &send_counts, &mut recv, &recv_counts)
        .unwrap();
    let expect: Vec<f32> = g
        .ranks()
        .iter()
        .enumerate()
        .flat_map(|(q, &src)| std::iter::repeat_n((10 * src + p) as f32, q + p + 1))
        .collect();
    assert_eq!(recv, expect);
}

/// The body of each rank process; an ordinary `cargo test` run passes through it doing nothing.
#[test]
fn rank_process() {
    let (Some(mode), Some(dir)) = (std::env::var(MODE_VAR).ok(), std::env::var_os(DIR_VAR)) else {
        return;
    };
    let dir = PathBuf::from(dir);
    if mode == "agree" && std::env::var("OMPI_COMM_WORLD_RANK").as_deref() == Ok("0") {
        // Before MPI starts, on one process of the job only (Open MPI names the rank).
        std::env::set_var(WAIT_VAR, "nap");
    }
    let comm = MpiComm::init().expect("MPI initialises under the launcher");
    let rank = comm.rank();
    // A rank that fails must take the job down: returning (or unwinding) would finalise MPI
    // while its peer still waits in a collective, and the launch would hang until the timeout.
    let abort = comm.abort_handle();
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let result = rank_body(&mode, &dir, comm);
        let path = dir.join(format!("{mode}-rank{rank}.json"));
        std::fs::write(&path, serde_json::to_vec(&result).unwrap()).unwrap();
    }));
    if outcome.is_err() {
        eprintln!("rank {rank} failed; aborting the MPI job");
        abort.abort(3);
    }
}

/// How `ranks` ranks launched on this machine wait when not told: they nap only where they
/// outnumber the CPUs this process may use (its CPU set, within any quota). Open MPI 4.1
/// binds each of up to two ranks to a core of its own, more ranks to a socket, and none
/// when they outnumber the cores: on a one-socket machine the ranks' CPU sets cover all
/// its CPUs or one each, and either way they outnumber them exactly when `ranks` does.
fn chosen_waiting(ranks: usize) -> &'static str {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if ranks > cpus {
        "Nap"
    } else {
        "Spin"
    }
}

/// Runs `mpirun -n RANKS` on this test binary in `mode`; returns each rank's result, by rank.
/// Fails with the launcher's output if it fails, and kills it if it outlives [`TIMEOUT`].
/// The ranks choose how to wait from the cores (the variable is cleared).
fn launch(mode: &str, ranks: usize, dir: &Path) -> Vec<RankResult> {
    launch_waiting(mode, ranks, dir, None)
}

/// [`launch`], with the ranks told how to wait (`spin` or `nap`) when `waiting` is given.
fn launch_waiting(mode: &str, ranks: usize, dir: &Path, waiting: Option<&str>) -> Vec<RankResult> {
    let launcher = std::env::var("ORRERY_MPIRUN").unwrap_or_else(|_| "mpirun".into());
    let exe = std::env::current_exe().unwrap();
    let log = dir.join(format!("{mode}.log"));
    let log_file = std::fs::File::create(&log).unwrap();
    let session = common::mpi_session::mpi_session_dir();
    let mut command = Command::new(&launcher);
    match waiting {
        Some(w) => command.env(WAIT_VAR, w),
        None => command.env_remove(WAIT_VAR),
    };
    let mut child = command
        .args(["-n", &ranks.to_string()])
        .arg(&exe)
        .args(["--exact", "rank_process", "--nocapture", "--test-threads=1"])
        .env(MODE_VAR, mode)
        .env(DIR_VAR, dir)
        // CI runs as root in a container, which Open MPI refuses unless told twice.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // Two ranks may exceed the slots Open MPI counts on a small machine (one per core).
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        // Loopback TCP between the two processes (plus `self` for a rank's messages to
        // itself): it works in any container, whereas the shared-memory transport needs a
        // large /dev/shm and cross-process memory access that containers often restrict.
        .env("OMPI_MCA_btl", "self,tcp")
        .env("OMPI_MCA_btl_tcp_if_include", "lo")
        // The out-of-band channel between mpirun and the ranks, also on loopback.
        .env("OMPI_MCA_oob_tcp_if_include", "lo")
        // Its own session folder: parallel launches race on a shared one.
        .env("TMPDIR", &session)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start `{launcher}` (is MPI installed?): {e}"));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > TIMEOUT {
            // SIGTERM first: mpirun then ends its ranks too, which SIGKILL would orphan.
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let grace = Instant::now();
            while grace.elapsed() < Duration::from_secs(10) {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "`{launcher} -n {ranks}` ({mode}) did not finish within {} s and was killed; its output:\n{}",
                TIMEOUT.as_secs(),
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = std::fs::remove_dir_all(&session);
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        status.success(),
        "`{launcher} -n {ranks}` ({mode}) failed with {status}; its output:\n{output}"
    );
    (0..ranks)
        .map(|rank| {
            let path = dir.join(format!("{mode}-rank{rank}.json"));
            let bytes = std::fs::read(&path)
                .unwrap_or_else(|e| panic!("rank {rank} wrote no result ({e}); output:\n{output}"));
            serde_json::from_slice(&bytes).unwrap()
        })
        .collect()
}

/// The test for the MPI backend: 2 MPI ranks with 4 sequences each train like 1 rank
/// with 8, within the tolerance of the threads test, and both ranks end with identical weights.
/// The MPI all-reduce sums in rank order like the threads backend, so on top of that the MPI
/// run reproduces the 2-thread run bit for bit.
#[test]
fn two_mpi_ranks_equal_one_rank_with_twice_the_batch() {
    let dir = temp_dir("mpi-dp");
    let ranks = launch("trainer", 2, &dir);
    for (i, r) in ranks.iter().enumerate() {
        assert_eq!((r.rank, r.world), (i, 2), "one rank per process");
        assert_eq!(r.waiting, chosen_waiting(2), "rank {i}");
    }
    assert_eq!(
        ranks[0].history, ranks[1].history,
        "both ranks report the same run"
    );
    assert_eq!(
        ranks[0].weights, ranks[1].weights,
        "ranks hold identical weights"
    );
    let config = dp_config();
    let weights: Vec<f32> = ranks[0]
        .weights
        .iter()
        .map(|&b| f32::from_bits(b))
        .collect();
    assert_matches_single(&run_single(&config), &ranks[0].history, &weights);

    let threads = run_threads(&config, 2);
    assert_eq!(
        ranks[0].history, threads[0].0.history,
        "MPI run = threads run"
    );
    assert_eq!(
        ranks[0].weights,
        bits(&threads[0].1),
        "MPI weights = threads weights"
    );

    // Through `train_with_comm`: the same run, progress and files on rank 0 only.
    let api = launch("api", 2, &dir);
    assert_eq!(api[0].history, ranks[0].history);
    assert_eq!((api[0].observed_steps, api[1].observed_steps), (8, 0));
    let out = dir.join("out");
    let metrics = std::fs::read_to_string(out.join(METRICS_FILE)).unwrap();
    let expected: Vec<String> = ranks[0].history.iter().map(|m| m.to_json_line()).collect();
    assert_eq!(metrics.lines().collect::<Vec<_>>(), expected);
    let ckpt = Checkpoint::load(&out.join(CHECKPOINT_FILE)).unwrap();
    assert_eq!(bits(&ckpt.values), ranks[0].weights);
    assert_eq!(ckpt.meta.world_size, 2);
    assert!(out.join(LOSS_PLOT_FILE).exists());
}

/// Issue 5's split refresh over MPI: 2 MPI ranks running SOAP with each basis refreshed by one
/// owner and sent to the other (threshold 0) train like 1 rank with twice the batch refreshing
/// everything itself, within the tolerance of the test above. Every refresh that fell due
/// was sent, both ranks count the same, and the run is bit for bit the 2-thread split run and
/// the 2-thread run without a split.
#[test]
fn two_mpi_ranks_with_split_refresh_equal_one_rank_with_twice_the_batch() {
    let dir = temp_dir("mpi-split");
    let ranks = launch("split", 2, &dir);
    let config = dp_config();
    let (a, b) = (&ranks[0], &ranks[1]);
    assert_eq!(a.history, b.history, "both ranks report the same run");
    assert_eq!(a.weights, b.weights, "ranks hold identical weights");
    assert_eq!(
        a.optimizer, b.optimizer,
        "both ranks count the same exchange"
    );
    let o = a.optimizer;
    // 4 rotated matrices (2 layers' key and value projections), 3 refreshes each.
    assert_eq!(o.refreshes, 12, "{o:?}");
    assert_eq!((o.bases_sent, o.bases_kept), (12, 0), "{o:?}");

    let weights: Vec<f32> = a.weights.iter().map(|&w| f32::from_bits(w)).collect();
    let single = run_single_with(&config, soap(None));
    assert_matches_single(&single, &a.history, &weights);
    assert_eq!(single.0.optimizer.refreshes, o.refreshes);

    for split in [Some(SEND_ALL), None] {
        let threads = run_threads_with(
            &config,
            2,
            || soap(split),
            |t, s| (s, bits(t.params().flat())),
        );
        assert_eq!(a.history, threads[0].0.history, "{split:?}: MPI = threads");
        assert_eq!(a.weights, threads[0].1, "{split:?}: MPI weights = threads");
    }
}

/// Every method of the trait over MPI, on 3 ranks: rank-order sums identical on all ranks,
/// broadcasts, an all-gather of unequal lengths, the barrier, and argument errors; with the
/// ranks waiting in MPI's blocking calls and with naps between non-blocking tests.
#[test]
fn mpi_collectives_keep_the_trait_contract() {
    for (waiting, expected) in [("spin", "Spin"), ("nap", "Nap")] {
        let dir = temp_dir(&format!("mpi-collectives-{waiting}"));
        let ranks = launch_waiting("collectives", 3, &dir, Some(waiting));
        for (i, r) in ranks.iter().enumerate() {
            assert_eq!((r.rank, r.world), (i, 3));
            assert_eq!(r.waiting, expected, "{WAIT_VAR}={waiting}");
        }
    }
}

/// One rank told to nap makes the whole job nap (ranks that waited differently would never
/// match their collectives): the variable is set in rank 0's process only.
#[test]
fn one_napping_rank_makes_every_rank_nap() {
    let dir = temp_dir("mpi-agree");
    let ranks = launch_waiting("agree", 2, &dir, Some("spin"));
    for r in &ranks {
        assert_eq!(r.waiting, "Nap", "rank {}", r.rank);
    }
}

/// The trainer with napping ranks trains bit for bit as with spinning ones: how a rank waits
/// changes when messages are picked up, never what they hold. Both are forced, so both run
/// whatever the machine's cores.
#[test]
fn napping_mpi_ranks_train_like_spinning_ones() {
    let dir = temp_dir("mpi-nap");
    let nap = launch_waiting("trainer", 2, &dir, Some("nap"));
    let spin = launch_waiting("trainer", 2, &dir, Some("spin"));
    for (n, s) in nap.iter().zip(&spin) {
        assert_eq!((n.waiting.as_str(), s.waiting.as_str()), ("Nap", "Spin"));
        assert_eq!(n.history, s.history, "rank {}: history", n.rank);
        assert_eq!(n.weights, s.weights, "rank {}: weights", n.rank);
    }
}

/// A mixture of experts laid out TP 2 × DP 2 × EP 2 (4 ranks).
fn moe_config() -> orrery_train::TrainConfig {
    let mut c = mp_config(2, 1, 2, 1);
    c.model.moe = Some(orrery_train::MoeConfig {
        experts: 4,
        top_k: 2,
    });
    c.parallel = c
        .parallel
        .map(|p| orrery_train::ParallelConfig { ep: 2, ..p });
    c
}

/// Tensor and pipeline parallelism over MPI: 4 processes laid out TP 2 × PP 2 train exactly
/// the 4-thread run (the group collectives and the pipeline's messages are the same
/// arithmetic on both backends), which `tests/model_parallel.rs` compares with one rank.
#[test]
fn model_parallel_over_mpi_equals_threads() {
    let dir = temp_dir("mpi-model-parallel");
    let ranks = launch("model_parallel", 4, &dir);
    let threads = run_model_parallel_threads(&mp_config(2, 2, 1, 2));
    for (r, t) in ranks.iter().zip(&threads) {
        assert_eq!(r.waiting, chosen_waiting(4), "rank {}", r.rank);
        assert_eq!(r.history, t.0, "rank {}: MPI history = threads", r.rank);
        assert_eq!(
            r.weights,
            bits(&t.1),
            "rank {}: MPI weights = threads",
            r.rank
        );
    }
}

/// Expert parallelism over MPI: the token dispatch and combine (group all-to-all) with one
/// process per rank train exactly the 4-thread run.
#[test]
fn expert_parallel_over_mpi_equals_threads() {
    let dir = temp_dir("mpi-expert-parallel");
    let ranks = launch("expert_parallel", 4, &dir);
    let threads = run_model_parallel_threads(&moe_config());
    for (r, t) in ranks.iter().zip(&threads) {
        assert_eq!(r.history, t.0, "rank {}: MPI history = threads", r.rank);
        assert_eq!(
            r.weights,
            bits(&t.1),
            "rank {}: MPI weights = threads",
            r.rank
        );
    }
}
