//! Dense linear algebra on row-major `f32` buffers, with the decompositions done by faer in
//! `f64`.
//!
//! Why `f64` for the decompositions: the statistics `L = E[G G^T]` are built in `f32` and often
//! have eigenvalues spanning many orders of magnitude (they start rank-deficient). An `f32`
//! eigensolver returns eigenvectors for the small eigenvalues that are mostly rounding noise and
//! loses orthogonality; in `f64` the basis comes back orthogonal to ~1e-15 and we round it to
//! `f32` once. The state stays `f32`, so memory is unchanged; only the transient work is `f64`.
//!
//! Why faer's low-level entry points with `Par::Seq` instead of the convenience methods: the
//! convenience methods read faer's global parallelism setting, and a multi-threaded reduction
//! could make the result depend on the thread count. The optimizer promises bit-identical
//! results for identical inputs, and parallelism comes from running *different* matrices on
//! different workers instead (see `runtime`).

use faer::dyn_stack::{MemBuffer, MemStack};
use faer::linalg::evd::{self, ComputeEigenvectors};
use faer::linalg::qr::no_pivoting::factor as qr;
use faer::{Accum, Mat, MatMut, MatRef, Par};
use thiserror::Error;

/// A decomposition failed (in practice: a NaN or infinity in the statistics).
#[derive(Debug, Error, Clone, PartialEq)]
pub enum LinalgError {
    #[error(
        "symmetric eigendecomposition of a {n}x{n} matrix did not converge (non-finite input?)"
    )]
    EigenNoConvergence { n: usize },
    #[error("{what} of a {n}x{n} matrix contains a non-finite value")]
    NonFinite { what: &'static str, n: usize },
}

/// `out = a * b` with `a` m×k and `b` k×n, all row-major `f32`.
pub fn matmul(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    let ar = MatRef::from_row_major_slice(a, m, k);
    let br = MatRef::from_row_major_slice(b, k, n);
    let o = MatMut::from_row_major_slice_mut(out, m, n);
    faer::linalg::matmul::matmul(o, Accum::Replace, ar, br, 1.0f32, Par::Seq);
}

/// `out = a^T * b` with `a` k×m and `b` k×n (row-major), `out` m×n.
pub fn matmul_tn(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    let ar = MatRef::from_row_major_slice(a, k, m);
    let br = MatRef::from_row_major_slice(b, k, n);
    let o = MatMut::from_row_major_slice_mut(out, m, n);
    faer::linalg::matmul::matmul(o, Accum::Replace, ar.transpose(), br, 1.0f32, Par::Seq);
}

/// `out = a * b^T` with `a` m×k and `b` n×k (row-major), `out` m×n.
pub fn matmul_nt(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    let ar = MatRef::from_row_major_slice(a, m, k);
    let br = MatRef::from_row_major_slice(b, n, k);
    let o = MatMut::from_row_major_slice_mut(out, m, n);
    faer::linalg::matmul::matmul(o, Accum::Replace, ar, br.transpose(), 1.0f32, Par::Seq);
}

/// `acc = beta * acc + (1 - beta) * g g^T` (`g` m×n, `acc` m×m), or `acc += g g^T` when
/// `beta == 1` (Shampoo's running sum).
pub fn accumulate_left(acc: &mut [f32], g: &[f32], m: usize, n: usize, beta: f32) {
    let gr = MatRef::from_row_major_slice(g, m, n);
    let o = MatMut::from_row_major_slice_mut(acc, m, m);
    ema_gram(o, gr, gr.transpose(), beta);
}

/// `acc = beta * acc + (1 - beta) * g^T g` (`g` m×n, `acc` n×n), or a running sum at `beta == 1`.
pub fn accumulate_right(acc: &mut [f32], g: &[f32], m: usize, n: usize, beta: f32) {
    let gr = MatRef::from_row_major_slice(g, m, n);
    let o = MatMut::from_row_major_slice_mut(acc, n, n);
    ema_gram(o, gr.transpose(), gr, beta);
}

fn ema_gram(mut o: MatMut<'_, f32>, a: MatRef<'_, f32>, b: MatRef<'_, f32>, beta: f32) {
    let alpha = if beta == 1.0 { 1.0 } else { 1.0 - beta };
    if beta != 1.0 {
        for j in 0..o.ncols() {
            for i in 0..o.nrows() {
                o[(i, j)] *= beta;
            }
        }
    }
    faer::linalg::matmul::matmul(o.as_mut(), Accum::Add, a, b, alpha, Par::Seq);
}

fn to_f64(a: &[f32], n: usize) -> Mat<f64> {
    Mat::from_fn(n, n, |i, j| f64::from(a[i * n + j]))
}

/// Symmetric eigendecomposition of the n×n row-major `a` (only its lower triangle is read),
/// computed in `f64`. Returns eigenvalues in *descending* order and the matching eigenvectors as
/// the columns of an n×n row-major `f64` matrix.
pub fn eigh_desc(a: &[f32], n: usize) -> Result<(Vec<f64>, Vec<f64>), LinalgError> {
    if a.iter().any(|x| !x.is_finite()) {
        return Err(LinalgError::NonFinite {
            what: "preconditioner statistic",
            n,
        });
    }
    let m = to_f64(a, n);
    let mut u = Mat::<f64>::zeros(n, n);
    let mut s = faer::diag::Diag::<f64>::zeros(n);
    let par = Par::Seq;
    let mut buf = MemBuffer::new(evd::self_adjoint_evd_scratch::<f64>(
        n,
        ComputeEigenvectors::Yes,
        par,
        Default::default(),
    ));
    evd::self_adjoint_evd(
        m.as_ref(),
        s.as_mut(),
        Some(u.as_mut()),
        par,
        MemStack::new(&mut buf),
        Default::default(),
    )
    .map_err(|_| LinalgError::EigenNoConvergence { n })?;
    // Sort descending ourselves (stable, ties by original index) instead of relying on the
    // solver's order, so the order is part of this function's contract.
    let sv: Vec<f64> = (0..n).map(|i| s[i]).collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| sv[j].total_cmp(&sv[i]).then(i.cmp(&j)));
    let vals = order.iter().map(|&i| sv[i]).collect();
    let mut vecs = vec![0.0f64; n * n];
    for (c, &src) in order.iter().enumerate() {
        for r in 0..n {
            vecs[r * n + c] = u[(r, src)];
        }
    }
    Ok((vals, vecs))
}

/// The orthogonal factor Q of the QR decomposition of the n×n row-major `f64` matrix `a`.
pub fn qr_q(a: &[f64], n: usize) -> Result<Vec<f64>, LinalgError> {
    if a.iter().any(|x| !x.is_finite()) {
        return Err(LinalgError::NonFinite {
            what: "power iterate",
            n,
        });
    }
    let mut m = Mat::from_fn(n, n, |i, j| a[i * n + j]);
    let par = Par::Seq;
    let bs = qr::recommended_block_size::<f64>(n, n);
    let mut coeff = Mat::<f64>::zeros(bs, n);
    {
        let mut buf = MemBuffer::new(qr::qr_in_place_scratch::<f64>(
            n,
            n,
            bs,
            par,
            Default::default(),
        ));
        qr::qr_in_place(
            m.as_mut(),
            coeff.as_mut(),
            par,
            MemStack::new(&mut buf),
            Default::default(),
        );
    }
    // Q = H_1 ... H_n applied to the identity; `m`'s strictly lower part holds the Householder
    // vectors (the upper part, R, is ignored by the routine).
    let mut q = Mat::<f64>::identity(n, n);
    let mut buf = MemBuffer::new(
        faer::linalg::householder::apply_block_householder_sequence_on_the_left_in_place_scratch::<
            f64,
        >(n, bs, n),
    );
    faer::linalg::householder::apply_block_householder_sequence_on_the_left_in_place_with_conj(
        m.as_ref(),
        coeff.as_ref(),
        faer::Conj::No,
        q.as_mut(),
        par,
        MemStack::new(&mut buf),
    );
    let mut out = vec![0.0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            out[i * n + j] = q[(i, j)];
        }
    }
    Ok(out)
}

/// `a (f32, n×n) * b (f64, n×n)` in `f64`, row-major.
pub fn matmul_f32_f64(a: &[f32], b: &[f64], n: usize) -> Vec<f64> {
    let am = to_f64(a, n);
    let bm = MatRef::from_row_major_slice(b, n, n);
    let mut o = Mat::<f64>::zeros(n, n);
    faer::linalg::matmul::matmul(
        o.as_mut(),
        Accum::Replace,
        am.as_ref(),
        bm,
        1.0f64,
        Par::Seq,
    );
    let mut out = vec![0.0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            out[i * n + j] = o[(i, j)];
        }
    }
    out
}

/// `A^{-1/root}` of the symmetric n×n `a` via its eigendecomposition in `f64`: eigenvalues are
/// clamped at zero (a PSD statistic's negative eigenvalues are rounding noise) and `eps` is
/// *added* to every eigenvalue (absolute epsilon, as in Gupta et al. and Meta's Distributed
/// Shampoo), i.e. the result is `(A + eps I)^{-1/root}` for PSD `A`.
pub fn inverse_root(a: &[f32], n: usize, root: f64, eps: f64) -> Result<Vec<f32>, LinalgError> {
    let (vals, vecs) = eigh_desc(a, n)?;
    let scale: Vec<f64> = vals
        .iter()
        .map(|&l| (l.max(0.0) + eps).powf(-1.0 / root))
        .collect();
    let mut out = vec![0.0f32; n * n];
    for i in 0..n {
        for j in 0..n {
            let mut s = 0.0f64;
            for (k, sc) in scale.iter().enumerate() {
                s += vecs[i * n + k] * sc * vecs[j * n + k];
            }
            out[i * n + j] = s as f32;
        }
    }
    Ok(out)
}

/// Rounds a row-major `f64` matrix to `f32`.
pub fn to_f32(a: &[f64]) -> Vec<f32> {
    a.iter().map(|&x| x as f32).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn eigh_reconstructs_and_sorts_descending() {
        let a = [4.0f32, 1.0, 0.5, 1.0, 3.0, 0.2, 0.5, 0.2, 1.0];
        let (vals, q) = eigh_desc(&a, 3).unwrap();
        assert!(vals[0] >= vals[1] && vals[1] >= vals[2]);
        for i in 0..3 {
            for j in 0..3 {
                let r: f64 = (0..3).map(|k| q[i * 3 + k] * vals[k] * q[j * 3 + k]).sum();
                assert!((r - f64::from(a[i * 3 + j])).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn qr_q_is_orthogonal_and_spans_columns() {
        let a = [2.0f64, 1.0, 0.0, 1.0, 3.0, 1.0, 0.0, 1.0, 4.0];
        let q = qr_q(&a, 3).unwrap();
        for i in 0..3 {
            for j in 0..3 {
                let d: f64 = (0..3).map(|k| q[k * 3 + i] * q[k * 3 + j]).sum();
                assert!((d - if i == j { 1.0 } else { 0.0 }).abs() < 1e-12);
            }
        }
        // The first column of Q is the normalised first column of A (up to sign).
        let n = (5.0f64).sqrt();
        assert!((q[0].abs() - 2.0 / n).abs() < 1e-12 && (q[3].abs() - 1.0 / n).abs() < 1e-12);
    }

    #[test]
    fn inverse_fourth_root_of_diagonal() {
        let a = [16.0f32, 0.0, 0.0, 81.0];
        let r = inverse_root(&a, 2, 4.0, 0.0).unwrap();
        assert!((r[0] - 0.5).abs() < 1e-7 && (r[3] - 1.0 / 3.0).abs() < 1e-7);
        assert!(r[1].abs() < 1e-7);
    }
}
