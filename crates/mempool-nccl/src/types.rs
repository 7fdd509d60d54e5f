//! The element types and reduction operations a collective takes.

use std::ffi::c_int;

/// `ncclDataType_t`: the element types of a collective.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataType {
    /// `ncclInt8`.
    Int8,
    /// `ncclUint8`.
    Uint8,
    /// `ncclInt32`.
    Int32,
    /// `ncclUint32`.
    Uint32,
    /// `ncclInt64`.
    Int64,
    /// `ncclUint64`.
    Uint64,
    /// `ncclFloat32`.
    Float32,
    /// `ncclFloat64`.
    Float64,
}

impl DataType {
    /// The `ncclDataType_t` value (nccl.h; a C enum, so an `int`).
    pub fn to_raw(self) -> c_int {
        match self {
            DataType::Int8 => 0,
            DataType::Uint8 => 1,
            DataType::Int32 => 2,
            DataType::Uint32 => 3,
            DataType::Int64 => 4,
            DataType::Uint64 => 5,
            DataType::Float32 => 7,
            DataType::Float64 => 8,
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type NCCL reduces and moves: `f32`, `f64`, `i8`, `u8`, `i32`, `u32`, `i64`, `u64`. Sealed:
/// the element size must be the one NCCL assumes for [`NcclType::DATA_TYPE`].
pub trait NcclType: sealed::Sealed + Copy + Send + Sync + 'static {
    /// NCCL's name for it.
    const DATA_TYPE: DataType;
}

macro_rules! nccl_types {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl NcclType for $t {
            const DATA_TYPE: DataType = DataType::$d;
        }
    )*};
}

nccl_types!(i8 => Int8, u8 => Uint8, i32 => Int32, u32 => Uint32, i64 => Int64, u64 => Uint64, f32 => Float32, f64 => Float64);

/// `ncclRedOp_t`: the built-in reductions.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// `ncclSum`.
    Sum,
    /// `ncclProd`.
    Prod,
    /// `ncclMax`.
    Max,
    /// `ncclMin`.
    Min,
    /// `ncclAvg` (NCCL 2.10 and later): the sum divided by the number of ranks.
    Avg,
}

impl ReduceOp {
    /// The `ncclRedOp_t` value (nccl.h; a C enum, so an `int`).
    pub fn to_raw(self) -> c_int {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Prod => 1,
            ReduceOp::Max => 2,
            ReduceOp::Min => 3,
            ReduceOp::Avg => 4,
        }
    }

    /// The NCCL version code that introduced the operation.
    pub(crate) fn since(self) -> i32 {
        match self {
            ReduceOp::Avg => 21000,
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_match_nccl_h() {
        assert_eq!(<i8 as NcclType>::DATA_TYPE.to_raw(), 0);
        assert_eq!(<u8 as NcclType>::DATA_TYPE.to_raw(), 1);
        assert_eq!(<i32 as NcclType>::DATA_TYPE.to_raw(), 2);
        assert_eq!(<u32 as NcclType>::DATA_TYPE.to_raw(), 3);
        assert_eq!(<i64 as NcclType>::DATA_TYPE.to_raw(), 4);
        assert_eq!(<u64 as NcclType>::DATA_TYPE.to_raw(), 5);
        assert_eq!(<f32 as NcclType>::DATA_TYPE.to_raw(), 7);
        assert_eq!(<f64 as NcclType>::DATA_TYPE.to_raw(), 8);
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Avg,
        ];
        assert_eq!(ops.map(ReduceOp::to_raw), [0, 1, 2, 3, 4]);
    }
}
