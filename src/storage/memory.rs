//! How much memory the daemon's page cache and pinned buffers may use: the host's RAM, or less where
//! the daemon runs in a memory cgroup (a container's limit, a Kubernetes pod's `limits.memory`, a
//! `memory.max` set by hand). The kernel charges the page cache of the files a process reads to
//! that process's cgroup, so a dataset larger than the cgroup's limit cannot stay cached even on a
//! host with more RAM than the dataset.

/// The memory the daemon may use: the host's RAM, or its memory cgroup's limit where that is
/// lower (cgroup v2 `memory.max` of the daemon's cgroup and of every cgroup above it, or v1
/// `memory.limit_in_bytes`). `None` where neither is known.
///
/// `GPUFEED_MEMORY_LIMIT` (bytes, suffixes K, M, G) in the daemon's environment replaces both:
/// for a daemon that shares its host or cgroup with processes whose memory it should leave alone,
/// and for tests of what a dataset larger than the memory changes.
pub fn memory_limit_bytes() -> Option<u64> {
    memory_limit().map(|(bytes, _)| bytes)
}

/// Where [`memory_limit_bytes`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryLimitSource {
    /// `GPUFEED_MEMORY_LIMIT`.
    Variable,
    /// The host's RAM.
    Ram,
    /// The daemon's memory cgroup (lower than the RAM).
    Cgroup,
}

impl MemoryLimitSource {
    /// The name `/v1/status` shows.
    pub fn name(self) -> &'static str {
        match self {
            MemoryLimitSource::Variable => "GPUFEED_MEMORY_LIMIT",
            MemoryLimitSource::Ram => "ram",
            MemoryLimitSource::Cgroup => "cgroup",
        }
    }
}

/// [`memory_limit_bytes`] and where it came from.
pub fn memory_limit() -> Option<(u64, MemoryLimitSource)> {
    if let Ok(text) = std::env::var("GPUFEED_MEMORY_LIMIT") {
        match parse_bytes(&text) {
            Some(bytes) => return Some((bytes, MemoryLimitSource::Variable)),
            None => tracing::warn!(
                "GPUFEED_MEMORY_LIMIT={text:?} is ignored: not a byte count like 8589934592 or 8G"
            ),
        }
    }
    let ram = host_ram_bytes();
    let cgroup = cgroup_limit_bytes();
    match (ram, cgroup) {
        (Some(ram), Some(cgroup)) if cgroup < ram => Some((cgroup, MemoryLimitSource::Cgroup)),
        (Some(ram), _) => Some((ram, MemoryLimitSource::Ram)),
        (None, Some(cgroup)) => Some((cgroup, MemoryLimitSource::Cgroup)),
        (None, None) => None,
    }
}

/// A byte count: digits, optionally followed by K, M or G (binary multiples).
fn parse_bytes(text: &str) -> Option<u64> {
    let text = text.trim();
    let (digits, shift) = match text.chars().last()? {
        'K' | 'k' => (&text[..text.len() - 1], 10),
        'M' | 'm' => (&text[..text.len() - 1], 20),
        'G' | 'g' => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    let value: u64 = digits.parse().ok()?;
    value.checked_mul(1u64 << shift)
}

/// Physical memory of the host, from `sysconf`.
pub fn host_ram_bytes() -> Option<u64> {
    // SAFETY: sysconf only reads system configuration.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    (pages > 0 && page > 0).then(|| pages as u64 * page as u64)
}

/// The lowest memory limit of the daemon's cgroup and those above it, if any is set.
pub fn cgroup_limit_bytes() -> Option<u64> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_limit_in(
        &membership,
        std::path::Path::new("/sys/fs/cgroup"),
        |path| std::fs::read_to_string(path).ok(),
    )
}

/// [`cgroup_limit_bytes`] given the text of `/proc/self/cgroup`, the cgroup file system's mount
/// point and a way to read its files.
fn cgroup_limit_in(
    membership: &str,
    root: &std::path::Path,
    read: impl Fn(&std::path::Path) -> Option<String>,
) -> Option<u64> {
    let mut lowest: Option<u64> = None;
    let mut lower = |limit: Option<u64>| {
        if let Some(limit) = limit {
            lowest = Some(lowest.map_or(limit, |l| l.min(limit)));
        }
    };
    for line in membership.lines() {
        // `hierarchy-id:controllers:path`; v2's unified hierarchy is `0::/path`.
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let relative = path.trim_start_matches('/');
        if id == "0" && controllers.is_empty() {
            // Every cgroup from the daemon's up to the root: a parent's limit bounds its children.
            let mut dir = root.join(relative);
            loop {
                lower(read(&dir.join("memory.max")).and_then(|text| parse_limit(&text)));
                if dir == root || !dir.pop() || !dir.starts_with(root) {
                    break;
                }
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            let file = root
                .join("memory")
                .join(relative)
                .join("memory.limit_in_bytes");
            lower(read(&file).and_then(|text| parse_limit(&text)));
        }
    }
    lowest
}

/// A limit file's value in bytes; `None` for `max` (v2) or v1's "no limit" (a value near
/// `i64::MAX`, rounded down to the page size).
fn parse_limit(text: &str) -> Option<u64> {
    let text = text.trim();
    if text == "max" {
        return None;
    }
    let bytes: u64 = text.parse().ok()?;
    (bytes < 1 << 62).then_some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::path::{Path, PathBuf};

    fn files(entries: &[(&str, &str)]) -> HashMap<PathBuf, String> {
        entries
            .iter()
            .map(|(p, t)| (PathBuf::from(p), t.to_string()))
            .collect()
    }

    #[test]
    fn the_lowest_limit_from_the_cgroup_up_to_the_root_counts() {
        let fs = files(&[
            ("/cg/memory.max", "max\n"),
            ("/cg/pods/memory.max", "8589934592\n"),
            ("/cg/pods/gpufeed/memory.max", "max\n"),
        ]);
        let read = |p: &Path| fs.get(p).cloned();
        assert_eq!(
            cgroup_limit_in("0::/pods/gpufeed\n", Path::new("/cg"), read),
            Some(8 << 30)
        );
        // The daemon's own limit, lower than its parent's.
        let fs = files(&[
            ("/cg/pods/memory.max", "8589934592\n"),
            ("/cg/pods/gpufeed/memory.max", "4294967296\n"),
        ]);
        let read = |p: &Path| fs.get(p).cloned();
        assert_eq!(
            cgroup_limit_in("0::/pods/gpufeed\n", Path::new("/cg"), read),
            Some(4 << 30)
        );
        // No limit anywhere, or the root cgroup (which has no memory.max).
        let read = |p: &Path| fs.get(p).cloned();
        let none = files(&[("/cg/a/memory.max", "max")]);
        let read_none = |p: &Path| none.get(p).cloned();
        assert_eq!(
            cgroup_limit_in("0::/a\n", Path::new("/cg"), read_none),
            None
        );
        assert_eq!(cgroup_limit_in("0::/\n", Path::new("/cg"), read), None);
    }

    #[test]
    fn cgroup_v1_memory_limits_count_and_their_unlimited_value_does_not() {
        let fs = files(&[
            (
                "/cg/memory/docker/abc/memory.limit_in_bytes",
                "2147483648\n",
            ),
            (
                "/cg/memory/free/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
        ]);
        let read = |p: &Path| fs.get(p).cloned();
        let v1 = "12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n";
        assert_eq!(cgroup_limit_in(v1, Path::new("/cg"), read), Some(2 << 30));
        let read = |p: &Path| fs.get(p).cloned();
        assert_eq!(
            cgroup_limit_in("4:memory:/free\n", Path::new("/cg"), read),
            None
        );
        assert_eq!(parse_limit("garbage"), None);
    }

    #[test]
    fn byte_counts_take_binary_suffixes() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("1M"), Some(1 << 20));
        assert_eq!(parse_bytes(" 8G "), Some(8 << 30));
        assert_eq!(parse_bytes("3k"), Some(3 << 10));
        assert_eq!(parse_bytes("G"), None);
        assert_eq!(parse_bytes("-1"), None);
        assert_eq!(parse_bytes("99999999999999G"), None);
        assert_eq!(parse_bytes(""), None);
    }

    #[test]
    fn the_limit_is_never_above_the_ram() {
        let ram = host_ram_bytes().expect("sysconf reports the RAM");
        assert!(memory_limit_bytes().is_some_and(|limit| limit <= ram));
    }
}
