//! Unit-wise norms and scaling, for adaptive gradient clipping (AGC, NFNets): a tensor is split
//! into `units` consecutive, equal units (its output rows: the first dimension of a Linear or
//! Conv weight; the whole tensor for a bias), each with a norm and a factor of its own.
//!
//! Two passes over a whole model, whatever its number of tensors: [`unit_norms`] reads every
//! weight and gradient once (all units of all tensors in one parallel loop, each unit's norm as
//! [`norm::norm`] gives it), and [`scale_units`] writes each gradient unit once, times its factor
//! (a unit whose factor is exactly 1 is not touched).

use crate::elementwise::scale_typed;
use crate::error::{Error, Result};
use crate::norm;
use crate::parallel;
use crate::tensor::{Slice, SliceMut};
use crate::with_slice;

/// The length of each of the `units` units of a tensor of `len` elements.
fn unit_len(index: usize, len: usize, units: usize) -> Result<usize> {
    if units == 0 {
        return if len == 0 { Ok(0) } else { Err(Error::Units { index, len, units }) };
    }
    if len % units != 0 {
        return Err(Error::Units { index, len, units });
    }
    Ok(len / units)
}

fn split<'a>(index: usize, t: Slice<'a>, units: usize, out: &mut Vec<Slice<'a>>) -> Result<()> {
    let n = unit_len(index, t.len(), units)?;
    if n == 0 {
        out.extend(std::iter::repeat_n(t, units)); // empty units (t is empty too)
        return Ok(());
    }
    match t {
        Slice::F32(s) => out.extend(s.chunks(n).map(Slice::F32)),
        Slice::F64(s) => out.extend(s.chunks(n).map(Slice::F64)),
        Slice::F16(s) => out.extend(s.chunks(n).map(Slice::F16)),
        Slice::BF16(s) => out.extend(s.chunks(n).map(Slice::BF16)),
    }
    Ok(())
}

/// The `p`-norm of every unit of every tensor, tensor by tensor, unit by unit.
pub fn unit_norms(tensors: &[Slice<'_>], units: &[usize], p: f64) -> Result<Vec<f64>> {
    if tensors.len() != units.len() {
        return Err(Error::LengthMismatch { what: "unit counts", left: tensors.len(), right: units.len() });
    }
    let mut rows = Vec::new();
    for (i, (&t, &u)) in tensors.iter().zip(units).enumerate() {
        split(i, t, u, &mut rows)?;
    }
    Ok(norm::norm(&rows, p)?.per_tensor)
}

/// `x *= factors[k]` for every element of unit `k` (units numbered as by [`unit_norms`]).
pub fn scale_units(tensors: Vec<SliceMut<'_>>, units: &[usize], factors: &[f64]) -> Result<()> {
    if tensors.len() != units.len() {
        return Err(Error::LengthMismatch { what: "unit counts", left: tensors.len(), right: units.len() });
    }
    let total: usize = units.iter().sum();
    if factors.len() != total {
        return Err(Error::LengthMismatch { what: "unit factors", left: total, right: factors.len() });
    }
    let mut rows: Vec<(SliceMut<'_>, f64)> = Vec::with_capacity(total);
    let mut k = 0;
    for (i, (t, &u)) in tensors.into_iter().zip(units).enumerate() {
        let n = unit_len(i, t.len(), u)?;
        if n == 0 {
            k += u;
            continue;
        }
        let before = rows.len();
        match t {
            SliceMut::F32(s) => rows.extend(s.chunks_mut(n).map(|r| (SliceMut::F32(r), 0.0))),
            SliceMut::F64(s) => rows.extend(s.chunks_mut(n).map(|r| (SliceMut::F64(r), 0.0))),
            SliceMut::F16(s) => rows.extend(s.chunks_mut(n).map(|r| (SliceMut::F16(r), 0.0))),
            SliceMut::BF16(s) => rows.extend(s.chunks_mut(n).map(|r| (SliceMut::BF16(r), 0.0))),
        }
        for (row, &f) in rows[before..].iter_mut().zip(&factors[k..k + u]) {
            row.1 = f;
        }
        k += u;
    }
    rows.retain(|&(_, f)| f != 1.0); // x * 1 == x bit for bit: nothing to write
    parallel::map(rows, |(r, _)| r.len(), |(r, f)| with_slice!(SliceMut, r, |x| scale_typed(x, f)));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_several_tensors_in_order() {
        let w = [3.0f32, 4.0, 0.0, 1.0, 6.0, 8.0];
        let b = [2.0f64, -2.0];
        let n = unit_norms(&[Slice::F32(&w), Slice::F64(&b)], &[3, 1], 2.0).unwrap();
        assert_eq!(n, vec![5.0, 1.0, 10.0, 8f64.sqrt()]);
        let mut g = w;
        let mut c = b;
        scale_units(vec![SliceMut::F32(&mut g), SliceMut::F64(&mut c)], &[3, 1], &[0.5, 1.0, 2.0, -1.0]).unwrap();
        assert_eq!(g, [1.5, 2.0, 0.0, 1.0, 12.0, 16.0]);
        assert_eq!(c, [-2.0, 2.0]);
    }

    #[test]
    fn units_must_divide_the_tensor() {
        let w = [1.0f32; 6];
        assert_eq!(unit_norms(&[Slice::F32(&w)], &[4], 2.0), Err(Error::Units { index: 0, len: 6, units: 4 }));
        let e: [f32; 0] = [];
        assert_eq!(unit_norms(&[Slice::F32(&e)], &[3], 2.0).unwrap(), vec![0.0; 3]);
        assert!(scale_units(vec![SliceMut::F32(&mut [1.0; 4])], &[2], &[1.0]).is_err());
    }
}
