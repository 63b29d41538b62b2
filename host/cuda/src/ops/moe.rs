//! The mixture-of-experts ops: top-k routing (with or without the pointer
//! gather), the per-pair expert FFN (quantized or float), the grouped
//! prefill FFN, the pointer gather and the slot combine.

use super::*;

impl CudaDevice {
    /// Top-k routing of `[n_tok, n_exp]` logits into `ids` / `weights`
    /// (`[n_tok, k]`). Twin: `ops::softmax_in_place` (or a sigmoid), `ops::top_k`,
    /// then renormalisation and scale.
    #[allow(clippy::too_many_arguments)]
    pub fn route(
        &self,
        stream: &CudaStream,
        spec: &RouterSpec,
        logits: &DeviceBuf<f32>,
        bias: Option<&DeviceBuf<f32>>,
        n_tok: usize,
        n_exp: usize,
        ids: &mut DeviceBuf<i32>,
        weights: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        self.route_with(stream, true, spec, logits, bias, n_tok, n_exp, ids, weights, None)
    }

    /// [`route`](Self::route), then each pair's (gate, up, down) slab pointers
    /// from per-expert tables, as [`moe_gather_ptrs`](Self::moe_gather_ptrs)
    /// gives them; one kernel where the one-warp router serves (<= 256 experts).
    #[allow(clippy::too_many_arguments)]
    pub fn route_gather(
        &self,
        stream: &CudaStream,
        spec: &RouterSpec,
        logits: &DeviceBuf<f32>,
        bias: Option<&DeviceBuf<f32>>,
        n_tok: usize,
        n_exp: usize,
        ids: &mut DeviceBuf<i32>,
        weights: &mut DeviceBuf<f32>,
        tables: [&DeviceBuf<u64>; 3],
        ptrs: [&mut DeviceBuf<u64>; 3],
    ) -> Result<(), CudaError> {
        self.route_with(stream, true, spec, logits, bias, n_tok, n_exp, ids, weights, Some((tables, ptrs)))
    }

    /// [`CudaDevice::route`] with the kernel chosen: `warp` runs one warp a
    /// token (route_topk_warp) when there are at most
    /// [`ROUTE_WARP_MAX_EXPERTS`] experts, else one block a token
    /// (route_topk). Both give the same ids and weight bits.
    #[allow(clippy::too_many_arguments)]
    pub fn route_with(
        &self,
        stream: &CudaStream,
        warp: bool,
        spec: &RouterSpec,
        logits: &DeviceBuf<f32>,
        bias: Option<&DeviceBuf<f32>>,
        n_tok: usize,
        n_exp: usize,
        ids: &mut DeviceBuf<i32>,
        weights: &mut DeviceBuf<f32>,
        gather: Option<([&DeviceBuf<u64>; 3], [&mut DeviceBuf<u64>; 3])>,
    ) -> Result<(), CudaError> {
        const OP: &str = "route";
        if spec.k == 0 || spec.k > MAX_TOP_K || spec.k > n_exp || n_exp > MAX_EXPERTS {
            return Err(shape(OP, format!("top-{} of {n_exp} experts", spec.k)));
        }
        want(OP, "logits", logits.len(), n_tok * n_exp)?;
        if let Some(b) = bias {
            want(OP, "bias", b.len(), n_exp)?;
        }
        want(OP, "ids", ids.len(), n_tok * spec.k)?;
        want(OP, "weights", weights.len(), n_tok * spec.k)?;
        let (nt, ne, k) = (to_i32(OP, "n_tok", n_tok)?, n_exp as i32, spec.k as i32);
        let gating: i32 = match spec.gating {
            Gating::Softmax => 0,
            Gating::Sigmoid => 1,
        };
        let (renorm, scale) = (spec.renormalize as i32, spec.scale);
        let (lp, bp, ip, wp) = (
            logits.device_ptr(),
            ptr_or_null(bias),
            ids.device_ptr(),
            weights.device_ptr(),
        );
        if warp && n_exp <= ROUTE_WARP_MAX_EXPERTS {
            // The gather: tables and per-pair outputs, or nulls.
            let ([tg, tu, td], [pg, pu, pd]) = match gather {
                Some((t, o)) => {
                    for x in &t[1..] {
                        want(OP, "table", x.len(), t[0].len())?;
                    }
                    if t[0].len() < n_exp {
                        return Err(shape(OP, format!("pointer tables of {} experts for {n_exp}", t[0].len())));
                    }
                    for x in &o {
                        want(OP, "pointers", x.len(), n_tok * spec.k)?;
                    }
                    (t.map(|x| x.device_ptr()), [o[0].device_ptr(), o[1].device_ptr(), o[2].device_ptr()])
                }
                None => ([0u64; 3], [0u64; 3]),
            };
            let f = self.func(Family::Moe, ROUTE_WARP)?;
            let grid = n_tok.div_ceil(ROUTE_WARP_TOKENS) as u32;
            // SAFETY: parameters as route_topk_warp; sizes checked.
            let args = &mut params![lp, bp, nt, ne, k, gating, renorm, scale, ip, wp, tg, tu, td, pg, pu, pd];
            unsafe { self.launch(f, (grid, 1, 1), 32 * ROUTE_WARP_TOKENS as u32, 0, stream, args) }
        } else {
            let args = &mut params![lp, bp, nt, ne, k, gating, renorm, scale, ip, wp];
            if let Some((t, o)) = gather {
                let f = self.func(Family::Moe, 0)?;
                let smem = (2 * n_exp * 4) as u32;
                // SAFETY: parameters as route_topk; sizes checked.
                unsafe { self.launch(f, (n_tok as u32, 1, 1), 256, smem, stream, args) }?;
                return self.moe_gather_ptrs(stream, ids, t, o);
            }
            let f = self.func(Family::Moe, 0)?;
            let smem = (2 * n_exp * 4) as u32;
            // SAFETY: parameters as route_topk; sizes checked.
            unsafe { self.launch(f, (n_tok as u32, 1, 1), 256, smem, stream, args) }
        }
    }

    /// The routed-expert FFN of one MoE layer over explicit per-(token, slot)
    /// pointers: `h[p] = act(gate_p x_t) * (up_p x_t)`, quantized to `hq`, then
    /// `out[p] = down_p hq[p]`. Pairs whose pointers are 0 are skipped (their
    /// rows of `h`/`out` are left as they were). `x` is the tokens' activations
    /// quantized for `gate_up_ty`; `h` is `[n_pairs, ff]`, `hq` that quantized
    /// for `down_ty`, `out` `[n_pairs, d_model]`. The caller sums `out` over
    /// slots (in slot order) with the router weights.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_ffn(
        &self,
        stream: &CudaStream,
        gate_up_ty: GgmlType,
        down_ty: GgmlType,
        pairs: &MoePairs<'_>,
        x: &DeviceBuf<u8>,
        d_model: usize,
        ff: usize,
        act: Activation,
        h: &mut DeviceBuf<f32>,
        hq: &mut DeviceBuf<u8>,
        out: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        self.moe_ffn_split(stream, gate_up_ty, down_ty, pairs, None, x, d_model, ff, act, h, hq, out, &mut |_| Ok(()))
    }

    /// [`moe_ffn`](Self::moe_ffn) with some rows of `h` computed elsewhere:
    /// pair `p`'s rows below `row_lo[p]` (`[n_pairs]`, each in `0..=ff`) are
    /// not computed on the device, and `fill_h` runs between the `h` kernel's
    /// launch and its quantization to write them (on `stream`, so in order).
    /// The GPU's `h` kernel is queued before `fill_h` is called, so the two
    /// work at once.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_ffn_split(
        &self,
        stream: &CudaStream,
        gate_up_ty: GgmlType,
        down_ty: GgmlType,
        pairs: &MoePairs<'_>,
        row_lo: Option<&DeviceBuf<i32>>,
        x: &DeviceBuf<u8>,
        d_model: usize,
        ff: usize,
        act: Activation,
        h: &mut DeviceBuf<f32>,
        hq: &mut DeviceBuf<u8>,
        out: &mut DeviceBuf<f32>,
        fill_h: &mut dyn FnMut(&mut DeviceBuf<f32>) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe_ffn";
        let gi = quant_index(gate_up_ty).ok_or(CudaError::Unsupported {
            op: OP,
            ty: gate_up_ty,
        })?;
        let di = quant_index(down_ty).ok_or(CudaError::Unsupported {
            op: OP,
            ty: down_ty,
        })?;
        let gfmt = ActFormat::for_weight(gate_up_ty).ok_or(CudaError::Unsupported {
            op: OP,
            ty: gate_up_ty,
        })?;
        let dfmt = ActFormat::for_weight(down_ty).ok_or(CudaError::Unsupported {
            op: OP,
            ty: down_ty,
        })?;
        let n_pairs = check_pairs(OP, pairs, h.len(), ff, out.len(), d_model)?;
        want(
            OP,
            "x bytes",
            x.len(),
            act_bytes(gfmt, pairs.n_tok, d_model)?,
        )?;
        if let Some(r) = row_lo {
            want(OP, "row_lo", r.len(), n_pairs)?;
        }
        let lop = row_lo.map_or(0, |r| r.device_ptr());
        // Weight shapes must be whole blocks (the pointers themselves are the caller's contract).
        weight_bytes(gate_up_ty, ff, d_model)?;
        weight_bytes(down_ty, d_model, ff)?;
        let a = act_code(act)?;
        let (ffi, dm, ns) = (
            to_i32(OP, "ff", ff)?,
            to_i32(OP, "d_model", d_model)?,
            to_i32(OP, "n_slot", pairs.n_slot)?,
        );
        let tab = self.iq_tables().device_ptr();
        let (gp, upp, dp) = (
            pairs.gate.device_ptr(),
            pairs.up.device_ptr(),
            pairs.down.device_ptr(),
        );
        let (xp, hp, op) = (x.device_ptr(), h.device_ptr(), out.device_ptr());
        let f = self.func(Family::Moe, 1 + 2 * gi)?;
        // Rows per warp from all the pairs' rows, as the GEMV picks them
        // (moe_up reads gate and up rows side by side: two matrices).
        let up = decode_plan(gate_up_ty, ff * n_pairs, 2, act_bytes(gfmt, 1, d_model)?);
        let down = decode_plan(down_ty, d_model * n_pairs, 1, act_bytes(dfmt, 1, ff)?);
        let (rui, gui, xui) = (up.rpw as i32, up.groups as i32, up.xsb as i32);
        let (rdi, gdi, xdi) = (down.rpw as i32, down.groups as i32, down.xsb as i32);
        let grid = (up.blocks(ff), n_pairs as u32, 1);
        // SAFETY: parameters as MOE_ENTRY moe_up; sizes checked; up.smem
        // bytes of dynamic shared memory (opted in at load).
        unsafe {
            self.launch(
                f,
                grid,
                up.threads(),
                up.smem as u32,
                stream,
                &mut params![gp, upp, lop, xp, hp, ffi, dm, ns, a, rui, gui, xui, tab],
            )?
        };
        fill_h(h)?;
        self.quantize_act(stream, dfmt, h, n_pairs, ff, hq)?;
        let hqp = hq.device_ptr();
        let f = self.func(Family::Moe, 2 + 2 * di)?;
        let grid = (down.blocks(d_model), n_pairs as u32, 1);
        // SAFETY: parameters as MOE_ENTRY moe_down; sizes checked; dynamic
        // shared memory as above.
        unsafe {
            self.launch(
                f,
                grid,
                down.threads(),
                down.smem as u32,
                stream,
                &mut params![dp, hqp, op, dm, ffi, rdi, gdi, xdi, tab],
            )
        }
    }

    /// [`moe_ffn`](Self::moe_ffn) for float experts: gate, up and down all of
    /// `ty` (F32, F16 or BF16), `x` the tokens' f32 rows (`[n_tok, d_model]`).
    /// `h[p] = act(gate_p x_t) * (up_p x_t)` (`[n_pairs, ff]`), then
    /// `out[p] = down_p h[p]` (`[n_pairs, d_model]`) with no quantization in
    /// between; null pairs are skipped. Each dot sums as [`gemm_float`](Self::gemm_float)'s GEMV.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_ffn_float(
        &self,
        stream: &CudaStream,
        ty: GgmlType,
        pairs: &MoePairs<'_>,
        x: &DeviceBuf<f32>,
        d_model: usize,
        ff: usize,
        act: Activation,
        h: &mut DeviceBuf<f32>,
        out: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe_ffn_float";
        let fi = float_index(ty).ok_or(CudaError::Unsupported { op: OP, ty })?;
        let n_pairs = check_pairs(OP, pairs, h.len(), ff, out.len(), d_model)?;
        want(OP, "x", x.len(), pairs.n_tok * d_model)?;
        // Non-empty shapes (the pointers themselves are the caller's contract).
        weight_bytes(ty, ff, d_model)?;
        weight_bytes(ty, d_model, ff)?;
        let a = act_code(act)?;
        let (ffi, dm, ns) = (
            to_i32(OP, "ff", ff)?,
            to_i32(OP, "d_model", d_model)?,
            to_i32(OP, "n_slot", pairs.n_slot)?,
        );
        let (gp, upp, dp) = (
            pairs.gate.device_ptr(),
            pairs.up.device_ptr(),
            pairs.down.device_ptr(),
        );
        let (xp, hp, op) = (x.device_ptr(), h.device_ptr(), out.device_ptr());
        let f = self.func(Family::Moe, MOE_FLOAT + 2 * fi)?;
        let grid = (ff.div_ceil(GEMV_ROWS_PER_BLOCK) as u32, n_pairs as u32, 1);
        // SAFETY: parameters as MOE_FENTRY moe_up; sizes checked.
        unsafe {
            self.launch(
                f,
                grid,
                128,
                0,
                stream,
                &mut params![gp, upp, xp, hp, ffi, dm, ns, a],
            )?
        };
        let f = self.func(Family::Moe, MOE_FLOAT + 2 * fi + 1)?;
        let grid = (
            d_model.div_ceil(GEMV_ROWS_PER_BLOCK) as u32,
            n_pairs as u32,
            1,
        );
        // SAFETY: parameters as MOE_FENTRY moe_down; sizes checked.
        unsafe { self.launch(f, grid, 128, 0, stream, &mut params![dp, hp, op, dm, ffi]) }
    }

    /// The routed-expert FFN of a prefill chunk, one expert at a time: the
    /// rows routed to an expert (sorted row i is token `tok_of[i]`, pair
    /// `pair_of[i]`) are gathered, multiplied by its matrices with the
    /// device's default GEMM (each weight row read once per tile of tokens,
    /// not once per pair), and scattered back to pair order in `out` (`[n_pairs,
    /// d_model]`); rows outside every run are left untouched. Same sums in
    /// the same order as [`CudaDevice::moe_ffn`] on the same pairs.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_ffn_grouped(
        &self,
        stream: &CudaStream,
        gate_up_ty: GgmlType,
        down_ty: GgmlType,
        runs: &[ExpertRun],
        tok_of: &DeviceBuf<i32>,
        pair_of: &DeviceBuf<i32>,
        x: &DeviceBuf<u8>,
        n_tok: usize,
        d_model: usize,
        ff: usize,
        act: Activation,
        s: &mut GroupedScratch<'_>,
        out: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe_ffn_grouped";
        let gi = quant_index(gate_up_ty).ok_or(CudaError::Unsupported { op: OP, ty: gate_up_ty })?;
        let di = quant_index(down_ty).ok_or(CudaError::Unsupported { op: OP, ty: down_ty })?;
        let gfmt = ActFormat::for_weight(gate_up_ty).ok_or(CudaError::Unsupported { op: OP, ty: gate_up_ty })?;
        let dfmt = ActFormat::for_weight(down_ty).ok_or(CudaError::Unsupported { op: OP, ty: down_ty })?;
        let n = tok_of.len();
        want(OP, "pair indices", pair_of.len(), n)?;
        let xrow = act_bytes(gfmt, 1, d_model)?;
        want(OP, "x bytes", x.len(), n_tok * xrow)?;
        want(OP, "gathered x", s.xs.len(), n * xrow)?;
        for (what, b) in [("hg", &*s.hg), ("hu", &*s.hu), ("h", &*s.h)] {
            want(OP, what, b.len(), n * ff)?;
        }
        want(OP, "hq", s.hq.len(), act_bytes(dfmt, n, ff)?)?;
        want(OP, "outs", s.outs.len(), n * d_model)?;
        if out.len() % d_model.max(1) != 0 {
            return Err(shape(OP, format!("out of {} values is not whole rows of {d_model}", out.len())));
        }
        weight_bytes(gate_up_ty, ff, d_model)?;
        weight_bytes(down_ty, d_model, ff)?;
        let mut end = 0;
        for r in runs {
            if r.start < end || r.start + r.len > n || r.len > MAX_GEMM_TOKENS {
                return Err(shape(OP, format!("run {}..{} of {n} rows (runs ascending, at most {MAX_GEMM_TOKENS} rows)", r.start, r.start + r.len)));
            }
            end = r.start + r.len;
        }
        if n == 0 {
            return Ok(());
        }
        let (ni, xr, dm) = (to_i32(OP, "rows", n)?, to_i32(OP, "x row", xrow)?, to_i32(OP, "d_model", d_model)?);
        to_i32(OP, "ff", ff)?;
        let f = self.func(Family::Act, ACT_GATHER_ROWS)?;
        let (src, idx, dst) = (x.device_ptr(), tok_of.device_ptr(), s.xs.device_ptr());
        // SAFETY: (src, idx, n, row_bytes, dst) as gather_rows_u8; tok_of's
        // values index `x`'s rows (the caller's contract, like the pointers).
        unsafe { self.launch(f, (n as u32, 1, 1), 128, 0, stream, &mut params![src, idx, ni, xr, dst])? };
        let tab = self.iq_tables().device_ptr();
        let hqrow = act_bytes(dfmt, 1, ff)?;
        if GemmKernel::default_for(self.compute_capability()) == GemmKernel::TensorCore {
            // One launch per matrix over every (expert, 32-row tile).
            let mut items = Vec::with_capacity(grouped_items_len(n, runs.len()));
            for r in runs {
                for t0 in (0..r.len).step_by(GROUPED_TILE) {
                    let len = GROUPED_TILE.min(r.len - t0);
                    items.extend([r.gate, r.up, r.down, (r.start + t0) as u64 | (len as u64) << 32]);
                }
            }
            if items.len() > s.items.len() {
                return Err(shape(OP, format!("{} work-list values for {} ({n} rows, {} runs)", items.len(), s.items.len(), runs.len())));
            }
            let n_items = items.len() / 4;
            if n_items > 65535 {
                return Err(shape(OP, format!("{n_items} work items (at most 65535)")));
            }
            s.items.upload_prefix(stream, &items)?;
            let ip = s.items.device_ptr();
            let mm = |fi: usize, which: i32, xp: u64, yp: u64, rows: usize, cols: usize| -> Result<(), CudaError> {
                let f = self.func(Family::GemvQuant, gemm_mma_grouped_entry(fi))?;
                let grid = (rows.div_ceil(MMA_ROWS_PER_BLOCK) as u32, n_items as u32, 1);
                let (r, c) = (rows as i32, cols as i32);
                // SAFETY: (items, which, X, Y, rows, cols, tab) as gemm_mma_grouped_*;
                // the items' rows lie in the checked scratch, their matrices are the caller's.
                unsafe { self.launch(f, grid, 128, MMA_GROUPED_SMEM_BYTES, stream, &mut params![ip, which, xp, yp, r, c, tab]) }
            };
            mm(gi, 0, s.xs.device_ptr(), s.hg.device_ptr(), ff, d_model)?;
            mm(gi, 1, s.xs.device_ptr(), s.hu.device_ptr(), ff, d_model)?;
            self.glu(stream, s.hg, s.hu, s.h, act)?;
            self.quantize_act(stream, dfmt, s.h, n, ff, s.hq)?;
            mm(di, 2, s.hq.device_ptr(), s.outs.device_ptr(), d_model, ff)?;
        } else {
            let gemm = |ty: GgmlType, fi: usize, w: u64, xp: u64, yp: u64, rows: usize, cols: usize, len: usize| {
                // SAFETY: X and Y lie inside the checked scratch; W is the caller's expert matrix.
                unsafe { self.launch_quant_gemm(stream, GemmKernel::Dp4a, ty, fi, w, xp, yp, rows, cols, len, tab) }
            };
            for r in runs.iter().filter(|r| r.len > 0) {
                let xp = s.xs.device_ptr() + (r.start * xrow) as u64;
                gemm(gate_up_ty, gi, r.gate, xp, s.hg.device_ptr() + (r.start * ff * 4) as u64, ff, d_model, r.len)?;
                gemm(gate_up_ty, gi, r.up, xp, s.hu.device_ptr() + (r.start * ff * 4) as u64, ff, d_model, r.len)?;
            }
            self.glu(stream, s.hg, s.hu, s.h, act)?;
            self.quantize_act(stream, dfmt, s.h, n, ff, s.hq)?;
            for r in runs.iter().filter(|r| r.len > 0) {
                let hp = s.hq.device_ptr() + (r.start * hqrow) as u64;
                gemm(down_ty, di, r.down, hp, s.outs.device_ptr() + (r.start * d_model * 4) as u64, d_model, ff, r.len)?;
            }
        }
        let f = self.func(Family::Act, ACT_SCATTER_ROWS)?;
        let (src, idx, dst) = (s.outs.device_ptr(), pair_of.device_ptr(), out.device_ptr());
        // SAFETY: (src, idx, n, cols, dst) as scatter_rows_f32; pair_of's
        // values index `out`'s rows (the caller's contract).
        unsafe { self.launch(f, (n as u32, 1, 1), 128, 0, stream, &mut params![src, idx, ni, dm, dst]) }
    }

    /// Per-(token, slot) slab pointers from per-expert tables (`[n_exp]`
    /// device addresses each, 0 = "not mine"): `out.gate[p] = gate[ids[p]]`.
    /// An id outside the tables gives a null pair. Twin: a host table lookup.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gather_ptrs(
        &self,
        stream: &CudaStream,
        ids: &DeviceBuf<i32>,
        tables: [&DeviceBuf<u64>; 3],
        out: [&mut DeviceBuf<u64>; 3],
    ) -> Result<(), CudaError> {
        const OP: &str = "moe_gather_ptrs";
        let n_pairs = ids.len();
        let n_exp = tables[0].len();
        for t in &tables[1..] {
            want(OP, "table", t.len(), n_exp)?;
        }
        for o in &out {
            want(OP, "pointers", o.len(), n_pairs)?;
        }
        let (np, ne) = (to_i32(OP, "n_pairs", n_pairs)?, to_i32(OP, "n_exp", n_exp)?);
        let (ip, tg, tu, td) = (ids.device_ptr(), tables[0].device_ptr(), tables[1].device_ptr(), tables[2].device_ptr());
        let (pg, pu, pd) = (out[0].device_ptr(), out[1].device_ptr(), out[2].device_ptr());
        let f = self.func(Family::Moe, MOE_GATHER_PTRS)?;
        // SAFETY: parameters as moe_gather_ptrs; sizes checked.
        unsafe {
            self.launch(
                f,
                (n_pairs.div_ceil(128).max(1) as u32, 1, 1),
                128,
                0,
                stream,
                &mut params![ip, np, ne, tg, tu, td, pg, pu, pd],
            )
        }
    }

    /// `y[t] = sum_s w[t, s] * out[t * n_slot + s]` in slot order (`out`:
    /// `[n_tok * n_slot, d_model]`, `w`: `[n_tok, n_slot]`, `y`: `[n_tok,
    /// d_model]`). Twin: the CPU MoE op's slot sum (same roundings).
    pub fn moe_combine(
        &self,
        stream: &CudaStream,
        out: &DeviceBuf<f32>,
        w: &DeviceBuf<f32>,
        n_tok: usize,
        n_slot: usize,
        y: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        let (nt, ns, dm) = check_combine("moe_combine", out, w, n_tok, n_slot, y)?;
        let (op, wp, yp) = (out.device_ptr(), w.device_ptr(), y.device_ptr());
        let f = self.func(Family::Moe, MOE_COMBINE)?;
        // SAFETY: parameters as moe_combine; sizes checked.
        unsafe { self.launch(f, combine_grid(dm, nt), 128, 0, stream, &mut params![op, wp, nt, ns, dm, yp]) }
    }

    /// [`CudaDevice::moe_combine`]'s `y`, and `sum = y + r` (`r_first`:
    /// `r + y`) with [`CudaDevice::add`]'s bits, in one launch: the residual
    /// add after a decoder layer's MoE.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_combine_add(
        &self,
        stream: &CudaStream,
        out: &DeviceBuf<f32>,
        w: &DeviceBuf<f32>,
        n_tok: usize,
        n_slot: usize,
        r: &DeviceBuf<f32>,
        r_first: bool,
        y: &mut DeviceBuf<f32>,
        sum: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "moe_combine_add";
        let (nt, ns, dm) = check_combine(OP, out, w, n_tok, n_slot, y)?;
        want(OP, "r", r.len(), y.len())?;
        want(OP, "sum", sum.len(), y.len())?;
        let (op, wp, rp, yp, sp) = (out.device_ptr(), w.device_ptr(), r.device_ptr(), y.device_ptr(), sum.device_ptr());
        let rf = i32::from(r_first);
        let f = self.func(Family::Moe, MOE_COMBINE_ADD)?;
        // SAFETY: parameters as moe_combine_add; sizes checked.
        unsafe { self.launch(f, combine_grid(dm, nt), 128, 0, stream, &mut params![op, wp, nt, ns, dm, rp, rf, yp, sp]) }
    }
}

impl CudaDevice {
    /// Segment `s` of `segs` (`(dst, src, len)`) copies `len` values from
    /// `vals + src` into `h[dst..]`, in one launch. `vals` and `segs` are
    /// device addresses, possibly of mapped host memory (the CPU lane's heads
    /// and their places, written by the host). Twin: one copy per segment.
    ///
    /// # Safety
    /// `vals` must address `vals_len` readable f32s and `segs` the `3 *
    /// n_seg` i32s `seg_host` holds (the same values), both alive and
    /// unchanged until the stream passes this launch.
    pub unsafe fn lane_fill_rows(
        &self,
        stream: &CudaStream,
        vals: u64,
        vals_len: usize,
        segs: u64,
        seg_host: &[[i32; 3]],
        h: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "lane_fill_rows";
        for &[dst, src, len] in seg_host {
            let ok = dst >= 0 && src >= 0 && len >= 0 && (dst as usize + len as usize) <= h.len() && (src as usize + len as usize) <= vals_len;
            if !ok {
                return Err(shape(OP, format!("segment ({dst}, {src}, {len}) outside h of {} or values of {vals_len}", h.len())));
            }
        }
        if seg_host.is_empty() {
            return Ok(());
        }
        let n = to_i32(OP, "segments", seg_host.len())?;
        if seg_host.len() > 65535 {
            return Err(shape(OP, format!("{n} segments in one launch (at most 65535)")));
        }
        let hp = h.device_ptr();
        let f = self.func(Family::Moe, LANE_FILL_ROWS)?;
        // SAFETY: segments checked against both buffers; the caller keeps the
        // addresses alive (per the contract above).
        unsafe { self.launch(f, (n as u32, 1, 1), 128, 0, stream, &mut params![vals, segs, n, hp]) }
    }
}

/// The sizes a slot combine checks: `(n_tok, n_slot, d_model)` as kernel ints.
fn check_combine(
    op: &'static str,
    out: &DeviceBuf<f32>,
    w: &DeviceBuf<f32>,
    n_tok: usize,
    n_slot: usize,
    y: &DeviceBuf<f32>,
) -> Result<(i32, i32, i32), CudaError> {
    want(op, "weights", w.len(), n_tok * n_slot)?;
    let d_model = y.len().checked_div(n_tok).unwrap_or(0);
    want(op, "y", y.len(), n_tok * d_model)?;
    want(op, "out", out.len(), n_tok * n_slot * d_model)?;
    if n_tok > 65535 {
        return Err(shape(op, format!("{n_tok} tokens in one launch (at most 65535)")));
    }
    Ok((to_i32(op, "n_tok", n_tok)?, to_i32(op, "n_slot", n_slot)?, to_i32(op, "d_model", d_model)?))
}

fn combine_grid(d_model: i32, n_tok: i32) -> (u32, u32, u32) {
    ((d_model as u32).div_ceil(128).max(1), (n_tok as u32).max(1), 1)
}
