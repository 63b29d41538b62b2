//! Attention: the KV-cache write and the decode / split / tiled prefill
//! attention kernels (a fourth `impl CudaDevice`). Twin: `ops::attend_rows`.

use super::*;

impl CudaDevice {
    /// Write a step's `k` (`[n, kw]`) and `v` (`[n, vw]`) rows into a layer's
    /// cache (`n_ctx` rows; f32, f16 rounded to nearest even, or q8_0) at the rows
    /// `positions` name, read on the device so a captured decode graph stays
    /// right from token to token.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write<K: KvElem>(
        &self,
        stream: &CudaStream,
        k: &DeviceBuf<f32>,
        v: &DeviceBuf<f32>,
        positions: &DeviceBuf<u32>,
        kw: usize,
        vw: usize,
        k_cache: &mut DeviceBuf<K>,
        v_cache: &mut DeviceBuf<K>,
    ) -> Result<(), CudaError> {
        const OP: &str = "kv_write";
        let n = positions.len();
        want(OP, "k", k.len(), n * kw)?;
        want(OP, "v", v.len(), n * vw)?;
        let (krl, vrl) = (K::row_len(kw), K::row_len(vw));
        if kw == 0 || vw == 0 || k_cache.len() % krl != 0 || v_cache.len() / vrl != k_cache.len() / krl {
            return Err(shape(OP, format!("caches of {} and {} values for widths {kw} and {vw}", k_cache.len(), v_cache.len())));
        }
        if n > 65535 {
            return Err(shape(OP, "more than 65535 rows"));
        }
        let n_ctx = to_i32(OP, "n_ctx", k_cache.len() / krl)?;
        let (kwi, vwi) = (to_i32(OP, "kw", kw)?, to_i32(OP, "vw", vw)?);
        let f = self.func(Family::Attention, KV_WRITE_AT[K::ENTRY])?;
        let (kp, vp, pp, kcp, vcp) = (k.device_ptr(), v.device_ptr(), positions.device_ptr(), k_cache.device_ptr(), v_cache.device_ptr());
        let grid = ((kw + vw).div_ceil(256).min(64) as u32, n as u32, 1);
        // SAFETY: (k, v, positions, kc, vc, kw, vw, n_ctx) as kv_write; sizes checked above.
        unsafe { self.launch(f, grid, 256, 0, stream, &mut params![kp, vp, pp, kcp, vcp, kwi, vwi, n_ctx]) }
    }

    /// Causal attention of `positions.len()` queries over the first `n_ctx`
    /// rows of a KV cache (f32, f16 bits as `u16`, or q8_0 rows as `u8`), split over the keys.
    /// `work` holds [`attention_workspace_len`] values. Twin: `ops::attend_rows`.
    /// Prefill-sized steps take [`AttnKernel::Tiled`] where it applies.
    #[allow(clippy::too_many_arguments)]
    pub fn attention<K: KvElem>(
        &self,
        stream: &CudaStream,
        p: &AttnParams,
        q: &DeviceBuf<f32>,
        positions: &DeviceBuf<u32>,
        k_cache: &DeviceBuf<K>,
        v_cache: &DeviceBuf<K>,
        n_ctx: usize,
        work: &mut DeviceBuf<f32>,
        out: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        let n_q = positions.len();
        let rows = n_q.saturating_mul(p.n_head / p.n_kv_head.max(1));
        let blocks = rows.div_ceil(ATT_PREFILL_ROWS).saturating_mul(p.n_kv_head).saturating_mul(attention_splits(p, n_ctx));
        let ptrs = [q.device_ptr(), k_cache.device_ptr(), v_cache.device_ptr()];
        let tiled = n_q >= ATT_TILED_MIN_Q && blocks >= ATT_TILED_MIN_BLOCKS && self.attention_tiled_entry::<K>(p, n_q, ptrs)?.is_some();
        let kernel = if tiled {
            AttnKernel::Tiled
        } else if grouped_pays(p, n_ctx) && self.attention_grouped_entry(p, |i| att_decode_at(K::ENTRY, i), ptrs)?.is_some() {
            AttnKernel::Grouped
        } else {
            AttnKernel::PerQuery
        };
        self.attention_with(stream, kernel, p, q, positions, k_cache, v_cache, n_ctx, work, out)
    }

    /// Whether [`AttnKernel::Grouped`] takes these heads on this device
    /// (given 16-byte aligned buffers, as [`CudaDevice::alloc`] makes them).
    pub fn attention_grouped_available<K: KvElem>(&self, p: &AttnParams) -> Result<bool, CudaError> {
        Ok(self.attention_grouped_entry(p, |i| att_decode_at(K::ENTRY, i), [0; 3])?.is_some())
    }

    /// The attn_decode entry (`at` of the head dim's index) and its
    /// dynamic shared memory for these heads, or None where it does not
    /// apply (head dims, this device's shared memory, pointers not 16-byte
    /// aligned).
    fn attention_grouped_entry(&self, p: &AttnParams, at: impl Fn(usize) -> usize, ptrs: [u64; 3]) -> Result<Option<(usize, u32)>, CudaError> {
        let Some(i) = ATT_PREFILL_DIMS.iter().position(|&d| d == p.head_dim_k) else {
            return Ok(None);
        };
        let index = at(i);
        let smem = attn_decode_smem(p.head_dim_k);
        let fits = p.head_dim_v == p.head_dim_k && ptrs.iter().all(|a| a % 16 == 0) && self.func_smem(Family::Attention, index)? >= smem;
        Ok(fits.then_some((index, smem)))
    }

    /// Whether [`AttnKernel::Tiled`] takes these heads on this device
    /// (given 16-byte aligned buffers, as [`CudaDevice::alloc`] makes them).
    pub fn attention_tiled_available<K: KvElem>(&self, p: &AttnParams) -> Result<bool, CudaError> {
        Ok(self.attention_tiled_entry::<K>(p, 1, [0; 3])?.is_some())
    }

    /// The attn_prefill entry and its dynamic shared memory for these
    /// heads, or None where it does not apply (head dims, this device's
    /// shared memory, rows past i32, pointers not 16-byte aligned).
    fn attention_tiled_entry<K: KvElem>(&self, p: &AttnParams, n_q: usize, ptrs: [u64; 3]) -> Result<Option<(usize, u32)>, CudaError> {
        let Some(i) = ATT_PREFILL_DIMS.iter().position(|&d| d == p.head_dim_k) else {
            return Ok(None);
        };
        let index = att_prefill_at(K::ENTRY, i);
        let smem = attn_prefill_smem(p.head_dim_k);
        let fits = p.head_dim_v == p.head_dim_k
            && n_q.checked_mul(p.n_head).is_some_and(|r| r <= i32::MAX as usize)
            && ptrs.iter().all(|a| a % 16 == 0)
            && self.func_smem(Family::Attention, index)? >= smem;
        Ok(fits.then_some((index, smem)))
    }

    /// [`CudaDevice::attention`] with an explicit kernel for the partials;
    /// [`AttnKernel::Tiled`] where it does not apply is an error.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_with<K: KvElem>(
        &self,
        stream: &CudaStream,
        kernel: AttnKernel,
        p: &AttnParams,
        q: &DeviceBuf<f32>,
        positions: &DeviceBuf<u32>,
        k_cache: &DeviceBuf<K>,
        v_cache: &DeviceBuf<K>,
        n_ctx: usize,
        work: &mut DeviceBuf<f32>,
        out: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "attention";
        if p.n_kv_head == 0 || p.n_head % p.n_kv_head != 0 || p.head_dim_k == 0 || p.head_dim_v == 0
        {
            return Err(shape(
                OP,
                format!("{} heads over {} kv heads", p.n_head, p.n_kv_head),
            ));
        }
        if p.head_dim_k > 1024 || p.head_dim_v > 512 {
            return Err(shape(OP, format!("head dims {}/{} above 1024/512", p.head_dim_k, p.head_dim_v)));
        }
        let n_q = positions.len();
        want(OP, "q", q.len(), n_q * p.n_head * p.head_dim_k)?;
        want(OP, "out", out.len(), n_q * p.n_head * p.head_dim_v)?;
        if k_cache.len() < n_ctx * K::row_len(p.n_kv_head * p.head_dim_k)
            || v_cache.len() < n_ctx * K::row_len(p.n_kv_head * p.head_dim_v)
        {
            return Err(shape(OP, format!("cache shorter than {n_ctx} rows")));
        }
        let n_split = attention_splits(p, n_ctx);
        want(
            OP,
            "work",
            work.len(),
            attention_workspace_len(p, n_q, n_ctx),
        )?;
        if n_q > 65535 || p.n_head > 65535 || n_split > 65535 {
            return Err(shape(OP, "grid too large"));
        }
        let (nq, nh, nkv) = (n_q as i32, p.n_head as i32, p.n_kv_head as i32);
        let (dk, dv, nc) = (
            p.head_dim_k as i32,
            p.head_dim_v as i32,
            to_i32(OP, "n_ctx", n_ctx)?,
        );
        let (scale, window, softcap) = (p.scale, to_i32(OP, "window", p.window)?, p.softcap);
        let (chunk, ns) = (ATT_CHUNK as i32, n_split as i32);
        let (qp, pp, kp, vp, wp, op) = (
            q.device_ptr(),
            positions.device_ptr(),
            k_cache.device_ptr(),
            v_cache.device_ptr(),
            work.device_ptr(),
            out.device_ptr(),
        );
        if kernel == AttnKernel::Tiled {
            let Some((index, smem)) = self.attention_tiled_entry::<K>(p, n_q, [qp, kp, vp])? else {
                return Err(shape(OP, format!("no tiled kernel for d_k {} d_v {} here", p.head_dim_k, p.head_dim_v)));
            };
            let f = self.func(Family::Attention, index)?;
            let tiles = (n_q * (p.n_head / p.n_kv_head)).div_ceil(ATT_PREFILL_ROWS);
            let grid = (tiles as u32, p.n_kv_head as u32, n_split as u32);
            // SAFETY: parameters as AP_ENTRY; sizes checked above, rows within i32.
            unsafe {
                self.launch(
                    f,
                    grid,
                    ATT_PREFILL_THREADS,
                    smem,
                    stream,
                    &mut params![qp, pp, kp, vp, wp, nq, nh, nkv, nc, scale, window, softcap, ns],
                )?;
            }
        } else if kernel == AttnKernel::Grouped {
            let Some((index, smem)) = self.attention_grouped_entry(p, |i| att_decode_at(K::ENTRY, i), [qp, kp, vp])? else {
                return Err(shape(OP, format!("no grouped kernel for d_k {} d_v {} here", p.head_dim_k, p.head_dim_v)));
            };
            let gb = grouped_heads(p, n_q, n_split, self.sm_count());
            let f = self.func(Family::Attention, index)?;
            let grid = ((p.n_kv_head * (p.n_head / p.n_kv_head).div_ceil(gb)) as u32, n_q as u32, n_split as u32);
            let gbi = gb as i32;
            // SAFETY: parameters as AD_ENTRY; sizes checked above.
            unsafe {
                self.launch(f, grid, ATT_DECODE_THREADS, smem, stream, &mut params![qp, pp, kp, vp, wp, nh, nkv, dv, nc, scale, window, softcap, ns, gbi])?;
            }
        } else {
            let f = self.func(Family::Attention, ATT_PARTIAL_AT[K::ENTRY])?;
            let smem = ((p.head_dim_k + ATT_CHUNK) * 4) as u32;
            let grid = (p.n_head as u32, n_q as u32, n_split as u32);
            // SAFETY: parameters as ATT_ENTRY; sizes checked above.
            unsafe {
                self.launch(
                    f,
                    grid,
                    ATT_THREADS,
                    smem,
                    stream,
                    &mut params![
                        qp, pp, kp, vp, wp, nq, nh, nkv, dk, dv, nc, scale, window, softcap, chunk, ns
                    ],
                )?;
            }
        }
        let f = self.func(Family::Attention, ATT_COMBINE)?;
        // SAFETY: (part, out, n_q, n_head, dv, n_split) as attn_combine.
        unsafe {
            self.launch(
                f,
                (p.n_head as u32, n_q as u32, 1),
                ATT_THREADS,
                0,
                stream,
                &mut params![wp, op, nq, nh, dv, ns],
            )
        }
    }
    /// [`CudaDevice::kv_write`] for rows of several sequences: row `r`'s key
    /// and value go to the layer caches whose device addresses are
    /// `tables[k_at + r]` and `tables[v_at + r]`, at row `positions[r]`.
    ///
    /// # Safety
    /// Every address must be the start of a live cache of `K` of at least
    /// `n_ctx` rows of `kw` (keys) or `vw` (values) values, and no two rows
    /// of one cache may name the same position.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn kv_write_rows<K: KvElem>(
        &self,
        stream: &CudaStream,
        k: &DeviceBuf<f32>,
        v: &DeviceBuf<f32>,
        positions: &DeviceBuf<u32>,
        tables: &DeviceBuf<u64>,
        (k_at, v_at): (usize, usize),
        (kw, vw): (usize, usize),
        n_ctx: usize,
    ) -> Result<(), CudaError> {
        const OP: &str = "kv_write_rows";
        let n = positions.len();
        want(OP, "k", k.len(), n * kw)?;
        want(OP, "v", v.len(), n * vw)?;
        if kw == 0 || vw == 0 || k_at.max(v_at) + n > tables.len() || n > 65535 {
            return Err(shape(OP, format!("{n} rows of widths {kw}/{vw} at table entries {k_at}/{v_at} of {}", tables.len())));
        }
        let (kwi, vwi, nc) = (to_i32(OP, "kw", kw)?, to_i32(OP, "vw", vw)?, to_i32(OP, "n_ctx", n_ctx)?);
        let f = self.func(Family::Attention, KV_WRITE_ROWS_AT[K::ENTRY])?;
        let (kt, vt) = (tables.device_ptr_at(k_at)?, tables.device_ptr_at(v_at)?);
        let (kp, vp, pp) = (k.device_ptr(), v.device_ptr(), positions.device_ptr());
        let grid = ((kw + vw).div_ceil(256).min(64) as u32, n as u32, 1);
        // SAFETY: (k, v, positions, kcs, vcs, kw, vw, n_ctx) as kv_write_rows;
        // sizes checked above, the caches by the caller.
        unsafe { self.launch(f, grid, 256, 0, stream, &mut params![kp, vp, pp, kt, vt, kwi, vwi, nc]) }
    }

    /// [`CudaDevice::attention`] (the per-query kernel) for rows of several
    /// sequences, each over its own cache of `K`: row `t` reads the layer
    /// caches at the device addresses `tables[k_at + t]` / `tables[v_at + t]`.
    /// A row's output has the bits it has alone. `n_ctx` is the longest
    /// row's context (it sizes the splits); `work` holds
    /// [`attention_workspace_len`] values for it.
    ///
    /// # Safety
    /// Every address must be the start of a live cache of `K` holding at
    /// least `positions[t] + 1` rows of the widths `p` gives.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attention_rows<K: KvElem>(
        &self,
        stream: &CudaStream,
        p: &AttnParams,
        q: &DeviceBuf<f32>,
        positions: &DeviceBuf<u32>,
        tables: &DeviceBuf<u64>,
        (k_at, v_at): (usize, usize),
        n_ctx: usize,
        work: &mut DeviceBuf<f32>,
        out: &mut DeviceBuf<f32>,
    ) -> Result<(), CudaError> {
        const OP: &str = "attention_rows";
        if p.n_kv_head == 0 || p.n_head % p.n_kv_head != 0 || p.head_dim_k == 0 || p.head_dim_v == 0 || p.head_dim_k > 1024 || p.head_dim_v > 512 {
            return Err(shape(OP, format!("{} heads over {} kv heads, head dims {}/{}", p.n_head, p.n_kv_head, p.head_dim_k, p.head_dim_v)));
        }
        let n_q = positions.len();
        want(OP, "q", q.len(), n_q * p.n_head * p.head_dim_k)?;
        want(OP, "out", out.len(), n_q * p.n_head * p.head_dim_v)?;
        want(OP, "work", work.len(), attention_workspace_len(p, n_q, n_ctx))?;
        let n_split = attention_splits(p, n_ctx);
        if k_at.max(v_at) + n_q > tables.len() || n_q > 65535 || p.n_head > 65535 || n_split > 65535 {
            return Err(shape(OP, format!("{n_q} rows at table entries {k_at}/{v_at} of {}, or a grid too large", tables.len())));
        }
        let (nq, nh, nkv) = (n_q as i32, p.n_head as i32, p.n_kv_head as i32);
        let (dk, dv, nc) = (p.head_dim_k as i32, p.head_dim_v as i32, to_i32(OP, "n_ctx", n_ctx)?);
        let (scale, window, softcap) = (p.scale, to_i32(OP, "window", p.window)?, p.softcap);
        let (chunk, ns) = (ATT_CHUNK as i32, n_split as i32);
        let (kt, vt) = (tables.device_ptr_at(k_at)?, tables.device_ptr_at(v_at)?);
        let (qp, pp, wp, op) = (q.device_ptr(), positions.device_ptr(), work.device_ptr(), out.device_ptr());
        // The table's addresses are the caches' own allocations (16-byte aligned).
        let grouped = if grouped_pays(p, n_ctx) { self.attention_grouped_entry(p, |i| att_decode_rows_at(K::ENTRY, i), [qp, 0, 0])? } else { None };
        if let Some((index, smem)) = grouped {
            let gb = grouped_heads(p, n_q, n_split, self.sm_count());
            let f = self.func(Family::Attention, index)?;
            let grid = ((p.n_kv_head * (p.n_head / p.n_kv_head).div_ceil(gb)) as u32, n_q as u32, n_split as u32);
            let gbi = gb as i32;
            // SAFETY: parameters as AD_ROWS_ENTRY; sizes checked above, the
            // caches by the caller.
            unsafe { self.launch(f, grid, ATT_DECODE_THREADS, smem, stream, &mut params![qp, pp, kt, vt, wp, nh, nkv, dv, nc, scale, window, softcap, ns, gbi])? };
        } else {
            let f = self.func(Family::Attention, ATT_ROWS_AT[K::ENTRY])?;
            let smem = ((p.head_dim_k + ATT_CHUNK) * 4) as u32;
            // SAFETY: parameters as attn_partial_rows_f32; sizes checked above,
            // the caches by the caller.
            unsafe {
                self.launch(
                    f,
                    (p.n_head as u32, n_q as u32, n_split as u32),
                    ATT_THREADS,
                    smem,
                    stream,
                    &mut params![qp, pp, kt, vt, wp, nq, nh, nkv, dk, dv, nc, scale, window, softcap, chunk, ns],
                )?;
            }
        }
        let f = self.func(Family::Attention, ATT_COMBINE)?;
        // SAFETY: (part, out, n_q, n_head, dv, n_split) as attn_combine.
        unsafe { self.launch(f, (p.n_head as u32, n_q as u32, 1), ATT_THREADS, 0, stream, &mut params![wp, op, nq, nh, dv, ns]) }
    }
}

/// Whether the grouped decode kernel is the faster for these heads at this
/// context (the per-query kernel's re-reads stay in L2 below it).
fn grouped_pays(p: &AttnParams, n_ctx: usize) -> bool {
    let span = if p.window > 0 { p.window.min(n_ctx) } else { n_ctx };
    p.n_kv_head > 0 && p.n_head / p.n_kv_head >= ATT_GROUPED_MIN_GROUP && span >= ATT_GROUPED_MIN_CTX
}

/// Heads per attn_decode block: all of a group's (at most 16) where that
/// gives blocks enough for four waves over `sm_count` SMs, else fewer (down
/// to 4) for more blocks (their k / v reads then meet in L2). The bits do
/// not depend on it.
fn grouped_heads(p: &AttnParams, n_q: usize, n_split: usize, sm_count: usize) -> usize {
    let group = p.n_head / p.n_kv_head.max(1);
    let mut gb = group.min(ATT_DECODE_HEADS);
    let blocks = |gb: usize| p.n_kv_head * group.div_ceil(gb) * n_q * n_split;
    while gb > 4 && blocks(gb) < 4 * sm_count {
        gb = gb.div_ceil(2);
    }
    gb
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heads(n_head: usize, n_kv_head: usize, window: usize) -> AttnParams {
        AttnParams { n_head, n_kv_head, head_dim_k: 128, head_dim_v: 128, scale: 0.1, window, softcap: 0.0 }
    }

    #[test]
    fn the_grouped_kernel_takes_long_contexts_of_groups_of_four_or_more() {
        let q235 = heads(64, 4, 0);
        assert!(!grouped_pays(&q235, ATT_GROUPED_MIN_CTX - 1) && grouped_pays(&q235, ATT_GROUPED_MIN_CTX));
        // A window caps the keys a query reads, whatever the context.
        assert!(!grouped_pays(&heads(64, 4, 1024), 1 << 20));
        assert!(!grouped_pays(&heads(12, 4, 0), 1 << 20), "groups of 3");
    }

    #[test]
    fn heads_per_block_shrink_until_the_blocks_fill_four_waves() {
        let q235 = heads(64, 4, 0);
        // 32768 keys: 128 splits x 4 kv heads = 512 blocks of 16 heads, below 4 x 132.
        assert_eq!(grouped_heads(&q235, 1, 128, 132), 8);
        assert_eq!(grouped_heads(&q235, 1, 128, 32), 16);
        assert_eq!(grouped_heads(&q235, 1, 1, 132), 4, "never below a quad");
        // Groups smaller than 16 start from the group; 20 heads a kv head split 16 + 4.
        assert_eq!(grouped_heads(&heads(32, 4, 0), 1, 1000, 132), 8);
        assert_eq!(grouped_heads(&heads(40, 2, 0), 1, 1000, 132), 16);
        assert_eq!(grouped_heads(&heads(6, 2, 0), 1, 1, 132), 3);
    }
}
