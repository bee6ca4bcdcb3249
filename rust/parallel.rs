//! Where the parallel loops run: torch's own OpenMP team when the Python layer has handed over
//! its OpenMP runtime's entry points ([`use_openmp`]), else rayon's pool.
//!
//! Why torch's team: after each parallel op torch's OpenMP workers spin for milliseconds
//! waiting for the next one. A rayon pool beside them has its threads share the cores with
//! spinning ones: with 2 cores a bf16 norm run right after a torch op took 11.4 ms instead of
//! 6.6 ms (measured; with `OMP_WAIT_POLICY=PASSIVE` the gap vanished). Run as an OpenMP
//! parallel region, the work lands on the threads already spinning, as torch's own ops do, and
//! honours `torch.set_num_threads`.
//!
//! Either way the work is split by item, each item runs on one thread, and results come back
//! in item order, so callers that combine them in order are deterministic for any thread count.
//!
//! After `fork()` neither pool works in the child: the child has only the thread that forked,
//! while the OpenMP runtime (libgomp) and rayon's registry still count the parent's workers, so a
//! parallel region waits forever for threads that do not exist (torch's own large ops hang there
//! the same way). The pools belong to the process that set them up ([`HOME`]); any other process
//! is a forked child and runs its loops on a pool of its own, built on first use ([`fork_pool`]).

use std::any::Any;
use std::cell::UnsafeCell;
use std::ffi::{c_int, c_uint, c_void};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, OnceLock};

use rayon::prelude::*;

use crate::tensor::PARALLEL_MIN;

/// `GOMP_parallel(fn, data, num_threads, flags)`: runs `fn(data)` on every thread of a team
/// (0 threads: the runtime's default, which `omp_set_num_threads` sets); libgomp's ABI, which
/// LLVM's OpenMP runtime exports too.
type ParallelFn = unsafe extern "C" fn(unsafe extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);
type IntFn = unsafe extern "C" fn() -> c_int;

#[derive(Clone, Copy)]
struct OpenMp {
    parallel: ParallelFn,
    thread_num: IntFn,
    num_threads: IntFn,
    max_threads: IntFn,
}

static OPENMP: OnceLock<OpenMp> = OnceLock::new();

/// The process whose pools these are: the first one to set up or use them.
static HOME: OnceLock<u32> = OnceLock::new();

/// Whether this process is a child forked after the pools were set up (see the module docs).
fn forked() -> bool {
    let pid = std::process::id();
    *HOME.get_or_init(|| pid) != pid
}

/// A forked child's own pool (and the process it belongs to), never freed: one per forked process.
/// Lock-free, since a lock taken in the parent at the moment of a fork stays taken in the child.
static FORK_POOL: AtomicPtr<(u32, rayon::ThreadPool)> = AtomicPtr::new(std::ptr::null_mut());

/// This forked process's pool: as many threads as the parent's loops used (torch's thread count
/// when on its OpenMP team, which `torch.set_num_threads` in the child also changes).
fn fork_pool() -> &'static rayon::ThreadPool {
    let pid = std::process::id();
    // SAFETY: non-null pointers in FORK_POOL come from Box::into_raw below and are never freed.
    if let Some((owner, pool)) = unsafe { FORK_POOL.load(Ordering::Acquire).as_ref() } {
        if *owner == pid {
            return pool;
        }
    }
    let mut builder = rayon::ThreadPoolBuilder::new();
    if let Some(omp) = OPENMP.get() {
        // SAFETY: a valid omp_get_max_threads (use_openmp's contract); it reads a setting, no team.
        builder = builder.num_threads(unsafe { (omp.max_threads)() }.max(1) as usize);
    }
    let pool = builder.build().expect("gradfuse: could not start threads in a forked process");
    let leaked = Box::into_raw(Box::new((pid, pool)));
    // Two threads of the child racing here each build one; the loser's pool is simply unused.
    FORK_POOL.store(leaked, Ordering::Release);
    // SAFETY: from Box::into_raw just above, never freed.
    unsafe { &(*leaked).1 }
}

/// Run parallel loops on the OpenMP runtime whose functions are at these addresses (from then
/// on, for the life of the process). Returns whether they are in use (the first call wins).
///
/// # Safety
/// The addresses must be `GOMP_parallel`, `omp_get_thread_num`, `omp_get_num_threads` and
/// `omp_get_max_threads` of one OpenMP runtime loaded for the life of the process.
pub unsafe fn use_openmp(parallel: usize, thread_num: usize, num_threads: usize, max_threads: usize) -> bool {
    if [parallel, thread_num, num_threads, max_threads].contains(&0) {
        return false;
    }
    HOME.get_or_init(std::process::id);
    let omp = OpenMp {
        parallel: std::mem::transmute::<usize, ParallelFn>(parallel),
        thread_num: std::mem::transmute::<usize, IntFn>(thread_num),
        num_threads: std::mem::transmute::<usize, IntFn>(num_threads),
        max_threads: std::mem::transmute::<usize, IntFn>(max_threads),
    };
    let _ = OPENMP.set(omp);
    OPENMP.get().is_some_and(|o| o.parallel as usize == parallel)
}

/// Whether parallel loops run on an OpenMP team (see [`use_openmp`]).
pub fn on_openmp() -> bool {
    OPENMP.get().is_some()
}

/// Threads a parallel loop started now would use.
pub fn num_threads() -> usize {
    if forked() {
        return fork_pool().current_num_threads();
    }
    match OPENMP.get() {
        // SAFETY: a valid omp_get_max_threads (use_openmp's contract).
        Some(omp) => unsafe { (omp.max_threads)() }.max(1) as usize,
        None => rayon::current_num_threads(),
    }
}

/// `f` of every item, results in item order; in parallel when the items' total `weight`
/// (elements) is at least [`PARALLEL_MIN`]. On OpenMP, thread `t` of `n` takes the items that
/// start in the `t`-th `n`-th of the total weight.
pub fn map<S: Send, R: Send>(items: Vec<S>, weight: impl Fn(&S) -> usize, f: impl Fn(S) -> R + Sync + Send) -> Vec<R> {
    let starts: Vec<usize> = items
        .iter()
        .scan(0usize, |acc, s| {
            let start = *acc;
            *acc += weight(s);
            Some(start)
        })
        .collect();
    let total = items.last().map_or(0, |last| starts[starts.len() - 1] + weight(last));
    if total < PARALLEL_MIN || items.len() < 2 {
        return items.into_iter().map(f).collect();
    }
    if forked() {
        return fork_pool().install(|| items.into_par_iter().map(f).collect());
    }
    match OPENMP.get() {
        Some(omp) => map_on(omp, items, &starts, total, f),
        None => items.into_par_iter().map(f).collect(),
    }
}

/// [`map`]'s OpenMP path: `starts` are the items' offsets in the `total` weight.
fn map_on<S: Send, R: Send>(
    omp: &OpenMp,
    items: Vec<S>,
    starts: &[usize],
    total: usize,
    f: impl Fn(S) -> R + Sync + Send,
) -> Vec<R> {
    let n = items.len();
    let slots = Slots {
        items: items.into_iter().map(|s| UnsafeCell::new(Some(s))).collect(),
        out: (0..n).map(|_| UnsafeCell::new(None)).collect(),
    };
    let shared = &slots; // captured whole: Slots is Sync, its fields are not
    region(omp, |t: usize, of: usize| {
        let first = starts.partition_point(|&s| s < total * t / of);
        let end = starts.partition_point(|&s| s < total * (t + 1) / of);
        for i in first..end {
            // SAFETY: each index is in exactly one thread's range [first, end).
            unsafe {
                let item = (*shared.items[i].get()).take().expect("each item runs once");
                *shared.out[i].get() = Some(f(item));
            }
        }
    });
    slots.out.into_iter().map(|r| r.into_inner().expect("every item ran")).collect()
}

/// Items and results, written by index from several threads (each index by one thread).
struct Slots<S, R> {
    items: Vec<UnsafeCell<Option<S>>>,
    out: Vec<UnsafeCell<Option<R>>>,
}

// SAFETY: threads touch disjoint indices only (see `map`); the values themselves are Send.
unsafe impl<S: Send, R: Send> Sync for Slots<S, R> {}

/// Runs `run(t, n)` on each thread `t` of an OpenMP team of `n`; re-raises a panic from any.
fn region<F: Fn(usize, usize) + Sync>(omp: &OpenMp, run: F) {
    let job = Job { run, omp, panic: Mutex::new(None) };
    // SAFETY: `trampoline::<F>` gets a pointer to `job`, which outlives the region
    // (GOMP_parallel returns when every thread has finished).
    unsafe { (omp.parallel)(trampoline::<F>, (&job as *const Job<'_, F>).cast_mut().cast(), 0, 0) };
    if let Some(payload) = job.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
        resume_unwind(payload);
    }
}

struct Job<'a, F> {
    run: F,
    omp: &'a OpenMp,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

/// The body of the parallel region: this thread's share of the job. A panic must not unwind
/// through the OpenMP runtime's C frames: it is caught and re-raised after the region.
unsafe extern "C" fn trampoline<F: Fn(usize, usize) + Sync>(data: *mut c_void) {
    let job = &*(data as *const Job<'_, F>);
    let t = (job.omp.thread_num)().max(0) as usize;
    let of = (job.omp.num_threads)().max(1) as usize;
    if let Err(payload) = catch_unwind(AssertUnwindSafe(|| (job.run)(t, of))) {
        let mut slot = job.panic.lock().unwrap_or_else(|e| e.into_inner());
        slot.get_or_insert(payload);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    // A stand-in OpenMP runtime: a team of 3 scoped threads.
    thread_local! {
        static THREAD: Cell<c_int> = const { Cell::new(0) };
    }
    const TEAM: c_int = 3;

    unsafe extern "C" fn fake_parallel(f: unsafe extern "C" fn(*mut c_void), data: *mut c_void, _: c_uint, _: c_uint) {
        let data = data as usize;
        std::thread::scope(|scope| {
            for t in 0..TEAM {
                scope.spawn(move || {
                    THREAD.with(|c| c.set(t));
                    // SAFETY: as GOMP_parallel would call it.
                    unsafe { f(data as *mut c_void) }
                });
            }
        });
    }
    unsafe extern "C" fn fake_thread_num() -> c_int {
        THREAD.with(Cell::get)
    }
    unsafe extern "C" fn fake_num_threads() -> c_int {
        TEAM
    }

    fn fake() -> OpenMp {
        OpenMp {
            parallel: fake_parallel,
            thread_num: fake_thread_num,
            num_threads: fake_num_threads,
            max_threads: fake_num_threads,
        }
    }

    #[test]
    fn openmp_path_runs_every_item_once_in_order_and_splits_by_weight() {
        // Uneven weights: one thread's share holds many small items, another's one big one.
        let weights: Vec<usize> = (0..40).map(|i| if i == 30 { 1000 } else { i % 7 + 1 }).collect();
        let starts: Vec<usize> = weights.iter().scan(0, |a, w| Some(std::mem::replace(a, *a + w))).collect();
        let total = weights.iter().sum();
        let items: Vec<(usize, usize)> = weights.iter().copied().enumerate().collect();
        let out = map_on(&fake(), items, &starts, total, |(i, w)| (i, w * 2, THREAD.with(Cell::get)));
        assert_eq!(out.iter().map(|r| r.0).collect::<Vec<_>>(), (0..40).collect::<Vec<_>>());
        assert!(out.iter().zip(&weights).all(|(r, w)| r.1 == w * 2));
        // Thread t runs the items starting in the t-th third of the weight.
        for (r, &s) in out.iter().zip(&starts) {
            assert_eq!(r.2 as usize, (0..TEAM as usize).rfind(|&t| s >= total * t / TEAM as usize).unwrap());
        }
        // A thread whose share of the weight lies inside one big item (item 30) runs nothing.
        assert!(!out.iter().any(|r| r.2 == 1));
    }

    #[test]
    fn openmp_path_reraises_a_panic_after_the_region() {
        let items: Vec<usize> = (0..10).collect();
        let starts: Vec<usize> = items.clone();
        let caught = std::panic::catch_unwind(|| {
            map_on(&fake(), items, &starts, 10, |i| {
                if i == 7 {
                    panic!("item seven");
                }
                i
            })
        });
        let payload = caught.expect_err("the panic must reach the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"item seven"));
    }
}
