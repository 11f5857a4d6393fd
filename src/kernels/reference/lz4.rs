//! The LZ4 kernels transcribed: the one-pass decoder and the two-phase decoder the daemon loads.

use crate::kernels::Lz4Status;

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
pub(super) const SRC_INPUT: u32 = 32;
pub(super) const SRC_OUTPUT: u32 = 33;
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
