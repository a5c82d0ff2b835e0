//! Device memory handed to Python: `__cuda_array_interface__` views that keep their storage.

use std::any::Any;

use ep::{Element, Tensor};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// A read-write view of device memory owned by the native side (a pooled output region, the
/// zero-copy combine buffer): `torch.as_tensor(view, device="cuda")` makes a tensor over it with
/// no copy. The view keeps its storage reserved for as long as it (or a tensor made from it)
/// lives. `typestr` is the array-interface element type; BF16 is exposed as `<i2` and FP8 as
/// `|u1` (the array interface has no names for them) and re-typed by the Python layer with
/// `Tensor.view(dtype)`.
#[pyclass(module = "ep_ibgda._ep", frozen)]
pub struct DeviceView {
    /// Device address of the first element.
    #[pyo3(get)]
    ptr: u64,
    /// Row-major shape.
    #[pyo3(get)]
    shape: Vec<usize>,
    /// Array-interface element type.
    #[pyo3(get)]
    typestr: &'static str,
    /// The ep element type's name (`bf16`, `fp8_e4m3`, `f32`, `i32`, `i64`, `u8`).
    #[pyo3(get)]
    dtype: &'static str,
    _keep: Box<dyn Any + Send + Sync>,
}

impl DeviceView {
    /// A view of `t` (kept alive by the view).
    pub fn of<T: Element>(t: &Tensor<T>) -> Self {
        let typestr = match T::NAME {
            "bf16" => "<i2",
            "f32" => "<f4",
            "i32" => "<i4",
            "i64" => "<i8",
            _ => "|u1",
        };
        Self {
            ptr: t.device_address(),
            shape: t.shape().to_vec(),
            typestr,
            dtype: T::NAME,
            _keep: Box::new(t.clone()),
        }
    }

    /// [`of`](Self::of), as a Python object.
    pub fn py<T: Element>(py: Python<'_>, t: &Tensor<T>) -> PyResult<Py<DeviceView>> {
        Py::new(py, Self::of(t))
    }
}

#[pymethods]
impl DeviceView {
    /// The CUDA array interface (version 3, without the optional `stream` key: the Python layer
    /// orders every use on its streams).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", pyo3::types::PyTuple::new(py, &self.shape)?)?;
        d.set_item("typestr", self.typestr)?;
        // A zero-size array may carry any address; keep the real one (never dereferenced).
        d.set_item("data", (self.ptr, false))?;
        d.set_item("version", 3)?;
        d.set_item("strides", py.None())?;
        Ok(d)
    }

    /// Bytes viewed.
    #[getter]
    fn nbytes(&self) -> usize {
        let elem = match self.typestr {
            "<i2" => 2,
            "<f4" | "<i4" => 4,
            _ => 1,
        };
        self.shape.iter().product::<usize>() * elem
    }

    fn __repr__(&self) -> String {
        format!(
            "DeviceView(ptr={:#x}, shape={:?}, dtype={})",
            self.ptr, self.shape, self.dtype
        )
    }
}

/// A borrowed input tensor of `shape` at device address `ptr`, on `ctx`'s GPU.
///
/// # Safety
///
/// As [`Tensor::from_device_ptr`]: `ptr` addresses `shape.product() * size_of::<T>()` bytes of
/// live device memory on `ctx`'s GPU that outlive every use of the tensor, the GPU work queued
/// with it included.
pub(crate) unsafe fn input<T: Element>(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    ptr: u64,
    shape: &[usize],
) -> Tensor<T> {
    // SAFETY: forwarded to our caller (see above).
    unsafe { Tensor::from_device_ptr(ctx, ptr, shape) }
}
