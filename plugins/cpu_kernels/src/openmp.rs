//! Running chunks on torch's own OpenMP team.
//!
//! While torch runs its ops on several threads, its OpenMP workers poll for the next
//! parallel region for a while after each op. A second pool beside them (``pool.rs``) finds
//! its cores taken, so a kernel called between torch ops ran no faster on two threads than
//! on one. Entering a parallel region of the same OpenMP runtime instead hands the chunks
//! to exactly those polling workers: no second set of threads, no contention.
//!
//! The runtime is the one torch loaded into the process; Python finds ``GOMP_parallel``
//! there (``ctypes``) and gives its address to ``set_openmp``. libgomp defines it, and
//! Intel's and LLVM's runtimes export it for compatibility.

use std::any::Any;
use std::ffi::{c_uint, c_void};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// ``void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags)``.
type GompParallel = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);

/// The address of ``GOMP_parallel``; 0 while none was given.
static GOMP_PARALLEL: AtomicUsize = AtomicUsize::new(0);

/// Use the OpenMP runtime whose ``GOMP_parallel`` is at ``address`` (0: none).
///
/// # Safety
/// ``address`` must be 0 or the address of ``GOMP_parallel`` of an OpenMP runtime that stays
/// loaded for the life of the process.
pub unsafe fn set_openmp(address: usize) {
    GOMP_PARALLEL.store(address, Ordering::Release);
}

/// Whether ``run`` has a runtime to run on.
pub fn openmp_available() -> bool {
    GOMP_PARALLEL.load(Ordering::Acquire) != 0
}

/// One parallel region's shared state: its threads claim chunks from ``next``.
struct Region<'a> {
    work: &'a (dyn Fn(usize) + Sync + 'a),
    chunks: usize,
    next: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

extern "C" fn region_body(data: *mut c_void) {
    // SAFETY: ``run`` passes a ``Region`` that outlives the parallel region.
    let region = unsafe { &*(data as *const Region) };
    loop {
        let chunk = region.next.fetch_add(1, Ordering::Relaxed);
        if chunk >= region.chunks {
            return;
        }
        // A panic must not unwind through the OpenMP runtime's C frames.
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| (region.work)(chunk))) {
            region
                .panic
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(panic);
            region.next.store(region.chunks, Ordering::Relaxed); // the rest is not run
        }
    }
}

/// ``work(i)`` for ``i`` in ``0..chunks`` on an OpenMP team of ``threads`` threads (the
/// calling one included); returns once every chunk ran, re-raising a chunk's panic. False,
/// with nothing run, when no runtime was given.
pub(crate) fn run(threads: usize, chunks: usize, work: &(dyn Fn(usize) + Sync)) -> bool {
    let address = GOMP_PARALLEL.load(Ordering::Acquire);
    if address == 0 {
        return false;
    }
    // SAFETY: ``set_openmp``'s contract.
    let parallel: GompParallel = unsafe { std::mem::transmute::<usize, GompParallel>(address) };
    let region = Region {
        work,
        chunks,
        next: AtomicUsize::new(0),
        panic: Mutex::new(None),
    };
    let team = threads.clamp(1, chunks.max(1)) as c_uint;
    // SAFETY: GOMP_parallel returns only after every thread of the team left region_body.
    unsafe {
        parallel(
            region_body,
            &region as *const Region as *mut c_void,
            team,
            0,
        )
    };
    if let Some(panic) = region.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
        resume_unwind(panic);
    }
    true
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::{run, set_openmp};
    use std::collections::HashSet;
    use std::ffi::{c_char, c_int, c_void, CString};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Mutex, OnceLock};

    extern "C" {
        fn dlopen(file: *const c_char, mode: c_int) -> *mut c_void;
        fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void;
    }
    const RTLD_NOW: c_int = 2;

    /// libgomp from ``POWERTRAIN_TEST_LIBGOMP`` (the pytest run passes torch's), else the
    /// system's; handed to ``set_openmp`` once for every test. None where neither loads.
    fn runtime() -> Option<usize> {
        static ADDRESS: OnceLock<Option<usize>> = OnceLock::new();
        *ADDRESS.get_or_init(|| {
            let given = std::env::var("POWERTRAIN_TEST_LIBGOMP").ok();
            let path =
                CString::new(given.clone().unwrap_or_else(|| "libgomp.so.1".into())).unwrap();
            let symbol = CString::new("GOMP_parallel").unwrap();
            let address = unsafe {
                let handle = dlopen(path.as_ptr(), RTLD_NOW);
                if handle.is_null() {
                    std::ptr::null_mut()
                } else {
                    dlsym(handle, symbol.as_ptr())
                }
            } as usize;
            assert!(
                given.is_none() || address != 0,
                "{given:?} gave no GOMP_parallel"
            );
            (address != 0).then(|| {
                unsafe { set_openmp(address) };
                address
            })
        })
    }

    #[test]
    fn every_chunk_runs_once_on_a_team_of_the_threads_asked_for() {
        // Only a bare ``cargo test`` without a system libgomp returns here: the pytest run
        // always names torch's, and a name that does not load fails in ``runtime``.
        if runtime().is_none() {
            eprintln!("no libgomp to test with (set POWERTRAIN_TEST_LIBGOMP)");
            return;
        }
        for (threads, chunks) in [(2, 1), (2, 2), (3, 7), (2, 500), (4, 64)] {
            let hits: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
            let seen = Mutex::new(HashSet::new());
            // Each chunk waits until as many threads as asked have taken one (or 10 s pass),
            // so a thread that starts late still gets a chunk: a fixed sleep here failed under
            // load, one thread taking both chunks before the other had started.
            let want = threads.min(chunks);
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let ran = run(threads, chunks, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
                seen.lock().unwrap().insert(std::thread::current().id());
                while seen.lock().unwrap().len() < want && std::time::Instant::now() < deadline {
                    std::thread::yield_now();
                }
            });
            assert!(ran);
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "{threads} threads, {chunks} chunks"
            );
            assert_eq!(
                seen.into_inner().unwrap().len(),
                threads.min(chunks),
                "{threads} threads, {chunks} chunks"
            );
        }
    }

    #[test]
    fn a_chunks_panic_reaches_the_caller_after_the_team_left() {
        // Only a bare ``cargo test`` without a system libgomp returns here: the pytest run
        // always names torch's, and a name that does not load fails in ``runtime``.
        if runtime().is_none() {
            eprintln!("no libgomp to test with (set POWERTRAIN_TEST_LIBGOMP)");
            return;
        }
        let finished = AtomicUsize::new(0);
        let caught = std::panic::catch_unwind(|| {
            run(2, 40, &|i| {
                if i == 3 {
                    panic!("chunk 3 failed");
                }
                finished.fetch_add(1, Ordering::Relaxed);
            })
        });
        let message = caught.expect_err("the panic must reach the caller");
        assert_eq!(message.downcast_ref::<&str>(), Some(&"chunk 3 failed"));
        assert!(finished.load(Ordering::Relaxed) < 40);
        // The runtime still works after a panicking region.
        let again = AtomicUsize::new(0);
        assert!(run(2, 10, &|_| {
            again.fetch_add(1, Ordering::Relaxed);
        }));
        assert_eq!(again.load(Ordering::Relaxed), 10);
    }
}
