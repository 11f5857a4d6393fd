//! Conversions between the wire types of `gpufeed_proto::protocol` and the daemon's own: a
//! consumer's [`StreamSpec`] becomes the pipeline's [`StreamRequest`], the serving ledger becomes the
//! `Status` frame. They are here so that only `ipc` knows the wire format.

use gpufeed_proto::protocol::{
    BatchForm, CorruptPolicy as WireCorruptPolicy, DaemonStatus, Device, FieldRequest, Shuffle,
    StreamSpec, Tail as WireTail,
};

use crate::metrics::ServingCounts;
use crate::pipeline::varlen::{VariableForm, VariableSelection};
use crate::pipeline::{
    CorruptPolicy, FieldSelection, ShuffleMode, StreamDevice, StreamRequest, Tail,
};

impl From<&StreamSpec> for StreamRequest {
    fn from(spec: &StreamSpec) -> StreamRequest {
        StreamRequest {
            fields: spec.fields.iter().map(FieldSelection::from).collect(),
            batch_size: spec.batch_size,
            world_size: spec.world_size,
            rank: spec.rank,
            seed: spec.seed,
            epoch: spec.epoch,
            start_cursor: spec.start_cursor,
            shuffle: spec.shuffle.into(),
            tail: spec.tail.into(),
            prefetch: spec.prefetch,
            on_corrupt: spec.on_corrupt.into(),
            device: spec.device.into(),
            variable: spec
                .variable
                .iter()
                .map(|v| VariableSelection {
                    name: v.name.clone(),
                    form: match v.form {
                        BatchForm::Padded => VariableForm::Padded,
                        BatchForm::Packed => VariableForm::Packed,
                    },
                    cap: v.cap,
                })
                .collect(),
        }
    }
}

impl From<&FieldRequest> for FieldSelection {
    fn from(request: &FieldRequest) -> FieldSelection {
        FieldSelection {
            name: request.name.clone(),
            dtype: request.dtype,
        }
    }
}

impl From<Shuffle> for ShuffleMode {
    /// A window of zero shards stays one: the plan refuses it with a message naming the request.
    fn from(shuffle: Shuffle) -> ShuffleMode {
        match shuffle {
            Shuffle::None => ShuffleMode::None,
            Shuffle::Window(shards) => ShuffleMode::Window { shards },
            Shuffle::Full => ShuffleMode::Full,
        }
    }
}

impl From<WireTail> for Tail {
    fn from(tail: WireTail) -> Tail {
        match tail {
            WireTail::Drop => Tail::Drop,
            WireTail::Pad => Tail::Pad,
        }
    }
}

impl From<WireCorruptPolicy> for CorruptPolicy {
    fn from(policy: WireCorruptPolicy) -> CorruptPolicy {
        match policy {
            WireCorruptPolicy::Fail => CorruptPolicy::Fail,
            WireCorruptPolicy::Replace => CorruptPolicy::Replace,
        }
    }
}

impl From<Device> for StreamDevice {
    fn from(device: Device) -> StreamDevice {
        match device {
            Device::Cpu => StreamDevice::Host,
            Device::Cuda(ordinal) => StreamDevice::Cuda(ordinal),
        }
    }
}

/// The `Status` frame's counters from the serving ledger (session and stream counts are bounded by
/// `sessions_max`, a `u32`).
pub(crate) fn daemon_status(counts: ServingCounts) -> DaemonStatus {
    DaemonStatus {
        sessions: u32::try_from(counts.sessions).unwrap_or(u32::MAX),
        streams: u32::try_from(counts.streams).unwrap_or(u32::MAX),
        slots_allocated: counts.slots_allocated,
        slot_bytes_allocated: counts.slot_bytes_allocated,
        batches_served: counts.batches_served,
        samples_replaced: counts.samples_replaced,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_converts_field_by_field() {
        let mut spec = StreamSpec::new("demo", 32);
        spec.fields = vec![FieldRequest {
            name: "x".into(),
            dtype: None,
        }];
        spec.world_size = 4;
        spec.rank = 3;
        spec.seed = 9;
        spec.epoch = 2;
        spec.start_cursor = 64;
        spec.shuffle = Shuffle::Window(0);
        spec.tail = WireTail::Pad;
        spec.prefetch = 5;
        spec.on_corrupt = WireCorruptPolicy::Replace;
        spec.device = Device::Cuda(1);
        let request = StreamRequest::from(&spec);
        assert_eq!(
            request,
            StreamRequest {
                fields: vec![FieldSelection {
                    name: "x".into(),
                    dtype: None
                }],
                batch_size: 32,
                world_size: 4,
                rank: 3,
                seed: 9,
                epoch: 2,
                start_cursor: 64,
                shuffle: ShuffleMode::Window { shards: 0 },
                tail: Tail::Pad,
                prefetch: 5,
                on_corrupt: CorruptPolicy::Replace,
                device: StreamDevice::Cuda(1),
                variable: Vec::new(),
            }
        );
    }
}
