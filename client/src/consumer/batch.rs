//! A batch: a lease on one slot, its fields read in place.

use std::net::Shutdown;
use std::sync::Arc;

use super::error::ClientError;
use super::layout::extent_bytes;
use super::slots::{Outbox, SlotMemory, Slots};

use crate::dtype::DType;
use crate::protocol::BatchInfo;

/// A batch: a lease on one filled slot. Its fields are read in place; dropping it releases the slot.
#[derive(Debug)]
pub struct Batch {
    pub(super) info: BatchInfo,
    pub(super) memory: Arc<SlotMemory>,
    pub(super) outbox: Arc<Outbox>,
    /// The CUDA stream whose queued work the release waits for, when not the stream's own (set
    /// by [`Batch::release_after`]).
    pub(super) release_stream: Option<u64>,
}

/// One field of a batch.
#[derive(Clone, Copy, Debug)]
pub struct FieldView<'a> {
    /// Field name.
    pub name: &'a str,
    /// Element type.
    pub dtype: DType,
    /// Shape, batch dimension first.
    pub shape: &'a [u64],
    /// The batch's elements in C order: `product(shape) × dtype size` bytes, in host or device memory.
    pub data: FieldData<'a>,
    pub(super) slot: u32,
    pub(super) memory: &'a SlotMemory,
}

/// Where a field's bytes are.
#[derive(Clone, Copy, Debug)]
pub enum FieldData<'a> {
    /// In host memory (the CPU backend).
    Host(&'a [u8]),
    /// In device memory (the CUDA backend): `bytes` bytes at device address `ptr`, ready for work
    /// queued on the stream's CUDA stream (see [`Stream::set_cuda_stream`]).
    Device {
        /// The device address (a `CUdeviceptr`).
        ptr: u64,
        /// Length in bytes.
        bytes: usize,
    },
}

impl FieldView<'_> {
    /// The bytes, when the field is in host memory.
    pub fn host_bytes(&self) -> Option<&[u8]> {
        match self.data {
            FieldData::Host(bytes) => Some(bytes),
            FieldData::Device { .. } => None,
        }
    }

    /// The device address, when the field is in device memory.
    pub fn device_ptr(&self) -> Option<u64> {
        match self.data {
            FieldData::Host(_) => None,
            FieldData::Device { ptr, .. } => Some(ptr),
        }
    }

    /// Length of the data in bytes.
    pub fn byte_len(&self) -> usize {
        match self.data {
            FieldData::Host(bytes) => bytes.len(),
            FieldData::Device { bytes, .. } => bytes,
        }
    }

    /// Appends the field's bytes to `out`: a copy from host memory, or, from device memory, a
    /// synchronous copy once the daemon's fill is done (for checks and tools, not the training path).
    pub fn copy_to_host(&self, out: &mut Vec<u8>) -> Result<(), ClientError> {
        match (self.data, &self.memory.slots) {
            (FieldData::Host(bytes), _) => out.extend_from_slice(bytes),
            (FieldData::Device { ptr, bytes }, Slots::Device(slots)) => {
                let start = out.len();
                out.resize(start + bytes, 0);
                slots.copy_to_host(self.slot, ptr, &mut out[start..])?;
            }
            (FieldData::Device { .. }, Slots::Host(_)) => {
                unreachable!("device views come from device slots")
            }
        }
        Ok(())
    }
}

impl Batch {
    /// Makes `stream` (a `CUstream` of the stream device's primary context; null is the legacy
    /// default stream) wait, on the device, for the daemon's fill of this batch: work queued on it
    /// afterwards reads the batch's final bytes, without the host waiting. The stream set with
    /// [`Stream::set_cuda_stream`] already waits; this is for other streams (DLPack consumers name
    /// theirs). No effect on host memory.
    ///
    /// # Safety
    /// `stream` is a live stream of the primary context of the stream's device.
    pub unsafe fn wait_ready_on(&self, stream: *mut std::ffi::c_void) -> Result<(), ClientError> {
        if let Slots::Device(slots) = &self.memory.slots {
            slots.wait_ready(self.info.slot, stream as crate::cuda::RawStream)?;
        }
        Ok(())
    }

    /// Releases the slot, when the batch is dropped, once the work queued on `stream` before the drop
    /// is done, instead of the work on the stream set with [`Stream::set_cuda_stream`]. No effect on
    /// host memory.
    ///
    /// # Safety
    /// `stream` stays live until the batch is dropped, and belongs to the primary context of the
    /// stream's device.
    pub unsafe fn release_after(&mut self, stream: *mut std::ffi::c_void) {
        self.release_stream = Some(stream as usize as u64);
    }

    /// The daemon's description of the batch.
    pub fn info(&self) -> &BatchInfo {
        &self.info
    }

    /// The slot it occupies.
    pub fn slot(&self) -> u32 {
        self.info.slot
    }

    /// Epoch of the batch.
    pub fn epoch(&self) -> u64 {
        self.info.epoch
    }

    /// Step within the epoch.
    pub fn step(&self) -> u64 {
        self.info.step
    }

    /// The epoch cursor once every rank has consumed this step; a checkpoint records it.
    pub fn cursor_after(&self) -> u64 {
        self.info.cursor_after
    }

    /// Samples in the batch.
    pub fn samples(&self) -> u32 {
        self.info.samples
    }

    /// Samples zero-filled because their block was corrupt (policy `Replace`).
    pub fn replaced(&self) -> u32 {
        self.info.replaced
    }

    /// The fields, in slot order.
    pub fn fields(&self) -> impl Iterator<Item = FieldView<'_>> + '_ {
        (0..self.info.fields.len()).map(|index| self.view(index))
    }

    /// The field called `name`.
    pub fn field(&self, name: &str) -> Option<FieldView<'_>> {
        let index = self
            .memory
            .layout
            .fields
            .iter()
            .position(|field| field.name == name)?;
        Some(self.view(index))
    }

    pub(super) fn view(&self, index: usize) -> FieldView<'_> {
        let field = &self.info.fields[index];
        // Validated in `accept_batch`: the product does not overflow and the range lies in the slot.
        let len = extent_bytes(&field.shape, field.dtype.size_bytes()).expect("validated extent");
        let start = field.offset as usize;
        let data = match &self.memory.slots {
            Slots::Host(slots) => {
                FieldData::Host(&slots.slot(self.info.slot)[start..start + len as usize])
            }
            Slots::Device(slots) => FieldData::Device {
                ptr: slots.ptr(self.info.slot) + start as u64,
                bytes: len as usize,
            },
        };
        FieldView {
            name: &self.memory.layout.fields[index].name,
            dtype: field.dtype,
            shape: &field.shape,
            data,
            slot: self.info.slot,
            memory: &self.memory,
        }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if let Slots::Device(slots) = &self.memory.slots {
            let stream = self.release_stream.map_or_else(
                || self.memory.cuda_stream(),
                |s| s as usize as crate::cuda::RawStream,
            );
            if slots.release(self.info.slot, stream).is_err() {
                // Neither recording the release event nor waiting for the stream worked: the
                // consumer's work may still read the slot, so it is not handed back; ending the
                // session makes the daemon reclaim the whole ring instead.
                let _ = self.outbox.lock().socket.shutdown(Shutdown::Both);
                return;
            }
        }
        self.outbox.release(self.info.slot);
    }
}
