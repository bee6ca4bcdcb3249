//! The bucket planner: where each parameter's gradient lives in a few flat buffers.
//!
//! `GradBuckets` (Python) lays the gradients of a model out in contiguous buffers, one per
//! bucket, so that every fused op and every collective runs on a handful of tensors whatever
//! the number of parameters. This module decides the layout, once, from the parameters' sizes,
//! dtypes and order; the Python side only allocates what the plan says.
//!
//! The rules, DDP's and Megatron's (`reducer.cpp`'s `compute_bucket_assignment_by_size`,
//! `ParamAndGradBuffer`):
//! - parameters are taken in the order given (reverse registration order at first, the order in
//!   which backward produced their gradients after a rebuild), so the first bucket fills with
//!   the gradients backward produces first and its communication can start early;
//! - one dtype per bucket: each dtype has its own open bucket;
//! - every gradient starts at an offset aligned to `align_bytes` (at least 64: a cache line,
//!   and 16-byte vector loads for the Triton kernels);
//! - a bucket's padded size stays within its cap (`first_cap_bytes` for a dtype's first bucket,
//!   so that communication starts early, `cap_bytes` after), except that a parameter larger
//!   than the cap gets a bucket of its own;
//! - each bucket is padded to a multiple of `world_size * align` elements, so that it splits
//!   into `world_size` equal, aligned shards (reduce-scatter);
//! - buckets are ordered by their first parameter's position in the order, which is the
//!   order in which they become ready in backward.
//!
//! The plan is a pure function of its inputs: every rank of a process group computes the same.

use crate::dtype::DType;
use crate::error::{Error, Result};

/// The least alignment of a gradient's offset, in bytes.
pub const MIN_ALIGN_BYTES: usize = 64;

/// Layout options; sizes in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// Cap of every bucket but a dtype's first.
    pub cap_bytes: usize,
    /// Cap of each dtype's first bucket (DDP: 1 MiB with a process group); `cap_bytes` for none.
    pub first_cap_bytes: usize,
    /// Alignment of every gradient's offset: a power of two, at least [`MIN_ALIGN_BYTES`].
    pub align_bytes: usize,
    /// Ranks a bucket must split evenly across (1 without a process group).
    pub world_size: usize,
}

/// One flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub dtype: DType,
    /// Elements, padding included: a multiple of `world_size * align / dtype.size()`.
    pub numel: usize,
    /// The parameters it holds, in the order they were placed (increasing offsets).
    pub params: Vec<usize>,
}

/// Where one parameter's gradient lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub bucket: usize,
    /// Offset of the gradient's first element in the bucket, in elements.
    pub offset: usize,
}

/// The layout of every gradient: `slots[i]` is parameter `i`'s (indices as given, not as ordered).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub buckets: Vec<Bucket>,
    pub slots: Vec<Slot>,
}

fn round_up(n: usize, multiple: usize) -> usize {
    n.div_ceil(multiple) * multiple
}

fn invalid(reason: String) -> Error {
    Error::BucketPlan { reason }
}

fn check(numels: &[usize], dtypes: &[DType], order: &[usize], opts: &Options) -> Result<()> {
    if numels.len() != dtypes.len() || numels.len() != order.len() {
        return Err(invalid(format!(
            "{} sizes, {} dtypes and an order of {} parameters",
            numels.len(),
            dtypes.len(),
            order.len()
        )));
    }
    if opts.cap_bytes == 0 || opts.first_cap_bytes == 0 {
        return Err(invalid("bucket caps must be positive".into()));
    }
    if !opts.align_bytes.is_power_of_two() || opts.align_bytes < MIN_ALIGN_BYTES {
        return Err(invalid(format!(
            "align_bytes must be a power of two of at least {MIN_ALIGN_BYTES}, got {}",
            opts.align_bytes
        )));
    }
    if opts.world_size == 0 {
        return Err(invalid("world_size must be at least 1".into()));
    }
    let mut seen = vec![false; numels.len()];
    for (k, &i) in order.iter().enumerate() {
        if i >= numels.len() || std::mem::replace(&mut seen[i], true) {
            return Err(invalid(format!(
                "order[{k}] = {i} is out of range or repeated; the order must be a permutation of 0..{}",
                numels.len()
            )));
        }
    }
    Ok(())
}

/// A bucket of one dtype being filled.
#[derive(Default)]
struct Open {
    params: Vec<usize>,
    offsets: Vec<usize>,
    end: usize,
    /// Position in `order` of its first parameter (buckets are sorted by it).
    first_position: usize,
    /// Whether this dtype has closed a bucket before (its first bucket has the first cap).
    after_first: bool,
}

impl Open {
    /// Closes the bucket into `closed` and opens the next one of the same dtype.
    fn close(&mut self, dtype: DType, closed: &mut Vec<(DType, Open)>) {
        let full = std::mem::replace(self, Open { after_first: true, ..Open::default() });
        closed.push((dtype, full));
    }
}

/// Plans the buckets. `numels[i]` and `dtypes[i]` describe parameter `i`; `order` is a
/// permutation of `0..n` giving the order in which parameters are placed.
pub fn plan(numels: &[usize], dtypes: &[DType], order: &[usize], opts: &Options) -> Result<Plan> {
    check(numels, dtypes, order, opts)?;
    let pad_bytes = opts.align_bytes * opts.world_size;
    let mut open: Vec<(DType, Open)> = Vec::new(); // one per dtype seen, at most four
    let mut closed: Vec<(DType, Open)> = Vec::new();
    for (position, &i) in order.iter().enumerate() {
        let dtype = dtypes[i];
        let size = dtype.size();
        let (align, pad) = (opts.align_bytes / size, pad_bytes / size);
        let k = open.iter().position(|(d, _)| *d == dtype).unwrap_or_else(|| {
            open.push((dtype, Open::default()));
            open.len() - 1
        });
        let bucket = &mut open[k].1;
        let cap = |b: &Open| (if b.after_first { opts.cap_bytes } else { opts.first_cap_bytes }) / size;
        if !bucket.params.is_empty() && round_up(round_up(bucket.end, align) + numels[i], pad) > cap(bucket) {
            bucket.close(dtype, &mut closed);
        }
        let offset = round_up(bucket.end, align);
        if bucket.params.is_empty() {
            bucket.first_position = position;
        }
        bucket.params.push(i);
        bucket.offsets.push(offset);
        bucket.end = offset + numels[i];
        if round_up(bucket.end, pad) > cap(bucket) {
            // A parameter alone over the cap: a bucket of its own, closed at once.
            bucket.close(dtype, &mut closed);
        }
    }
    closed.extend(open.into_iter().filter(|(_, b)| !b.params.is_empty()));
    closed.sort_by_key(|(_, b)| b.first_position);
    let mut slots = vec![Slot { bucket: 0, offset: 0 }; numels.len()];
    let buckets = closed
        .into_iter()
        .enumerate()
        .map(|(b, (dtype, open))| {
            for (&i, &offset) in open.params.iter().zip(&open.offsets) {
                slots[i] = Slot { bucket: b, offset };
            }
            // An empty gradient still gets one padded unit, so that no buffer is empty.
            let numel = round_up(open.end.max(1), pad_bytes / dtype.size());
            Bucket { dtype, numel, params: open.params }
        })
        .collect();
    Ok(Plan { buckets, slots })
}

#[cfg(test)]
mod tests {
    use super::*;

    const F32: DType = DType::F32;

    fn opts(cap: usize) -> Options {
        Options { cap_bytes: cap, first_cap_bytes: cap, align_bytes: 64, world_size: 1 }
    }

    fn reversed(n: usize) -> Vec<usize> {
        (0..n).rev().collect()
    }

    /// Every invariant the module docs promise, checked on one plan.
    fn check_invariants(numels: &[usize], dtypes: &[DType], order: &[usize], o: &Options, p: &Plan) {
        let n = numels.len();
        assert_eq!(p.slots.len(), n);
        // Every parameter in exactly one bucket, at its slot.
        let mut count = vec![0; n];
        for (b, bucket) in p.buckets.iter().enumerate() {
            assert!(!bucket.params.is_empty());
            for &i in &bucket.params {
                count[i] += 1;
                assert_eq!(p.slots[i].bucket, b);
                assert_eq!(dtypes[i], bucket.dtype, "one dtype per bucket");
            }
        }
        assert!(count.iter().all(|&c| c == 1), "{count:?}");
        for (b, bucket) in p.buckets.iter().enumerate() {
            let size = bucket.dtype.size();
            assert_eq!(bucket.numel * size % (o.align_bytes * o.world_size), 0, "padding");
            let mut ranges: Vec<(usize, usize)> = bucket
                .params
                .iter()
                .map(|&i| {
                    let s = p.slots[i];
                    assert_eq!(s.offset * size % o.align_bytes, 0, "alignment of param {i}");
                    (s.offset, s.offset + numels[i])
                })
                .collect();
            ranges.sort();
            assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0), "views overlap in bucket {b}: {ranges:?}");
            assert!(ranges.last().unwrap().1 <= bucket.numel);
            // Cap: the padded bucket fits its cap (a dtype's first bucket has the first cap),
            // unless it holds one parameter alone.
            let first_of_dtype = !p.buckets[..b].iter().any(|x| x.dtype == bucket.dtype);
            let cap = if first_of_dtype { o.first_cap_bytes } else { o.cap_bytes };
            if bucket.params.len() > 1 {
                assert!(bucket.numel * size <= cap, "bucket {b} over its cap {cap}");
            }
        }
        // Buckets in the order of their first parameter's position.
        let position: Vec<usize> = {
            let mut pos = vec![0; n];
            order.iter().enumerate().for_each(|(k, &i)| pos[i] = k);
            pos
        };
        let firsts: Vec<usize> = p.buckets.iter().map(|b| position[b.params[0]]).collect();
        assert!(firsts.windows(2).all(|w| w[0] < w[1]), "{firsts:?}");
        // Within a bucket, parameters keep their order.
        for bucket in &p.buckets {
            assert!(bucket.params.windows(2).all(|w| position[w[0]] < position[w[1]]));
        }
    }

    #[test]
    fn fills_buckets_in_reverse_order_up_to_the_cap() {
        // Four f32 parameters of 64 elements (256 bytes) under a 512-byte cap: two per bucket,
        // the last-registered parameters first.
        let numels = [64; 4];
        let dtypes = [F32; 4];
        let p = plan(&numels, &dtypes, &reversed(4), &opts(512)).unwrap();
        assert_eq!(p.buckets.len(), 2);
        assert_eq!(p.buckets[0].params, vec![3, 2]);
        assert_eq!(p.buckets[1].params, vec![1, 0]);
        assert_eq!(p.slots[3], Slot { bucket: 0, offset: 0 });
        assert_eq!(p.slots[2], Slot { bucket: 0, offset: 64 });
        assert_eq!(p.buckets[0].numel, 128);
    }

    #[test]
    fn aligns_offsets_and_pads_to_the_world_size() {
        // 3 f32 elements then 5: the second starts at 16 (64 bytes); 2 ranks pad to 32 elements.
        let o = Options { world_size: 2, ..opts(1 << 20) };
        let p = plan(&[3, 5], &[F32, F32], &[0, 1], &o).unwrap();
        assert_eq!(p.slots[1].offset, 16);
        assert_eq!(p.buckets[0].numel, 32);
        // bf16: 64 bytes are 32 elements.
        let p = plan(&[3, 5], &[DType::BF16, DType::BF16], &[0, 1], &opts(1 << 20)).unwrap();
        assert_eq!(p.slots[1].offset, 32);
        assert_eq!(p.buckets[0].numel, 64);
    }

    #[test]
    fn a_parameter_over_the_cap_gets_a_bucket_of_its_own() {
        let numels = [10, 1000, 10];
        let p = plan(&numels, &[F32; 3], &[0, 1, 2], &opts(256)).unwrap();
        assert_eq!(p.buckets.len(), 3);
        assert_eq!(p.buckets[1].params, vec![1]);
        assert_eq!(p.buckets[1].numel, 1008);
        check_invariants(&numels, &[F32; 3], &[0, 1, 2], &opts(256), &p);
    }

    #[test]
    fn one_dtype_per_bucket_and_the_first_cap() {
        let numels = [16, 16, 16, 16, 16, 16];
        let dtypes = [F32, DType::BF16, F32, DType::BF16, F32, DType::F64];
        let o = Options { first_cap_bytes: 64, ..opts(1 << 20) };
        let order = reversed(6);
        let p = plan(&numels, &dtypes, &order, &o).unwrap();
        check_invariants(&numels, &dtypes, &order, &o, &p);
        // Each dtype's first bucket holds one 64-byte gradient; f32's second holds the other two.
        let f32_buckets: Vec<&Vec<usize>> = p.buckets.iter().filter(|b| b.dtype == F32).map(|b| &b.params).collect();
        assert_eq!(f32_buckets, vec![&vec![4], &vec![2, 0]]);
    }

    #[test]
    fn is_deterministic_and_follows_the_order() {
        let numels = [100, 7, 64, 300, 1];
        let dtypes = [F32; 5];
        let a = plan(&numels, &dtypes, &[4, 0, 2, 1, 3], &opts(1024)).unwrap();
        let b = plan(&numels, &dtypes, &[4, 0, 2, 1, 3], &opts(1024)).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.buckets[0].params[..2], [4, 0]);
    }

    #[test]
    fn empty_parameters_and_bad_arguments() {
        let p = plan(&[0, 0], &[F32, F32], &[1, 0], &opts(64)).unwrap();
        assert!(p.buckets.iter().all(|b| b.numel > 0));
        check_invariants(&[0, 0], &[F32, F32], &[1, 0], &opts(64), &p);
        assert!(plan(&[], &[], &[], &opts(64)).unwrap().buckets.is_empty());
        let bad = |numels: &[usize], order: &[usize], o: Options| {
            let dtypes = vec![F32; numels.len()];
            match plan(numels, &dtypes, order, &o) {
                Err(Error::BucketPlan { reason }) => reason,
                other => panic!("{other:?}"),
            }
        };
        assert!(bad(&[1, 2], &[0, 0], opts(64)).contains("order[1] = 0"));
        assert!(bad(&[1, 2], &[0, 2], opts(64)).contains("permutation"));
        assert!(bad(&[1], &[0, 1], opts(64)).contains("order of 2"));
        assert!(bad(&[1], &[0], opts(0)).contains("positive"));
        assert!(bad(&[1], &[0], Options { align_bytes: 32, ..opts(64) }).contains("power of two"));
        assert!(bad(&[1], &[0], Options { world_size: 0, ..opts(64) }).contains("world_size"));
    }

    #[test]
    fn invariants_hold_on_random_layouts() {
        let mut seed = 0x9E3779B97F4A7C15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let all = [DType::F32, DType::F64, DType::F16, DType::BF16];
        for _ in 0..400 {
            let n = (next() % 30) as usize;
            let numels: Vec<usize> = (0..n).map(|_| (next() % 5000) as usize).collect();
            let dtypes: Vec<DType> = (0..n).map(|_| all[(next() % 4) as usize]).collect();
            let mut order: Vec<usize> = (0..n).collect();
            for k in (1..n).rev() {
                order.swap(k, (next() % (k as u64 + 1)) as usize);
            }
            let o = Options {
                cap_bytes: 64 + (next() % 20000) as usize,
                first_cap_bytes: 64 + (next() % 20000) as usize,
                align_bytes: 64 << (next() % 3),
                world_size: 1 + (next() % 4) as usize,
            };
            let p = plan(&numels, &dtypes, &order, &o).unwrap();
            check_invariants(&numels, &dtypes, &order, &o, &p);
        }
    }
}
