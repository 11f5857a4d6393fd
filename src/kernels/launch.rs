//! What the host side of every kernel shares: loading its entry point, and checking a table's
//! buffer before a launch.

use crate::device::{
    CacheDir, CompileOptions, Device, DeviceError, DeviceMemory, Kernel, KernelSource, ModuleOrigin,
};

/// Loads `source` for `device`, compiled with NVRTC and `defines` unless `cache` (or the device's
/// module cache) holds it, and returns its entry point `entry` with where the module came from.
pub(super) fn load_kernel(
    device: &Device,
    source: &KernelSource,
    defines: Vec<(String, String)>,
    cache: CacheDir,
    entry: &str,
) -> Result<(Kernel, ModuleOrigin), DeviceError> {
    let options = CompileOptions { defines, cache };
    let (module, origin) = device.load_module(source, &options)?;
    Ok((module.kernel(device, entry)?, origin))
}

/// Fails unless `table` holds `count` entries of `entry_bytes` bytes. A kernel checks the extents
/// its table entries name, but trusts the table's own length, so every launch checks it first.
pub(super) fn check_table(
    what: &'static str,
    table: &dyn DeviceMemory,
    count: u32,
    entry_bytes: usize,
) -> Result<(), DeviceError> {
    let bytes = count as u64 * entry_bytes as u64;
    if bytes > table.len() as u64 {
        return Err(DeviceError::OutOfBounds {
            what,
            offset: 0,
            bytes,
            capacity: table.len() as u64,
        });
    }
    Ok(())
}
