//! The control API's router in process (`tower::ServiceExt::oneshot`), over a scratch data root:
//! every endpoint and its error paths (malformed JSON, unknown fields, wrong content type, oversized
//! bodies, duplicate names, paths outside the root lexically and through symbolic links, tokens),
//! pack jobs (success, input errors, cancellation of running and queued jobs, the queue bound),
//! removal while streams hold a dataset, datasets whose files vanished, and how the catalog, the
//! start-up scan and interrupted jobs settle when the control state is opened again.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use gpufeed::api::{self, ApiOptions, AuthPolicy, AuthScope, Control, Metrics};
use gpufeed::catalog::{CatalogData, JobRecord, JobState, CATALOG_FILE_NAME};
use gpufeed::config::JobLimits;
use gpufeed::input::{npy, FieldSource};
use gpufeed::pack::{self, CodecChoice, OnExisting, PackOptions, Quiet, ShuffleChoice};
use gpufeed::registry::{CloseReason, Registry, SessionInfo};
use gpufeed::storage::EngineMode;
use gpufeed_client::DType;
use serde_json::{json, Value};
use tower::ServiceExt;

const TOKEN: &str = "test-token-0123456789abcdef";

fn options(root: &Path) -> ApiOptions {
    ApiOptions {
        data_root: root.to_path_buf(),
        auth: AuthPolicy {
            token: None,
            scope: AuthScope::Mutating,
        },
        body_bytes_max: 64 << 10,
        jobs: JobLimits {
            running_max: 2,
            queued_max: 4,
            records_max: 16,
        },
        pack_threads: 1,
        pack_bytes_per_s_max: None,
        verifies_max: 1,
        sessions_max: 8,
        slot_memory_bytes_max: 1 << 30,
        device: "cpu".to_string(),
        engine: EngineMode::Auto,
        gpu: gpufeed::config::GpuSettings::node_defaults(),
        socket_path: root.join("gpufeed.sock"),
        allowed_uids: vec![1000],
        http_connections: gpufeed::config::HttpConnections {
            connections_max: 16,
            idle_timeout: Duration::from_secs(30),
        },
    }
}

/// The control state and router over `root`.
struct App {
    control: Arc<Control>,
    router: Router,
}

fn open(options: ApiOptions) -> App {
    let registry = Arc::new(Registry::new());
    let (control, _notes) = Control::open(options, registry, Arc::new(Metrics::new())).unwrap();
    let router = api::router(Arc::clone(&control));
    App { control, router }
}

struct Reply {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: Vec<u8>,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "status {}: not JSON ({e}): {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// Asserts an error reply with this status and code; returns its message.
    fn error(&self, status: u16, code: &str) -> String {
        let body = self.json();
        assert_eq!(self.status.as_u16(), status, "{body}");
        assert_eq!(body["code"], code, "{body}");
        body["message"].as_str().unwrap().to_string()
    }
}

async fn call(
    app: &App,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: Option<Vec<u8>>,
) -> Reply {
    let mut request = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(body.map_or_else(Body::empty, Body::from))
        .unwrap();
    let response = app.router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap()
        .to_vec();
    Reply {
        status,
        headers,
        body,
    }
}

async fn get(app: &App, uri: &str) -> Reply {
    call(app, "GET", uri, &[], None).await
}

async fn post(app: &App, uri: &str, body: Value) -> Reply {
    call(
        app,
        "POST",
        uri,
        &[("content-type", "application/json")],
        Some(body.to_string().into_bytes()),
    )
    .await
}

async fn delete(app: &App, uri: &str) -> Reply {
    call(app, "DELETE", uri, &[], None).await
}

/// Packs a small two-field dataset named `name` into `dir`.
fn pack_dataset(dir: &Path, name: &str) {
    let samples = 300u64;
    let tokens: Vec<u8> = (0..samples as i32 * 4).flat_map(i32::to_le_bytes).collect();
    let embedding = gpufeed::synth::embedding_f16((samples * 8) as usize, 3);
    let fields = vec![
        FieldSource::from_bytes("tok", DType::I32, vec![4], tokens).unwrap(),
        FieldSource::from_bytes("emb", DType::F16, vec![8], embedding).unwrap(),
    ];
    let options = PackOptions {
        name: name.to_string(),
        block_bytes: 4096,
        samples_per_shard: Some(100),
        codec: CodecChoice::Auto,
        shuffle: ShuffleChoice::Auto,
        on_existing: OnExisting::Refuse,
        threads: 1,
    };
    pack::pack(dir, &fields, &options, &Quiet).unwrap();
}

/// Writes `samples` i32 samples of 16 values as an `.npy`.
fn write_npy(path: &Path, samples: u64) {
    let mut writer = npy::write_npy(path, DType::I32, &[samples, 16]).unwrap();
    let bytes: Vec<u8> = (0..samples as i32 * 16)
        .flat_map(i32::to_le_bytes)
        .collect();
    writer.write_all(&bytes).unwrap();
    writer.finish().unwrap();
}

/// A scratch root; datasets packed below `nested/` are not found by the start-up scan.
fn scratch() -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("nested")).unwrap();
    root
}

fn register_body(name: &str, path: &str) -> Value {
    json!({"name": name, "path": path})
}

fn staging_dirs(root: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().contains(".partial-"))
        .map(|e| e.path())
        .collect()
}

/// Waits (bounded) until `condition` holds of the job's view.
async fn job_until(app: &App, id: u64, condition: impl Fn(&Value) -> bool) -> Value {
    for _ in 0..2000 {
        let job = get(app, &format!("/v1/jobs/{id}")).await.json();
        if condition(&job) {
            return job;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("job {id} never reached the condition");
}

#[tokio::test]
async fn the_openapi_document_lists_exactly_the_routes_the_router_serves() {
    let root = scratch();
    let app = open(options(root.path()));
    let reply = get(&app, "/openapi.json").await;
    assert_eq!(reply.status, 200);
    let document = reply.json();
    assert!(document["openapi"].as_str().unwrap().starts_with("3."));
    let mut listed: Vec<(String, String)> = Vec::new();
    for (path, item) in document["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            if ["get", "post", "delete", "put", "patch"].contains(&method.as_str()) {
                listed.push((method.clone(), path.clone()));
            }
        }
    }
    listed.sort();
    let mut routes: Vec<(String, String)> = api::ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    routes.sort();
    assert_eq!(listed, routes);
    assert!(document["components"]["securitySchemes"]["bearer"].is_object());
    // Operation ids are unique (links name them).
    let mut ids: Vec<&str> = document["paths"]
        .as_object()
        .unwrap()
        .values()
        .flat_map(|item| item.as_object().unwrap().values())
        .filter_map(|operation| operation["operationId"].as_str())
        .collect();
    assert_eq!(ids.len(), routes.len());
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), routes.len(), "duplicate operation ids");
    // Every link names an operation that exists, in OpenAPI's spelling.
    let link = &document["paths"]["/v1/datasets"]["post"]["responses"]["202"]["links"]["GetJob"];
    assert_eq!(link["operationId"], "get_job", "{link}");
    assert!(ids.contains(&"get_job"));
    // Every listed route is served: none falls through to the router's own 404 or 405.
    for (method, path) in &routes {
        let uri = path.replace("{name}", "nothing").replace("{id}", "999");
        let reply = call(
            &app,
            &method.to_uppercase(),
            &uri,
            &[("content-type", "application/json")],
            (method == "post").then(|| b"{}".to_vec()),
        )
        .await;
        if reply.status == 404 || reply.status == 405 {
            let message = reply.json()["message"].as_str().unwrap().to_string();
            assert!(
                !message.contains("/openapi.json lists them"),
                "{method} {path} is not routed: {message}"
            );
        }
    }
}

#[tokio::test]
async fn unknown_routes_wrong_methods_and_health_answer_json() {
    let root = scratch();
    let app = open(options(root.path()));
    let health = get(&app, "/healthz").await;
    assert_eq!(health.status, 200);
    assert_eq!(health.json(), json!({"status": "ok"}));
    get(&app, "/v2/nothing").await.error(404, "not_found");
    call(&app, "PUT", "/healthz", &[], None)
        .await
        .error(405, "method_not_allowed");
    call(&app, "PATCH", "/v1/datasets", &[], None)
        .await
        .error(405, "method_not_allowed");
}

#[tokio::test]
async fn malformed_requests_are_json_errors() {
    let root = scratch();
    let mut small = options(root.path());
    small.body_bytes_max = 2048;
    let app = open(small);
    let json_header = [("content-type", "application/json")];
    let send = |body: &'static [u8]| {
        call(
            &app,
            "POST",
            "/v1/datasets",
            &json_header,
            Some(body.to_vec()),
        )
    };
    send(b"{\"name\": \"a\", ").await.error(400, "invalid_json");
    send(b"not json").await.error(400, "invalid_json");
    let message = send(b"{\"name\": \"a\", \"path\": \"x\", \"colour\": 1}")
        .await
        .error(400, "invalid_json");
    assert!(message.contains("colour"), "{message}");
    send(b"{\"name\": 7, \"path\": \"x\"}")
        .await
        .error(400, "invalid_json");
    send(b"{\"name\": \"a\", \"source\": {\"fields\": [], \"level\": 9}}")
        .await
        .error(400, "invalid_json");
    send(b"{\"name\": \"a\"}").await.error(400, "bad_request");
    send(b"{\"name\": \"a\", \"path\": \"x\", \"source\": {\"fields\": []}}")
        .await
        .error(400, "bad_request");
    for name in ["", ".hidden", "a/b", "spaces are bad", &"n".repeat(129)] {
        post(&app, "/v1/datasets", register_body(name, "x"))
            .await
            .error(400, "bad_request");
    }
    call(&app, "POST", "/v1/datasets", &[], Some(b"{}".to_vec()))
        .await
        .error(415, "unsupported_media_type");
    let oversized = format!("{{\"name\": \"a\", \"path\": \"{}\"}}", "x".repeat(4096));
    call(
        &app,
        "POST",
        "/v1/datasets",
        &json_header,
        Some(oversized.into_bytes()),
    )
    .await
    .error(413, "payload_too_large");
    get(&app, "/v1/jobs/abc").await.error(400, "bad_request");
    get(&app, "/v1/jobs/1?wait_s=soon")
        .await
        .error(400, "bad_request");
    get(&app, "/v1/jobs/1?wait_s=61")
        .await
        .error(400, "bad_request");
    delete(&app, "/v1/datasets/x?force=maybe")
        .await
        .error(400, "bad_request");
    delete(&app, "/v1/sessions/-1")
        .await
        .error(400, "bad_request");
}

#[tokio::test]
async fn register_list_inspect_and_refuse_duplicates() {
    let root = scratch();
    pack_dataset(&root.path().join("nested/alpha"), "alpha");
    let app = open(options(root.path()));
    assert_eq!(
        get(&app, "/v1/datasets").await.json()["datasets"],
        json!([])
    );

    let created = post(&app, "/v1/datasets", register_body("alpha", "nested/alpha")).await;
    assert_eq!(created.status, 201, "{}", created.json());
    assert_eq!(created.headers["location"], "/v1/datasets/alpha");
    let view = created.json();
    assert_eq!(view["state"], "ready");
    assert_eq!(view["origin"], "registered");
    assert_eq!(view["path"], "nested/alpha");
    assert_eq!(view["samples"], 300);
    assert_eq!(view["shards"], 3);
    assert_eq!(view["fields"], json!(["tok", "emb"]));

    let list = get(&app, "/v1/datasets").await.json();
    assert_eq!(list["datasets"].as_array().unwrap().len(), 1);
    let detail = get(&app, "/v1/datasets/alpha").await.json();
    assert_eq!(detail["dataset"]["name"], "alpha");
    assert_eq!(detail["summary"]["samples"], 300);
    assert_eq!(detail["summary"]["fields"][0]["dtype"], "i32");
    get(&app, "/v1/datasets/beta").await.error(404, "not_found");

    // The same name again, the same directory under another name, a manifest naming another
    // dataset, and an absolute path under the root.
    post(&app, "/v1/datasets", register_body("alpha", "nested/alpha"))
        .await
        .error(409, "conflict");
    post(&app, "/v1/datasets", register_body("gamma", "nested/alpha"))
        .await
        .error(409, "conflict");
    pack_dataset(&root.path().join("nested/beta-dir"), "beta");
    let message = post(
        &app,
        "/v1/datasets",
        register_body("other", "nested/beta-dir"),
    )
    .await
    .error(400, "bad_request");
    assert!(message.contains("'beta'"), "{message}");
    let absolute = root.path().join("nested/beta-dir");
    let created = post(
        &app,
        "/v1/datasets",
        register_body("beta", absolute.to_str().unwrap()),
    )
    .await;
    assert_eq!(created.status, 201, "{}", created.json());
    assert_eq!(created.json()["path"], "nested/beta-dir");
    assert!(app.control.registry().get("beta").is_some());
}

#[tokio::test]
async fn paths_outside_the_data_root_are_refused() {
    let root = scratch();
    let outside = tempfile::tempdir().unwrap();
    pack_dataset(&outside.path().join("elsewhere"), "elsewhere");
    write_npy(&outside.path().join("secret.npy"), 8);
    symlink(
        outside.path().join("elsewhere"),
        root.path().join("link-out"),
    )
    .unwrap();
    symlink(outside.path(), root.path().join("nested/dir-out")).unwrap();
    symlink(
        outside.path().join("secret.npy"),
        root.path().join("secret.npy"),
    )
    .unwrap();
    pack_dataset(&root.path().join("nested/inside"), "inside");
    symlink(
        root.path().join("nested/inside"),
        root.path().join("link-in"),
    )
    .unwrap();
    let app = open(options(root.path()));

    let outside_dir = outside.path().join("elsewhere");
    for path in [
        "../elsewhere",
        "nested/../../elsewhere",
        outside_dir.to_str().unwrap(),
        "/etc",
        "link-out",
        "nested/dir-out/elsewhere",
    ] {
        let message = post(&app, "/v1/datasets", register_body("elsewhere", path))
            .await
            .error(403, "path_outside_root");
        assert!(
            message.contains("outside the data root"),
            "{path}: {message}"
        );
    }
    post(&app, "/v1/datasets", register_body("x", "nested/none"))
        .await
        .error(400, "path_not_found");
    post(&app, "/v1/datasets", register_body("x", "."))
        .await
        .error(400, "bad_request");
    // Unusable paths are the request's fault: a loop of links, a file as a directory, a name
    // longer than the file system allows.
    symlink("loop", root.path().join("loop")).unwrap();
    std::fs::write(root.path().join("file"), b"").unwrap();
    for path in ["loop", "file/dataset", &"n".repeat(300)] {
        post(&app, "/v1/datasets", register_body("x", path))
            .await
            .error(400, "bad_request");
    }
    assert!(app.control.registry().names().is_empty());

    // A link that stays inside the root is followed and its target recorded.
    let created = post(&app, "/v1/datasets", register_body("inside", "link-in")).await;
    assert_eq!(created.status, 201, "{}", created.json());
    assert_eq!(created.json()["path"], "nested/inside");

    // Pack inputs are confined the same way.
    for input in ["../secret.npy", "secret.npy", "nested/dir-out/secret.npy"] {
        let body = json!({"name": "packed", "source": {"fields": [{"name": "x", "npy": [input]}]}});
        post(&app, "/v1/datasets", body)
            .await
            .error(403, "path_outside_root");
    }
    assert!(!root.path().join("packed").exists());
}

#[tokio::test]
async fn a_directory_that_is_not_a_dataset_is_unprocessable() {
    let root = scratch();
    std::fs::create_dir(root.path().join("nested/empty")).unwrap();
    pack_dataset(&root.path().join("nested/broken"), "broken");
    // Flip a byte of the first shard's header: its checksum no longer matches.
    let shard = root.path().join("nested/broken/shard-000000.gfs");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[20] ^= 0xff;
    std::fs::write(&shard, bytes).unwrap();
    let app = open(options(root.path()));
    post(&app, "/v1/datasets", register_body("empty", "nested/empty"))
        .await
        .error(422, "invalid_dataset");
    let message = post(
        &app,
        "/v1/datasets",
        register_body("broken", "nested/broken"),
    )
    .await
    .error(422, "invalid_dataset");
    assert!(message.contains("checksum"), "{message}");
    assert!(get(&app, "/v1/datasets").await.json()["datasets"]
        .as_array()
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn verify_reports_every_corrupt_block() {
    let root = scratch();
    pack_dataset(&root.path().join("nested/data"), "data");
    let app = open(options(root.path()));
    assert_eq!(
        post(&app, "/v1/datasets", register_body("data", "nested/data"))
            .await
            .status,
        201
    );
    let intact = call(&app, "POST", "/v1/datasets/data/verify", &[], None).await;
    assert_eq!(intact.status, 200);
    let intact = intact.json();
    assert_eq!(intact["ok"], true, "{intact}");
    assert_eq!(intact["shards_ok"], 3);
    assert_eq!(intact["problems_total"], 0);
    let blocks = intact["blocks_ok"].as_u64().unwrap();
    assert!(blocks > 0);

    // Damage the payload of the second shard's first block.
    let dataset = app.control.registry().get("data").unwrap();
    let shard = &dataset.shards[1];
    let offset = shard.metadata.blocks[0].stored_offset as usize;
    let path = shard.path.clone();
    drop(dataset);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[offset] ^= 0x55;
    std::fs::write(&path, bytes).unwrap();
    let damaged = call(&app, "POST", "/v1/datasets/data/verify", &[], None)
        .await
        .json();
    assert_eq!(damaged["ok"], false);
    assert_eq!(damaged["problems_total"], 1, "{damaged}");
    assert_eq!(damaged["blocks_ok"].as_u64().unwrap(), blocks - 1);
    assert!(damaged["problems"][0]
        .as_str()
        .unwrap()
        .contains("shard-000001.gfs"));
    call(&app, "POST", "/v1/datasets/none/verify", &[], None)
        .await
        .error(404, "not_found");
}

#[tokio::test]
async fn removal_waits_for_streams_unless_forced_and_survives_a_restart() {
    let root = scratch();
    pack_dataset(&root.path().join("kept"), "kept");
    let app = open(options(root.path()));
    // Found by the scan, and recorded in the catalog.
    let listed = get(&app, "/v1/datasets").await.json();
    assert_eq!(listed["datasets"][0]["name"], "kept");
    assert_eq!(listed["datasets"][0]["origin"], "scanned");

    // A stream holds the dataset: removal is refused, then forced.
    let stream = app.control.registry().get("kept").unwrap();
    assert_eq!(
        get(&app, "/v1/datasets/kept").await.json()["dataset"]["references"],
        1
    );
    let message = delete(&app, "/v1/datasets/kept").await.error(409, "in_use");
    assert!(message.contains("force=true"), "{message}");
    assert!(app.control.registry().get("kept").is_some());
    let removed = delete(&app, "/v1/datasets/kept?force=true").await;
    assert_eq!(removed.status, 200);
    let removed = removed.json();
    assert_eq!(removed["references_left"], 1, "{removed}");
    assert_eq!(removed["path"], "kept");
    assert_eq!(
        stream.manifest.sample_count, 300,
        "the stream's dataset stays valid"
    );
    drop(stream);
    delete(&app, "/v1/datasets/kept")
        .await
        .error(404, "not_found");
    assert!(
        root.path().join("kept/manifest.json").is_file(),
        "files are kept"
    );

    // After a restart the scan does not bring it back; registering it again does.
    drop(app);
    let app = open(options(root.path()));
    assert!(get(&app, "/v1/datasets").await.json()["datasets"]
        .as_array()
        .unwrap()
        .is_empty());
    let created = post(&app, "/v1/datasets", register_body("kept", "kept")).await;
    assert_eq!(created.status, 201, "{}", created.json());
    let removed = delete(&app, "/v1/datasets/kept").await;
    assert_eq!(removed.status, 200);
    assert_eq!(removed.json()["references_left"], 0);
}

#[tokio::test]
async fn a_dataset_whose_files_vanished_is_reported_missing() {
    let root = scratch();
    pack_dataset(&root.path().join("nested/fleeting"), "fleeting");
    let app = open(options(root.path()));
    assert_eq!(
        post(
            &app,
            "/v1/datasets",
            register_body("fleeting", "nested/fleeting")
        )
        .await
        .status,
        201
    );
    std::fs::rename(
        root.path().join("nested/fleeting"),
        root.path().join("nested/moved"),
    )
    .unwrap();
    let listed = get(&app, "/v1/datasets").await.json();
    assert_eq!(listed["datasets"][0]["state"], "missing", "{listed}");
    assert!(listed["datasets"][0]["error"]
        .as_str()
        .unwrap()
        .contains("vanished"));
    let detail = get(&app, "/v1/datasets/fleeting").await.json();
    assert_eq!(detail["dataset"]["state"], "missing");
    assert_eq!(detail["summary"], Value::Null);
    call(&app, "POST", "/v1/datasets/fleeting/verify", &[], None)
        .await
        .error(409, "dataset_unavailable");
    let status = get(&app, "/v1/status").await.json();
    assert_eq!(status["datasets_unavailable"], 1);
    // The page-cache registration budget is shown with where it came from.
    let budget = gpufeed::config::registered_bytes_max_default();
    assert_eq!(status["serving"]["registered_memory_max"], budget.bytes_max);
    assert_eq!(status["serving"]["registered_memory_source"], "derived");
    assert_eq!(status["serving"]["zero_copy"], "auto");
    assert_eq!(
        status["serving"]["device_shard_memory"],
        gpufeed::config::DEVICE_SHARD_BYTES_DEFAULT
    );
    assert_eq!(
        status["serving"]["loader_copy_threads"],
        gpufeed::config::LOADER_COPY_THREADS_DEFAULT
    );
    // So are the GPU tuning settings, once read by the pipeline from the environment unseen, and
    // the settings of the socket, the API and pack jobs.
    let gpu = gpufeed::config::GpuSettings::node_defaults();
    let serving = &status["serving"];
    assert_eq!(serving["rounds_in_flight"], gpu.rounds_in_flight);
    assert_eq!(serving["filler_spin_us"], 0);
    assert_eq!(serving["gather_piece_kib"], gpu.gather_piece_bytes >> 10);
    assert_eq!(serving["inline_gather_tables"], gpu.inline_gather_tables);
    assert_eq!(serving["batch_group_max"], gpu.batch_group_max);
    assert_eq!(serving["plan_threads"], 0);
    assert_eq!(serving["device_pool_idle_s"], 30);
    assert_eq!(serving["avoid_irq_cpus"], true);
    let control = &status["control"];
    assert_eq!(control["allowed_uids"], json!([1000]));
    assert_eq!(control["api_token_set"], false);
    assert_eq!(control["body_limit_bytes"], 64 << 10);
    assert_eq!(control["http_connections_max"], 16);
    assert_eq!(control["http_idle_timeout_s"], 30);
    assert_eq!(control["job_records_max"], 16);
    assert_eq!(control["pack_threads"], 1);
    assert_eq!(control["pack_rate_max"], Value::Null);

    // A restart lists it as missing, with the reason, and serves the rest.
    drop(app);
    let app = open(options(root.path()));
    let listed = get(&app, "/v1/datasets").await.json();
    assert_eq!(listed["datasets"][0]["state"], "missing", "{listed}");
    assert!(listed["datasets"][0]["error"].as_str().is_some());
    assert!(app.control.registry().get("fleeting").is_none());
    let metrics = String::from_utf8(get(&app, "/metrics").await.body).unwrap();
    assert!(
        metrics.contains("gpufeed_datasets{state=\"missing\"} 1\n"),
        "{metrics}"
    );

    // Once the files are back, the next start serves it again.
    std::fs::rename(
        root.path().join("nested/moved"),
        root.path().join("nested/fleeting"),
    )
    .unwrap();
    drop(app);
    let app = open(options(root.path()));
    assert_eq!(
        get(&app, "/v1/datasets").await.json()["datasets"][0]["state"],
        "ready"
    );
    let removed = delete(&app, "/v1/datasets/fleeting").await;
    assert_eq!(removed.status, 200);
}

#[tokio::test]
async fn a_pack_job_packs_registers_and_reports_its_bytes() {
    let root = scratch();
    write_npy(&root.path().join("a.npy"), 500);
    write_npy(&root.path().join("b.npy"), 300);
    let app = open(options(root.path()));
    let body = json!({
        "name": "made",
        "source": {
            "fields": [{"name": "tokens", "npy": ["a.npy", "b.npy"]}],
            "block_bytes": 4096,
            "samples_per_shard": 256,
            "codec": "lz4",
            "shuffle_filter": "on"
        }
    });
    let accepted = post(&app, "/v1/datasets", body).await;
    assert_eq!(accepted.status, 202, "{}", accepted.json());
    let job = accepted.json();
    let id = job["id"].as_u64().unwrap();
    assert_eq!(accepted.headers["location"], format!("/v1/jobs/{id}"));
    assert_eq!(job["dataset"], "made");
    let done = get(&app, &format!("/v1/jobs/{id}?wait_s=60")).await.json();
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["raw_bytes_total"], 800 * 64);
    assert_eq!(done["raw_bytes_done"], 800 * 64);
    assert_eq!(done["progress"], 1.0);
    assert!(done["stored_bytes"].as_u64().unwrap() > 0);
    assert_eq!(done["error"], Value::Null);
    assert_eq!(done["source"]["codec"], "lz4");

    let detail = get(&app, "/v1/datasets/made").await.json();
    assert_eq!(detail["dataset"]["origin"], "packed");
    assert_eq!(detail["dataset"]["job"], id);
    assert_eq!(detail["summary"]["samples"], 800);
    assert_eq!(detail["summary"]["shards"], 4);
    // 3 shards of 256 samples (4 blocks of 64 samples each) and one of 32 samples (1 block).
    assert_eq!(detail["summary"]["fields"][0]["codecs"]["lz4_shuffled"], 13);
    assert!(staging_dirs(root.path()).is_empty());
    let jobs = get(&app, "/v1/jobs").await.json();
    assert_eq!(jobs["jobs"][0]["id"], id);
    delete(&app, &format!("/v1/jobs/{id}"))
        .await
        .error(409, "conflict");
    delete(&app, "/v1/jobs/999").await.error(404, "not_found");
    get(&app, "/v1/jobs/999").await.error(404, "not_found");

    // The name and the directory are now taken.
    let again = json!({"name": "made", "source": {"fields": [{"name": "t", "npy": ["a.npy"]}]}});
    post(&app, "/v1/datasets", again)
        .await
        .error(409, "conflict");
    let metrics = String::from_utf8(get(&app, "/metrics").await.body).unwrap();
    assert!(metrics.contains(&format!("gpufeed_pack_raw_bytes_total {}\n", 800 * 64)));
    assert!(metrics.contains("gpufeed_jobs{state=\"succeeded\"} 1\n"));
}

#[tokio::test]
async fn pack_requests_with_bad_inputs_are_refused_before_a_job_starts() {
    let root = scratch();
    write_npy(&root.path().join("a.npy"), 10);
    write_npy(&root.path().join("short.npy"), 5);
    std::fs::write(root.path().join("junk.npy"), b"not an npy file").unwrap();
    std::fs::create_dir(root.path().join("taken")).unwrap();
    let app = open(options(root.path()));
    let pack = |name: &str, source: Value| json!({"name": name, "source": source});
    let cases: Vec<(Value, u16, &str)> = vec![
        (pack("p", json!({"fields": []})), 400, "bad_request"),
        (
            pack("p", json!({"fields": [{"name": "x"}]})),
            400,
            "bad_request",
        ),
        (
            pack("p", json!({"fields": [{"name": "x", "npy": []}]})),
            400,
            "bad_request",
        ),
        (
            pack(
                "p",
                json!({"fields": [{"name": "x", "npy": ["a.npy"], "safetensors": "a.st", "tensor": "t"}]}),
            ),
            400,
            "bad_request",
        ),
        (
            pack(
                "p",
                json!({"fields": [{"name": "x", "safetensors": "a.safetensors"}]}),
            ),
            400,
            "bad_request",
        ),
        (
            pack(
                "p",
                json!({"fields": [{"name": "bad name", "npy": ["a.npy"]}]}),
            ),
            400,
            "bad_request",
        ),
        (
            pack(
                "p",
                json!({"fields": [{"name": "x", "npy": ["a.npy"]}, {"name": "x", "npy": ["a.npy"]}]}),
            ),
            400,
            "bad_request",
        ),
        (
            pack(
                "p",
                json!({"fields": [{"name": "x", "npy": ["a.npy"]}], "block_bytes": 5000}),
            ),
            400,
            "bad_request",
        ),
        (
            pack(
                "p",
                json!({"fields": [{"name": "x", "npy": ["a.npy"]}], "samples_per_shard": 0}),
            ),
            400,
            "bad_request",
        ),
        (
            pack(
                "p",
                json!({"fields": [{"name": "x", "npy": ["a.npy"]}], "codec": "zstd"}),
            ),
            400,
            "invalid_json",
        ),
        (
            pack(
                "p",
                json!({"fields": [{"name": "x", "npy": ["missing.npy"]}]}),
            ),
            400,
            "path_not_found",
        ),
        (
            pack("p", json!({"fields": [{"name": "x", "npy": ["nested"]}]})),
            400,
            "bad_request",
        ),
        (
            pack("p", json!({"fields": [{"name": "x", "npy": ["junk.npy"]}]})),
            400,
            "invalid_input",
        ),
        (
            pack(
                "taken",
                json!({"fields": [{"name": "x", "npy": ["a.npy"]}]}),
            ),
            409,
            "conflict",
        ),
    ];
    for (body, status, code) in cases {
        let reply = post(&app, "/v1/datasets", body.clone()).await;
        assert_eq!(
            (
                reply.status.as_u16(),
                reply.json()["code"].as_str().unwrap()
            ),
            (status, code),
            "{body}: {}",
            reply.json()
        );
    }
    assert!(get(&app, "/v1/jobs").await.json()["jobs"]
        .as_array()
        .unwrap()
        .is_empty());
    // Fields of different lengths are refused before a job starts (they were accepted with 202 and
    // failed in the pack), naming both fields and their sample counts.
    let mismatched = pack(
        "mismatch",
        json!({"fields": [{"name": "x", "npy": ["a.npy"]}, {"name": "y", "npy": ["short.npy"]}]}),
    );
    let message = post(&app, "/v1/datasets", mismatched)
        .await
        .error(400, "invalid_input");
    assert!(
        message.contains("'y'") && message.contains("5 samples") && message.contains("'x' has 10"),
        "{message}"
    );
    assert!(get(&app, "/v1/jobs").await.json()["jobs"]
        .as_array()
        .unwrap()
        .is_empty());
    assert!(!root.path().join("mismatch").exists());
    assert!(staging_dirs(root.path()).is_empty());
    get(&app, "/v1/datasets/mismatch")
        .await
        .error(404, "not_found");
}

#[tokio::test]
async fn cancelling_running_and_queued_jobs_leaves_nothing_and_the_queue_is_bounded() {
    let root = scratch();
    // 2 MiB of input packed at 256 KiB/s: the job runs for about 8 s unless cancelled.
    write_npy(&root.path().join("big.npy"), 32 * 1024);
    let mut slow = options(root.path());
    slow.pack_bytes_per_s_max = Some(256 << 10);
    slow.jobs = JobLimits {
        running_max: 1,
        queued_max: 1,
        records_max: 4,
    };
    let app = open(slow);
    let source = json!({"fields": [{"name": "t", "npy": ["big.npy"]}], "block_bytes": 4096});
    let first = post(
        &app,
        "/v1/datasets",
        json!({"name": "first", "source": source}),
    )
    .await;
    assert_eq!(first.status, 202);
    let first = first.json()["id"].as_u64().unwrap();
    let second = post(
        &app,
        "/v1/datasets",
        json!({"name": "second", "source": source}),
    )
    .await;
    assert_eq!(second.status, 202);
    let second = second.json()["id"].as_u64().unwrap();
    // One running and one queued: a third is refused.
    post(
        &app,
        "/v1/datasets",
        json!({"name": "third", "source": source}),
    )
    .await
    .error(429, "too_many_requests");
    // A second job for a name in flight is a conflict, not a queue entry.
    post(
        &app,
        "/v1/datasets",
        json!({"name": "first", "source": source}),
    )
    .await
    .error(409, "conflict");

    let running = job_until(&app, first, |job| {
        job["state"] == "running" && job["raw_bytes_done"].as_u64().unwrap() > 0
    })
    .await;
    assert!(running["progress"].as_f64().unwrap() < 1.0);
    assert_eq!(
        get(&app, &format!("/v1/jobs/{second}")).await.json()["state"],
        "queued"
    );
    let status = get(&app, "/v1/status").await.json();
    assert_eq!(status["pools"]["jobs_running"], 1);
    assert_eq!(status["pools"]["jobs_active"], 2);
    assert!(
        !staging_dirs(root.path()).is_empty(),
        "the running pack stages"
    );

    let cancelled = delete(&app, &format!("/v1/jobs/{second}")).await;
    assert_eq!(cancelled.status, 200);
    assert_eq!(cancelled.json()["state"], "cancelled");
    let cancelled = delete(&app, &format!("/v1/jobs/{first}")).await;
    assert_eq!(cancelled.status, 200, "{}", cancelled.json());
    let cancelled = cancelled.json();
    assert_eq!(cancelled["state"], "cancelled");
    assert!(
        cancelled["raw_bytes_done"].as_u64().unwrap()
            < cancelled["raw_bytes_total"].as_u64().unwrap()
    );
    assert!(staging_dirs(root.path()).is_empty(), "nothing half-written");
    assert!(!root.path().join("first").exists());
    assert!(!root.path().join("second").exists());
    assert!(get(&app, "/v1/datasets").await.json()["datasets"]
        .as_array()
        .unwrap()
        .is_empty());
    // Cancelling is idempotent.
    let again = delete(&app, &format!("/v1/jobs/{first}")).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.json()["state"], "cancelled");
    // Both slots are free again.
    let status = get(&app, "/v1/status").await.json();
    assert_eq!(status["pools"]["jobs_active"], 0);
}

#[tokio::test]
async fn sessions_are_listed_and_closed_through_the_directory() {
    let root = scratch();
    let app = open(options(root.path()));
    let listed = get(&app, "/v1/sessions").await.json();
    assert_eq!(listed["listed"], false);
    assert_eq!(listed["sessions"], json!([]));
    let message = delete(&app, "/v1/sessions/1").await.error(404, "not_found");
    assert!(message.contains("does not list"), "{message}");

    // What the socket server does once it is hooked up.
    let directory = app.control.registry().sessions();
    directory.attach();
    let closed = Arc::new(AtomicBool::new(false));
    let entry = directory.register(
        SessionInfo {
            id: 7,
            uid: 1000,
            client: "trainer rank 0".to_string(),
            started: SystemTime::UNIX_EPOCH + Duration::from_secs(86_400),
        },
        {
            let closed = Arc::clone(&closed);
            Arc::new(move |_reason: CloseReason| closed.store(true, Ordering::SeqCst))
        },
    );
    entry.set_stream("demo");
    let listed = get(&app, "/v1/sessions").await.json();
    assert_eq!(listed["listed"], true);
    assert_eq!(
        listed["sessions"],
        json!([{"id": 7, "uid": 1000, "client": "trainer rank 0",
                "started_at": "1970-01-02T00:00:00Z", "dataset": "demo"}])
    );
    let reply = delete(&app, "/v1/sessions/7").await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json(), json!({"id": 7, "closed": true}));
    assert!(closed.load(Ordering::SeqCst));
    drop(entry);
    assert_eq!(
        get(&app, "/v1/sessions").await.json()["sessions"],
        json!([])
    );
    delete(&app, "/v1/sessions/7").await.error(404, "not_found");
}

#[tokio::test]
async fn status_and_metrics_report_what_exists() {
    let root = scratch();
    pack_dataset(&root.path().join("one"), "one");
    let app = open(options(root.path()));
    // As the socket server does when it binds: status then reports it as attached.
    app.control.registry().sessions().attach();
    let status = get(&app, "/v1/status").await.json();
    assert_eq!(status["version"], env!("CARGO_PKG_VERSION"));
    assert!(status["uptime_seconds"].as_f64().unwrap() >= 0.0);
    assert_eq!(status["serving"]["backend"], "cpu");
    assert_eq!(status["pools"]["socket_server"], true);
    assert_eq!(status["pools"]["sessions_max"], 8);
    assert_eq!(status["pools"]["slot_bytes_max"], 1u64 << 30);
    assert_eq!(status["host_memory"]["budget_bytes"], 1u64 << 30);
    // The memory the daemon may use: the RAM or a cgroup's limit, never above the RAM.
    let ram = gpufeed::storage::memory::host_ram_bytes().unwrap();
    let limit = status["host_memory"]["memory_limit_bytes"]
        .as_u64()
        .unwrap();
    assert!(limit > 0 && limit <= ram, "{limit} of {ram}");
    let source = status["host_memory"]["memory_limit_source"]
        .as_str()
        .unwrap();
    assert!(["ram", "cgroup"].contains(&source), "{source}");
    assert_eq!(status["host_memory"]["block_cache_kept_bytes"], 0);
    assert_eq!(status["host_memory"]["block_cache_hits"], 0);
    assert_eq!(status["datasets"], 1);
    let engines = status["platform"]["engines"].as_array().unwrap();
    let uring = engines
        .iter()
        .find(|e| e["device"] == "host" && e["engine"] == "io_uring")
        .expect("io_uring is reported");
    assert!(uring["reason"].as_str().is_some_and(|r| !r.is_empty()));
    let cuda = &status["platform"]["cuda"];
    assert_eq!(
        cuda["available"].as_bool().unwrap(),
        !status["platform"]["devices"].as_array().unwrap().is_empty()
    );
    assert!(!cuda["reason"].as_str().unwrap().is_empty());
    // MPS: the pipe directory looked at, and active only where the driver says this process is a
    // client and a control daemon runs; without a CUDA device nothing is a client.
    let mps = &status["mps"];
    assert!(
        mps["pipe_directory"]
            .as_str()
            .is_some_and(|d| !d.is_empty()),
        "{mps}"
    );
    assert!(!mps["reason"].as_str().unwrap().is_empty());
    assert_eq!(
        mps["active"].as_bool().unwrap(),
        mps["client"] == true && !mps["control_daemon_pid"].is_null(),
        "{mps}"
    );
    if !cuda["available"].as_bool().unwrap() {
        assert_eq!(mps["active"], false, "{mps}");
        assert_eq!(mps["client"], Value::Null, "{mps}");
    }

    let reply = get(&app, "/metrics").await;
    assert_eq!(reply.status, 200);
    assert!(reply.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    let text = String::from_utf8(reply.body).unwrap();
    for series in [
        "gpufeed_batches_served_total 0\n",
        "gpufeed_sessions 0\n",
        "gpufeed_slot_bytes_allocated 0\n",
        "gpufeed_datasets{state=\"ready\"} 1\n",
        "gpufeed_read_bytes_total{engine=\"io_uring\"} 0\n",
        "gpufeed_handoff_latency_seconds_bucket{le=\"+Inf\"} 0\n",
        "gpufeed_corrupt_blocks_total 0\n",
        "gpufeed_decode_seconds_total 0\n",
        "gpufeed_host_stream_memory_budget_bytes 1073741824\n",
        "gpufeed_block_cache_kept_bytes 0\n",
        "gpufeed_block_cache_misses_total 0\n",
    ] {
        assert!(text.contains(series), "no {series:?} in:\n{text}");
    }
    // Responses so far: the status, and this one is counted after it is rendered.
    assert!(
        text.contains("gpufeed_http_responses_total{class=\"2xx\"} 1\n"),
        "{text}"
    );
}

#[tokio::test]
async fn the_token_guards_mutations_on_loopback_and_everything_beyond() {
    let root = scratch();
    pack_dataset(&root.path().join("nested/t"), "t");
    let mut guarded = options(root.path());
    guarded.auth = AuthPolicy {
        token: Some(TOKEN.to_string()),
        scope: AuthScope::Mutating,
    };
    let app = open(guarded.clone());
    assert_eq!(get(&app, "/v1/datasets").await.status, 200);
    assert_eq!(get(&app, "/healthz").await.status, 200);
    let body = register_body("t", "nested/t").to_string().into_bytes();
    let json_header = ("content-type", "application/json");
    let missing = call(
        &app,
        "POST",
        "/v1/datasets",
        &[json_header],
        Some(body.clone()),
    )
    .await;
    missing.error(401, "unauthorized");
    assert!(missing.headers["www-authenticate"]
        .to_str()
        .unwrap()
        .starts_with("Bearer"));
    let wrong = format!("Bearer {TOKEN}x");
    call(
        &app,
        "POST",
        "/v1/datasets",
        &[json_header, ("authorization", &wrong)],
        Some(body.clone()),
    )
    .await
    .error(401, "unauthorized");
    call(
        &app,
        "POST",
        "/v1/datasets",
        &[json_header, ("authorization", TOKEN)],
        Some(body.clone()),
    )
    .await
    .error(401, "unauthorized");
    let right = format!("Bearer {TOKEN}");
    let created = call(
        &app,
        "POST",
        "/v1/datasets",
        &[json_header, ("authorization", &right)],
        Some(body),
    )
    .await;
    assert_eq!(created.status, 201);
    call(&app, "DELETE", "/v1/datasets/t", &[], None)
        .await
        .error(401, "unauthorized");
    call(&app, "DELETE", "/v1/sessions/1", &[], None)
        .await
        .error(401, "unauthorized");
    drop(app);

    guarded.auth.scope = AuthScope::Everything;
    let app = open(guarded);
    for path in [
        "/healthz",
        "/v1/datasets",
        "/metrics",
        "/openapi.json",
        "/v1/status",
    ] {
        get(&app, path).await.error(401, "unauthorized");
        let reply = call(&app, "GET", path, &[("authorization", &right)], None).await;
        assert_eq!(reply.status, 200, "{path}");
    }
}

#[tokio::test]
async fn start_up_settles_interrupted_jobs_and_combines_catalog_and_scan() {
    let root = scratch();
    pack_dataset(&root.path().join("scanned"), "scanned");
    pack_dataset(&root.path().join("finished"), "finished");
    std::fs::create_dir(root.path().join(".half.partial-1-2")).unwrap();
    std::fs::write(
        root.path().join(".half.partial-1-2/shard-000000.gfs"),
        b"partial",
    )
    .unwrap();
    std::fs::create_dir(root.path().join(".hidden")).unwrap();
    // What a daemon killed in the middle of two jobs leaves: one had not finished packing, the
    // other had renamed its dataset into place but not recorded it.
    let job = |dataset: &str, state: JobState| JobRecord {
        dataset: dataset.to_string(),
        state,
        created_at_unix_s: 1,
        started_at_unix_s: Some(2),
        finished_at_unix_s: None,
        source: json!({"fields": []}),
        raw_bytes_total: 100,
        raw_bytes_done: 40,
        stored_bytes: None,
        error: None,
    };
    let mut catalog = CatalogData {
        next_job_id: 3,
        ..CatalogData::default()
    };
    catalog.jobs.insert(1, job("half", JobState::Running));
    catalog.jobs.insert(2, job("finished", JobState::Running));
    std::fs::write(root.path().join(CATALOG_FILE_NAME), catalog.to_json()).unwrap();

    let app = open(options(root.path()));
    let half = get(&app, "/v1/jobs/1").await.json();
    assert_eq!(half["state"], "failed");
    assert!(half["error"]
        .as_str()
        .unwrap()
        .contains("stopped during the job"));
    assert!(!root.path().join(".half.partial-1-2").exists());
    get(&app, "/v1/datasets/half").await.error(404, "not_found");
    let finished = get(&app, "/v1/jobs/2").await.json();
    assert_eq!(finished["state"], "succeeded");
    let datasets = get(&app, "/v1/datasets").await.json();
    let names: Vec<(&str, &str)> = datasets["datasets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["name"].as_str().unwrap(), d["origin"].as_str().unwrap()))
        .collect();
    assert_eq!(names, [("finished", "packed"), ("scanned", "scanned")]);

    // The settled catalog is on disk: a second start changes nothing.
    let on_disk = std::fs::read(root.path().join(CATALOG_FILE_NAME)).unwrap();
    drop(app);
    let app = open(options(root.path()));
    assert_eq!(
        std::fs::read(root.path().join(CATALOG_FILE_NAME)).unwrap(),
        on_disk
    );
    assert_eq!(app.control.registry().names(), ["finished", "scanned"]);
}

#[tokio::test]
async fn a_corrupt_catalog_stops_the_start_and_is_left_alone() {
    let root = scratch();
    let path = root.path().join(CATALOG_FILE_NAME);
    std::fs::write(
        &path,
        b"{\"format\": \"gpufeed-catalog\", \"version\": 1, \"dat",
    )
    .unwrap();
    let result = Control::open(
        options(root.path()),
        Arc::new(Registry::new()),
        Arc::new(Metrics::new()),
    );
    let error = result
        .err()
        .expect("a corrupt catalog is an error")
        .to_string();
    assert!(
        error.contains(CATALOG_FILE_NAME) && error.contains("corrupt"),
        "{error}"
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        b"{\"format\": \"gpufeed-catalog\", \"version\": 1, \"dat"
    );
}

/// The device-memory tier's endpoints on a daemon that serves no GPU: each names the device asked
/// for and what the daemon serves (404), and status reports the tier's budget as off.
#[tokio::test]
async fn device_cache_endpoints_name_the_devices_served() {
    let root = scratch();
    pack_dataset(&root.path().join("one"), "one");
    let app = open(options(root.path()));
    for (method, uri) in [
        ("GET", "/v1/devices/cuda:0/cache"),
        ("PUT", "/v1/devices/cuda:0/cache/one/pin"),
        ("DELETE", "/v1/devices/cuda:0/cache/one/pin"),
        ("DELETE", "/v1/devices/0/cache/one"),
    ] {
        let reply = call(&app, method, uri, &[], None).await;
        let message = reply.error(404, "not_found");
        assert!(
            message.contains("is not served by this daemon") && message.contains("no GPU"),
            "{method} {uri}: {message}"
        );
    }
    let status = get(&app, "/v1/status").await.json();
    assert_eq!(status["serving"]["device_cache"], 0);
}
