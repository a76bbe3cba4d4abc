//! The canonical parameter values: named `f32` buffers in a fixed order.
//!
//! The optimizer, checkpoints and the data-parallel all-reduce all work on this store; the
//! burn module is rebuilt from it (see [`crate::model::Gpt::build`]). Keeping one flat buffer
//! makes the all-reduce a single call and a checkpoint a single copy.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;

use crate::model::{Init, ParamSpec};
use crate::rng::Rng;

/// Named parameter tensors stored back to back in one `f32` buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamStore {
    names: Vec<String>,
    shapes: Vec<Vec<usize>>,
    offsets: Vec<usize>,
    values: Vec<f32>,
}

impl ParamStore {
    /// Allocates the parameters of `specs` and initialises them from `rng`, in order.
    pub fn init(specs: &[ParamSpec], rng: &mut Rng) -> Self {
        let mut store = Self::zeros(specs);
        for (i, spec) in specs.iter().enumerate() {
            let range = store.range(i);
            for x in &mut store.values[range] {
                *x = match spec.init {
                    Init::Normal(std) => (rng.normal() * std) as f32,
                    Init::Const(c) => c,
                };
            }
        }
        store
    }

    /// The parameters of `specs`, all zero (a gradient buffer of the same layout).
    pub fn zeros(specs: &[ParamSpec]) -> Self {
        let mut offsets = Vec::with_capacity(specs.len() + 1);
        let mut total = 0;
        for s in specs {
            offsets.push(total);
            total += s.shape.iter().product::<usize>();
        }
        offsets.push(total);
        Self {
            names: specs.iter().map(|s| s.name.clone()).collect(),
            shapes: specs.iter().map(|s| s.shape.clone()).collect(),
            offsets,
            values: vec![0.0; total],
        }
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Total number of scalars.
    pub fn numel(&self) -> usize {
        self.values.len()
    }

    pub fn name(&self, i: usize) -> &str {
        &self.names[i]
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn shape(&self, i: usize) -> &[usize] {
        &self.shapes[i]
    }

    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| n == name)
    }

    pub fn range(&self, i: usize) -> std::ops::Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
    }

    pub fn values(&self, i: usize) -> &[f32] {
        &self.values[self.range(i)]
    }

    pub fn values_mut(&mut self, i: usize) -> &mut [f32] {
        let r = self.range(i);
        &mut self.values[r]
    }

    /// All scalars in store order.
    pub fn flat(&self) -> &[f32] {
        &self.values
    }

    pub fn flat_mut(&mut self) -> &mut [f32] {
        &mut self.values
    }

    /// Whether `other` has the same names and shapes in the same order.
    pub fn same_layout(&self, other: &Self) -> bool {
        self.names == other.names && self.shapes == other.shapes
    }
}

/// Walks an autodiff module and copies out every parameter's gradient, keyed by module path.
struct GradCollector<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    path: Vec<String>,
    found: BTreeMap<String, Vec<f32>>,
    error: Option<String>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradCollector<'_, B> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_owned());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let name = self.path.join(".");
        if let Some(grad) = param.val().grad(self.grads) {
            match grad
                .try_into_data()
                .map(|d| d.convert::<f32>().into_vec::<f32>())
            {
                Ok(Ok(v)) => {
                    self.found.insert(name, v);
                }
                Ok(Err(e)) => self.error = Some(format!("gradient of `{name}`: {e:?}")),
                Err(e) => self.error = Some(format!("gradient of `{name}`: {e:?}")),
            }
        }
    }
}

/// Copies the gradients of `module`'s parameters into `out` (same layout as the store the
/// module was built from). A parameter with no gradient (unused by the loss) gets zeros.
pub fn collect_grads<B: AutodiffBackend, M: Module<B>>(
    module: &M,
    grads: &B::Gradients,
    out: &mut ParamStore,
) -> Result<(), String> {
    let mut c = GradCollector::<B> {
        grads,
        path: Vec::new(),
        found: BTreeMap::new(),
        error: None,
    };
    module.visit(&mut c);
    if let Some(e) = c.error {
        return Err(e);
    }
    for i in 0..out.len() {
        let name = out.name(i).to_owned();
        let dst = out.values_mut(i);
        match c.found.remove(&name) {
            Some(g) if g.len() == dst.len() => dst.copy_from_slice(&g),
            Some(g) => {
                return Err(format!(
                    "gradient of `{name}` has {} elements, the parameter {}",
                    g.len(),
                    dst.len()
                ))
            }
            None => dst.fill(0.0),
        }
    }
    if let Some(name) = c.found.keys().next() {
        return Err(format!("module parameter `{name}` is not in the store"));
    }
    Ok(())
}

impl ParamStore {
    /// Hands the store's values with `grads` (same layout) to `f` as optimizer parameters.
    pub fn with_optim_params<R>(
        &mut self,
        grads: &ParamStore,
        f: impl FnOnce(&mut [orrery_optim::Param<'_>]) -> R,
    ) -> R {
        let mut params = Vec::with_capacity(self.names.len());
        let mut rest: &mut [f32] = &mut self.values;
        for (i, (name, shape)) in self.names.iter().zip(&self.shapes).enumerate() {
            let n = self.offsets[i + 1] - self.offsets[i];
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
            rest = tail;
            params.push(orrery_optim::Param {
                name,
                shape,
                value: head,
                grad: &grads.values[grads.offsets[i]..grads.offsets[i + 1]],
            });
        }
        f(&mut params)
    }
}
