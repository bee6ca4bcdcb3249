//! gradfuse's CPU core: multi-tensor norms, clipping, AMP unscale-and-check, accumulation
//! and clamping over lists of f32/f64/f16/bf16 tensors, multithreaded (on torch's OpenMP team
//! when the Python layer hands it over, else rayon; see `parallel`) and deterministic (fixed
//! segments, partials combined in a fixed order); and the planner that lays a model's
//! gradients out in a few flat buckets (`bucket`).
//!
//! Everything here is plain Rust over slices and is tested with `cargo test`; the pyo3 glue
//! that turns tensor addresses into those slices lives in `python.rs`, behind the `python`
//! feature that maturin enables.

pub mod bucket;
pub mod dtype;
pub mod elementwise;
pub mod error;
pub mod norm;
pub mod parallel;
pub mod prefetch;
pub mod simd;
pub mod stats;
pub mod tensor;
pub mod unitwise;

#[cfg(feature = "python")]
mod python;
