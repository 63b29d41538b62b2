//! A sequence's state on the CPU, one slot per state the plan declares (by
//! state index): f32 K/V rows per position, rows of a latent cache per
//! position, and fixed-size recurrent states. Allocated once for the
//! context length. KV rows are held in the model's [`KvType`] (rounded once
//! as they are written); latent rows and recurrent states are f32.
//!
//! Rows written at a position are never written again by later positions,
//! so keeping a prefix of a KV or rows cache is free; a recurrent state
//! holds exactly the tokens it has absorbed, so going back needs a
//! [`Snapshot`] (or a restart from position 0).

use pulsar_kernels::ops::{KvRows, KvType};
use pulsar_plugin_api::{ModelPlan, STATE_KV, STATE_RECURRENT, STATE_ROWS};

/// Rows of one cache in its format (the variants of [`KvRows`]).
#[derive(Clone)]
enum KvBuf {
    F32(Vec<f32>),
    F16(Vec<u16>),
    Bf16(Vec<u16>),
    /// Rows of `width` values in a byte format (q8_0, q4_0, fp8),
    /// `ty.row_bytes(width)` bytes each.
    Bytes { ty: KvType, data: Vec<u8>, width: usize },
}

impl KvBuf {
    /// `n` rows of `w` values.
    fn new(ty: KvType, w: usize, n: usize) -> KvBuf {
        match ty {
            KvType::F32 => KvBuf::F32(vec![0.0; w * n]),
            KvType::F16 => KvBuf::F16(vec![0; w * n]),
            KvType::Bf16 => KvBuf::Bf16(vec![0; w * n]),
            KvType::Q8_0 | KvType::Q4_0 | KvType::Fp8 => KvBuf::Bytes { ty, data: vec![0; ty.row_bytes(w) * n], width: w },
        }
    }
    /// Values held (rows times width).
    fn len(&self) -> usize {
        self.rows_all().len()
    }
    fn bytes(&self) -> usize {
        match self {
            KvBuf::F32(v) => 4 * v.len(),
            KvBuf::F16(v) | KvBuf::Bf16(v) => 2 * v.len(),
            KvBuf::Bytes { data, .. } => data.len(),
        }
    }
    fn kv_type(&self) -> KvType {
        self.rows_all().kv_type()
    }
    fn rows_all(&self) -> KvRows<'_> {
        match self {
            KvBuf::F32(v) => KvRows::F32(v),
            KvBuf::F16(v) => KvRows::F16(v),
            KvBuf::Bf16(v) => KvRows::Bf16(v),
            KvBuf::Bytes { ty, data, width } => KvRows::Bytes { ty: *ty, data, width: *width },
        }
    }
    /// Store row `j` (`w` values).
    fn put(&mut self, j: usize, x: &[f32]) {
        let t = self.kv_type();
        let at = j * x.len();
        match self {
            KvBuf::F32(v) => v[at..at + x.len()].copy_from_slice(x),
            KvBuf::F16(v) | KvBuf::Bf16(v) => v[at..at + x.len()].iter_mut().zip(x).for_each(|(o, &x)| *o = t.bits(x)),
            KvBuf::Bytes { data, width, .. } => {
                let rb = t.row_bytes(*width);
                t.put_row(x, &mut data[j * rb..(j + 1) * rb]);
            }
        }
    }
    /// Rows `[0, n)` of `w` values.
    fn rows(&self, w: usize, n: usize) -> KvRows<'_> {
        match self {
            KvBuf::F32(v) => KvRows::F32(&v[..n * w]),
            KvBuf::F16(v) => KvRows::F16(&v[..n * w]),
            KvBuf::Bf16(v) => KvRows::Bf16(&v[..n * w]),
            KvBuf::Bytes { ty, data, width } => KvRows::Bytes { ty: *ty, data: &data[..n * ty.row_bytes(*width)], width: *width },
        }
    }
    /// Copy the first `n` rows of `w` values of `from` (the same format).
    fn copy_prefix(&mut self, from: &KvBuf, w: usize, n: usize) -> Result<(), String> {
        match (self, from) {
            (KvBuf::F32(d), KvBuf::F32(s)) => d[..n * w].copy_from_slice(&s[..n * w]),
            (KvBuf::F16(d), KvBuf::F16(s)) | (KvBuf::Bf16(d), KvBuf::Bf16(s)) => d[..n * w].copy_from_slice(&s[..n * w]),
            (KvBuf::Bytes { ty, data: d, .. }, KvBuf::Bytes { ty: ts, data: s, .. }) if ty == ts => {
                let b = n * ty.row_bytes(w);
                d[..b].copy_from_slice(&s[..b])
            }
            _ => return Err("the two caches hold different KV formats".into()),
        }
        Ok(())
    }
}

pub struct LayerKv {
    kw: usize,
    vw: usize,
    k: KvBuf,
    v: KvBuf,
}

fn full(pos: usize, n_ctx: usize) -> String {
    format!("context is full: position {pos} needs a context larger than {n_ctx} (raise --ctx)")
}

impl LayerKv {
    pub fn write(&mut self, pos: usize, k: &[f32], v: &[f32]) -> Result<(), String> {
        let n_ctx = self.k.len() / self.kw.max(1);
        if pos >= n_ctx {
            return Err(full(pos, n_ctx));
        }
        if k.len() != self.kw || v.len() != self.vw {
            return Err(format!("k/v rows of {}/{} values for a cache of widths {}/{}", k.len(), v.len(), self.kw, self.vw));
        }
        self.k.put(pos, k);
        self.v.put(pos, v);
        Ok(())
    }
    /// Keys of positions `[0, n)`.
    pub fn keys(&self, n: usize) -> KvRows<'_> {
        self.k.rows(self.kw, n)
    }
    pub fn values(&self, n: usize) -> KvRows<'_> {
        self.v.rows(self.vw, n)
    }
    pub fn kv_type(&self) -> KvType {
        self.k.kv_type()
    }
}

/// One row per position.
pub struct Rows {
    width: usize,
    data: Vec<f32>,
}

impl Rows {
    pub fn write(&mut self, pos: usize, row: &[f32]) -> Result<(), String> {
        let n_ctx = self.data.len() / self.width.max(1);
        if pos >= n_ctx {
            return Err(full(pos, n_ctx));
        }
        self.data[pos * self.width..(pos + 1) * self.width].copy_from_slice(row);
        Ok(())
    }
    /// Rows of positions `[0, n)`.
    pub fn rows(&self, n: usize) -> &[f32] {
        &self.data[..n * self.width]
    }
}

/// A recurrent state and how many tokens it has absorbed.
#[derive(Clone, Debug, PartialEq)]
pub struct Recurrent {
    pub value: Vec<f32>,
    pub pos: usize,
}

pub enum Slot {
    Kv(LayerKv),
    Rows(Rows),
    Recurrent(Recurrent),
}

/// What a rollback needs: the position and every recurrent state.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub n_past: usize,
    recurrent: Vec<(usize, Recurrent)>,
}

pub struct SeqState {
    n_ctx: usize,
    slots: Vec<Option<Slot>>,
}

impl SeqState {
    /// Every state of `plan` for a context of `n_ctx` positions, KV rows in
    /// `kv`; kinds this host does not know get no slot (the model refuses
    /// them at open).
    pub fn new(plan: &ModelPlan, n_ctx: usize, kv: KvType) -> SeqState {
        let slots = plan
            .states
            .iter()
            .map(|s| match (s.kind, s.dims.as_slice()) {
                (STATE_KV, [h, dk, dv, _]) => {
                    let (kw, vw) = ((h * dk) as usize, (h * dv) as usize);
                    Some(Slot::Kv(LayerKv { kw, vw, k: KvBuf::new(kv, kw, n_ctx), v: KvBuf::new(kv, vw, n_ctx) }))
                }
                (STATE_ROWS, [w]) => Some(Slot::Rows(Rows { width: *w as usize, data: vec![0.0; *w as usize * n_ctx] })),
                (STATE_RECURRENT, d) => Some(Slot::Recurrent(Recurrent { value: vec![0.0; d.iter().product::<u64>() as usize], pos: 0 })),
                _ => None,
            })
            .collect();
        SeqState { n_ctx, slots }
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Give the memory of every KV and rows cache back (the positions were
    /// evicted): fresh zeroed buffers of the same size, which the allocator
    /// maps lazily, so only positions written again take memory.
    pub fn release(&mut self) {
        for slot in self.slots.iter_mut().flatten() {
            match slot {
                Slot::Kv(l) => {
                    let n = l.k.len() / l.kw.max(1);
                    l.k = KvBuf::new(l.k.kv_type(), l.kw, n);
                    l.v = KvBuf::new(l.v.kv_type(), l.vw, n);
                }
                Slot::Rows(r) => r.data = vec![0.0; r.data.len()],
                Slot::Recurrent(_) => {}
            }
        }
    }

    pub fn bytes(&self) -> usize {
        self.slots
            .iter()
            .flatten()
            .map(|s| match s {
                Slot::Kv(l) => l.k.bytes() + l.v.bytes(),
                Slot::Rows(r) => 4 * r.data.len(),
                Slot::Recurrent(r) => 4 * r.value.len(),
            })
            .sum()
    }

    pub fn layer(&self, state: usize) -> Result<&LayerKv, String> {
        match self.slots.get(state) {
            Some(Some(Slot::Kv(l))) => Ok(l),
            _ => Err(format!("state {state} is not a KV cache")),
        }
    }

    /// The KV state, checking the row widths the op uses against the plan.
    pub fn layer_mut(&mut self, state: usize, kw: usize, vw: usize) -> Result<&mut LayerKv, String> {
        let l = match self.slots.get_mut(state) {
            Some(Some(Slot::Kv(l))) => l,
            _ => return Err(format!("state {state} is not a KV cache")),
        };
        if l.kw != kw || l.vw != vw {
            return Err(format!("KV state {state}: attention uses k/v widths {kw}/{vw}, the plan declared {}/{}", l.kw, l.vw));
        }
        Ok(l)
    }

    pub fn rows_mut(&mut self, state: usize) -> Result<&mut Rows, String> {
        match self.slots.get_mut(state) {
            Some(Some(Slot::Rows(r))) => Ok(r),
            _ => Err(format!("state {state} is not a rows state")),
        }
    }

    pub fn recurrent_mut(&mut self, state: usize) -> Result<&mut Recurrent, String> {
        match self.slots.get_mut(state) {
            Some(Some(Slot::Recurrent(r))) => Ok(r),
            _ => Err(format!("state {state} is not a recurrent state")),
        }
    }

    /// Whether any state (a recurrent or conv one) cannot go back without a snapshot.
    pub fn has_recurrent(&self) -> bool {
        self.slots.iter().any(|s| matches!(s, Some(Slot::Recurrent(_))))
    }

    /// How many of `n_past` cached positions can stay when only the first
    /// `keep` are wanted: `keep` itself, unless a recurrent state would have
    /// to go back (it cannot without a snapshot): then 0, a restart.
    pub fn keepable(&self, keep: usize, n_past: usize) -> usize {
        if keep >= n_past || !self.has_recurrent() {
            keep.min(n_past)
        } else {
            0
        }
    }

    /// Copy the first `n` positions of every KV and rows cache of `from`
    /// (a state of the same plan) into this one: the rows a prefix of the
    /// same tokens would write. Refused for recurrent states, which hold
    /// their whole history, not a prefix.
    pub fn copy_prefix(&mut self, from: &SeqState, n: usize) -> Result<(), String> {
        if self.has_recurrent() || self.slots.len() != from.slots.len() {
            return Err("only the caches of the same plan without recurrent states copy a prefix".into());
        }
        if n > self.n_ctx.min(from.n_ctx) {
            return Err(full(n - 1, self.n_ctx.min(from.n_ctx)));
        }
        for (dst, src) in self.slots.iter_mut().zip(&from.slots) {
            match (dst, src) {
                (Some(Slot::Kv(d)), Some(Slot::Kv(s))) if (d.kw, d.vw) == (s.kw, s.vw) => {
                    d.k.copy_prefix(&s.k, d.kw, n)?;
                    d.v.copy_prefix(&s.v, d.vw, n)?;
                }
                (Some(Slot::Rows(d)), Some(Slot::Rows(s))) if d.width == s.width => d.data[..n * d.width].copy_from_slice(&s.data[..n * s.width]),
                (None, None) => {}
                _ => return Err("the two states' slots differ".into()),
            }
        }
        Ok(())
    }

    /// The state after `n_past` positions, for [`SeqState::restore`]
    /// (speculative decoding: try tokens, go back).
    pub fn snapshot(&self, n_past: usize) -> Snapshot {
        let recurrent = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Some(Slot::Recurrent(r)) => Some((i, r.clone())),
                _ => None,
            })
            .collect();
        Snapshot { n_past, recurrent }
    }

    /// Go back to `snap`; returns its position. Rows past it are overwritten
    /// by the tokens that follow.
    pub fn restore(&mut self, snap: &Snapshot) -> Result<usize, String> {
        for (i, r) in &snap.recurrent {
            *self.recurrent_mut(*i)? = r.clone();
        }
        Ok(snap.n_past)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pulsar_plugin_api::StateSpec;

    fn plan(states: Vec<StateSpec>) -> ModelPlan {
        ModelPlan { states: states.into(), ..Default::default() }
    }

    #[test]
    fn every_kind_gets_its_slot_and_bytes() {
        let p = plan(vec![StateSpec::kv(0, 2, 4, 3, 0), StateSpec::rows(0, 5), StateSpec::recurrent(1, &[2, 3])]);
        let mut s = SeqState::new(&p, 8, KvType::F32);
        assert_eq!(s.bytes(), 4 * (8 * 8 + 8 * 6) + 4 * 8 * 5 + 4 * 6);
        assert!(s.layer_mut(0, 8, 6).is_ok());
        assert!(s.layer_mut(0, 8, 5).is_err());
        assert!(s.rows_mut(1).is_ok() && s.rows_mut(0).is_err());
        assert!(s.recurrent_mut(2).is_ok() && s.recurrent_mut(1).is_err());
        let e = s.rows_mut(1).unwrap().write(8, &[0.0; 5]).unwrap_err();
        assert!(e.contains("--ctx"), "{e}");
    }

    #[test]
    fn a_prefix_copies_kv_and_rows_and_never_a_recurrent_state() {
        let p = plan(vec![StateSpec::kv(0, 1, 2, 2, 0), StateSpec::rows(0, 3)]);
        let (mut a, mut b) = (SeqState::new(&p, 4, KvType::F32), SeqState::new(&p, 4, KvType::F32));
        for pos in 0..4 {
            let x = pos as f32;
            a.layer_mut(0, 2, 2).unwrap().write(pos, &[x, x + 0.5], &[-x, -x - 0.5]).unwrap();
            a.rows_mut(1).unwrap().write(pos, &[x; 3]).unwrap();
        }
        b.copy_prefix(&a, 3).unwrap();
        let f32s = |r: KvRows<'_>| match r {
            KvRows::F32(v) => v.to_vec(),
            other => panic!("{other:?}"),
        };
        assert_eq!(f32s(b.layer(0).unwrap().keys(4)), &[0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 0.0, 0.0]);
        assert_eq!(f32s(b.layer(0).unwrap().values(3)), f32s(a.layer(0).unwrap().values(3)));
        assert_eq!(&b.rows_mut(1).unwrap().rows(4)[6..], &[2.0, 2.0, 2.0, 0.0, 0.0, 0.0]);
        assert!(b.copy_prefix(&a, 5).unwrap_err().contains("--ctx"));
        let r = plan(vec![StateSpec::kv(0, 1, 2, 2, 0), StateSpec::recurrent(0, &[3])]);
        assert!(SeqState::new(&r, 4, KvType::F32).copy_prefix(&SeqState::new(&r, 4, KvType::F32), 1).is_err());
    }

    #[test]
    fn sixteen_bit_caches_round_on_write_take_half_the_bytes_and_copy_only_their_own_format() {
        let p = plan(vec![StateSpec::kv(0, 1, 2, 2, 0)]);
        for t in [KvType::F16, KvType::Bf16] {
            let (mut a, mut b) = (SeqState::new(&p, 4, t), SeqState::new(&p, 4, t));
            assert_eq!(a.bytes(), 2 * (8 + 8));
            a.layer_mut(0, 2, 2).unwrap().write(1, &[0.1, -3.7], &[1e-3, 7.0]).unwrap();
            b.copy_prefix(&a, 2).unwrap();
            let mut buf = [0f32; 2];
            let layer = b.layer(0).unwrap();
            assert_eq!(layer.kv_type(), t);
            assert_eq!(layer.keys(2).get(2, &mut buf), &[t.round(0.1).unwrap(), t.round(-3.7).unwrap()]);
            assert_eq!(layer.values(2).get(2, &mut buf), &[t.round(1e-3).unwrap(), 7.0]);
            assert!(b.layer_mut(0, 2, 2).unwrap().write(0, &[0.0; 3], &[0.0; 2]).is_err());
            assert!(SeqState::new(&p, 4, KvType::F32).copy_prefix(&a, 1).unwrap_err().contains("format"));
        }
    }

    #[test]
    fn fp8_caches_take_a_byte_a_value_and_read_back_the_rounded_values() {
        let p = plan(vec![StateSpec::kv(0, 1, 2, 2, 0)]);
        let (mut a, mut b) = (SeqState::new(&p, 4, KvType::Fp8), SeqState::new(&p, 4, KvType::Fp8));
        assert_eq!(a.bytes(), 8 + 8);
        a.layer_mut(0, 2, 2).unwrap().write(1, &[0.1, -3.7], &[1e-3, 900.0]).unwrap();
        b.copy_prefix(&a, 2).unwrap();
        let mut buf = [0f32; 2];
        let layer = b.layer(0).unwrap();
        assert_eq!(layer.kv_type(), KvType::Fp8);
        assert_eq!(layer.keys(2).get(2, &mut buf), &[0.1015625, -3.75]);
        // 1e-3 is a subnormal (0.512 x 2^-9 rounds to 2^-9); 900 saturates.
        assert_eq!(layer.values(2).get(2, &mut buf), &[1.0 / 512.0, 448.0]);
        assert!(SeqState::new(&p, 4, KvType::Q8_0).copy_prefix(&a, 1).unwrap_err().contains("format"));
    }

    #[test]
    fn q8_0_caches_quantize_rows_on_write_and_copy_them_whole() {
        // k rows of 2 x 20 = 40 values: a block of 32 and one of 8; v rows of 2 x 3.
        let p = plan(vec![StateSpec::kv(0, 2, 20, 3, 0)]);
        let (mut a, mut b) = (SeqState::new(&p, 3, KvType::Q8_0), SeqState::new(&p, 3, KvType::Q8_0));
        assert_eq!(a.bytes(), 3 * (48 + 16));
        let k: Vec<f32> = (0..40).map(|i| i as f32 * 0.25 - 4.0).collect();
        a.layer_mut(0, 40, 6).unwrap().write(1, &k, &[1.0, -2.0, 0.5, 0.0, 3.0, 127.0]).unwrap();
        b.copy_prefix(&a, 2).unwrap();
        let mut row = vec![0u8; 48];
        KvType::Q8_0.put_row(&k, &mut row);
        let want = KvRows::Bytes { ty: KvType::Q8_0, data: &row, width: 40 };
        let layer = b.layer(0).unwrap();
        assert_eq!(layer.keys(2).len(), 80);
        let (mut x, mut y) = ([0f32; 20], [0f32; 20]);
        assert_eq!(layer.keys(2).get(60, &mut x), want.get(20, &mut y));
        let mut v = [0f32; 3];
        assert_eq!(layer.values(2).get(9, &mut v), &[0.0, 3.0, 127.0]);
        assert!(SeqState::new(&p, 3, KvType::F16).copy_prefix(&a, 1).unwrap_err().contains("format"));
    }

    #[test]
    fn a_snapshot_restores_recurrent_states_and_truncation_respects_them() {
        let p = plan(vec![StateSpec::kv(0, 1, 2, 2, 0), StateSpec::recurrent(0, &[3])]);
        let mut s = SeqState::new(&p, 16, KvType::F32);
        s.recurrent_mut(1).unwrap().value = vec![1.0, 2.0, 3.0];
        s.recurrent_mut(1).unwrap().pos = 4;
        let snap = s.snapshot(4);
        s.recurrent_mut(1).unwrap().value = vec![9.0; 3];
        s.recurrent_mut(1).unwrap().pos = 7;
        assert_eq!(s.restore(&snap), Ok(4));
        assert_eq!(s.recurrent_mut(1).unwrap(), &Recurrent { value: vec![1.0, 2.0, 3.0], pos: 4 });
        // A recurrent state cannot go back without a snapshot; KV alone can.
        assert_eq!(s.keepable(2, 4), 0);
        assert_eq!(s.keepable(4, 4), 4);
        let kv_only = SeqState::new(&plan(vec![StateSpec::kv(0, 1, 2, 2, 0)]), 16, KvType::F32);
        assert_eq!(kv_only.keepable(2, 4), 2);
        assert_eq!(kv_only.keepable(9, 4), 4);
    }
}
