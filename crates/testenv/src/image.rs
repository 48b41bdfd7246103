//! OCI images built without Docker: a list of files packed as one layer into an OCI image
//! layout archive that `ctr images import` takes. Used for the sandbox image, the ipreclaim
//! image and the whereabouts control loop image of the real node.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

/// One file of an image's filesystem.
pub struct File {
    /// Absolute path inside the image.
    pub path: String,
    pub data: Vec<u8>,
    pub mode: u32,
}

impl File {
    pub fn new(path: &str, data: impl Into<Vec<u8>>, mode: u32) -> File {
        File {
            path: path.into(),
            data: data.into(),
            mode,
        }
    }

    /// A host file placed at `to` in the image, with its mode.
    pub fn from_host_to(path: &Path, to: &str) -> Result<File> {
        use std::os::unix::fs::PermissionsExt;
        let data = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
        let mode = std::fs::metadata(path)?.permissions().mode() & 0o7777;
        Ok(File::new(to, data, mode))
    }
}

/// What an image runs.
pub struct Config<'a> {
    pub name: &'a str,
    pub entrypoint: &'a [&'a str],
    pub cmd: &'a [&'a str],
    /// `uid:gid`, or empty for root.
    pub user: &'a str,
}

fn sha256_hex(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn tar_add(archive: &mut tar::Builder<Vec<u8>>, name: &str, data: &[u8], mode: u32) -> Result<()> {
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(mode);
    h.set_mtime(0);
    h.set_cksum();
    archive.append_data(&mut h, name, data)?;
    Ok(())
}

/// Packs `files` as an OCI image layout archive at `out`, named `config.name`.
pub fn write_oci_archive(files: &[File], config: &Config, out: &Path) -> Result<()> {
    let mut layer = tar::Builder::new(Vec::new());
    for f in files {
        let name = f.path.trim_start_matches('/');
        tar_add(&mut layer, name, &f.data, f.mode)?;
    }
    let layer = layer.into_inner()?;
    let layer_digest = sha256_hex(&layer);

    let image_config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Entrypoint": config.entrypoint,
            "Cmd": config.cmd,
            "User": config.user,
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
        },
        "rootfs": { "type": "layers", "diff_ids": [format!("sha256:{layer_digest}")] },
    })
    .to_string();
    let config_digest = sha256_hex(image_config.as_bytes());
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": format!("sha256:{config_digest}"),
            "size": image_config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": format!("sha256:{layer_digest}"),
            "size": layer.len(),
        }],
    })
    .to_string();
    let manifest_digest = sha256_hex(manifest.as_bytes());
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{manifest_digest}"),
            "size": manifest.len(),
            "annotations": { "io.containerd.image.name": config.name },
        }],
    })
    .to_string();

    let mut archive = tar::Builder::new(Vec::new());
    tar_add(
        &mut archive,
        "oci-layout",
        br#"{"imageLayoutVersion":"1.0.0"}"#,
        0o644,
    )?;
    tar_add(&mut archive, "index.json", index.as_bytes(), 0o644)?;
    tar_add(
        &mut archive,
        &format!("blobs/sha256/{layer_digest}"),
        &layer,
        0o644,
    )?;
    tar_add(
        &mut archive,
        &format!("blobs/sha256/{config_digest}"),
        image_config.as_bytes(),
        0o644,
    )?;
    tar_add(
        &mut archive,
        &format!("blobs/sha256/{manifest_digest}"),
        manifest.as_bytes(),
        0o644,
    )?;
    std::fs::write(out, archive.into_inner()?).with_context(|| format!("write {}", out.display()))
}

/// The shared libraries (and the loader) a dynamically linked `binary` needs, from `ldd`.
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("run ldd (libc-bin)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // A static binary: ldd says so and needs nothing.
        if text.contains("not a dynamic executable")
            || String::from_utf8_lossy(&out.stderr).contains("not a dynamic executable")
        {
            return Ok(Vec::new());
        }
        bail!("ldd {} failed: {text}", binary.display());
    }
    let mut libs = Vec::new();
    for line in text.lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line
                .split_whitespace()
                .next()
                .filter(|p| p.starts_with('/')),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    Ok(libs)
}

/// `/etc/passwd` and `/etc/group` with root and the distroless `nonroot` user (65532).
pub fn user_files() -> Vec<File> {
    vec![
        File::new(
            "/etc/passwd",
            "root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n",
            0o644,
        ),
        File::new("/etc/group", "root:x:0:\nnonroot:x:65532:\n", 0o644),
    ]
}

/// An image of one host binary at `to` with what it needs to run (its shared libraries, the
/// loader, `/etc/passwd`), the way a distroless base would hold it.
pub fn binary_image_files(binary: &Path, to: &str) -> Result<Vec<File>> {
    let mut files = vec![File::from_host_to(binary, to)?];
    for lib in shared_libraries(binary)? {
        // Resolve symlinks (the loader path is one) but keep the path the binary asks for.
        let real = std::fs::canonicalize(&lib)?;
        files.push(File::from_host_to(&real, &lib.display().to_string())?);
    }
    files.extend(user_files());
    Ok(files)
}
