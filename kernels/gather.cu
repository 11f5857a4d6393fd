// Gather + convert: builds a batch slot from decoded (or raw) blocks.
//
// Compiled at run time by NVRTC (see src/device/module.rs) without any CUDA header. The input is a
// table of pieces, each a run of elements copied from one source buffer into the slot and converted on
// the way; a sample spanning two blocks is two pieces. One thread block takes one piece at a time,
// having read its next pieces (up to 256) and their sources into shared memory together.
// docs/KERNELS.md describes the design; the CPU reference is crate::decode::convert, whose f16 and
// bf16 rules are the `half` crate's: this file reproduces them with integer operations, bit for bit.
//
// Every piece is checked against its source's length and the slot's capacity before any access; a
// piece that does not fit is skipped and counted in the outcome.
//
// Sources are the few device buffers passed by value (block cache, staging), and a table of *regions*
// in device memory: page-cache windows registered and mapped for the device, which pieces read
// straight over PCIe (zero-copy), one row at a time, so a shuffled batch never stages whole blocks.
// A piece's source index below GF_GATHER_SOURCES_MAX names a buffer, from it upwards a region.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef signed char i8;
typedef short i16;
typedef int i32;
typedef long long i64;

#define GF_GATHER_SOURCES_MAX 4

// 1: each thread stores one 16-byte vector per step and loads just the inputs it needs, so that every
// warp-wide store covers 512 contiguous bytes; 0: each thread loads whole 16-byte vectors and stores
// every output they make (several strided 16-byte stores per step).
#ifndef GF_GATHER_COALESCED_STORES
#define GF_GATHER_COALESCED_STORES 1
#endif

// Conversion codes, mirrored by kernels::GatherOp.
#define GF_OP_COPY 0u
#define GF_OP_F16_F32 1u
#define GF_OP_BF16_F32 2u
#define GF_OP_U8_F32 3u
#define GF_OP_I8_F32 4u
#define GF_OP_U16_F32 5u
#define GF_OP_I16_F32 6u
#define GF_OP_U32_F32 7u
#define GF_OP_I32_F32 8u
#define GF_OP_U64_F32 9u
#define GF_OP_I64_F32 10u
#define GF_OP_F64_F32 11u
#define GF_OP_U8_I64 12u
#define GF_OP_I8_I64 13u
#define GF_OP_U16_I64 14u
#define GF_OP_I16_I64 15u
#define GF_OP_U32_I64 16u
#define GF_OP_I32_I64 17u

// One run of elements. Layout mirrored by kernels::GatherPiece (#[repr(C)], 32 bytes).
struct GatherPiece {
    u64 src_offset;  // byte offset of the first element in sources[source]
    u64 dst_offset;  // byte offset of the first converted element in the slot
    u32 elements;    // element count (bytes, for GF_OP_COPY)
    u16 source;      // index into the sources table
    u8 op;           // GF_OP_*
    u8 reserved0;
    float scale;     // multiplier for GF_OP_U8_F32 (1.0: exact conversion)
    u32 reserved1;
};

// The buffers pieces may read from, passed by value. Mirrored by kernels::GatherSources.
struct GatherSources {
    u64 ptr[GF_GATHER_SOURCES_MAX];
    u64 bytes[GF_GATHER_SOURCES_MAX];
    u32 count;
    u32 reserved;
};

// One mapped region, in a device table. Mirrored by kernels::GatherRegion (16 bytes).
struct GatherRegion {
    u64 ptr;    // device address of the mapped window
    u64 bytes;  // its length
};

// Mirrored by kernels::GatherOutcome; zeroed before each launch.
struct GatherOutcome {
    u32 faulted_pieces;       // pieces skipped because they did not fit
    u32 last_faulted_plus_1;  // 1 + the highest index of a skipped piece, 0 when none
};

__device__ __forceinline__ bool extent_fits(u64 offset, u64 bytes, u64 capacity) {
    return offset <= capacity && bytes <= capacity - offset;
}

// f16 -> f32 exactly as half::f16::to_f32: subnormals normalised, infinities kept, NaN keeps sign and
// payload with the quiet bit set.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    const u32 sign = ((u32)h & 0x8000u) << 16;
    const u32 exp = ((u32)h >> 10) & 0x1fu;
    const u32 man = (u32)h & 0x3ffu;
    u32 bits;
    if (exp == 0x1fu) {
        bits = man == 0u ? (sign | 0x7f800000u) : (sign | 0x7fc00000u | (man << 13));
    } else if (exp == 0u) {
        if (man == 0u) {
            bits = sign;
        } else {
            // man has its top set bit at position 9 - e; shift it to the implicit bit.
            const u32 e = (u32)__clz(man) - 22u;
            bits = sign | ((112u - e) << 23) | ((man << (14u + e)) & 0x7fffffu);
        }
    } else {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    }
    return __uint_as_float(bits);
}

// bf16 -> f32 exactly as half::bf16::to_f32: the top half of the f32, NaN quietened.
__device__ __forceinline__ float bf16_to_f32(u16 h) {
    const u32 x = (u32)h;
    return __uint_as_float(((x & 0x7fffu) > 0x7f80u ? (x | 0x40u) : x) << 16);
}

// f64 -> f32 rounded to nearest even; NaN as x86 cvtsd2ss (and so Rust's `as` there) produces it: sign
// kept, quiet bit set, the payload's top 22 bits kept.
__device__ __forceinline__ float f64_to_f32(u64 b) {
    if ((b & 0x7fffffffffffffffull) > 0x7ff0000000000000ull) {
        const u32 sign = (u32)(b >> 32) & 0x80000000u;
        return __uint_as_float(sign | 0x7fc00000u | (u32)((b >> 29) & 0x3fffffu));
    }
    return (float)__longlong_as_double((i64)b);
}

// Conversion functors: In is the stored element, Out the slot's.
struct CopyByte {
    __device__ __forceinline__ u8 operator()(u8 x) const { return x; }
};
struct F16ToF32 {
    __device__ __forceinline__ float operator()(u16 x) const { return f16_to_f32(x); }
};
struct Bf16ToF32 {
    __device__ __forceinline__ float operator()(u16 x) const { return bf16_to_f32(x); }
};
struct U8ToF32 {
    float scale;
    __device__ __forceinline__ float operator()(u8 x) const { return __fmul_rn((float)x, scale); }
};
template <typename T>
struct IntToF32 {
    __device__ __forceinline__ float operator()(T x) const { return (float)x; }
};
struct F64ToF32 {
    __device__ __forceinline__ float operator()(u64 x) const { return f64_to_f32(x); }
};
template <typename T>
struct IntToI64 {
    __device__ __forceinline__ i64 operator()(T x) const { return (i64)x; }
};

// Byte-wise element access, for pieces or edges that are not aligned for typed accesses.
template <typename T>
__device__ __forceinline__ T load_bytes(const u8* __restrict__ p) {
    union {
        T value;
        u8 bytes[sizeof(T)];
    } u;
#pragma unroll
    for (int k = 0; k < (int)sizeof(T); ++k) u.bytes[k] = p[k];
    return u.value;
}

template <typename T>
__device__ __forceinline__ void store_bytes(u8* __restrict__ p, T v) {
    union {
        T value;
        u8 bytes[sizeof(T)];
    } u;
    u.value = v;
#pragma unroll
    for (int k = 0; k < (int)sizeof(T); ++k) p[k] = u.bytes[k];
}

template <int A, int B>
struct MinOf {
    static const int value = A < B ? A : B;
};

// Converts `n` elements from src to dst with the whole thread block. The middle runs on groups of G
// elements moved as 16-byte vectors when src (after a scalar head) and dst are both 16-byte aligned;
// otherwise, and for the head and tail, element by element.
template <typename In, typename Out, typename Conv>
__device__ void convert_piece_wide_loads(const u8* __restrict__ src, u8* __restrict__ dst, u32 n, Conv conv) {
    const int G = 16 / MinOf<(int)sizeof(In), (int)sizeof(Out)>::value;
    const int LOADS = G * (int)sizeof(In) / 16;
    const int STORES = G * (int)sizeof(Out) / 16;
    const u32 tid = threadIdx.x;
    const u32 threads = blockDim.x;

    const u32 misalign = (u32)((u64)src & 15u);
    u32 head = ((16u - misalign) & 15u);
    bool vector = head % sizeof(In) == 0u;
    head = head / (u32)sizeof(In);
    if (head > n) head = n;
    vector = vector && (((u64)(dst + (u64)head * sizeof(Out))) & 15u) == 0u;
    if (!vector) head = n;

    for (u32 i = tid; i < head; i += threads) {
        store_bytes<Out>(dst + (u64)i * sizeof(Out), conv(load_bytes<In>(src + (u64)i * sizeof(In))));
    }
    if (!vector) return;

    const u32 groups = (n - head) / (u32)G;
    const uint4* __restrict__ vin = reinterpret_cast<const uint4*>(src + (u64)head * sizeof(In));
    uint4* __restrict__ vout = reinterpret_cast<uint4*>(dst + (u64)head * sizeof(Out));
#pragma unroll 2
    for (u32 g = tid; g < groups; g += threads) {
        union {
            uint4 v[LOADS];
            In e[G];
        } a;
        union {
            uint4 v[STORES];
            Out e[G];
        } b;
#pragma unroll
        for (int k = 0; k < LOADS; ++k) a.v[k] = __ldg(vin + (u64)g * LOADS + k);
#pragma unroll
        for (int k = 0; k < G; ++k) b.e[k] = conv(a.e[k]);
#pragma unroll
        for (int k = 0; k < STORES; ++k) vout[(u64)g * STORES + k] = b.v[k];
    }

    for (u32 i = head + groups * (u32)G + tid; i < n; i += threads) {
        store_bytes<Out>(dst + (u64)i * sizeof(Out), conv(load_bytes<In>(src + (u64)i * sizeof(In))));
    }
}

// Converts `n` elements from src to dst with the whole thread block, one 16-byte output vector per
// thread and step: E = 16 / sizeof(Out) elements, loaded as one access of E * sizeof(In) bytes (two
// 16-byte loads for 8-byte inputs). A scalar head runs until dst is 16-byte aligned; the vector middle
// runs when src is then aligned for its loads; otherwise, and for the tail, element by element.
template <typename In, typename Out, typename Conv>
__device__ void convert_piece_coalesced(const u8* __restrict__ src, u8* __restrict__ dst, u32 n, Conv conv) {
    const int E = 16 / (int)sizeof(Out);
    const int IN_BYTES = E * (int)sizeof(In);
    const u32 tid = threadIdx.x;
    const u32 threads = blockDim.x;

    u32 head = (16u - (u32)((u64)dst & 15u)) & 15u;
    bool vector = head % sizeof(Out) == 0u;
    head = head / (u32)sizeof(Out);
    if (head > n) head = n;
    const u64 in_align = IN_BYTES < 16 ? (u64)IN_BYTES : 16u;
    vector = vector && ((u64)(src + (u64)head * sizeof(In)) % in_align) == 0u;
    if (!vector) head = n;

    for (u32 i = tid; i < head; i += threads) {
        store_bytes<Out>(dst + (u64)i * sizeof(Out), conv(load_bytes<In>(src + (u64)i * sizeof(In))));
    }
    if (!vector) return;

    const u32 groups = (n - head) / (u32)E;
    const u8* __restrict__ vin = src + (u64)head * sizeof(In);
    uint4* __restrict__ vout = reinterpret_cast<uint4*>(dst + (u64)head * sizeof(Out));
#pragma unroll 4
    for (u32 g = tid; g < groups; g += threads) {
        union {
            uint4 q[2];
            uint2 d[4];
            u32 w[8];
            u16 h[16];
            In e[E];
        } a;
        const u8* p = vin + (u64)g * IN_BYTES;
        if (IN_BYTES == 2) {
            a.h[0] = __ldg(reinterpret_cast<const u16*>(p));
        } else if (IN_BYTES == 4) {
            a.w[0] = __ldg(reinterpret_cast<const u32*>(p));
        } else if (IN_BYTES == 8) {
            a.d[0] = __ldg(reinterpret_cast<const uint2*>(p));
        } else if (IN_BYTES == 16) {
            a.q[0] = __ldg(reinterpret_cast<const uint4*>(p));
        } else {
            a.q[0] = __ldg(reinterpret_cast<const uint4*>(p));
            a.q[1] = __ldg(reinterpret_cast<const uint4*>(p) + 1);
        }
        union {
            uint4 q;
            Out e[E];
        } b;
#pragma unroll
        for (int k = 0; k < E; ++k) b.e[k] = conv(a.e[k]);
        vout[g] = b.q;
    }

    for (u32 i = head + groups * (u32)E + tid; i < n; i += threads) {
        store_bytes<Out>(dst + (u64)i * sizeof(Out), conv(load_bytes<In>(src + (u64)i * sizeof(In))));
    }
}

template <typename In, typename Out, typename Conv>
__device__ __forceinline__ void convert_piece(const u8* __restrict__ src, u8* __restrict__ dst, u32 n, Conv conv) {
#if GF_GATHER_COALESCED_STORES
    convert_piece_coalesced<In, Out, Conv>(src, dst, n, conv);
#else
    convert_piece_wide_loads<In, Out, Conv>(src, dst, n, conv);
#endif
}

// Bytes of one stored element and one slot element for each op; 0 for an unknown op.
__device__ __forceinline__ void op_sizes(u32 op, u32* in_bytes, u32* out_bytes) {
    switch (op) {
        case GF_OP_COPY: *in_bytes = 1; *out_bytes = 1; return;
        case GF_OP_F16_F32: case GF_OP_BF16_F32: case GF_OP_U16_F32: case GF_OP_I16_F32:
            *in_bytes = 2; *out_bytes = 4; return;
        case GF_OP_U8_F32: case GF_OP_I8_F32: *in_bytes = 1; *out_bytes = 4; return;
        case GF_OP_U32_F32: case GF_OP_I32_F32: *in_bytes = 4; *out_bytes = 4; return;
        case GF_OP_U64_F32: case GF_OP_I64_F32: case GF_OP_F64_F32: *in_bytes = 8; *out_bytes = 4; return;
        case GF_OP_U8_I64: case GF_OP_I8_I64: *in_bytes = 1; *out_bytes = 8; return;
        case GF_OP_U16_I64: case GF_OP_I16_I64: *in_bytes = 2; *out_bytes = 8; return;
        case GF_OP_U32_I64: case GF_OP_I32_I64: *in_bytes = 4; *out_bytes = 8; return;
        default: *in_bytes = 0; *out_bytes = 0; return;
    }
}

// Converts one piece's `count` elements at `src` into `out` with conversion `op` (GF_OP_*); an unknown
// op writes nothing (the callers count it as a fault first).
__device__ __forceinline__ void convert_op(u32 op, const u8* src, u8* out, u32 count, float scale) {
    switch (op) {
        case GF_OP_COPY: convert_piece<u8, u8>(src, out, count, CopyByte()); break;
        case GF_OP_F16_F32: convert_piece<u16, float>(src, out, count, F16ToF32()); break;
        case GF_OP_BF16_F32: convert_piece<u16, float>(src, out, count, Bf16ToF32()); break;
        case GF_OP_U8_F32: {
            U8ToF32 conv;
            conv.scale = scale;
            convert_piece<u8, float>(src, out, count, conv);
            break;
        }
        case GF_OP_I8_F32: convert_piece<i8, float>(src, out, count, IntToF32<i8>()); break;
        case GF_OP_U16_F32: convert_piece<u16, float>(src, out, count, IntToF32<u16>()); break;
        case GF_OP_I16_F32: convert_piece<i16, float>(src, out, count, IntToF32<i16>()); break;
        case GF_OP_U32_F32: convert_piece<u32, float>(src, out, count, IntToF32<u32>()); break;
        case GF_OP_I32_F32: convert_piece<i32, float>(src, out, count, IntToF32<i32>()); break;
        case GF_OP_U64_F32: convert_piece<u64, float>(src, out, count, IntToF32<u64>()); break;
        case GF_OP_I64_F32: convert_piece<i64, float>(src, out, count, IntToF32<i64>()); break;
        case GF_OP_F64_F32: convert_piece<u64, float>(src, out, count, F64ToF32()); break;
        case GF_OP_U8_I64: convert_piece<u8, i64>(src, out, count, IntToI64<u8>()); break;
        case GF_OP_I8_I64: convert_piece<i8, i64>(src, out, count, IntToI64<i8>()); break;
        case GF_OP_U16_I64: convert_piece<u16, i64>(src, out, count, IntToI64<u16>()); break;
        case GF_OP_I16_I64: convert_piece<i16, i64>(src, out, count, IntToI64<i16>()); break;
        case GF_OP_U32_I64: convert_piece<u32, i64>(src, out, count, IntToI64<u32>()); break;
        case GF_OP_I32_I64: convert_piece<i32, i64>(src, out, count, IntToI64<i32>()); break;
        default: break;
    }
}

// Pieces (and their sources) a thread block reads into shared memory at once: one per thread.
#define GF_GATHER_PREFETCH 256u

extern "C" __global__ void __launch_bounds__(256)
gf_gather_convert(const GatherPiece* __restrict__ pieces, u32 piece_count, GatherSources sources,
                  const GatherRegion* __restrict__ regions, u32 region_count,
                  u8* __restrict__ dst, u64 dst_capacity, GatherOutcome* __restrict__ outcome) {
    // The piece and region tables may live in pinned host memory read over PCIe: a block takes its
    // pieces (blockIdx.x, blockIdx.x + gridDim.x, ...) up to GF_GATHER_PREFETCH at a time, each
    // thread loading one piece and its source, so that the block waits for one round trip per
    // table per chunk instead of two per piece.
    __shared__ GatherPiece chunk_pieces[GF_GATHER_PREFETCH];
    __shared__ u64 chunk_ptr[GF_GATHER_PREFETCH];
    __shared__ u64 chunk_bytes[GF_GATHER_PREFETCH];
    const u32 mine = blockIdx.x < piece_count ? (piece_count - blockIdx.x - 1u) / gridDim.x + 1u : 0u;
    for (u32 first = 0; first < mine; first += GF_GATHER_PREFETCH) {
        const u32 chunk = mine - first < GF_GATHER_PREFETCH ? mine - first : (u32)GF_GATHER_PREFETCH;
        __syncthreads();  // the previous chunk is done with the shared tables
        for (u32 k = threadIdx.x; k < chunk; k += blockDim.x) {
            const GatherPiece piece = pieces[blockIdx.x + (first + k) * gridDim.x];
            // Select the source with constant indices: a run-time index into a by-value parameter
            // would copy the whole table to local memory.
            u64 source_ptr = 0, source_bytes = 0;
#pragma unroll
            for (u32 s = 0; s < GF_GATHER_SOURCES_MAX; ++s) {
                if (s == (u32)piece.source && s < sources.count) {
                    source_ptr = sources.ptr[s];
                    source_bytes = sources.bytes[s];
                }
            }
            if ((u32)piece.source >= GF_GATHER_SOURCES_MAX) {
                const u32 r = (u32)piece.source - GF_GATHER_SOURCES_MAX;
                if (r < region_count) {
                    const GatherRegion region = regions[r];
                    source_ptr = region.ptr;
                    source_bytes = region.bytes;
                }
            }
            chunk_pieces[k] = piece;
            chunk_ptr[k] = source_ptr;
            chunk_bytes[k] = source_bytes;
        }
        __syncthreads();
        for (u32 k = 0; k < chunk; ++k) {
            const u32 p = blockIdx.x + (first + k) * gridDim.x;
            const GatherPiece piece = chunk_pieces[k];
            u32 in_bytes, out_bytes;
            op_sizes(piece.op, &in_bytes, &out_bytes);
            const u64 n = piece.elements;
            const u64 source_ptr = chunk_ptr[k];
            const u64 source_bytes = chunk_bytes[k];
            const bool fits = in_bytes != 0u && source_ptr != 0u &&
                              extent_fits(piece.src_offset, n * in_bytes, source_bytes) &&
                              extent_fits(piece.dst_offset, n * out_bytes, dst_capacity);
            if (!fits) {
                if (threadIdx.x == 0) {
                    atomicAdd(&outcome->faulted_pieces, 1u);
                    atomicMax(&outcome->last_faulted_plus_1, p + 1u);
                }
                continue;
            }
            convert_op(piece.op, reinterpret_cast<const u8*>(source_ptr) + piece.src_offset,
                       dst + piece.dst_offset, piece.elements, piece.scale);
        }
    }
}

// Pieces one launch of gf_gather_convert_inline_N passes by value, in its parameters: kernel parameters
// of up to 32 764 bytes need CUDA 12.1 and a Volta or later device. The host resolves every piece's
// source to a device address (src_offset is that address) and has checked that it lies inside its
// source; the kernel checks the destination. With the table in the launch's parameters the kernel
// reads nothing over PCIe before its first row: the front end fetches parameters with the launch,
// ahead of time, while a table in pinned memory costs each block round trips over a link that shard
// copies may keep busy.
template <u32 N>
struct GatherInlinePieces {
    u32 count;
    u32 first;  // index of pieces[0] in the round's table, for the outcome's fault index
    GatherPiece pieces[N];
};

template <u32 N>
__device__ __forceinline__ void gather_inline(const GatherInlinePieces<N>& table, u8* __restrict__ dst,
                                              u64 dst_capacity, GatherOutcome* __restrict__ outcome) {
    const u32 count = table.count < N ? table.count : N;
    for (u32 p = blockIdx.x; p < count; p += gridDim.x) {
        const GatherPiece piece = table.pieces[p];
        u32 in_bytes, out_bytes;
        op_sizes(piece.op, &in_bytes, &out_bytes);
        const u64 n = piece.elements;
        const bool fits = in_bytes != 0u && piece.src_offset != 0u &&
                          extent_fits(piece.dst_offset, n * out_bytes, dst_capacity);
        if (!fits) {
            if (threadIdx.x == 0) {
                atomicAdd(&outcome->faulted_pieces, 1u);
                atomicMax(&outcome->last_faulted_plus_1, table.first + p + 1u);
            }
            continue;
        }
        convert_op(piece.op, reinterpret_cast<const u8*>(piece.src_offset), dst + piece.dst_offset,
                   piece.elements, piece.scale);
    }
}

// Three sizes, so that a launch carries (and the driver copies) no more parameter bytes than its
// table needs: 2 KiB, 8 KiB (a dataset-order round of 1024 rows of 4 KiB out) and 32 KiB.
#define GF_GATHER_INLINE_SMALL 64u
#define GF_GATHER_INLINE_MEDIUM 256u
#define GF_GATHER_INLINE_LARGE 1016u

extern "C" __global__ void __launch_bounds__(256)
gf_gather_convert_inline_small(const __grid_constant__ GatherInlinePieces<GF_GATHER_INLINE_SMALL> table,
                               u8* __restrict__ dst, u64 dst_capacity, GatherOutcome* __restrict__ outcome) {
    gather_inline(table, dst, dst_capacity, outcome);
}

extern "C" __global__ void __launch_bounds__(256)
gf_gather_convert_inline_medium(const __grid_constant__ GatherInlinePieces<GF_GATHER_INLINE_MEDIUM> table,
                                u8* __restrict__ dst, u64 dst_capacity, GatherOutcome* __restrict__ outcome) {
    gather_inline(table, dst, dst_capacity, outcome);
}

extern "C" __global__ void __launch_bounds__(256)
gf_gather_convert_inline_large(const __grid_constant__ GatherInlinePieces<GF_GATHER_INLINE_LARGE> table,
                               u8* __restrict__ dst, u64 dst_capacity, GatherOutcome* __restrict__ outcome) {
    gather_inline(table, dst, dst_capacity, outcome);
}

// ----- The ordered gather: rows in an epoch's order computed on the device -----
//
// Each row's sample is computed from its position in the epoch's order as `pipeline::order` defines
// it (dataset order, a keyed Feistel permutation of every sample, or windows of shards each with
// its own permutation), its shard by a binary search of the shards' first samples, and its offset
// in the shard as its field's base there plus the sample's index times the field's stored bytes
// (every field lies back to back in its shard); the offset is found in the stream's region table
// (the shard's windows, `window_bytes` each: registered page-cache windows read in place, or the
// device-memory tier), a row crossing a window's end read from both. The host passes a launch's
// first position, batches and rows; nothing per row is planned on the host.

struct OrderedField {
    u64 out_offset;        // the field's offset within a slot
    u64 out_sample_bytes;  // a sample's converted bytes
    u64 in_sample_bytes;   // a sample's stored bytes
    u32 op;
    u32 elements;          // elements per sample (bytes for GF_OP_COPY)
    float scale;
    u32 pad;
};

struct OrderedWindow {
    u64 start;
    u64 len;
    u64 keys[6];
    u32 half_bits;
    u32 member_first;
    u32 member_count;
    u32 pad;
};

struct OrderedMember {
    u64 first_sample;
    u64 count;
    u64 offset;
};

struct OrderedParams {
    u64 tables;        // device address of the stream's tables
    u64 regions;       // device address of the stream's region table (GatherRegion)
    u64 window_bytes;  // bytes of each shard's windows (the last may be shorter)
    u64 sample_count;
    u64 pos_base;      // the position of the launch's first batch's first row (before wrapping)
    u64 step_samples;  // positions from one batch of the launch to the next
    u64 slot_stride;   // bytes from one batch's slot to the next
    u64 keys[6];       // the full shuffle's permutation
    u32 half_bits;
    u32 mode;          // 0 dataset order, 1 full shuffle, 2 windows
    u32 batch_rows;
    u32 batches;
    u32 shard_count;
    u32 field_count;
    u32 window_count;
    u32 off_fields;    // byte offsets of the tables after the shards' first samples
    u32 off_bases;
    u32 off_windows;
    u32 off_members;
    u32 off_first_regions;  // per shard: its first window's index in the region table (u64)
    u32 region_count;
    u32 pad;
};

__device__ __forceinline__ u64 ordered_rotl64(u64 x, u32 r) { return (x << r) | (x >> (64u - r)); }

// xxh3-64 of the 8 little-endian bytes of `v` with `seed` (the 4-to-8-byte path, default secret).
__device__ __forceinline__ u64 ordered_xxh3_u64(u64 v, u64 seed) {
    seed ^= (u64)__byte_perm((u32)seed, 0u, 0x0123u) << 32;
    const u64 flip = (0x1cad21f72c81017cull ^ 0xdb979083e96dd4deull) - seed;
    u64 h = ((v >> 32) + ((v & 0xffffffffull) << 32)) ^ flip;
    h ^= ordered_rotl64(h, 49) ^ ordered_rotl64(h, 24);
    h *= 0x9FB21C651E98DF25ull;
    h ^= (h >> 35) + 8ull;
    h *= 0x9FB21C651E98DF25ull;
    h ^= h >> 28;
    return h;
}

// `Permutation::apply`: a 6-round Feistel network over the power-of-four domain, cycle-walked to 0..n.
__device__ u64 ordered_permute(u64 n, u32 half_bits, const u64* keys, u64 i) {
    if (n <= 1ull) return 0ull;
    const u64 mask = (1ull << half_bits) - 1ull;
    u64 value = i;
    for (;;) {
        u64 left = value >> half_bits, right = value & mask;
#pragma unroll
        for (int r = 0; r < 6; ++r) {
            const u64 mixed = ordered_xxh3_u64(right, keys[r]) & mask;
            const u64 next = left ^ mixed;
            left = right;
            right = next;
        }
        value = (left << half_bits) | right;
        if (value < n) return value;
    }
}

// `EpochOrder::sample_at`.
__device__ u64 ordered_sample(const OrderedParams& p, const OrderedWindow* __restrict__ windows,
                              const OrderedMember* __restrict__ members, u64 position) {
    if (p.mode == 1u) return ordered_permute(p.sample_count, p.half_bits, p.keys, position);
    if (p.mode != 2u) return position;
    u32 lo = 0u, hi = p.window_count;
    while (lo < hi) {
        const u32 mid = (lo + hi) / 2u;
        if (windows[mid].start + windows[mid].len <= position) lo = mid + 1u; else hi = mid;
    }
    const OrderedWindow& w = windows[lo];
    const u64 within = ordered_permute(w.len, w.half_bits, w.keys, position - w.start);
    u32 a = 0u, b = w.member_count;
    while (a < b) {
        const u32 mid = (a + b) / 2u;
        const OrderedMember& m = members[w.member_first + mid];
        if (m.offset + m.count <= within) a = mid + 1u; else b = mid;
    }
    const OrderedMember& m = members[w.member_first + a];
    return m.first_sample + (within - m.offset);
}

// Rows gathered at once by the ordered gather's fast path (1: one row at a time).
#ifndef GF_ORDERED_ROWS
#define GF_ORDERED_ROWS 4u
#endif

// Whether the ordered gather's fast path may take `field`: the stream's one field, a 2-byte float
// converted to fp32, its element count a multiple of 4.
__device__ __forceinline__ bool ordered_fast_field(const OrderedParams& p, const OrderedField& field) {
    return p.field_count == 1u && (field.op == GF_OP_F16_F32 || field.op == GF_OP_BF16_F32) &&
           field.elements % 4u == 0u && field.in_sample_bytes == (u64)field.elements * 2ull &&
           field.out_sample_bytes == (u64)field.elements * 4ull;
}

// The fast path's source address of a row (sample `local` of shard `shard`, row `i` of launch batch
// `batch`), with its offset in `dst` in `out`: 0 when the row does not qualify (it crosses a region's
// end, its source is not 8-byte or its destination not 16-byte aligned, or it does not fit: the
// general path then takes it and counts the fault). Computed once per row, by the thread that
// locates it, so that the threads moving the row do no 64-bit division.
__device__ __forceinline__ u64 ordered_fast_source(const OrderedParams& p, const OrderedField& field,
                                                   const u64* __restrict__ bases,
                                                   const u64* __restrict__ first_regions,
                                                   const GatherRegion* __restrict__ regions, u32 shard,
                                                   u64 local, u64 batch, u64 i, const u8* dst,
                                                   u64 dst_capacity, u64* out) {
    if (shard >= p.shard_count) return 0ull;
    const u64 at = bases[(u64)shard] + local * field.in_sample_bytes;
    const u64 o = batch * p.slot_stride + field.out_offset + i * field.out_sample_bytes;
    const u64 region = first_regions[shard] + at / p.window_bytes;
    const u64 within = at % p.window_bytes;
    if (region >= p.region_count || !extent_fits(o, field.out_sample_bytes, dst_capacity)) return 0ull;
    const GatherRegion g = regions[region];
    if (within >= g.bytes || within + field.in_sample_bytes > g.bytes) return 0ull;
    const u64 s = g.ptr + within;
    if ((s & 7ull) != 0ull || (((u64)(dst + o)) & 15ull) != 0ull) return 0ull;
    *out = o;
    return s;
}

// The ordered gather's fast path: rows k.. of the block's chunk (at most GF_ORDERED_ROWS, up to the
// chunk's end or the first row that does not qualify, see ordered_fast_source) moved at once: each
// thread loads its 4 elements of every row, then converts and stores them. Returns the rows done
// (0 when row k does not qualify).
__device__ __forceinline__ u32 ordered_rows_fast(const OrderedField& field, const u64* row_src,
                                                 const u64* row_out, u32 k, u32 chunk, u8* dst) {
    const u8* src[GF_ORDERED_ROWS];
    float4* out[GF_ORDERED_ROWS];
    u32 rows = 0u;
    for (; rows < GF_ORDERED_ROWS && k + rows < chunk && row_src[k + rows] != 0ull; ++rows) {
        src[rows] = reinterpret_cast<const u8*>(row_src[k + rows]);
        out[rows] = reinterpret_cast<float4*>(dst + row_out[k + rows]);
    }
    if (rows == 0u) return 0u;
    const u32 groups = field.elements / 4u;
    const bool bf16 = field.op == GF_OP_BF16_F32;
    for (u32 g = threadIdx.x; g < groups; g += blockDim.x) {
        uint2 a[GF_ORDERED_ROWS];
#pragma unroll
        for (u32 u = 0; u < GF_ORDERED_ROWS; ++u)
            if (u < rows) a[u] = __ldg(reinterpret_cast<const uint2*>(src[u]) + g);
#pragma unroll
        for (u32 u = 0; u < GF_ORDERED_ROWS; ++u) {
            if (u >= rows) continue;
            const u16 h0 = (u16)(a[u].x & 0xffffu), h1 = (u16)(a[u].x >> 16);
            const u16 h2 = (u16)(a[u].y & 0xffffu), h3 = (u16)(a[u].y >> 16);
            float4 v;
            if (bf16) {
                v = make_float4(bf16_to_f32(h0), bf16_to_f32(h1), bf16_to_f32(h2), bf16_to_f32(h3));
            } else {
                v = make_float4(f16_to_f32(h0), f16_to_f32(h1), f16_to_f32(h2), f16_to_f32(h3));
            }
            out[u][g] = v;
        }
    }
    return rows;
}

extern "C" __global__ void __launch_bounds__(256, 4)
gf_gather_ordered(const __grid_constant__ OrderedParams p, u8* __restrict__ dst, u64 dst_capacity,
                  GatherOutcome* __restrict__ outcome) {
    __shared__ u32 row_shard[GF_GATHER_PREFETCH];
    __shared__ u64 row_local[GF_GATHER_PREFETCH];
    // The fast path's rows: source address (0: the row takes the general path) and offset in dst.
    __shared__ u64 row_src[GF_GATHER_PREFETCH];
    __shared__ u64 row_out[GF_GATHER_PREFETCH];
    const u8* tables = reinterpret_cast<const u8*>(p.tables);
    const u64* __restrict__ shard_first = reinterpret_cast<const u64*>(tables);
    const OrderedField* __restrict__ fields = reinterpret_cast<const OrderedField*>(tables + p.off_fields);
    const u64* __restrict__ bases = reinterpret_cast<const u64*>(tables + p.off_bases);
    const OrderedWindow* __restrict__ windows = reinterpret_cast<const OrderedWindow*>(tables + p.off_windows);
    const OrderedMember* __restrict__ members = reinterpret_cast<const OrderedMember*>(tables + p.off_members);
    const u64* __restrict__ first_regions = reinterpret_cast<const u64*>(tables + p.off_first_regions);
    const GatherRegion* __restrict__ regions = reinterpret_cast<const GatherRegion*>(p.regions);
    const bool fast = GF_ORDERED_ROWS > 1u && ordered_fast_field(p, fields[0]);
    const u64 total = (u64)p.batch_rows * (u64)p.batches;
    const u64 mine = blockIdx.x < total ? (total - blockIdx.x - 1ull) / gridDim.x + 1ull : 0ull;
    for (u64 first = 0; first < mine; first += GF_GATHER_PREFETCH) {
        const u32 chunk = mine - first < GF_GATHER_PREFETCH ? (u32)(mine - first) : GF_GATHER_PREFETCH;
        __syncthreads();  // the previous chunk is done with the shared rows
        for (u32 k = threadIdx.x; k < chunk; k += blockDim.x) {
            const u64 r = blockIdx.x + (first + k) * gridDim.x;
            const u64 batch = r / p.batch_rows, i = r % p.batch_rows;
            const u64 position = (p.pos_base + batch * p.step_samples + i) % p.sample_count;
            const u64 sample = ordered_sample(p, windows, members, position);
            u32 lo = 0u, hi = p.shard_count + 1u;
            while (lo < hi) {
                const u32 mid = (lo + hi) / 2u;
                if (shard_first[mid] <= sample) lo = mid + 1u; else hi = mid;
            }
            const u32 shard = lo - 1u;
            const u64 local = sample - shard_first[shard];
            row_shard[k] = shard;
            row_local[k] = local;
            u64 out = 0ull;
            row_src[k] = fast ? ordered_fast_source(p, fields[0], bases, first_regions, regions, shard, local,
                                                    batch, i, dst, dst_capacity, &out)
                              : 0ull;
            row_out[k] = out;
        }
        __syncthreads();
        for (u32 k = 0; k < chunk; ++k) {
            // Up to GF_ORDERED_ROWS rows of a 2-byte float field at once, every load before any
            // store: a block holds only a few rows of a batch, and one row's load at a time per
            // thread left the device's memory mostly idle.
            if (fast) {
                const u32 rows = ordered_rows_fast(fields[0], row_src, row_out, k, chunk, dst);
                if (rows > 0u) {
                    k += rows - 1u;
                    continue;
                }
            }
            const u64 r = blockIdx.x + (first + k) * gridDim.x;
            const u64 batch = r / p.batch_rows, i = r % p.batch_rows;
            const u32 shard = row_shard[k];
            const u64 local = row_local[k];
            for (u32 f = 0; f < p.field_count; ++f) {
                const OrderedField field = fields[f];
                u64 in_bytes, out_bytes_per_in;
                {
                    u32 a, b;
                    op_sizes(field.op, &a, &b);
                    in_bytes = a;
                    out_bytes_per_in = b;
                }
                const u64 at = bases[(u64)shard * p.field_count + f] + local * field.in_sample_bytes;
                const u64 out = batch * p.slot_stride + field.out_offset + i * field.out_sample_bytes;
                const u64 region = shard < p.shard_count ? first_regions[shard] + at / p.window_bytes : ~0ull;
                const u64 within = at % p.window_bytes;
                // Elements read from this window, and from the next when the row crosses its end
                // (window sizes are multiples of every element size).
                u64 head = field.in_sample_bytes;
                bool fits = in_bytes != 0u && region < p.region_count &&
                            extent_fits(out, field.out_sample_bytes, dst_capacity);
                GatherRegion first_region_of_row = {0ull, 0ull}, next_region = {0ull, 0ull};
                if (fits) {
                    first_region_of_row = regions[region];
                    fits = within < first_region_of_row.bytes;
                    if (fits && within + head > first_region_of_row.bytes) {
                        head = first_region_of_row.bytes - within;
                        fits = region + 1u < p.region_count && head % in_bytes == 0u;
                        if (fits) {
                            next_region = regions[region + 1u];
                            fits = field.in_sample_bytes - head <= next_region.bytes;
                        }
                    }
                }
                if (!fits) {
                    if (threadIdx.x == 0) {
                        atomicAdd(&outcome->faulted_pieces, 1u);
                        atomicMax(&outcome->last_faulted_plus_1, (u32)r + 1u);
                    }
                    continue;
                }
                const u32 head_elements = (u32)(head / in_bytes);
                convert_op(field.op, reinterpret_cast<const u8*>(first_region_of_row.ptr + within), dst + out,
                           head_elements, field.scale);
                if (head_elements < field.elements) {
                    convert_op(field.op, reinterpret_cast<const u8*>(next_region.ptr),
                               dst + out + (u64)head_elements * out_bytes_per_in,
                               field.elements - head_elements, field.scale);
                }
            }
        }
    }
}
