//! Pack jobs: `POST /v1/datasets` with a `source` starts one; `GET /v1/jobs[/{id}]` reports them and
//! `DELETE /v1/jobs/{id}` cancels one.
//!
//! A job runs [`pack::pack`] on a blocking thread into `DATA_ROOT/<name>`, with an observer that
//! publishes progress, polls the cancel flag and, when configured, holds the pack to a byte rate.
//! At most `jobs_max` jobs run at once; up to `jobs_queued_max` more wait, and beyond that a new job
//! is refused with 429. The pack writes into a hidden staging directory and renames it into place
//! last, so a cancelled or failed job leaves nothing behind, and the job's success (the dataset
//! record and the job record) is one catalog write, so a crash never leaves a half-registered
//! dataset.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use tokio::sync::{watch, Notify};
use utoipa::{IntoParams, ToSchema};

use super::error::blocking;
use super::error::{ApiError, ApiPath, ApiQuery, ErrorBody};
use super::job_table::{JobObserver, LiveJob, StopReason};
use super::state::{remove_staging, rfc3339, unix_now, Control, Reservation};
use crate::catalog::{CatalogData, CatalogError, DatasetRecord, JobRecord, JobState, Origin};
use crate::format::{
    self, Dataset, BLOCK_BYTES_DEFAULT, BLOCK_BYTES_MAX, BLOCK_BYTES_MIN, FIELDS_MAX,
};
use crate::input::{self, FieldSource};
use crate::pack::{self, CodecChoice, OnExisting, PackError, PackOptions, ShuffleChoice};

/// Most `.npy` files one field may concatenate.
pub const NPY_FILES_PER_FIELD_MAX: usize = 4096;
/// Longest a `GET /v1/jobs/{id}?wait_s=` or a cancellation waits for the job to finish.
pub const JOB_WAIT_S_MAX: u64 = 60;

/// Codec policy of a pack job.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum CodecName {
    /// Per field, LZ4 where sampled blocks compress at least 2x, raw otherwise (as `pack --codec auto`).
    #[default]
    Auto,
    /// LZ4 for every block.
    Lz4,
    /// No compression.
    Raw,
}

/// Shuffle-filter policy of a pack job.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ShuffleName {
    /// Per block, whichever of shuffled and plain compresses smaller.
    #[default]
    Auto,
    /// Always shuffle elements wider than a byte.
    On,
    /// Never shuffle.
    Off,
}

/// One field of a pack job: `.npy` files concatenated along axis 0, or one safetensors tensor.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FieldInput {
    /// The field's name in the dataset (1 to 63 ASCII letters, digits, `_`, `-`, `.`).
    pub name: String,
    /// `.npy` files under the data root, concatenated along axis 0. Give this or `safetensors`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub npy: Option<Vec<String>>,
    /// A `.safetensors` file under the data root. Give this and `tensor`, or `npy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safetensors: Option<String>,
    /// The tensor of the safetensors file (axis 0 is the sample axis).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor: Option<String>,
}

fn default_block_bytes() -> u32 {
    BLOCK_BYTES_DEFAULT
}

/// What to pack and how; the options of `gpufeed pack`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PackSource {
    /// The fields, in dataset order; all must have the same number of samples.
    pub fields: Vec<FieldInput>,
    /// Largest raw size of a block: a power of two from 4096 to 16777216.
    #[serde(default = "default_block_bytes")]
    #[schema(default = 65536, minimum = 4096, maximum = 16777216)]
    pub block_bytes: u32,
    /// Samples per shard file; `null` aims at about 256 MiB of raw data per shard.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub samples_per_shard: Option<u64>,
    /// Codec policy.
    #[serde(default)]
    pub codec: CodecName,
    /// Shuffle-filter policy.
    #[serde(default)]
    pub shuffle_filter: ShuffleName,
}

impl PackSource {
    /// Checks what can be checked without the file system.
    pub fn validate(&self) -> Result<(), ApiError> {
        if self.fields.is_empty() {
            return Err(ApiError::bad_request("source.fields is empty"));
        }
        if self.fields.len() > FIELDS_MAX {
            return Err(ApiError::bad_request(format!(
                "source.fields has {} fields; at most {FIELDS_MAX}",
                self.fields.len()
            )));
        }
        for (index, field) in self.fields.iter().enumerate() {
            let at = format!("source.fields[{index}]");
            format::validate_field_name(&field.name)
                .map_err(|reason| ApiError::bad_request(format!("{at}.name: {reason}")))?;
            if self.fields[..index].iter().any(|f| f.name == field.name) {
                return Err(ApiError::bad_request(format!(
                    "{at}.name: field '{}' is given twice",
                    field.name
                )));
            }
            match (&field.npy, &field.safetensors, &field.tensor) {
                (Some(files), None, None) => {
                    if files.is_empty() || files.len() > NPY_FILES_PER_FIELD_MAX {
                        return Err(ApiError::bad_request(format!(
                            "{at}.npy must list 1 to {NPY_FILES_PER_FIELD_MAX} files"
                        )));
                    }
                }
                (None, Some(_), Some(_)) => {}
                _ => {
                    return Err(ApiError::bad_request(format!(
                        "{at} must have either `npy` (a list of files) or `safetensors` and \
                         `tensor`"
                    )))
                }
            }
        }
        if !self.block_bytes.is_power_of_two()
            || !(BLOCK_BYTES_MIN..=BLOCK_BYTES_MAX).contains(&self.block_bytes)
        {
            return Err(ApiError::bad_request(format!(
                "source.block_bytes {} is not a power of two in {BLOCK_BYTES_MIN}..={BLOCK_BYTES_MAX}",
                self.block_bytes
            )));
        }
        if self.samples_per_shard == Some(0) {
            return Err(ApiError::bad_request(
                "source.samples_per_shard must be at least 1",
            ));
        }
        Ok(())
    }
}

/// A job's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum JobStateName {
    /// Waiting for a running slot.
    Queued,
    /// Packing.
    Running,
    /// Finished; the dataset is registered.
    Succeeded,
    /// Finished with an error; nothing was registered.
    Failed,
    /// Cancelled; nothing was registered.
    Cancelled,
}

impl From<JobState> for JobStateName {
    fn from(state: JobState) -> JobStateName {
        match state {
            JobState::Queued => JobStateName::Queued,
            JobState::Running => JobStateName::Running,
            JobState::Succeeded => JobStateName::Succeeded,
            JobState::Failed => JobStateName::Failed,
            JobState::Cancelled => JobStateName::Cancelled,
        }
    }
}

/// A pack job as the API reports it.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct JobView {
    /// The job id.
    pub id: u64,
    /// The dataset it writes.
    pub dataset: String,
    /// Its state.
    pub state: JobStateName,
    /// When it was submitted (RFC 3339).
    pub created_at: String,
    /// When it started packing.
    pub started_at: Option<String>,
    /// When it finished.
    pub finished_at: Option<String>,
    /// Raw bytes to pack (0 until the pack has started).
    pub raw_bytes_total: u64,
    /// Raw bytes packed so far.
    pub raw_bytes_done: u64,
    /// `raw_bytes_done / raw_bytes_total`, from 0 to 1.
    pub progress: f64,
    /// Payload bytes stored, once it succeeded.
    pub stored_bytes: Option<u64>,
    /// Why it failed.
    pub error: Option<String>,
    /// The pack options as submitted.
    #[schema(value_type = Object)]
    pub source: serde_json::Value,
}

/// Every job record kept.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct JobList {
    /// Jobs by id, oldest first.
    pub jobs: Vec<JobView>,
}

/// The job view of a catalog record, with the live progress of an active job.
pub(crate) fn job_view(id: u64, record: &JobRecord, live: Option<&LiveJob>) -> JobView {
    let (total, done) = match live {
        Some(live) => (
            live.raw_bytes_total.load(Ordering::SeqCst),
            live.raw_bytes_done.load(Ordering::SeqCst),
        ),
        None => (record.raw_bytes_total, record.raw_bytes_done),
    };
    JobView {
        id,
        dataset: record.dataset.clone(),
        state: record.state.into(),
        created_at: rfc3339(record.created_at_unix_s),
        started_at: record.started_at_unix_s.map(rfc3339),
        finished_at: record.finished_at_unix_s.map(rfc3339),
        raw_bytes_total: total,
        raw_bytes_done: done,
        progress: if total == 0 {
            if record.state == JobState::Succeeded {
                1.0
            } else {
                0.0
            }
        } else {
            done as f64 / total as f64
        },
        stored_bytes: record.stored_bytes,
        error: record.error.clone(),
        source: record.source.clone(),
    }
}

fn current_view(control: &Control, id: u64) -> Option<JobView> {
    let live = control.jobs.get(id);
    control
        .catalog
        .read(|data| data.jobs.get(&id).cloned())
        .map(|record| job_view(id, &record, live.as_deref()))
}

/// Drops the oldest finished job records beyond the bound.
fn prune_jobs(data: &mut CatalogData, records_max: u32) {
    while data.jobs.len() > records_max as usize {
        let oldest_finished = data
            .jobs
            .iter()
            .find(|(_, job)| job.state.is_finished())
            .map(|(&id, _)| id);
        match oldest_finished {
            Some(id) => {
                data.jobs.remove(&id);
            }
            None => break,
        }
    }
}

/// Confines and opens a job's inputs.
fn open_inputs(control: &Control, source: &PackSource) -> Result<Vec<FieldSource>, ApiError> {
    let file = |requested: &str| -> Result<PathBuf, ApiError> {
        let confined = control.root.resolve_existing(requested)?;
        if !confined.absolute.is_file() {
            return Err(ApiError::bad_request(format!(
                "{requested:?} is not a regular file"
            )));
        }
        Ok(confined.absolute)
    };
    let invalid_input = |error: input::InputError| {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_input", error.to_string())
    };
    source
        .fields
        .iter()
        .map(
            |field| match (&field.npy, &field.safetensors, &field.tensor) {
                (Some(files), _, _) => {
                    let paths = files
                        .iter()
                        .map(|f| file(f))
                        .collect::<Result<Vec<_>, _>>()?;
                    input::open_npy_field(&field.name, &paths).map_err(invalid_input)
                }
                (None, Some(path), Some(tensor)) => {
                    input::open_safetensors_field(&field.name, &file(path)?, tensor)
                        .map_err(invalid_input)
                }
                _ => unreachable!("validated: npy, or safetensors with tensor"),
            },
        )
        .collect()
}

/// Starts a pack job for dataset `name` (`POST /v1/datasets` with a `source`).
pub(crate) async fn submit(
    control: &Arc<Control>,
    name: String,
    source: PackSource,
) -> Result<JobView, ApiError> {
    if control.is_shutting_down() {
        return Err(shutting_down());
    }
    source.validate()?;
    let reservation = control.reserve(&name)?;
    control.check_name_free(&name)?;
    let out = control.root.child(&name)?;
    if out.absolute.symlink_metadata().is_ok() {
        return Err(ApiError::conflict(format!(
            "{} already exists on disk; remove it or choose another name",
            out.absolute.display()
        )));
    }
    let admission = control.jobs.admit()?;
    let fields = {
        let (control, source) = (Arc::clone(control), source.clone());
        blocking(move || open_inputs(&control, &source)).await??
    };
    let options = PackOptions {
        name: name.clone(),
        block_bytes: source.block_bytes,
        samples_per_shard: source.samples_per_shard,
        codec: match source.codec {
            CodecName::Auto => CodecChoice::Auto,
            CodecName::Lz4 => CodecChoice::Lz4,
            CodecName::Raw => CodecChoice::Raw,
        },
        shuffle: match source.shuffle_filter {
            ShuffleName::Auto => ShuffleChoice::Auto,
            ShuffleName::On => ShuffleChoice::On,
            ShuffleName::Off => ShuffleChoice::Off,
        },
        on_existing: OnExisting::Refuse,
        threads: control.options.pack_threads,
    };
    // Everything the packer checks before reading (names, shapes, sample counts agreeing across
    // fields, sizes) is checked before the job is accepted, so that a request that cannot succeed
    // is refused here with the reason instead of accepted and failed later.
    crate::pack::check_inputs(&fields, &options).map_err(|error| {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_input", error.to_string())
    })?;
    let record = JobRecord {
        dataset: name.clone(),
        state: JobState::Queued,
        created_at_unix_s: unix_now(),
        started_at_unix_s: None,
        finished_at_unix_s: None,
        source: serde_json::to_value(&source).expect("the source serializes"),
        raw_bytes_total: 0,
        raw_bytes_done: 0,
        stored_bytes: None,
        error: None,
    };
    let id = {
        let (control, record) = (Arc::clone(control), record.clone());
        blocking(move || {
            let records_max = control.jobs.limits.records_max;
            control.catalog.update(|data| {
                let id = data.next_job_id;
                data.next_job_id += 1;
                data.jobs.insert(id, record);
                prune_jobs(data, records_max);
                Ok::<_, CatalogError>(id)
            })
        })
        .await??
    };
    let (state, _) = watch::channel(JobState::Queued);
    let live = Arc::new(LiveJob {
        id,
        raw_bytes_total: AtomicU64::new(0),
        raw_bytes_done: AtomicU64::new(0),
        cancel: AtomicBool::new(false),
        stop_reason: Mutex::new(None),
        cancel_notify: Notify::new(),
        state,
        bytes_per_s_max: control.options.pack_bytes_per_s_max,
        pack_started: Mutex::new(None),
    });
    control.jobs.live().insert(id, Arc::clone(&live));
    admission.keep();

    tokio::spawn(run_job(
        Arc::clone(control),
        live,
        fields,
        options,
        out.absolute,
        reservation,
    ));
    Ok(job_view(id, &record, None))
}

fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "shutting_down",
        "the daemon is shutting down",
    )
}

/// How a job ended.
enum Outcome {
    Succeeded {
        dataset: Arc<Dataset>,
        stored_bytes: u64,
    },
    Failed(String),
    Cancelled,
}

async fn run_job(
    control: Arc<Control>,
    live: Arc<LiveJob>,
    fields: Vec<FieldSource>,
    options: PackOptions,
    out: PathBuf,
    reservation: Reservation,
) {
    let permit = tokio::select! {
        permit = Arc::clone(&control.jobs.running).acquire_owned() => permit.ok(),
        () = live.cancel_notify.notified() => None,
    };
    let outcome = match permit {
        Some(permit) if !live.cancel.load(Ordering::SeqCst) => {
            let outcome = pack_and_open(&control, &live, fields, options, &out).await;
            drop(permit);
            outcome
        }
        _ => Outcome::Cancelled,
    };
    finish(&control, &live, outcome).await;
    drop(reservation);
}

async fn pack_and_open(
    control: &Arc<Control>,
    live: &Arc<LiveJob>,
    fields: Vec<FieldSource>,
    options: PackOptions,
    out: &std::path::Path,
) -> Outcome {
    let id = live.id;
    let started = {
        let control = Arc::clone(control);
        blocking(move || {
            control.catalog.update(|data| {
                if let Some(job) = data.jobs.get_mut(&id) {
                    job.state = JobState::Running;
                    job.started_at_unix_s = Some(unix_now());
                }
                Ok::<_, CatalogError>(())
            })
        })
        .await
    };
    match started {
        Ok(Ok(())) => {}
        Ok(Err(error)) => {
            return Outcome::Failed(format!("the catalog could not be written: {error}"))
        }
        Err(error) => return Outcome::Failed(error.message),
    }
    live.state.send_replace(JobState::Running);
    let observer = JobObserver(Arc::clone(live));
    let packed = {
        let out = out.to_path_buf();
        tokio::task::spawn_blocking(move || pack::pack(&out, &fields, &options, &observer)).await
    };
    match packed {
        Ok(Ok(summary)) => {
            control.metrics.add_pack_raw_bytes(summary.raw_bytes);
            let dir = out.to_path_buf();
            match blocking(move || Dataset::open(&dir)).await {
                Ok(Ok(dataset)) => Outcome::Succeeded {
                    dataset: Arc::new(dataset),
                    stored_bytes: summary.stored_bytes,
                },
                Ok(Err(error)) => {
                    // The pack finished but what it wrote does not open: remove it, so that no
                    // unregistered dataset is left for the next start's scan to pick up.
                    let _ = std::fs::remove_dir_all(out);
                    Outcome::Failed(format!("the packed dataset does not open: {error}"))
                }
                Err(error) => Outcome::Failed(error.message),
            }
        }
        Ok(Err(PackError::Cancelled)) => Outcome::Cancelled,
        Ok(Err(error)) => Outcome::Failed(error.to_string()),
        Err(error) => {
            let mut notes = Vec::new();
            remove_staging(&control.root, &options_name(out), &mut notes);
            Outcome::Failed(format!("the pack thread failed: {error}"))
        }
    }
}

fn options_name(out: &std::path::Path) -> String {
    out.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Records the job's end in the catalog (with the dataset, if it succeeded, in the same write),
/// registers the dataset, and retires the live job.
async fn finish(control: &Arc<Control>, live: &Arc<LiveJob>, outcome: Outcome) {
    let id = live.id;
    let done = live.raw_bytes_done.load(Ordering::SeqCst);
    let total = live.raw_bytes_total.load(Ordering::SeqCst);
    let (state, error, stored_bytes, dataset) = match outcome {
        Outcome::Succeeded {
            dataset,
            stored_bytes,
        } => (JobState::Succeeded, None, Some(stored_bytes), Some(dataset)),
        Outcome::Failed(error) => (JobState::Failed, Some(error), None, None),
        Outcome::Cancelled => match live.stop_reason() {
            Some(StopReason::Shutdown) => (
                JobState::Failed,
                Some("the daemon shut down during the job; nothing was registered".to_string()),
                None,
                None,
            ),
            _ => (JobState::Cancelled, None, None, None),
        },
    };
    let written = {
        let control = Arc::clone(control);
        let relative = dataset.as_ref().map(|d| options_name(&d.dir));
        blocking(move || {
            control.catalog.update(|data| {
                let Some(job) = data.jobs.get_mut(&id) else {
                    return Ok::<_, CatalogError>(());
                };
                job.state = state;
                job.error = error;
                job.finished_at_unix_s = Some(unix_now());
                job.raw_bytes_total = total;
                job.raw_bytes_done = done;
                job.stored_bytes = stored_bytes;
                if let Some(relative) = relative {
                    let name = job.dataset.clone();
                    data.unregistered.remove(&relative);
                    data.datasets.insert(
                        name,
                        DatasetRecord {
                            path: relative,
                            origin: Origin::Packed,
                            registered_at_unix_s: unix_now(),
                            job: Some(id),
                        },
                    );
                }
                Ok(())
            })
        })
        .await
    };
    match written {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::error!(
            "job {id}: the catalog could not record its end ({error}); the next start settles it"
        ),
        Err(error) => tracing::error!("job {id}: {}", error.message),
    }
    if let Some(dataset) = dataset {
        let name = dataset.manifest.name.clone();
        if let Err(reason) = control.registry.insert_shared(dataset) {
            tracing::error!("job {id}: cannot register '{name}': {reason}");
        }
        control.clear_problem(&name);
    }
    control.jobs.live().remove(&id);
    control.jobs.active.fetch_sub(1, Ordering::SeqCst);
    live.state.send_replace(state);
    tracing::info!("job {id}: {}", state.name());
}

/// Asks every active job to stop because the daemon shuts down, and waits up to `limit` for them.
pub(crate) async fn stop_all(control: &Control, limit: Duration) -> usize {
    let live: Vec<Arc<LiveJob>> = control.jobs.live().values().cloned().collect();
    for job in &live {
        job.request_stop(StopReason::Shutdown);
    }
    let waits = live.iter().map(|job| job.wait_finished(limit));
    for wait in waits {
        wait.await;
    }
    live.len()
}

/// Query of `GET /v1/jobs/{id}`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
pub struct JobQuery {
    /// Wait up to this many seconds (at most 60) for an active job to finish before answering.
    #[param(minimum = 0, maximum = 60)]
    pub wait_s: Option<u64>,
}

/// Lists the job records kept (active and the most recent finished ones).
#[utoipa::path(
    get, path = "/v1/jobs", tag = "jobs", operation_id = "list_jobs",
    responses(
        (status = 200, description = "The job records", body = JobList),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
    ),
    security((), ("bearer" = []))
)]
pub async fn list(State(control): State<Arc<Control>>) -> Json<JobList> {
    let records: Vec<(u64, JobRecord)> = control
        .catalog
        .read(|data| data.jobs.iter().map(|(&id, r)| (id, r.clone())).collect());
    let jobs = records
        .iter()
        .map(|(id, record)| job_view(*id, record, control.jobs.get(*id).as_deref()))
        .collect();
    Json(JobList { jobs })
}

/// One job: state, progress, bytes and error.
#[utoipa::path(
    get, path = "/v1/jobs/{id}", tag = "jobs", operation_id = "get_job",
    params(("id" = u64, Path, description = "The job id"), JobQuery),
    responses(
        (status = 200, description = "The job", body = JobView),
        (status = 400, description = "The id or query is malformed", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such job", body = ErrorBody),
    ),
    security((), ("bearer" = []))
)]
pub async fn get_one(
    State(control): State<Arc<Control>>,
    ApiPath(id): ApiPath<u64>,
    ApiQuery(query): ApiQuery<JobQuery>,
) -> Result<Json<JobView>, ApiError> {
    let wait = query.wait_s.unwrap_or(0);
    if wait > JOB_WAIT_S_MAX {
        return Err(ApiError::bad_request(format!(
            "wait_s may be at most {JOB_WAIT_S_MAX}"
        )));
    }
    if wait > 0 {
        if let Some(live) = control.jobs.get(id) {
            live.wait_finished(Duration::from_secs(wait)).await;
        }
    }
    current_view(&control, id)
        .map(Json)
        .ok_or_else(|| ApiError::not_found(format!("no job {id}")))
}

/// Cancels a queued or running job and waits for it to stop: its staging directory is removed and
/// nothing is registered.
#[utoipa::path(
    delete, path = "/v1/jobs/{id}", tag = "jobs", operation_id = "cancel_job",
    params(("id" = u64, Path, description = "The job id")),
    responses(
        (status = 200, description = "The job, cancelled", body = JobView),
        (status = 202, description = "The job is stopping but had not stopped within 60 s", body = JobView),
        (status = 400, description = "The id is malformed", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such job", body = ErrorBody),
        (status = 409, description = "The job had already finished", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn cancel(
    State(control): State<Arc<Control>>,
    ApiPath(id): ApiPath<u64>,
) -> Result<(StatusCode, Json<JobView>), ApiError> {
    if let Some(live) = control.jobs.get(id) {
        live.request_stop(StopReason::Operator);
        live.wait_finished(Duration::from_secs(JOB_WAIT_S_MAX))
            .await;
    }
    let view =
        current_view(&control, id).ok_or_else(|| ApiError::not_found(format!("no job {id}")))?;
    match view.state {
        JobStateName::Cancelled => Ok((StatusCode::OK, Json(view))),
        JobStateName::Queued | JobStateName::Running => Ok((StatusCode::ACCEPTED, Json(view))),
        state => Err(ApiError::conflict(format!(
            "job {id} had already {} before it could be cancelled",
            match state {
                JobStateName::Succeeded => "succeeded",
                _ => "failed",
            }
        ))),
    }
}
