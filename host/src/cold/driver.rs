//! One thread that runs the CPU lane's jobs while the host goes on.
//!
//! A decode layer's lane job (the heads of its split experts) used to run on
//! the host thread, which queued nothing for the GPU meanwhile: the lane's
//! time added to the layer's serial chain. The driver takes the job instead,
//! as the caller of the lane's [`SpinPool`](super::spin::SpinPool), and the
//! host queues the rest of the layer, the GPU waiting for the lane's output
//! on a flag. Like the pool's workers, the driver spins between jobs (a
//! wake-up costs tens of microseconds in a VM) and parks after a while.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::*};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long the idle driver spins before it parks.
const SPIN: Duration = Duration::from_millis(3);

type Task = Box<dyn FnOnce() + Send + 'static>;

struct Inner {
    /// The job waiting for the driver (at most one).
    slot: Mutex<Option<Task>>,
    wake: Condvar,
    /// Jobs submitted and jobs finished, counting from 1.
    submitted: AtomicU64,
    finished: AtomicU64,
    parked: AtomicBool,
    stop: AtomicBool,
}

/// A submitted job, to [`Driver::wait`] on.
#[must_use = "a job's borrows must outlive it: wait on its ticket"]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(u64);

pub struct Driver {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
}

impl Inner {
    fn run(&self) {
        let mut done = 0u64;
        loop {
            let since = Instant::now();
            let mut spins = 0u32;
            while self.submitted.load(Acquire) == done {
                if self.stop.load(Acquire) {
                    return;
                }
                std::hint::spin_loop();
                spins += 1;
                if spins.is_multiple_of(256) && since.elapsed() > SPIN {
                    let mut g = self.slot.lock().unwrap_or_else(|e| e.into_inner());
                    self.parked.store(true, SeqCst);
                    while self.submitted.load(SeqCst) == done && !self.stop.load(SeqCst) {
                        g = self.wake.wait_timeout(g, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0;
                    }
                    self.parked.store(false, SeqCst);
                    drop(g);
                    spins = 0;
                }
            }
            let task = self.slot.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(t) = task {
                // A job reports its own failures; a panic must not end the driver.
                let _ = catch_unwind(AssertUnwindSafe(t));
            }
            done += 1;
            self.finished.store(done, Release);
        }
    }
}

impl Driver {
    pub fn new(name: &str) -> std::io::Result<Driver> {
        let inner = Arc::new(Inner {
            slot: Mutex::new(None),
            wake: Condvar::new(),
            submitted: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            parked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let i = inner.clone();
        let thread = std::thread::Builder::new().name(name.to_string()).spawn(move || i.run())?;
        Ok(Driver { inner, thread: Some(thread) })
    }

    /// Run `job` on the driver thread, after any job before it.
    ///
    /// # Safety
    /// Whatever `job` borrows must stay alive and unaliased by writers until
    /// [`wait`](Self::wait) on the returned ticket has returned (dropping the
    /// driver also waits).
    pub unsafe fn submit<'s>(&self, job: Box<dyn FnOnce() + Send + 's>) -> Ticket {
        // SAFETY: the caller keeps the borrows alive until the job has run
        // (per this function's contract); only the lifetime is erased.
        let job: Task = unsafe { std::mem::transmute::<Box<dyn FnOnce() + Send + 's>, Task>(job) };
        // One job in the slot at a time: the one before must have been taken.
        let n = self.inner.submitted.load(Acquire);
        while self.inner.finished.load(Acquire) < n {
            std::hint::spin_loop();
        }
        let mut g = self.inner.slot.lock().unwrap_or_else(|e| e.into_inner());
        *g = Some(job);
        self.inner.submitted.store(n + 1, SeqCst);
        if self.inner.parked.load(SeqCst) {
            self.inner.wake.notify_all();
        }
        drop(g);
        Ticket(n + 1)
    }

    /// Whether the job of `t` has finished.
    pub fn is_done(&self, t: Ticket) -> bool {
        self.inner.finished.load(Acquire) >= t.0
    }

    /// Block until the job of `t` has finished (spinning: jobs are short).
    pub fn wait(&self, t: Ticket) {
        while !self.is_done(t) {
            std::hint::spin_loop();
        }
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // Jobs may borrow what outlives only this driver: let them finish.
        let n = self.inner.submitted.load(Acquire);
        self.wait(Ticket(n));
        self.inner.stop.store(true, SeqCst);
        {
            let _g = self.inner.slot.lock().unwrap_or_else(|e| e.into_inner());
            self.inner.wake.notify_all();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn jobs_run_in_order_and_tickets_say_when() {
        let d = Driver::new("t").unwrap();
        let log = Mutex::new(Vec::new());
        let mut last = None;
        let log_ref = &log;
        for i in 0..200 {
            // SAFETY: `log` outlives the wait below (`i` is moved in).
            let t = unsafe { d.submit(Box::new(move || log_ref.lock().unwrap().push(i))) };
            last = Some(t);
        }
        d.wait(last.unwrap());
        assert_eq!(*log.lock().unwrap(), (0..200).collect::<Vec<_>>());
    }

    #[test]
    fn the_host_goes_on_while_a_job_runs() {
        let d = Driver::new("t").unwrap();
        let gate = AtomicBool::new(false);
        let ran = AtomicUsize::new(0);
        // SAFETY: both outlive the wait below.
        let t = unsafe {
            d.submit(Box::new(|| {
                while !gate.load(Acquire) {
                    std::hint::spin_loop();
                }
                ran.fetch_add(1, SeqCst);
            }))
        };
        std::thread::sleep(Duration::from_millis(5));
        assert!(!d.is_done(t), "the job finished before it was let go");
        gate.store(true, Release);
        d.wait(t);
        assert_eq!(ran.load(SeqCst), 1);
    }

    #[test]
    fn a_parked_driver_wakes_and_a_panic_does_not_end_it() {
        let d = Driver::new("t").unwrap();
        std::thread::sleep(SPIN * 4);
        // SAFETY: borrows nothing.
        let t = unsafe { d.submit(Box::new(|| panic!("job"))) };
        d.wait(t);
        let n = AtomicUsize::new(0);
        // SAFETY: `n` outlives the wait below.
        let t = unsafe {
            d.submit(Box::new(|| {
                n.fetch_add(1, SeqCst);
            }))
        };
        d.wait(t);
        assert_eq!(n.load(SeqCst), 1);
    }
}
