//! The coordinator: real ranks' measured compute into the emulation engine.
//!
//! Each real rank gets a [`RankReporter`]. Its program reports every compute segment it
//! finishes (the time between two communication calls, or before the first and after the
//! last) and says when it is done. The [`Coordinator`] owns the engine and advances it;
//! whenever the engine starts a compute op of a real rank, the coordinator takes that
//! rank's next report (waiting for it, up to the timeout) and supplies its duration. The
//! collected graph of a real rank has one compute op per segment, in the same order, so the
//! `k`-th report is the `k`-th compute op.

use orrery_net::NetworkModel;
use orrery_predict::emulate::{EmulateError, Emulation, EmulationStep};
use orrery_predict::replay::Timeline;
use orrery_units::{Picos, RankId};
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;
use thiserror::Error;

/// What a real rank tells the coordinator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Report {
    /// A compute segment finished; it took this long. The second field is the bytes the
    /// operation that ends the segment moves, where the program knows them (an expert
    /// all-to-all's size follows the router's choices, step by step).
    Segment(Picos, Option<u64>),
    /// The rank's step is over (no more segments).
    Done,
    /// The rank's program failed; the reason is shown to the user.
    Failed(String),
}

/// Why a coordinated emulation stopped.
#[derive(Debug, Error)]
pub enum CoordinatorError {
    #[error("real rank {rank} reported nothing for {waited:?} while the emulation waited for its compute segment {segment} (hung?)")]
    Hung {
        rank: u32,
        segment: usize,
        waited: Duration,
    },
    #[error("real rank {rank} stopped before its compute segment {segment} (its program ended or crashed without reporting)")]
    Gone { rank: u32, segment: usize },
    #[error("real rank {rank} failed: {reason}")]
    Failed { rank: u32, reason: String },
    #[error("real rank {rank} finished after {reported} compute segments, its graph has more (segment {segment} is waiting)")]
    TooFew {
        rank: u32,
        reported: usize,
        segment: usize,
    },
    #[error("real rank {rank} reported more compute segments ({reported}) than its graph has ({expected})")]
    TooMany {
        rank: u32,
        reported: usize,
        expected: usize,
    },
    #[error("{0} is not a real rank of this emulation")]
    NotLive(u32),
    #[error(transparent)]
    Emulate(#[from] EmulateError),
}

/// The sending end a real rank reports through. Cheap to clone; dropping every clone
/// without [`Report::Done`] counts as the rank being gone.
#[derive(Debug, Clone)]
pub struct RankReporter {
    rank: RankId,
    tx: Sender<Report>,
}

impl RankReporter {
    pub fn rank(&self) -> RankId {
        self.rank
    }

    /// Reports a finished compute segment. Never blocks; fails only if the coordinator has
    /// stopped (then the emulation is over and the rank may stop too).
    pub fn segment(&self, took: Picos) -> Result<(), Report> {
        self.tx.send(Report::Segment(took, None)).map_err(|e| e.0)
    }

    /// Reports a finished compute segment and the bytes of the operation that ends it.
    pub fn segment_before(&self, took: Picos, bytes: u64) -> Result<(), Report> {
        self.tx
            .send(Report::Segment(took, Some(bytes)))
            .map_err(|e| e.0)
    }

    pub fn done(&self) -> Result<(), Report> {
        self.tx.send(Report::Done).map_err(|e| e.0)
    }

    pub fn failed(&self, reason: impl Into<String>) -> Result<(), Report> {
        self.tx.send(Report::Failed(reason.into())).map_err(|e| e.0)
    }
}

struct Live {
    rx: Receiver<Report>,
    /// Segments received.
    reported: usize,
    done: bool,
}

/// Drives an emulation from real ranks' reports (see the module docs).
pub struct Coordinator<'a, N: NetworkModel> {
    emulation: Emulation<'a, N>,
    live: HashMap<u32, Live>,
    timeout: Duration,
}

impl<N: NetworkModel> std::fmt::Debug for Coordinator<'_, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("live", &self.live.len())
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// What a coordinated step gives back.
#[derive(Debug, Clone)]
pub struct CoordinatedStep {
    pub timeline: Timeline,
    /// Who each participant of the timeline is (in the timeline's order).
    pub participants: Vec<orrery_predict::emulate::ParticipantInfo>,
    /// Wall time the engine spent on the step (advancing and taking durations, not
    /// waiting for reports): emulation's own cost, on a core beside the real ranks'.
    pub engine: Duration,
    /// For each real rank: the durations it reported, in order, against what the models
    /// (the collected graph, or the cost model) expected.
    pub segments: Vec<(RankId, Vec<(Picos, Picos)>)>,
}

impl<'a, N: NetworkModel> Coordinator<'a, N> {
    /// A coordinator over `emulation`, with one reporter per real rank. A rank that
    /// reports nothing for `timeout` while the emulation waits for it is an error.
    pub fn new(
        emulation: Emulation<'a, N>,
        timeout: Duration,
    ) -> (Coordinator<'a, N>, Vec<RankReporter>) {
        let mut live = HashMap::new();
        let mut reporters = Vec::new();
        for p in emulation.participants() {
            if p.live {
                let (tx, rx) = channel();
                live.insert(
                    p.rank.0,
                    Live {
                        rx,
                        reported: 0,
                        done: false,
                    },
                );
                reporters.push(RankReporter { rank: p.rank, tx });
            }
        }
        (
            Coordinator {
                emulation,
                live,
                timeout,
            },
            reporters,
        )
    }

    /// Runs the step to its end.
    pub fn run(mut self) -> Result<CoordinatedStep, CoordinatorError> {
        let participants = self.emulation.participants().to_vec();
        let mut engine = Duration::ZERO;
        let mut segments: HashMap<u32, Vec<(Picos, Picos)>> = HashMap::new();
        loop {
            let t = std::time::Instant::now();
            let next = self.emulation.advance()?;
            engine += t.elapsed();
            match next {
                EmulationStep::Done(timeline) => {
                    self.check_all_done()?;
                    let mut segs: Vec<(RankId, Vec<(Picos, Picos)>)> =
                        segments.into_iter().map(|(r, s)| (RankId(r), s)).collect();
                    segs.sort_by_key(|(r, _)| *r);
                    return Ok(CoordinatedStep {
                        timeline,
                        participants,
                        engine,
                        segments: segs,
                    });
                }
                EmulationStep::Compute {
                    participant,
                    rank,
                    op,
                    modelled,
                    ..
                } => {
                    let (took, bytes) = self.next_segment(rank)?;
                    let t = std::time::Instant::now();
                    segments.entry(rank.0).or_default().push((took, modelled));
                    self.emulation.supply(participant, op, took)?;
                    if let Some(b) = bytes {
                        self.emulation.size_next_all_to_all(participant, op, b);
                    }
                    engine += t.elapsed();
                }
            }
        }
    }

    /// The next segment `rank` reports, waiting up to the timeout.
    fn next_segment(&mut self, rank: RankId) -> Result<(Picos, Option<u64>), CoordinatorError> {
        let timeout = self.timeout;
        let live = self
            .live
            .get_mut(&rank.0)
            .ok_or(CoordinatorError::NotLive(rank.0))?;
        let segment = live.reported;
        if live.done {
            return Err(CoordinatorError::TooFew {
                rank: rank.0,
                reported: live.reported,
                segment,
            });
        }
        match live.rx.recv_timeout(timeout) {
            Ok(Report::Segment(d, bytes)) => {
                live.reported += 1;
                Ok((d, bytes))
            }
            Ok(Report::Done) => {
                live.done = true;
                Err(CoordinatorError::TooFew {
                    rank: rank.0,
                    reported: live.reported,
                    segment,
                })
            }
            Ok(Report::Failed(reason)) => Err(CoordinatorError::Failed {
                rank: rank.0,
                reason,
            }),
            Err(RecvTimeoutError::Timeout) => Err(CoordinatorError::Hung {
                rank: rank.0,
                segment,
                waited: timeout,
            }),
            Err(RecvTimeoutError::Disconnected) => Err(CoordinatorError::Gone {
                rank: rank.0,
                segment,
            }),
        }
    }

    /// After the step: every real rank must say it is done, with no segment left over.
    fn check_all_done(&mut self) -> Result<(), CoordinatorError> {
        let mut ranks: Vec<u32> = self.live.keys().copied().collect();
        ranks.sort_unstable();
        for r in ranks {
            let timeout = self.timeout;
            let Some(live) = self.live.get_mut(&r) else {
                continue;
            };
            if live.done {
                continue;
            }
            match live.rx.recv_timeout(timeout) {
                Ok(Report::Done) => live.done = true,
                Ok(Report::Segment(..)) => {
                    return Err(CoordinatorError::TooMany {
                        rank: r,
                        reported: live.reported + 1,
                        expected: live.reported,
                    })
                }
                Ok(Report::Failed(reason)) => {
                    return Err(CoordinatorError::Failed { rank: r, reason })
                }
                Err(RecvTimeoutError::Timeout) => {
                    return Err(CoordinatorError::Hung {
                        rank: r,
                        segment: live.reported,
                        waited: timeout,
                    })
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(CoordinatorError::Gone {
                        rank: r,
                        segment: live.reported,
                    })
                }
            }
        }
        Ok(())
    }
}
