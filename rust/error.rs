//! The one error type of the CPU core. Every variant names the tensor index it is about;
//! the pyo3 glue maps each to a specific Python exception.

use std::fmt;

#[derive(Clone, Debug, PartialEq)]
pub enum Error {
    /// A dtype code the core does not know (the Python layer sends 0..=3).
    UnknownDType { index: usize, code: u8 },
    /// A tensor address that is not a multiple of its element size.
    Misaligned { index: usize, addr: usize, align: usize },
    /// A null address for a tensor with elements.
    NullData { index: usize },
    /// Two parallel lists (addresses, sizes, dtypes, or dst/src) of different lengths.
    LengthMismatch { what: &'static str, left: usize, right: usize },
    /// `dst[index]` and `src[index]` have different numbers of elements.
    NumelMismatch { index: usize, dst: usize, src: usize },
    /// An inf, -inf or negative-order norm of an empty tensor (torch has no identity for it).
    EmptyNorm { index: usize, p: f64 },
    /// The memory of two tensors, each named by its list and index, overlaps and at least one is written.
    Overlap { first: (String, usize), second: (String, usize) },
    /// A norm order that is NaN.
    BadNormType { p: f64 },
    /// Arguments the bucket planner cannot lay out (see `bucket::plan`).
    BucketPlan { reason: String },
    /// A tensor of `len` elements cannot be split into `units` equal units (`unitwise`).
    Units { index: usize, len: usize, units: usize },
}

/// Formats a norm order as C++'s ostream does (torch's messages use that): 2, -1, 0.5, inf.
pub fn format_order(p: f64) -> String {
    if p.is_infinite() {
        return if p > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if p == p.trunc() && p.abs() < 1e15 {
        return format!("{}", p as i64);
    }
    format!("{p}")
}

impl Error {
    /// The message, naming tensors as `list[index]` (`list` for the first or only list of the
    /// call, `other` for the second one: `src` of accumulate).
    pub fn message(&self, list: &str, other: &str) -> String {
        match self {
            Error::UnknownDType { index, code } => {
                format!("{list}[{index}] has an unsupported dtype code {code}")
            }
            Error::Misaligned { index, addr, align } => format!(
                "{list}[{index}] starts at address {addr:#x}, which is not aligned to its element size {align}"
            ),
            Error::NullData { index } => format!("{list}[{index}] has elements but a null data pointer"),
            Error::LengthMismatch { what, left, right } => {
                format!("{what}: {list} has {left} tensors but {other} has {right}")
            }
            Error::NumelMismatch { index, dst, src } => {
                format!("{list}[{index}] has {dst} elements but {other}[{index}] has {src}")
            }
            Error::EmptyNorm { index, p } => format!(
                "linalg.vector_norm cannot compute the {} norm on an empty tensor because the operation does not have an identity ({list}[{index}] is empty)",
                format_order(*p)
            ),
            Error::Overlap { first, second } => format!(
                "{}[{}] and {}[{}] overlap in memory; in-place targets must not overlap each other or their inputs",
                first.0, first.1, second.0, second.1
            ),
            Error::BadNormType { p } => format!("norm_type must be a real number, got {p}"),
            Error::BucketPlan { reason } => format!("bucket plan: {reason}"),
            Error::Units { index, len, units } => {
                format!("{list}[{index}] has {len} elements, which cannot be split into {units} equal units")
            }
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message("tensors", "src"))
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_print_like_cpp() {
        assert_eq!(format_order(2.0), "2");
        assert_eq!(format_order(-1.0), "-1");
        assert_eq!(format_order(0.5), "0.5");
        assert_eq!(format_order(f64::INFINITY), "inf");
        assert_eq!(format_order(f64::NEG_INFINITY), "-inf");
    }

    #[test]
    fn messages_name_the_index() {
        let m = Error::NumelMismatch { index: 3, dst: 4, src: 5 }.message("dst", "src");
        assert!(m.contains("dst[3] has 4") && m.contains("src[3] has 5"), "{m}");
        let m = Error::Overlap { first: ("grads".into(), 1), second: ("grads".into(), 7) }.to_string();
        assert!(m.contains("grads[1]") && m.contains("grads[7]"), "{m}");
        let m = Error::EmptyNorm { index: 2, p: f64::INFINITY }.message("grads", "");
        assert!(m.starts_with("linalg.vector_norm cannot compute the inf norm on an empty tensor"), "{m}");
    }
}
