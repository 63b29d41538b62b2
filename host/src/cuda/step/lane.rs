//! The CPU lane's part of a decode MoE layer on the GPU path: whole cold
//! experts and the heads of split ones, computed from host bytes while the
//! GPU runs the rest, their outputs queued into the step's buffers, and the
//! lane's work accounted in the pool and the cost model.

use pulsar_cuda::DeviceBuf;
use pulsar_plugin_api::MoeSpec;

use super::{err, CudaStep, R};
use crate::cpu::act_of;
use crate::cuda::{CudaBackendError, ExpertPool};

impl<'a> CudaStep<'a> {
    /// Expert `e`'s host bytes of weight `wi` (slab kind `kind`) of `layer`,
    /// for the CPU lane: from the store's step, or the file mapping.
    fn lane_slab<'g>(&'g self, layer: u32, wi: usize, kind: pulsar_store::SlabKind, guard: Option<&'g pulsar_store::StepGuard<'_>>, e: u32) -> R<crate::cold::Slab<'g>> {
        let model = self.model;
        let w = &model.weights[wi];
        let bytes = match guard {
            Some(g) => g.slab(pulsar_store::SlabId::new(layer, kind, e)).ok_or_else(|| format!("layer {layer} expert {e}: not resolved"))?,
            None => {
                let range = model.file.expert_slab(model.tensor(w), e as u64).map_err(err)?;
                model.file.bytes(&range).map_err(err)?
            }
        };
        Ok(crate::cold::Slab { ty: w.ty, bytes })
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
            let gate = self.lane_slab(spec.layer, widx[0], pulsar_store::SlabKind::Gate, None, e)?;
            let up = self.lane_slab(spec.layer, widx[1], pulsar_store::SlabKind::Up, None, e)?;
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
