//! Page-aligned host buffers, as O_DIRECT requires of read destinations.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use super::IO_ALIGN_BYTES;

/// A zeroed, 4096-aligned heap buffer of fixed length.
pub struct AlignedBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain owned memory, like a Vec<u8>.
unsafe impl Send for AlignedBuffer {}
// SAFETY: shared access only hands out shared slices.
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    /// Allocates `len` zeroed bytes (rounded up to a whole number of 4096-byte pages, at least one).
    pub fn new(len: usize) -> AlignedBuffer {
        let len = len.max(1).div_ceil(IO_ALIGN_BYTES as usize) * IO_ALIGN_BYTES as usize;
        let layout = Layout::from_size_align(len, IO_ALIGN_BYTES as usize).expect("valid layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(ptr) else {
            std::alloc::handle_alloc_error(layout);
        };
        AlignedBuffer { ptr, len }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer (never: the length is at least one page).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes for the buffer's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        let layout =
            Layout::from_size_align(self.len, IO_ALIGN_BYTES as usize).expect("valid layout");
        // SAFETY: allocated in `new` with this exact layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
    }
}
