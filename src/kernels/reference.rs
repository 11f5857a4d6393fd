//! CPU models of the kernels, for tests.
//!
//! Two kinds live here. The *reference* ([`gather_reference`]) is built on the CPU decode path
//! (`crate::decode::convert`, hence `half`): the GPU must agree with it bit for bit. The *transcriptions*
//! ([`lz4_decode_transcribed`], [`f16_to_f32_bits`], [`xxh3_64_transcribed`], ...) copy the kernels' own
//! algorithms line for line into Rust, so that CI, which has no GPU, checks those algorithms against the
//! reference on every input it can afford (all 65 536 half patterns, adversarial LZ4 blocks, every xxh3
//! length class). The GPU tests then check the kernels against the reference directly.

use super::{
    GatherOp, GatherOutcome, GatherPiece, Lz4Status, Xxh3Config, Xxh3Job, Xxh3Outcome, Xxh3Status,
};

/// The LZ4 kernel's parse and bounds checks, sequentially: decodes `input` into exactly `out.len()`
/// bytes. Returns the status the kernel reports and the bytes produced.
pub fn lz4_decode_transcribed(input: &[u8], out: &mut [u8]) -> (Lz4Status, usize) {
    let len = input.len();
    let cap = out.len();
    let mut ip = 0usize;
    let mut op = 0usize;
    let status = 'parse: loop {
        if ip >= len {
            break 'parse Lz4Status::InputOverrun;
        }
        let token = input[ip] as usize;
        ip += 1;
        let mut lit = token >> 4;
        if lit == 15 {
            loop {
                if ip >= len {
                    break 'parse Lz4Status::InputOverrun;
                }
                let b = input[ip] as usize;
                ip += 1;
                lit += b;
                if lit > len {
                    break 'parse Lz4Status::InputOverrun;
                }
                if b != 255 {
                    break;
                }
            }
        }
        if lit > len - ip {
            break 'parse Lz4Status::InputOverrun;
        }
        if lit > cap - op {
            break 'parse Lz4Status::OutputOverrun;
        }
        out[op..op + lit].copy_from_slice(&input[ip..ip + lit]);
        ip += lit;
        op += lit;
        if ip == len {
            break 'parse Lz4Status::Ok;
        }
        if len - ip < 2 {
            break 'parse Lz4Status::InputOverrun;
        }
        let offset = input[ip] as usize | (input[ip + 1] as usize) << 8;
        ip += 2;
        if offset == 0 {
            break 'parse Lz4Status::BadOffset;
        }
        let mut mlen = token & 15;
        if mlen == 15 {
            loop {
                if ip >= len {
                    break 'parse Lz4Status::InputOverrun;
                }
                let b = input[ip] as usize;
                ip += 1;
                mlen += b;
                if mlen > cap {
                    break 'parse Lz4Status::OutputOverrun;
                }
                if b != 255 {
                    break;
                }
            }
        }
        mlen += 4;
        if mlen > cap - op {
            break 'parse Lz4Status::OutputOverrun;
        }
        if offset > op {
            break 'parse Lz4Status::BadOffset;
        }
        let from = op - offset;
        if offset >= 32 || offset >= mlen {
            // Lanes read out[from + (i mod offset)]: bytes already written before this match.
            for i in 0..mlen {
                out[op + i] = out[from + i % offset];
            }
        } else {
            // Lanes stride by a multiple of the offset, each writing its one pattern byte.
            let stride = (32 / offset) * offset;
            for lane in 0..stride.min(mlen) {
                let v = out[from + lane % offset];
                let mut i = lane;
                while i < mlen {
                    out[op + i] = v;
                    i += stride;
                }
            }
        }
        op += mlen;
    };
    let status = if status == Lz4Status::Ok && op != cap {
        Lz4Status::SizeMismatch
    } else {
        status
    };
    (status, op)
}

/// Where one sequence of a valid LZ4 block lies, for tests that damage one of its fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lz4SequenceAt {
    /// Input position of the sequence's two offset bytes; `None` for the last, literal-only one.
    pub offset_at: Option<usize>,
    /// Output position where its match starts (after its literals).
    pub match_start: usize,
    /// Output position after its match.
    pub end: usize,
}

/// The sequences of a valid LZ4 block, in order. Panics on a block that does not parse.
pub fn lz4_sequences(stored: &[u8]) -> Vec<Lz4SequenceAt> {
    let length = |ip: &mut usize, mut value: usize| loop {
        let b = stored[*ip] as usize;
        *ip += 1;
        value += b;
        if b != 255 {
            return value;
        }
    };
    let mut sequences = Vec::new();
    let (mut ip, mut op) = (0usize, 0usize);
    while ip < stored.len() {
        let token = stored[ip] as usize;
        ip += 1;
        let mut lit = token >> 4;
        if lit == 15 {
            lit = length(&mut ip, lit);
        }
        ip += lit;
        let match_start = op + lit;
        if ip == stored.len() {
            sequences.push(Lz4SequenceAt {
                offset_at: None,
                match_start,
                end: match_start,
            });
            break;
        }
        let offset_at = ip;
        ip += 2;
        let mut mlen = token & 15;
        if mlen == 15 {
            mlen = length(&mut ip, mlen);
        }
        op = match_start + mlen + 4;
        sequences.push(Lz4SequenceAt {
            offset_at: Some(offset_at),
            match_start,
            end: op,
        });
    }
    sequences
}

// ------------------------------------------------------------------------------------------------
// LZ4, two-phase: a transcription of gf_lz4_decode_two_phase, lane by lane.

/// `GF_WINDOW_BYTES`: input bytes staged in shared memory per warp.
pub const LZ4_WINDOW_BYTES: usize = 1024;
/// `GF_TP_FAST_HEADER`: bytes of a fast-parsed sequence's header that must lie in the window.
pub const LZ4_TP_FAST_HEADER: u32 = 20;
/// `GF_TP_REFILL_AHEAD`: how close to the window's end the fast parse stops before a refill.
pub const LZ4_TP_REFILL_AHEAD: i64 = 288;
/// `GF_TP_FAST_SEQUENCE_MAX`: most output bytes of one fast-parsed sequence.
pub const LZ4_TP_FAST_SEQUENCE_MAX: u32 = 542;
/// The longest header the fast parse takes: token, one length byte, 15 + 254 literals, the offset,
/// one length byte. It must fit between the refill point and the window's end.
const LZ4_TP_FAST_HEADER_SPAN_MAX: i64 = 1 + 1 + 269 + 2 + 1;
const _: () = assert!(LZ4_TP_FAST_HEADER_SPAN_MAX <= LZ4_TP_REFILL_AHEAD);
const _: () = assert!(LZ4_TP_FAST_SEQUENCE_MAX == (15 + 254) + (15 + 254 + 4));
/// The kernel's copy-phase source codes (0..31 name a lane).
const SRC_INPUT: u32 = 32;
const SRC_OUTPUT: u32 = 33;
const WARP: usize = 32;

/// The kernel's input window: bytes `[base, base + LZ4_WINDOW_BYTES)` of the block, zero outside it.
struct TpWindow<'a> {
    input: &'a [u8],
    /// The input's address modulo 16 on the device: the window starts on 16-byte boundaries.
    misalign: i64,
    base: i64,
    bytes: [u8; LZ4_WINDOW_BYTES],
}

impl TpWindow<'_> {
    /// `window_fill`.
    fn fill(&mut self, pos: u32) {
        self.base = ((pos as i64 + self.misalign) & !15) - self.misalign;
        for (i, b) in self.bytes.iter_mut().enumerate() {
            let p = self.base + i as i64;
            *b = if p >= 0 && p < self.input.len() as i64 {
                self.input[p as usize]
            } else {
                0
            };
        }
    }

    /// `window_byte`: the kernel reads `bytes[pos - base]`, so `pos` must not lie behind the window.
    fn byte(&mut self, pos: u32) -> u32 {
        if pos as i64 >= self.base + LZ4_WINDOW_BYTES as i64 {
            self.fill(pos);
        }
        let at = pos as i64 - self.base;
        assert!(
            (0..LZ4_WINDOW_BYTES as i64).contains(&at),
            "window_byte({pos}) outside the window at {}",
            self.base
        );
        self.bytes[at as usize] as u32
    }

    /// `shared_byte(window + at)` in the fast parse: must stay inside the window's buffer.
    fn at(&self, at: u32) -> u32 {
        assert!(
            (at as usize) < LZ4_WINDOW_BYTES,
            "fast parse read {at} past the window"
        );
        self.bytes[at as usize] as u32
    }

    /// `read_length`: adds length bytes while they are 255.
    fn read_length(
        &mut self,
        len: u32,
        ip: &mut u32,
        value: &mut u32,
        limit: u32,
        too_long: Lz4Status,
    ) -> Option<Lz4Status> {
        loop {
            if *ip >= len {
                return Some(Lz4Status::InputOverrun);
            }
            let b = self.byte(*ip);
            *ip += 1;
            *value = value.wrapping_add(b);
            if *value > limit {
                return Some(too_long);
            }
            if b != 255 {
                return None;
            }
        }
    }
}

/// One lane's `Record`.
#[derive(Clone, Copy, Default)]
struct TpRecord {
    start: u32,
    match_start: u32,
    literal_src: u32,
    matched: u32,
}

/// How the checked parse ended: go on, the block's end after a sequence's literals, or a fault.
enum TpParse {
    Continue,
    End,
    Fault(Lz4Status),
}

/// `parse_sequence_checked`.
fn tp_parse_checked(
    w: &mut TpWindow,
    len: u32,
    cap: u32,
    ip_io: &mut u32,
    op_io: &mut u32,
    lanes: &mut [TpRecord; WARP],
    k: &mut u32,
) -> TpParse {
    let mut ip = *ip_io;
    let op = *op_io;
    if ip >= len {
        return TpParse::Fault(Lz4Status::InputOverrun);
    }
    let token = w.byte(ip);
    ip += 1;
    let mut lit = token >> 4;
    if lit == 15 {
        if let Some(status) = w.read_length(len, &mut ip, &mut lit, len, Lz4Status::InputOverrun) {
            return TpParse::Fault(status);
        }
    }
    if lit > len - ip {
        return TpParse::Fault(Lz4Status::InputOverrun);
    }
    if lit > cap.wrapping_sub(op) {
        return TpParse::Fault(Lz4Status::OutputOverrun);
    }
    let literal_src = ip;
    ip += lit;
    let match_start = op.wrapping_add(lit);
    let mut result = TpParse::Continue;
    let mut mlen = 0u32;
    if ip == len {
        result = TpParse::End;
    } else if len - ip < 2 {
        result = TpParse::Fault(Lz4Status::InputOverrun);
    } else {
        let low = w.byte(ip);
        let offset = low | w.byte(ip + 1) << 8;
        ip += 2;
        if offset == 0 {
            result = TpParse::Fault(Lz4Status::BadOffset);
        } else {
            let mut m = token & 15;
            let mut fault = None;
            if m == 15 {
                fault = w.read_length(len, &mut ip, &mut m, cap, Lz4Status::OutputOverrun);
            }
            match fault {
                Some(status) => result = TpParse::Fault(status),
                None => {
                    let room = cap.wrapping_sub(match_start);
                    if room < 4 || m > room - 4 {
                        result = TpParse::Fault(Lz4Status::OutputOverrun);
                    } else if offset > match_start {
                        result = TpParse::Fault(Lz4Status::BadOffset);
                    } else {
                        mlen = m + 4;
                    }
                }
            }
        }
    }
    if lit.wrapping_add(mlen) != 0 {
        assert!(*k < WARP as u32, "a 33rd record in a chunk");
        lanes[*k as usize] = TpRecord {
            start: op,
            match_start,
            literal_src,
            ..lanes[*k as usize]
        };
        *k += 1;
    }
    *ip_io = ip;
    *op_io = match_start.wrapping_add(mlen);
    result
}

/// `validate_records`: returns the ballot of failing records.
fn tp_validate(
    lanes: &mut [TpRecord; WARP],
    count: u32,
    first: u32,
    end: u32,
    cap: u32,
    input: &[u8],
) -> u32 {
    // __shfl_down_sync(.., 1): lane 31 gets its own value.
    let next_start: [u32; WARP] = std::array::from_fn(|l| lanes[(l + 1).min(WARP - 1)].start);
    let mut ballot = 0u32;
    for (lane, rec) in lanes.iter_mut().enumerate() {
        let lane = lane as u32;
        let held = lane < count;
        let rec_end = if lane + 1 < count {
            next_start[lane as usize]
        } else {
            end
        };
        let has_match = held && rec_end != rec.match_start;
        let mut offset = 0u32;
        if has_match {
            let at = rec
                .literal_src
                .wrapping_add(rec.match_start.wrapping_sub(rec.start));
            assert!(
                (at as usize) + 1 < input.len(),
                "validation read offset bytes at {at} of {}",
                input.len()
            );
            offset = input[at as usize] as u32 | (input[at as usize + 1] as u32) << 8;
        }
        let inverse = if offset != 0 && offset < 32 {
            (1023 + offset) / offset
        } else {
            0
        };
        rec.matched = offset | inverse << 16;
        if !held {
            rec.start = first.wrapping_sub(1);
        }
        let bad =
            held && (rec_end > cap || (has_match && offset.wrapping_sub(1) >= rec.match_start));
        if bad {
            ballot |= 1 << lane;
        }
    }
    ballot
}

/// `copy_chunk`, lane by lane and step by step. Each step's loads happen before its stores, as on the
/// device; the asserts are the kernel's bounds argument: every record lookup lands on a record of the
/// chunk that holds the byte, every input read lies in the block, every output read lies below the
/// step (written by an earlier one), every write lies in `[first, end)`.
fn tp_copy(
    lanes: &[TpRecord; WARP],
    count: u32,
    first: u32,
    end: u32,
    input: &[u8],
    out: &mut [u8],
) {
    let literal_delta: [u32; WARP] =
        std::array::from_fn(|l| lanes[l].literal_src.wrapping_sub(lanes[l].start));
    let mut before = 0u32;
    let mut q0 = first;
    loop {
        let mut starts = 0u32;
        for rec in lanes {
            let rel = rec.start.wrapping_sub(q0);
            if rel < 32 {
                starts |= 1 << rel;
            }
        }
        let mut code = [0u32; WARP];
        let mut pos = [0u32; WARP];
        let mut active = [false; WARP];
        for lane in 0..WARP {
            let lanes_upto = u32::MAX >> (31 - lane);
            let mine = before
                .wrapping_add((starts & lanes_upto).count_ones())
                .wrapping_sub(1);
            let rec = lanes[(mine & 31) as usize];
            let (match_start, delta, matched) = (
                rec.match_start,
                literal_delta[(mine & 31) as usize],
                rec.matched,
            );
            active[lane] = (lane as u32) < end.wrapping_sub(q0);
            let q = q0.wrapping_add(lane as u32);
            if active[lane] {
                assert!(mine < count, "byte {q} looked up record {mine} of {count}");
                assert!(
                    rec.start <= q,
                    "byte {q} before its record at {}",
                    rec.start
                );
                let next = if mine + 1 < count {
                    lanes[mine as usize + 1].start
                } else {
                    end
                };
                assert!(q < next, "byte {q} past its record's end {next}");
            }
            let offset = matched & 0xffff;
            let b = match_start.max(q0);
            let j = (q.wrapping_sub(b).wrapping_mul(matched >> 16) >> 10).wrapping_add(1);
            let from = q.wrapping_sub(offset.wrapping_mul(j));
            code[lane] = if from >= q0 { from - q0 } else { SRC_OUTPUT };
            pos[lane] = from;
            if q < match_start {
                code[lane] = SRC_INPUT;
                pos[lane] = q.wrapping_add(delta);
            }
            if !active[lane] {
                code[lane] = SRC_OUTPUT;
            }
        }
        while code.iter().any(|&c| c < 32) {
            let from_lane: [usize; WARP] =
                std::array::from_fn(|l| if code[l] < 32 { code[l] as usize } else { l });
            for (l, &f) in from_lane.iter().enumerate() {
                assert!(f < l || code[l] >= 32, "lane {l} names lane {f}");
            }
            let (old_code, old_pos) = (code, pos);
            for l in 0..WARP {
                code[l] = old_code[from_lane[l]];
                pos[l] = old_pos[from_lane[l]];
            }
        }
        let mut values = [0u8; WARP];
        for lane in 0..WARP {
            if !active[lane] {
                continue;
            }
            let q = q0.wrapping_add(lane as u32);
            values[lane] = if code[lane] == SRC_INPUT {
                assert!(
                    (pos[lane] as usize) < input.len(),
                    "byte {q} reads input {} of {}",
                    pos[lane],
                    input.len()
                );
                input[pos[lane] as usize]
            } else {
                assert_eq!(code[lane], SRC_OUTPUT);
                assert!(
                    pos[lane] < q0,
                    "byte {q} reads output {} not yet written (step {q0})",
                    pos[lane]
                );
                out[pos[lane] as usize]
            };
        }
        for lane in 0..WARP {
            if active[lane] {
                let q = q0.wrapping_add(lane as u32);
                assert!(first <= q && q < end && (q as usize) < out.len());
                out[q as usize] = values[lane];
            }
        }
        before = before.wrapping_add(starts.count_ones());
        if end.wrapping_sub(q0) <= 32 {
            break;
        }
        q0 = q0.wrapping_add(32);
    }
}

/// The two-phase LZ4 kernel (`gf_lz4_decode_two_phase`) step for step: the window (its refills
/// depend on the input's address modulo 16, `input_misalign`), the fast and checked parse into
/// per-lane records, the validation and its cut, the copy with its per-step masks, period steps and
/// pointer jumping over 32 modelled lanes. Decodes `input` into exactly `out.len()` bytes and returns
/// the status and the bytes produced, which must equal [`lz4_decode_transcribed`]'s (the kernels'
/// shared contract); panics where the kernel would read or write outside its bounds.
pub fn lz4_decode_two_phase_transcribed(
    input: &[u8],
    out: &mut [u8],
    input_misalign: usize,
) -> (Lz4Status, usize) {
    let len = u32::try_from(input.len()).expect("blocks below 4 GiB");
    let cap = u32::try_from(out.len()).expect("blocks below 4 GiB");
    let mut w = TpWindow {
        input,
        misalign: (input_misalign % 16) as i64,
        base: 0,
        bytes: [0; LZ4_WINDOW_BYTES],
    };
    let mut ip = 0u32;
    let mut op = 0u32;
    let mut state = TpParse::Continue;
    let fast_allowed = cap <= u32::MAX - 32 * LZ4_TP_FAST_SEQUENCE_MAX;
    let mut recheck = false;
    let mut lanes = [TpRecord::default(); WARP];
    w.fill(0);
    while matches!(state, TpParse::Continue) {
        let first = op;
        let mut k = 0u32;
        while k < 32 {
            let wend = w.base + LZ4_WINDOW_BYTES as i64;
            let wlim = (wend.min(len as i64) - w.base) as u32;
            let rel = ip as i64 - w.base;
            if !recheck
                && fast_allowed
                && wlim >= LZ4_TP_FAST_HEADER
                && rel >= 0
                && rel <= (wlim - LZ4_TP_FAST_HEADER) as i64
            {
                let wbase = w.base as u32;
                let last = wlim - LZ4_TP_FAST_HEADER;
                let mut p = rel as u32;
                while k < 32 && p <= last {
                    let token = w.at(p);
                    let b1 = w.at(p + 1);
                    let lit_ext = token >= 0xf0;
                    let lit = (token >> 4) + if lit_ext { b1 } else { 0 };
                    let h = p + if lit_ext { 2 } else { 1 };
                    let at = h + lit;
                    let mut bad = (lit_ext && b1 == 255) || at > last + (LZ4_TP_FAST_HEADER - 3);
                    let b2 = w.at((if bad { p } else { at }) + 2);
                    let m = token & 15;
                    let match_ext = m == 15;
                    bad = bad || (match_ext && b2 == 255);
                    if bad {
                        break;
                    }
                    let match_start = op.wrapping_add(lit);
                    lanes[k as usize] = TpRecord {
                        start: op,
                        match_start,
                        literal_src: wbase.wrapping_add(h),
                        ..lanes[k as usize]
                    };
                    k += 1;
                    op = match_start.wrapping_add(m + 4).wrapping_add(if match_ext {
                        b2
                    } else {
                        0
                    });
                    p = at + if match_ext { 3 } else { 2 };
                }
                ip = wbase.wrapping_add(p);
                if k == 32 {
                    break;
                }
            }
            if !recheck && wend < len as i64 && ip as i64 + LZ4_TP_REFILL_AHEAD > wend {
                w.fill(ip);
                continue;
            }
            if (ip as i64) < w.base {
                w.fill(ip);
            }
            recheck = false;
            state = tp_parse_checked(&mut w, len, cap, &mut ip, &mut op, &mut lanes, &mut k);
            if !matches!(state, TpParse::Continue) {
                break;
            }
        }
        let bad = tp_validate(&mut lanes, k, first, op, cap, input);
        if bad != 0 {
            let f = bad.trailing_zeros() as usize;
            let rec = lanes[f];
            let f_lit = rec.match_start.wrapping_sub(rec.start);
            ip = rec
                .literal_src
                .wrapping_sub(if f_lit >= 15 { 2 } else { 1 });
            op = rec.start;
            k = f as u32;
            state = TpParse::Continue;
            recheck = true;
        }
        if op != first {
            tp_copy(&lanes, k, first, op, input, out);
        }
    }
    let status = match state {
        TpParse::End if op == cap => Lz4Status::Ok,
        TpParse::End => Lz4Status::SizeMismatch,
        TpParse::Fault(status) => status,
        TpParse::Continue => unreachable!("the parse loop ends only on the end or a fault"),
    };
    (status, op as usize)
}

/// The gather kernel's f16 -> f32 rule, transcribed (integer operations only).
pub fn f16_to_f32_bits(h: u16) -> u32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let exp = (h >> 10) & 0x1f;
    let man = h & 0x3ff;
    if exp == 0x1f {
        if man == 0 {
            sign | 0x7f80_0000
        } else {
            sign | 0x7fc0_0000 | (man << 13)
        }
    } else if exp == 0 {
        if man == 0 {
            sign
        } else {
            let e = man.leading_zeros() - 22;
            sign | ((112 - e) << 23) | ((man << (14 + e)) & 0x7f_ffff)
        }
    } else {
        sign | ((exp + 112) << 23) | (man << 13)
    }
}

/// The gather kernel's bf16 -> f32 rule, transcribed.
pub fn bf16_to_f32_bits(h: u16) -> u32 {
    let x = h as u32;
    (if x & 0x7fff > 0x7f80 { x | 0x40 } else { x }) << 16
}

/// The gather kernel's f64 -> f32 rule for NaN, transcribed; other values round to nearest even.
pub fn f64_to_f32_bits(b: u64) -> u32 {
    if b & 0x7fff_ffff_ffff_ffff > 0x7ff0_0000_0000_0000 {
        let sign = (b >> 32) as u32 & 0x8000_0000;
        sign | 0x7fc0_0000 | ((b >> 29) as u32 & 0x3f_ffff)
    } else {
        (f64::from_bits(b) as f32).to_bits()
    }
}

/// What the gather kernel must produce: each piece converted by the CPU decode path into `dst`, with
/// the kernel's rules for pieces that do not fit (skipped and counted).
pub fn gather_reference(
    pieces: &[GatherPiece],
    sources: &[&[u8]],
    dst: &mut [u8],
) -> GatherOutcome {
    let mut outcome = GatherOutcome::default();
    for (index, piece) in pieces.iter().enumerate() {
        let n = piece.elements as u64;
        let in_bytes = n * piece.op.in_bytes();
        let out_bytes = n * piece.op.out_bytes();
        let fits = |offset: u64, bytes: u64, capacity: usize| {
            offset <= capacity as u64 && bytes <= capacity as u64 - offset
        };
        let source = sources
            .get(piece.source as usize)
            .filter(|_| (piece.source as usize) < super::GATHER_SOURCES_MAX);
        let Some(source) = source.filter(|s| {
            fits(piece.src_offset, in_bytes, s.len())
                && fits(piece.dst_offset, out_bytes, dst.len())
        }) else {
            outcome.faulted_pieces += 1;
            outcome.last_faulted_plus_1 = outcome.last_faulted_plus_1.max(index as u32 + 1);
            continue;
        };
        let src = &source[piece.src_offset as usize..(piece.src_offset + in_bytes) as usize];
        let out = &mut dst[piece.dst_offset as usize..(piece.dst_offset + out_bytes) as usize];
        match piece.op.dtypes() {
            None => out.copy_from_slice(src),
            Some((from, to)) => {
                crate::decode::convert(from, src, to, out)
                    .expect("every GatherOp is a supported conversion");
                if piece.op == GatherOp::U8ToF32 && piece.scale != 1.0 {
                    for word in out.chunks_exact_mut(4) {
                        let v = f32::from_le_bytes(word.try_into().expect("4 bytes")) * piece.scale;
                        word.copy_from_slice(&v.to_le_bytes());
                    }
                }
            }
        }
    }
    outcome
}

/// `count` fp16 activations after a ReLU, little-endian: max(0, x) for x drawn from N(0, 1), so about
/// half are zero in runs of random length (the "ReLU-sparse fp16" of the kernel benchmarks).
pub fn relu_sparse_f16(count: usize, seed: u64) -> Vec<u8> {
    use rand::SeedableRng;
    use rand_distr::{Distribution, Normal};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let normal = Normal::new(0.0f32, 1.0).expect("valid normal");
    let mut out = Vec::with_capacity(count * 2);
    for _ in 0..count {
        let x = normal.sample(&mut rng).max(0.0);
        out.extend_from_slice(&half::f16::from_f32(x).to_le_bytes());
    }
    out
}

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

#[cfg(test)]
mod tests {
    use half::{bf16, f16};
    use rand::{Rng, SeedableRng};

    use super::*;

    #[test]
    fn f16_rule_matches_half_for_every_pattern() {
        for bits in 0..=u16::MAX {
            assert_eq!(
                f16_to_f32_bits(bits),
                f16::from_bits(bits).to_f32().to_bits(),
                "f16 {bits:#06x}"
            );
        }
    }

    #[test]
    fn bf16_rule_matches_half_for_every_pattern() {
        for bits in 0..=u16::MAX {
            assert_eq!(
                bf16_to_f32_bits(bits),
                bf16::from_bits(bits).to_f32().to_bits(),
                "bf16 {bits:#06x}"
            );
        }
    }

    #[test]
    fn f64_rule_matches_the_cpu_path_on_nan_and_random_patterns() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut patterns: Vec<u64> = (0..100_000).map(|_| rng.gen()).collect();
        for payload in [
            1u64,
            2,
            0x7ffff,
            1 << 29,
            (1 << 51) - 1,
            1 << 51,
            (1 << 52) - 1,
        ] {
            patterns.push(0x7ff0_0000_0000_0000 | payload);
            patterns.push(0xfff0_0000_0000_0000 | payload);
        }
        patterns.extend([
            0,
            1,
            0x0010_0000_0000_0000,
            0x7ff0_0000_0000_0000,
            0x36a0_0000_0000_0001,
        ]);
        for bits in patterns {
            let mut out = [0u8; 4];
            crate::decode::convert(
                gpufeed_proto::DType::F64,
                &bits.to_le_bytes(),
                gpufeed_proto::DType::F32,
                &mut out,
            )
            .unwrap();
            assert_eq!(
                f64_to_f32_bits(bits),
                u32::from_le_bytes(out),
                "f64 {bits:#018x}"
            );
        }
    }

    fn agree_with_lz4_flex(stored: &[u8], raw_bytes: usize) {
        let mut cpu = vec![0u8; raw_bytes];
        let cpu_result = lz4_flex::block::decompress_into(stored, &mut cpu);
        let mut model = vec![0u8; raw_bytes];
        let (status, produced) = lz4_decode_transcribed(stored, &mut model);
        match cpu_result {
            Ok(n) if n == raw_bytes => {
                assert_eq!(
                    status,
                    Lz4Status::Ok,
                    "lz4_flex accepted, model said {status:?}"
                );
                assert_eq!(produced, raw_bytes);
                assert!(model == cpu, "bytes differ");
            }
            Ok(n) => {
                assert_eq!(
                    status,
                    Lz4Status::SizeMismatch,
                    "lz4_flex made {n} of {raw_bytes}"
                );
                assert_eq!(produced, n);
            }
            Err(e) => assert_ne!(
                status,
                Lz4Status::Ok,
                "lz4_flex rejected ({e}), model accepted"
            ),
        }
    }

    #[test]
    fn lz4_transcription_agrees_with_lz4_flex_on_valid_and_damaged_blocks() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let mut inputs: Vec<Vec<u8>> = vec![
            crate::synth::zipf_tokens_i32(4096, 1),
            vec![0u8; 70_000],
            b"abcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabc".repeat(300),
            crate::synth::random_bytes(5000, 2),
            vec![7u8; 1],
            Vec::new(),
        ];
        for period in 1..40 {
            let pattern: Vec<u8> = (0..period).map(|_| rng.gen()).collect();
            inputs.push(
                pattern
                    .iter()
                    .cycle()
                    .take(3000 + period)
                    .copied()
                    .collect(),
            );
        }
        for raw in &inputs {
            let stored = lz4_flex::block::compress(raw);
            agree_with_lz4_flex(&stored, raw.len());
            // Wrong raw lengths.
            for delta in [1usize, 7, 100] {
                agree_with_lz4_flex(&stored, raw.len() + delta);
                agree_with_lz4_flex(&stored, raw.len().saturating_sub(delta));
            }
            // Truncations and byte damage.
            for _ in 0..50 {
                let cut = rng.gen_range(0..=stored.len());
                agree_with_lz4_flex(&stored[..cut], raw.len());
                let mut damaged = stored.clone();
                if !damaged.is_empty() {
                    let at = rng.gen_range(0..damaged.len());
                    damaged[at] ^= 1 << rng.gen_range(0..8);
                    agree_with_lz4_flex(&damaged, raw.len());
                }
            }
        }
        // Hand-made sequences: zero offset, offset before the start, overlong lengths.
        agree_with_lz4_flex(&[0x14, b'a', 0, 0, 0x00], 6); // offset 0
        agree_with_lz4_flex(&[0x14, b'a', 2, 0, 0x00], 6); // offset 2 > 1 byte produced
        agree_with_lz4_flex(&[0xf0, 0xff, 0xff, 0x10], 1000); // literal length past the input
        agree_with_lz4_flex(&[0x1f, b'a', 1, 0, 0xff, 0xff, 0xff, 0x10, 0x00], 20); // match too long
        agree_with_lz4_flex(&[0x10, b'a'], 1); // literal-only
        agree_with_lz4_flex(&[0x00], 0); // empty block
        agree_with_lz4_flex(&[0x14, b'a', 1, 0], 6); // ends after a match
        for _ in 0..20_000 {
            let n = rng.gen_range(0..40);
            let garbage: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            agree_with_lz4_flex(&garbage, rng.gen_range(0..300));
        }
    }

    /// The two-phase model must give the one-phase model's status, count and bytes (poisoned buffers:
    /// no byte past `produced` may change), and agree with lz4_flex.
    fn two_phase_agrees(stored: &[u8], raw_bytes: usize, misalign: usize) {
        let mut one = vec![0xA5u8; raw_bytes];
        let one_result = lz4_decode_transcribed(stored, &mut one);
        let mut two = vec![0xA5u8; raw_bytes];
        let two_result = lz4_decode_two_phase_transcribed(stored, &mut two, misalign);
        assert_eq!(
            two_result,
            one_result,
            "{} stored bytes, {raw_bytes} raw, misalign {misalign}",
            stored.len()
        );
        assert!(
            two == one,
            "bytes differ from the one-phase model ({} stored bytes, {raw_bytes} raw)",
            stored.len()
        );
        let mut cpu = vec![0u8; raw_bytes];
        match lz4_flex::block::decompress_into(stored, &mut cpu) {
            Ok(n) if n == raw_bytes => {
                assert_eq!(two_result, (Lz4Status::Ok, raw_bytes));
                assert!(two == cpu, "bytes differ from lz4_flex");
            }
            Ok(n) => assert_eq!(two_result, (Lz4Status::SizeMismatch, n)),
            Err(e) => assert_ne!(two_result.0, Lz4Status::Ok, "lz4_flex rejected ({e})"),
        }
    }

    /// Blocks of every kind the GPU tests use: zipf tokens (plain and byte-shuffled), ReLU-sparse fp16,
    /// noise, zeros, short and long periods, back-references of every distance, literal-only runs.
    fn two_phase_inputs(rng: &mut rand::rngs::StdRng) -> Vec<Vec<u8>> {
        let zipf = crate::synth::zipf_tokens_i32(16_384, 31);
        let mut zipf_shuffled = vec![0u8; zipf.len()];
        crate::decode::shuffle(&zipf, 4, &mut zipf_shuffled);
        let relu = relu_sparse_f16(32_768, 32);
        let mut relu_shuffled = vec![0u8; relu.len()];
        crate::decode::shuffle(&relu, 2, &mut relu_shuffled);
        let mut inputs = vec![
            zipf,
            zipf_shuffled,
            relu,
            relu_shuffled,
            crate::synth::zipf_tokens_i32(700, 33),
            crate::synth::random_bytes(70_000, 34),
            crate::synth::random_bytes(300, 35),
            vec![0u8; 70_000],
            vec![0u8; 17],
            b"abcabcabcabcabcabcabcabcabcabcabcabcabcabcabcabc".repeat(300),
            vec![7u8; 1],
            Vec::new(),
        ];
        for period in (1..40).chain([63, 64, 65, 100]) {
            let pattern: Vec<u8> = (0..period).map(|_| rng.gen()).collect();
            let n = 3000 + period;
            inputs.push(pattern.iter().cycle().take(n).copied().collect());
        }
        // Repeats from every distance, noise and zero runs, as in the GPU tests.
        for size in [70_000usize, 20_000, 4_000] {
            let mut out: Vec<u8> = Vec::with_capacity(size);
            while out.len() < size {
                match rng.gen_range(0..3) {
                    0 if !out.is_empty() => {
                        let back = rng.gen_range(1..=out.len().min(65_535));
                        let n = rng.gen_range(4..600);
                        let start = out.len() - back;
                        for k in 0..n {
                            out.push(out[start + k]);
                        }
                    }
                    1 => out.extend(crate::synth::random_bytes(rng.gen_range(1..300), rng.gen())),
                    _ => out.extend(std::iter::repeat_n(0u8, rng.gen_range(1..2000))),
                }
            }
            out.truncate(size);
            inputs.push(out);
        }
        inputs
    }

    #[test]
    fn lz4_two_phase_transcription_agrees_with_the_one_phase_model_and_lz4_flex() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(41);
        let inputs = two_phase_inputs(&mut rng);
        for (i, raw) in inputs.iter().enumerate() {
            let stored = lz4_flex::block::compress(raw);
            for misalign in [0, 1, 9, 15] {
                two_phase_agrees(&stored, raw.len(), (misalign + i) % 16);
            }
            // Wrong raw lengths: the output ends inside a chunk, at a chunk's end, or far beyond.
            for delta in [1usize, 4, 7, 100, 1000, 20_000] {
                two_phase_agrees(&stored, raw.len() + delta, i % 16);
                if delta <= raw.len() {
                    two_phase_agrees(&stored, raw.len() - delta, i % 16);
                }
            }
            // Truncations and byte damage: faults in the fast parse's records, found by validation.
            let damage = if raw.len() > 10_000 { 12 } else { 40 };
            for _ in 0..damage {
                let cut = rng.gen_range(0..=stored.len());
                two_phase_agrees(&stored[..cut], raw.len(), rng.gen_range(0..16));
                if !stored.is_empty() {
                    let mut damaged = stored.clone();
                    let at = rng.gen_range(0..damaged.len());
                    damaged[at] ^= 1 << rng.gen_range(0..8);
                    two_phase_agrees(&damaged, raw.len(), rng.gen_range(0..16));
                    // Several flips: more than one bad record in a chunk.
                    for _ in 0..3 {
                        let at = rng.gen_range(0..damaged.len());
                        damaged[at] = rng.gen();
                    }
                    two_phase_agrees(&damaged, raw.len(), rng.gen_range(0..16));
                }
            }
        }
        // One field of one sequence made wrong, at several places in a chunk: offsets of 0, one and two
        // past the match start (the first bytes before the output), the largest; raw lengths ending
        // inside a sequence's literals, at its match start, one byte short of its end.
        for raw in [&inputs[0], &inputs[2], &inputs[3]] {
            let stored = lz4_flex::block::compress(raw);
            let sequences = lz4_sequences(&stored);
            assert_eq!(sequences.last().map(|s| s.end), Some(raw.len()));
            let n = sequences.len();
            for k in [0, 1, 5, 30, 31, 32, 33, 63, 64, 100, n / 2, n - 2] {
                let sequence = sequences[k];
                let at = sequence.offset_at.expect("not the last sequence");
                let ms = sequence.match_start;
                for offset in [0, ms + 1, ms + 2, 65_535] {
                    if offset > 65_535 || (offset <= ms && offset != 0) {
                        continue;
                    }
                    let mut damaged = stored.clone();
                    damaged[at..at + 2].copy_from_slice(&(offset as u16).to_le_bytes());
                    two_phase_agrees(&damaged, raw.len(), k % 16);
                }
                for raw_bytes in [ms.saturating_sub(1), ms, ms + 1, sequence.end - 1] {
                    two_phase_agrees(&stored, raw_bytes, k % 16);
                }
            }
        }
        // Literal-only blocks around the length classes: no extension, one byte, 255-byte chains, runs
        // longer than the window.
        for n in [
            1usize, 14, 15, 16, 269, 270, 271, 284, 285, 1000, 1023, 1024, 1040, 3000,
        ] {
            let raw = crate::synth::random_bytes(n, n as u64);
            let mut stored = Vec::new();
            if n < 15 {
                stored.push((n as u8) << 4);
            } else {
                stored.push(0xf0);
                let mut rest = n - 15;
                while rest >= 255 {
                    stored.push(255);
                    rest -= 255;
                }
                stored.push(rest as u8);
            }
            stored.extend_from_slice(&raw);
            for misalign in 0..16 {
                two_phase_agrees(&stored, n, misalign);
                two_phase_agrees(&stored, n + 1, misalign);
                two_phase_agrees(&stored[..stored.len() - 1], n, misalign);
            }
        }
        // Overlapping matches of every short offset, with match lengths of one, two and many extension
        // bytes, after literal runs of every extension class.
        for offset in 1..=40u16 {
            for lits in [offset as usize, offset as usize + 15, offset as usize + 300] {
                let pattern = crate::synth::random_bytes(lits, rng.gen());
                let mlen = rng.gen_range(19..3000usize);
                let mut stored = Vec::new();
                stored.push((lits.min(15) as u8) << 4 | 0x0f);
                if lits >= 15 {
                    let mut rest = lits - 15;
                    while rest >= 255 {
                        stored.push(255);
                        rest -= 255;
                    }
                    stored.push(rest as u8);
                }
                stored.extend_from_slice(&pattern);
                stored.extend_from_slice(&offset.to_le_bytes());
                let mut rest = mlen - 19;
                while rest >= 255 {
                    stored.push(255);
                    rest -= 255;
                }
                stored.push(rest as u8);
                stored.push(0x50);
                stored.extend_from_slice(b"tail!");
                two_phase_agrees(&stored, lits + mlen + 5, offset as usize);
                two_phase_agrees(&stored, lits + mlen + 4, offset as usize);
            }
        }
        // Hand-made faults, then garbage.
        for (stored, raw_bytes) in [
            (&[0x14, b'a', 0, 0, 0x00][..], 6),
            (&[0x14, b'a', 2, 0, 0x00], 6),
            (&[0x0f, 0xff, 0xff, 0x00, 0x00], 64),
            (&[0xf0, 0xff, 0xff, 0x10], 1000),
            (&[0xf0, 0xff, 0xff, 0xff], 1 << 20),
            (&[0x1f, b'a', 1, 0, 0xff, 0xff, 0xff, 0x10, 0x00], 20),
            (&[0x10, b'a'], 1),
            (&[0x00], 0),
            (&[0x14, b'a', 1, 0], 6),
            (&[0x14, b'a', 1], 6),
            (&[], 0),
        ] {
            for misalign in 0..16 {
                two_phase_agrees(stored, raw_bytes, misalign);
            }
        }
        for _ in 0..20_000 {
            let n = rng.gen_range(0..64);
            let garbage: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            two_phase_agrees(&garbage, rng.gen_range(0..512), rng.gen_range(0..16));
        }
    }

    #[test]
    fn lz4_two_phase_period_step_divides_exactly() {
        // The copy moves a match byte back by floor(t / offset) + 1 periods with a multiply by
        // ceil(1024 / offset) and a shift: exact for every t and offset below 32.
        for offset in 1..32u32 {
            let inverse = (1023 + offset) / offset;
            for t in 0..32u32 {
                assert_eq!((t * inverse) >> 10, t / offset, "t {t}, offset {offset}");
            }
        }
    }

    #[test]
    fn lz4_kernel_constants_match_the_two_phase_transcription() {
        let source = super::super::LZ4_SOURCE.source;
        let define = |name: &str| -> u64 {
            let line = source
                .lines()
                .find(|l| l.split_whitespace().take(2).eq(["#define", name]))
                .unwrap_or_else(|| panic!("the kernel defines {name}"));
            let value = line.split_whitespace().nth(2).expect("a value");
            value
                .trim_end_matches('u')
                .parse()
                .expect("a decimal value")
        };
        assert_eq!(define("GF_WINDOW_BYTES"), LZ4_WINDOW_BYTES as u64);
        assert_eq!(define("GF_TP_FAST_HEADER"), LZ4_TP_FAST_HEADER as u64);
        assert_eq!(define("GF_TP_REFILL_AHEAD"), LZ4_TP_REFILL_AHEAD as u64);
        assert_eq!(
            define("GF_TP_FAST_SEQUENCE_MAX"),
            LZ4_TP_FAST_SEQUENCE_MAX as u64
        );
        assert_eq!(define("GF_TP_SRC_INPUT"), SRC_INPUT as u64);
        assert_eq!(define("GF_TP_SRC_OUTPUT"), SRC_OUTPUT as u64);
    }

    fn xxh3_agrees(input: &[u8]) {
        assert_eq!(
            xxh3_64_transcribed(input),
            xxhash_rust::xxh3::xxh3_64(input),
            "{} bytes",
            input.len()
        );
    }

    #[test]
    fn xxh3_transcription_matches_xxhash_rust_for_every_length_class() {
        let data = crate::synth::random_bytes(200_000, 21);
        // 0, 1-3, 4-8, 9-16, 17-128, 129-240, and the long path's first two blocks, at two offsets.
        for len in 0..=2113 {
            xxh3_agrees(&data[..len]);
            xxh3_agrees(&data[7..7 + len]);
        }
        // Around every 1 KiB boundary up to 70 KiB: where the number of scrambles, the partial block's
        // stripe count and the last stripe's overlap with it change.
        for k in 1..=70usize {
            for delta in [-65i64, -64, -63, -1, 0, 1, 63, 64, 65] {
                let len = (k as i64 * 1024 + delta) as usize;
                xxh3_agrees(&data[..len]);
            }
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(23);
        for _ in 0..400 {
            let len = rng.gen_range(0..70_000);
            let start = rng.gen_range(0..=data.len() - len);
            xxh3_agrees(&data[start..start + len]);
        }
        // Inputs that are not random: zeros and ones.
        for len in [0, 3, 8, 16, 128, 240, 241, 1024, 1025, 65536] {
            xxh3_agrees(&vec![0u8; len]);
            xxh3_agrees(&vec![0xffu8; len]);
        }
    }

    #[test]
    fn xxh3_transcription_gives_the_same_hash_for_every_group_size() {
        let data = crate::synth::random_bytes(70_000, 22);
        for len in [
            241,
            1024,
            1025,
            4096,
            4097,
            5 * 1024 + 1,
            9 * 1024 + 1,
            65536,
            70_000,
        ] {
            let expected = xxhash_rust::xxh3::xxh3_64(&data[..len]);
            for group in 1..=8 {
                assert_eq!(
                    xxh3_64_transcribed_with_group(&data[..len], group),
                    expected,
                    "{len} bytes, {group} blocks per step"
                );
            }
        }
    }

    #[test]
    fn xxh3_kernel_secret_table_is_the_default_secret() {
        let source = super::super::XXH3_SOURCE.source;
        let start = source
            .find("gf_xxh3_secret[24] = {")
            .expect("the kernel declares its secret table");
        let body = &source[start..];
        let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
        let words: Vec<u64> = body
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| {
                let hex = t.strip_prefix("0x").and_then(|t| t.strip_suffix("ull"));
                u64::from_str_radix(hex.expect("0x...ull literals"), 16).expect("a hex word")
            })
            .collect();
        assert_eq!(words, xxh3_secret_words());
    }

    #[test]
    fn xxh3_verify_transcription_reports_mismatches_and_bad_jobs() {
        let src = crate::synth::random_bytes(10_000, 24);
        let sum = |range: std::ops::Range<usize>| xxhash_rust::xxh3::xxh3_64(&src[range]);
        let jobs = [
            Xxh3Job {
                src_offset: 100,
                bytes: 5000,
                expected: sum(100..5100),
            },
            Xxh3Job {
                src_offset: 3,
                bytes: 17,
                expected: sum(3..20) ^ 1,
            },
            Xxh3Job {
                src_offset: 10_000,
                bytes: 0,
                expected: sum(0..0),
            },
            Xxh3Job {
                src_offset: 9_999,
                bytes: 2,
                expected: 0,
            },
            Xxh3Job {
                src_offset: u64::MAX,
                bytes: 1,
                expected: 0,
            },
        ];
        let outcomes = xxh3_verify_transcribed(&jobs, &src);
        let expected = [
            (Xxh3Status::Ok, sum(100..5100)),
            (Xxh3Status::Mismatch, sum(3..20)),
            (Xxh3Status::Ok, sum(0..0)),
            (Xxh3Status::BadJob, 0),
            (Xxh3Status::BadJob, 0),
        ];
        let got: Vec<(Xxh3Status, u64)> = outcomes.iter().map(|o| (o.status, o.hash)).collect();
        assert_eq!(got, expected);
    }
}
