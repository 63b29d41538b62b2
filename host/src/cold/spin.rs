//! A small fork-join pool whose workers spin between jobs.
//!
//! The CPU lane runs one short job per decode MoE layer, a few hundred
//! microseconds apart. A sleeping pool (rayon's) pays a thread wake-up per
//! worker and per caller at every job; in a virtual machine that is tens of
//! microseconds each, and it measured as ~0.3 ms a layer on the H200 host,
//! as much as the work. Here workers spin for [`SPIN`] after a job before
//! they park, and the caller works on the job too and spins for the end.
//!
//! One job at a time: `run(n, f)` calls `f(i)` once for each `i < n` over
//! the workers and the caller, and returns when every call has returned.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN: Duration = Duration::from_millis(3);
/// Most tasks one job may have (the state word's task fields are 20 bits).
pub const MAX_TASKS: usize = (1 << 20) - 1;

/// The job word: epoch (24 bits), task count (20), next task to claim (20).
/// One word, so a worker can never claim a task of one job under another's count.
fn pack(epoch: u64, n: u64, next: u64) -> u64 {
    (epoch & 0xff_ffff) << 40 | n << 20 | next
}
fn epoch_of(s: u64) -> u64 {
    s >> 40
}
fn n_of(s: u64) -> u64 {
    (s >> 20) & 0xf_ffff
}
fn next_of(s: u64) -> u64 {
    s & 0xf_ffff
}

/// The current job's function, behind a thin pointer.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
}

struct Inner {
    state: AtomicU64,
    /// The running job's `Job`, valid while a claimed task of it is unfinished.
    job: AtomicPtr<()>,
    /// Calls of the current job that have returned.
    done: AtomicU32,
    panicked: AtomicBool,
    parked: AtomicU32,
    stop: AtomicBool,
    lock: Mutex<()>,
    wake: Condvar,
}

impl Inner {
    /// Claim and run tasks of the job in `epoch` until none are left.
    fn work(&self, epoch: u64) {
        loop {
            let s = self.state.load(Acquire);
            if epoch_of(s) != epoch || next_of(s) >= n_of(s) {
                return;
            }
            if self.state.compare_exchange_weak(s, s + 1, AcqRel, Relaxed).is_err() {
                continue;
            }
            // SAFETY: task next_of(s) of `epoch` is claimed and not yet done,
            // so that job's caller is still waiting in `run` and its `Job`
            // (stored before the epoch was published) is alive.
            let job = unsafe { &*(self.job.load(Acquire) as *const Job<'_>) };
            if catch_unwind(AssertUnwindSafe(|| (job.f)(next_of(s) as usize))).is_err() {
                self.panicked.store(true, Release);
            }
            self.done.fetch_add(1, Release);
        }
    }

    fn worker(&self) {
        let mut seen = epoch_of(self.state.load(Acquire));
        loop {
            let since = Instant::now();
            let mut spins = 0u32;
            let epoch = loop {
                let e = epoch_of(self.state.load(Acquire));
                if e != seen {
                    break e;
                }
                if self.stop.load(Acquire) {
                    return;
                }
                std::hint::spin_loop();
                spins += 1;
                if spins.is_multiple_of(256) && since.elapsed() > SPIN {
                    let g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
                    // Counted before the state is re-read, so a caller that
                    // publishes after this check sees the count and wakes us.
                    self.parked.fetch_add(1, SeqCst);
                    let mut g = g;
                    while epoch_of(self.state.load(SeqCst)) == seen && !self.stop.load(SeqCst) {
                        g = self.wake.wait_timeout(g, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0;
                    }
                    self.parked.fetch_sub(1, SeqCst);
                    drop(g);
                    spins = 0;
                }
            };
            seen = epoch;
            self.work(epoch);
        }
    }
}

/// Why a job did not complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    #[error("a task panicked")]
    Panicked,
    #[error("a job of {0} tasks (at most {MAX_TASKS})")]
    TooManyTasks(usize),
}

pub struct SpinPool {
    inner: Arc<Inner>,
    workers: Vec<JoinHandle<()>>,
    /// One job at a time (and the epoch counter).
    running: Mutex<u64>,
}

impl SpinPool {
    /// A pool that runs jobs on `threads` threads in all: `threads - 1`
    /// workers plus the caller.
    pub fn new(threads: usize, name: &str) -> std::io::Result<SpinPool> {
        let inner = Arc::new(Inner {
            state: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicU32::new(0),
            panicked: AtomicBool::new(false),
            parked: AtomicU32::new(0),
            stop: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut pool = SpinPool { inner, workers: Vec::new(), running: Mutex::new(0) };
        for i in 1..threads.max(1) {
            let inner = pool.inner.clone();
            // On an error `pool` drops here, stopping the workers started so far.
            pool.workers.push(std::thread::Builder::new().name(format!("{name}-{i}")).spawn(move || inner.worker())?);
        }
        Ok(pool)
    }

    /// Threads a job runs on, the caller's included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Call `f(i)` for every `i < n` on the pool's threads and this one;
    /// returns when all calls have returned. At most [`MAX_TASKS`] tasks.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) -> Result<(), PoolError> {
        if n == 0 {
            return Ok(());
        }
        if n > MAX_TASKS {
            return Err(PoolError::TooManyTasks(n));
        }
        let mut epoch = self.running.lock().unwrap_or_else(|e| e.into_inner());
        *epoch = (*epoch + 1) & 0xff_ffff;
        let inner = &*self.inner;
        let job = Job { f };
        inner.job.store(&job as *const Job<'_> as *mut (), Release);
        inner.done.store(0, Relaxed);
        inner.panicked.store(false, Relaxed);
        inner.state.store(pack(*epoch, n as u64, 0), SeqCst);
        if inner.parked.load(SeqCst) > 0 {
            let _g = inner.lock.lock().unwrap_or_else(|e| e.into_inner());
            inner.wake.notify_all();
        }
        inner.work(*epoch);
        while (inner.done.load(Acquire) as usize) < n {
            std::hint::spin_loop();
        }
        if inner.panicked.load(Acquire) {
            Err(PoolError::Panicked)
        } else {
            Ok(())
        }
    }
}

impl Drop for SpinPool {
    fn drop(&mut self) {
        self.inner.stop.store(true, SeqCst);
        {
            let _g = self.inner.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.inner.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_task_runs_once_per_job() {
        for threads in [1, 2, 5] {
            let pool = SpinPool::new(threads, "t").unwrap();
            assert_eq!(pool.threads(), threads);
            for n in [1usize, 3, 64, 1000] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Relaxed);
                })
                .unwrap();
                assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "threads {threads} n {n}");
            }
            pool.run(0, &|_| unreachable!()).unwrap();
        }
    }

    #[test]
    fn results_are_visible_to_the_caller() {
        let pool = SpinPool::new(4, "t").unwrap();
        let out: Vec<Mutex<u64>> = (0..500).map(|_| Mutex::new(0)).collect();
        for round in 0..200u64 {
            pool.run(out.len(), &|i| *out[i].lock().unwrap() = round * 1000 + i as u64).unwrap();
            assert!(out.iter().enumerate().all(|(i, v)| *v.lock().unwrap() == round * 1000 + i as u64), "round {round}");
        }
    }

    #[test]
    fn workers_wake_after_parking() {
        let pool = SpinPool::new(3, "t").unwrap();
        std::thread::sleep(SPIN * 4);
        let who = Mutex::new(std::collections::BTreeSet::new());
        // Long enough tasks that the parked workers get woken and take some.
        pool.run(64, &|_| {
            std::thread::sleep(Duration::from_millis(2));
            who.lock().unwrap().insert(std::thread::current().name().map(str::to_string));
        })
        .unwrap();
        assert!(who.lock().unwrap().len() > 1, "only the caller worked");
    }

    #[test]
    fn a_panicking_task_is_an_error_and_the_pool_goes_on() {
        let pool = SpinPool::new(3, "t").unwrap();
        let r = pool.run(10, &|i| {
            if i == 7 {
                panic!("task 7");
            }
        });
        assert_eq!(r, Err(PoolError::Panicked));
        assert_eq!(pool.run(MAX_TASKS + 1, &|_| ()), Err(PoolError::TooManyTasks(MAX_TASKS + 1)));
        let n = AtomicUsize::new(0);
        pool.run(10, &|_| {
            n.fetch_add(1, Relaxed);
        })
        .unwrap();
        assert_eq!(n.load(Relaxed), 10);
    }

    #[test]
    fn the_job_word_keeps_its_fields_apart() {
        let s = pack(0xab_cdef, 77, 5);
        assert_eq!((epoch_of(s), n_of(s), next_of(s)), (0xab_cdef, 77, 5));
        assert_eq!(next_of(s + 1), 6);
        assert_eq!(epoch_of(pack(1 << 24, 1, 0)), 0, "the epoch wraps");
    }
}
