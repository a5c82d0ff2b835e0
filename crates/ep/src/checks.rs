//! Argument checks that every buffer makes the same way, with the same words.

use crate::dtype::Element;
use crate::error::{invalid, EpError};
use crate::tensor::Tensor;

/// `t` must be on GPU `ordinal`, the one this rank uses.
pub(crate) fn on_gpu<T: Element>(
    rank: usize,
    ordinal: usize,
    t: &Tensor<T>,
    name: &str,
) -> Result<(), EpError> {
    if t.device_ordinal() != ordinal {
        return Err(invalid(
            rank,
            format!(
                "{name} is on GPU {}, this rank uses GPU {}",
                t.device_ordinal(),
                ordinal
            ),
        ));
    }
    Ok(())
}

/// `t` must be on GPU `ordinal` and have the shape `want`.
pub(crate) fn shape_is<T: Element>(
    rank: usize,
    ordinal: usize,
    t: &Tensor<T>,
    want: &[usize],
    name: &str,
) -> Result<(), EpError> {
    on_gpu(rank, ordinal, t, name)?;
    if t.shape() != want {
        return Err(invalid(
            rank,
            format!(
                "{name} ({}) has shape {:?}, expected {want:?}",
                T::NAME,
                t.shape()
            ),
        ));
    }
    Ok(())
}
