//! AWS shared configuration files (`~/.aws/credentials`, `~/.aws/config`): the profile the
//! environment names, read where the environment itself gives no keys, as the AWS CLI and SDKs do.
//!
//! Precedence, as the AWS tools define it: keys in the environment (`AWS_ACCESS_KEY_ID`, ...) win
//! over any profile, and are then the only credentials used; otherwise the profile `AWS_PROFILE`
//! names (`default` when unset) gives them, from `AWS_SHARED_CREDENTIALS_FILE` (else
//! `~/.aws/credentials`, section `[NAME]`) and from `AWS_CONFIG_FILE` (else `~/.aws/config`,
//! section `[profile NAME]`, or `[default]`), the credentials file winning where both set a key.
//! The region and endpoint of the profile apply unless the environment sets them. Without keys in
//! either, the store client goes on to its other providers (web identity, the ECS and EC2 roles).
//! A profile named by `AWS_PROFILE` that neither file holds is an error; a missing `default` is
//! not. Secrets read here are never logged or put in errors.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What a profile sets (values as written in the files).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AwsProfile {
    /// `aws_access_key_id`.
    pub access_key_id: Option<String>,
    /// `aws_secret_access_key`.
    pub secret_access_key: Option<String>,
    /// `aws_session_token`.
    pub session_token: Option<String>,
    /// `region`.
    pub region: Option<String>,
    /// `endpoint_url`.
    pub endpoint_url: Option<String>,
}

/// A profile named by `AWS_PROFILE` that no file holds.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "AWS_PROFILE names the profile '{profile}', which neither {credentials} nor {config} holds"
)]
pub struct MissingProfile {
    /// The profile's name.
    pub profile: String,
    /// The credentials file looked in.
    pub credentials: String,
    /// The config file looked in.
    pub config: String,
}

/// The sections of an INI file as the AWS tools write them: `[name]` headers, `key = value` lines,
/// `#` and `;` comment lines; keys lowercased. Lines of nested settings (indented, under a key with
/// no value) are skipped.
fn sections(text: &str) -> HashMap<String, HashMap<String, String>> {
    let mut sections: HashMap<String, HashMap<String, String>> = HashMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if line.starts_with([' ', '\t']) {
            continue;
        }
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let name = name.trim().to_string();
            sections.entry(name.clone()).or_default();
            current = Some(name);
            continue;
        }
        if let (Some(section), Some((key, value))) = (&current, line.split_once('=')) {
            let value = value.trim();
            if !value.is_empty() {
                sections
                    .entry(section.clone())
                    .or_default()
                    .insert(key.trim().to_ascii_lowercase(), value.to_string());
            }
        }
    }
    sections
}

/// The profile `env` (a variable's value by name) selects from the files, or `None` when the
/// environment's own keys are to be used, or no file holds the default profile.
pub fn profile_from(
    env: &dyn Fn(&str) -> Option<String>,
    home: Option<&Path>,
) -> Result<Option<AwsProfile>, MissingProfile> {
    if env("AWS_ACCESS_KEY_ID").is_some() {
        return Ok(None);
    }
    let named = env("AWS_PROFILE").filter(|p| !p.is_empty());
    let name = named.clone().unwrap_or_else(|| "default".to_string());
    let path = |variable: &str, file: &str| -> Option<PathBuf> {
        env(variable)
            .map(PathBuf::from)
            .or_else(|| home.map(|h| h.join(".aws").join(file)))
    };
    let credentials_path = path("AWS_SHARED_CREDENTIALS_FILE", "credentials");
    let config_path = path("AWS_CONFIG_FILE", "config");
    let read = |p: &Option<PathBuf>| {
        p.as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map(|t| sections(&t))
            .unwrap_or_default()
    };
    let credentials = read(&credentials_path);
    let config = read(&config_path);
    let config_section = if name == "default" {
        config.get("default")
    } else {
        config.get(&format!("profile {name}"))
    };
    let credentials_section = credentials.get(&name);
    if credentials_section.is_none() && config_section.is_none() {
        if named.is_some() {
            let shown = |p: &Option<PathBuf>| {
                p.as_ref().map_or("(no file: HOME unset)".to_string(), |p| {
                    p.display().to_string()
                })
            };
            return Err(MissingProfile {
                profile: name,
                credentials: shown(&credentials_path),
                config: shown(&config_path),
            });
        }
        return Ok(None);
    }
    let get = |key: &str| {
        credentials_section
            .and_then(|s| s.get(key))
            .or_else(|| config_section.and_then(|s| s.get(key)))
            .cloned()
    };
    Ok(Some(AwsProfile {
        access_key_id: get("aws_access_key_id"),
        secret_access_key: get("aws_secret_access_key"),
        session_token: get("aws_session_token"),
        region: get("region")
            .filter(|_| env("AWS_REGION").is_none() && env("AWS_DEFAULT_REGION").is_none()),
        endpoint_url: get("endpoint_url")
            .filter(|_| env("AWS_ENDPOINT").is_none() && env("AWS_ENDPOINT_URL").is_none()),
    }))
}

/// [`profile_from`] the process's environment and home directory.
pub fn profile() -> Result<Option<AwsProfile>, MissingProfile> {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    profile_from(&|name| std::env::var(name).ok(), home.as_deref())
}

/// `builder` with what `profile` sets.
pub fn apply(
    mut builder: object_store::aws::AmazonS3Builder,
    profile: &AwsProfile,
) -> object_store::aws::AmazonS3Builder {
    if let (Some(key), Some(secret)) = (&profile.access_key_id, &profile.secret_access_key) {
        builder = builder
            .with_access_key_id(key)
            .with_secret_access_key(secret);
        if let Some(token) = &profile.session_token {
            builder = builder.with_token(token);
        }
    }
    if let Some(region) = &profile.region {
        builder = builder.with_region(region);
    }
    if let Some(endpoint) = &profile.endpoint_url {
        builder = builder.with_endpoint(endpoint);
    }
    builder
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    fn home_with(credentials: &str, config: &str) -> tempfile::TempDir {
        let home = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(home.path().join(".aws")).unwrap();
        std::fs::write(home.path().join(".aws/credentials"), credentials).unwrap();
        std::fs::write(home.path().join(".aws/config"), config).unwrap();
        home
    }

    const CREDENTIALS: &str = "# keys\n[default]\naws_access_key_id = AKDEFAULT\n\
        aws_secret_access_key = secret-default\n\n[train]\naws_access_key_id=AKTRAIN\n\
        aws_secret_access_key=secret-train\naws_session_token = tok\n";
    const CONFIG: &str = "[default]\nregion = us-east-1\n[profile train]\nregion = eu-west-1\n\
        endpoint_url = http://127.0.0.1:9000\ns3 =\n  addressing_style = path\n\
        [profile config-only]\naws_access_key_id = AKCFG\naws_secret_access_key = secret-cfg\n";

    #[test]
    fn the_named_profile_is_read_from_both_files() {
        let home = home_with(CREDENTIALS, CONFIG);
        let env = env_of(&[("AWS_PROFILE", "train")]);
        let profile = profile_from(&env, Some(home.path())).unwrap().unwrap();
        assert_eq!(
            profile,
            AwsProfile {
                access_key_id: Some("AKTRAIN".into()),
                secret_access_key: Some("secret-train".into()),
                session_token: Some("tok".into()),
                region: Some("eu-west-1".into()),
                endpoint_url: Some("http://127.0.0.1:9000".into()),
            }
        );
        let default = profile_from(&env_of(&[]), Some(home.path()))
            .unwrap()
            .unwrap();
        assert_eq!(default.access_key_id.as_deref(), Some("AKDEFAULT"));
        assert_eq!(default.region.as_deref(), Some("us-east-1"));
        let config_only = profile_from(
            &env_of(&[("AWS_PROFILE", "config-only")]),
            Some(home.path()),
        )
        .unwrap()
        .unwrap();
        assert_eq!(config_only.secret_access_key.as_deref(), Some("secret-cfg"));
    }

    #[test]
    fn the_environment_wins_over_the_files() {
        let home = home_with(CREDENTIALS, CONFIG);
        let keys = env_of(&[("AWS_ACCESS_KEY_ID", "AKENV"), ("AWS_PROFILE", "train")]);
        assert_eq!(profile_from(&keys, Some(home.path())).unwrap(), None);
        let region = env_of(&[("AWS_PROFILE", "train"), ("AWS_REGION", "ap-south-1")]);
        let profile = profile_from(&region, Some(home.path())).unwrap().unwrap();
        assert_eq!(profile.region, None, "the environment's region applies");
        assert_eq!(profile.access_key_id.as_deref(), Some("AKTRAIN"));
        let files = tempfile::tempdir().unwrap();
        let moved = files.path().join("creds");
        std::fs::write(&moved, "[train]\naws_access_key_id = AKMOVED\n").unwrap();
        let env = env_of(&[
            ("AWS_PROFILE", "train"),
            ("AWS_SHARED_CREDENTIALS_FILE", moved.to_str().unwrap()),
        ]);
        let profile = profile_from(&env, Some(home.path())).unwrap().unwrap();
        assert_eq!(profile.access_key_id.as_deref(), Some("AKMOVED"));
    }

    #[test]
    fn a_named_profile_no_file_holds_is_an_error_a_missing_default_is_not() {
        let home = home_with(CREDENTIALS, CONFIG);
        let error =
            profile_from(&env_of(&[("AWS_PROFILE", "nope")]), Some(home.path())).unwrap_err();
        assert_eq!(error.profile, "nope");
        assert!(error.to_string().contains("credentials"), "{error}");
        assert!(!error.to_string().contains("secret"), "{error}");
        let empty = tempfile::tempdir().unwrap();
        assert_eq!(
            profile_from(&env_of(&[]), Some(empty.path())).unwrap(),
            None
        );
        assert_eq!(profile_from(&env_of(&[]), None).unwrap(), None);
    }
}
