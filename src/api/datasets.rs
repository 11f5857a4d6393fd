//! `/v1/datasets`: register, pack, list, inspect, remove and verify datasets.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::error::blocking;
use super::error::{ApiError, ApiJson, ApiPath, ApiQuery, ErrorBody};
use super::jobs::{self, JobView, PackSource};
use super::state::{rfc3339, unix_now, Control, DatasetState};
use crate::catalog::{CatalogError, DatasetRecord, Origin};
use crate::format::{validate_dataset_name, Dataset};
use crate::registry::CloseReason;
use crate::tools::{self, NoProgress};

/// Most problems a verification lists; the count says how many there were in all.
pub const VERIFY_PROBLEMS_LISTED_MAX: usize = 1000;

/// `POST /v1/datasets`: register an already-packed directory (`path`) or pack one (`source`).
#[derive(Clone, Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateDataset {
    /// The dataset's name (1 to 128 ASCII letters, digits, `_`, `-`, `.`, not starting with `.`).
    /// A registered directory's manifest must carry the same name; a packed dataset is written to
    /// `DATA_ROOT/<name>`.
    pub name: String,
    /// An already-packed dataset directory under the data root (relative to it, or absolute under
    /// it), or the URL of one in object storage (`s3://bucket/prefix`, `gs://...`, `az://...`,
    /// `file:///...`), served through the node's object cache. Give this or `source`.
    #[serde(default)]
    pub path: Option<String>,
    /// Inputs under the data root and pack options: starts a pack job. Give this or `path`.
    #[serde(default)]
    pub source: Option<PackSource>,
}

/// A dataset's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DatasetStateName {
    /// Registered and served.
    Ready,
    /// Its files vanished.
    Missing,
    /// It no longer opens (corrupt, renamed inside, or outside the data root).
    Invalid,
    /// A file of it cannot be read (permissions, an I/O error): not corruption.
    Unreadable,
}

impl From<DatasetState> for DatasetStateName {
    fn from(state: DatasetState) -> DatasetStateName {
        match state {
            DatasetState::Ready => DatasetStateName::Ready,
            DatasetState::Missing => DatasetStateName::Missing,
            DatasetState::Invalid => DatasetStateName::Invalid,
            DatasetState::Unreadable => DatasetStateName::Unreadable,
        }
    }
}

/// How a dataset came into the catalog.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OriginName {
    /// Registered through the API.
    Registered,
    /// Written by a pack job.
    Packed,
    /// Found by the start-up scan of the data root.
    Scanned,
    /// In object storage, given with `--dataset` (or `datasets` in the configuration) at start:
    /// not kept in the catalog, and registered again at each start that names it.
    Configured,
}

impl From<Origin> for OriginName {
    fn from(origin: Origin) -> OriginName {
        match origin {
            Origin::Registered => OriginName::Registered,
            Origin::Packed => OriginName::Packed,
            Origin::Scanned => OriginName::Scanned,
            Origin::Configured => OriginName::Configured,
        }
    }
}

/// A dataset in the catalog.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct DatasetView {
    /// The name consumers open it by.
    pub name: String,
    /// Its directory, relative to the data root.
    pub path: String,
    /// Whether it is served.
    pub state: DatasetStateName,
    /// Why it is not served.
    pub error: Option<String>,
    /// How it came into the catalog.
    pub origin: OriginName,
    /// When it was registered (RFC 3339).
    pub registered_at: String,
    /// The pack job that wrote it.
    pub job: Option<u64>,
    /// Samples, when ready.
    pub samples: Option<u64>,
    /// Shard files, when ready.
    pub shards: Option<u64>,
    /// Field names, when ready.
    pub fields: Option<Vec<String>>,
    /// References held by readers (each open stream holds at least one).
    pub references: u64,
}

/// Every dataset in the catalog.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct DatasetList {
    /// By name.
    pub datasets: Vec<DatasetView>,
}

/// A dataset with its `gpufeed inspect` summary.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct DatasetDetail {
    /// The catalog entry.
    pub dataset: DatasetView,
    /// `gpufeed inspect`'s summary (fields, dtypes, shapes, bytes, ratios, codec counts) when the
    /// dataset is ready; `null` otherwise.
    #[schema(value_type = Option<Object>)]
    pub summary: Option<serde_json::Value>,
}

/// What a removal did.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct RemovedDataset {
    /// The dataset.
    pub name: String,
    /// Its directory, relative to the data root: left on disk, and not registered again by the
    /// start-up scan.
    pub path: String,
    /// Streams closed (with `force`).
    pub streams_closed: u64,
    /// References readers still held when it was removed (with `force`): streams the socket server
    /// could not be asked to close read on until they end.
    pub references_left: u64,
}

/// What a verification found.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct VerifyView {
    /// The dataset.
    pub name: String,
    /// True when every checksum matched and every block decoded.
    pub ok: bool,
    /// Shards in the manifest.
    pub shards_total: u64,
    /// Shards whose metadata opened.
    pub shards_ok: u64,
    /// Blocks intact.
    pub blocks_ok: u64,
    /// Problems found, each naming the shard, field and block (at most 1000 listed).
    pub problems: Vec<String>,
    /// Problems found in all.
    pub problems_total: u64,
}

/// Query of `DELETE /v1/datasets/{name}`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct RemoveQuery {
    /// Remove the dataset even while streams read it, closing them.
    pub force: Option<bool>,
}

pub(crate) fn dataset_view(control: &Control, name: &str, record: &DatasetRecord) -> DatasetView {
    let (state, error) = control.dataset_state(name);
    let dataset = (state == DatasetState::Ready)
        .then(|| control.registry.get(name))
        .flatten();
    let references = control
        .registry
        .references(name)
        .unwrap_or(0)
        .saturating_sub(usize::from(dataset.is_some()));
    DatasetView {
        name: name.to_string(),
        path: record.path.clone(),
        state: state.into(),
        error,
        origin: record.origin.into(),
        registered_at: rfc3339(record.registered_at_unix_s),
        job: record.job,
        samples: dataset.as_ref().map(|d| d.manifest.sample_count),
        shards: dataset.as_ref().map(|d| d.manifest.shards.len() as u64),
        fields: dataset
            .as_ref()
            .map(|d| d.manifest.fields.iter().map(|f| f.name.clone()).collect()),
        references: references as u64,
    }
}

fn record_of(control: &Control, name: &str) -> Result<DatasetRecord, ApiError> {
    control
        .catalog
        .read(|data| data.datasets.get(name).cloned())
        .or_else(|| configured_record(control, name))
        .ok_or_else(|| ApiError::not_found(format!("no dataset named '{name}' in the catalog")))
}

/// The record of a dataset in object storage given with `--dataset` at start, which the catalog
/// does not keep.
fn configured_record(control: &Control, name: &str) -> Option<DatasetRecord> {
    let remote = control.registry.remote(name)?;
    Some(DatasetRecord {
        path: remote.url().to_string(),
        origin: Origin::Configured,
        registered_at_unix_s: remote
            .registered_at()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| since.as_secs()),
        job: None,
    })
}

fn location(path: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Ok(value) = HeaderValue::from_str(path) {
        headers.insert(header::LOCATION, value);
    }
    headers
}

/// Registers an already-packed dataset (`path`, answered 201 with the dataset) or starts a pack job
/// (`source`, answered 202 with the job).
#[utoipa::path(
    post, path = "/v1/datasets", tag = "datasets", operation_id = "create_dataset",
    request_body(
        content = CreateDataset,
        content_type = "application/json",
        examples(
            ("register" = (
                summary = "Register an already-packed dataset",
                value = json!({"name": "nested-ds", "path": "nested/nested-ds"})
            )),
            ("pack" = (
                summary = "Pack .npy files into a new dataset",
                value = json!({
                    "name": "fresh",
                    "source": {
                        "fields": [{"name": "tokens", "npy": ["x.npy"]}],
                        "block_bytes": 65536,
                        "codec": "auto",
                        "shuffle_filter": "auto"
                    }
                })
            ))
        )
    ),
    responses(
        (status = 201, description = "Registered", body = DatasetView,
            headers(("location" = String, description = "The dataset's URL")),
            links(
                ("GetDataset" = (operation_id = "get_dataset", parameters(("name" = "$response.body#/name")))),
                ("VerifyDataset" = (operation_id = "verify_dataset", parameters(("name" = "$response.body#/name")))),
                ("RemoveDataset" = (operation_id = "remove_dataset", parameters(("name" = "$response.body#/name"))))
            )),
        (status = 202, description = "Pack job started", body = JobView,
            headers(("location" = String, description = "The job's URL")),
            links(
                ("GetJob" = (operation_id = "get_job", parameters(("id" = "$response.body#/id")))),
                ("CancelJob" = (operation_id = "cancel_job", parameters(("id" = "$response.body#/id"))))
            )),
        (status = 400, description = "Malformed JSON, unknown fields, a bad name or options, a \
            missing path or an unreadable input", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 403, description = "A path is outside the data root", body = ErrorBody),
        (status = 409, description = "The name is taken or its directory exists", body = ErrorBody),
        (status = 413, description = "The body is too large", body = ErrorBody),
        (status = 415, description = "The body is not JSON", body = ErrorBody),
        (status = 422, description = "The directory is not a valid dataset", body = ErrorBody),
        (status = 429, description = "Too many pack jobs", body = ErrorBody),
        (status = 503, description = "The daemon is shutting down", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn create(
    State(control): State<Arc<Control>>,
    ApiJson(request): ApiJson<CreateDataset>,
) -> Result<Response, ApiError> {
    validate_dataset_name(&request.name)
        .map_err(|reason| ApiError::bad_request(format!("name: {reason}")))?;
    match (request.path, request.source) {
        (Some(path), None) => {
            let view = register(&control, request.name, path).await?;
            let headers = location(&format!("/v1/datasets/{}", view.name));
            Ok((StatusCode::CREATED, headers, Json(view)).into_response())
        }
        (None, Some(source)) => {
            let view = jobs::submit(&control, request.name, source).await?;
            let headers = location(&format!("/v1/jobs/{}", view.id));
            Ok((StatusCode::ACCEPTED, headers, Json(view)).into_response())
        }
        _ => Err(ApiError::bad_request(
            "give exactly one of `path` (register an already-packed dataset) and `source` (pack one)",
        )),
    }
}

async fn register(
    control: &Arc<Control>,
    name: String,
    path: String,
) -> Result<DatasetView, ApiError> {
    if crate::remote::is_object_url(&path) {
        return register_remote(control, name, path).await;
    }
    let confined = control.root.resolve_existing(&path)?;
    let _reservation = control.reserve(&name)?;
    control.check_name_free(&name)?;
    let relative = confined.relative.to_string_lossy().into_owned();
    if let Some(other) = control.catalog.read(|data| {
        data.datasets
            .iter()
            .find(|(_, record)| record.path == relative)
            .map(|(other, _)| other.clone())
    }) {
        return Err(ApiError::conflict(format!(
            "{relative} is already registered as '{other}'"
        )));
    }
    // A FIFO, a device or a file where the directory should be: said plainly (opening its manifest
    // would report only "Not a directory", or nothing useful for a FIFO).
    if !confined.absolute.is_dir() {
        return Err(ApiError::bad_request(format!(
            "{relative} is not a directory: a dataset is a directory holding its manifest and shards"
        )));
    }
    let dir = confined.absolute.clone();
    let dataset = blocking(move || Dataset::open(&dir))
        .await?
        .map_err(|error| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_dataset",
                error.to_string(),
            )
        })?;
    if dataset.manifest.name != name {
        return Err(ApiError::bad_request(format!(
            "the manifest at {relative} names the dataset '{}', not '{name}'",
            dataset.manifest.name
        )));
    }
    let record = DatasetRecord {
        path: relative.clone(),
        origin: Origin::Registered,
        registered_at_unix_s: unix_now(),
        job: None,
    };
    {
        let (control, name, record) = (Arc::clone(control), name.clone(), record.clone());
        blocking(move || {
            control.catalog.update(|data| {
                data.unregistered.remove(&record.path);
                data.datasets.insert(name, record);
                Ok::<_, CatalogError>(())
            })
        })
        .await??;
    }
    control
        .registry
        .insert_shared(Arc::new(dataset))
        .map_err(ApiError::conflict)?;
    control.clear_problem(&name);
    Ok(dataset_view(control, &name, &record))
}

/// Registers the dataset in object storage at `url`: its manifest and shard metadata are read now
/// (a missing bucket or manifest, refused credentials: 422 naming the URL); its shards are fetched
/// into the node's cache when a stream needs them.
async fn register_remote(
    control: &Arc<Control>,
    name: String,
    url: String,
) -> Result<DatasetView, ApiError> {
    let url = url.trim_end_matches('/').to_string();
    let _reservation = control.reserve(&name)?;
    control.check_name_free(&name)?;
    if let Some(other) = control.catalog.read(|data| {
        data.datasets
            .iter()
            .find(|(_, record)| record.path == url)
            .map(|(other, _)| other.clone())
    }) {
        return Err(ApiError::conflict(format!(
            "{url} is already registered as '{other}'"
        )));
    }
    let (remote, dataset) = {
        let (control, name, url) = (Arc::clone(control), name.clone(), url.clone());
        blocking(move || {
            control.registry.open_remote(&name, &url).map_err(|reason| {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_dataset", reason)
            })
        })
        .await??
    };
    let record = DatasetRecord {
        path: url,
        origin: Origin::Registered,
        registered_at_unix_s: unix_now(),
        job: None,
    };
    {
        let (control, name, record) = (Arc::clone(control), name.clone(), record.clone());
        blocking(move || {
            control.catalog.update(|data| {
                data.datasets.insert(name, record);
                Ok::<_, CatalogError>(())
            })
        })
        .await??;
    }
    control
        .registry
        .insert_remote(dataset, remote)
        .map_err(ApiError::conflict)?;
    control.clear_problem(&name);
    Ok(dataset_view(control, &name, &record))
}

/// Lists every dataset in the catalog with its state; a dataset whose files vanished is listed as
/// `missing`.
#[utoipa::path(
    get, path = "/v1/datasets", tag = "datasets", operation_id = "list_datasets",
    responses(
        (status = 200, description = "The datasets", body = DatasetList),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
    ),
    security((), ("bearer" = []))
)]
pub async fn list(State(control): State<Arc<Control>>) -> Json<DatasetList> {
    let mut records: Vec<(String, DatasetRecord)> = control.catalog.read(|data| {
        data.datasets
            .iter()
            .map(|(n, r)| (n.clone(), r.clone()))
            .collect()
    });
    for name in control.registry.remote_names() {
        if !records.iter().any(|(listed, _)| *listed == name) {
            if let Some(record) = configured_record(&control, &name) {
                records.push((name, record));
            }
        }
    }
    records.sort_by(|a, b| a.0.cmp(&b.0));
    let datasets = records
        .iter()
        .map(|(name, record)| dataset_view(&control, name, record))
        .collect();
    Json(DatasetList { datasets })
}

/// One dataset: its catalog entry and `gpufeed inspect`'s summary.
#[utoipa::path(
    get, path = "/v1/datasets/{name}", tag = "datasets", operation_id = "get_dataset",
    params(("name" = String, Path, description = "The dataset name")),
    responses(
        (status = 200, description = "The dataset", body = DatasetDetail),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such dataset", body = ErrorBody),
    ),
    security((), ("bearer" = []))
)]
pub async fn get_one(
    State(control): State<Arc<Control>>,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<DatasetDetail>, ApiError> {
    let record = record_of(&control, &name)?;
    let view = dataset_view(&control, &name, &record);
    let summary = match (view.state, control.registry.get(&name)) {
        (DatasetStateName::Ready, Some(dataset)) => {
            Some(blocking(move || tools::inspect(&dataset)).await?)
        }
        _ => None,
    };
    Ok(Json(DatasetDetail {
        dataset: view,
        summary,
    }))
}

/// Unregisters a dataset; its files stay on disk. Refused with 409 `in_use` while streams read it,
/// unless `force=true`, which closes them.
/// How long a forced removal waits for the streams it closed to let go of the dataset.
const CLOSED_STREAMS_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

#[utoipa::path(
    delete, path = "/v1/datasets/{name}", tag = "datasets", operation_id = "remove_dataset",
    params(("name" = String, Path, description = "The dataset name"), RemoveQuery),
    responses(
        (status = 200, description = "Removed", body = RemovedDataset),
        (status = 400, description = "The query is malformed", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such dataset", body = ErrorBody),
        (status = 409, description = "Streams read it (`in_use`), or another request changes it", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn remove(
    State(control): State<Arc<Control>>,
    ApiPath(name): ApiPath<String>,
    ApiQuery(query): ApiQuery<RemoveQuery>,
) -> Result<Json<RemovedDataset>, ApiError> {
    let _reservation = control.reserve(&name)?;
    let record = record_of(&control, &name)?;
    let force = query.force.unwrap_or(false);
    let (removed, streams_closed) = if force {
        let removed = control.registry.remove(&name);
        let closed = control
            .registry
            .sessions()
            .close_streams_on(&name, CloseReason::DatasetRemoved);
        (removed, closed)
    } else {
        match control.registry.remove_unused(&name) {
            Ok(removed) => (removed, 0),
            Err(in_use) => {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "in_use",
                    format!(
                        "dataset '{name}' is read by open streams ({} references); retry when \
                         they have ended, or pass force=true to close them",
                        in_use.references
                    ),
                ))
            }
        }
    };
    // Closed streams let go of the dataset when their session threads have stopped them, just after
    // the close: wait for that (bounded), so that the count says what is still reading it rather
    // than what was about to stop.
    let references_left = match &removed {
        Some(dataset) if streams_closed > 0 => {
            let dataset = Arc::clone(dataset);
            blocking(move || {
                let deadline = std::time::Instant::now() + CLOSED_STREAMS_WAIT;
                while Arc::strong_count(&dataset) > 2 && std::time::Instant::now() < deadline {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Ok::<_, ApiError>(Arc::strong_count(&dataset) - 2)
            })
            .await??
        }
        Some(dataset) => Arc::strong_count(dataset) - 1,
        None => 0,
    };
    let written = {
        let (control, name, path) = (Arc::clone(&control), name.clone(), record.path.clone());
        blocking(move || {
            let on_disk = control.root.canonical().join(&path).exists();
            control.catalog.update(|data| {
                data.datasets.remove(&name);
                if on_disk {
                    data.unregistered.insert(path);
                }
                Ok::<_, CatalogError>(())
            })
        })
        .await
    };
    if let Err(error) = written.and_then(|result| result.map_err(ApiError::from)) {
        // The catalog still lists it: serve it again rather than leave the two disagreeing.
        if let Some(dataset) = removed {
            let _ = control.registry.insert_shared(dataset);
        }
        return Err(error);
    }
    control.clear_problem(&name);
    Ok(Json(RemovedDataset {
        name,
        path: record.path,
        streams_closed: streams_closed as u64,
        references_left: references_left as u64,
    }))
}

/// Checks every checksum and decodes every block of a dataset (`gpufeed verify`); answers when done.
#[utoipa::path(
    post, path = "/v1/datasets/{name}/verify", tag = "datasets", operation_id = "verify_dataset",
    params(("name" = String, Path, description = "The dataset name")),
    responses(
        (status = 200, description = "What the verification found", body = VerifyView),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such dataset", body = ErrorBody),
        (status = 409, description = "The dataset is missing or invalid (`dataset_unavailable`)", body = ErrorBody),
        (status = 429, description = "Too many verifications are running", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn verify(
    State(control): State<Arc<Control>>,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<VerifyView>, ApiError> {
    record_of(&control, &name)?;
    let (state, error) = control.dataset_state(&name);
    let dir = match (state, control.registry.get(&name)) {
        (DatasetState::Ready, Some(dataset)) => dataset.dir.clone(),
        _ => {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "dataset_unavailable",
                format!(
                    "dataset '{name}' is {}: {}",
                    state.name(),
                    error.unwrap_or_default()
                ),
            ))
        }
    };
    let _permit = Arc::clone(&control.verify_slots)
        .try_acquire_owned()
        .map_err(|_| {
            ApiError::too_many_requests(
                "the most verifications this daemon runs at once are running; retry later",
            )
        })?;
    let (registry, held) = (Arc::clone(&control.registry), name.clone());
    let report = blocking(move || {
        // A dataset in object storage is verified in the cache, its shards fetched and held
        // there meanwhile.
        let _shards = match (registry.remote(&held), registry.get(&held)) {
            (Some(remote), Some(dataset)) => match remote.acquire(&dataset) {
                Ok(pins) => Some(pins),
                Err(error) => return Ok(Err(error.to_string())),
            },
            _ => None,
        };
        Ok::<_, ApiError>(tools::verify(&dir, &NoProgress).map_err(|error| error.to_string()))
    })
    .await??;
    let (shards_total, shards_ok, blocks_ok, mut problems) = match report {
        Ok(report) => (
            report.shards_total as u64,
            report.shards_ok as u64,
            report.blocks_ok,
            report.problems,
        ),
        Err(error) => (0, 0, 0, vec![error]),
    };
    let problems_total = problems.len() as u64;
    problems.truncate(VERIFY_PROBLEMS_LISTED_MAX);
    Ok(Json(VerifyView {
        name,
        ok: problems_total == 0,
        shards_total,
        shards_ok,
        blocks_ok,
        problems,
        problems_total,
    }))
}

/// What a rescan did.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct RescanReport {
    /// Datasets found under the data root and registered (packed there since the daemon started).
    pub registered: Vec<String>,
    /// Registered datasets packed again in place, read again from disk.
    pub reloaded: Vec<String>,
    /// Directories not registered, and why; datasets that could not be read again, and why.
    pub notes: Vec<String>,
}

/// Looks under the data root again: registers the dataset directories that appeared there since
/// the daemon started (or the last rescan), and reads again the registered datasets packed again in
/// place. Directories removed from the catalog stay removed until registered by path.
#[utoipa::path(
    post, path = "/v1/rescan", tag = "datasets", operation_id = "rescan_datasets",
    responses(
        (status = 200, description = "What the rescan registered and reloaded", body = RescanReport),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn rescan(State(control): State<Arc<Control>>) -> Result<Json<RescanReport>, ApiError> {
    let report = blocking(move || {
        let mut notes = Vec::new();
        let mut registered = Vec::new();
        control.catalog.update(|data| {
            let before: std::collections::BTreeSet<String> =
                data.datasets.keys().cloned().collect();
            super::state::scan(&control.root, &control.registry, data, &mut notes);
            registered = data
                .datasets
                .keys()
                .filter(|name| !before.contains(*name))
                .cloned()
                .collect();
            Ok::<_, CatalogError>(())
        })?;
        let mut reloaded = Vec::new();
        for name in control.registry.names() {
            let Some(dataset) = control.registry.get(&name) else {
                continue;
            };
            if let Some(crate::format::DiskChange::ManifestChanged(_)) = dataset.disk_change() {
                match control.registry.reload(&name) {
                    Ok(_) => reloaded.push(name),
                    Err(reason) => notes.push(format!("dataset '{name}': {reason}")),
                }
            }
        }
        Ok::<_, ApiError>(RescanReport {
            registered,
            reloaded,
            notes,
        })
    })
    .await??;
    Ok(Json(report))
}
