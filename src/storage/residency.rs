//! Page-cache residency of file ranges, to choose per read between the cold path (O_DIRECT or cuFile)
//! and the page-cache path (copies straight from a registered mapping).
//!
//! Data read in one epoch is usually still cached in the next; reading it again with O_DIRECT would go
//! back to the disk, and copying it through CPU threads costs a core per ~7 GB/s. Knowing which ranges
//! are resident lets the engine send each read down the cheaper path.

use std::fs::File;
use std::io;

use memmap2::Mmap;

/// A read-only mapping of a whole file, used to ask the kernel which pages are cached.
pub struct ResidencyMap {
    map: Mmap,
    page_bytes: usize,
}

impl ResidencyMap {
    /// Maps `file` read-only. Mapping reads nothing; pages are only touched if someone reads them.
    pub fn new(file: &File) -> io::Result<ResidencyMap> {
        // SAFETY: read-only mapping; gpufeed never modifies shards after their manifest exists, and
        // this mapping is only passed to mincore(2), which does not access the pages.
        let map = unsafe { Mmap::map(file)? };
        // SAFETY: sysconf has no preconditions.
        let page_bytes = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
        Ok(ResidencyMap { map, page_bytes })
    }

    /// Length of the mapped file.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True for an empty file.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Fraction (0.0 to 1.0) of the pages overlapping `offset .. offset + len` that are in the page
    /// cache. A range past the end of the file counts only its part within the file.
    pub fn resident_fraction(&self, offset: usize, len: usize) -> io::Result<f64> {
        let end = offset.saturating_add(len).min(self.map.len());
        if offset >= end {
            return Ok(0.0);
        }
        let first_page = offset / self.page_bytes;
        let last_page = (end - 1) / self.page_bytes;
        let pages = last_page - first_page + 1;
        let mut vector = vec![0u8; pages];
        self.mincore(
            first_page * self.page_bytes,
            end - first_page * self.page_bytes,
            &mut vector,
        )?;
        let resident = vector.iter().filter(|&&v| v & 1 == 1).count();
        Ok(resident as f64 / pages as f64)
    }

    /// As [`Self::resident_fraction`], from one page in every `stride` bytes (the first page of
    /// each stride) for a range longer than two strides: one mincore(2) per sampled page, where one
    /// over the whole range walks every page of it (about 3 ms for 64 MiB of a cached file on a
    /// development VM, against 0.04 ms for 64 samples). For a window judged whole before it is
    /// registered for one copy: a sampled page that is not cached stands for its stride.
    pub fn resident_fraction_sampled(
        &self,
        offset: usize,
        len: usize,
        stride: usize,
    ) -> io::Result<f64> {
        let end = offset.saturating_add(len).min(self.map.len());
        if offset >= end {
            return Ok(0.0);
        }
        let stride = (stride / self.page_bytes).max(1) * self.page_bytes;
        let first = offset / self.page_bytes * self.page_bytes;
        if end - first <= 2 * stride {
            return self.resident_fraction(offset, len);
        }
        let (mut samples, mut resident) = (0u64, 0u64);
        let mut at = first;
        while at < end {
            let mut vector = [0u8];
            self.mincore(at, self.page_bytes, &mut vector)?;
            samples += 1;
            resident += u64::from(vector[0] & 1);
            at += stride;
        }
        Ok(resident as f64 / samples as f64)
    }

    /// mincore(2) over `len` bytes of the mapping from `start` (page-aligned), one byte of
    /// `vector` per page.
    fn mincore(&self, start: usize, len: usize, vector: &mut [u8]) -> io::Result<()> {
        assert!(
            start % self.page_bytes == 0
                && start.saturating_add(len) <= self.map.len().next_multiple_of(self.page_bytes)
                && vector.len() >= len.div_ceil(self.page_bytes),
            "mincore over {len} bytes at {start} outside the mapping or its vector"
        );
        // SAFETY: the range lies within the live mapping (page-aligned start, checked above) and
        // `vector` has a byte per page of it, as mincore(2) requires.
        let result = unsafe {
            libc::mincore(
                self.map.as_ptr().add(start) as *mut libc::c_void,
                len,
                vector.as_mut_ptr(),
            )
        };
        if result != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    #[test]
    fn sampled_residency_agrees_with_the_whole_count_on_a_cached_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut file = File::create(&path).unwrap();
        file.write_all(&vec![7u8; 8 << 20]).unwrap();
        let file = File::open(&path).unwrap();
        let map = ResidencyMap::new(&file).unwrap();
        // Every page was just written: cached, sampled or not, over any range.
        assert_eq!(
            map.resident_fraction_sampled(0, 8 << 20, 1 << 20).unwrap(),
            1.0
        );
        assert_eq!(
            map.resident_fraction_sampled(4096, 5 << 20, 1 << 20)
                .unwrap(),
            1.0
        );
        // Short ranges are counted whole; ranges past the end count their part in the file.
        assert_eq!(
            map.resident_fraction_sampled(0, 8192, 1 << 20).unwrap(),
            1.0
        );
        assert_eq!(
            map.resident_fraction_sampled(7 << 20, 4 << 20, 1 << 20)
                .unwrap(),
            1.0
        );
        assert_eq!(
            map.resident_fraction_sampled(9 << 20, 10, 1 << 20).unwrap(),
            0.0
        );
    }

    #[test]
    fn written_pages_are_resident_and_dropped_pages_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut file = File::create(&path).unwrap();
        file.write_all(&vec![7u8; 1 << 20]).unwrap();
        file.sync_all().unwrap();
        let file = File::open(&path).unwrap();
        let map = ResidencyMap::new(&file).unwrap();
        assert_eq!(map.resident_fraction(0, 1 << 20).unwrap(), 1.0);
        // Clean, synced pages are dropped from the cache on request, except on tmpfs where the cache
        // is the storage.
        // SAFETY: plain syscall on an open descriptor.
        let advised =
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(advised, 0);
        let after = map.resident_fraction(0, 1 << 20).unwrap();
        // SAFETY: fstatfs writes into the zeroed struct we own.
        let mut stat: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: fstatfs on an open descriptor, writing into `stat`, which we own.
        assert_eq!(unsafe { libc::fstatfs(file.as_raw_fd(), &mut stat) }, 0);
        const TMPFS_MAGIC: i64 = 0x0102_1994;
        if stat.f_type as i64 == TMPFS_MAGIC {
            assert_eq!(after, 1.0);
        } else {
            assert_eq!(after, 0.0);
        }
        assert_eq!(map.resident_fraction(2 << 20, 10).unwrap(), 0.0);
    }
}

/// The memory the host has available for new pages now (`MemAvailable` of `/proc/meminfo`), in
/// bytes; `None` where that is unknown.
pub fn available_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod available_tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let meminfo = "MemTotal:       131072000 kB\nMemFree:  1000 kB\nMemAvailable:   65536 kB\n";
        assert_eq!(parse_mem_available(meminfo), Some(65536 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert!(available_memory_bytes().is_some_and(|b| b > 0));
    }
}
