// LZ4 block decompression, one warp per block, many blocks per launch.
//
// Compiled at run time by NVRTC (see src/device/module.rs); it includes no CUDA header, so it uses plain
// integer types and the compiler's built-in intrinsics only. docs/KERNELS.md describes the design; the
// CPU reference is lz4_flex::block::decompress_into followed by crate::decode::unshuffle.
//
// Rules every line below keeps:
// - every byte read from the input lies in [src + src_offset, src + src_offset + src_bytes);
// - every byte written lies in the job's output extent (and, for a filtered block, its scratch extent);
// - a job whose extents do not fit the buffers is refused before anything is read or written;
// - all 32 lanes of a warp hold the same parse state (the token stream is decoded redundantly), so every
//   branch on that state is warp-uniform and the warp-collective steps (window refill, __syncwarp) are
//   reached by all lanes together.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#ifndef GF_LZ4_WARPS
#define GF_LZ4_WARPS 4
#endif

// 1: try the fast sequence path (below) before the general one; 0: general path only.
#ifndef GF_LZ4_FAST
#define GF_LZ4_FAST 1
#endif

// Thread blocks per multiprocessor to ask the compiler to fit (capping registers); 0: no cap.
#ifndef GF_LZ4_MIN_BLOCKS
#define GF_LZ4_MIN_BLOCKS 0
#endif
#if GF_LZ4_MIN_BLOCKS > 0
#define GF_LZ4_BOUNDS __launch_bounds__(GF_LZ4_WARPS * 32, GF_LZ4_MIN_BLOCKS)
#else
#define GF_LZ4_BOUNDS __launch_bounds__(GF_LZ4_WARPS * 32)
#endif

// Bytes of input staged in shared memory per warp; each refill is one 16-byte load per lane and chunk.
#define GF_WINDOW_BYTES 1024
#define GF_WINDOW_CHUNKS (GF_WINDOW_BYTES / 16 / 32)
// The window is refilled before a sequence whose first bytes it no longer covers this far ahead.
#define GF_WINDOW_LOOKAHEAD 64
// Widest element the byte-shuffle filter may use.
#define GF_SHUFFLE_BYTES_MAX 16

// Status codes, mirrored by kernels::Lz4Status.
#define GF_LZ4_OK 0u
#define GF_LZ4_INPUT_OVERRUN 1u
#define GF_LZ4_OUTPUT_OVERRUN 2u
#define GF_LZ4_BAD_OFFSET 3u
#define GF_LZ4_SIZE_MISMATCH 4u
#define GF_LZ4_BAD_JOB 5u

// One block to decode. Layout mirrored by kernels::Lz4Job (#[repr(C)], 40 bytes).
struct Lz4Job {
    u64 src_offset;      // first stored byte, in the source buffer
    u64 dst_offset;      // first output byte, in the destination buffer
    u64 scratch_offset;  // shuffled-order output of a filtered block, in the destination buffer
    u32 src_bytes;       // stored length
    u32 raw_bytes;       // length the block must decode to
    u32 shuffle_bytes;   // element width of the byte-shuffle filter; 0 or 1: no filter
    u32 reserved;
};

// What became of one block. Layout mirrored by kernels::Lz4Outcome.
struct Lz4Outcome {
    u32 status;
    u32 produced;  // bytes decoded before the end or the fault
};

// True when [offset, offset + bytes) lies inside a buffer of `capacity` bytes, without overflow.
__device__ __forceinline__ bool extent_fits(u64 offset, u64 bytes, u64 capacity) {
    return offset <= capacity && bytes <= capacity - offset;
}

// The warp's shared-memory copy of input bytes [base, base + GF_WINDOW_BYTES). `base` may be negative
// (the window starts on a 16-byte boundary of the address space); bytes outside the block read as zero
// and are never consumed, because the parser checks every position against the input length first.
struct Window {
    u8* bytes;
    i64 base;
};

__device__ __forceinline__ void window_fill(Window& w, const u8* __restrict__ in, u32 len, i64 pos,
                                            u32 lane) {
    __syncwarp();  // every lane is done reading the old contents
    const i64 misalign = (i64)((u64)in & 15u);
    w.base = ((pos + misalign) & ~(i64)15) - misalign;
#pragma unroll
    for (int c = 0; c < GF_WINDOW_CHUNKS; ++c) {
        const u32 chunk = lane + 32u * (u32)c;
        const i64 q = w.base + 16 * (i64)chunk;
        u32 v0, v1, v2, v3;
        if (q >= 0 && q + 16 <= (i64)len) {
            // Aligned: (in + q) is a multiple of 16 by the choice of base.
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(in + q));
            v0 = v.x;
            v1 = v.y;
            v2 = v.z;
            v3 = v.w;
        } else {
            u32 word[4] = {0u, 0u, 0u, 0u};
#pragma unroll
            for (int k = 0; k < 16; ++k) {
                const i64 p = q + k;
                if (p >= 0 && p < (i64)len) word[k >> 2] |= (u32)in[p] << (8 * (k & 3));
            }
            v0 = word[0];
            v1 = word[1];
            v2 = word[2];
            v3 = word[3];
        }
        *reinterpret_cast<uint4*>(w.bytes + 16 * chunk) = make_uint4(v0, v1, v2, v3);
    }
    __syncwarp();  // the new contents are visible to every lane
}

// Input byte at `pos` (< len, checked by the caller), refilling the window when it has moved past it.
__device__ __forceinline__ u32 window_byte(Window& w, const u8* __restrict__ in, u32 len, u32 pos,
                                           u32 lane) {
    if ((i64)pos >= w.base + GF_WINDOW_BYTES) window_fill(w, in, len, pos, lane);
    return w.bytes[(i64)pos - w.base];
}

// Reads an LZ4 length extension (bytes added while they are 255) starting at *ip, adding to *value.
// Fails with INPUT_OVERRUN when the input ends first, or with `too_long_status` as soon as the value
// exceeds `limit` (it only grows, so the block is bad whatever follows; this also keeps it in 32 bits).
__device__ __forceinline__ u32 read_length(Window& w, const u8* __restrict__ in, u32 len, u32* ip,
                                           u32* value, u32 limit, u32 too_long_status, u32 lane) {
    for (;;) {
        if (*ip >= len) return GF_LZ4_INPUT_OVERRUN;
        const u32 b = window_byte(w, in, len, *ip, lane);
        *ip += 1;
        *value += b;
        if (*value > limit) return too_long_status;
        if (b != 255u) return GF_LZ4_OK;
    }
}

// lane % offset for offsets 1..31, one row per offset: a shared-memory lookup instead of a division.
typedef u8 ModTable[32][32];

// Copies a match of `mlen` bytes from `offset` bytes back to out[op..]. Every byte read lies below op
// (already written and made visible by the caller's __syncwarp), so no lane waits for another's write.
__device__ __forceinline__ void copy_match(u8* __restrict__ out, u32 op, u32 offset, u32 mlen,
                                           const ModTable& mod, u32 lane) {
    const u32 from = op - offset;
    if (offset >= mlen) {
        for (u32 i = lane; i < mlen; i += 32u) out[op + i] = out[from + i];
    } else if (offset >= 32u) {
        // Overlapping, long period: out[op + i] = out[from + (i mod offset)]; the remainder advances by
        // 32 per step and wraps at most once.
        u32 r = lane;
        for (u32 i = lane; i < mlen; i += 32u) {
            out[op + i] = out[from + r];
            r += 32u;
            if (r >= offset) r -= offset;
        }
    } else {
        // Short repeating pattern: lanes stride by the largest multiple of the offset that fits in a
        // warp, so each lane's byte is the same on every step and is read once.
        u32 rem = (u32)mod[offset][31] + 1u;  // 32 mod offset
        if (rem == offset) rem = 0u;
        const u32 stride = 32u - rem;
        if (lane < stride) {
            const u8 v = out[from + mod[offset][lane]];
            for (u32 i = lane; i < mlen; i += stride) out[op + i] = v;
        }
    }
}

// The fast path: one sequence whose token, literals, offset and length bytes (at most one extension
// byte each) all lie in the staged window and whose output fits, decoded without per-byte checks.
// Returns false, having changed nothing, when the sequence is not such a one; the general path then
// decodes it with every check (and reports whatever is wrong with it). Within these limits the only
// fault left is a bad offset, found after the literals exactly as the general path finds it.
__device__ __forceinline__ bool fast_sequence(const Window& w, u32 len, u8* __restrict__ out, u32 cap,
                                              u32* ip_io, u32* op_io, u32* status, const ModTable& mod,
                                              u32 lane) {
    const u32 ip = *ip_io;
    const u32 op = *op_io;
    const i64 wend = w.base + GF_WINDOW_BYTES;
    const u32 lim = (u32)(wend < (i64)len ? wend : (i64)len);
    if (ip + 20u > lim || (i64)ip < w.base) return false;
    const u8* p = w.bytes + ((i64)ip - w.base);
    const u32 token = p[0];
    u32 lit = token >> 4;
    u32 k = 1u;
    if (lit == 15u) {
        const u32 b = p[1];
        if (b == 255u) return false;
        lit += b;
        k = 2u;
    }
    // Literals at p[k, k + lit), the offset after them, then possibly one length byte.
    if (ip + k + lit + 3u > lim) return false;
    const u32 offset = (u32)p[k + lit] | ((u32)p[k + lit + 1u] << 8);
    u32 used = k + lit + 2u;
    u32 mlen = token & 15u;
    if (mlen == 15u) {
        const u32 b = p[used];
        if (b == 255u) return false;
        mlen += b;
        used += 1u;
    }
    mlen += 4u;
    if (lit + mlen > cap - op) return false;

    for (u32 i = lane; i < lit; i += 32u) out[op + i] = p[k + i];
    *ip_io = ip + used;
    const u32 at = op + lit;
    if (offset == 0u || offset > at) {
        *op_io = at;
        *status = GF_LZ4_BAD_OFFSET;
        return true;
    }
    __syncwarp();  // the literals and earlier bytes written by other lanes are visible
    copy_match(out, at, offset, mlen, mod, lane);
    *op_io = at + mlen;
    return true;
}

// Decodes one LZ4 block of `len` input bytes into exactly `cap` output bytes. Returns the status and
// sets *produced. Reads only in[0, len), writes only out[0, cap).
__device__ u32 lz4_decode_block(Window& w, const u8* __restrict__ in, u32 len, u8* __restrict__ out,
                                u32 cap, u32* produced, const ModTable& mod, u32 lane) {
    u32 ip = 0;
    u32 op = 0;
    u32 status = GF_LZ4_OK;
    w.base = -(i64)(2 * GF_WINDOW_BYTES);  // empty: the first read fills it
    for (;;) {
        if (ip >= len) {
            status = GF_LZ4_INPUT_OVERRUN;  // a block must end after a sequence's literals
            break;
        }
        if ((i64)ip + GF_WINDOW_LOOKAHEAD > w.base + GF_WINDOW_BYTES &&
            w.base + GF_WINDOW_BYTES < (i64)len) {
            window_fill(w, in, len, ip, lane);
        }
#if GF_LZ4_FAST
        {
            bool progressed = false;
            while (status == GF_LZ4_OK && fast_sequence(w, len, out, cap, &ip, &op, &status, mod, lane)) {
                progressed = true;
            }
            if (status != GF_LZ4_OK) break;
            if (progressed) continue;  // back to the top: end of input, window refill
        }
#endif
        const u32 token = window_byte(w, in, len, ip, lane);
        ip += 1;

        // Literals.
        u32 lit = token >> 4;
        if (lit == 15u) {
            status = read_length(w, in, len, &ip, &lit, len, GF_LZ4_INPUT_OVERRUN, lane);
            if (status != GF_LZ4_OK) break;
        }
        if (lit > len - ip) {
            status = GF_LZ4_INPUT_OVERRUN;
            break;
        }
        if (lit > cap - op) {
            status = GF_LZ4_OUTPUT_OVERRUN;
            break;
        }
        if (lit != 0u) {
            if ((i64)(ip + lit) <= w.base + GF_WINDOW_BYTES && (i64)ip >= w.base) {
                // Inside the staged window: shared-memory reads, coalesced byte stores.
                for (u32 i = lane; i < lit; i += 32u) out[op + i] = w.bytes[(i64)(ip + i) - w.base];
            } else {
                // A long literal run: straight from global memory, several loads in flight per lane.
#pragma unroll 4
                for (u32 i = lane; i < lit; i += 32u) out[op + i] = __ldg(in + ip + i);
            }
            ip += lit;
            op += lit;
        }
        if (ip == len) break;  // the last sequence has no match

        // Match.
        if (len - ip < 2u) {
            status = GF_LZ4_INPUT_OVERRUN;
            break;
        }
        // Two statements: the low byte must be read first, since reading the high byte may move the
        // window past it (operands of | are evaluated in no set order).
        const u32 offset_low = window_byte(w, in, len, ip, lane);
        const u32 offset = offset_low | (window_byte(w, in, len, ip + 1, lane) << 8);
        ip += 2;
        if (offset == 0u) {
            status = GF_LZ4_BAD_OFFSET;
            break;
        }
        u32 mlen = token & 15u;
        if (mlen == 15u) {
            status = read_length(w, in, len, &ip, &mlen, cap, GF_LZ4_OUTPUT_OVERRUN, lane);
            if (status != GF_LZ4_OK) break;
        }
        mlen += 4u;
        if (mlen > cap - op) {
            status = GF_LZ4_OUTPUT_OVERRUN;
            break;
        }
        if (offset > op) {
            status = GF_LZ4_BAD_OFFSET;
            break;
        }
        __syncwarp();  // earlier literal and match bytes written by other lanes are visible
#if GF_LZ4_FAST
        copy_match(out, op, offset, mlen, mod, lane);
#else
        const u32 from = op - offset;
        if (offset >= 32u || offset >= mlen) {
            // Each lane reads out[from + (i mod offset)], always below op: already written, so the
            // reads never depend on this match's own writes, overlapping or not. With offset >= 32 the
            // remainder advances by 32 per step and wraps at most once; with offset >= mlen it never wraps.
            u32 r = lane;
            for (u32 i = lane; i < mlen; i += 32u) {
                out[op + i] = out[from + r];
                r += 32u;
                if (r >= offset) r -= offset;
            }
        } else {
            // A short repeating pattern: lanes stride by the largest multiple of the offset that fits in
            // a warp, so each lane's byte is the same on every step and is read once.
            const u32 stride = (32u / offset) * offset;
            if (lane < stride) {
                const u8 v = out[from + lane % offset];
                for (u32 i = lane; i < mlen; i += stride) out[op + i] = v;
            }
        }
#endif
        op += mlen;
    }
    *produced = op;
    if (status == GF_LZ4_OK && op != cap) status = GF_LZ4_SIZE_MISMATCH;
    return status;
}

// Undoes the byte shuffle: out[e * width + b] = shuffled[b * n + e] for n = bytes / width elements.
// Reads only shuffled[0, bytes), writes only out[0, bytes).
__device__ void unshuffle_block(const u8* __restrict__ shuffled, u8* __restrict__ out, u32 bytes,
                                u32 width, u32 lane) {
    const u32 n = bytes / width;
    const bool aligned = ((u64)out % width) == 0;
    if (width == 2u && aligned) {
        for (u32 e = lane; e < n; e += 32u) {
            const u32 v = (u32)shuffled[e] | ((u32)shuffled[n + e] << 8);
            reinterpret_cast<u16*>(out)[e] = (u16)v;
        }
    } else if (width == 4u && aligned) {
        for (u32 e = lane; e < n; e += 32u) {
            const u32 v = (u32)shuffled[e] | ((u32)shuffled[n + e] << 8) | ((u32)shuffled[2 * n + e] << 16) |
                          ((u32)shuffled[3 * n + e] << 24);
            reinterpret_cast<u32*>(out)[e] = v;
        }
    } else if (width == 8u && aligned) {
        for (u32 e = lane; e < n; e += 32u) {
            u64 v = 0;
#pragma unroll
            for (u32 b = 0; b < 8u; ++b) v |= (u64)shuffled[b * n + e] << (8 * b);
            reinterpret_cast<u64*>(out)[e] = v;
        }
    } else {
        for (u32 e = lane; e < n; e += 32u) {
            for (u32 b = 0; b < width; ++b) out[e * width + b] = shuffled[b * n + e];
        }
    }
}

// Decodes jobs[0, job_count): warp w of the grid takes jobs w, w + total_warps, ...
// `src` holds `src_capacity` bytes of stored payloads, `dst` `dst_capacity` bytes of output space.
extern "C" __global__ void GF_LZ4_BOUNDS
gf_lz4_decode(const Lz4Job* __restrict__ jobs, u32 job_count, const u8* __restrict__ src, u64 src_capacity,
              u8* __restrict__ dst, u64 dst_capacity, Lz4Outcome* __restrict__ outcomes) {
    __shared__ __align__(16) u8 windows[GF_LZ4_WARPS][GF_WINDOW_BYTES];
    __shared__ ModTable mod;
    for (u32 k = threadIdx.x; k < 32u * 32u; k += blockDim.x) {
        const u32 offset = k >> 5, lane = k & 31u;
        mod[offset][lane] = (u8)(offset == 0u ? 0u : lane % offset);
    }
    __syncthreads();
    const u32 lane = threadIdx.x & 31u;
    const u32 warp = threadIdx.x >> 5;
    Window w;
    w.bytes = windows[warp];
    const u32 total_warps = gridDim.x * GF_LZ4_WARPS;
    for (u32 j = blockIdx.x * GF_LZ4_WARPS + warp; j < job_count; j += total_warps) {
        const Lz4Job job = jobs[j];
        const bool filtered = job.shuffle_bytes > 1u;
        bool ok = extent_fits(job.src_offset, job.src_bytes, src_capacity) &&
                  extent_fits(job.dst_offset, job.raw_bytes, dst_capacity);
        if (filtered) {
            ok = ok && job.shuffle_bytes <= GF_SHUFFLE_BYTES_MAX && job.raw_bytes % job.shuffle_bytes == 0u &&
                 extent_fits(job.scratch_offset, job.raw_bytes, dst_capacity) &&
                 (job.scratch_offset + job.raw_bytes <= job.dst_offset ||
                  job.dst_offset + job.raw_bytes <= job.scratch_offset);
        }
        u32 status = GF_LZ4_BAD_JOB;
        u32 produced = 0;
        if (ok) {
            u8* target = dst + (filtered ? job.scratch_offset : job.dst_offset);
            status = lz4_decode_block(w, src + job.src_offset, job.src_bytes, target, job.raw_bytes, &produced,
                                      mod, lane);
            if (status == GF_LZ4_OK && filtered) {
                __syncwarp();  // the shuffled bytes written by every lane are visible
                unshuffle_block(target, dst + job.dst_offset, job.raw_bytes, job.shuffle_bytes, lane);
            }
        }
        if (lane == 0) {
            outcomes[j].status = status;
            outcomes[j].produced = produced;
        }
        __syncwarp();  // the window is reused by the next job
    }
}
