//! The fused MoE op on the CUDA step: router and top-k on the device, the
//! selected experts resolved through the VRAM pool (resident, hot set,
//! scratch uploads, zero-copy reads, the CPU lane), the expert FFNs, and the
//! slot combine.

use pulsar_cuda::{DeviceBuf, Gating as CGating, MoePairs, RouterSpec};

use super::super::CudaModel;
use super::{err, CudaStep, HEAD_GRANULE, R};
use crate::cpu::act_of;
use crate::graph::{Gating, MoeSpec};
use pulsar_kernels::ActFormat;
use pulsar_plugin_api::{Val, Wt};

/// Most rows a MoE op on resident experts runs pair by pair (see do_moe):
/// measured on the 48-layer q2_K twin, 4 and 8 rows prefill 21% faster pair
/// by pair, while 16-row decode steps of 16 sequences served slower than grouped.
const PAIR_ROWS_MAX: usize = 8;

fn cgating(g: Gating) -> CGating {
    match g {
        Gating::Softmax => CGating::Softmax,
        Gating::Sigmoid => CGating::Sigmoid,
    }
}

impl<'a> CudaStep<'a> {
    /// A selection bias as its device vector.
    fn bias_values(&self, w: Option<Wt>) -> R<Option<&'a DeviceBuf<f32>>> {
        let Some(w) = w else { return Ok(None) };
        let (dw, mw) = self.weight(w)?;
        dw.f32.as_ref().map(Some).ok_or_else(|| format!("{} is not a vector", mw.name))
    }

    /// The MoE op on `x`: routed by `spec`'s router on the device, or, with
    /// `given`, by the ids (i32) and weights the graph computed (then the
    /// spec's router, gating, bias and scale are not read).
    pub(super) fn do_moe(&mut self, x: Val, spec: &MoeSpec, given: Option<(Val, Val)>) -> R<Val> {
        let cm: &'a CudaModel = self.cm;
        let dev = &cm.dev;
        let stream = dev.compute().clone();
        let (rows, d_model) = self.dims(x)?;
        let (ne, k) = (spec.n_expert as usize, spec.top_k as usize);
        // Router scores on the device, top-k there too.
        let logits = match given {
            None => Some(self.linear_w(spec.router, x, &[])?),
            Some(_) => None,
        };
        let mut ids = self.pools.i32.take(dev, rows * k).map_err(err)?;
        let mut wts = self.pools.f32.take(dev, rows * k).map_err(err)?;
        let rs = RouterSpec { k, gating: cgating(spec.gating), renormalize: spec.norm_topk, scale: spec.weights_scale };
        let bias = self.bias_values(spec.bias)?;
        let n_pairs = rows * k;
        let ws = [spec.gate_exps, spec.up_exps, spec.down_exps];
        let widx = [self.weight_index(ws[0])?, self.weight_index(ws[1])?, self.weight_index(ws[2])?];
        let (gdw, _) = self.weight(spec.gate_exps)?;
        let (ddw, _) = self.weight(spec.down_exps)?;
        let (gate_ty, down_ty) = (gdw.ty, ddw.ty);
        let ff = gdw.dims[1] as usize;
        let fmt_of = |t: pulsar_gguf::GgmlType| ActFormat::for_weight(t).ok_or_else(|| format!("no CUDA expert kernel for {t}"));
        let (gfmt, dfmt) = (fmt_of(gate_ty)?, fmt_of(down_ty)?);
        // Float experts: f32 activations, one format for all three matrices.
        let float = gfmt == ActFormat::F32;
        if float != (dfmt == ActFormat::F32) || (float && gate_ty != down_ty) {
            return Err(format!("moe layer {}: CUDA expert kernels need one float format or two quantized ones, not {gate_ty}/{down_ty}", spec.layer));
        }
        let resident: Option<[&DeviceBuf<u64>; 3]> = match widx.map(|i| cm.expert_tables.get(&i)) {
            [Some(g), Some(u), Some(d)] => Some([g, u, d]),
            _ => None,
        };
        // Prefill chunks of quantized experts go expert by expert (each weight
        // read once per tile of its tokens); decode goes pair by pair. So do
        // a few rows on resident experts (a batched decode step of several
        // sequences, a short prompt): grouping needs the routing on the host,
        // three stream syncs a layer that cost more than the pairs' repeated
        // weight reads. Both paths sum in the GEMV's order: the same bits.
        let grouped = rows > 1 && !float && !(resident.is_some() && rows <= PAIR_ROWS_MAX);
        let mut pbufs = Vec::with_capacity(3);
        for _ in 0..3 {
            pbufs.push(self.pools.u64.take(dev, n_pairs).map_err(err)?);
        }
        {
            let [pg, pu, pd] = &mut pbufs[..] else { unreachable!("three pointer buffers") };
            match (given, logits) {
                (Some((gi, gw)), _) => {
                    for (src, dst) in [(gi, ids.device_ptr()), (gw, wts.device_ptr())] {
                        let (r, c) = self.dims(src)?;
                        if r * c != n_pairs {
                            return Err(format!("experts layer {}: {} routing values for {rows} rows of {k}", spec.layer, r * c));
                        }
                        self.copy_rows(dst, self.buf(src)?.device_ptr(), n_pairs * 4)?;
                    }
                    if let (Some(tables), false) = (resident, grouped) {
                        dev.moe_gather_ptrs(&stream, &ids, tables, [pg, pu, pd]).map_err(err)?;
                    }
                }
                (None, Some(logits)) => match resident {
                    // Decode on resident experts: the router kernel gathers the
                    // pairs' pointers too (no host round trip, one kernel).
                    Some(tables) if !grouped => dev.route_gather(&stream, &rs, self.buf(logits)?, bias, rows, ne, &mut ids, &mut wts, tables, [pg, pu, pd]),
                    _ => dev.route(&stream, &rs, self.buf(logits)?, bias, rows, ne, &mut ids, &mut wts),
                }
                .map_err(err)?,
                (None, None) => unreachable!("the router ran when no routing was given"),
            }
        }
        self.mark(Some(&|| "moe: expert placement".to_string()));
        // Host copies, when the host takes part: routing ids, and each
        // selected expert's (gate, up, down) device addresses.
        let mut h_ids: Vec<i32> = Vec::new();
        let mut host_ptrs: Vec<[u64; 3]> = Vec::new();
        // Prefill with prefetch: the next layer's predicted experts, their
        // weights and slab kinds, for the copies that wait for this layer's kernels.
        let mut prefetch_rest: Option<(Vec<u32>, Vec<usize>, [pulsar_store::SlabKind; 3])> = None;
        // The store's step (streamed experts through the host cache): alive
        // until the uploads and the CPU lane have read its bytes.
        let mut guard: Option<pulsar_store::StepGuard<'a>> = None;
        // Cold experts the CPU lane computes this step, and the slab kinds.
        let mut lane_experts: Vec<u32> = Vec::new();
        let mut lane_x: Vec<f32> = Vec::new();
        // (expert, rows): gate/up heads the CPU lane computes this step.
        let mut lane_heads: Vec<(u32, usize)> = Vec::new();
        let mut layer_kinds = [pulsar_store::SlabKind::Gate; 3];
        // A prefill chunk routed to more cold slabs than the scratch holds:
        // its fill and grouped kernels run in passes (at the kernels below).
        let mut passes: Option<Passes> = None;
        let [pg, pu, pd] = &mut pbufs[..] else { unreachable!("three pointer buffers") };
        match resident {
            Some(_) => {
                if grouped {
                    h_ids = vec![0i32; n_pairs];
                    ids.download(&stream, &mut h_ids).map_err(err)?;
                    host_ptrs = (0..ne)
                        .map(|e| -> R<[u64; 3]> {
                            let mut p = [0u64; 3];
                            for (ki, &i) in widx.iter().enumerate() {
                                let (dw, mw) = (&cm.weights[i], &self.model.weights[i]);
                                let slab = (mw.bytes / dw.dims.get(2).copied().unwrap_or(1).max(1)) as usize;
                                p[ki] = dw.raw.as_ref().ok_or("resident expert without bytes")?.device_ptr_at(e * slab).map_err(err)?;
                            }
                            Ok(p)
                        })
                        .collect::<R<_>>()?;
                }
                // Else: everything is on the device, gathered by the router above.
            }
            None => {
                let pool = cm.experts.as_ref().ok_or("experts are neither resident nor pooled")?;
                // Decode: predict the next layer's experts with its router on
                // this layer's input, so their cold slabs can be copied while
                // this layer computes (the store path's guard cannot outlive
                // the layer, so only the page-locked mapping prefetches).
                let pays = pool.lock().unwrap_or_else(|e| e.into_inner()).prefetch_pays();
                // Prefill predicts too (its whole next-layer set is copied
                // while this layer computes); repetitive text routes a chunk to
                // few experts, so "every expert" would waste the link.
                // The next layer's routing, as its graph has it (same width
                // of choice, else no prediction).
                let next_spec = match (self.store, cm.prefetch && (rows > 1 || pays)) {
                    (None, true) => self.graph.moe_of_layer(spec.layer + 1).map(|m| m.spec).filter(|n| n.top_k == spec.top_k && n.n_expert == spec.n_expert),
                    _ => None,
                };
                let mut next = None;
                if let Some(ns) = next_spec {
                    let nl = self.linear_w(ns.router, x, &[])?;
                    let mut idn = self.pools.i32.take(dev, rows * k).map_err(err)?;
                    let mut wn = self.pools.f32.take(dev, rows * k).map_err(err)?;
                    let nrs = RouterSpec { gating: cgating(ns.gating), renormalize: ns.norm_topk, scale: ns.weights_scale, ..rs };
                    dev.route(&stream, &nrs, self.buf(nl)?, self.bias_values(ns.bias)?, rows, ne, &mut idn, &mut wn).map_err(err)?;
                    next = Some((idn, wn));
                }
                h_ids = vec![0i32; n_pairs];
                // Decode with a lane: its input comes back with the routing ids.
                let lane_may = rows == 1 && cm.lane.is_some() && !grouped;
                if lane_may {
                    pool.lock().unwrap_or_else(|e| e.into_inner()).stage_lane_input(dev, self.buf(x)?).map_err(err)?;
                }
                // Synchronises the stream: earlier layers' expert kernels are
                // done, so their scratch and evicted slots may be reused.
                let t_route = std::time::Instant::now();
                ids.download(&stream, &mut h_ids).map_err(err)?;
                let route_wait = t_route.elapsed().as_secs_f64();
                let mut predicted: Vec<u32> = Vec::new();
                if let Some((idn, wn)) = next {
                    let mut h = vec![0i32; rows * k];
                    let r = idn.download(&stream, &mut h);
                    self.pools.i32.give(idn);
                    self.pools.f32.give(wn);
                    r.map_err(err)?;
                    predicted = h.into_iter().filter(|&e| e >= 0 && (e as usize) < ne).map(|e| e as u32).collect();
                    predicted.sort_unstable();
                    predicted.dedup();
                }
                if let Some(&e) = h_ids.iter().find(|&&e| e < 0 || e as usize >= ne) {
                    return Err(format!("moe layer {}: router chose expert {e} of {ne}", spec.layer));
                }
                // The layer before's lane job is done (the stream waited for
                // it before this sync): account it before this layer's plan.
                self.join_lane()?;
                let touched: Vec<u32> = h_ids.iter().map(|&e| e as u32).collect();
                let mut experts = touched.clone();
                experts.sort_unstable();
                experts.dedup();
                let mut kinds = [pulsar_store::SlabKind::Gate; 3];
                for (ki, &i) in widx.iter().enumerate() {
                    let w = &self.model.weights[i];
                    kinds[ki] = crate::cpu::moe::slab_kind(&w.name).ok_or_else(|| format!("{}: not an expert tensor", w.name))?;
                }
                let model = self.model;
                let req0 = super::super::LayerRequest { layer: spec.layer, kinds, experts: &experts, touched: &touched, zero_copy: &[], cpu: &[], heads: &[], decode: rows == 1 };
                let mut pool = pool.lock().unwrap_or_else(|e| e.into_inner());
                if self.store.is_none() && cm.prefetch {
                    pool.enable_prefetch(k);
                }
                let plan = pool.plan_layer(&req0).map_err(err)?;
                pool.stats.route_wait_seconds += route_wait;
                // Who waited for whom in the layer before: steer the lane's share.
                let (busy, chain) = pool.take_layer_outcome();
                let copies = pool.take_copy_span().filter(|_| rows == 1);
                if busy.is_some() || chain.is_some() || copies.is_some() {
                    let mut cost = cm.cost.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some((bytes, secs)) = copies {
                        cost.observe_link(bytes, secs);
                    }
                    if let Some(link_busy) = busy {
                        cost.balance(link_busy);
                    }
                    if let Some(c) = chain {
                        cost.observe_chain(c);
                    }
                }
                use crate::cold::{ColdPath, ColdPolicy};
                let policy = if cm.lane.is_none() && cm.cold == ColdPolicy::Force(ColdPath::Cpu) { ColdPolicy::Force(ColdPath::Upload) } else { cm.cold };
                let lane_on = cm.lane.is_some() && matches!(policy, ColdPolicy::Auto | ColdPolicy::Force(ColdPath::Cpu));
                let expert_bytes = |ws: &[usize]| -> u64 { ws.iter().map(|&i| self.model.weights[i].bytes / ne as u64).sum() };
                // Bytes of `r` rows of this layer's gate (= up) slab.
                let gate_row = pulsar_kernels::quant::row_bytes(gate_ty, d_model).unwrap_or(0);
                let head_bytes = |r: usize| r * gate_row;
                // A layer's head geometry (gate + up bytes of a row, ff, one
                // slab's row bytes), if gate and up share one type.
                let next_head = |ws: &[usize]| -> Option<(u64, usize, usize)> {
                    // Gate and up fused in one slab: a head would need rows of both halves.
                    if ws[0] == ws[1] {
                        return None;
                    }
                    let (g, u) = (&self.model.weights[ws[0]], &self.model.weights[ws[1]]);
                    let row = pulsar_kernels::quant::row_bytes(g.ty, *g.dims.first()? as usize).ok()?;
                    (g.ty == u.ty && g.dims == u.dims).then_some((2 * row as u64, *g.dims.get(1)? as usize, row))
                };
                let as_cold = |experts: &[u32], bytes: u64| -> Vec<crate::cold::ColdExpert> {
                    experts.iter().map(|&expert| crate::cold::ColdExpert { expert, bytes, ty: gate_ty, in_host_memory: true }).collect()
                };
                // Decode: split the cold experts between the link (upload or
                // zero-copy) and the CPU lane by measured cost. Experts the
                // last layer's prefetch left to the lane go there; the rest
                // are split around them. Prefill uploads: its grouped
                // products want the weights in VRAM.
                // Experts whose gate/up heads the last layer's prefetch left
                // to the lane (their other rows and down are on the device).
                let heads: Vec<(u32, usize)> = if !grouped && !float && lane_on && policy == ColdPolicy::Auto && widx[0] != widx[1] { pool.heads_ready(spec.layer, kinds, &experts) } else { Vec::new() };
                let head_experts: Vec<u32> = heads.iter().map(|h| h.0).collect();
                let (mut zero_copy, mut cpu) = (Vec::new(), Vec::new());
                if !grouped && !plan.cold.is_empty() {
                    let reserved = pool.lane_reserved(spec.layer);
                    let (kept, rest): (Vec<u32>, Vec<u32>) = plan.cold.iter().partition(|e| lane_on && reserved.binary_search(e).is_ok());
                    let cost = cm.cost.lock().unwrap_or_else(|e| e.into_inner());
                    let bytes = expert_bytes(&widx);
                    let kept_cold = as_cold(&kept, bytes);
                    let head_bytes: u64 = heads.iter().map(|&(_, r)| head_bytes(r) as u64 * 2).sum();
                    let mut busy = crate::cold::Busy { link: 0.0, cpu: crate::cold::lane_seconds(&kept_cold, &vec![ColdPath::Cpu; kept.len()], &cost).1 };
                    if head_bytes > 0 {
                        busy.cpu += cost.cpu_fixed() + cost.seconds(ColdPath::Cpu, head_bytes, gate_ty);
                    }
                    let rest_cold = as_cold(&rest, bytes);
                    let paths = crate::cold::split_busy(&rest_cold, &cost, policy, busy);
                    cpu = kept;
                    for (c, p) in rest_cold.iter().zip(paths) {
                        match p {
                            ColdPath::ZeroCopy => zero_copy.push(c.expert),
                            ColdPath::Cpu if lane_on => cpu.push(c.expert),
                            _ => {}
                        }
                    }
                    zero_copy.sort_unstable();
                    cpu.sort_unstable();
                }
                if !grouped && lane_on && cpu.is_empty() && heads.is_empty() {
                    cm.cost.lock().unwrap_or_else(|e| e.into_inner()).relax();
                }
                // The lane reads this layer's input on the host; the stream
                // is idle here (the routing ids just came back), so this
                // copy costs no wait, and the lane can run beside the GPU.
                let mut x_host = Vec::new();
                if !cpu.is_empty() || !heads.is_empty() {
                    x_host = pool.lane_input().to_vec();
                    if !lane_may || x_host.len() != rows * d_model {
                        x_host = vec![0f32; rows * d_model];
                        self.buf(x)?.download(&stream, &mut x_host).map_err(err)?;
                    }
                }
                // Heads start now, on the lane's driver, while the host copies and queues.
                let heads_async = !heads.is_empty() && pool.async_lane();
                if heads_async {
                    // A copy: whole cold experts of this layer run on the lane after it (16 KB).
                    self.submit_heads(&mut pool, spec, x_host.clone(), &h_ids, &heads, widx, ff)?;
                }
                let req = super::super::LayerRequest { zero_copy: &zero_copy, cpu: &cpu, heads: &head_experts, ..req0 };
                let need = &plan.need;
                let split = if grouped { pool.passes(&req).map_err(err)? } else { Vec::new() };
                if split.len() > 1 {
                    // No prefetch: the next layer's copies would take the slots the passes reuse.
                    passes = Some(Passes { ranges: split, experts: experts.clone(), kinds });
                }
                match self.store.filter(|_| !need.is_empty() && passes.is_none()) {
                    // Tier 3/4: what VRAM lacks comes through the host cache
                    // (page-locked) over the disk; the guard keeps those bytes
                    // alive until the copies and the CPU lane are done with them.
                    Some(st) => {
                        let sel: Vec<pulsar_store::Selection> =
                            h_ids.iter().enumerate().map(|(p, &e)| pulsar_store::Selection { token: (p / k) as u32, slot: (p % k) as u32, expert: e as u32 }).collect();
                        // Places first, then each slab's copy starts the moment
                        // the store has its bytes (a host-cache hit at once, a
                        // disk read as it completes), overlapping the rest.
                        let plan = pool.assign_layer(dev, &req, None).map_err(err)?;
                        let r = st.store.resolve_streaming(spec.layer, &sel, &|e| need.binary_search(&e).is_ok(), &mut |id, b| {
                            pool.copy_slab(dev, &plan, id, b).map_err(|e| e.to_string())
                        });
                        if r.is_err() {
                            // Nothing may still read host bytes the failed step released.
                            let _ = pool.wait_copies();
                        }
                        let g = r.map_err(err)?;
                        let g = guard.insert(g);
                        if let Some(&(id, ..)) = plan.copies.iter().find(|c| g.slab(c.0).is_none()) {
                            return Err(format!("{id}: not resolved by the store"));
                        }
                        pool.finish_fill(dev, plan).map_err(err)?;
                    }
                    None if passes.is_some() => {}
                    None => {
                        pool.fill_layer(dev, &req, &|ki, e| slab_bytes(model, widx[ki], e))
                        .map_err(err)?;
                        let nw: Option<Vec<usize>> = kinds.iter().map(|&kd| cm.slab_index.get(&(spec.layer + 1, kd)).copied()).collect();
                        if let (false, Some(nw)) = (predicted.is_empty(), nw) {
                            // Decode: the predicted cold experts the lane would
                            // finish before the link are left to it (they then
                            // never cross the link); the link copies the rest.
                            let mut lane_next = Vec::new();
                            if rows == 1 && lane_on && pool.prefetch_enabled() {
                                let next_cold = as_cold(&pool.cold_of(spec.layer + 1, kinds, &predicted), expert_bytes(&nw));
                                let cost = cm.cost.lock().unwrap_or_else(|e| e.into_inner());
                                lane_next = match policy {
                                    // Forced: the lane takes them whole.
                                    ColdPolicy::Force(_) => next_cold.iter().map(|c| (c.expert, super::super::pool::LaneShare::Whole)).collect(),
                                    // Auto: the same head of each, sized so the
                                    // lane and the link finish together.
                                    ColdPolicy::Auto => match next_head(&nw) {
                                        Some((gu_row, ff_next, row)) if !float => {
                                            // Beside the host, the lane adds to no host work.
                                            let serial = if pool.async_lane() { 0.0 } else { cost.chain_s };
                                            let r = crate::cold::head_rows(&next_cold, gu_row, ff_next, HEAD_GRANULE, serial, &cost);
                                            if r == 0 { Vec::new() } else { next_cold.iter().map(|c| (c.expert, super::super::pool::LaneShare::Head { rows: r, bytes: r * row })).collect() }
                                        }
                                        _ => Vec::new(),
                                    },
                                };
                            }
                            pool.prefetch_layer(dev, spec.layer + 1, rows == 1, kinds, &predicted, &lane_next, &|ki, e| slab_bytes(model, nw[ki], e))
                            .map_err(err)?;
                            if grouped {
                                prefetch_rest = Some((std::mem::take(&mut predicted), nw, kinds));
                            }
                        }
                    }
                }
                lane_experts = cpu;
                lane_heads = heads;
                lane_x = x_host;
                layer_kinds = kinds;
                if grouped {
                    host_ptrs = host_ptrs_of(&pool, ne);
                } else {
                    let table = pool.tables();
                    dev.moe_gather_ptrs(&stream, &ids, [&table[0], &table[1], &table[2]], [pg, pu, pd]).map_err(err)?;
                }
            }
        }
        self.mark(Some(&|| format!("moe: experts {}", if grouped { "grouped" } else { "per pair" })));
        let mut out = self.pools.f32.take(dev, n_pairs * d_model).map_err(err)?;
        if float {
            let mut h = self.pools.f32.take(dev, n_pairs * ff).map_err(err)?;
            let pairs = MoePairs { gate: &pbufs[0], up: &pbufs[1], down: &pbufs[2], n_tok: rows, n_slot: k };
            let r = dev.moe_ffn_float(&stream, gate_ty, &pairs, self.buf(x)?, d_model, ff, act_of(spec.act), &mut h, &mut out);
            self.pools.f32.give(h);
            r.map_err(err)?;
            if !lane_experts.is_empty() {
                self.run_lane(spec, &lane_x, &h_ids, &lane_experts, layer_kinds, widx, guard.as_ref(), &mut out)?;
            }
        } else if grouped {
            // Pairs sorted by expert (stable: pair order within an expert).
            let mut order: Vec<usize> = (0..n_pairs).collect();
            order.sort_by_key(|&p| h_ids[p]);
            let g = Grouped { gate_ty, down_ty, gfmt, dfmt, d_model, ff, k, ne };
            match passes.take() {
                None => self.grouped_ffn(x, spec, &g, &h_ids, &order, &host_ptrs, &mut out)?,
                Some(ps) => self.grouped_passes(x, spec, &g, &h_ids, &order, &ps, widx, &mut out)?,
            }
            if let (Some((predicted, nw, kinds)), Some(pool)) = (prefetch_rest.take(), &cm.experts) {
                let model = self.model;
                pool.lock().unwrap_or_else(|e| e.into_inner())
                    .prefetch_rest(dev, spec.layer + 1, kinds, &predicted, &|ki, e| slab_bytes(model, nw[ki], e))
                    .map_err(err)?;
            }
        } else {
            let xqi = self.quantized(x, gfmt)?;
            let mut h = self.pools.f32.take(dev, n_pairs * ff).map_err(err)?;
            let mut hq = self.pools.u8.take(dev, pulsar_cuda::act_bytes(dfmt, n_pairs, ff).map_err(err)?).map_err(err)?;
            let pairs = MoePairs { gate: &pbufs[0], up: &pbufs[1], down: &pbufs[2], n_tok: rows, n_slot: k };
            // Split experts: each pair's first device row of h; the lane
            // fills the rows below while the GPU computes the rest.
            let row_lo = if lane_heads.is_empty() {
                None
            } else {
                let lo: Vec<i32> = h_ids.iter().map(|&e| lane_heads.iter().find(|h| h.0 as i32 == e).map_or(0, |h| h.1 as i32)).collect();
                let mut b = self.pools.i32.take(dev, n_pairs).map_err(err)?;
                let pool = cm.experts.as_ref().ok_or("heads without an expert pool")?;
                pool.lock().unwrap_or_else(|e| e.into_inner()).stage_row_lo(dev, &lo, &mut b).map_err(err)?;
                Some(b)
            };
            let mut lane_err = None;
            let r = {
                let (me, heads, xh, ids) = (&*self, &lane_heads, &lane_x, &h_ids);
                let mut fill = |h: &mut DeviceBuf<f32>| -> Result<(), pulsar_cuda::CudaError> {
                    if heads.is_empty() {
                        return Ok(());
                    }
                    // A pending job here is this layer's (the layer before's
                    // was joined at the routing sync): its copies go behind a
                    // wait for its flag, and the host does not wait.
                    if let (Some(p), Some(pool)) = (me.lane_pending.as_ref(), cm.experts.as_ref()) {
                        return pool.lock().unwrap_or_else(|e| e.into_inner()).queue_lane_output(dev, p.seq, &p.segs, h).map_err(|e| {
                            lane_err = Some(e.to_string());
                            pulsar_cuda::CudaError::Shape { op: "moe_ffn", what: "the cpu lane's heads could not be queued".into() }
                        });
                    }
                    me.lane_heads(spec, xh, ids, heads, widx, ff, h).map_err(|e| {
                        lane_err = Some(e);
                        pulsar_cuda::CudaError::Shape { op: "moe_ffn", what: "the cpu lane's heads failed".into() }
                    })
                };
                dev.moe_ffn_split(&stream, gate_ty, down_ty, &pairs, row_lo.as_ref(), &self.qcache[xqi].2, d_model, ff, act_of(spec.act), &mut h, &mut hq, &mut out, &mut fill)
            };
            if let Some(b) = row_lo {
                self.pools.i32.give(b);
            }
            self.pools.u8.give(hq);
            self.pools.f32.give(h);
            if let Some(e) = lane_err {
                return Err(e);
            }
            r.map_err(err)?;
            if !lane_experts.is_empty() {
                // The GPU works on its experts meanwhile; the lane's rows land
                // in `out` before the combine, which sums in slot order as ever.
                self.run_lane(spec, &lane_x, &h_ids, &lane_experts, layer_kinds, widx, guard.as_ref(), &mut out)?;
            }
        }
        if let Some(g) = guard.take() {
            if let Some(p) = &cm.experts {
                p.lock().unwrap_or_else(|e| e.into_inner()).wait_copies().map_err(err)?;
            }
            drop(g);
        }
        // Weighted sum over slots, in slot order, as the CPU backend does.
        self.mark(Some(&|| "moe: combine".to_string()));
        let y = self.combine(&out, &wts, rows, k, d_model);
        for b in pbufs {
            self.pools.u64.give(b);
        }
        self.pools.i32.give(ids);
        self.pools.f32.give(wts);
        self.pools.f32.give(out);
        y
    }

    /// The grouped expert FFN (prefill) over the pairs `order` (pair
    /// indices sorted by expert), writing their rows of `out`; the others
    /// are left as they are. `host_ptrs`: each expert's (gate, up, down)
    /// device addresses (a pair whose expert has a null one is skipped).
    #[allow(clippy::too_many_arguments)]
    fn grouped_ffn(&mut self, x: Val, spec: &MoeSpec, g: &Grouped, h_ids: &[i32], order: &[usize], host_ptrs: &[[u64; 3]], out: &mut DeviceBuf<f32>) -> R<()> {
        let dev = &self.cm.dev;
        let stream = dev.compute().clone();
        let (rows, _) = self.dims(x)?;
        let Grouped { gate_ty, down_ty, gfmt, dfmt, d_model, ff, k, ne } = *g;
        let n = order.len();
        let xqi = self.quantized(x, gfmt)?;
        let tok_of: Vec<i32> = order.iter().map(|&p| (p / k) as i32).collect();
        let pair_of: Vec<i32> = order.iter().map(|&p| p as i32).collect();
        let mut runs = Vec::new();
        let mut i = 0;
        while i < n {
            let e = h_ids[order[i]] as usize;
            let mut j = i;
            while j < n && h_ids[order[j]] as usize == e {
                j += 1;
            }
            let p = host_ptrs.get(e).copied().ok_or_else(|| format!("moe layer {}: router chose expert {e} of {ne}", spec.layer))?;
            if p.iter().all(|&a| a != 0) {
                runs.push(pulsar_cuda::ExpertRun { gate: p[0], up: p[1], down: p[2], start: i, len: j - i });
            }
            i = j;
        }
        let mut tb = self.pools.i32.take(dev, n).map_err(err)?;
        let mut pb = self.pools.i32.take(dev, n).map_err(err)?;
        tb.upload(&stream, &tok_of).map_err(err)?;
        pb.upload(&stream, &pair_of).map_err(err)?;
        let mut xs = self.pools.u8.take(dev, pulsar_cuda::act_bytes(gfmt, n, d_model).map_err(err)?).map_err(err)?;
        let mut hg = self.pools.f32.take(dev, n * ff).map_err(err)?;
        let mut hu = self.pools.f32.take(dev, n * ff).map_err(err)?;
        let mut h = self.pools.f32.take(dev, n * ff).map_err(err)?;
        let mut hq = self.pools.u8.take(dev, pulsar_cuda::act_bytes(dfmt, n, ff).map_err(err)?).map_err(err)?;
        let mut outs = self.pools.f32.take(dev, n * d_model).map_err(err)?;
        // Sized for the most runs a chunk can have (one per expert), so the pool
        // hands back one buffer instead of allocating one per distinct run count.
        let mut items = self.pools.u64.take(dev, pulsar_cuda::grouped_items_len(n, ne.min(n))).map_err(err)?;
        let mut scratch = pulsar_cuda::GroupedScratch { items: &mut items, xs: &mut xs, hg: &mut hg, hu: &mut hu, h: &mut h, hq: &mut hq, outs: &mut outs };
        let r = dev.moe_ffn_grouped(&stream, gate_ty, down_ty, &runs, &tb, &pb, &self.qcache[xqi].2, rows, d_model, ff, act_of(spec.act), &mut scratch, out);
        self.pools.i32.give(tb);
        self.pools.i32.give(pb);
        self.pools.u64.give(items);
        self.pools.u8.give(xs);
        self.pools.u8.give(hq);
        for b in [hg, hu, h, outs] {
            self.pools.f32.give(b);
        }
        r.map_err(err)
    }

    /// [`grouped_ffn`](Self::grouped_ffn) in passes whose cold slabs each fit
    /// the scratch ([`Passes`]): fill a pass's experts, run their pairs (a
    /// contiguous run of `order`), and before the next fill wait for the
    /// device to finish with the slots it reuses. Every pair's row is
    /// computed once, by the same kernel as in one pass: the same bits.
    #[allow(clippy::too_many_arguments)]
    fn grouped_passes(&mut self, x: Val, spec: &MoeSpec, g: &Grouped, h_ids: &[i32], order: &[usize], ps: &Passes, widx: [usize; 3], out: &mut DeviceBuf<f32>) -> R<()> {
        let cm: &'a CudaModel = self.cm;
        let model = self.model;
        let dev = &cm.dev;
        let stream = dev.compute().clone();
        let pool_m = cm.experts.as_ref().ok_or("moe passes without an expert pool")?;
        let mut at = 0;
        for (pi, range) in ps.ranges.iter().enumerate() {
            let experts = &ps.experts[range.clone()];
            let Some(&last) = experts.last() else { continue };
            if pi > 0 {
                // The last pass's kernels read the scratch slots this fill reuses.
                stream.synchronize().map_err(err)?;
            }
            let req = super::super::LayerRequest { layer: spec.layer, kinds: ps.kinds, experts, touched: &[], zero_copy: &[], cpu: &[], heads: &[], decode: false };
            let in_pass = |e: u32| experts.binary_search(&e).is_ok();
            let mut pool = pool_m.lock().unwrap_or_else(|e| e.into_inner());
            let mut guard = None;
            match self.store {
                Some(st) => {
                    let sel: Vec<pulsar_store::Selection> = h_ids
                        .iter()
                        .enumerate()
                        .filter(|&(_, &e)| in_pass(e as u32))
                        .map(|(p, &e)| pulsar_store::Selection { token: (p / g.k) as u32, slot: (p % g.k) as u32, expert: e as u32 })
                        .collect();
                    let plan = pool.assign_layer(dev, &req, None).map_err(err)?;
                    // Every expert of the pass: the layer's prefetch may have been dropped.
                    let r = st.store.resolve_streaming(spec.layer, &sel, &|e| in_pass(e), &mut |id, b| {
                        pool.copy_slab(dev, &plan, id, b).map_err(|e| e.to_string())
                    });
                    if r.is_err() {
                        let _ = pool.wait_copies();
                    }
                    let gd = guard.insert(r.map_err(err)?);
                    if let Some(&(id, ..)) = plan.copies.iter().find(|c| gd.slab(c.0).is_none()) {
                        return Err(format!("{id}: not resolved by the store"));
                    }
                    pool.finish_fill(dev, plan).map_err(err)?;
                }
                None => {
                    pool.fill_layer(dev, &req, &|ki, e| slab_bytes(model, widx[ki], e))
                    .map_err(err)?;
                }
            }
            let host_ptrs = host_ptrs_of(&pool, g.ne);
            drop(pool);
            let end = at + order[at..].iter().take_while(|&&p| h_ids[p] <= last as i32).count();
            self.grouped_ffn(x, spec, g, h_ids, &order[at..end], &host_ptrs, out)?;
            at = end;
            if let Some(gd) = guard.take() {
                pool_m.lock().unwrap_or_else(|e| e.into_inner()).wait_copies().map_err(err)?;
                drop(gd);
            }
        }
        if at != order.len() {
            return Err(format!("moe layer {}: the passes ran {at} of {} pairs", spec.layer, order.len()));
        }
        Ok(())
    }
}

/// What the grouped expert FFN needs of its layer.
#[derive(Clone, Copy)]
struct Grouped {
    gate_ty: pulsar_gguf::GgmlType,
    down_ty: pulsar_gguf::GgmlType,
    gfmt: ActFormat,
    dfmt: ActFormat,
    d_model: usize,
    ff: usize,
    k: usize,
    ne: usize,
}

/// A layer's fill in passes ([`super::super::ExpertPool::passes`]): ranges
/// of its distinct experts (ascending) and their slab kinds.
struct Passes {
    ranges: Vec<std::ops::Range<usize>>,
    experts: Vec<u32>,
    kinds: [pulsar_store::SlabKind; 3],
}

/// Each expert's (gate, up, down) device addresses from the pool's last fill.
fn host_ptrs_of(pool: &super::super::ExpertPool, ne: usize) -> Vec<[u64; 3]> {
    let t = pool.host_tables();
    (0..ne).map(|e| [t[0][e], t[1][e], t[2][e]]).collect()
}

/// Expert `e`'s slab of weight `w` in the model file (its mapping).
fn slab_bytes(model: &crate::model::Model, w: usize, e: u32) -> Result<&[u8], String> {
    let t = model.tensor(&model.weights[w]);
    let range = model.file.expert_slab(t, e as u64).map_err(err)?;
    model.file.bytes(&range).map_err(err)
}
