//! Element types of dataset fields and of the batches served from them.
//!
//! The numeric codes are part of the shard format (`docs/FORMAT.md`) and of the wire protocol, so they
//! never change once assigned.

use std::fmt;
use std::str::FromStr;

/// The element type of a field, as stored in a shard and as delivered in a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Unsigned 16-bit integer.
    U16,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 64-bit integer.
    I64,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (the top half of an IEEE 754 binary32).
    BF16,
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary64.
    F64,
}

/// Every dtype, in code order.
pub const ALL_DTYPES: [DType; 12] = [
    DType::U8,
    DType::I8,
    DType::U16,
    DType::I16,
    DType::U32,
    DType::I32,
    DType::U64,
    DType::I64,
    DType::F16,
    DType::BF16,
    DType::F32,
    DType::F64,
];

/// A dtype name or code that gpufeed does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DTypeError {
    /// The name is not one of `u8 i8 u16 i16 u32 i32 u64 i64 f16 bf16 f32 f64`.
    #[error(
        "unknown dtype name {0:?} (expected one of u8 i8 u16 i16 u32 i32 u64 i64 f16 bf16 f32 f64)"
    )]
    UnknownName(String),
    /// The numeric code is not assigned.
    #[error("unknown dtype code {0}")]
    UnknownCode(u8),
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    /// The stable numeric code used in shard files and protocol frames.
    pub const fn code(self) -> u8 {
        match self {
            DType::U8 => 1,
            DType::I8 => 2,
            DType::U16 => 3,
            DType::I16 => 4,
            DType::U32 => 5,
            DType::I32 => 6,
            DType::U64 => 7,
            DType::I64 => 8,
            DType::F16 => 9,
            DType::BF16 => 10,
            DType::F32 => 11,
            DType::F64 => 12,
        }
    }

    /// The dtype with the given code.
    pub fn from_code(code: u8) -> Result<DType, DTypeError> {
        ALL_DTYPES
            .iter()
            .copied()
            .find(|d| d.code() == code)
            .ok_or(DTypeError::UnknownCode(code))
    }

    /// The short lowercase name (`f16`, `bf16`, `i32`, ...), used in manifests, the CLI and JSON.
    pub const fn name(self) -> &'static str {
        match self {
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::U16 => "u16",
            DType::I16 => "i16",
            DType::U32 => "u32",
            DType::I32 => "i32",
            DType::U64 => "u64",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }

    /// True for the floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = DTypeError;

    fn from_str(s: &str) -> Result<DType, DTypeError> {
        ALL_DTYPES
            .iter()
            .copied()
            .find(|d| d.name() == s)
            .ok_or_else(|| DTypeError::UnknownName(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for dtype in ALL_DTYPES {
            assert_eq!(DType::from_code(dtype.code()), Ok(dtype));
            assert_eq!(dtype.name().parse::<DType>(), Ok(dtype));
        }
        assert_eq!(DType::from_code(0), Err(DTypeError::UnknownCode(0)));
        assert!("float16".parse::<DType>().is_err());
    }
}
