//! Read-only memory maps of files that another process may truncate while they are mapped.
//!
//! Reading a page of a file mapping that lies wholly beyond the file's end raises `SIGBUS`, whose
//! default action kills the process. Shards are immutable once packed, but `cp` or
//! `rsync --inplace` over a served dataset truncates its shards in place, and a pack input saved
//! again (`np.save`) shrinks under the packer: without this module either took the daemon down,
//! and with it every stream of the node.
//!
//! Every map of a file that the daemon reads through the CPU is a [`MappedFile`]. Each registers its
//! address range in a bounded, lock-free table, and a process-wide `SIGBUS` handler (installed once,
//! by the first map) looks the faulting address up in it. Inside a registered range, the handler maps
//! a page of anonymous zeros over the faulting page and marks the mapping truncated, then returns, so
//! the access that faulted completes, reading zeros. Readers call [`MappedFile::check`] after they
//! copied or verified bytes from the mapping and before anything they read is used: it fails when
//! the mark is set or the file is now shorter, or was modified, since it was mapped, so nothing read
//! from a file that changed under the map is served. (A file cut short inside a page reads zeros past
//! its new end without a fault: the size check catches that.) A `SIGBUS` at any other address goes
//! to the handler installed before ours (the Rust runtime's, which reports stack overflows) or, if
//! there was none, to the default action: a real crash stays a crash.
//!
//! The table holds [`MAPPINGS_MAX`] mappings: a map beyond that fails with an error that says so,
//! and callers fall back to reading the file (or fail, naming it).

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::Once;

use memmap2::Mmap;

/// Mappings registered at once, at most: the kernel's default `vm.max_map_count` (65530) bounds the
/// mappings of a process near the same number, so the table is not what runs out first.
pub const MAPPINGS_MAX: usize = 1 << 16;

/// State of a slot: the low two bits are the tag, the rest a generation counter that changes at
/// every claim, so that the handler can tell a slot it read consistently from one that changed
/// while it read it (a sequence lock).
const TAG_FREE: u64 = 0;
const TAG_BUSY: u64 = 1;
const TAG_LIVE: u64 = 2;
const TAG_MASK: u64 = 3;

/// One registered mapping: its address range, and whether the handler found it truncated.
struct Slot {
    state: AtomicU64,
    start: AtomicUsize,
    len: AtomicUsize,
    truncated: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)] // Only used to initialise the static table.
const SLOT_INIT: Slot = Slot {
    state: AtomicU64::new(TAG_FREE),
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    truncated: AtomicU64::new(0),
};

/// The table of registered mappings (zero-initialised: it costs memory only where used).
static SLOTS: [Slot; MAPPINGS_MAX] = [SLOT_INIT; MAPPINGS_MAX];
/// One past the highest slot ever claimed: the handler scans no further.
static SLOTS_USED: AtomicUsize = AtomicUsize::new(0);
/// Where the next claim starts looking for a free slot: at or below the lowest free slot, so that
/// live slots stay packed at the start of the table and the handler's scan stays as short as the
/// number of maps alive at once (a handler scanning the whole table at every fault of a large
/// truncated range would take a long time).
static CLAIM_HINT: AtomicUsize = AtomicUsize::new(0);
/// The page size, read once when the handler is installed (the handler calls nothing to find it).
static PAGE_BYTES: AtomicUsize = AtomicUsize::new(4096);
/// The `SIGBUS` action in place before ours (leaked, written once before ours is installed).
static PREVIOUS_ACTION: AtomicPtr<libc::sigaction> = AtomicPtr::new(std::ptr::null_mut());
/// Pages the handler has mapped zeros over, since the process started (for tests and logs).
static ZERO_PAGES_MAPPED: AtomicU64 = AtomicU64::new(0);
static INSTALL: Once = Once::new();
/// Why installing the handler failed, if it did (then no file is mapped: see [`MappedFile::map`]).
static INSTALL_ERROR: std::sync::OnceLock<i32> = std::sync::OnceLock::new();

/// Pages of registered mappings that the `SIGBUS` handler has replaced with zeros since the process
/// started.
pub fn zero_pages_mapped() -> u64 {
    ZERO_PAGES_MAPPED.load(Ordering::Relaxed)
}

/// How a file changed under its map.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MapChange {
    /// A read reached a page beyond the file's end: the file was truncated while mapped.
    #[error("the file was truncated while it was read (a read reached past its new end)")]
    Faulted,
    /// The file is shorter (or longer) than when it was mapped.
    #[error("the file is {now_bytes} bytes, {mapped_bytes} when it was opened: it was rewritten while it was read")]
    Length {
        /// Its length when it was mapped.
        mapped_bytes: u64,
        /// Its length now.
        now_bytes: u64,
    },
    /// The file's modification time changed since it was mapped: its bytes may have.
    #[error("the file was modified while it was read")]
    Modified,
    /// The file could not be examined.
    #[error("the file cannot be examined: {0}")]
    Stat(String),
}

/// A read-only map of a whole file, registered with the `SIGBUS` handler (see the module
/// documentation): a read beyond the end of the file, if it is truncated while mapped, reads zeros
/// instead of killing the process, and [`MappedFile::check`] then fails.
pub struct MappedFile {
    map: Mmap,
    /// The slot of this mapping in the table; `None` for an empty file (nothing is mapped).
    slot: Option<usize>,
    /// The file's length and modification time (nanoseconds) when it was mapped.
    mapped_bytes: u64,
    modified_ns: i128,
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MappedFile({} bytes)", self.map.len())
    }
}

fn modified_ns(metadata: &std::fs::Metadata) -> i128 {
    i128::from(metadata.mtime()) * 1_000_000_000 + i128::from(metadata.mtime_nsec())
}

impl MappedFile {
    /// Maps `file` read-only and registers the mapping (installing the `SIGBUS` handler on first
    /// use). Fails if the file cannot be mapped, the handler cannot be installed or [`MAPPINGS_MAX`]
    /// mappings are registered already.
    pub fn map(file: &File) -> io::Result<MappedFile> {
        install_handler()?;
        let metadata = file.metadata()?;
        // SAFETY: a read-only, shared mapping that this process never writes through. The hazard of
        // such a mapping, another process truncating the file while it is mapped, is handled: the
        // range is registered below, before any byte of it is read, so a read beyond the new end
        // of the file reads zeros (the SIGBUS handler) and `check` reports it. A file modified in
        // place may change the bytes under a reader: `check` reports that by its modification time.
        let map = unsafe { Mmap::map(file)? };
        let slot = if map.is_empty() {
            None
        } else {
            Some(claim_slot(map.as_ptr() as usize, map.len()).ok_or_else(|| {
                io::Error::other(format!(
                    "more than {MAPPINGS_MAX} files are mapped at once: not mapping another"
                ))
            })?)
        };
        Ok(MappedFile {
            map,
            slot,
            mapped_bytes: metadata.len(),
            modified_ns: modified_ns(&metadata),
        })
    }

    /// The mapped bytes. A read of them may return zeros where the file was truncated since it was
    /// mapped: call [`Self::check`] after reading and before using what was read.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The length of the mapping (the file's length when it was mapped).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True for an empty file.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Whether a read of this mapping reached beyond the end of the file (one atomic load: cheap
    /// enough to ask after every read).
    pub fn faulted(&self) -> bool {
        self.slot
            .is_some_and(|slot| SLOTS[slot].truncated.load(Ordering::Acquire) != 0)
    }

    /// Whether the bytes read from this mapping so far are the file's bytes as mapped: fails when a
    /// read reached beyond the end of the file, or `file` (the file mapped) now has another length or
    /// modification time. One `fstat`.
    pub fn check(&self, file: &File) -> Result<(), MapChange> {
        if self.faulted() {
            return Err(MapChange::Faulted);
        }
        let metadata = file
            .metadata()
            .map_err(|error| MapChange::Stat(error.to_string()))?;
        if metadata.len() != self.mapped_bytes {
            return Err(MapChange::Length {
                mapped_bytes: self.mapped_bytes,
                now_bytes: metadata.len(),
            });
        }
        if modified_ns(&metadata) != self.modified_ns {
            return Err(MapChange::Modified);
        }
        // A fault between the first test and the fstat: the file is the same length, but some read
        // found it shorter meanwhile.
        if self.faulted() {
            return Err(MapChange::Faulted);
        }
        Ok(())
    }

    /// Advises the kernel that `len` bytes at `offset` will be read soon (best effort).
    pub fn advise_will_need(&self, offset: usize, len: usize) {
        let _ = self
            .map
            .advise_range(memmap2::Advice::WillNeed, offset, len);
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        // The slot goes first, then the mapping (when `map` drops after this): a fault can only come
        // from a read of the mapping, and none is possible while it is being dropped.
        if let Some(slot) = self.slot {
            release_slot(slot);
        }
    }
}

/// Claims a free slot for `start .. start + len`; `None` when all are taken.
fn claim_slot(start: usize, len: usize) -> Option<usize> {
    let hint = CLAIM_HINT.load(Ordering::Relaxed).min(MAPPINGS_MAX - 1);
    for step in 0..MAPPINGS_MAX {
        let index = (hint + step) % MAPPINGS_MAX;
        let slot = &SLOTS[index];
        let state = slot.state.load(Ordering::Relaxed);
        if state & TAG_MASK != TAG_FREE {
            continue;
        }
        let generation = (state >> 2).wrapping_add(1);
        if slot
            .state
            .compare_exchange(
                state,
                generation << 2 | TAG_BUSY,
                Ordering::Acquire,
                Ordering::Relaxed,
            )
            .is_err()
        {
            continue;
        }
        slot.start.store(start, Ordering::Relaxed);
        slot.len.store(len, Ordering::Relaxed);
        slot.truncated.store(0, Ordering::Relaxed);
        SLOTS_USED.fetch_max(index + 1, Ordering::Release);
        // Release: the handler that sees the slot live sees its range.
        slot.state
            .store(generation << 2 | TAG_LIVE, Ordering::Release);
        // Slots below `index` were taken when the scan passed them (or freed since, which lowered
        // the hint again).
        let _ = CLAIM_HINT.compare_exchange(hint, index + 1, Ordering::Relaxed, Ordering::Relaxed);
        return Some(index);
    }
    None
}

fn release_slot(index: usize) {
    let slot = &SLOTS[index];
    let state = slot.state.load(Ordering::Relaxed);
    debug_assert_eq!(state & TAG_MASK, TAG_LIVE);
    slot.state
        .store((state & !TAG_MASK) | TAG_FREE, Ordering::Release);
    CLAIM_HINT.fetch_min(index, Ordering::Relaxed);
}

/// The live slot whose range holds `address`, read consistently (see [`TAG_MASK`]).
fn slot_holding(address: usize) -> Option<usize> {
    let used = SLOTS_USED.load(Ordering::Acquire);
    for (index, slot) in SLOTS[..used].iter().enumerate() {
        let before = slot.state.load(Ordering::Acquire);
        if before & TAG_MASK != TAG_LIVE {
            continue;
        }
        let start = slot.start.load(Ordering::Relaxed);
        let len = slot.len.load(Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Acquire);
        if slot.state.load(Ordering::Relaxed) != before {
            continue;
        }
        if address >= start && address - start < len {
            return Some(index);
        }
    }
    None
}

/// Installs the `SIGBUS` handler once for the process; fails (every time) if that failed.
fn install_handler() -> io::Result<()> {
    INSTALL.call_once(|| {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page > 0 {
            PAGE_BYTES.store(page as usize, Ordering::Relaxed);
        }
        // SAFETY: all-zero is a valid `sigaction` (no handler, no flags, an empty mask).
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_sigbus as *const () as usize;
        // SA_ONSTACK: a thread with an alternate signal stack (the Rust runtime gives its threads one,
        // for stack overflows) handles the fault there.
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        // SAFETY: sigemptyset initialises the mask we own.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        let previous: *mut libc::sigaction = Box::into_raw(Box::new(
            // SAFETY: as above, all-zero is a valid `sigaction`, overwritten by the call below.
            unsafe { std::mem::zeroed::<libc::sigaction>() },
        ));
        // The previous action is stored before ours is installed, so the handler always finds it.
        // SAFETY: sigaction reads `action` and writes the previous action into `previous`, both
        // valid; `previous` is leaked on purpose: the handler reads it for the process's life.
        let result = unsafe {
            let got = libc::sigaction(libc::SIGBUS, std::ptr::null(), previous);
            if got == 0 {
                PREVIOUS_ACTION.store(previous, Ordering::Release);
                libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut())
            } else {
                got
            }
        };
        if result != 0 {
            let _ = INSTALL_ERROR.set(io::Error::last_os_error().raw_os_error().unwrap_or(0));
        }
    });
    match INSTALL_ERROR.get() {
        Some(&errno) => Err(io::Error::new(
            io::Error::from_raw_os_error(errno).kind(),
            format!(
                "installing the SIGBUS handler that guards file maps failed: {}",
                io::Error::from_raw_os_error(errno)
            ),
        )),
        None => Ok(()),
    }
}

/// The `SIGBUS` handler.
///
/// # Safety
///
/// Called by the kernel only, with the `siginfo_t` of the fault. It is async-signal-safe: it
/// touches only atomics and static memory (no allocation, no lock), and calls `mmap`, `sigaction`
/// and `raise`, each one system call on Linux. Mapping zeros over the faulting page is sound
/// because the page lies inside a mapping registered by a live [`MappedFile`] (the thread that
/// faulted is reading it, so it cannot be dropped meanwhile), that mapping is read-only and
/// private to this process's view, and nothing can have borrowed the page's bytes mutably. A
/// fault anywhere else is handed on unchanged.
extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo_t to an SA_SIGINFO handler.
    let address = unsafe { (*info).si_addr() } as usize;
    if let Some(index) = slot_holding(address) {
        let page_bytes = PAGE_BYTES.load(Ordering::Relaxed);
        let page = address & !(page_bytes - 1);
        // SAFETY: see the function's `# Safety`: the page lies within a live registered mapping;
        // MAP_FIXED replaces that page only.
        let mapped = unsafe {
            libc::mmap(
                page as *mut libc::c_void,
                page_bytes,
                libc::PROT_READ,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if mapped != libc::MAP_FAILED {
            SLOTS[index].truncated.store(1, Ordering::Release);
            ZERO_PAGES_MAPPED.fetch_add(1, Ordering::Relaxed);
            // Returning retries the access, which now reads zeros.
            return;
        }
    }
    let previous = PREVIOUS_ACTION.load(Ordering::Acquire);
    if !previous.is_null() {
        // SAFETY: written once before this handler was installed and never freed.
        let previous = unsafe { &*previous };
        let handler = previous.sa_sigaction;
        if handler != libc::SIG_DFL && handler != libc::SIG_IGN {
            if previous.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: the previous handler was installed with SA_SIGINFO, so it has this
                // signature; it is called as the kernel would have called it.
                let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(handler) };
                handler(signal, info, context);
            } else {
                // SAFETY: a handler installed without SA_SIGINFO takes the signal number only.
                let handler: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
                handler(signal);
            }
            return;
        }
    }
    // No one else handles it: the default action (terminate with a core dump), as if no handler had
    // been installed. Returning from a fault retries the access, which faults again; a SIGBUS sent
    // by `kill` is raised again, pending until this handler returns.
    // SAFETY: all-zero with SIG_DFL is a valid action; sigaction and raise are async-signal-safe.
    unsafe {
        let mut default: libc::sigaction = std::mem::zeroed();
        default.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(libc::SIGBUS, &default, std::ptr::null_mut());
        libc::raise(libc::SIGBUS);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_of(dir: &tempfile::TempDir, name: &str, bytes: usize) -> (std::path::PathBuf, File) {
        let path = dir.path().join(name);
        let mut file = File::create(&path).unwrap();
        let pattern: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8 + 1).collect();
        file.write_all(&pattern).unwrap();
        (path.clone(), File::open(&path).unwrap())
    }

    /// The handler itself: reading pages of a map beyond the end of a file truncated while mapped
    /// killed the process with SIGBUS; it now reads zeros, and the map reports the truncation.
    #[test]
    fn a_read_beyond_a_truncated_end_reads_zeros_and_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let (path, file) = file_of(&dir, "shard", 64 << 10);
        let map = MappedFile::map(&file).unwrap();
        assert!(map.check(&file).is_ok());
        let before = map.bytes()[40 << 10];
        assert_ne!(before, 0);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(8 << 10)
            .unwrap();
        // Beyond the new end: a SIGBUS, turned into zeros.
        let after: u64 = map.bytes()[16 << 10..].iter().map(|&b| u64::from(b)).sum();
        assert_eq!(after, 0);
        assert!(map.faulted());
        assert_eq!(map.check(&file), Err(MapChange::Faulted));
        // Within the new end the file's bytes are still there.
        assert_eq!(map.bytes()[100], 101);
        assert!(zero_pages_mapped() >= 1);
    }

    /// A file cut inside a page reads zeros past its end without a fault: the length check says so.
    #[test]
    fn a_shrink_within_a_page_is_found_by_its_length() {
        let dir = tempfile::tempdir().unwrap();
        let (path, file) = file_of(&dir, "input", 4000);
        let map = MappedFile::map(&file).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(2000)
            .unwrap();
        assert_eq!(map.bytes()[3000], 0);
        assert!(!map.faulted());
        assert_eq!(
            map.check(&file),
            Err(MapChange::Length {
                mapped_bytes: 4000,
                now_bytes: 2000
            })
        );
    }

    /// A real crash stays a crash: a SIGBUS at an address no registered map holds (here a plain map
    /// of a truncated file) still kills the process, with SIGBUS.
    #[test]
    fn a_fault_outside_registered_maps_still_kills_the_process() {
        let dir = tempfile::tempdir().unwrap();
        let (path, file) = file_of(&dir, "plain", 64 << 10);
        let registered = MappedFile::map(&file).unwrap();
        // SAFETY: a read-only map, read only by the child below, which is meant to die of it.
        let plain = unsafe { Mmap::map(&file) }.unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4096)
            .unwrap();
        // SAFETY: the child only sets a resource limit, reads memory and exits, all async-signal-safe
        // (it runs no code of the test harness's other threads).
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
        if pid == 0 {
            let no_core = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: setrlimit reads the struct we own; then a volatile read of a live mapping (the
            // fault is the point) and _exit, which never returns.
            unsafe {
                libc::setrlimit(libc::RLIMIT_CORE, &no_core);
                let byte = std::ptr::read_volatile(plain.as_ptr().add(32 << 10));
                libc::_exit(10 + i32::from(byte != 0));
            }
        }
        let mut status = 0;
        // SAFETY: waitpid on our own child, writing into `status`, which we own.
        let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(waited, pid);
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGBUS,
            "the child did not die of SIGBUS: status {status:#x}"
        );
        assert!(
            !registered.faulted(),
            "the fault was not in the registered map"
        );
    }

    /// Slots are given back when maps drop, so maps beyond the table's size over time are fine, and
    /// another mapping's slot is never found for an address outside every live range.
    #[test]
    fn slots_are_reused_and_unknown_addresses_are_not_claimed() {
        let dir = tempfile::tempdir().unwrap();
        let (_, file) = file_of(&dir, "small", 100);
        let map = MappedFile::map(&file).unwrap();
        let inside = map.bytes().as_ptr() as usize + 10;
        let slot = slot_holding(inside).expect("registered");
        assert_eq!(Some(slot), map.slot);
        let live = SLOTS[slot].state.load(Ordering::Acquire);
        drop(map);
        // Freed (or claimed again since by another map, with another generation).
        assert_ne!(SLOTS[slot].state.load(Ordering::Acquire), live);
        let local = 0u8;
        assert_eq!(slot_holding(&local as *const u8 as usize), None);
        for _ in 0..3 {
            let maps: Vec<MappedFile> = (0..64).map(|_| MappedFile::map(&file).unwrap()).collect();
            assert!(maps.iter().all(|m| m.check(&file).is_ok()));
        }
        // Freed slots are claimed again first: the table's used part stays near the most maps alive
        // at once (here 64 and the other tests' few), not the number ever made.
        assert!(SLOTS_USED.load(Ordering::Acquire) < 1024);
        let empty = dir.path().join("empty");
        File::create(&empty).unwrap();
        let empty = MappedFile::map(&File::open(&empty).unwrap()).unwrap();
        assert!(empty.is_empty() && empty.slot.is_none());
    }
}
