//! Ops computed ahead by one fused launch, found from the last step's trace.
//!
//! A decode layer of qwen3 norms q and k per head and then rotates both: four
//! launches of a few microseconds each for a few kilobytes. When the last step
//! of this kind ran `norm(q)`, `norm(k)`, `rope(norm q)`, `rope(norm k)` in a
//! row, the first norm runs all four in one `norm_rope` launch and keeps the
//! other three outputs here. Each is claimed only by an op with the same
//! parameters reading the same value, so a step that departs from the last
//! one wastes a launch but never takes a wrong output. The same holds for the
//! residual add after a MoE op (`moe_combine_add`).

use pulsar_cuda::DeviceBuf;

/// What the fusion needs to know of an op (one per op of a step's trace).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum OpKey {
    Other,
    /// `rms_norm` with this weight (index), eps bits and group.
    Norm { w: Option<u32>, eps: u32, group: u32 },
    /// `rope` with these parameters (floats as bits; mode 0 neox, 1 interleaved).
    Rope { head_dim: u32, n_rot: u32, base: u32, factor: u32, mode: u8 },
    /// `add` (its two inputs, in order, are the match).
    Add,
}

/// One op of a recorded step: its key, inputs and output value (`u32::MAX`
/// when it failed).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct TraceOp {
    pub key: OpKey,
    pub inputs: Vec<u32>,
    pub out: u32,
}

/// Op `i` (a per-head norm) and the three after it in the last step, when
/// they were `norm(k)`, `rope(out i)`, `rope(out i + 1)` with one rope: the
/// input of `norm(k)`, its key and the rope's key.
pub(super) fn norm_rope_ahead(plan: &[TraceOp], i: usize) -> Option<(u32, OpKey, OpKey)> {
    let [a, b, c, d] = plan.get(i..i + 4)? else { return None };
    let (OpKey::Norm { .. }, OpKey::Norm { .. }, OpKey::Rope { .. }) = (a.key, b.key, c.key) else { return None };
    let ok = d.key == c.key
        && b.inputs.len() == 1
        && c.inputs == [a.out]
        && d.inputs == [b.out]
        && a.out != u32::MAX
        && b.out != u32::MAX
        && b.inputs[0] != a.out;
    ok.then(|| (b.inputs[0], b.key, c.key))
}

/// Op `i` (a MoE op) and the one after it in the last step, when that was an
/// add of op i's output and another value: the other value, and whether it
/// came first.
pub(super) fn residual_add_ahead(plan: &[TraceOp], i: usize) -> Option<(u32, bool)> {
    let [a, b] = plan.get(i..i + 2)? else { return None };
    if b.key != OpKey::Add || a.out == u32::MAX || b.inputs.len() != 2 {
        return None;
    }
    match (b.inputs[0] == a.out, b.inputs[1] == a.out) {
        (true, false) => Some((b.inputs[1], false)),
        (false, true) => Some((b.inputs[0], true)),
        _ => None,
    }
}

/// An output computed ahead: claimed by the op with `key` reading `inputs`
/// (a None until the value it stands for exists: the output of the claim of
/// the slot whose `feeds` points here).
pub(super) struct Ahead {
    pub key: OpKey,
    pub inputs: Vec<Option<u32>>,
    pub buf: DeviceBuf<f32>,
    pub rows: usize,
    pub cols: usize,
    /// (slot, input position) that reads this output's value once claimed.
    pub feeds: Option<(usize, usize)>,
}

#[derive(Default)]
pub(super) struct AheadSet {
    slots: Vec<Option<Ahead>>,
}

impl AheadSet {
    /// Add an output; returns its slot.
    pub fn add(&mut self, a: Ahead) -> usize {
        self.slots.push(Some(a));
        self.slots.len() - 1
    }

    /// The output for the op `key` reading `inputs`, if one was computed
    /// ahead; `bind` then gets the value it becomes (see [`AheadSet::bind`]).
    pub fn claim(&mut self, key: OpKey, inputs: &[u32]) -> Option<Ahead> {
        let hit = |a: &Ahead| a.key == key && a.inputs.len() == inputs.len() && a.inputs.iter().zip(inputs).all(|(x, y)| *x == Some(*y));
        let s = self.slots.iter_mut().find(|s| s.as_ref().is_some_and(hit))?;
        s.take()
    }

    /// The input that `feeds` (from a claimed output) names is value `v`.
    pub fn bind(&mut self, feeds: Option<(usize, usize)>, v: u32) {
        let Some((slot, at)) = feeds else { return };
        if let Some(Some(a)) = self.slots.get_mut(slot) {
            if let Some(x) = a.inputs.get_mut(at) {
                *x = Some(v);
            }
        }
    }

    /// Every unclaimed buffer (the step's end).
    pub fn drain(&mut self) -> impl Iterator<Item = DeviceBuf<f32>> + '_ {
        self.slots.drain(..).flatten().map(|a| a.buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(key: OpKey, inputs: &[u32], out: u32) -> TraceOp {
        TraceOp { key, inputs: inputs.to_vec(), out }
    }
    const N1: OpKey = OpKey::Norm { w: Some(3), eps: 1, group: 128 };
    const N2: OpKey = OpKey::Norm { w: Some(4), eps: 1, group: 128 };
    const R: OpKey = OpKey::Rope { head_dim: 128, n_rot: 128, base: 7, factor: 1, mode: 0 };
    const R2: OpKey = OpKey::Rope { head_dim: 128, n_rot: 64, base: 7, factor: 1, mode: 0 };

    #[test]
    fn finds_the_qwen3_pattern() {
        let plan = vec![op(OpKey::Other, &[0], 1), op(OpKey::Other, &[0], 2), op(N1, &[1], 3), op(N2, &[2], 4), op(R, &[3], 5), op(R, &[4], 6)];
        assert_eq!(norm_rope_ahead(&plan, 2), Some((2, N2, R)));
        // Not from another op, nor past the end.
        assert_eq!(norm_rope_ahead(&plan, 1), None);
        assert_eq!(norm_rope_ahead(&plan, 3), None);
    }

    #[test]
    fn refuses_near_misses() {
        let base = [op(N1, &[1], 3), op(N2, &[2], 4), op(R, &[3], 5), op(R, &[4], 6)];
        let cases: [(usize, TraceOp); 5] = [
            (2, op(R, &[4], 5)),       // first rope reads the wrong value
            (3, op(R, &[3], 6)),       // second rope too
            (3, op(R2, &[4], 6)),      // ropes differ
            (1, op(N2, &[3], 4)),      // norm(k) reads norm(q)'s output
            (1, op(OpKey::Other, &[2], 4)),
        ];
        for (at, bad) in cases {
            let mut plan = base.to_vec();
            plan[at] = bad.clone();
            assert_eq!(norm_rope_ahead(&plan, 0), None, "{bad:?} at {at}");
        }
        let mut failed = base.to_vec();
        failed[0].out = u32::MAX;
        assert_eq!(norm_rope_ahead(&failed, 0), None);
        assert_eq!(norm_rope_ahead(&base, 0), Some((2, N2, R)));
    }

    #[test]
    fn finds_the_residual_add_after_a_moe_op() {
        let moe = op(OpKey::Other, &[7], 9);
        assert_eq!(residual_add_ahead(&[moe.clone(), op(OpKey::Add, &[5, 9], 10)], 0), Some((5, true)));
        assert_eq!(residual_add_ahead(&[moe.clone(), op(OpKey::Add, &[9, 5], 10)], 0), Some((5, false)));
        // Not an add of the output, an add of it with itself, or past the end.
        assert_eq!(residual_add_ahead(&[moe.clone(), op(OpKey::Add, &[5, 6], 10)], 0), None);
        assert_eq!(residual_add_ahead(&[moe.clone(), op(OpKey::Add, &[9, 9], 10)], 0), None);
        assert_eq!(residual_add_ahead(&[moe.clone(), op(OpKey::Other, &[5, 9], 10)], 0), None);
        assert_eq!(residual_add_ahead(&[moe], 0), None);
    }
}
