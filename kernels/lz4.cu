// LZ4 block decompression, one warp per block, many blocks per launch.
//
// Compiled at run time by NVRTC (see src/device/module.rs); it includes no CUDA header, so it uses plain
// integer types and the compiler's built-in intrinsics only. docs/KERNELS.md describes the design; the
// CPU reference is lz4_flex::block::decompress_into followed by crate::decode::unshuffle.
//
// Two decoders share the job table, the outcomes and the rules below: gf_lz4_decode decodes one sequence
// per warp step (the whole warp copies each sequence's literals, then its match);
// gf_lz4_decode_two_phase (compiled instead with GF_LZ4_TWO_PHASE=1, at the end of this file) parses up
// to 32 sequences into per-lane records first, then writes their output 32 bytes per warp step.
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

// 1: compile gf_lz4_decode_two_phase (the two-phase decoder at the end of this file) instead of
// gf_lz4_decode.
#ifndef GF_LZ4_TWO_PHASE
#define GF_LZ4_TWO_PHASE 0
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

// Whether a job's extents lie in their buffers, and a filtered job's scratch is valid and does not
// overlap its output: a job that fails is refused (GF_LZ4_BAD_JOB) before any access.
__device__ __forceinline__ bool lz4_job_fits(const Lz4Job& job, u64 src_capacity, u64 dst_capacity) {
    bool ok = extent_fits(job.src_offset, job.src_bytes, src_capacity) &&
              extent_fits(job.dst_offset, job.raw_bytes, dst_capacity);
    if (job.shuffle_bytes > 1u) {
        ok = ok && job.shuffle_bytes <= GF_SHUFFLE_BYTES_MAX && job.raw_bytes % job.shuffle_bytes == 0u &&
             extent_fits(job.scratch_offset, job.raw_bytes, dst_capacity) &&
             (job.scratch_offset + job.raw_bytes <= job.dst_offset ||
              job.dst_offset + job.raw_bytes <= job.scratch_offset);
    }
    return ok;
}

#if !GF_LZ4_TWO_PHASE
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
        const bool ok = lz4_job_fits(job, src_capacity, dst_capacity);
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
#endif  // !GF_LZ4_TWO_PHASE

#if GF_LZ4_TWO_PHASE
// ------------------------------------------------------------------------------------------------
// The two-phase decoder (SequencePath::TwoPhase).
//
// gf_lz4_decode spends a fixed ~100 warp instructions on every sequence, mostly on copying: a literal
// run and a match of a few bytes each occupy the whole warp for a loop, a __syncwarp and the copy's
// set-up. Here the block is decoded in chunks of up to 32 sequences, each in three steps:
//
// 1. Parse. All lanes walk the token stream together (warp-uniform state, as in gf_lz4_decode, so window
//    refills and branches need no vote) and lane k keeps the chunk's k-th sequence as a record in
//    registers: where its output starts, where its match starts (after the literals), where its
//    literals are in the input. The fast parse only finds the sequences (lengths, positions, the
//    window's bounds); nothing is copied or stored, and a record costs a compare and three selects.
//    Whatever it does not take (length bytes of 255, a header leaving the window, the end of the block)
//    goes through the checked parse, which applies every check of gf_lz4_decode in its order.
// 2. Validate, all records at once: each lane reads its match offset and checks it (1 <= offset <=
//    match start) and that its sequence ends within the output. At the first record that fails, the
//    chunk is cut and that sequence is parsed again by the checked parse, which reports the fault
//    exactly as gf_lz4_decode does (same status, same `produced`): what reaches the copy is valid.
// 3. Copy. The warp writes the chunk's output 32 consecutive bytes per step, lane l byte q0 + l. A lane
//    finds the record holding its byte from one bit mask per step (bit b: a record starts at q0 + b;
//    each record's lane sets its bit, the warp ORs them), a popcount below the lane and three shuffles
//    from that record's lane. Its byte's source is an input byte (a literal) or the output byte
//    `offset` back (a match). A match source inside the current step has not been written yet; the
//    lane then names the lane of that byte and takes its source with a shuffle, repeated until no lane
//    names another (pointer jumping; names only go to lower lanes). For offsets below 32 the source is
//    first moved back by whole periods to just below the step, or just below the match's start (a
//    multiply by the offset's inverse, prepared in step 2), so only a match that starts inside the step
//    names a lane, and only an earlier record's. Every source left is then an input byte or an output
//    byte written by an earlier step (visible after that step's __syncwarp): one load and one store
//    per lane finish the step.
//
// So a sequence costs its share of a short serial parse and of 32-byte copy steps whose cost does not
// depend on how the bytes divide into sequences.
//
// Bounds: a record reaches the copy only once gf_lz4_decode's checks have passed for it, so the copy
// reads only input bytes inside [0, len) (literal runs the parse checked), output bytes below the one it
// writes (offsets checked against the match start) and writes only below the chunk's checked end.
// Before validation, the parse reads the input only inside [0, len) (the window, or checked positions),
// and validation reads each record's offset bytes, which the parse found inside [0, len). Positions are
// 32-bit; comparisons are written so that they cannot wrap, and the fast parse (whose output end runs
// ahead of its checks, at most 32 * GF_TP_FAST_SEQUENCE_MAX bytes) is used only where that cannot wrap.

// A fast-parsed sequence's first GF_TP_FAST_HEADER bytes (token, a literal length byte, up to 14
// literals, the offset, a match length byte) must lie in the staged window; longer literal runs are
// checked against the window once their length is known.
#define GF_TP_FAST_HEADER 20u
// The window is moved to the cursor when the fast parse stops this close to its end: a fast sequence's
// header spans at most 274 bytes (token, one length byte, 269 literals, offset, one length byte).
#define GF_TP_REFILL_AHEAD 288
// Most output bytes of one fast-parsed sequence: 15 + 254 literals, 15 + 254 + 4 match bytes.
#define GF_TP_FAST_SEQUENCE_MAX 542u
// Parse result: the block ended after a sequence's literals (not a status the host sees).
#define GF_TP_PARSE_END 0xffu
// Copy phase source codes: 0..31 name the lane whose byte this byte equals; these two are resolved.
#define GF_TP_SRC_INPUT 32u
#define GF_TP_SRC_OUTPUT 33u

// One lane's record: the chunk's sequence number `lane`, if the chunk has that many.
struct Record {
    u32 start;        // output position of the sequence's first byte
    u32 match_start;  // start + literal length
    u32 literal_src;  // input position of the first literal
    u32 match;        // match offset | ceil(1024 / offset) << 16 (0 for offsets of 32 or more): step 2
};

// Makes the sequence the k-th of the chunk: lane k keeps it.
__device__ __forceinline__ void keep_record(Record& r, u32 k, u32 start, u32 match_start, u32 literal_src,
                                            u32 lane) {
    const bool mine = lane == k;
    r.start = mine ? start : r.start;
    r.match_start = mine ? match_start : r.match_start;
    r.literal_src = mine ? literal_src : r.literal_src;
}

// `v`, which the compiler may no longer recompute from its inputs. Without it, it rebuilds loop bounds
// and the window's address inside the fast parse loop at every sequence (64-bit window arithmetic, the
// shared window's generic address), some ten instructions, to save a register.
__device__ __forceinline__ u32 opaque(u32 v) {
    asm volatile("" : "+r"(v));
    return v;
}

// The shared-memory byte at `addr` (a shared-space address). Inline PTX, so that the window's address
// stays one register (see `opaque`); volatile with a memory clobber, so that it stays after the
// window's refill and its __syncwarp.
__device__ __forceinline__ u32 shared_byte(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

// The bitwise OR of `v` over the warp.
__device__ __forceinline__ u32 warp_or(u32 v) {
#if __CUDA_ARCH__ >= 800
    u32 r;
    asm volatile("redux.sync.or.b32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
#else
    for (u32 s = 16u; s != 0u; s >>= 1) v |= __shfl_xor_sync(0xffffffffu, v, s);
    return v;
#endif
}

// Parses the sequence at *ip_io with every check of lz4_decode_block's general path, in the same order,
// and keeps it as record *k_io if it produces bytes. Returns GF_LZ4_OK to go on, GF_TP_PARSE_END when
// the block ended after its literals, or the fault; *op_io then counts the literals that gf_lz4_decode
// would have copied before finding it.
__device__ __forceinline__ u32 parse_sequence_checked(Window& w, const u8* __restrict__ in, u32 len, u32 cap,
                                                      u32* ip_io, u32* op_io, Record& rec, u32* k_io,
                                                      u32 lane) {
    u32 ip = *ip_io;
    const u32 op = *op_io;
    if (ip >= len) return GF_LZ4_INPUT_OVERRUN;  // a block must end after a sequence's literals
    const u32 token = window_byte(w, in, len, ip, lane);
    ip += 1u;
    u32 lit = token >> 4;
    if (lit == 15u) {
        const u32 status = read_length(w, in, len, &ip, &lit, len, GF_LZ4_INPUT_OVERRUN, lane);
        if (status != GF_LZ4_OK) return status;
    }
    if (lit > len - ip) return GF_LZ4_INPUT_OVERRUN;
    if (lit > cap - op) return GF_LZ4_OUTPUT_OVERRUN;
    const u32 literal_src = ip;
    ip += lit;
    const u32 match_start = op + lit;
    u32 status = GF_LZ4_OK;
    u32 mlen = 0u;
    if (ip == len) {
        status = GF_TP_PARSE_END;  // the last sequence has no match
    } else if (len - ip < 2u) {
        status = GF_LZ4_INPUT_OVERRUN;
    } else {
        // Two statements: reading the high byte may move the window past the low one.
        const u32 offset_low = window_byte(w, in, len, ip, lane);
        const u32 offset = offset_low | (window_byte(w, in, len, ip + 1u, lane) << 8);
        ip += 2u;
        if (offset == 0u) {
            status = GF_LZ4_BAD_OFFSET;
        } else {
            u32 m = token & 15u;
            if (m == 15u) status = read_length(w, in, len, &ip, &m, cap, GF_LZ4_OUTPUT_OVERRUN, lane);
            if (status == GF_LZ4_OK) {
                // m + 4 > cap - match_start, written so that it cannot wrap.
                const u32 room = cap - match_start;
                if (room < 4u || m > room - 4u) {
                    status = GF_LZ4_OUTPUT_OVERRUN;
                } else if (offset > match_start) {
                    status = GF_LZ4_BAD_OFFSET;
                } else {
                    mlen = m + 4u;
                }
            }
        }
    }
    if (lit + mlen != 0u) {
        keep_record(rec, *k_io, op, match_start, literal_src, lane);
        *k_io += 1u;
    }
    *ip_io = ip;
    *op_io = match_start + mlen;
    return status;
}

// Step 2: reads each record's match offset into rec.match and returns the lanes whose record fails a
// check of gf_lz4_decode: a match offset of 0 or beyond the match start, or an end beyond `cap`.
// Records [0, count) cover output [.., end) in order; lanes from `count` on get a start that sets no
// bit in the copy's masks. Every lane takes part.
__device__ __forceinline__ u32 validate_records(Record& rec, u32 count, u32 first, u32 end, u32 cap,
                                                const u8* __restrict__ in, u32 lane) {
    const u32 next_start = __shfl_down_sync(0xffffffffu, rec.start, 1u);
    const bool held = lane < count;
    const u32 rec_end = lane + 1u < count ? next_start : end;
    // A record has a match unless it is the block's last sequence or was cut by a fault; its offset
    // then lies right after its literals, inside the input (the parse read or bounded it).
    const bool has_match = held && rec_end != rec.match_start;
    u32 offset = 0u;
    if (has_match) {
        const u32 at = rec.literal_src + (rec.match_start - rec.start);
        offset = (u32)__ldg(in + at) | ((u32)__ldg(in + at + 1u) << 8);
    }
    // floor(t / offset) = (t * ceil(1024 / offset)) >> 10 for every t < 32 and offset < 32 (checked for
    // all of them by the CPU model's tests).
    const u32 inverse = offset != 0u && offset < 32u ? (1023u + offset) / offset : 0u;
    rec.match = offset | (inverse << 16);
    if (!held) rec.start = first - 1u;  // below every step's start: rel wraps past 32
    const bool bad = held && (rec_end > cap || (has_match && offset - 1u >= rec.match_start));
    return __ballot_sync(0xffffffffu, bad);
}

// Bits 0..lane.
__device__ __forceinline__ u32 lanes_upto_self() {
    u32 m;
    asm("mov.u32 %0, %%lanemask_le;" : "=r"(m));
    return m;
}

// Step 3: writes out[first, end) from the chunk's `count` records, which cover it in order (each
// record's bytes run from its start to the next record's start, or to `end`). Every lane takes part.
__device__ __forceinline__ void copy_chunk(const Record& rec, u32 first, u32 end, const u8* __restrict__ in,
                                           u8* __restrict__ out, u32 lane) {
    // A literal's input position is its output position plus this (modulo 2^32).
    const u32 literal_delta = rec.literal_src - rec.start;
    u32 before = 0u;  // records that start before this step
    for (u32 q0 = first;; q0 += 32u) {
        // Bit b of `starts`: a record starts at q0 + b. Records are never empty and lie in order, so at
        // most 32 start in a step; records that started before (and lanes without one) have a start
        // below q0, which wraps `rel` past 32.
        const u32 rel = rec.start - q0;
        const u32 starts = warp_or(rel < 32u ? 1u << rel : 0u);
        const u32 mine = before + __popc(starts & lanes_upto_self()) - 1u;  // the record of q0 + lane
        before += __popc(starts);
        const u32 match_start = __shfl_sync(0xffffffffu, rec.match_start, mine);
        const u32 delta = __shfl_sync(0xffffffffu, literal_delta, mine);
        const u32 match = __shfl_sync(0xffffffffu, rec.match, mine);
        const bool active = lane < end - q0;
        const u32 q = q0 + lane;
        // A match byte: out[q] = out[q - j * offset] for every j that keeps it at or after match_start -
        // offset. Take the largest such j that lands below both the match start and this step:
        // j = floor((q - b) / offset) + 1, with q - b < 32 for offsets below 32; j = 1 for the others,
        // whose inverse is 0 (and q - offset < q0 then). Computed for every lane, without a branch.
        const u32 offset = match & 0xffffu;
        const u32 b = match_start > q0 ? match_start : q0;
        const u32 from = q - offset * ((((q - b) * (match >> 16)) >> 10) + 1u);
        u32 code = from >= q0 ? from - q0 : GF_TP_SRC_OUTPUT;  // a lane of this step, or written
        u32 pos = from;
        if (q < match_start) {
            code = GF_TP_SRC_INPUT;
            pos = q + delta;
        }
        if (!active) code = GF_TP_SRC_OUTPUT;  // resolved, and never named by another lane
        // Pointer jumping: a lane naming lane j takes j's source; names only go to lower lanes.
        while (__any_sync(0xffffffffu, code < 32u)) {
            const u32 from_lane = code < 32u ? code : lane;
            const u32 next_code = __shfl_sync(0xffffffffu, code, from_lane);
            pos = __shfl_sync(0xffffffffu, pos, from_lane);
            code = next_code;
        }
        if (active) {
            const u8* src = code == GF_TP_SRC_INPUT ? in : out;
            out[q] = src[pos];
        }
        __syncwarp();  // this step's bytes are visible to the next step's (and the next chunk's) loads
        if (end - q0 <= 32u) break;
    }
}

// Decodes one LZ4 block of `len` input bytes into exactly `cap` output bytes, chunk by chunk. Returns the
// status and sets *produced, both as lz4_decode_block would. Reads only in[0, len), writes only
// out[0, cap).
__device__ u32 lz4_decode_block_two_phase(Window& w, const u8* __restrict__ in, u32 len,
                                          u8* __restrict__ out, u32 cap, u32* produced, u32 lane) {
    u32 ip = 0u;
    u32 op = 0u;
    u32 status = GF_LZ4_OK;
    // The fast parse lets the output position run up to 32 sequences past `cap` before validation finds
    // the overrun: allowed where that cannot wrap (every real block).
    const bool fast_allowed = cap <= 0xffffffffu - 32u * GF_TP_FAST_SEQUENCE_MAX;
    bool recheck = false;  // validation cut the chunk: the sequence at ip goes through the checked parse
    Record rec = {0u, 0u, 0u, 0u};
    window_fill(w, in, len, 0, lane);
    while (status == GF_LZ4_OK) {
        const u32 first = op;
        u32 k = 0u;
        // Step 1: parse up to 32 sequences.
        while (k < 32u) {
            // Window-relative positions (all below 2 * GF_WINDOW_BYTES): no check below can wrap.
            const i64 wend = w.base + GF_WINDOW_BYTES;
            const u32 wlim = (u32)((wend < (i64)len ? wend : (i64)len) - w.base);
            const i64 rel = (i64)ip - w.base;
            if (!recheck && fast_allowed && wlim >= GF_TP_FAST_HEADER && rel >= 0 &&
                rel <= (i64)(wlim - GF_TP_FAST_HEADER)) {
                // The fast parse: sequences whose header lies in the window and whose length bytes are
                // not 255. Branch-free but for the one exit: every byte it may need is loaded (inside
                // the window) and the conditions are combined.
                const u32 wbase = (u32)w.base;  // positions are wbase + p, modulo 2^32
                const u32 last = opaque(wlim - GF_TP_FAST_HEADER);  // the last p a sequence may start at
                const u32 window = opaque((u32)__cvta_generic_to_shared(w.bytes));
                u32 p = (u32)rel;
                while (k < 32u && p <= last) {
                    const u32 token = shared_byte(window + p);
                    const u32 b1 = shared_byte(window + p + 1u);
                    const bool lit_ext = token >= 0xf0u;
                    const u32 lit = (token >> 4) + (lit_ext ? b1 : 0u);
                    const u32 h = p + (lit_ext ? 2u : 1u);  // the first literal
                    const u32 at = h + lit;                 // the offset
                    // The offset and a length byte must lie in the window: at + 3 <= wlim = last + 20.
                    bool bad = (lit_ext && b1 == 255u) || at > last + (GF_TP_FAST_HEADER - 3u);
                    const u32 b2 = shared_byte(window + (bad ? p : at) + 2u);  // inside the window
                    const u32 m = token & 15u;
                    const bool match_ext = m == 15u;
                    bad = bad || (match_ext && b2 == 255u);
                    if (bad) break;
                    const u32 match_start = op + lit;
                    keep_record(rec, k, op, match_start, wbase + h, lane);
                    k += 1u;
                    op = match_start + m + 4u + (match_ext ? b2 : 0u);
                    p = at + (match_ext ? 3u : 2u);
                }
                ip = wbase + p;
                if (k == 32u) break;
            }
            if (!recheck && wend < (i64)len && (i64)ip + GF_TP_REFILL_AHEAD > wend) {
                window_fill(w, in, len, ip, lane);  // then the fast parse again, from the cursor
                continue;
            }
            // The checked parse reads forward from the window's base: after a cut, ip may lie before it.
            if ((i64)ip < w.base) window_fill(w, in, len, ip, lane);
            recheck = false;
            status = parse_sequence_checked(w, in, len, cap, &ip, &op, rec, &k, lane);
            if (status != GF_LZ4_OK) break;
        }
        // Step 2: validate. At the first bad record, cut the chunk and parse that sequence again, checked
        // (it fails there, with gf_lz4_decode's status); whatever followed it is dropped.
        const u32 bad = validate_records(rec, k, first, op, cap, in, lane);
        if (bad != 0u) {
            const u32 f = (u32)__ffs(bad) - 1u;
            const u32 f_start = __shfl_sync(0xffffffffu, rec.start, f);
            const u32 f_lit = __shfl_sync(0xffffffffu, rec.match_start, f) - f_start;
            const u32 f_literal_src = __shfl_sync(0xffffffffu, rec.literal_src, f);
            // Only fast-parsed records can fail, and their literal length has one extension byte exactly
            // when it is 15 or more: the token lies right before.
            ip = f_literal_src - (f_lit >= 15u ? 2u : 1u);
            op = f_start;
            k = f;
            status = GF_LZ4_OK;
            recheck = true;
        }
        // Step 3.
        if (op != first) copy_chunk(rec, first, op, in, out, lane);
    }
    *produced = op;
    if (status == GF_TP_PARSE_END) status = op == cap ? GF_LZ4_OK : GF_LZ4_SIZE_MISMATCH;
    return status;
}

// Decodes jobs[0, job_count) like gf_lz4_decode (same table, outcomes and job checks), in two phases.
extern "C" __global__ void GF_LZ4_BOUNDS
gf_lz4_decode_two_phase(const Lz4Job* __restrict__ jobs, u32 job_count, const u8* __restrict__ src,
                        u64 src_capacity, u8* __restrict__ dst, u64 dst_capacity,
                        Lz4Outcome* __restrict__ outcomes) {
    __shared__ __align__(16) u8 windows[GF_LZ4_WARPS][GF_WINDOW_BYTES];
    const u32 lane = threadIdx.x & 31u;
    const u32 warp = threadIdx.x >> 5;
    Window w;
    w.bytes = windows[warp];
    const u32 total_warps = gridDim.x * GF_LZ4_WARPS;
    for (u32 j = blockIdx.x * GF_LZ4_WARPS + warp; j < job_count; j += total_warps) {
        const Lz4Job job = jobs[j];
        const bool filtered = job.shuffle_bytes > 1u;
        const bool ok = lz4_job_fits(job, src_capacity, dst_capacity);
        u32 status = GF_LZ4_BAD_JOB;
        u32 produced = 0;
        if (ok) {
            u8* target = dst + (filtered ? job.scratch_offset : job.dst_offset);
            status = lz4_decode_block_two_phase(w, src + job.src_offset, job.src_bytes, target, job.raw_bytes,
                                                &produced, lane);
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
#endif  // GF_LZ4_TWO_PHASE
