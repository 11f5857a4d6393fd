//! Where a dataset lives in object storage: its URL turned into a store (credentials from the
//! environment, retries bounded), and the requests gpufeed makes of it.

use std::future::Future;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt};

use super::error::RemoteError;

/// The URL schemes a dataset may be registered from.
pub const OBJECT_URL_SCHEMES: [&str; 5] = ["s3", "gs", "az", "abfs", "file"];

/// Times a ranged GET is tried in all (each try is itself retried by the store client on
/// connection errors and server errors, [`STORE_RETRIES_MAX`] times).
pub const GET_ATTEMPTS_MAX: u32 = 4;

/// Retries the store client makes of one request before it reports the failure.
pub const STORE_RETRIES_MAX: usize = 3;

/// Pause before the second try of a ranged GET; doubled before each next one.
const GET_BACKOFF_FIRST: Duration = Duration::from_millis(250);

/// Longest a request may take, its body included (an 8 MiB range at 1 MB/s), and longest a
/// connection may take to open.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether `text` names a dataset in object storage rather than a directory.
pub fn is_object_url(text: &str) -> bool {
    OBJECT_URL_SCHEMES.iter().any(|scheme| {
        text.strip_prefix(scheme)
            .is_some_and(|rest| rest.starts_with("://"))
    })
}

/// A prefix in an object store: a dataset's `manifest.json` and shards are the objects under it.
#[derive(Clone, Debug)]
pub struct ObjectLocation {
    url: String,
    store: Arc<dyn ObjectStore>,
    prefix: ObjectPath,
}

impl ObjectLocation {
    /// The location `url` names (`s3://bucket/prefix`, `gs://bucket/prefix`,
    /// `az://container/prefix`, `file:///absolute/dir`), with credentials and settings from the
    /// environment (`AWS_*`, `GOOGLE_*`, `AZURE_*`). Nothing is requested yet.
    pub fn parse(url: &str) -> Result<ObjectLocation, RemoteError> {
        let trimmed = url.trim_end_matches('/').to_string();
        let bad = |reason: String| RemoteError::BadUrl {
            url: trimmed.clone(),
            reason,
        };
        let parsed = url::Url::parse(&trimmed).map_err(|e| bad(e.to_string()))?;
        let host = parsed.host_str().unwrap_or_default().to_string();
        let retry = object_store::RetryConfig {
            backoff: object_store::BackoffConfig {
                init_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(2),
                base: 2.0,
            },
            max_retries: STORE_RETRIES_MAX,
            retry_timeout: Duration::from_secs(30),
        };
        // Set key by key: replacing the client options whole would drop those read from the
        // environment (AWS_ALLOW_HTTP, proxies, ...).
        let timeouts = [
            (object_store::ClientConfigKey::Timeout, REQUEST_TIMEOUT),
            (
                object_store::ClientConfigKey::ConnectTimeout,
                CONNECT_TIMEOUT,
            ),
        ]
        .map(|(key, duration)| (key, format!("{}s", duration.as_secs())));
        let need_host = |what: &str| {
            if host.is_empty() {
                Err(bad(format!("names no {what}")))
            } else {
                Ok(())
            }
        };
        let built: Result<Arc<dyn ObjectStore>, object_store::Error> = match parsed.scheme() {
            "s3" => {
                need_host("bucket")?;
                // A profile of the shared AWS files, where the environment gives no keys.
                let profile = super::aws_profile::profile().map_err(|e| bad(e.to_string()))?;
                let builder = timeouts.iter().fold(
                    object_store::aws::AmazonS3Builder::from_env(),
                    |builder, (key, value)| {
                        builder
                            .with_config(object_store::aws::AmazonS3ConfigKey::Client(*key), value)
                    },
                );
                match &profile {
                    Some(profile) => super::aws_profile::apply(builder, profile),
                    None => builder,
                }
                .with_bucket_name(&host)
                .with_retry(retry)
                .build()
                .map(|store| Arc::new(store) as Arc<dyn ObjectStore>)
            }
            "gs" => {
                need_host("bucket")?;
                timeouts
                    .iter()
                    .fold(
                        object_store::gcp::GoogleCloudStorageBuilder::from_env(),
                        |builder, (key, value)| {
                            builder.with_config(
                                object_store::gcp::GoogleConfigKey::Client(*key),
                                value,
                            )
                        },
                    )
                    .with_bucket_name(&host)
                    .with_retry(retry)
                    .build()
                    .map(|store| Arc::new(store) as Arc<dyn ObjectStore>)
            }
            "az" | "abfs" => {
                need_host("container")?;
                timeouts
                    .iter()
                    .fold(
                        object_store::azure::MicrosoftAzureBuilder::from_env(),
                        |builder, (key, value)| {
                            builder.with_config(
                                object_store::azure::AzureConfigKey::Client(*key),
                                value,
                            )
                        },
                    )
                    .with_container_name(&host)
                    .with_retry(retry)
                    .build()
                    .map(|store| Arc::new(store) as Arc<dyn ObjectStore>)
            }
            "file" => {
                if !host.is_empty() && host != "localhost" {
                    return Err(bad("a file:// URL names a local path: file:///dir".into()));
                }
                Ok(Arc::new(object_store::local::LocalFileSystem::new()) as Arc<dyn ObjectStore>)
            }
            other => {
                return Err(bad(format!(
                    "unknown scheme {other:?} (expected one of {})",
                    OBJECT_URL_SCHEMES.join(", ")
                )))
            }
        };
        let store = built.map_err(|error| RemoteError::from_store(&trimmed, error))?;
        let prefix = ObjectPath::parse(parsed.path().trim_matches('/'))
            .map_err(|e| bad(format!("not a valid object prefix: {e}")))?;
        Ok(ObjectLocation {
            url: trimmed,
            store,
            prefix,
        })
    }

    /// The URL, without a trailing `/`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The URL of the object `name` under the prefix.
    pub fn object_url(&self, name: &str) -> String {
        format!("{}/{name}", self.url)
    }

    /// This location with its store put behind `wrap`: tests place a store that counts, holds or
    /// fails requests in front of the real one.
    #[cfg(test)]
    pub(crate) fn wrapping_store(
        &self,
        wrap: impl FnOnce(Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore>,
    ) -> ObjectLocation {
        ObjectLocation {
            url: self.url.clone(),
            store: wrap(Arc::clone(&self.store)),
            prefix: self.prefix.clone(),
        }
    }

    fn object(&self, name: &str) -> ObjectPath {
        self.prefix.clone().join(name)
    }

    /// The whole object `name`, refused if it is over `bytes_max` bytes.
    pub async fn get_all(&self, name: &str, bytes_max: u64) -> Result<Bytes, RemoteError> {
        let url = self.object_url(name);
        let path = self.object(name);
        let meta = self
            .store
            .head(&path)
            .await
            .map_err(|error| RemoteError::from_store(&url, error))?;
        if meta.size > bytes_max {
            return Err(RemoteError::Corrupt {
                url,
                what: format!("{} bytes exceeds the {bytes_max}-byte limit", meta.size),
            });
        }
        self.get_range(name, 0..meta.size, &AtomicU64::new(0)).await
    }

    /// The size of object `name`, or `None` if there is no such object.
    pub async fn size_of(&self, name: &str) -> Result<Option<u64>, RemoteError> {
        let url = self.object_url(name);
        match self.store.head(&self.object(name)).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(error) => Err(RemoteError::from_store(&url, error)),
        }
    }

    /// Bytes `range` of object `name`, exactly: a short answer is an error. Tried up to
    /// [`GET_ATTEMPTS_MAX`] times with a doubling pause between tries while the failure is the
    /// network's or the store's; each failed try is counted in `errors`.
    pub async fn get_range(
        &self,
        name: &str,
        range: Range<u64>,
        errors: &AtomicU64,
    ) -> Result<Bytes, RemoteError> {
        let url = self.object_url(name);
        let path = self.object(name);
        let wanted = range.end - range.start;
        let mut attempt = 1;
        loop {
            let error = match self.store.get_range(&path, range.clone()).await {
                Ok(bytes) if bytes.len() as u64 == wanted => return Ok(bytes),
                Ok(bytes) => RemoteError::Store {
                    url: url.clone(),
                    reason: format!(
                        "asked for bytes {}..{}, the store answered {} bytes",
                        range.start,
                        range.end,
                        bytes.len()
                    ),
                },
                Err(error) => RemoteError::from_store(&url, error),
            };
            errors.fetch_add(1, Ordering::Relaxed);
            if !error.is_transient() || attempt >= GET_ATTEMPTS_MAX {
                return Err(match error {
                    RemoteError::Store { url, reason } => RemoteError::Store {
                        url,
                        reason: format!("{reason} (after {attempt} tries)"),
                    },
                    other => other,
                });
            }
            tokio::time::sleep(GET_BACKOFF_FIRST * 2u32.pow(attempt - 1)).await;
            attempt += 1;
        }
    }

    /// Writes `bytes` as object `name` in one request.
    pub async fn put(&self, name: &str, bytes: Bytes) -> Result<(), RemoteError> {
        let url = self.object_url(name);
        self.store
            .put(&self.object(name), bytes.into())
            .await
            .map(|_| ())
            .map_err(|error| RemoteError::from_store(&url, error))
    }

    /// Writes the local file `file` as object `name`, in parts of `part_bytes` with at most
    /// `parts_in_flight` of them uploading at once.
    pub async fn upload_file(
        &self,
        name: &str,
        file: &std::path::Path,
        part_bytes: usize,
        parts_in_flight: usize,
    ) -> Result<(), RemoteError> {
        use std::io::Read;
        let url = self.object_url(name);
        let store_error = |error| RemoteError::from_store(&url, error);
        let io = |source| RemoteError::Io {
            path: file.to_path_buf(),
            source,
        };
        let upload = self
            .store
            .put_multipart(&self.object(name))
            .await
            .map_err(store_error)?;
        let mut writer = object_store::WriteMultipart::new_with_chunk_size(upload, part_bytes);
        let mut source = std::fs::File::open(file).map_err(io)?;
        let mut buffer = vec![0u8; part_bytes];
        loop {
            let read = source.read(&mut buffer).map_err(io)?;
            if read == 0 {
                break;
            }
            writer
                .wait_for_capacity(parts_in_flight)
                .await
                .map_err(store_error)?;
            writer.write(&buffer[..read]);
        }
        writer.finish().await.map(|_| ()).map_err(store_error)
    }
}

/// A small tokio runtime of its own for the object store's requests, usable from any thread, in
/// a runtime or not: tasks are spawned on it and their results sent back.
pub struct IoRuntime {
    runtime: Option<tokio::runtime::Runtime>,
}

impl IoRuntime {
    /// A runtime of `threads` worker threads.
    pub fn new(threads: usize) -> std::io::Result<IoRuntime> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("gpufeed-object")
            .enable_all()
            .build()?;
        Ok(IoRuntime {
            runtime: Some(runtime),
        })
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.runtime
            .as_ref()
            .expect("the runtime lives until drop")
            .handle()
    }

    /// Runs `future` on the runtime and blocks the calling thread until it is done. Not for a
    /// runtime's worker thread (use [`IoRuntime::run_async`] there).
    pub fn run<T: Send + 'static>(&self, future: impl Future<Output = T> + Send + 'static) -> T {
        let (done, result) = std::sync::mpsc::sync_channel(1);
        self.handle().spawn(async move {
            let _ = done.send(future.await);
        });
        result
            .recv()
            .expect("a task on the object runtime panicked")
    }

    /// Runs `future` on the runtime and waits for it asynchronously (from another runtime).
    pub async fn run_async<T: Send + 'static>(
        &self,
        future: impl Future<Output = T> + Send + 'static,
    ) -> T {
        self.handle()
            .spawn(future)
            .await
            .expect("a task on the object runtime panicked")
    }

    /// Spawns `future` on the runtime.
    pub fn spawn<T: Send + 'static>(
        &self,
        future: impl Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        self.handle().spawn(future)
    }
}

impl Drop for IoRuntime {
    fn drop(&mut self) {
        // Dropping a runtime from inside another runtime's task would panic; this never blocks.
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_urls_are_told_from_paths() {
        assert!(is_object_url("s3://bucket/prefix"));
        assert!(is_object_url("gs://bucket"));
        assert!(is_object_url("file:///tmp/ds"));
        assert!(!is_object_url("datasets/s3"));
        assert!(!is_object_url("s3:/bucket"));
        assert!(!is_object_url("/abs/path"));
    }

    #[test]
    fn a_bad_url_is_refused_naming_it() {
        let error = ObjectLocation::parse("ftp://host/x").unwrap_err();
        assert!(error.to_string().contains("ftp://host/x"), "{error}");
        assert!(error.to_string().contains("unknown scheme"), "{error}");
        let error = ObjectLocation::parse("s3:///no-bucket").unwrap_err();
        assert!(error.to_string().contains("names no bucket"), "{error}");
    }

    #[test]
    fn a_file_url_reads_the_local_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("object"), b"0123456789").unwrap();
        let location = ObjectLocation::parse(&format!("file://{}/", dir.path().display())).unwrap();
        assert_eq!(location.url(), format!("file://{}", dir.path().display()));
        let runtime = IoRuntime::new(1).unwrap();
        let errors = Arc::new(AtomicU64::new(0));
        let (at, counted) = (location.clone(), Arc::clone(&errors));
        let bytes = runtime
            .run(async move { at.get_range("object", 2..5, &counted).await })
            .unwrap();
        assert_eq!(&bytes[..], b"234");
        let missing = runtime
            .run(async move { location.get_all("absent", 100).await })
            .unwrap_err();
        assert!(matches!(missing, RemoteError::NotFound { .. }), "{missing}");
        assert!(
            missing.to_string().contains("/absent: not found"),
            "{missing}"
        );
    }
}
