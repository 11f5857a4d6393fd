//! The device-memory tier of each served GPU (`--device-cache`): what it holds, and pins and
//! evictions by dataset name. The tier itself is the pipeline's (`pipeline::gpu::tier`); the daemon
//! attaches each device's to the control state.

use std::sync::Arc;

use axum::extract::{Path as ApiPath, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{ApiError, ErrorBody};
use super::state::Control;
use crate::pipeline::gpu::DeviceTier;

/// One dataset in a device's memory tier.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct DeviceCacheDataset {
    /// The registered name of the dataset, or its directory when no dataset of the registry lives
    /// there any more.
    pub name: String,
    /// Device bytes it holds: its shard files as stored, or, for a dataset with compressed
    /// blocks, every field decoded (`decoded`).
    pub bytes: u64,
    /// Whether its compressed blocks are held decoded (decoded once, when it was admitted).
    #[serde(default)]
    pub decoded: bool,
    /// `resident` (whole in device memory), `filling` (its first stream is copying it), `retiring`
    /// (evicted; freed when the streams reading it close) or `pinned` (pinned, not read yet).
    pub state: String,
    /// Whether it is pinned: never evicted to make room for another dataset.
    pub pinned: bool,
    /// Streams reading it now.
    pub streams: u64,
}

/// A device's memory tier.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct DeviceCacheView {
    /// `cuda:N` (the daemon's ordinal).
    pub device: String,
    /// The budget (`--device-cache`); 0: the tier is off.
    pub bytes_max: u64,
    /// Device bytes held (datasets evicted while streams read them included).
    pub held_bytes: u64,
    /// The datasets it holds, least recently used first.
    pub datasets: Vec<DeviceCacheDataset>,
    /// Streams that found their dataset whole in the tier when they opened.
    pub hits: u64,
    /// Streams that admitted their dataset and filled it.
    pub admissions: u64,
    /// Streams whose dataset fitted the budget but found no room (the others pinned or read) or no
    /// device memory: served without the tier.
    pub declined: u64,
    /// Datasets evicted (for room, through this API, or re-packed in place).
    pub evictions: u64,
    /// Datasets with compressed blocks that the tier does not take (off, too small or full),
    /// decoded whole for the streams of this device reading them now, and freed when the last of
    /// them closes.
    #[serde(default)]
    pub decoded_for_streams: Vec<DeviceCacheDataset>,
    /// The memory those may take (`--device-shard-memory`; 0: none, `GPUFEED_DECODE_WHOLE=off`).
    #[serde(default)]
    pub decoded_for_streams_bytes_max: u64,
    /// Such datasets too large for that memory (or finding no room there), decoded whole into
    /// page-locked host memory mapped for this device instead (`bytes` are host bytes).
    #[serde(default)]
    pub decoded_in_host_memory: Vec<DeviceCacheDataset>,
    /// The host memory those may take (this device's share of `--host-decoded-memory`; 0: none).
    #[serde(default)]
    pub decoded_in_host_memory_bytes_max: u64,
}

/// The views of every served device's tier.
pub(crate) fn views(control: &Control) -> Vec<DeviceCacheView> {
    control
        .device_tiers()
        .iter()
        .map(|t| view(control, t))
        .collect()
}

fn view(control: &Control, tier: &DeviceTier) -> DeviceCacheView {
    let report = tier.report();
    let held = tier.held_report();
    let host_held = tier.host_held_report();
    let names: Vec<(String, std::path::PathBuf)> = control
        .registry
        .names()
        .into_iter()
        .filter_map(|name| control.registry.get(&name).map(|d| (name, d.dir.clone())))
        .collect();
    let datasets = |report: &crate::pipeline::gpu::tier::TierReport| -> Vec<DeviceCacheDataset> {
        report
            .datasets
            .iter()
            .map(|d| DeviceCacheDataset {
                name: names
                    .iter()
                    .find(|(_, dir)| *dir == d.dir)
                    .map_or_else(|| d.dir.display().to_string(), |(name, _)| name.clone()),
                bytes: d.bytes,
                decoded: d.decoded,
                state: d.state.to_string(),
                pinned: d.pinned,
                streams: d.streams,
            })
            .collect()
    };
    DeviceCacheView {
        device: format!("cuda:{}", tier.ordinal()),
        bytes_max: report.bytes_max,
        held_bytes: report.held_bytes,
        datasets: datasets(&report),
        hits: report.hits,
        admissions: report.admissions,
        declined: report.declined,
        evictions: report.evictions,
        decoded_for_streams: datasets(&held),
        decoded_for_streams_bytes_max: held.bytes_max,
        decoded_in_host_memory: datasets(&host_held),
        decoded_in_host_memory_bytes_max: host_held.bytes_max,
    }
}

/// The tier of `device` (`cuda:N` or `N`): 404 when the daemon serves no such GPU, 409 when its
/// tier is off.
fn tier_of(control: &Control, device: &str) -> Result<Arc<DeviceTier>, ApiError> {
    let tier = device_tier(control, device)?;
    if !tier.is_enabled() {
        return Err(ApiError::new(
            axum::http::StatusCode::CONFLICT,
            "device_cache_off",
            format!("the device-memory tier of {device} is off: start the daemon with --device-cache BYTES"),
        ));
    }
    Ok(tier)
}

/// The tier of `device` (`cuda:N` or `N`), on or off: 404 when the daemon serves no such GPU.
fn device_tier(control: &Control, device: &str) -> Result<Arc<DeviceTier>, ApiError> {
    let ordinal: Option<u32> = device.strip_prefix("cuda:").unwrap_or(device).parse().ok();
    let Some(tier) = ordinal.and_then(|o| {
        control
            .device_tiers()
            .iter()
            .find(|t| t.ordinal() == o)
            .cloned()
    }) else {
        let served: Vec<String> = control
            .device_tiers()
            .iter()
            .map(|t| format!("cuda:{}", t.ordinal()))
            .collect();
        return Err(ApiError::not_found(format!(
            "device '{device}' is not served by this daemon (it serves: {})",
            if served.is_empty() {
                "no GPU".to_string()
            } else {
                served.join(", ")
            }
        )));
    };
    Ok(tier)
}

/// The directory of registered dataset `name`; 404 when there is none.
fn dataset_dir(control: &Control, name: &str) -> Result<std::path::PathBuf, ApiError> {
    control
        .registry
        .get(name)
        .map(|d| d.dir.clone())
        .ok_or_else(|| ApiError::not_found(format!("no dataset named '{name}' is registered")))
}

/// Applies `apply` to the tier of `device` and the directory of dataset `name`, then answers the
/// tier's view: what pinning, unpinning and evicting share.
fn change(
    control: &Control,
    device: &str,
    name: &str,
    apply: impl FnOnce(&DeviceTier, &std::path::Path) -> Result<(), ApiError>,
) -> Result<Json<DeviceCacheView>, ApiError> {
    let tier = tier_of(control, device)?;
    let dir = dataset_dir(control, name)?;
    apply(&tier, &dir)?;
    Ok(Json(view(control, &tier)))
}

/// What a device's memory tier holds.
#[utoipa::path(
    get, path = "/v1/devices/{device}/cache", tag = "daemon", operation_id = "get_device_cache",
    params(("device" = String, Path, description = "`cuda:N` or `N`: a GPU the daemon serves")),
    responses(
        (status = 200, description = "The device's memory tier", body = DeviceCacheView),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "The daemon serves no such device", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_one(
    State(control): State<Arc<Control>>,
    ApiPath(device): ApiPath<String>,
) -> Result<Json<DeviceCacheView>, ApiError> {
    // Answered with the tier off too (`bytes_max` 0): the datasets decoded for their streams are
    // there.
    let tier = device_tier(&control, &device)?;
    Ok(Json(view(&control, &tier)))
}

/// Pins a dataset to a device's memory tier: never evicted to make room for another. It is kept
/// in device memory from its next stream on that device (filled while that stream's first epoch
/// runs), if it fits the budget.
#[utoipa::path(
    put, path = "/v1/devices/{device}/cache/{name}/pin", tag = "daemon",
    operation_id = "pin_device_cache_dataset",
    params(
        ("device" = String, Path, description = "`cuda:N` or `N`: a GPU the daemon serves"),
        ("name" = String, Path, description = "The dataset name"),
    ),
    responses(
        (status = 200, description = "The device's memory tier", body = DeviceCacheView),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such device or dataset", body = ErrorBody),
        (status = 409, description = "The device's tier is off (`device_cache_off`), or too many pins (`conflict`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn pin(
    State(control): State<Arc<Control>>,
    ApiPath((device, name)): ApiPath<(String, String)>,
) -> Result<Json<DeviceCacheView>, ApiError> {
    change(&control, &device, &name, |tier, dir| {
        tier.set_pinned(dir, true)
            .map_err(|e| ApiError::conflict(e.to_string()))
    })
}

/// Unpins a dataset: it stays in the tier until evicted for room like any other.
#[utoipa::path(
    delete, path = "/v1/devices/{device}/cache/{name}/pin", tag = "daemon",
    operation_id = "unpin_device_cache_dataset",
    params(
        ("device" = String, Path, description = "`cuda:N` or `N`: a GPU the daemon serves"),
        ("name" = String, Path, description = "The dataset name"),
    ),
    responses(
        (status = 200, description = "The device's memory tier", body = DeviceCacheView),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such device or dataset", body = ErrorBody),
        (status = 409, description = "The device's tier is off (`device_cache_off`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn unpin(
    State(control): State<Arc<Control>>,
    ApiPath((device, name)): ApiPath<(String, String)>,
) -> Result<Json<DeviceCacheView>, ApiError> {
    change(&control, &device, &name, |tier, dir| {
        tier.set_pinned(dir, false)
            .map_err(|e| ApiError::conflict(e.to_string()))
    })
}

/// Evicts a dataset from a device's memory tier (and unpins it). Streams reading it go on reading
/// it; its memory is freed when the last of them closes. Later streams read it as without the tier
/// until one of them admits it again.
#[utoipa::path(
    delete, path = "/v1/devices/{device}/cache/{name}", tag = "daemon",
    operation_id = "evict_device_cache_dataset",
    params(
        ("device" = String, Path, description = "`cuda:N` or `N`: a GPU the daemon serves"),
        ("name" = String, Path, description = "The dataset name"),
    ),
    responses(
        (status = 200, description = "The device's memory tier", body = DeviceCacheView),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such device or dataset, or the dataset is not in the tier", body = ErrorBody),
        (status = 409, description = "The device's tier is off (`device_cache_off`)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn evict(
    State(control): State<Arc<Control>>,
    ApiPath((device, name)): ApiPath<(String, String)>,
) -> Result<Json<DeviceCacheView>, ApiError> {
    change(&control, &device, &name, |tier, dir| {
        tier.evict(dir)
            .map_err(|e| ApiError::not_found(format!("dataset '{name}': {e}")))
    })
}
