//! Shapes of step values: N-D, row-major, with two symbolic sizes the host
//! fixes per step (the tokens of the step and the rows whose logits it
//! wants), so one graph serves every step of a kind.

use std::fmt;

/// One dimension of a value's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    /// A fixed size.
    N(u64),
    /// The tokens of the step (a prefill chunk's length, the rows of a batched decode).
    T,
    /// The rows whose logits the host wants (`output_rows`).
    O,
    /// The positions a sequence's cache holds after this step (its past and
    /// the step's tokens): the rows of a `state_rows` read and the keys of a
    /// `mask`. Defined for steps of one sequence only.
    C,
}

/// How a [`Dim`] crosses the boundary: sizes as themselves, symbols negative.
pub const DIM_T: i64 = -1;
pub const DIM_O: i64 = -2;
pub const DIM_C: i64 = -3;

impl Dim {
    pub fn encode(self) -> i64 {
        match self {
            Dim::N(n) => n as i64,
            Dim::T => DIM_T,
            Dim::O => DIM_O,
            Dim::C => DIM_C,
        }
    }
    pub fn decode(v: i64) -> Result<Dim, String> {
        match v {
            DIM_T => Ok(Dim::T),
            DIM_O => Ok(Dim::O),
            DIM_C => Ok(Dim::C),
            n if n >= 0 => Ok(Dim::N(n as u64)),
            n => Err(format!("dimension code {n} is not a size nor a known symbol")),
        }
    }
    pub fn fixed(self) -> Option<u64> {
        match self {
            Dim::N(n) => Some(n),
            _ => None,
        }
    }
    /// The size at run time, given the step's token, output-row and
    /// context counts.
    pub fn at(self, s: &Sizes) -> usize {
        match self {
            Dim::N(n) => n as usize,
            Dim::T => s.t,
            Dim::O => s.o,
            Dim::C => s.c,
        }
    }
}

/// What the symbols stand for in one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Sizes {
    pub t: usize,
    pub o: usize,
    pub c: usize,
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::N(n) => write!(f, "{n}"),
            Dim::T => f.write_str("T"),
            Dim::O => f.write_str("O"),
            Dim::C => f.write_str("C"),
        }
    }
}

/// Element type of a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    /// Indices: token ids, positions, selected experts.
    I32,
}

/// A value's element type and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    pub dtype: DType,
    pub dims: Vec<Dim>,
}

impl Shape {
    pub fn f32(dims: Vec<Dim>) -> Shape {
        Shape { dtype: DType::F32, dims }
    }
    pub fn i32(dims: Vec<Dim>) -> Shape {
        Shape { dtype: DType::I32, dims }
    }
    pub fn rank(&self) -> usize {
        self.dims.len()
    }
    /// The last dimension's fixed size, if it has one.
    pub fn last(&self) -> Option<u64> {
        self.dims.last().and_then(|d| d.fixed())
    }
    /// Sizes at run time.
    pub fn at(&self, s: &Sizes) -> Vec<usize> {
        self.dims.iter().map(|d| d.at(s)).collect()
    }
    /// Resolve a possibly negative axis (-1 = last).
    pub fn axis(&self, axis: i64) -> Result<usize, String> {
        let r = self.rank() as i64;
        let a = if axis < 0 { axis + r } else { axis };
        if a < 0 || a >= r {
            return Err(format!("axis {axis} is outside a rank-{r} value"));
        }
        Ok(a as usize)
    }
    /// The product of the fixed dims, and the symbols in order.
    pub fn split(&self) -> (u64, Vec<Dim>) {
        let mut n = 1u64;
        let mut sym = Vec::new();
        for d in &self.dims {
            match d {
                Dim::N(k) => n = n.saturating_mul(*k),
                s => sym.push(*s),
            }
        }
        (n, sym)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.dims.iter().map(|d| d.to_string()).collect();
        let t = match self.dtype {
            DType::F32 => "f32",
            DType::I32 => "i32",
        };
        write!(f, "{t}[{}]", dims.join(", "))
    }
}

/// Numpy broadcasting of two shapes (aligned at the last axis). A symbol
/// broadcasts only against itself or a size of 1.
pub fn broadcast(a: &[Dim], b: &[Dim]) -> Result<Vec<Dim>, String> {
    let n = a.len().max(b.len());
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let da = if i + a.len() >= n { a[i + a.len() - n] } else { Dim::N(1) };
        let db = if i + b.len() >= n { b[i + b.len() - n] } else { Dim::N(1) };
        let d = match (da, db) {
            (x, y) if x == y => x,
            (Dim::N(1), y) => y,
            (x, Dim::N(1)) => x,
            (x, y) => return Err(format!("dimensions {x} and {y} do not broadcast")),
        };
        out.push(d);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dims_round_trip_and_bad_codes_are_refused() {
        for d in [Dim::N(0), Dim::N(4096), Dim::T, Dim::O, Dim::C] {
            assert_eq!(Dim::decode(d.encode()), Ok(d));
        }
        assert!(Dim::decode(-4).is_err());
    }

    #[test]
    fn broadcasting_follows_numpy_and_keeps_symbols_apart() {
        use Dim::*;
        assert_eq!(broadcast(&[T, N(4)], &[N(4)]), Ok(vec![T, N(4)]));
        assert_eq!(broadcast(&[T, N(1)], &[N(1), N(8)]), Ok(vec![T, N(8)]));
        assert!(broadcast(&[T, N(4)], &[O, N(4)]).is_err());
        assert!(broadcast(&[T, N(4)], &[N(3)]).is_err());
        assert!(broadcast(&[N(2), N(4)], &[T, N(4)]).is_err());
    }

    #[test]
    fn axes_resolve_from_either_end() {
        let s = Shape::f32(vec![Dim::T, Dim::N(2), Dim::N(3)]);
        assert_eq!(s.axis(-1), Ok(2));
        assert_eq!(s.axis(0), Ok(0));
        assert!(s.axis(3).is_err());
        assert!(s.axis(-4).is_err());
        assert_eq!(s.split(), (6, vec![Dim::T]));
    }
}
