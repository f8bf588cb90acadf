//! A small fork-join pool in which the calling thread works too and idle workers spin a
//! little before they sleep.
//!
//! Why not rayon: in a decode step the engine calls a kernel ~200 times, each for 20-200 us,
//! with torch ops in between. A rayon ``install`` hands the work to the pool and puts the
//! calling thread to sleep; by the next call the workers have gone to sleep too, so every
//! call paid two wake-ups (futex + scheduler latency) and one of the cores sat idle while
//! the caller waited. In-engine the kernels ran faster on one thread than on rayon's two.
//! Here the caller claims chunks like any worker, and workers spin for ``SPIN`` after a job
//! (yielding the core to any other runnable thread) before they park, so back-to-back
//! calls find them awake.
//!
//! One job runs at a time. A second thread that calls while a job runs does its work alone
//! on its own thread, so callers never wait for each other and never deadlock.

use std::any::Any;
use std::cell::UnsafeCell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker keeps polling for the next job before it parks: longer than the
/// torch ops between two matmuls of a decode step (tens to hundreds of microseconds) and
/// than the engine's work between two steps, short enough that an idle engine sleeps.
/// In-engine decode measured the same (within noise) from 0.5 to 10 ms; 50 us and less was
/// ~25% slower.
const SPIN: Duration = Duration::from_millis(2);

type Work = dyn Fn(usize) + Sync;

/// The job being run: ``work(i)`` for every chunk the ticket hands out. Borrowed from
/// ``Pool::run``'s caller, which does not return before every claimed chunk is done;
/// 'static only so it can sit here.
struct Job {
    work: *const Work,
}

/// The most chunks one job may have (the ticket's 16-bit fields).
const MAX_CHUNKS: usize = 0x8000;

struct Shared {
    /// ``job id << 32 | chunks << 16 | next chunk``: a worker claims a chunk with one
    /// ``fetch_add`` and learns from the same value whether it is a real one, so a worker
    /// late for a finished job can never mistake the next job's chunks for its own, and it
    /// reads ``job`` only while holding a real, unfinished chunk.
    ticket: AtomicU64,
    /// Written only by the thread holding ``running``, before the ticket publishes it.
    job: UnsafeCell<Job>,
    done: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    sleepers: AtomicUsize,
    wake: Mutex<()>,
    woken: Condvar,
    stop: AtomicBool,
}

// The job cell is written by one thread while no chunk of any job is unclaimed-and-running
// (see ``Pool::run``) and read by workers after an acquiring ticket claim.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub(crate) struct Pool {
    shared: Arc<Shared>,
    running: Mutex<()>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
}

impl Pool {
    /// A pool of ``threads`` threads in all: the caller and ``threads - 1`` workers.
    pub(crate) fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            ticket: AtomicU64::new(0),
            job: UnsafeCell::new(Job {
                work: (&|_: usize| {}) as &Work as *const Work,
            }),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            sleepers: AtomicUsize::new(0),
            wake: Mutex::new(()),
            woken: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let workers = (1..threads.max(1))
            .filter_map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("powertrain-cpu-kernels-{i}"))
                    .spawn(move || worker(&shared))
                    .ok()
            })
            .collect::<Vec<_>>();
        let threads = workers.len() + 1;
        Pool {
            shared,
            running: Mutex::new(()),
            workers,
            threads,
        }
    }

    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// ``work(i)`` for ``i`` in ``0..chunks``, spread over the pool; returns when all ran.
    pub(crate) fn run<'a>(&self, chunks: usize, work: &'a (dyn Fn(usize) + Sync + 'a)) {
        let guard = match self.running.try_lock() {
            Ok(guard) if self.threads > 1 && chunks > 1 && chunks <= MAX_CHUNKS => guard,
            _ => return (0..chunks).for_each(work), // busy, alone or one chunk: on this thread
        };
        let shared = &*self.shared;
        let id = ((shared.ticket.load(SeqCst) >> 32) + 1) & 0xFFFF_FFFF; // wraps after 2^32 jobs
                                                                         // SAFETY: the previous job is finished (its caller waited for every chunk), and a
                                                                         // worker reads the cell only after claiming a real chunk of the ticket stored below.
        unsafe {
            *shared.job.get() = Job {
                work: std::mem::transmute::<&'a (dyn Fn(usize) + Sync + 'a), &'static Work>(work),
            };
        }
        shared.done.store(0, SeqCst);
        shared
            .ticket
            .store(id << 32 | (chunks as u64) << 16, SeqCst);
        if shared.sleepers.load(SeqCst) > 0 {
            let _lock = shared.wake.lock().unwrap_or_else(|e| e.into_inner());
            shared.woken.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| claim_and_run(shared)));
        // Every chunk must finish before ``work`` (on this stack) may go away.
        let mut rounds = 0u32;
        while shared.done.load(SeqCst) < chunks {
            relax(&mut rounds);
        }
        let theirs = shared
            .panic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        drop(guard);
        if let Err(payload) = mine {
            resume_unwind(payload);
        }
        if let Some(payload) = theirs {
            resume_unwind(payload);
        }
    }
}

/// Claim chunks of the current job until none is left; ``true`` when any ran.
fn claim_and_run(shared: &Shared) -> bool {
    let mut ran = false;
    loop {
        let ticket = shared.ticket.fetch_add(1, SeqCst);
        let (chunks, index) = ((ticket >> 16 & 0xFFFF) as usize, (ticket & 0xFFFF) as usize);
        if index >= chunks {
            return ran; // a late claim beyond the end: never touches the job cell
        }
        // SAFETY: the ticket was published after the job cell was written, and the job's
        // caller waits for this chunk (counted in ``done``) before it changes the cell.
        let work = unsafe { &*(*shared.job.get()).work };
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| work(index))) {
            *shared.panic.lock().unwrap_or_else(|e| e.into_inner()) = Some(payload);
        }
        shared.done.fetch_add(1, SeqCst);
        ran = true;
    }
}

fn worker(shared: &Shared) {
    let mut seen = 0u64;
    loop {
        // Poll for a new job id for SPIN, then park until the next job is published.
        let start = Instant::now();
        let mut rounds = 0u32;
        loop {
            if shared.stop.load(SeqCst) {
                return;
            }
            let id = shared.ticket.load(SeqCst) >> 32;
            if id != seen {
                seen = id;
                claim_and_run(shared);
                break;
            }
            if relax(&mut rounds) && start.elapsed() > SPIN {
                park(shared, seen);
                break;
            }
        }
    }
}

/// One round of a polling loop: a CPU pause hint, and every 64th round the core yielded to
/// any other runnable thread (then ``true``).
fn relax(rounds: &mut u32) -> bool {
    *rounds = rounds.wrapping_add(1);
    if rounds.is_multiple_of(64) {
        std::thread::yield_now();
        true
    } else {
        std::hint::spin_loop();
        false
    }
}

/// Sleep until a job other than ``seen`` is published (or the pool stops).
fn park(shared: &Shared, seen: u64) {
    let mut lock = shared.wake.lock().unwrap_or_else(|e| e.into_inner());
    shared.sleepers.fetch_add(1, SeqCst);
    // Checked after counting ourselves as a sleeper: a caller that published before this
    // load is seen here; one that publishes after it sees the sleeper and notifies under
    // the lock we hold until ``wait`` releases it.
    while shared.ticket.load(SeqCst) >> 32 == seen && !shared.stop.load(SeqCst) {
        lock = shared.woken.wait(lock).unwrap_or_else(|e| e.into_inner());
    }
    shared.sleepers.fetch_sub(1, SeqCst);
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        {
            let _lock = self.shared.wake.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.woken.notify_all();
        }
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Pool;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_chunk_runs_once_across_many_jobs() {
        let pool = Pool::new(3);
        for chunks in [0, 1, 2, 7, 64, 1000] {
            let hits: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
            for _ in 0..50 {
                pool.run(chunks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
            }
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 50));
        }
    }

    #[test]
    fn parked_workers_wake_for_the_next_job() {
        let pool = Pool::new(2);
        let total = AtomicUsize::new(0);
        for _ in 0..3 {
            std::thread::sleep(std::time::Duration::from_millis(5)); // past the spin: parked
            pool.run(16, &|i| {
                total.fetch_add(i, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 3 * (0..16).sum::<usize>());
    }

    #[test]
    fn concurrent_callers_each_get_their_work_done() {
        let pool = Pool::new(2);
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        pool.run(8, &|_| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 200 * 8);
    }

    #[test]
    fn a_panicking_chunk_reaches_the_caller_after_the_others_finish() {
        let pool = Pool::new(2);
        let finished = AtomicUsize::new(0);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(32, &|i| {
                if i == 5 {
                    panic!("chunk 5");
                }
                finished.fetch_add(1, Ordering::Relaxed);
            })
        }));
        assert!(result.is_err());
        assert_eq!(finished.load(Ordering::Relaxed), 31);
        pool.run(4, &|_| {
            finished.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(finished.load(Ordering::Relaxed), 35);
    }
}
