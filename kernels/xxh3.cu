// Block checksums on the device: xxh3-64 (seed 0, default secret) of each job's stored bytes, compared
// with the checksum the shard's block table carries. One warp per job, many jobs per launch.
//
// Compiled at run time by NVRTC (see src/device/module.rs) without any CUDA header: plain integer types
// and the compiler's built-ins only. docs/KERNELS.md describes the design; the reference is
// xxhash_rust::xxh3::xxh3_64 (crate::format::checksum), and kernels::reference::xxh3_64_transcribed is a
// step-for-step Rust copy of this file's warp decomposition that CI checks against it.
//
// Rules every line below keeps:
// - a job whose extent does not fit the source buffer is refused before anything is read;
// - every byte read lies in [src + src_offset, src + src_offset + bytes);
// - all 32 lanes of a warp take the same branches on the job (its length and extent), so every lane
//   reaches every shuffle; only the loads differ between lanes.

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef GF_XXH3_WARPS
#define GF_XXH3_WARPS 4
#endif

// Whole 1 KiB blocks of input whose loads a warp issues together before reducing them (more bytes in
// flight per warp); the scrambles between them still run in input order.
#ifndef GF_XXH3_GROUP
#define GF_XXH3_GROUP 4
#endif

// Thread blocks per multiprocessor to ask the compiler to fit (capping registers); 0: no cap.
#ifndef GF_XXH3_MIN_BLOCKS
#define GF_XXH3_MIN_BLOCKS 0
#endif
#if GF_XXH3_MIN_BLOCKS > 0
#define GF_XXH3_BOUNDS __launch_bounds__(GF_XXH3_WARPS * 32, GF_XXH3_MIN_BLOCKS)
#else
#define GF_XXH3_BOUNDS __launch_bounds__(GF_XXH3_WARPS * 32)
#endif

// Status codes, mirrored by kernels::Xxh3Status.
#define GF_XXH3_OK 0u
#define GF_XXH3_MISMATCH 1u
#define GF_XXH3_BAD_JOB 2u

// One extent to check. Layout mirrored by kernels::Xxh3Job (24 bytes, little-endian).
struct Xxh3Job {
    u64 src_offset;  // first stored byte, in the source buffer
    u32 bytes;       // stored length
    u32 reserved;
    u64 expected;    // the checksum the block table carries
};

// What the kernel found. Layout mirrored by kernels::Xxh3Outcome (16 bytes).
struct Xxh3Outcome {
    u32 status;
    u32 reserved;
    u64 hash;  // the computed xxh3-64; 0 for a refused job
};

#define PRIME32_1 0x9E3779B1ull
#define PRIME32_2 0x85EBCA77ull
#define PRIME32_3 0xC2B2AE3Dull
#define PRIME64_1 0x9E3779B185EBCA87ull
#define PRIME64_2 0xC2B2AE3D27D4EB4Full
#define PRIME64_3 0x165667B19E3779F9ull
#define PRIME64_4 0x85EBCA77C2B2AE63ull
#define PRIME64_5 0x27D4EB2F165667C5ull

#define GF_XXH3_MID_MAX 240u
#define GF_XXH3_BLOCK_BYTES 1024u
#define GF_XXH3_STRIPE_BYTES 64u
// Secret offsets of the long path: the scramble key, the last stripe's key, the merge keys.
#define GF_XXH3_SCRAMBLE_OFFSET 128u
#define GF_XXH3_LAST_STRIPE_OFFSET 121u
#define GF_XXH3_MERGE_OFFSET 11u

// xxh3's default 192-byte secret as 24 little-endian words (byte k of the secret is byte k % 8 of word
// k / 8). A CI test compares this table with the secret in kernels::reference.
__constant__ u64 gf_xxh3_secret[24] = {
    0xbe4ba423396cfeb8ull, 0x1cad21f72c81017cull, 0xdb979083e96dd4deull, 0x1f67b3b7a4a44072ull,
    0x78e5c0cc4ee679cbull, 0x2172ffcc7dd05a82ull, 0x8e2443f7744608b8ull, 0x4c263a81e69035e0ull,
    0xcb00c391bb52283cull, 0xa32e531b8b65d088ull, 0x4ef90da297486471ull, 0xd8acdea946ef1938ull,
    0x3f349ce33f76faa8ull, 0x1d4f0bc7c7bbdcf9ull, 0x3159b4cd4be0518aull, 0x647378d9c97e9fc8ull,
    0xc3ebd33483acc5eaull, 0xeb6313faffa081c5ull, 0x49daf0b751dd0d17ull, 0x9e68d429265516d3ull,
    0xfca1477d58be162bull, 0xce31d07ad1b8f88full, 0x280416958f3acb45ull, 0x7e404bbbcafbd7afull,
};

// True when [offset, offset + bytes) lies inside a buffer of `capacity` bytes, without overflow.
__device__ __forceinline__ bool extent_fits(u64 offset, u64 bytes, u64 capacity) {
    return offset <= capacity && bytes <= capacity - offset;
}

// The secret's 8 bytes at `offset` (any offset up to 184), little-endian.
__device__ __forceinline__ u64 secret64(u32 offset) {
    const u32 word = offset >> 3;
    const u32 shift = (offset & 7u) * 8u;
    const u64 low = gf_xxh3_secret[word];
    if (shift == 0u) return low;
    return (low >> shift) | (gf_xxh3_secret[word + 1u] << (64u - shift));
}

// Unaligned little-endian reads for the short inputs (at most 240 bytes, read by one lane).
__device__ __forceinline__ u64 read64(const u8* p) {
    u64 v = 0;
#pragma unroll
    for (u32 k = 0; k < 8u; ++k) v |= (u64)p[k] << (8u * k);
    return v;
}

__device__ __forceinline__ u32 read32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

__device__ __forceinline__ u64 rotl64(u64 x, u32 r) { return (x << r) | (x >> (64u - r)); }

__device__ __forceinline__ u64 swap64(u64 x) {
    x = ((x & 0x00ff00ff00ff00ffull) << 8) | ((x >> 8) & 0x00ff00ff00ff00ffull);
    x = ((x & 0x0000ffff0000ffffull) << 16) | ((x >> 16) & 0x0000ffff0000ffffull);
    return (x << 32) | (x >> 32);
}

// The 128-bit product of two words, its halves xored.
__device__ __forceinline__ u64 mul128_fold64(u64 a, u64 b) { return (a * b) ^ __umul64hi(a, b); }

// XXH64's final mix (used by xxh3 for 0 to 3 bytes).
__device__ __forceinline__ u64 xxh64_avalanche(u64 h) {
    h ^= h >> 33;
    h *= PRIME64_2;
    h ^= h >> 29;
    h *= PRIME64_3;
    h ^= h >> 32;
    return h;
}

__device__ __forceinline__ u64 xxh3_avalanche(u64 h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    h ^= h >> 32;
    return h;
}

// "rrmxmx", the final mix for 4 to 8 bytes.
__device__ __forceinline__ u64 xxh3_rrmxmx(u64 h, u64 len) {
    h ^= rotl64(h, 49) ^ rotl64(h, 24);
    h *= 0x9FB21C651E98DF25ull;
    h ^= (h >> 35) + len;
    h *= 0x9FB21C651E98DF25ull;
    h ^= h >> 28;
    return h;
}

// 16 input bytes against 16 secret bytes.
__device__ __forceinline__ u64 mix16(const u8* p, u32 secret_offset) {
    const u64 lo = read64(p) ^ secret64(secret_offset);
    const u64 hi = read64(p + 8) ^ secret64(secret_offset + 8u);
    return mul128_fold64(lo, hi);
}

// xxh3-64 of 0 to 240 bytes, sequentially (one lane).
__device__ u64 hash_short(const u8* p, u32 len) {
    if (len == 0u) return xxh64_avalanche(secret64(56) ^ secret64(64));
    if (len <= 3u) {
        const u32 combo = ((u32)p[0] << 16) | ((u32)p[len >> 1] << 24) | (u32)p[len - 1u] | (len << 8);
        const u64 flip = (u64)((u32)secret64(0) ^ (u32)secret64(4));
        return xxh64_avalanche((u64)combo ^ flip);
    }
    if (len <= 8u) {
        const u64 first = read32(p);
        const u64 last = read32(p + len - 4u);
        const u64 flip = secret64(8) ^ secret64(16);
        return xxh3_rrmxmx((last + (first << 32)) ^ flip, len);
    }
    if (len <= 16u) {
        const u64 lo = read64(p) ^ (secret64(24) ^ secret64(32));
        const u64 hi = read64(p + len - 8u) ^ (secret64(40) ^ secret64(48));
        return xxh3_avalanche((u64)len + swap64(lo) + hi + mul128_fold64(lo, hi));
    }
    u64 acc = (u64)len * PRIME64_1;
    if (len <= 128u) {
        if (len > 32u) {
            if (len > 64u) {
                if (len > 96u) {
                    acc += mix16(p + 48, 96);
                    acc += mix16(p + len - 64u, 112);
                }
                acc += mix16(p + 32, 64);
                acc += mix16(p + len - 48u, 80);
            }
            acc += mix16(p + 16, 32);
            acc += mix16(p + len - 32u, 48);
        }
        acc += mix16(p, 0);
        acc += mix16(p + len - 16u, 16);
        return xxh3_avalanche(acc);
    }
    // 129 to 240 bytes.
    const u32 rounds = len / 16u;
    for (u32 i = 0; i < 8u; ++i) acc += mix16(p + 16u * i, 16u * i);
    acc = xxh3_avalanche(acc);
    for (u32 i = 8; i < rounds; ++i) acc += mix16(p + 16u * i, 16u * (i - 8u) + 3u);
    acc += mix16(p + len - 16u, 136u - 17u);
    return xxh3_avalanche(acc);
}

// ---------------------------------------------------------------------------------------------------
// The long path (more than 240 bytes): 8 accumulators, 64-byte stripes, a scramble after each 1 KiB
// block of 16 stripes, then the input's last 64 bytes and the merge.
//
// Warp decomposition: lane l takes bytes [32 l, 32 l + 32) of each block, i.e. half h = l % 2 of stripe
// s = l / 2: the stripe's words 4h .. 4h+3, whose contributions go to accumulators 4h .. 4h+3 only (a
// word's plain value goes to the neighbouring accumulator j ^ 1, in the same half). Between two
// scrambles an accumulator only sums (mod 2^64) one contribution per stripe, so the lanes' partial sums
// are reduced across the 16 lanes of each half and then added in one step. The reduction leaves lane l
// owning accumulator acc_index(l) (4 lanes hold each), which it scrambles alone; the merge at the end
// gathers the eight with four shuffles.

// The accumulator lane l owns after reduce_scatter.
__device__ __forceinline__ u32 acc_index(u32 lane) {
    return 4u * (lane & 1u) + 2u * ((lane >> 4) & 1u) + ((lane >> 3) & 1u);
}

__device__ __forceinline__ u64 initial_acc(u32 index) {
    switch (index) {
        case 0: return PRIME32_3;
        case 1: return PRIME64_1;
        case 2: return PRIME64_2;
        case 3: return PRIME64_3;
        case 4: return PRIME64_4;
        case 5: return PRIME32_2;
        case 6: return PRIME64_5;
        default: return PRIME32_1;
    }
}

__device__ __forceinline__ u64 shfl_xor64(u64 v, int mask) {
    const u32 lo = __shfl_xor_sync(0xffffffffu, (u32)v, mask);
    const u32 hi = __shfl_xor_sync(0xffffffffu, (u32)(v >> 32), mask);
    return ((u64)hi << 32) | lo;
}

// The 32 bytes at p as 4 little-endian words, with the widest loads p's alignment allows (every lane of
// a block shares it: lanes are 32 bytes apart, blocks 1 KiB).
__device__ __forceinline__ void load_words(const u8* __restrict__ p, u64 (&w)[4]) {
    const u64 address = (u64)p;
    if ((address & 15u) == 0u) {
        const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
        const uint4 b = __ldg(reinterpret_cast<const uint4*>(p) + 1);
        w[0] = (u64)a.x | ((u64)a.y << 32);
        w[1] = (u64)a.z | ((u64)a.w << 32);
        w[2] = (u64)b.x | ((u64)b.y << 32);
        w[3] = (u64)b.z | ((u64)b.w << 32);
    } else if ((address & 7u) == 0u) {
        const u64* q = reinterpret_cast<const u64*>(p);
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = q[k];
    } else if ((address & 3u) == 0u) {
        const u32* q = reinterpret_cast<const u32*>(p);
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = (u64)q[2 * k] | ((u64)q[2 * k + 1] << 32);
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) w[k] = read64(p + 8 * k);
    }
}

// One lane's contributions to its half's 4 accumulators from its 4 words of a stripe (accumulate_512).
__device__ __forceinline__ void lane_contribution(const u64 (&w)[4], const u64 (&key)[4], u64 (&c)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u64 keyed = w[i] ^ key[i];
        c[i] = w[i ^ 1] + (u64)(u32)keyed * (u64)(u32)(keyed >> 32);
    }
}

// Sums c[i] over the 16 lanes of each half (the 16 stripes of a block) and returns, on lane l, the sum
// for accumulator acc_index(l): two exchange steps that halve what each lane keeps, then two that add.
__device__ __forceinline__ u64 reduce_scatter(const u64 (&c)[4], u32 lane) {
    const bool upper_pair = (lane & 16u) != 0u;  // keeps accumulators 4h+2, 4h+3
    const bool odd = (lane & 8u) != 0u;          // then keeps 4h+2p+1
    const u64 keep0 = (upper_pair ? c[2] : c[0]) + shfl_xor64(upper_pair ? c[0] : c[2], 16);
    const u64 keep1 = (upper_pair ? c[3] : c[1]) + shfl_xor64(upper_pair ? c[1] : c[3], 16);
    u64 v = (odd ? keep1 : keep0) + shfl_xor64(odd ? keep0 : keep1, 8);
    v += shfl_xor64(v, 4);
    v += shfl_xor64(v, 2);
    return v;
}

__device__ __forceinline__ u64 scramble(u64 acc, u64 key) { return ((acc ^ (acc >> 47)) ^ key) * PRIME32_1; }

// The keys one lane uses for a whole launch.
struct LaneKeys {
    u64 stripe[4];  // secret words s + 4h .. s + 4h + 3: this lane's part of each stripe's key
    u64 scramble;   // the scramble key of the accumulator the lane owns
    u64 merge;      // the merge key of that accumulator
    u64 initial;    // its initial value
};

__device__ __forceinline__ LaneKeys lane_keys(u32 lane) {
    LaneKeys k;
    const u32 s = lane >> 1, h = lane & 1u, j = acc_index(lane);
#pragma unroll
    for (u32 i = 0; i < 4u; ++i) k.stripe[i] = gf_xxh3_secret[s + 4u * h + i];
    k.scramble = gf_xxh3_secret[GF_XXH3_SCRAMBLE_OFFSET / 8u + j];
    k.merge = secret64(GF_XXH3_MERGE_OFFSET + 8u * j);
    k.initial = initial_acc(j);
    return k;
}

// xxh3-64 of more than 240 bytes; every lane of the warp calls it, lane 0 gets the hash.
__device__ u64 hash_long(const u8* __restrict__ in, u32 len, u32 lane, const LaneKeys& keys) {
    u64 acc = keys.initial;
    const u32 blocks = (len - 1u) / GF_XXH3_BLOCK_BYTES;  // whole blocks followed by a scramble
    const u8* lane_in = in + 32u * lane;
    u32 b = 0;
    for (; b + GF_XXH3_GROUP <= blocks; b += GF_XXH3_GROUP) {
        u64 w[GF_XXH3_GROUP][4];
#pragma unroll
        for (int g = 0; g < GF_XXH3_GROUP; ++g) load_words(lane_in + (u64)(b + g) * GF_XXH3_BLOCK_BYTES, w[g]);
        u64 sum[GF_XXH3_GROUP];
#pragma unroll
        for (int g = 0; g < GF_XXH3_GROUP; ++g) {
            u64 c[4];
            lane_contribution(w[g], keys.stripe, c);
            sum[g] = reduce_scatter(c, lane);
        }
#pragma unroll
        for (int g = 0; g < GF_XXH3_GROUP; ++g) acc = scramble(acc + sum[g], keys.scramble);
    }
    for (; b < blocks; ++b) {
        u64 w[4], c[4];
        load_words(lane_in + (u64)b * GF_XXH3_BLOCK_BYTES, w);
        lane_contribution(w, keys.stripe, c);
        acc = scramble(acc + reduce_scatter(c, lane), keys.scramble);
    }
    // The last, partial block: its whole stripes (0 to 15, from secret offset 0 as in every block) come
    // from lanes s < stripes; the input's last 64 bytes, keyed at secret offset 121, from the lanes of
    // stripe 15, which the partial block never uses. No scramble follows, so one reduction adds both.
    const u32 stripes = (len - 1u - blocks * GF_XXH3_BLOCK_BYTES) / GF_XXH3_STRIPE_BYTES;
    const u32 s = lane >> 1, h = lane & 1u;
    u64 c[4] = {0, 0, 0, 0};
    if (s < stripes) {
        u64 w[4];
        load_words(lane_in + (u64)blocks * GF_XXH3_BLOCK_BYTES, w);
        lane_contribution(w, keys.stripe, c);
    } else if (s == 15u) {
        u64 w[4], key[4];
        load_words(in + len - GF_XXH3_STRIPE_BYTES + 32u * h, w);
#pragma unroll
        for (u32 i = 0; i < 4u; ++i) key[i] = secret64(GF_XXH3_LAST_STRIPE_OFFSET + 32u * h + 8u * i);
        lane_contribution(w, key, c);
    }
    acc += reduce_scatter(c, lane);
    // Merge: the lane owning accumulator 2i pairs it with 2i+1 (lane ^ 8), then lanes 0, 16, 1 and 17,
    // which own accumulators 0, 2, 4 and 6, add their four products into lane 0.
    const u64 keyed = acc ^ keys.merge;
    const u64 partner = shfl_xor64(keyed, 8);
    u64 merged = (lane & 8u) ? 0ull : mul128_fold64(keyed, partner);
    merged += shfl_xor64(merged, 16);
    merged += shfl_xor64(merged, 1);
    return xxh3_avalanche((u64)len * PRIME64_1 + merged);
}

// Checks jobs[0, job_count): warp w of the grid takes jobs w, w + total_warps, ...
// `src` holds `src_capacity` bytes; every job's extent is checked against it before any read.
extern "C" __global__ void GF_XXH3_BOUNDS
gf_xxh3_verify(const Xxh3Job* __restrict__ jobs, u32 job_count, const u8* __restrict__ src, u64 src_capacity,
               Xxh3Outcome* __restrict__ outcomes) {
    const u32 lane = threadIdx.x & 31u;
    const u32 warp = threadIdx.x >> 5;
    const LaneKeys keys = lane_keys(lane);
    const u32 total_warps = gridDim.x * GF_XXH3_WARPS;
    for (u32 j = blockIdx.x * GF_XXH3_WARPS + warp; j < job_count; j += total_warps) {
        const Xxh3Job job = jobs[j];
        u32 status = GF_XXH3_BAD_JOB;
        u64 hash = 0;
        if (extent_fits(job.src_offset, job.bytes, src_capacity)) {
            const u8* in = src + job.src_offset;
            if (job.bytes > GF_XXH3_MID_MAX) {
                hash = hash_long(in, job.bytes, lane, keys);
            } else if (lane == 0u) {
                hash = hash_short(in, job.bytes);
            }
            status = hash == job.expected ? GF_XXH3_OK : GF_XXH3_MISMATCH;
        }
        if (lane == 0u) {
            outcomes[j].status = status;
            outcomes[j].reserved = 0u;
            outcomes[j].hash = hash;
        }
    }
}
