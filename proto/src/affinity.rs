//! Keeping hot threads off the CPUs that service a GPU's interrupts.
//!
//! A GPU raises tens of thousands of interrupts a second while it is fed (its work completing, the
//! copies the daemon queues). The kernel delivers each of a PCI function's MSI-X vectors to one CPU,
//! and on a VM all of a GPU's interrupts often land on a single vCPU. A thread running there loses a
//! share of its time to the interrupt handler, without a context switch to show for it, and its CUDA
//! driver calls wait behind the handler: on the H100 test machine a consumer on that CPU took 200-300
//! µs for 1-1.5 % of its per-batch driver queries (25 % of its time at batches of 64 rows), and a
//! daemon filler there ran three times slower for a whole epoch
//! (`docs/benchmarks/handoff-2026-11-24.md`, run 31).
//!
//! [`interrupt_cpus`] finds those CPUs for a PCI function from sysfs and `/proc` (where its active
//! interrupt vectors go now);
//! [`keep_thread_off`] moves the calling thread to the other CPUs it may use.

use std::collections::BTreeSet;
use std::io;
use std::path::Path;

/// A CPU whose share of a device's interrupts is at least this (in parts of 1000) counts as one of
/// the device's interrupt CPUs.
const SHARE_MIN_PER_MILLE: u64 = 10;

/// The CPUs servicing the interrupts of the PCI function `address` (`dddd:bb:dd.f`): its MSI IRQ
/// numbers from `{sysfs}/bus/pci/devices/{address}/msi_irqs`; of those, the ones that took at least
/// 1 % of the function's interrupts so far (from `interrupts`, the text of `/proc/interrupts`) are
/// the active ones, and each active IRQ's CPUs are where the kernel sends it now
/// (`{procfs}/irq/{n}/effective_affinity_list`), or, where that file is missing or empty, the CPUs
/// that took at least 1 % of the function's interrupts. Empty when the function has no MSI IRQs,
/// none has fired yet, or the files are not there (not Linux, no sysfs).
pub fn interrupt_cpus_from(
    sysfs: &Path,
    procfs: &Path,
    interrupts: &str,
    address: &str,
) -> Vec<usize> {
    let dir = sysfs.join("bus/pci/devices").join(address).join("msi_irqs");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let irqs: BTreeSet<u64> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    let counts = InterruptCounts::parse(interrupts, &irqs);
    let mut cpus = BTreeSet::new();
    for irq in counts.active_irqs() {
        let file = procfs.join(format!("irq/{irq}/effective_affinity_list"));
        let now = std::fs::read_to_string(file)
            .ok()
            .and_then(|text| parse_cpulist(&text).ok())
            .filter(|list| !list.is_empty());
        match now {
            Some(list) => cpus.extend(list),
            None => cpus.extend(counts.cpus_taking(&[irq])),
        }
    }
    cpus.into_iter().collect()
}

/// Most CPUs a `cpulist` may name (a bound on what a malformed file can make us allocate).
const CPUS_MAX: usize = 1 << 16;

/// Parses a kernel CPU list such as `0-7,16-23` or `3`; an empty list is empty.
pub fn parse_cpulist(text: &str) -> Result<Vec<usize>, String> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let number = |s: &str| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| format!("CPU list {text:?}: {s:?} is not a CPU number"))
        };
        let (first, last) = match part.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None => {
                let n = number(part)?;
                (n, n)
            }
        };
        if first > last || last >= CPUS_MAX {
            return Err(format!("CPU list {text:?}: range {part:?} is not valid"));
        }
        cpus.extend(first..=last);
    }
    cpus.sort_unstable();
    cpus.dedup();
    Ok(cpus)
}

/// Per-CPU interrupt counts of some IRQs, from `/proc/interrupts` text.
struct InterruptCounts {
    /// The CPU number of each count column (from the header: CPU0 CPU1 ...; offline CPUs have none).
    columns: Vec<usize>,
    /// Each IRQ's counts, by column.
    by_irq: Vec<(u64, Vec<u64>)>,
}

impl InterruptCounts {
    fn parse(interrupts: &str, irqs: &BTreeSet<u64>) -> InterruptCounts {
        let mut lines = interrupts.lines();
        let columns: Vec<usize> = lines
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|name| name.strip_prefix("CPU")?.parse().ok())
            .collect();
        let mut by_irq = Vec::new();
        for line in lines {
            let mut fields = line.split_whitespace();
            let Some(irq) = fields
                .next()
                .and_then(|f| f.strip_suffix(':'))
                .and_then(|f| f.parse::<u64>().ok())
            else {
                continue;
            };
            if !irqs.contains(&irq) {
                continue;
            }
            let mut counts = vec![0u64; columns.len()];
            for (count, field) in counts.iter_mut().zip(fields) {
                match field.parse::<u64>() {
                    Ok(n) => *count = n,
                    Err(_) => break,
                }
            }
            by_irq.push((irq, counts));
        }
        InterruptCounts { columns, by_irq }
    }

    fn total(&self, irqs: Option<&[u64]>) -> Vec<u64> {
        let mut sum = vec![0u64; self.columns.len()];
        for (irq, counts) in &self.by_irq {
            if irqs.is_some_and(|only| !only.contains(irq)) {
                continue;
            }
            for (s, &c) in sum.iter_mut().zip(counts) {
                *s = s.saturating_add(c);
            }
        }
        sum
    }

    fn all(&self) -> u64 {
        self.total(None)
            .iter()
            .fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// The IRQs that took at least 1 % of all the counted interrupts.
    fn active_irqs(&self) -> Vec<u64> {
        let all = self.all();
        if all == 0 {
            return Vec::new();
        }
        self.by_irq
            .iter()
            .filter(|(_, counts)| {
                let n = counts.iter().fold(0u64, |a, &b| a.saturating_add(b));
                n.saturating_mul(1000) >= all.saturating_mul(SHARE_MIN_PER_MILLE)
            })
            .map(|(irq, _)| *irq)
            .collect()
    }

    /// The CPUs that took at least 1 % of all the counted interrupts, counting those of `irqs`.
    fn cpus_taking(&self, irqs: &[u64]) -> Vec<usize> {
        let all = self.all();
        if all == 0 {
            return Vec::new();
        }
        self.columns
            .iter()
            .zip(self.total(Some(irqs)))
            .filter(|&(_, n)| n.saturating_mul(1000) >= all.saturating_mul(SHARE_MIN_PER_MILLE))
            .map(|(&cpu, _)| cpu)
            .collect()
    }
}

/// The CPUs of `/proc/interrupts` text that took at least 1 % of the interrupts of `irqs`.
pub fn cpus_taking(interrupts: &str, irqs: &BTreeSet<u64>) -> Vec<usize> {
    let counts = InterruptCounts::parse(interrupts, irqs);
    let all: Vec<u64> = irqs.iter().copied().collect();
    counts.cpus_taking(&all)
}

/// [`interrupt_cpus_from`] on this host (`/sys`, `/proc`).
pub fn interrupt_cpus(address: &str) -> Vec<usize> {
    let interrupts = std::fs::read_to_string("/proc/interrupts").unwrap_or_default();
    interrupt_cpus_from(Path::new("/sys"), Path::new("/proc"), &interrupts, address)
}

/// Restricts the calling thread to the CPUs it may use now (its affinity), less `avoid`, when that
/// leaves at least one; returns the CPUs it now runs on, or `None` when it was left as it was
/// (nothing to avoid, or nothing else allowed). Threads it starts afterwards inherit the restriction.
pub fn keep_thread_off(avoid: &[usize]) -> io::Result<Option<Vec<usize>>> {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    use nix::unistd::Pid;
    if avoid.is_empty() {
        return Ok(None);
    }
    let allowed = match sched_getaffinity(Pid::from_raw(0)) {
        Ok(allowed) => allowed,
        // More CPUs than a fixed-size set holds (over 1024 possible CPUs): leave the thread alone.
        Err(nix::errno::Errno::EINVAL) => return Ok(None),
        Err(error) => return Err(io::Error::from(error)),
    };
    let mut set = CpuSet::new();
    let mut kept = Vec::new();
    let mut avoided_any = false;
    for cpu in 0..CpuSet::count() {
        if !allowed.is_set(cpu).unwrap_or(false) {
            continue;
        }
        if avoid.contains(&cpu) {
            avoided_any = true;
            continue;
        }
        set.set(cpu).map_err(io::Error::from)?;
        kept.push(cpu);
    }
    if !avoided_any || kept.is_empty() {
        return Ok(None);
    }
    sched_setaffinity(Pid::from_raw(0), &set).map_err(io::Error::from)?;
    Ok(Some(kept))
}

#[cfg(test)]
mod tests {
    use super::*;

    const INTERRUPTS: &str = "           CPU0       CPU1       CPU2       CPU3
  0:         10          0          0          0   IO-APIC   2-edge      timer
 42:          0          0     336558          0 PCI-MSIX-0000:00:06.0   0-edge      nvidia
 43:          0          0          0          0 PCI-MSIX-0000:00:06.0   1-edge      nvidia
 44:         14          0          0          0 PCI-MSIX-0000:00:06.0   2-edge      nvidia
 45:        900        900          0          0 PCI-MSIX-0000:00:07.0   0-edge      nvme
NMI:          0          0          0          0   Non-maskable interrupts
";

    #[test]
    fn the_cpus_taking_a_devices_interrupts_are_found_and_small_shares_ignored() {
        let irqs: BTreeSet<u64> = [42, 43, 44].into_iter().collect();
        // CPU0's 14 are under 1 % of the device's interrupts; the other device's lines do not count.
        assert_eq!(cpus_taking(INTERRUPTS, &irqs), vec![2]);
        let nvme: BTreeSet<u64> = [45].into_iter().collect();
        assert_eq!(cpus_taking(INTERRUPTS, &nvme), vec![0, 1]);
        // No interrupts yet, unknown IRQs, or no text: nothing to avoid.
        let idle: BTreeSet<u64> = [43].into_iter().collect();
        assert!(cpus_taking(INTERRUPTS, &idle).is_empty());
        assert!(cpus_taking(INTERRUPTS, &[7].into_iter().collect()).is_empty());
        assert!(cpus_taking("", &irqs).is_empty());
        // Garbage lines are skipped, a short line counts what it has.
        let odd = "CPU0 CPU1\n 42: x y\n 42: 5\nrubbish\n";
        assert_eq!(cpus_taking(odd, &irqs), vec![0]);
    }

    #[test]
    fn a_devices_msi_irqs_are_read_from_sysfs() {
        let sysfs = tempfile::tempdir().unwrap();
        let dir = sysfs.path().join("bus/pci/devices/0000:00:06.0/msi_irqs");
        std::fs::create_dir_all(&dir).unwrap();
        for irq in [42, 43, 44] {
            std::fs::write(dir.join(irq.to_string()), "msix").unwrap();
        }
        let procfs = tempfile::tempdir().unwrap();
        // No effective affinity to read: the CPUs that took the interrupts.
        assert_eq!(
            interrupt_cpus_from(sysfs.path(), procfs.path(), INTERRUPTS, "0000:00:06.0"),
            vec![2]
        );
        assert!(
            interrupt_cpus_from(sysfs.path(), procfs.path(), INTERRUPTS, "0000:00:08.0").is_empty()
        );
        // The active vector (42) was moved to CPU 3: where it goes now counts, not where it went.
        // The idle vectors' affinity (43) does not.
        for (irq, list) in [(42, "3\n"), (43, "0-1\n")] {
            let dir = procfs.path().join(format!("irq/{irq}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("effective_affinity_list"), list).unwrap();
        }
        assert_eq!(
            interrupt_cpus_from(sysfs.path(), procfs.path(), INTERRUPTS, "0000:00:06.0"),
            vec![3]
        );
        // A malformed list falls back to the counts.
        std::fs::write(procfs.path().join("irq/42/effective_affinity_list"), "x-y").unwrap();
        assert_eq!(
            interrupt_cpus_from(sysfs.path(), procfs.path(), INTERRUPTS, "0000:00:06.0"),
            vec![2]
        );
    }

    #[test]
    fn a_thread_kept_off_cpus_runs_on_the_others_and_nothing_changes_without_a_choice() {
        std::thread::spawn(|| {
            let allowed = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
            let cpus: Vec<usize> = (0..nix::sched::CpuSet::count())
                .filter(|&c| allowed.is_set(c).unwrap_or(false))
                .collect();
            assert_eq!(keep_thread_off(&[]).unwrap(), None);
            // Avoiding every allowed CPU leaves the thread as it was.
            assert_eq!(keep_thread_off(&cpus).unwrap(), None);
            if cpus.len() >= 2 {
                let kept = keep_thread_off(&cpus[..1]).unwrap().unwrap();
                assert_eq!(kept, cpus[1..].to_vec());
                let now = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).unwrap();
                assert!(!now.is_set(cpus[0]).unwrap());
            }
        })
        .join()
        .unwrap();
    }
}
