//! Which GPU serves a stream: the consumer names a device by its own ordinal and, since the
//! `device_uuid` field of `OpenStream`, by the device's UUID too. Ordinals depend on each process's
//! `CUDA_VISIBLE_DEVICES` (and `CUDA_DEVICE_ORDER`), so a consumer's `cuda:0` can be the daemon's
//! `cuda:3`; the UUID is the same in every process. A request with a UUID is served by the backend
//! whose device has that UUID; one without keeps the ordinal's meaning (the daemon's ordinal).

use std::sync::Arc;

use gpufeed_proto::protocol::{Device, DeviceUuid, StreamSpec};

use crate::pipeline::{GpuBackend, StreamBackend, StreamDevice};

/// The consumer's GPU is not one this daemon serves. The message names the consumer's device, its
/// UUID, and what the daemon serves.
#[derive(Debug, thiserror::Error)]
#[error(
    "device cuda:{asked} of the consumer is {uuid}, which this daemon does not serve: {served}"
)]
pub struct UnservedDevice {
    /// The consumer's ordinal.
    pub asked: u32,
    /// The UUID it gave.
    pub uuid: DeviceUuid,
    /// What the daemon serves, in words.
    pub served: String,
}

/// One GPU the daemon serves, as far as choosing is concerned: its ordinal in the daemon and its
/// UUID (`None` where the driver could not say).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServedGpu {
    /// The daemon's ordinal.
    pub ordinal: u32,
    /// The device's UUID.
    pub uuid: Option<DeviceUuid>,
}

/// The position in `served` of the GPU with `uuid`, which the consumer calls `cuda:asked`.
pub fn position_by_uuid(
    asked: u32,
    uuid: DeviceUuid,
    served: &[ServedGpu],
) -> Result<usize, UnservedDevice> {
    served
        .iter()
        .position(|gpu| gpu.uuid == Some(uuid))
        .ok_or_else(|| UnservedDevice {
            asked,
            uuid,
            served: if served.is_empty() {
                "it runs the CPU backend".to_string()
            } else {
                let listed: Vec<String> = served
                    .iter()
                    .map(|gpu| match gpu.uuid {
                        Some(uuid) => format!("cuda:{} ({uuid})", gpu.ordinal),
                        None => format!("cuda:{} (UUID unknown)", gpu.ordinal),
                    })
                    .collect();
                format!("it serves {}", listed.join(", "))
            },
        })
}

/// The backend of `gpus` that serves the stream `spec` asks for: by the device's UUID where the
/// request carries one, else by ordinal ([`StreamBackend::select`]). The error is the message for
/// the consumer.
pub fn stream_backend<'a>(
    spec: &StreamSpec,
    gpus: &'a [Arc<GpuBackend>],
) -> Result<StreamBackend<'a>, String> {
    match (spec.device, spec.device_uuid) {
        (Device::Cuda(asked), Some(uuid)) => {
            let served: Vec<ServedGpu> = gpus
                .iter()
                .map(|gpu| ServedGpu {
                    ordinal: gpu.ordinal,
                    uuid: gpu.device.properties().uuid.map(DeviceUuid),
                })
                .collect();
            let position = position_by_uuid(asked, uuid, &served).map_err(|e| e.to_string())?;
            Ok(StreamBackend::Gpu(&gpus[position]))
        }
        (device, _) => {
            StreamBackend::select(StreamDevice::from(device), gpus).map_err(|e| e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uuid(last: u8) -> DeviceUuid {
        let mut bytes = [0x11u8; 16];
        bytes[15] = last;
        DeviceUuid(bytes)
    }

    /// A node of four GPUs where the daemon sees all of them and a consumer with
    /// `CUDA_VISIBLE_DEVICES=2,3` calls the daemon's cuda:2 its cuda:0 and cuda:3 its cuda:1.
    fn four_gpus() -> Vec<ServedGpu> {
        (0..4)
            .map(|ordinal| ServedGpu {
                ordinal,
                uuid: Some(uuid(ordinal as u8)),
            })
            .collect()
    }

    #[test]
    fn a_consumer_ordinal_is_served_on_the_gpu_with_its_uuid() {
        let served = four_gpus();
        assert_eq!(position_by_uuid(0, uuid(2), &served).unwrap(), 2);
        assert_eq!(position_by_uuid(1, uuid(3), &served).unwrap(), 3);
        // The same UUID whatever ordinal the consumer has for it.
        assert_eq!(position_by_uuid(7, uuid(3), &served).unwrap(), 3);
    }

    #[test]
    fn a_daemon_serving_a_subset_finds_the_gpu_by_uuid_not_position() {
        // The daemon runs with CUDA_VISIBLE_DEVICES=1,3: its cuda:0 and cuda:1.
        let served = [
            ServedGpu {
                ordinal: 0,
                uuid: Some(uuid(1)),
            },
            ServedGpu {
                ordinal: 1,
                uuid: Some(uuid(3)),
            },
        ];
        assert_eq!(position_by_uuid(0, uuid(3), &served).unwrap(), 1);
        assert_eq!(position_by_uuid(1, uuid(1), &served).unwrap(), 0);
    }

    #[test]
    fn an_unserved_uuid_is_refused_naming_it_and_what_is_served() {
        let served = [
            ServedGpu {
                ordinal: 0,
                uuid: Some(uuid(1)),
            },
            ServedGpu {
                ordinal: 1,
                uuid: None,
            },
        ];
        let error = position_by_uuid(0, uuid(9), &served)
            .unwrap_err()
            .to_string();
        assert!(error.contains(&format!("cuda:0 of the consumer is {}", uuid(9))));
        assert!(error.contains(&format!("cuda:0 ({})", uuid(1))), "{error}");
        assert!(error.contains("cuda:1 (UUID unknown)"), "{error}");
        let none = position_by_uuid(0, uuid(9), &[]).unwrap_err().to_string();
        assert!(none.ends_with("it runs the CPU backend"), "{none}");
    }

    #[test]
    fn requests_without_a_uuid_keep_the_ordinal_meaning() {
        let mut spec = StreamSpec::new("set", 4);
        assert!(matches!(
            stream_backend(&spec, &[]).unwrap(),
            StreamBackend::Cpu
        ));
        spec.device = Device::Cuda(1);
        let Err(error) = stream_backend(&spec, &[]) else {
            panic!("served without a GPU");
        };
        assert!(error.contains("cuda:1"), "{error}");
        spec.device_uuid = Some(uuid(1));
        let Err(error) = stream_backend(&spec, &[]) else {
            panic!("served without a GPU");
        };
        assert!(error.contains(&uuid(1).to_string()), "{error}");
    }
}
