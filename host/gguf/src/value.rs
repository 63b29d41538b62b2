//! Metadata values.
//!
//! Arrays are stored as typed vectors (`Vec<String>`, `Vec<f32>`, ...) rather
//! than one [`Value`] per element: a 262k-token vocabulary is then one vector
//! of strings plus one of scores, not half a million tagged enums.

use std::fmt;

/// The on-disk `gguf_type` of a metadata value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The type for an on-disk id, or `None` if unknown.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The on-disk id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Size in bytes of one value of a fixed-size type; `None` for string/array.
    pub fn fixed_size(self) -> Option<u64> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// The smallest number of bytes one value of this type can occupy on disk
    /// (a string is at least its 8-byte length, an array its type + count).
    /// Used to bound element counts by the bytes that remain, before allocating.
    pub fn min_size(self) -> u64 {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            t => t.fixed_size().unwrap_or(1),
        }
    }

    /// Lower-case name used in messages and reports.
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Array),
}

/// A metadata array: one typed vector per element type. Nested arrays are
/// `Array::Array`, each inner array carrying its own element type.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<Array>),
}

impl Value {
    /// The value's on-disk type.
    pub fn ty(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F32(_) => ValueType::F32,
            Value::F64(_) => ValueType::F64,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
        }
    }

    /// A short description of the type, e.g. `u32` or `array of string`.
    pub fn type_description(&self) -> String {
        match self {
            Value::Array(a) => format!("array of {}", a.elem_type()),
            v => v.ty().name().to_string(),
        }
    }

    /// The value as a signed 128-bit integer when it is of any integer type.
    /// (i128 holds every u64 and i64, so range checks are exact.)
    pub fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The string, if this is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The array, if this is an array.
    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl Array {
    /// The element type.
    pub fn elem_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F32(_) => ValueType::F32,
            Array::F64(_) => ValueType::F64,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
        }
    }

    /// True when the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as a signed 128-bit integer, for arrays of an integer type.
    pub fn int_at(&self, i: usize) -> Option<i128> {
        Some(match self {
            Array::U8(v) => (*v.get(i)?).into(),
            Array::I8(v) => (*v.get(i)?).into(),
            Array::U16(v) => (*v.get(i)?).into(),
            Array::I16(v) => (*v.get(i)?).into(),
            Array::U32(v) => (*v.get(i)?).into(),
            Array::I32(v) => (*v.get(i)?).into(),
            Array::U64(v) => (*v.get(i)?).into(),
            Array::I64(v) => (*v.get(i)?).into(),
            _ => return None,
        })
    }

    /// True for arrays whose elements are integers of some width.
    pub fn is_integer(&self) -> bool {
        use ValueType::*;
        matches!(self.elem_type(), U8 | I8 | U16 | I16 | U32 | I32 | U64 | I64)
    }

    /// Element `i` rendered for humans (strings quoted), used by the report.
    pub fn display_at(&self, i: usize) -> Option<String> {
        Some(match self {
            Array::F32(v) => format!("{}", v.get(i)?),
            Array::F64(v) => format!("{}", v.get(i)?),
            Array::Bool(v) => format!("{}", v.get(i)?),
            Array::String(v) => format!("{:?}", v.get(i)?),
            Array::Array(v) => {
                let a = v.get(i)?;
                format!("[{} x {}]", a.len(), a.elem_type())
            }
            a => format!("{}", a.int_at(i)?),
        })
    }
}

macro_rules! from_impls {
    ($($t:ty => $v:ident),* $(,)?) => {$(
        impl From<$t> for Value { fn from(x: $t) -> Value { Value::$v(x) } }
        impl From<Vec<$t>> for Value { fn from(x: Vec<$t>) -> Value { Value::Array(Array::$v(x)) } }
        impl From<Vec<$t>> for Array { fn from(x: Vec<$t>) -> Array { Array::$v(x) } }
    )*};
}
from_impls!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32,
            u64 => U64, i64 => I64, f32 => F32, f64 => F64, bool => Bool, String => String);

impl From<&str> for Value {
    fn from(s: &str) -> Value {
        Value::String(s.to_string())
    }
}
impl From<Vec<&str>> for Value {
    fn from(v: Vec<&str>) -> Value {
        Value::Array(Array::String(v.into_iter().map(str::to_string).collect()))
    }
}
impl From<Array> for Value {
    fn from(a: Array) -> Value {
        Value::Array(a)
    }
}
impl From<Vec<Array>> for Value {
    fn from(v: Vec<Array>) -> Value {
        Value::Array(Array::Array(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_ids_round_trip_and_unknown_is_none() {
        for id in 0..13 {
            assert_eq!(ValueType::from_id(id).unwrap().id(), id);
        }
        assert_eq!(ValueType::from_id(13), None);
        assert_eq!(ValueType::from_id(u32::MAX), None);
    }

    #[test]
    fn integer_views_are_exact_at_the_extremes() {
        assert_eq!(Value::U64(u64::MAX).as_i128(), Some(u64::MAX as i128));
        assert_eq!(Value::I64(i64::MIN).as_i128(), Some(i64::MIN as i128));
        assert_eq!(Value::F32(1.0).as_i128(), None);
        let a = Array::I16(vec![-3, 7]);
        assert_eq!(a.int_at(0), Some(-3));
        assert_eq!(a.int_at(2), None);
        assert_eq!(Value::from(vec![Array::U8(vec![])]).type_description(), "array of array");
    }
}
