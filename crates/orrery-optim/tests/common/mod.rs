//! An independent `f64` reference for the tests: plain loops, a cyclic Jacobi eigensolver and
//! modified Gram–Schmidt QR, written from the published algorithms and sharing no code with the
//! crate.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::needless_range_loop,
    clippy::type_complexity
)]

pub mod lockstep;

/// Parameters named and shaped by `shapes`, with values `xs` and gradients `gs` (in order).
pub fn shaped_params<'a>(
    shapes: &'a [(&'a str, &'a [usize])],
    xs: &'a mut [Vec<f32>],
    gs: &'a [Vec<f32>],
) -> Vec<orrery_optim::Param<'a>> {
    shapes
        .iter()
        .zip(xs.iter_mut())
        .zip(gs)
        .map(|(((name, shape), x), g)| orrery_optim::Param {
            name,
            shape,
            value: x,
            grad: g,
        })
        .collect()
}

/// One step of `opt` on a single parameter `w` of `shape`.
pub fn step_one<O: orrery_optim::Optimizer + ?Sized>(
    opt: &mut O,
    lr: f32,
    shape: &[usize],
    value: &mut [f32],
    grad: &[f32],
) {
    opt.step(
        lr,
        &mut [orrery_optim::Param {
            name: "w",
            shape,
            value,
            grad,
        }],
    )
    .unwrap();
}

pub type M = Vec<f64>;

pub fn matmul(a: &[f64], b: &[f64], m: usize, k: usize, n: usize) -> M {
    let mut o = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut s = 0.0;
            for p in 0..k {
                s += a[i * k + p] * b[p * n + j];
            }
            o[i * n + j] = s;
        }
    }
    o
}

pub fn transpose(a: &[f64], m: usize, n: usize) -> M {
    let mut o = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            o[j * m + i] = a[i * n + j];
        }
    }
    o
}

/// Eigenvalues (descending) and eigenvectors (columns) of a symmetric matrix by cyclic Jacobi.
pub fn jacobi_eigh(a0: &[f64], n: usize) -> (Vec<f64>, M) {
    let mut a = a0.to_vec();
    let mut v = vec![0.0; n * n];
    for i in 0..n {
        v[i * n + i] = 1.0;
    }
    let scale: f64 = a.iter().map(|x| x * x).sum::<f64>().max(1e-300);
    for _ in 0..200 {
        let off: f64 = (0..n)
            .flat_map(|p| (0..n).map(move |q| (p, q)))
            .filter(|(p, q)| p != q)
            .map(|(p, q)| a[p * n + q].powi(2))
            .sum();
        if off <= 1e-32 * scale {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq == 0.0 {
                    continue;
                }
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (x, y) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * x - s * y;
                    a[k * n + q] = s * x + c * y;
                }
                for k in 0..n {
                    let (x, y) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * x - s * y;
                    a[q * n + k] = s * x + c * y;
                }
                for k in 0..n {
                    let (x, y) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * x - s * y;
                    v[k * n + q] = s * x + c * y;
                }
            }
        }
    }
    let vals: Vec<f64> = (0..n).map(|i| a[i * n + i]).collect();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| vals[j].partial_cmp(&vals[i]).unwrap());
    let mut vecs = vec![0.0; n * n];
    for (c, &src) in order.iter().enumerate() {
        for r in 0..n {
            vecs[r * n + c] = v[r * n + src];
        }
    }
    // Self-check: A V = V diag(λ).
    let av = matmul(a0, &vecs, n, n, n);
    for r in 0..n {
        for c in 0..n {
            let want = vecs[r * n + c] * vals[order[c]];
            assert!(
                (av[r * n + c] - want).abs() <= 1e-9 * scale.sqrt().max(1.0),
                "jacobi failed"
            );
        }
    }
    (order.iter().map(|&i| vals[i]).collect(), vecs)
}

/// Q of a QR decomposition by modified Gram–Schmidt (full-rank square input).
pub fn gram_schmidt_q(a: &[f64], n: usize) -> M {
    let mut q = a.to_vec();
    for j in 0..n {
        for k in 0..j {
            let d: f64 = (0..n).map(|i| q[i * n + k] * q[i * n + j]).sum();
            for i in 0..n {
                q[i * n + j] -= d * q[i * n + k];
            }
        }
        let norm: f64 = (0..n).map(|i| q[i * n + j].powi(2)).sum::<f64>().sqrt();
        assert!(
            norm > 1e-12,
            "rank-deficient power iterate in the reference"
        );
        for i in 0..n {
            q[i * n + j] /= norm;
        }
    }
    q
}

/// The published SOAP step, written literally after the reference implementation (including
/// its back-and-forth projection of the first moment on every step), in `f64`.
pub struct RefSoap {
    pub rows: usize,
    pub cols: usize,
    pub b1: f64,
    pub b2: f64,
    pub sb: f64,
    pub eps: f64,
    pub wd: f64,
    pub freq: u64,
    pub l: Option<M>,
    pub r: Option<M>,
    pub ql: Option<M>,
    pub qr: Option<M>,
    pub m: M,
    pub v: M,
    pub step: u64,
    pub started: bool,
}

impl RefSoap {
    pub fn new(
        rows: usize,
        cols: usize,
        max_dim: usize,
        betas: (f64, f64),
        eps: f64,
        wd: f64,
        freq: u64,
    ) -> Self {
        let n = rows * cols;
        Self {
            rows,
            cols,
            b1: betas.0,
            b2: betas.1,
            sb: betas.1,
            eps,
            wd,
            freq,
            l: (rows <= max_dim).then(|| vec![0.0; rows * rows]),
            r: (cols <= max_dim).then(|| vec![0.0; cols * cols]),
            ql: None,
            qr: None,
            m: vec![0.0; n],
            v: vec![0.0; n],
            step: 0,
            // Deliberate deviation documented in the crate: with no rotated side there is no
            // projection to protect, so the first call already takes an Adam step.
            started: rows > max_dim && cols > max_dim,
        }
    }

    pub fn project(&self, g: &[f64]) -> M {
        let (m, n) = (self.rows, self.cols);
        let mut x = g.to_vec();
        if let Some(q) = &self.ql {
            x = matmul(&transpose(q, m, m), &x, m, m, n);
        }
        if let Some(q) = &self.qr {
            x = matmul(&x, q, m, n, n);
        }
        x
    }

    pub fn project_back(&self, g: &[f64]) -> M {
        let (m, n) = (self.rows, self.cols);
        let mut x = g.to_vec();
        if let Some(q) = &self.ql {
            x = matmul(q, &x, m, m, n);
        }
        if let Some(q) = &self.qr {
            x = matmul(&x, &transpose(q, n, n), m, n, n);
        }
        x
    }

    pub fn step(&mut self, lr: f64, x: &mut [f64], g: &[f64]) {
        if !self.started {
            self.update_preconditioner(g);
            self.started = true;
            return;
        }
        let gp = self.project(g);
        self.step += 1;
        for i in 0..gp.len() {
            self.m[i] = self.b1 * self.m[i] + (1.0 - self.b1) * gp[i];
            self.v[i] = self.b2 * self.v[i] + (1.0 - self.b2) * gp[i] * gp[i];
        }
        let t = self.step as i32;
        let step_size = lr * (1.0 - self.b2.powi(t)).sqrt() / (1.0 - self.b1.powi(t));
        let d: M = self
            .m
            .iter()
            .zip(&self.v)
            .map(|(m, v)| m / (v.sqrt() + self.eps))
            .collect();
        let d = self.project_back(&d);
        for (xi, di) in x.iter_mut().zip(&d) {
            *xi -= step_size * di;
            *xi -= lr * self.wd * *xi;
        }
        self.update_preconditioner(g);
    }

    fn update_preconditioner(&mut self, g: &[f64]) {
        let (m, n) = (self.rows, self.cols);
        if self.started {
            self.m = self.project_back(&self.m.clone());
        }
        let sb = self.sb;
        if let Some(l) = &mut self.l {
            let ggt = matmul(g, &transpose(g, m, n), m, n, m);
            for (a, b) in l.iter_mut().zip(&ggt) {
                *a = sb * *a + (1.0 - sb) * b;
            }
        }
        if let Some(r) = &mut self.r {
            let gtg = matmul(&transpose(g, m, n), g, n, m, n);
            for (a, b) in r.iter_mut().zip(&gtg) {
                *a = sb * *a + (1.0 - sb) * b;
            }
        }
        if !self.started {
            self.ql = self.l.as_ref().map(|l| jacobi_eigh(l, m).1);
            self.qr = self.r.as_ref().map(|r| jacobi_eigh(r, n).1);
        }
        if self.step > 0 && self.step.is_multiple_of(self.freq) {
            if let (Some(l), Some(q)) = (&self.l, &self.ql) {
                let (perm, newq) = power_qr(l, q, m);
                let old = self.v.clone();
                for (i, &src) in perm.iter().enumerate() {
                    for j in 0..n {
                        self.v[i * n + j] = old[src * n + j];
                    }
                }
                self.ql = Some(newq);
            }
            if let (Some(r), Some(q)) = (&self.r, &self.qr) {
                let (perm, newq) = power_qr(r, q, n);
                let old = self.v.clone();
                for i in 0..m {
                    for (j, &src) in perm.iter().enumerate() {
                        self.v[i * n + j] = old[i * n + src];
                    }
                }
                self.qr = Some(newq);
            }
        }
        if self.started {
            self.m = self.project(&self.m.clone());
        }
    }
}

fn power_qr(s: &[f64], q: &[f64], n: usize) -> (Vec<usize>, M) {
    let sq = matmul(s, q, n, n, n);
    let qt = transpose(q, n, n);
    let est = matmul(&qt, &sq, n, n, n);
    let mut perm: Vec<usize> = (0..n).collect();
    perm.sort_by(|&a, &b| est[b * n + b].partial_cmp(&est[a * n + a]).unwrap());
    let mut qs = vec![0.0; n * n];
    for i in 0..n {
        for (c, &src) in perm.iter().enumerate() {
            qs[i * n + c] = q[i * n + src];
        }
    }
    let power = matmul(s, &qs, n, n, n);
    (perm, gram_schmidt_q(&power, n))
}

/// A deterministic pseudo-random sequence in [-1, 1) (SplitMix64), so tests need no RNG crate.
pub fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f64 / (1u64 << 23) as f64 - 1.0) as f32
        })
        .collect()
}

/// `(A + eps I)^(-1/4)` of a PSD matrix, eigenvalues clamped at zero, via Jacobi.
pub fn inv_fourth_root(a: &[f64], n: usize, eps: f64) -> M {
    let (vals, v) = jacobi_eigh(a, n);
    let mut o = vec![0.0; n * n];
    for i in 0..n {
        for j in 0..n {
            o[i * n + j] = (0..n)
                .map(|k| v[i * n + k] * (vals[k].max(0.0) + eps).powf(-0.25) * v[j * n + k])
                .sum();
        }
    }
    o
}

/// Blocked Shampoo with Adam grafting, literally, in `f64`.
pub struct RefShampoo {
    pub rows: usize,
    pub cols: usize,
    pub bdim: usize,
    pub beta1: f64,
    pub sbeta: f64,
    pub eps: f64,
    pub wd: f64,
    pub freq: u64,
    pub gb2: f64,
    pub geps: f64,
    pub t: u64,
    pub m: M,
    pub v: M,
    /// (r0, rn, c0, cn, L, R, PL, PR)
    pub blocks: Vec<(usize, usize, usize, usize, M, M, M, M)>,
}

impl RefShampoo {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        rows: usize,
        cols: usize,
        bdim: usize,
        beta1: f64,
        sbeta: f64,
        eps: f64,
        wd: f64,
        freq: u64,
    ) -> Self {
        let mut blocks = Vec::new();
        let mut r0 = 0;
        while r0 < rows {
            let rn = bdim.min(rows - r0);
            let mut c0 = 0;
            while c0 < cols {
                let cn = bdim.min(cols - c0);
                blocks.push((
                    r0,
                    rn,
                    c0,
                    cn,
                    vec![0.0; rn * rn],
                    vec![0.0; cn * cn],
                    vec![],
                    vec![],
                ));
                c0 += cn;
            }
            r0 += rn;
        }
        Self {
            rows,
            cols,
            bdim,
            beta1,
            sbeta,
            eps,
            wd,
            freq,
            gb2: 0.999,
            geps: 1e-8,
            t: 0,
            m: vec![0.0; rows * cols],
            v: vec![0.0; rows * cols],
            blocks,
        }
    }

    pub fn step(&mut self, lr: f64, x: &mut [f64], g: &[f64]) {
        self.t += 1;
        let t = self.t as i32;
        let n = g.len();
        let mut mhat = vec![0.0; n];
        let mut a = vec![0.0; n];
        for i in 0..n {
            self.m[i] = self.beta1 * self.m[i] + (1.0 - self.beta1) * g[i];
            self.v[i] = self.gb2 * self.v[i] + (1.0 - self.gb2) * g[i] * g[i];
            mhat[i] = self.m[i] / (1.0 - self.beta1.powi(t));
            a[i] = mhat[i] / ((self.v[i] / (1.0 - self.gb2.powi(t))).sqrt() + self.geps);
        }
        let mut d = a.clone();
        let cols = self.cols;
        let refresh = (self.t - 1).is_multiple_of(self.freq);
        for (r0, rn, c0, cn, l, r, pl, pr) in &mut self.blocks {
            let (r0, rn, c0, cn) = (*r0, *rn, *c0, *cn);
            let blk = |src: &[f64]| -> M {
                let mut o = vec![];
                for i in r0..r0 + rn {
                    o.extend_from_slice(&src[i * cols + c0..i * cols + c0 + cn]);
                }
                o
            };
            let gb = blk(g);
            let ggt = matmul(&gb, &transpose(&gb, rn, cn), rn, cn, rn);
            let gtg = matmul(&transpose(&gb, rn, cn), &gb, cn, rn, cn);
            let (wa, wb) = if self.sbeta == 1.0 {
                (1.0, 1.0)
            } else {
                (self.sbeta, 1.0 - self.sbeta)
            };
            for (p, q) in l.iter_mut().zip(&ggt) {
                *p = wa * *p + wb * q;
            }
            for (p, q) in r.iter_mut().zip(&gtg) {
                *p = wa * *p + wb * q;
            }
            if refresh {
                *pl = inv_fourth_root(l, rn, self.eps);
                *pr = inv_fourth_root(r, cn, self.eps);
            }
            let s = matmul(&matmul(pl, &blk(&mhat), rn, rn, cn), pr, rn, cn, cn);
            let ab = blk(&a);
            let ns = s.iter().map(|x| x * x).sum::<f64>().sqrt();
            let na = ab.iter().map(|x| x * x).sum::<f64>().sqrt();
            for (k, i) in (r0..r0 + rn).enumerate() {
                for j in 0..cn {
                    d[i * cols + c0 + j] = s[k * cn + j] * na / ns;
                }
            }
        }
        for (xi, di) in x.iter_mut().zip(&d) {
            *xi = *xi * (1.0 - lr * self.wd) - lr * di;
        }
    }
}
