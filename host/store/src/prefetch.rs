//! Cross-layer prefetch: predicted slabs for a coming layer are read by a
//! background thread into the host cache.
//!
//! Bounded twice: the queue (queued + being read) never exceeds
//! `max_requests` slabs or `max_bytes`, so a prefill predicting hundreds of
//! experts cannot flood the disk ahead of demand reads; and a prefetch only
//! takes cache room that is not pinned by a step (it never waits for room).
//! A failed prefetch read is counted and logged at debug level: the step that
//! needs the slab reads it again and reports the error itself.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::catalog::SlabId;
use crate::error::{Result, StoreError};
use crate::host_cache::Owner;
use crate::reader::{DiskReader, SlabRead};
use crate::store::{lock, Backing, Shared};

/// Caps on outstanding prefetch work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefetchLimits {
    pub max_requests: usize,
    pub max_bytes: u64,
}

impl Default for PrefetchLimits {
    fn default() -> Self {
        PrefetchLimits { max_requests: 256, max_bytes: 512 << 20 }
    }
}

#[derive(Default)]
struct Queue {
    items: VecDeque<(SlabId, u64)>,
    /// Queued plus being read.
    outstanding: usize,
    outstanding_bytes: u64,
    busy: bool,
    stop: bool,
}

struct Control {
    q: Mutex<Queue>,
    cv: Condvar,
}

pub(crate) struct PrefetchWorker {
    ctl: Arc<Control>,
    shared: Arc<Shared>,
    limits: PrefetchLimits,
    handle: Option<JoinHandle<()>>,
}

impl PrefetchWorker {
    pub(crate) fn spawn(shared: Arc<Shared>, reader: DiskReader, limits: PrefetchLimits) -> Result<PrefetchWorker> {
        let ctl = Arc::new(Control { q: Mutex::new(Queue::default()), cv: Condvar::new() });
        let (c, s) = (ctl.clone(), shared.clone());
        let handle = std::thread::Builder::new()
            .name("pulsar-prefetch".into())
            .spawn(move || run(c, s, reader))
            .map_err(|source| StoreError::Backend { backend: "prefetch thread", source })?;
        Ok(PrefetchWorker { ctl, shared, limits, handle: Some(handle) })
    }

    /// Queue the slabs of `experts` (known to exist) of `layer`.
    pub(crate) fn enqueue(&self, layer: u32, experts: &[u32]) -> usize {
        let Backing::Cached(cs) = &self.shared.backing else { return 0 };
        let cat = &self.shared.catalog;
        let mut todo = Vec::new();
        let (mut skipped, mut dropped) = (0, 0);
        {
            let cache = lock(&cs.cache);
            for &e in experts {
                let Some(t) = cat.triple(layer, e) else { continue };
                for id in t.slabs() {
                    if cache.contains(id) || cache.is_pending(id) {
                        skipped += 1;
                    } else if let Some(loc) = cat.get(id) {
                        todo.push((id, cs.cost(loc)));
                    }
                }
            }
        }
        let mut queued = 0;
        {
            let mut q = lock(&self.ctl.q);
            if q.stop {
                dropped += todo.len() as u64;
                todo.clear();
            }
            for (id, cost) in todo {
                if q.items.iter().any(|x| x.0 == id) {
                    skipped += 1;
                } else if q.outstanding + 1 > self.limits.max_requests || q.outstanding_bytes + cost > self.limits.max_bytes {
                    dropped += 1;
                } else {
                    q.items.push_back((id, cost));
                    q.outstanding += 1;
                    q.outstanding_bytes += cost;
                    queued += 1;
                }
            }
        }
        self.ctl.cv.notify_all();
        let mut c = lock(&self.shared.counters);
        c.prefetch.queued += queued as u64;
        c.prefetch.skipped += skipped;
        c.prefetch.dropped += dropped;
        queued
    }

    pub(crate) fn wait_idle(&self) {
        let mut q = lock(&self.ctl.q);
        while (q.busy || !q.items.is_empty()) && !q.stop {
            q = self.ctl.cv.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    pub(crate) fn shutdown(mut self) {
        lock(&self.ctl.q).stop = true;
        self.ctl.cv.notify_all();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Marks the worker stopped however it exits, so nobody waits on it forever.
struct StopOnExit(Arc<Control>);

impl Drop for StopOnExit {
    fn drop(&mut self) {
        let mut q = lock(&self.0.q);
        q.stop = true;
        q.busy = false;
        drop(q);
        self.0.cv.notify_all();
    }
}

fn run(ctl: Arc<Control>, shared: Arc<Shared>, mut reader: DiskReader) {
    let _stop = StopOnExit(ctl.clone());
    let Backing::Cached(cs) = &shared.backing else { return };
    let batch_max = 32;
    loop {
        let batch: Vec<(SlabId, u64)> = {
            let mut q = lock(&ctl.q);
            loop {
                if q.stop {
                    return;
                }
                if !q.items.is_empty() {
                    break;
                }
                q.busy = false;
                ctl.cv.notify_all();
                q = ctl.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            q.busy = true;
            let n = q.items.len().min(batch_max);
            q.items.drain(..n).collect()
        };
        let mut reqs = Vec::with_capacity(batch.len());
        // Only what this batch reserved may be cancelled on failure: a slab
        // skipped as pending belongs to someone else's read.
        let mut reserved: HashMap<SlabId, u64> = HashMap::new();
        let (mut skipped, mut dropped, mut failed) = (0u64, 0u64, 0u64);
        {
            let mut cache = lock(&cs.cache);
            for &(id, cost) in &batch {
                if cache.contains(id) || cache.is_pending(id) {
                    skipped += 1;
                    continue;
                }
                match cache.reserve(id, cost, Owner::Prefetch) {
                    Ok(Some(buf)) => match shared.catalog.get(id) {
                        Some(&loc) => {
                            reserved.insert(id, cost);
                            reqs.push(SlabRead { id, loc, buf });
                        }
                        None => cache.cancel(id, cost, Owner::Prefetch, Some(buf)),
                    },
                    Ok(None) => dropped += 1,
                    Err(_) => failed += 1,
                }
            }
        }
        let (mut read, mut bytes) = (0u64, 0u64);
        let t0 = Instant::now();
        let n_reqs = reqs.len() as u64;
        let res = if reqs.is_empty() {
            Ok(())
        } else {
            reader.read(reqs, &mut |data| {
                let id = data.id();
                bytes += data.bytes().len() as u64;
                read += 1;
                let cost = reserved.remove(&id).unwrap_or(0);
                lock(&cs.cache).fill(data, cost, Owner::Prefetch, false);
                cs.changed.notify_all();
                Ok(())
            })
        };
        let seconds = t0.elapsed().as_secs_f64();
        if let Err(e) = res {
            tracing::debug!("prefetch read failed (the step needing it will retry): {e}");
            failed += n_reqs - read;
            let mut cache = lock(&cs.cache);
            for (&id, &cost) in &reserved {
                cache.cancel(id, cost, Owner::Prefetch, None);
            }
        }
        cs.changed.notify_all();
        {
            let mut c = lock(&shared.counters);
            let p = &mut c.prefetch;
            p.skipped += skipped;
            p.dropped += dropped;
            p.failed += failed;
            p.read += read;
            p.bytes += bytes;
            p.seconds += seconds;
        }
        let mut q = lock(&ctl.q);
        for &(_, cost) in &batch {
            q.outstanding -= 1;
            q.outstanding_bytes -= cost;
        }
        drop(q);
        ctl.cv.notify_all();
    }
}
