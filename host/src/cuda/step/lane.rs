//! The CPU lane's part of a decode MoE layer on the GPU path: whole cold
//! experts and the heads of split ones, computed from host bytes while the
//! GPU runs the rest, their outputs queued into the step's buffers, and the
//! lane's work accounted in the pool and the cost model.
//!
//! Heads run asynchronously where the device can wait on a host flag: the
//! job goes to the lane's driver thread as soon as the layer's routing is
//! known, the host goes on queueing the layer (the copies of the heads'
//! output sit behind a wait for the job's flag), and the job is joined, its
//! time accounted, at the next layer's routing sync or the step's end.

use std::sync::{Arc, Mutex};

use pulsar_cuda::DeviceBuf;
use crate::graph::MoeSpec;

use super::{err, CudaStep, R};
use crate::cold::driver::Ticket;
use crate::cpu::act_of;
use crate::cuda::{CudaBackendError, ExpertPool};

/// An asynchronous heads job in flight: what joining it needs, and where
/// its output goes (pairs' `(offset in h, rows)`, in the job's order).
pub(super) struct PendingLane {
    ticket: Ticket,
    /// The job's wall seconds, or why it failed; set before its flag rises.
    outcome: Arc<Mutex<Option<Result<f64, String>>>>,
    ty: pulsar_gguf::GgmlType,
    bytes: u64,
    pub(super) seq: u32,
    pub(super) segs: Vec<(usize, usize)>,
}

impl PendingLane {
    pub(super) fn ticket(&self) -> Ticket {
        self.ticket
    }
}

/// Raises a job's flag when dropped: at its end, or while a panic unwinds
/// (the stream waits on it with no timeout).
struct RaiseOnDrop<'o>(&'o crate::cuda::pool::LaneOutput);

impl Drop for RaiseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.raise();
    }
}

impl<'a> CudaStep<'a> {
    /// Expert `e`'s host bytes of weight `wi` (slab kind `kind`) of `layer`,
    /// for the CPU lane: from the store's step, or the file mapping.
    fn lane_slab<'g>(&'g self, layer: u32, wi: usize, kind: pulsar_store::SlabKind, guard: Option<&'g pulsar_store::StepGuard<'_>>, e: u32) -> R<crate::cold::Slab<'g>> {
        match guard {
            Some(g) => {
                let bytes = g.slab(pulsar_store::SlabId::new(layer, kind, e)).ok_or_else(|| format!("layer {layer} expert {e}: not resolved"))?;
                Ok(crate::cold::Slab { ty: self.model.weights[wi].ty, bytes })
            }
            None => self.mapped_slab(wi, e),
        }
    }

    /// Account a finished lane job (`bytes` of `ty` weights in `secs`) in the
    /// pool's statistics and the cost model, and queue its output's copy.
    fn lane_finished(&self, ty: pulsar_gguf::GgmlType, bytes: u64, secs: f64, upload: impl FnOnce(&mut ExpertPool) -> Result<(), CudaBackendError>) -> R<()> {
        let cm = self.cm;
        let mut pool = cm.experts.as_ref().ok_or("no expert pool")?.lock().unwrap_or_else(|e| e.into_inner());
        pool.note_lane_work(secs);
        pool.stats.cpu_lane_bytes += bytes;
        pool.stats.cpu_lane_seconds += secs;
        upload(&mut pool).map_err(err)?;
        drop(pool);
        cm.cost.lock().unwrap_or_else(|e| e.into_inner()).observe_cpu(ty, bytes, secs);
        Ok(())
    }

    /// Expert `e`'s host bytes of weight `wi`, from the file mapping, for as
    /// long as the model lives (an asynchronous job outlives this borrow).
    fn mapped_slab(&self, wi: usize, e: u32) -> R<crate::cold::Slab<'a>> {
        let model: &'a crate::model::Model = self.model;
        let w = &model.weights[wi];
        let range = model.file.expert_slab(model.tensor(w), e as u64).map_err(err)?;
        Ok(crate::cold::Slab { ty: w.ty, bytes: model.file.bytes(&range).map_err(err)? })
    }

    /// Start the CPU lane's heads of this decode layer's split experts on the
    /// lane's driver thread (see [`lane_heads`](Self::lane_heads) for what
    /// they are); `pool` is the layer's locked expert pool. The fill of `h`
    /// then queues their copies behind the job's flag
    /// ([`ExpertPool::queue_lane_output`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn submit_heads(&mut self, pool: &mut ExpertPool, spec: &MoeSpec, xh: Vec<f32>, h_ids: &[i32], heads: &[(u32, usize)], widx: [usize; 3], ff: usize) -> R<()> {
        let cm: &'a crate::cuda::CudaModel = self.cm;
        let lane: &'a crate::cold::CpuLane = cm.lane.as_ref().ok_or("no CPU lane")?;
        let d_model = cm.weights[widx[0]].dims[0] as usize;
        let k = (spec.top_k as usize).max(1);
        if xh.len() != h_ids.len() / k * d_model {
            return Err(format!("moe layer {}: lane input has {} values for {} rows of {d_model}", spec.layer, xh.len(), h_ids.len() / k));
        }
        // The previous job's staging must be free before it is handed out again.
        self.join_lane()?;
        let mut items = Vec::new();
        let mut segs = Vec::new();
        for (p, &e) in h_ids.iter().enumerate() {
            let Some(&(e, rows)) = heads.iter().find(|h| h.0 as i32 == e) else { continue };
            items.push((e, p / k, self.mapped_slab(widx[0], e)?, self.mapped_slab(widx[1], e)?, rows));
            segs.push((p * ff, rows));
        }
        let total: usize = segs.iter().map(|s| s.1).sum();
        let bytes: u64 = items.iter().map(|(_, _, g, u, rows)| ((g.bytes.len() + u.bytes.len()) as u64 * *rows as u64).checked_div(ff as u64).unwrap_or(0)).sum();
        let out = pool.reserve_lane_output(&cm.dev, total).map_err(err)?;
        let seq = out.seq;
        let outcome = Arc::new(Mutex::new(None));
        let put = outcome.clone();
        let act = act_of(spec.act);
        let t0 = std::time::Instant::now();
        let job = move || {
            {
                let _raise = RaiseOnDrop(&out);
                let pairs = items
                    .iter()
                    .map(|&(expert, t, gate, up, rows)| crate::cold::LaneHead { expert, x: &xh[t * d_model..(t + 1) * d_model], gate_up: crate::cold::GateUp::Split { gate, up }, rows })
                    .collect();
                let job = crate::cold::LaneHeadJob { d_model, ff, act, pairs };
                let r = lane.heads(&job).map_err(|e| e.to_string()).and_then(|y| {
                    // SAFETY: this job's reserved region, written once before the flag rises.
                    let v = unsafe { out.values() };
                    if v.len() != y.len() {
                        return Err(format!("{} head values for {} reserved", y.len(), v.len()));
                    }
                    v.copy_from_slice(&y);
                    Ok(t0.elapsed().as_secs_f64())
                });
                // The result is in place before the flag lets the stream (and a join) go.
                *put.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            }
        };
        // SAFETY: the job borrows the lane and the model's mapping (both live
        // for 'a) and the pool's staging (handed out again only after a join);
        // the step joins the ticket at the next layer, at its end, or on drop.
        let ticket = unsafe { lane.driver().submit(Box::new(job)) };
        self.lane_pending = Some(PendingLane { ticket, outcome, ty: self.model.weights[widx[0]].ty, bytes, seq, segs });
        Ok(())
    }

    /// Wait for the asynchronous lane job in flight, if any, and account it
    /// (or return why it failed).
    pub(super) fn join_lane(&mut self) -> R<()> {
        let Some(p) = self.lane_pending.take() else { return Ok(()) };
        let lane = self.cm.lane.as_ref().ok_or("no CPU lane")?;
        lane.driver().wait(p.ticket);
        let r = p.outcome.lock().unwrap_or_else(|e| e.into_inner()).take();
        let secs = r.unwrap_or_else(|| Err("the job ended without a result (it panicked)".into())).map_err(|e| format!("the CPU lane's heads: {e}"))?;
        self.lane_finished(p.ty, p.bytes, secs, |_| Ok(()))
    }

    /// The CPU lane's heads of this decode layer's split experts, written
    /// into their rows of `h` (on the compute stream, after the GPU's `h`
    /// kernel was queued): pair `p` with expert `e` of `heads` gets its rows
    /// `0..rows`. Weights come from the file mapping (heads exist only where
    /// the prefetch runs, which is the mapping's path).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn lane_heads(&self, spec: &MoeSpec, xh: &[f32], h_ids: &[i32], heads: &[(u32, usize)], widx: [usize; 3], ff: usize, h: &mut DeviceBuf<f32>) -> R<()> {
        let cm = self.cm;
        let lane = cm.lane.as_ref().ok_or("no CPU lane")?;
        let t0 = std::time::Instant::now();
        let d_model = cm.weights[widx[0]].dims[0] as usize;
        let k = (spec.top_k as usize).max(1);
        if xh.len() != h_ids.len() / k * d_model {
            return Err(format!("moe layer {}: lane input has {} values for {} rows of {d_model}", spec.layer, xh.len(), h_ids.len() / k));
        }
        let mut pairs = Vec::new();
        let mut segs = Vec::new();
        for (p, &e) in h_ids.iter().enumerate() {
            let Some(&(e, rows)) = heads.iter().find(|h| h.0 as i32 == e) else { continue };
            let t = p / k;
            let (gate, up) = (self.mapped_slab(widx[0], e)?, self.mapped_slab(widx[1], e)?);
            pairs.push(crate::cold::LaneHead { expert: e, x: &xh[t * d_model..(t + 1) * d_model], gate_up: crate::cold::GateUp::Split { gate, up }, rows });
            segs.push((p * ff, rows));
        }
        let job = crate::cold::LaneHeadJob { d_model, ff, act: act_of(spec.act), pairs };
        let bytes = job.weight_bytes();
        let y = lane.heads(&job).map_err(err)?;
        let secs = t0.elapsed().as_secs_f64();
        self.lane_finished(self.model.weights[widx[0]].ty, bytes, secs, |pool| pool.upload_lane_segments(&cm.dev, &y, &segs, h))
    }

    /// The CPU lane's share of a decode MoE layer, while the GPU runs the
    /// rest (its kernels are queued): `xh` is the layer's input on the host.
    /// The lane's rows land in `out` before the combine, which sums in slot
    /// order as ever.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_lane(
        &mut self,
        spec: &MoeSpec,
        xh: &[f32],
        h_ids: &[i32],
        experts: &[u32],
        kinds: [pulsar_store::SlabKind; 3],
        widx: [usize; 3],
        guard: Option<&pulsar_store::StepGuard<'_>>,
        out: &mut DeviceBuf<f32>,
    ) -> R<()> {
        let cm = self.cm;
        let lane = cm.lane.as_ref().ok_or("no CPU lane")?;
        let t0 = std::time::Instant::now();
        let d_model = cm.weights[widx[2]].dims[1] as usize;
        let model = self.model;
        let slab = |ki: usize, e: u32| self.lane_slab(spec.layer, widx[ki], kinds[ki], guard, e);
        let k = spec.top_k as usize;
        let ff = cm.weights[widx[0]].dims[1] as usize;
        if xh.len() != h_ids.len() / k.max(1) * d_model {
            return Err(format!("moe layer {}: lane input has {} values for {} rows of {d_model}", spec.layer, xh.len(), h_ids.len() / k.max(1)));
        }
        let mut pairs = Vec::new();
        let mut rows_of = Vec::new();
        for (p, &e) in h_ids.iter().enumerate() {
            let e = e as u32;
            if experts.binary_search(&e).is_err() {
                continue;
            }
            let t = p / k;
            pairs.push(crate::cold::LanePair {
                expert: e,
                x: &xh[t * d_model..(t + 1) * d_model],
                gate_up: crate::cold::GateUp::Split { gate: slab(0, e)?, up: slab(1, e)? },
                down: slab(2, e)?,
            });
            rows_of.push(p);
        }
        let job = crate::cold::LaneJob { d_model, ff, act: act_of(spec.act), pairs };
        let lane_bytes = job.weight_bytes();
        let y = lane.run(&job).map_err(err)?;
        let secs = t0.elapsed().as_secs_f64();
        // What the lane really achieved feeds the rate the next split reads.
        self.lane_finished(model.weights[widx[0]].ty, lane_bytes, secs, |pool| pool.upload_lane_rows(&cm.dev, &y, &rows_of, d_model, out))
    }
}

