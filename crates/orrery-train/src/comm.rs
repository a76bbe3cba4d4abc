//! Collective communication between data-parallel ranks.
//!
//! [`Communicator`] is the small blocking, rank-ordered interface the trainer needs: every rank
//! calls the same collectives in the same order, each call returns when the collective is
//! complete on that rank. That is the MPI model, so the MPI backend maps onto MPI collectives
//! (`MPI_Bcast`, `MPI_Allgather`, `MPI_Barrier`; the all-reduce is an `MPI_Alltoallv` and an
//! `MPI_Allgatherv` rather than `MPI_Allreduce`, whose summation order is the library's
//! choice); an emulated backend (real ranks among virtual ones) fits the same shape.
//!
//! Two backends live here: [`SingleRank`] (world of one; every collective is the identity) and
//! [`ThreadComm`] (ranks are threads of one process sharing a mutex-protected exchange area).
//! The third, `MpiComm` (one rank per process, over MPI), is in `comm_mpi` behind the `mpi`
//! feature. Sums are always taken in rank order `((x0 + x1) + x2) + ...` and every rank computes
//! the same sum, so results never depend on thread timing or on the backend and are identical
//! on all ranks.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use thiserror::Error;

/// Errors of a collective.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CommError {
    #[error("a peer rank left the communicator before finishing the collective")]
    PeerGone,
    #[error("rank {rank} contributed {found} elements, rank 0 contributed {expected}")]
    LengthMismatch {
        rank: usize,
        expected: usize,
        found: usize,
    },
    #[error("root rank {root} is outside a world of {world}")]
    BadRoot { root: usize, world: usize },
    #[error("a peer rank panicked while holding the communicator")]
    Poisoned,
    #[error("a message of {elements} elements is too long for the communicator")]
    TooLarge { elements: usize },
}

/// Blocking, rank-ordered collectives over a fixed group of ranks.
pub trait Communicator: Send {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Replaces `buf` on every rank by the element-wise sum over ranks, summed in rank order.
    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<(), CommError>;
    /// Copies `root`'s `buf` into every rank's `buf` (all the same length).
    fn broadcast_f32(&mut self, root: usize, buf: &mut [f32]) -> Result<(), CommError>;
    /// Copies `root`'s bytes to every rank (lengths may differ before the call).
    fn broadcast_bytes(&mut self, root: usize, buf: &mut Vec<u8>) -> Result<(), CommError>;
    /// Every rank's bytes, indexed by rank, on every rank.
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<(), CommError>;
}

/// The communicator of a run with one rank.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleRank;

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum_f32(&mut self, _buf: &mut [f32]) -> Result<(), CommError> {
        Ok(())
    }
    fn broadcast_f32(&mut self, root: usize, _buf: &mut [f32]) -> Result<(), CommError> {
        check_root(root, 1)
    }
    fn broadcast_bytes(&mut self, root: usize, _buf: &mut Vec<u8>) -> Result<(), CommError> {
        check_root(root, 1)
    }
    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        Ok(vec![mine.to_vec()])
    }
    fn barrier(&mut self) -> Result<(), CommError> {
        Ok(())
    }
}

fn check_root(root: usize, world: usize) -> Result<(), CommError> {
    if root < world {
        Ok(())
    } else {
        Err(CommError::BadRoot { root, world })
    }
}

#[derive(Debug)]
struct State {
    /// Incremented each time every rank has arrived at a barrier.
    generation: u64,
    arrived: usize,
    /// Set when a rank drops its communicator; peers waiting for it then fail instead of
    /// hanging.
    departed: bool,
    floats: Vec<Vec<f32>>,
    bytes: Vec<Vec<u8>>,
}

#[derive(Debug)]
struct Shared {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank of an in-process group; create the group with [`ThreadComm::group`] and move each
/// member to its own thread.
#[derive(Debug)]
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl ThreadComm {
    /// `world` connected ranks (`world >= 1`), indexed by rank.
    pub fn group(world: usize) -> Vec<ThreadComm> {
        let world = world.max(1);
        let shared = Arc::new(Shared {
            world,
            state: Mutex::new(State {
                generation: 0,
                arrived: 0,
                departed: false,
                floats: vec![Vec::new(); world],
                bytes: vec![Vec::new(); world],
            }),
            cv: Condvar::new(),
        });
        (0..world)
            .map(|rank| ThreadComm {
                rank,
                shared: Arc::clone(&shared),
            })
            .collect()
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, CommError> {
        self.shared.state.lock().map_err(|_| CommError::Poisoned)
    }

    /// Waits until every rank has arrived; returns the guard re-acquired after the wait.
    fn wait_all<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
    ) -> Result<MutexGuard<'a, State>, CommError> {
        let gen = st.generation;
        st.arrived += 1;
        if st.arrived == self.shared.world {
            st.arrived = 0;
            st.generation += 1;
            self.shared.cv.notify_all();
            return Ok(st);
        }
        // `departed` is checked before every wait: a peer that left before we arrived has
        // already sent its notification.
        while st.generation == gen {
            if st.departed {
                return Err(CommError::PeerGone);
            }
            st = self.shared.cv.wait(st).map_err(|_| CommError::Poisoned)?;
        }
        Ok(st)
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        if let Ok(mut st) = self.shared.state.lock() {
            st.departed = true;
        }
        self.shared.cv.notify_all();
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum_f32(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let mut st = self.lock()?;
        st.floats[self.rank].clear();
        st.floats[self.rank].extend_from_slice(buf);
        let st = self.wait_all(st)?;
        let expected = st.floats[0].len();
        for (rank, f) in st.floats.iter().enumerate() {
            if f.len() != expected {
                // Every rank sees the same mismatch, so all fail the same way; still pass the
                // second barrier so nobody is left waiting.
                let err = CommError::LengthMismatch {
                    rank,
                    expected,
                    found: f.len(),
                };
                drop(self.wait_all(st)?);
                return Err(err);
            }
        }
        buf.copy_from_slice(&st.floats[0]);
        for f in &st.floats[1..] {
            for (acc, x) in buf.iter_mut().zip(f) {
                *acc += *x;
            }
        }
        // The second barrier keeps a fast rank from overwriting its slot for the next
        // collective while a slow one is still reading this one.
        let _st = self.wait_all(st)?;
        Ok(())
    }

    fn broadcast_f32(&mut self, root: usize, buf: &mut [f32]) -> Result<(), CommError> {
        check_root(root, self.shared.world)?;
        let mut st = self.lock()?;
        if self.rank == root {
            st.floats[root].clear();
            st.floats[root].extend_from_slice(buf);
        }
        let st = self.wait_all(st)?;
        let src = &st.floats[root];
        let result = if src.len() == buf.len() {
            if self.rank != root {
                buf.copy_from_slice(src);
            }
            Ok(())
        } else {
            Err(CommError::LengthMismatch {
                rank: self.rank,
                expected: src.len(),
                found: buf.len(),
            })
        };
        let _st = self.wait_all(st)?;
        result
    }

    fn broadcast_bytes(&mut self, root: usize, buf: &mut Vec<u8>) -> Result<(), CommError> {
        check_root(root, self.shared.world)?;
        let mut st = self.lock()?;
        if self.rank == root {
            st.bytes[root].clear();
            st.bytes[root].extend_from_slice(buf);
        }
        let st = self.wait_all(st)?;
        if self.rank != root {
            buf.clear();
            buf.extend_from_slice(&st.bytes[root]);
        }
        let _st = self.wait_all(st)?;
        Ok(())
    }

    fn all_gather_bytes(&mut self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        let mut st = self.lock()?;
        st.bytes[self.rank].clear();
        st.bytes[self.rank].extend_from_slice(mine);
        let st = self.wait_all(st)?;
        let all = st.bytes.clone();
        let _st = self.wait_all(st)?;
        Ok(all)
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let st = self.lock()?;
        let _st = self.wait_all(st)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<T: Send>(world: usize, f: impl Fn(ThreadComm) -> T + Sync) -> Vec<T> {
        let comms = ThreadComm::group(world);
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    let f = &f;
                    s.spawn(move || f(c))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_reduce_sums_in_rank_order_on_every_rank() {
        let out = run(4, |mut c| {
            let r = c.rank() as f32;
            let mut results = Vec::new();
            for round in 0..50 {
                let mut buf = vec![r + round as f32, 1e8 * (r - 1.5), 0.1 * r];
                c.all_reduce_sum_f32(&mut buf).unwrap();
                results.push(buf);
            }
            results
        });
        for round in 0..50 {
            let f = round as f32;
            let expected0 = ((f + (1.0 + f)) + (2.0 + f)) + (3.0 + f);
            assert_eq!(out[0][round][0], expected0);
            let e1 = ((1e8f32 * -1.5 + 1e8 * -0.5) + 1e8 * 0.5) + 1e8 * 1.5;
            assert_eq!(out[0][round][1], e1);
            for rank in &out {
                assert_eq!(rank[round], out[0][round], "identical on every rank");
            }
        }
    }

    #[test]
    fn broadcast_gather_and_barrier() {
        let out = run(3, |mut c| {
            let mut f = vec![c.rank() as f32; 2];
            c.broadcast_f32(2, &mut f).unwrap();
            let mut b = if c.rank() == 1 {
                b"hello".to_vec()
            } else {
                Vec::new()
            };
            c.broadcast_bytes(1, &mut b).unwrap();
            let all = c.all_gather_bytes(&[c.rank() as u8]).unwrap();
            c.barrier().unwrap();
            (f, b, all)
        });
        for (f, b, all) in out {
            assert_eq!(f, vec![2.0, 2.0]);
            assert_eq!(b, b"hello");
            assert_eq!(all, vec![vec![0], vec![1], vec![2]]);
        }
    }

    #[test]
    fn a_departed_peer_fails_the_collective_instead_of_hanging() {
        let out = run(2, |mut c| {
            if c.rank() == 1 {
                drop(c);
                return Ok(());
            }
            let mut buf = [1.0f32];
            c.all_reduce_sum_f32(&mut buf)
        });
        assert_eq!(out[0], Err(CommError::PeerGone));
    }

    #[test]
    fn mismatched_lengths_are_reported_by_all() {
        let out = run(2, |mut c| {
            let mut buf = vec![0.0f32; 1 + c.rank()];
            c.all_reduce_sum_f32(&mut buf)
        });
        assert!(out
            .iter()
            .all(|r| matches!(r, Err(CommError::LengthMismatch { .. }))));
    }

    #[test]
    fn single_rank_is_identity() {
        let mut c = SingleRank;
        let mut buf = [1.0f32, 2.0];
        c.all_reduce_sum_f32(&mut buf).unwrap();
        assert_eq!(buf, [1.0, 2.0]);
        assert!(c.broadcast_f32(1, &mut buf).is_err());
    }
}
