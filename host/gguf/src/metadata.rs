//! The key/value metadata of a GGUF file, in file order, with typed getters.
//!
//! Getters come in two forms: `get_T(key) -> Result<Option<T>>` (absent is
//! `Ok(None)`, present with the wrong type is an error naming the key and both
//! types) and `require_T(key) -> Result<T>` (absent is an error too). Integer
//! getters accept a value of any integer type whose value fits the requested
//! type, because converters are not consistent about widths (`u32` vs `i32`).

use std::collections::HashMap;

use crate::error::{GgufError, Result};
use crate::value::{Array, Value};

/// Ordered metadata with O(1) lookup by key.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

macro_rules! int_getters {
    ($($get:ident, $req:ident, $t:ty, $name:literal;)*) => {$(
        #[doc = concat!("The value as `", $name, "`, accepting any integer type whose value fits.")]
        pub fn $get(&self, key: &str) -> Result<Option<$t>> {
            self.get_int::<$t>(key, $name)
        }
        #[doc = concat!("Like [`Metadata::", stringify!($get), "`], but a missing key is an error.")]
        pub fn $req(&self, key: &str) -> Result<$t> {
            require(key, self.$get(key)?)
        }
    )*};
}

macro_rules! slice_getters {
    ($($get:ident, $req:ident, $t:ty, $variant:ident, $name:literal;)*) => {$(
        #[doc = concat!("The value as a slice, when it is an ", $name, ".")]
        pub fn $get(&self, key: &str) -> Result<Option<&[$t]>> {
            self.typed(key, $name, |v| match v {
                Value::Array(Array::$variant(a)) => Some(a.as_slice()),
                _ => None,
            })
        }
        #[doc = concat!("Like [`Metadata::", stringify!($get), "`], but a missing key is an error.")]
        pub fn $req(&self, key: &str) -> Result<&[$t]> {
            require(key, self.$get(key)?)
        }
    )*};
}

macro_rules! int_vec_getters {
    ($($get:ident, $req:ident, $t:ty, $name:literal;)*) => {$(
        #[doc = concat!("An integer array of any element width, converted to `Vec<", stringify!($t),
                        ">`; an element that does not fit is an error naming its index.")]
        pub fn $get(&self, key: &str) -> Result<Option<Vec<$t>>> {
            self.get_int_vec::<$t>(key, $name)
        }
        #[doc = concat!("Like [`Metadata::", stringify!($get), "`], but a missing key is an error.")]
        pub fn $req(&self, key: &str) -> Result<Vec<$t>> {
            require(key, self.$get(key)?)
        }
    )*};
}

fn require<T>(key: &str, v: Option<T>) -> Result<T> {
    v.ok_or_else(|| GgufError::MissingKey { key: key.to_string() })
}

impl Metadata {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a key; returns `false` (and changes nothing) if it already exists.
    pub fn insert(&mut self, key: impl Into<String>, value: Value) -> bool {
        let key = key.into();
        if self.index.contains_key(&key) {
            return false;
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        true
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when there are no keys.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keys and values in file order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &Value)> + '_ {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Keys in file order.
    pub fn keys(&self) -> impl ExactSizeIterator<Item = &str> + '_ {
        self.entries.iter().map(|(k, _)| k.as_str())
    }

    /// The raw value of a key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.entries[i].1)
    }

    /// True when the key exists.
    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        f: impl FnOnce(&'a Value) -> Option<T>,
    ) -> Result<Option<T>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        match f(v) {
            Some(t) => Ok(Some(t)),
            None => Err(GgufError::WrongType {
                key: key.to_string(),
                expected,
                found: v.type_description(),
            }),
        }
    }

    fn get_int<T: TryFrom<i128>>(&self, key: &str, expected: &'static str) -> Result<Option<T>> {
        let Some(n) = self.typed(key, expected, Value::as_i128)? else { return Ok(None) };
        T::try_from(n).map(Some).map_err(|_| GgufError::OutOfRange {
            key: key.to_string(),
            value: n.to_string(),
            expected,
        })
    }

    fn get_int_vec<T: TryFrom<i128>>(&self, key: &str, expected: &'static str) -> Result<Option<Vec<T>>> {
        let Some(a) = self.typed(key, expected, |v| v.as_array().filter(|a| a.is_integer()))? else {
            return Ok(None);
        };
        let mut out = Vec::with_capacity(a.len());
        for i in 0..a.len() {
            // is_integer() guarantees int_at is Some for every index below len.
            let n = a.int_at(i).unwrap_or_default();
            out.push(T::try_from(n).map_err(|_| GgufError::OutOfRange {
                key: key.to_string(),
                value: format!("{n} (element {i})"),
                expected,
            })?);
        }
        Ok(Some(out))
    }

    int_getters! {
        get_u8, require_u8, u8, "u8";
        get_u16, require_u16, u16, "u16";
        get_u32, require_u32, u32, "u32";
        get_u64, require_u64, u64, "u64";
        get_i32, require_i32, i32, "i32";
        get_i64, require_i64, i64, "i64";
        get_usize, require_usize, usize, "usize";
    }

    /// The value as `f32` (an `f32` key only: narrowing an `f64` is the caller's call).
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>> {
        self.typed(key, "f32", |v| match *v {
            Value::F32(x) => Some(x),
            _ => None,
        })
    }
    /// Like [`Metadata::get_f32`], but a missing key is an error.
    pub fn require_f32(&self, key: &str) -> Result<f32> {
        require(key, self.get_f32(key)?)
    }

    /// The value as `f64`, accepting `f32` or `f64`.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "f64 or f32", |v| match *v {
            Value::F32(x) => Some(x.into()),
            Value::F64(x) => Some(x),
            _ => None,
        })
    }
    /// Like [`Metadata::get_f64`], but a missing key is an error.
    pub fn require_f64(&self, key: &str) -> Result<f64> {
        require(key, self.get_f64(key)?)
    }

    /// The value as `bool`.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "bool", |v| match *v {
            Value::Bool(x) => Some(x),
            _ => None,
        })
    }
    /// Like [`Metadata::get_bool`], but a missing key is an error.
    pub fn require_bool(&self, key: &str) -> Result<bool> {
        require(key, self.get_bool(key)?)
    }

    /// The value as a string.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "string", Value::as_str)
    }
    /// Like [`Metadata::get_str`], but a missing key is an error.
    pub fn require_str(&self, key: &str) -> Result<&str> {
        require(key, self.get_str(key)?)
    }

    /// The value as an array of any element type.
    pub fn get_array(&self, key: &str) -> Result<Option<&Array>> {
        self.typed(key, "array", Value::as_array)
    }
    /// Like [`Metadata::get_array`], but a missing key is an error.
    pub fn require_array(&self, key: &str) -> Result<&Array> {
        require(key, self.get_array(key)?)
    }

    slice_getters! {
        get_str_array, require_str_array, String, String, "array of string";
        get_f32_array, require_f32_array, f32, F32, "array of f32";
        get_i32_array, require_i32_array, i32, I32, "array of i32";
        get_u32_array, require_u32_array, u32, U32, "array of u32";
        get_bool_array, require_bool_array, bool, Bool, "array of bool";
        get_u8_array, require_u8_array, u8, U8, "array of u8";
    }

    int_vec_getters! {
        get_u32_vec, require_u32_vec, u32, "array of integers fitting u32";
        get_i64_vec, require_i64_vec, i64, "array of integers fitting i64";
        get_u64_vec, require_u64_vec, u64, "array of integers fitting u64";
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md() -> Metadata {
        let mut m = Metadata::new();
        assert!(m.insert("a.u8", Value::U8(200)));
        assert!(m.insert("a.neg", Value::I32(-1)));
        assert!(m.insert("a.big", Value::U64(u64::MAX)));
        assert!(m.insert("a.s", Value::from("hi")));
        assert!(m.insert("a.f", Value::F32(0.5)));
        assert!(m.insert("a.ints", Value::from(vec![1i16, 2, -3])));
        assert!(m.insert("a.toks", Value::from(vec!["x", "y"])));
        m
    }

    #[test]
    fn order_and_duplicates() {
        let mut m = md();
        assert!(!m.insert("a.s", Value::Bool(true)));
        assert_eq!(m.get("a.s"), Some(&Value::from("hi")));
        let keys: Vec<_> = m.keys().collect();
        assert_eq!(keys, ["a.u8", "a.neg", "a.big", "a.s", "a.f", "a.ints", "a.toks"]);
    }

    #[test]
    fn integer_getters_widen_and_range_check() {
        let m = md();
        assert_eq!(m.get_u32("a.u8").unwrap(), Some(200));
        assert_eq!(m.require_i64("a.neg").unwrap(), -1);
        assert_eq!(m.get_u64("a.big").unwrap(), Some(u64::MAX));
        assert_eq!(m.get_u32("nope").unwrap(), None);
        let e = m.get_u32("a.neg").unwrap_err().to_string();
        assert!(e.contains("'a.neg'") && e.contains("-1") && e.contains("u32"), "{e}");
        let e = m.require_u32("a.big").unwrap_err().to_string();
        assert!(e.contains("does not fit"), "{e}");
        let e = m.require_u32("nope").unwrap_err().to_string();
        assert!(e.contains("'nope'") && e.contains("missing"), "{e}");
    }

    #[test]
    fn wrong_type_names_key_and_both_types() {
        let m = md();
        let e = m.get_u32("a.s").unwrap_err().to_string();
        assert!(e.contains("'a.s'") && e.contains("expected u32") && e.contains("found string"), "{e}");
        let e = m.get_f32_array("a.toks").unwrap_err().to_string();
        assert!(e.contains("array of f32") && e.contains("array of string"), "{e}");
        assert!(m.get_bool("a.f").is_err());
        assert_eq!(m.get_f64("a.f").unwrap(), Some(0.5));
    }

    #[test]
    fn array_getters() {
        let m = md();
        assert_eq!(m.require_str_array("a.toks").unwrap(), ["x", "y"]);
        assert_eq!(m.get_i64_vec("a.ints").unwrap(), Some(vec![1, 2, -3]));
        let e = m.get_u32_vec("a.ints").unwrap_err().to_string();
        assert!(e.contains("element 2"), "{e}");
        assert!(m.get_i32_array("a.ints").is_err(), "exact-type slice getter must not widen");
        assert!(m.get_u32_vec("a.toks").is_err());
    }
}
