//! Kernels compiled at run time by NVRTC, cached per device in memory and on disk.
//!
//! A kernel source is compiled for the device's own compute capability (`sm_XY` cubin) when the loaded
//! NVRTC knows that architecture, else to PTX for the newest `compute_XY` it knows below it, which the
//! driver then compiles. The image is written to a disk cache keyed by a hash of the source and the
//! options, the target and the NVRTC version, so that a restart loads it instead of compiling (~170 ms a
//! module on the H100 machine). Cache writes are atomic (a temporary file renamed into place); a cache
//! that cannot be read or written only costs a compilation.

use std::ffi::{c_void, CString};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::driver::sys as cu;

use super::{ffi, nvrtc_ready, Device, DeviceError, Stream};
use crate::durable;

/// A kernel source file, embedded in the binary.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// Short name, used in cache file names and errors (`lz4`, `gather`).
    pub name: &'static str,
    /// The CUDA C++ text.
    pub source: &'static str,
}

/// Where compiled images are cached on disk (the daemon's `--cache-dir`, resolved with its default
/// in `config`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheDir {
    /// This directory.
    At(PathBuf),
    /// No disk cache.
    Disabled,
}

/// How to compile a kernel source.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompileOptions {
    /// Preprocessor definitions (`-DNAME=VALUE`).
    pub defines: Vec<(String, String)>,
    /// The disk cache.
    pub cache: CacheDir,
}

/// What NVRTC generated code for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Machine code for `sm_XY`, XY = 10 * major + minor.
    Cubin(i32),
    /// PTX for `compute_XY`, compiled by the driver at load.
    Ptx(i32),
}

impl Target {
    /// Chooses the target for a device of compute capability `capability` given the architectures the
    /// loaded NVRTC supports; `None` when it supports none at or below the device's.
    pub fn choose(capability: (u32, u32), supported: &[i32]) -> Option<Target> {
        let arch = (capability.0 * 10 + capability.1) as i32;
        if supported.contains(&arch) {
            return Some(Target::Cubin(arch));
        }
        supported
            .iter()
            .copied()
            .filter(|&a| a < arch)
            .max()
            .map(Target::Ptx)
    }

    fn option(self) -> String {
        match self {
            Target::Cubin(arch) => format!("--gpu-architecture=sm_{arch}"),
            Target::Ptx(arch) => format!("--gpu-architecture=compute_{arch}"),
        }
    }

    fn tag(self) -> String {
        match self {
            Target::Cubin(arch) => format!("sm{arch}.cubin"),
            Target::Ptx(arch) => format!("compute{arch}.ptx"),
        }
    }
}

/// A compiled kernel image.
#[derive(Clone, Debug)]
pub struct CompiledImage {
    /// What the image is.
    pub target: Target,
    /// The cubin, or NUL-terminated PTX.
    pub image: Vec<u8>,
    /// The NVRTC options used.
    pub options: Vec<String>,
    /// NVRTC's log (warnings).
    pub log: String,
    /// NVRTC's version (major, minor).
    pub nvrtc_version: (i32, i32),
}

/// CUDA's header folder, when one is installed: `$CUDA_HOME/include`, `$CUDA_PATH/include` or
/// `/usr/local/cuda/include`. The kernels include no header; the path is passed only so that a future
/// `#include` of CUDA's headers works where they exist.
fn cuda_include_dir() -> Option<PathBuf> {
    ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(|root| PathBuf::from(root).join("include"))
        .chain(std::iter::once(PathBuf::from("/usr/local/cuda/include")))
        .find(|dir| dir.join("cuda_runtime.h").is_file())
}

fn nvrtc_options(target: Target, defines: &[(String, String)]) -> Vec<String> {
    let mut options = vec![
        target.option(),
        "-default-device".to_owned(),
        "--std=c++17".to_owned(),
        // Line tables only (no debug code): lets compute-sanitizer and ncu point at source lines.
        "-lineinfo".to_owned(),
    ];
    options.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    if let Some(dir) = cuda_include_dir() {
        options.push(format!("-I{}", dir.display()));
    }
    options
}

/// Compiles `source` for a device of compute capability `capability` (no device needed; NVRTC only).
pub fn compile(
    source: &KernelSource,
    capability: (u32, u32),
    defines: &[(String, String)],
) -> Result<CompiledImage, DeviceError> {
    nvrtc_ready()?;
    let nvrtc_version = ffi::nvrtc_version()?;
    let supported = ffi::nvrtc_supported_archs()?;
    let target =
        Target::choose(capability, &supported).ok_or_else(|| DeviceError::Unavailable {
            reason: format!(
                "NVRTC {}.{} supports no architecture at or below sm_{}{}",
                nvrtc_version.0, nvrtc_version.1, capability.0, capability.1
            ),
        })?;
    let options = nvrtc_options(target, defines);
    let file_name = format!("{}.cu", source.name);
    match ffi::nvrtc_compile(
        source.source,
        &file_name,
        &options,
        matches!(target, Target::Cubin(_)),
    ) {
        Ok(output) => Ok(CompiledImage {
            target,
            image: output.image,
            options,
            log: output.log,
            nvrtc_version,
        }),
        Err(ffi::NvrtcFailure::Compile(log)) => Err(DeviceError::Compile {
            kernel: source.name.to_owned(),
            options,
            log,
        }),
        Err(ffi::NvrtcFailure::Call(e)) => Err(e.into()),
    }
}

/// The cache file name of `source` compiled with `options` for `target` by NVRTC `nvrtc_version`:
/// `NAME-HASH-TARGET-nvrtcMAJOR.MINOR.EXT`, HASH being xxh3-64 of the source and the options.
pub fn cache_file_name(
    source: &KernelSource,
    options: &[String],
    target: Target,
    nvrtc_version: (i32, i32),
) -> String {
    let mut keyed = source.source.as_bytes().to_vec();
    for option in options {
        keyed.push(0);
        keyed.extend_from_slice(option.as_bytes());
    }
    let hash = crate::format::checksum(&keyed);
    let tag = target.tag();
    let (stem, ext) = tag.split_once('.').expect("tag has an extension");
    format!(
        "{}-{hash:016x}-{stem}-nvrtc{}.{}.{ext}",
        source.name, nvrtc_version.0, nvrtc_version.1
    )
}

/// Writes `bytes` to the cache file `path` atomically ([`durable::write_atomically`]: written aside,
/// synced, renamed into place, the directory synced), creating the cache directory first.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), durable::PathError> {
    let dir = durable::parent_dir(path);
    fs::create_dir_all(dir).map_err(durable::on(dir))?;
    durable::write_atomically(path, bytes)
}

/// Where a module came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModuleOrigin {
    /// Already loaded on this device (the in-memory cache).
    Memory,
    /// Read from the disk cache at this path.
    Disk(PathBuf),
    /// Compiled now; `cached_at` is where the image was written, or why it was not.
    Compiled {
        /// The cache file written, or the reason there is none.
        cached_at: Result<PathBuf, String>,
    },
}

/// A loaded CUDA module. Unloaded on drop (with its context current).
///
/// A module does not hold its [`Device`] (the device's module cache holds the module, so that would be
/// a cycle); it keeps the raw context, which the device keeps retained: the cache is cleared before the
/// context is released, and every [`Kernel`] holds the device.
pub struct Module {
    handle: cu::CUmodule,
    context: cu::CUcontext,
    key: String,
}

// SAFETY: module handles may be used from any thread.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Module {
    /// The cache key (file name) of the image this module was loaded from.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The kernel `name` (an `extern "C"` function) of this module.
    pub fn kernel(self: &Arc<Self>, device: &Device, name: &str) -> Result<Kernel, DeviceError> {
        let name_c = CString::new(name).expect("kernel names have no NUL");
        device.bind()?;
        // SAFETY: the module is live for as long as the returned Kernel holds it.
        let function = unsafe { ffi::module_function(self.handle, &name_c) }?;
        Ok(Kernel {
            module: Arc::clone(self),
            device: device.clone(),
            function,
            name: name.to_owned(),
        })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: the context is retained while the module exists (see the type's documentation).
        let _ = unsafe { ffi::context_set_current(self.context) };
        // SAFETY: loaded once, unloaded once; every Kernel of it held an Arc, so none is left to launch.
        let _ = unsafe { ffi::module_unload(self.handle) };
    }
}

/// One kernel function of a loaded module.
pub struct Kernel {
    module: Arc<Module>,
    device: Device,
    function: cu::CUfunction,
    name: String,
}

// SAFETY: function handles may be launched from any thread.
unsafe impl Send for Kernel {}
// SAFETY: as above.
unsafe impl Sync for Kernel {}

impl Kernel {
    /// The module the function belongs to.
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }

    /// The function's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Thread blocks of `block_threads` threads that fit on one multiprocessor at once.
    pub fn blocks_per_multiprocessor(&self, block_threads: u32) -> Result<u32, DeviceError> {
        self.device.bind()?;
        // SAFETY: the function's module is held by self.
        Ok(unsafe { ffi::occupancy_blocks_per_multiprocessor(self.function, block_threads, 0) }?)
    }

    /// Queues a launch of `grid` blocks of `block` threads on `stream`.
    ///
    /// # Safety
    /// `params` holds one pointer per kernel parameter to a value of exactly that parameter's type;
    /// every buffer the arguments address stays allocated, and is used by nothing conflicting, until
    /// the launch has completed on `stream`.
    pub unsafe fn launch(
        &self,
        stream: &Stream,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), DeviceError> {
        self.device.bind()?;
        ffi::launch_kernel(
            self.function,
            (grid, 1, 1),
            (block, 1, 1),
            0,
            stream.raw(),
            params,
        )?;
        Ok(())
    }
}

impl Device {
    /// Loads `source` compiled with `options`, from this device's module cache, the disk cache, or a
    /// fresh NVRTC compilation (in that order).
    pub fn load_module(
        &self,
        source: &KernelSource,
        options: &CompileOptions,
    ) -> Result<(Arc<Module>, ModuleOrigin), DeviceError> {
        nvrtc_ready()?;
        let nvrtc_version = ffi::nvrtc_version()?;
        let supported = ffi::nvrtc_supported_archs()?;
        let capability = self.properties().compute_capability;
        let target =
            Target::choose(capability, &supported).ok_or_else(|| DeviceError::Unavailable {
                reason: format!(
                    "NVRTC {}.{} supports no architecture at or below sm_{}{}",
                    nvrtc_version.0, nvrtc_version.1, capability.0, capability.1
                ),
            })?;
        let nvrtc_options = nvrtc_options(target, &options.defines);
        let key = cache_file_name(source, &nvrtc_options, target, nvrtc_version);

        let mut modules = self.modules().lock().expect("module cache poisoned");
        if let Some(module) = modules.get(&key) {
            return Ok((Arc::clone(module), ModuleOrigin::Memory));
        }
        let cache_dir = match &options.cache {
            CacheDir::At(dir) => Some(dir.clone()),
            CacheDir::Disabled => None,
        };
        let cache_path = cache_dir.map(|d| d.join(&key));

        self.bind()?;
        if let Some(path) = &cache_path {
            if let Ok(image) = fs::read(path) {
                // A damaged file fails to load (the driver validates images); it is then recompiled
                // and overwritten.
                // SAFETY: the context is current; a cubin or PTX image from our own cache.
                if let Ok(handle) = unsafe { ffi::module_load_data(&image) } {
                    let module = Arc::new(Module {
                        handle,
                        context: self.inner.context,
                        key: key.clone(),
                    });
                    modules.insert(key, Arc::clone(&module));
                    return Ok((module, ModuleOrigin::Disk(path.clone())));
                }
            }
        }

        let compiled = compile(source, capability, &options.defines)?;
        let mut image = compiled.image;
        if matches!(target, Target::Ptx(_)) && image.last() != Some(&0) {
            image.push(0);
        }
        // SAFETY: the context is current; a fresh NVRTC image.
        let handle = unsafe { ffi::module_load_data(&image) }?;
        let module = Arc::new(Module {
            handle,
            context: self.inner.context,
            key: key.clone(),
        });
        modules.insert(key, Arc::clone(&module));
        let cached_at = match cache_path {
            Some(path) => write_atomically(&path, &image)
                .map(|()| path.clone())
                .map_err(|e| format!("writing {e}")),
            None => Err("no cache directory".to_owned()),
        };
        Ok((module, ModuleOrigin::Compiled { cached_at }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE: KernelSource = KernelSource {
        name: "probe",
        source: "extern \"C\" __global__ void probe() {}",
    };

    #[test]
    fn target_prefers_the_devices_own_architecture() {
        assert_eq!(
            Target::choose((9, 0), &[75, 80, 90]),
            Some(Target::Cubin(90))
        );
        // A device newer than NVRTC: PTX for the newest architecture below it, compiled by the driver.
        assert_eq!(
            Target::choose((12, 0), &[75, 80, 90, 100]),
            Some(Target::Ptx(100))
        );
        assert_eq!(Target::choose((7, 0), &[75, 80]), None);
    }

    #[test]
    fn cache_key_changes_with_source_options_target_and_nvrtc() {
        let options = vec!["--gpu-architecture=sm_90".to_owned()];
        let base = cache_file_name(&SOURCE, &options, Target::Cubin(90), (13, 0));
        assert!(base.starts_with("probe-"), "{base}");
        assert!(base.ends_with("-sm90-nvrtc13.0.cubin"), "{base}");
        let other_source = KernelSource {
            source: "extern \"C\" __global__ void probe() { }",
            ..SOURCE
        };
        assert_ne!(
            base,
            cache_file_name(&other_source, &options, Target::Cubin(90), (13, 0))
        );
        let more_options = vec![options[0].clone(), "-DX=1".to_owned()];
        assert_ne!(
            base,
            cache_file_name(&SOURCE, &more_options, Target::Cubin(90), (13, 0))
        );
        assert_ne!(
            base,
            cache_file_name(&SOURCE, &options, Target::Cubin(89), (13, 0))
        );
        assert_ne!(
            base,
            cache_file_name(&SOURCE, &options, Target::Cubin(90), (13, 1))
        );
        assert!(cache_file_name(&SOURCE, &options, Target::Ptx(90), (13, 0)).ends_with(".ptx"));
    }

    #[test]
    fn atomic_write_replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested").join("image.cubin");
        write_atomically(&path, b"first").unwrap();
        write_atomically(&path, b"second").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"second");
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("image.cubin")]);
    }

    #[test]
    fn options_name_the_target_and_defines() {
        let options = nvrtc_options(Target::Cubin(90), &[("GF_LZ4_WARPS".into(), "8".into())]);
        assert_eq!(options[0], "--gpu-architecture=sm_90");
        assert!(options.contains(&"-DGF_LZ4_WARPS=8".to_owned()));
        let ptx = nvrtc_options(Target::Ptx(90), &[]);
        assert_eq!(ptx[0], "--gpu-architecture=compute_90");
    }
}
