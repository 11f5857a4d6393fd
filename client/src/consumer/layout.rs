//! Checks of what the daemon says a stream's memory is, before anything is mapped or read.

use std::fs::File;
use std::os::fd::OwnedFd;

use gpufeed_proto::spec::FIELD_OFFSET_ALIGN_BYTES;
use memmap2::MmapOptions;
use nix::fcntl::{fcntl, FcntlArg, SealFlag};

use super::error::ClientError;
use super::slots::HostSlots;

use crate::dtype::DType;
use crate::protocol::{
    BatchForm, Device, FieldLayout, StreamLayout, StreamSpec, Tail, BATCH_NDIM_MAX, SLOTS_MAX,
    SLOT_STRIDE_ALIGN_BYTES, STREAM_OPENED_DESCRIPTORS,
};

/// Product of `dims` times `element_bytes`, `None` on overflow.
pub(super) fn extent_bytes(dims: &[u64], element_bytes: usize) -> Option<u64> {
    dims.iter()
        .try_fold(element_bytes as u64, |acc, &d| acc.checked_mul(d))
}

/// Bytes of the memory that holds every slot of `layout` (`slot_count` × `slot_stride`), `None` when
/// that does not fit in the address space.
pub(super) fn ring_memory_bytes(layout: &StreamLayout) -> Option<usize> {
    usize::try_from(layout.slot_stride)
        .ok()?
        .checked_mul(layout.slot_count as usize)
}

/// Validates a `StreamOpened` layout against the request before any memory is mapped.
pub(super) fn check_layout(
    spec: &StreamSpec,
    layout: &StreamLayout,
    descriptors: usize,
) -> Result<(), ClientError> {
    let violation = |reason: String| Err(ClientError::Protocol(reason));
    if layout.slot_count == 0 || layout.slot_count > SLOTS_MAX {
        return violation(format!(
            "slot_count {} outside 1..={SLOTS_MAX}",
            layout.slot_count
        ));
    }
    if descriptors != STREAM_OPENED_DESCRIPTORS as usize {
        return violation(format!(
            "StreamOpened carried {descriptors} descriptors, not {STREAM_OPENED_DESCRIPTORS} (the \
             slots' memory, then the hand-off ring and its two doorbells)"
        ));
    }
    if layout.slot_bytes == 0 || usize::try_from(layout.slot_bytes).is_err() {
        return violation(format!("slot_bytes {} cannot be mapped", layout.slot_bytes));
    }
    if layout.slot_stride < layout.slot_bytes || layout.slot_stride % SLOT_STRIDE_ALIGN_BYTES != 0 {
        return violation(format!(
            "slot_stride {} is not a multiple of {SLOT_STRIDE_ALIGN_BYTES} of at least slot_bytes {}",
            layout.slot_stride, layout.slot_bytes
        ));
    }
    if ring_memory_bytes(layout).is_none() {
        return violation(format!(
            "{} slots {} bytes apart cannot be mapped",
            layout.slot_count, layout.slot_stride
        ));
    }
    let step_samples = u64::from(spec.world_size) * u64::from(spec.batch_size);
    let samples_left = layout.epoch_samples.saturating_sub(spec.start_cursor);
    let expected_steps = match spec.tail {
        Tail::Drop => samples_left / step_samples,
        Tail::Pad => samples_left.div_ceil(step_samples),
    };
    if layout.steps != expected_steps {
        return violation(format!(
            "{} steps announced, but {} samples from cursor {} in steps of {step_samples} with tail {:?} make {expected_steps}",
            layout.steps, layout.epoch_samples, spec.start_cursor, spec.tail
        ));
    }
    if layout.fields.is_empty() {
        return violation("the layout has no fields".to_string());
    }
    if layout.device != spec.device {
        return violation(format!(
            "slots on {:?}, the request asked for {:?}",
            layout.device, spec.device
        ));
    }
    let events_expected = match layout.device {
        Device::Cpu => 0,
        Device::Cuda(_) => layout.slot_count as usize,
    };
    if layout.slot_events.len() != events_expected {
        return violation(format!(
            "{} slot event pairs for {} slots on {:?}",
            layout.slot_events.len(),
            layout.slot_count,
            layout.device
        ));
    }
    check_variable_layout(spec, layout)?;
    // The index tensors of variable-length fields follow their values, unrequested.
    let requested: Vec<usize> = (0..layout.fields.len())
        .filter(|&i| !layout.variable.iter().any(|v| usize::from(v.index) == i))
        .collect();
    if !spec.fields.is_empty() && spec.fields.len() != requested.len() {
        return violation(format!(
            "{} fields requested, {} in the layout",
            spec.fields.len(),
            requested.len()
        ));
    }
    let mut extents = Vec::with_capacity(layout.fields.len());
    for (index, field) in layout.fields.iter().enumerate() {
        let request = requested
            .iter()
            .position(|&i| i == index)
            .and_then(|at| spec.fields.get(at));
        if let Some(request) = request {
            if request.name != field.name {
                return violation(format!(
                    "layout field {index} is {:?}, the request's is {:?}",
                    field.name, request.name
                ));
            }
            if request.dtype.is_some_and(|dtype| dtype != field.dtype) {
                return violation(format!(
                    "field {:?} is served as {}, {} was requested",
                    field.name,
                    field.dtype,
                    request.dtype.map_or("", DType::name)
                ));
            }
        }
        if layout.fields[..index].iter().any(|f| f.name == field.name) {
            return violation(format!("field {:?} appears twice", field.name));
        }
        let index_form = layout
            .variable
            .iter()
            .find(|v| usize::from(v.index) == index)
            .map(|v| v.form);
        check_field_layout(spec, layout, field, index_form)?;
        extents.push((field.offset, field.offset + field.batch_bytes));
    }
    extents.sort_unstable();
    if extents.windows(2).any(|pair| pair[0].1 > pair[1].0) {
        return violation("fields overlap within the slot".to_string());
    }
    Ok(())
}

/// Checks the layout's variable-length fields: each asked for in the form the request gave, values
/// of at least one dimension (the length bound), and an `int32` index named after them.
fn check_variable_layout(spec: &StreamSpec, layout: &StreamLayout) -> Result<(), ClientError> {
    let violation = |reason: String| Err(ClientError::Protocol(reason));
    if layout.variable.is_empty() {
        return Ok(());
    }
    for (at, variable) in layout.variable.iter().enumerate() {
        let values = &layout.fields[usize::from(variable.values)];
        let index = &layout.fields[usize::from(variable.index)];
        if layout.variable[..at]
            .iter()
            .any(|v| v.values == variable.values || v.index == variable.index)
        {
            return violation(format!(
                "field {:?} is described twice as variable-length",
                values.name
            ));
        }
        if values.sample_shape.is_empty() {
            return violation(format!(
                "variable-length field {:?} has no length dimension",
                values.name
            ));
        }
        let expected = format!("{}.{}", values.name, variable.form.index_suffix());
        if index.name != expected || index.dtype != DType::I32 || !index.sample_shape.is_empty() {
            return violation(format!(
                "the index of variable-length field {:?} is {:?} {} {:?}, expected {expected:?} int32 []",
                values.name, index.name, index.dtype, index.sample_shape
            ));
        }
        if let Some(asked) = spec.variable.iter().find(|v| v.name == values.name) {
            if asked.form != variable.form {
                return violation(format!(
                    "field {:?} is served {:?}, {:?} was requested",
                    values.name, variable.form, asked.form
                ));
            }
            if asked
                .cap
                .is_some_and(|cap| values.sample_shape[0] > u64::from(cap))
            {
                return violation(format!(
                    "field {:?} holds samples of up to {} elements, above the cap {:?} requested",
                    values.name, values.sample_shape[0], asked.cap
                ));
            }
        }
    }
    Ok(())
}

pub(super) fn check_field_layout(
    spec: &StreamSpec,
    layout: &StreamLayout,
    field: &FieldLayout,
    index_form: Option<BatchForm>,
) -> Result<(), ClientError> {
    let violation = |reason: String| Err(ClientError::Protocol(reason));
    if field.sample_shape.len() >= BATCH_NDIM_MAX {
        return violation(format!(
            "field {:?} has {} sample dimensions; a batch has at most {BATCH_NDIM_MAX} with the batch dimension",
            field.name,
            field.sample_shape.len()
        ));
    }
    if field.offset % FIELD_OFFSET_ALIGN_BYTES != 0 {
        return violation(format!(
            "field {:?} at offset {} is not {FIELD_OFFSET_ALIGN_BYTES}-aligned",
            field.name, field.offset
        ));
    }
    // An index tensor of cumulative offsets has one entry more than the batch.
    let rows = u64::from(spec.batch_size) + u64::from(index_form == Some(BatchForm::Packed));
    let needed = extent_bytes(&field.sample_shape, field.dtype.size_bytes())
        .and_then(|sample| sample.checked_mul(rows));
    if needed.is_none_or(|needed| needed > field.batch_bytes) {
        return violation(format!(
            "field {:?} reserves {} bytes, less than {} samples of {:?} {}",
            field.name, field.batch_bytes, spec.batch_size, field.sample_shape, field.dtype
        ));
    }
    if field
        .offset
        .checked_add(field.batch_bytes)
        .is_none_or(|end| end > layout.slot_bytes)
    {
        return violation(format!(
            "field {:?} at offset {} with {} bytes ends beyond the {}-byte slot",
            field.name, field.offset, field.batch_bytes, layout.slot_bytes
        ));
    }
    Ok(())
}

/// Maps the slots' memory read-only after checking that its descriptor is a memory file sealed
/// against shrinking, large enough for every slot of the layout (checked by [`check_layout`]).
pub(super) fn map_slots(layout: &StreamLayout, fd: OwnedFd) -> Result<HostSlots, ClientError> {
    let bytes = ring_memory_bytes(layout).expect("checked by check_layout");
    let file = File::from(fd);
    let metadata = file.metadata()?;
    if !metadata.file_type().is_file() {
        return Err(ClientError::Protocol(
            "the slots' descriptor is not a memory file".to_string(),
        ));
    }
    if metadata.len() < bytes as u64 {
        return Err(ClientError::Protocol(format!(
            "the slots' memory is {} bytes; {} slots {} bytes apart need {bytes}",
            metadata.len(),
            layout.slot_count,
            layout.slot_stride
        )));
    }
    // A file that shrinks under a mapping turns reads past its new end into SIGBUS; the seal makes
    // the size check above hold for the mapping's lifetime.
    let seals = fcntl(&file, FcntlArg::F_GET_SEALS).map_err(std::io::Error::from)?;
    if !SealFlag::from_bits_truncate(seals).contains(SealFlag::F_SEAL_SHRINK) {
        return Err(ClientError::Protocol(
            "the slots' memory is not sealed against shrinking (F_SEAL_SHRINK)".to_string(),
        ));
    }
    // SAFETY: the mapping is shared with the daemon, which writes a slot while the daemon owns it.
    // The lease rule (docs/PROTOCOL.md, "Slots and leases") guarantees that the daemon never writes
    // a slot while a `Batch` for it exists, and slices of the mapping are only handed out through a
    // `Batch`. The file is at least `bytes` long and sealed against shrinking, so every page of the
    // mapping stays backed.
    let map = unsafe { MmapOptions::new().len(bytes).map(&file) }.map_err(|e| {
        std::io::Error::new(e.kind(), format!("mapping the slots ({bytes} bytes): {e}"))
    })?;
    Ok(HostSlots {
        map,
        stride: layout.slot_stride as usize,
        slot_bytes: layout.slot_bytes as usize,
    })
}
