//! Where a GPU sits among the host's NUMA nodes, and keeping a device's host threads and pinned
//! memory on its node.
//!
//! On a host with several NUMA nodes, each GPU's PCIe root sits on one of them; a copy from pinned
//! memory on the other node crosses the socket interconnect, and threads feeding the device run
//! farther from its memory. The daemon reads a device's node from sysfs (`numa_node` of its PCI
//! function), binds the threads of that device's streams (filler, planners, loader and copy threads,
//! which inherit the filler's or the stream set-up's binding) to the node's CPUs, and allocates a
//! stream's pinned buffers from a thread bound there (the kernel places those pages on the node of
//! the CPU that first touches them). A host with one node, or a device whose node is unknown, is
//! left alone. The page cache itself is where the kernel put it when the files were read: a dataset
//! read by all devices is on one node or spread, whatever the daemon does.

use std::io;
use std::path::Path;

/// A device's NUMA node and the CPUs of that node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaPlacement {
    /// The node.
    pub node: u32,
    /// Its CPUs (from `cpulist`), at least one.
    pub cpus: Vec<usize>,
}

/// Parses a kernel CPU list such as `0-7,16-23` (shared with the interrupt-CPU finder).
pub use gpufeed_proto::affinity::parse_cpulist;

/// The PCI address sysfs names a function by, `dddd:bb:dd.0`, from the driver's domain, bus and
/// device numbers.
pub fn pci_address(domain: u32, bus: u32, device: u32) -> String {
    format!("{domain:04x}:{bus:02x}:{device:02x}.0")
}

/// The NUMA placement of the PCI function `address` under the sysfs root `sysfs` (`/sys` on a real
/// host): `Ok(None)` when the host has one node or fewer, or the kernel does not know the
/// function's node (`-1`); an error when the files are missing or malformed.
pub fn placement_of(sysfs: &Path, address: &str) -> Result<Option<NumaPlacement>, String> {
    let nodes_dir = sysfs.join("devices/system/node");
    let nodes = match std::fs::read_dir(&nodes_dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok())
            .filter(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                name.strip_prefix("node")
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
            .count(),
        // No NUMA information: one node as far as we can tell.
        Err(error) if error.kind() == io::ErrorKind::NotFound => 0,
        Err(error) => return Err(format!("{}: {error}", nodes_dir.display())),
    };
    if nodes <= 1 {
        return Ok(None);
    }
    let node_file = sysfs
        .join("bus/pci/devices")
        .join(address)
        .join("numa_node");
    let text = std::fs::read_to_string(&node_file)
        .map_err(|error| format!("{}: {error}", node_file.display()))?;
    let node: i64 = text.trim().parse().map_err(|_| {
        format!(
            "{}: {:?} is not a node number",
            node_file.display(),
            text.trim()
        )
    })?;
    let Ok(node) = u32::try_from(node) else {
        return Ok(None);
    };
    let list_file = nodes_dir.join(format!("node{node}/cpulist"));
    let list = std::fs::read_to_string(&list_file)
        .map_err(|error| format!("{}: {error}", list_file.display()))?;
    let cpus = parse_cpulist(&list).map_err(|e| format!("{}: {e}", list_file.display()))?;
    if cpus.is_empty() {
        // A node without CPUs (memory only): nothing to bind to.
        return Ok(None);
    }
    Ok(Some(NumaPlacement { node, cpus }))
}

/// The calling thread's CPU affinity.
fn current_affinity() -> io::Result<nix::sched::CpuSet> {
    nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).map_err(io::Error::from)
}

/// Restricts the calling thread to `cpus` (those the process may use; an error when none is).
/// Threads it starts afterwards inherit the restriction.
pub fn bind_current_thread(cpus: &[usize]) -> io::Result<()> {
    let allowed = current_affinity()?;
    let mut set = nix::sched::CpuSet::new();
    let mut any = false;
    for &cpu in cpus {
        if cpu < nix::sched::CpuSet::count() && allowed.is_set(cpu).unwrap_or(false) {
            set.set(cpu).map_err(io::Error::from)?;
            any = true;
        }
    }
    if !any {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "none of the node's CPUs is allowed to this process",
        ));
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set).map_err(io::Error::from)
}

/// The calling thread bound to a node's CPUs until dropped, then given back its previous affinity:
/// for work on a shared thread (a stream's set-up on its session's thread) whose allocations and
/// started threads belong on the node.
pub struct BoundForNow {
    previous: Option<nix::sched::CpuSet>,
}

impl BoundForNow {
    /// Binds the calling thread to `placement`'s CPUs, if any; a failure is logged and leaves the
    /// thread as it was.
    pub fn new(placement: Option<&NumaPlacement>) -> BoundForNow {
        let Some(placement) = placement else {
            return BoundForNow { previous: None };
        };
        let previous = match current_affinity() {
            Ok(previous) => previous,
            Err(error) => {
                tracing::warn!(
                    "NUMA node {}: reading the affinity: {error}",
                    placement.node
                );
                return BoundForNow { previous: None };
            }
        };
        match bind_current_thread(&placement.cpus) {
            Ok(()) => BoundForNow {
                previous: Some(previous),
            },
            Err(error) => {
                tracing::warn!("NUMA node {}: binding a thread: {error}", placement.node);
                BoundForNow { previous: None }
            }
        }
    }
}

impl BoundForNow {
    /// Also keeps the calling thread off `avoid` (the CPUs servicing the device's interrupts,
    /// `gpufeed_proto::affinity`) until dropped, when other CPUs are allowed to it; the affinity
    /// before [`BoundForNow::new`] (or before this, if `new` bound nothing) comes back on drop.
    pub fn avoiding(mut self, avoid: &[usize]) -> BoundForNow {
        if avoid.is_empty() {
            return self;
        }
        let previous = match (&self.previous, current_affinity()) {
            (Some(_), _) => None,
            (None, Ok(previous)) => Some(previous),
            (None, Err(error)) => {
                tracing::warn!("reading the affinity: {error}");
                return self;
            }
        };
        match gpufeed_proto::affinity::keep_thread_off(avoid) {
            Ok(Some(_)) => {
                if previous.is_some() {
                    self.previous = previous;
                }
            }
            Ok(None) => {}
            Err(error) => tracing::warn!("keeping a thread off CPUs {avoid:?}: {error}"),
        }
        self
    }
}

impl Drop for BoundForNow {
    fn drop(&mut self) {
        if let Some(previous) = self.previous.take() {
            let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &previous);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_the_kernel_writes_them() {
        assert_eq!(parse_cpulist("0-3,8-9\n").unwrap(), vec![0, 1, 2, 3, 8, 9]);
        assert_eq!(parse_cpulist("5").unwrap(), vec![5]);
        assert_eq!(parse_cpulist("\n").unwrap(), Vec::<usize>::new());
        assert_eq!(parse_cpulist("2,1,2").unwrap(), vec![1, 2]);
        assert!(parse_cpulist("3-1").unwrap_err().contains("3-1"));
        assert!(parse_cpulist("a-b")
            .unwrap_err()
            .contains("not a CPU number"));
        assert!(parse_cpulist("0-99999999").is_err());
    }

    fn fake_sysfs(nodes: &[(u32, &str)], device_node: Option<&str>) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for (node, cpus) in nodes {
            let dir = root.path().join(format!("devices/system/node/node{node}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("cpulist"), cpus).unwrap();
        }
        // Entries that are not nodes are not counted.
        std::fs::create_dir_all(root.path().join("devices/system/node/power")).unwrap();
        if let Some(node) = device_node {
            let dir = root.path().join("bus/pci/devices/0000:3b:00.0");
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("numa_node"), node).unwrap();
        }
        root
    }

    #[test]
    fn a_device_on_a_two_node_host_is_placed_on_its_node() {
        let sysfs = fake_sysfs(&[(0, "0-7\n"), (1, "8-15\n")], Some("1\n"));
        let placement = placement_of(sysfs.path(), &pci_address(0, 0x3b, 0)).unwrap();
        assert_eq!(
            placement,
            Some(NumaPlacement {
                node: 1,
                cpus: (8..16).collect()
            })
        );
    }

    #[test]
    fn one_node_an_unknown_node_or_no_numa_information_places_nothing() {
        let one = fake_sysfs(&[(0, "0-15")], Some("0"));
        assert_eq!(placement_of(one.path(), "0000:3b:00.0").unwrap(), None);
        let unknown = fake_sysfs(&[(0, "0-7"), (1, "8-15")], Some("-1"));
        assert_eq!(placement_of(unknown.path(), "0000:3b:00.0").unwrap(), None);
        let bare = tempfile::tempdir().unwrap();
        assert_eq!(placement_of(bare.path(), "0000:3b:00.0").unwrap(), None);
        let memory_only = fake_sysfs(&[(0, "0-7"), (1, "")], Some("1"));
        assert_eq!(
            placement_of(memory_only.path(), "0000:3b:00.0").unwrap(),
            None
        );
    }

    #[test]
    fn a_missing_or_malformed_node_file_is_an_error_naming_it() {
        let missing = fake_sysfs(&[(0, "0-7"), (1, "8-15")], None);
        let error = placement_of(missing.path(), "0000:3b:00.0").unwrap_err();
        assert!(error.contains("0000:3b:00.0/numa_node"), "{error}");
        let malformed = fake_sysfs(&[(0, "0-7"), (1, "8-15")], Some("one"));
        let error = placement_of(malformed.path(), "0000:3b:00.0").unwrap_err();
        assert!(error.contains("not a node number"), "{error}");
    }

    #[test]
    fn a_thread_bound_for_now_gets_its_affinity_back() {
        let before = current_affinity().unwrap();
        let allowed: Vec<usize> = (0..nix::sched::CpuSet::count())
            .filter(|&c| before.is_set(c).unwrap_or(false))
            .collect();
        let first = allowed[0];
        {
            let _bound = BoundForNow::new(Some(&NumaPlacement {
                node: 0,
                cpus: vec![first],
            }));
            let now = current_affinity().unwrap();
            let set: Vec<usize> = (0..nix::sched::CpuSet::count())
                .filter(|&c| now.is_set(c).unwrap_or(false))
                .collect();
            assert_eq!(set, vec![first]);
            // A thread started meanwhile inherits the binding.
            let inherited = std::thread::spawn(|| {
                let set = current_affinity().unwrap();
                (0..nix::sched::CpuSet::count())
                    .filter(|&c| set.is_set(c).unwrap_or(false))
                    .collect::<Vec<_>>()
            })
            .join()
            .unwrap();
            assert_eq!(inherited, vec![first]);
        }
        let after = current_affinity().unwrap();
        assert_eq!(after, before);
        // CPUs the process may not use are refused, and the thread is left as it was.
        let outside = (0..nix::sched::CpuSet::count()).find(|&c| !before.is_set(c).unwrap_or(true));
        if let Some(outside) = outside {
            assert!(bind_current_thread(&[outside]).is_err());
            assert_eq!(current_affinity().unwrap(), before);
        }
    }

    #[test]
    fn a_thread_kept_off_cpus_for_now_gets_its_affinity_back() {
        std::thread::spawn(|| {
            let before = current_affinity().unwrap();
            let allowed: Vec<usize> = (0..nix::sched::CpuSet::count())
                .filter(|&c| before.is_set(c).unwrap_or(false))
                .collect();
            {
                let _off = BoundForNow::new(None).avoiding(&allowed[..1]);
                if allowed.len() >= 2 {
                    assert!(!current_affinity().unwrap().is_set(allowed[0]).unwrap());
                } else {
                    // The only CPU allowed is not given up.
                    assert_eq!(current_affinity().unwrap(), before);
                }
            }
            assert_eq!(current_affinity().unwrap(), before);
        })
        .join()
        .unwrap();
    }
}
