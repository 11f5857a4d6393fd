//! xxh3-64 transcribed from kernels/xxh3.cu, warp decomposition included.

use crate::kernels::{Xxh3Config, Xxh3Job, Xxh3Outcome, Xxh3Status};

// ------------------------------------------------------------------------------------------------
// xxh3-64: a transcription of kernels/xxh3.cu, warp decomposition included.

/// xxh3's default 192-byte secret (`kSecret` of the xxHash specification), which `crate::format::checksum`
/// uses (seed 0).
pub const XXH3_SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
];

/// The secret as the kernel's `__constant__` table holds it: 24 little-endian words.
pub fn xxh3_secret_words() -> [u64; 24] {
    std::array::from_fn(|k| {
        u64::from_le_bytes(XXH3_SECRET[8 * k..8 * k + 8].try_into().expect("8 bytes"))
    })
}

const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME32_2: u64 = 0x85EB_CA77;
const PRIME32_3: u64 = 0xC2B2_AE3D;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;
const XXH3_MID_MAX: usize = 240;
const XXH3_BLOCK_BYTES: usize = 1024;
const XXH3_STRIPE_BYTES: usize = 64;
const XXH3_SCRAMBLE_OFFSET: usize = 128;
const XXH3_LAST_STRIPE_OFFSET: usize = 121;
const XXH3_MERGE_OFFSET: usize = 11;
const LANES: usize = 32;

/// One u64 per lane of a warp.
type Lanes = [u64; LANES];

/// The kernel's `secret64`: 8 secret bytes at any offset, from the word table.
fn secret64(words: &[u64; 24], offset: usize) -> u64 {
    let (word, shift) = (offset >> 3, (offset & 7) * 8);
    if shift == 0 {
        words[word]
    } else {
        (words[word] >> shift) | (words[word + 1] << (64 - shift))
    }
}

fn read64(p: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(p[at..at + 8].try_into().expect("8 bytes"))
}

fn read32(p: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(p[at..at + 4].try_into().expect("4 bytes"))
}

fn mul128_fold64(a: u64, b: u64) -> u64 {
    let product = a as u128 * b as u128;
    product as u64 ^ (product >> 64) as u64
}

fn xxh64_avalanche(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(PRIME64_2);
    h ^= h >> 29;
    h = h.wrapping_mul(PRIME64_3);
    h ^ (h >> 32)
}

fn xxh3_avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

fn xxh3_rrmxmx(mut h: u64, len: u64) -> u64 {
    h ^= h.rotate_left(49) ^ h.rotate_left(24);
    h = h.wrapping_mul(0x9FB2_1C65_1E98_DF25);
    h ^= (h >> 35).wrapping_add(len);
    h = h.wrapping_mul(0x9FB2_1C65_1E98_DF25);
    h ^ (h >> 28)
}

fn mix16(words: &[u64; 24], p: &[u8], at: usize, secret_offset: usize) -> u64 {
    let lo = read64(p, at) ^ secret64(words, secret_offset);
    let hi = read64(p, at + 8) ^ secret64(words, secret_offset + 8);
    mul128_fold64(lo, hi)
}

/// The kernel's `hash_short`: 0 to 240 bytes, sequentially (lane 0).
fn xxh3_short_transcribed(words: &[u64; 24], p: &[u8]) -> u64 {
    let len = p.len();
    if len == 0 {
        return xxh64_avalanche(secret64(words, 56) ^ secret64(words, 64));
    }
    if len <= 3 {
        let combo = (p[0] as u32) << 16
            | (p[len >> 1] as u32) << 24
            | p[len - 1] as u32
            | (len as u32) << 8;
        let flip = (secret64(words, 0) as u32 ^ secret64(words, 4) as u32) as u64;
        return xxh64_avalanche(combo as u64 ^ flip);
    }
    if len <= 8 {
        let first = read32(p, 0) as u64;
        let last = read32(p, len - 4) as u64;
        let flip = secret64(words, 8) ^ secret64(words, 16);
        return xxh3_rrmxmx(last.wrapping_add(first << 32) ^ flip, len as u64);
    }
    if len <= 16 {
        let lo = read64(p, 0) ^ (secret64(words, 24) ^ secret64(words, 32));
        let hi = read64(p, len - 8) ^ (secret64(words, 40) ^ secret64(words, 48));
        return xxh3_avalanche(
            (len as u64)
                .wrapping_add(lo.swap_bytes())
                .wrapping_add(hi)
                .wrapping_add(mul128_fold64(lo, hi)),
        );
    }
    let mut acc = (len as u64).wrapping_mul(PRIME64_1);
    if len <= 128 {
        let mut add = |at: usize, secret_offset: usize| {
            acc = acc.wrapping_add(mix16(words, p, at, secret_offset));
        };
        if len > 32 {
            if len > 64 {
                if len > 96 {
                    add(48, 96);
                    add(len - 64, 112);
                }
                add(32, 64);
                add(len - 48, 80);
            }
            add(16, 32);
            add(len - 32, 48);
        }
        add(0, 0);
        add(len - 16, 16);
        return xxh3_avalanche(acc);
    }
    // 129 to 240 bytes.
    let rounds = len / 16;
    for i in 0..8 {
        acc = acc.wrapping_add(mix16(words, p, 16 * i, 16 * i));
    }
    acc = xxh3_avalanche(acc);
    for i in 8..rounds {
        acc = acc.wrapping_add(mix16(words, p, 16 * i, 16 * (i - 8) + 3));
    }
    acc = acc.wrapping_add(mix16(words, p, len - 16, 136 - 17));
    xxh3_avalanche(acc)
}

/// The accumulator lane `lane` owns after [`reduce_scatter`].
fn acc_index(lane: usize) -> usize {
    4 * (lane & 1) + 2 * ((lane >> 4) & 1) + ((lane >> 3) & 1)
}

fn initial_acc(index: usize) -> u64 {
    [
        PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1,
    ][index]
}

/// `__shfl_xor_sync` over a whole warp: lane l receives lane l ^ mask's value.
fn shfl_xor(v: &Lanes, mask: usize) -> Lanes {
    std::array::from_fn(|lane| v[lane ^ mask])
}

/// The kernel's `LaneKeys`.
#[derive(Clone, Copy)]
struct LaneKeys {
    stripe: [u64; 4],
    scramble: u64,
    merge: u64,
    initial: u64,
}

fn lane_keys(words: &[u64; 24], lane: usize) -> LaneKeys {
    let (s, h, j) = (lane >> 1, lane & 1, acc_index(lane));
    LaneKeys {
        stripe: std::array::from_fn(|i| words[s + 4 * h + i]),
        scramble: words[XXH3_SCRAMBLE_OFFSET / 8 + j],
        merge: secret64(words, XXH3_MERGE_OFFSET + 8 * j),
        initial: initial_acc(j),
    }
}

/// The kernel's `load_words`: the 32 bytes at `at` as 4 little-endian words.
fn load_words(input: &[u8], at: usize) -> [u64; 4] {
    std::array::from_fn(|k| read64(input, at + 8 * k))
}

/// The kernel's `lane_contribution` (one lane's share of accumulate_512).
fn lane_contribution(w: &[u64; 4], key: &[u64; 4]) -> [u64; 4] {
    std::array::from_fn(|i| {
        let keyed = w[i] ^ key[i];
        w[i ^ 1].wrapping_add((keyed & 0xffff_ffff) * (keyed >> 32))
    })
}

/// The kernel's `reduce_scatter`, shuffle for shuffle: lane l ends with the sum over its half's 16
/// lanes of the contributions to accumulator `acc_index(l)`.
fn reduce_scatter(c: &[[u64; 4]; LANES]) -> Lanes {
    let upper_pair = |lane: usize| lane & 16 != 0;
    let odd = |lane: usize| lane & 8 != 0;
    let send0: Lanes = std::array::from_fn(|l| if upper_pair(l) { c[l][0] } else { c[l][2] });
    let send1: Lanes = std::array::from_fn(|l| if upper_pair(l) { c[l][1] } else { c[l][3] });
    let (recv0, recv1) = (shfl_xor(&send0, 16), shfl_xor(&send1, 16));
    let keep0: Lanes = std::array::from_fn(|l| {
        (if upper_pair(l) { c[l][2] } else { c[l][0] }).wrapping_add(recv0[l])
    });
    let keep1: Lanes = std::array::from_fn(|l| {
        (if upper_pair(l) { c[l][3] } else { c[l][1] }).wrapping_add(recv1[l])
    });
    let send: Lanes = std::array::from_fn(|l| if odd(l) { keep0[l] } else { keep1[l] });
    let recv = shfl_xor(&send, 8);
    let mut v: Lanes =
        std::array::from_fn(|l| (if odd(l) { keep1[l] } else { keep0[l] }).wrapping_add(recv[l]));
    for mask in [4, 2] {
        let other = shfl_xor(&v, mask);
        for (x, y) in v.iter_mut().zip(other) {
            *x = x.wrapping_add(y);
        }
    }
    v
}

fn scramble(acc: u64, key: u64) -> u64 {
    ((acc ^ (acc >> 47)) ^ key).wrapping_mul(PRIME32_1)
}

/// The kernel's `hash_long` for more than 240 bytes, all 32 lanes at once; `group` is
/// [`Xxh3Config::blocks_per_step`].
fn xxh3_long_transcribed(words: &[u64; 24], input: &[u8], group: usize) -> u64 {
    let keys: [LaneKeys; LANES] = std::array::from_fn(|lane| lane_keys(words, lane));
    let mut acc: Lanes = std::array::from_fn(|lane| keys[lane].initial);
    let len = input.len();
    let blocks = (len - 1) / XXH3_BLOCK_BYTES;
    let block_sum = |block: usize| {
        let c: [[u64; 4]; LANES] = std::array::from_fn(|lane| {
            let w = load_words(input, block * XXH3_BLOCK_BYTES + 32 * lane);
            lane_contribution(&w, &keys[lane].stripe)
        });
        reduce_scatter(&c)
    };
    let mut b = 0;
    while b + group <= blocks {
        // All loads and reductions of the step first, then the scrambles in input order.
        let sums: Vec<Lanes> = (b..b + group).map(block_sum).collect();
        for sum in &sums {
            for lane in 0..LANES {
                acc[lane] = scramble(acc[lane].wrapping_add(sum[lane]), keys[lane].scramble);
            }
        }
        b += group;
    }
    while b < blocks {
        let sum = block_sum(b);
        for lane in 0..LANES {
            acc[lane] = scramble(acc[lane].wrapping_add(sum[lane]), keys[lane].scramble);
        }
        b += 1;
    }
    // The partial block's whole stripes from lanes s < stripes, the last 64 bytes from stripe 15's lanes.
    let stripes = (len - 1 - blocks * XXH3_BLOCK_BYTES) / XXH3_STRIPE_BYTES;
    let c: [[u64; 4]; LANES] = std::array::from_fn(|lane| {
        let (s, h) = (lane >> 1, lane & 1);
        if s < stripes {
            let w = load_words(input, blocks * XXH3_BLOCK_BYTES + 32 * lane);
            lane_contribution(&w, &keys[lane].stripe)
        } else if s == 15 {
            let w = load_words(input, len - XXH3_STRIPE_BYTES + 32 * h);
            let key =
                std::array::from_fn(|i| secret64(words, XXH3_LAST_STRIPE_OFFSET + 32 * h + 8 * i));
            lane_contribution(&w, &key)
        } else {
            [0; 4]
        }
    });
    let sum = reduce_scatter(&c);
    for lane in 0..LANES {
        acc[lane] = acc[lane].wrapping_add(sum[lane]);
    }
    // Merge: accumulator 2i with 2i+1 (lane ^ 8), then lanes 0, 16, 1, 17 into lane 0.
    let keyed: Lanes = std::array::from_fn(|lane| acc[lane] ^ keys[lane].merge);
    let partner = shfl_xor(&keyed, 8);
    let mut merged: Lanes = std::array::from_fn(|lane| {
        if lane & 8 != 0 {
            0
        } else {
            mul128_fold64(keyed[lane], partner[lane])
        }
    });
    for mask in [16, 1] {
        let other = shfl_xor(&merged, mask);
        for (x, y) in merged.iter_mut().zip(other) {
            *x = x.wrapping_add(y);
        }
    }
    xxh3_avalanche((len as u64).wrapping_mul(PRIME64_1).wrapping_add(merged[0]))
}

/// The checksum kernel's xxh3-64 of `input`, computed the way its warp does (for inputs over 240
/// bytes: 32 lanes' partial sums, the reduce-scatter, per-lane scrambles, the shuffled merge), with
/// `group` input blocks per step. Must equal `xxhash_rust::xxh3::xxh3_64` for every input.
pub fn xxh3_64_transcribed_with_group(input: &[u8], group: usize) -> u64 {
    assert!((1..=8).contains(&group), "1 to 8 input blocks per step");
    let words = xxh3_secret_words();
    if input.len() > XXH3_MID_MAX {
        xxh3_long_transcribed(&words, input, group)
    } else {
        xxh3_short_transcribed(&words, input)
    }
}

/// [`xxh3_64_transcribed_with_group`] with [`Xxh3Config::STANDARD`]'s group.
pub fn xxh3_64_transcribed(input: &[u8]) -> u64 {
    xxh3_64_transcribed_with_group(input, Xxh3Config::STANDARD.blocks_per_step as usize)
}

/// The outcomes the checksum kernel must write for `jobs` over the source buffer `src`: the same
/// extent check, hash and comparison, job by job.
pub fn xxh3_verify_transcribed(jobs: &[Xxh3Job], src: &[u8]) -> Vec<Xxh3Outcome> {
    jobs.iter()
        .map(|job| {
            let capacity = src.len() as u64;
            let fits = job.src_offset <= capacity && job.bytes as u64 <= capacity - job.src_offset;
            if !fits {
                return Xxh3Outcome {
                    status: Xxh3Status::BadJob,
                    hash: 0,
                };
            }
            let start = job.src_offset as usize;
            let hash = xxh3_64_transcribed(&src[start..start + job.bytes as usize]);
            Xxh3Outcome {
                status: if hash == job.expected {
                    Xxh3Status::Ok
                } else {
                    Xxh3Status::Mismatch
                },
                hash,
            }
        })
        .collect()
}
