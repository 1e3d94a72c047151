//! Checkpoints: parameters and optimizer state in safetensors plus a JSON sidecar (config, step,
//! data position, …), each written atomically (temporary file, fsync, rename) with the sidecar
//! last, so an interrupted save never leaves a checkpoint that loads (docs/ARCHITECTURE.md, "Models, data,
//! training").
//!
//! Layout in the checkpoint folder: `step-000042.safetensors` and `step-000042.json`; the JSON
//! records the sha256 of the safetensors file, checked on load.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};

use crate::data::{sha256_bytes, sha256_file};

/// A named f32 tensor: shape and row-major values.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    /// Name, e.g. `layers.0.attn.q_proj.weight` or `adam.m.layers.0.attn.q_proj.weight`.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
    /// Values, `shape.iter().product()` of them.
    pub data: Vec<f32>,
}

/// The JSON sidecar.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sidecar {
    /// Optimizer steps completed.
    pub step: u64,
    /// sha256 of the safetensors file.
    pub sha256: String,
    /// The safetensors file name (in the same folder).
    pub tensors: String,
    /// Everything else the run needs to resume (model config, schedule, data position, RNG…).
    pub state: serde_json::Value,
}

/// A loaded checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// The sidecar it was loaded from (a folder given to [`load`] resolves to its newest).
    pub path: PathBuf,
    /// The sidecar.
    pub sidecar: Sidecar,
    /// Tensors by name.
    pub tensors: BTreeMap<String, NamedTensor>,
}

/// Checkpoint errors, each naming the file.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// No complete checkpoint in a folder.
    #[error("no checkpoint (step-*.json) in {0}")]
    NotFound(PathBuf),
    /// The sidecar is not valid JSON of the expected form.
    #[error("{path}: corrupt checkpoint sidecar: {message}")]
    BadSidecar {
        /// The sidecar.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// The tensor file does not match its recorded checksum, or does not parse.
    #[error("{path}: corrupt checkpoint tensors: {message}")]
    BadTensors {
        /// The safetensors file.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// A tensor whose data length does not match its shape.
    #[error("tensor {name}: {len} values for shape {shape:?}")]
    Shape {
        /// Tensor name.
        name: String,
        /// Values given.
        len: usize,
        /// Shape given.
        shape: Vec<usize>,
    },
    /// Another process holds the folder's lock (a second run into one checkpoint folder).
    #[error("{0}: another graphpp run is using this checkpoint folder (its lock file .lock is held)")]
    Locked(PathBuf),
    /// I/O failure with the path.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_path_buf(), source }
}

/// Writes `bytes` to `path` atomically: a temporary sibling, fsync, rename, fsync of the folder
/// (so that the rename itself survives a power loss). A reader (or a process killed mid-write)
/// sees the old file or the new one, never a part.
///
/// # Errors
/// The I/O error of the temporary file or of the rename (the temporary file is removed).
pub fn write_file_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let res = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        let folder = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        // A folder that cannot be opened or fsynced (not Linux; a file system that refuses it)
        // keeps the rename as it is: the file is in place either way.
        if let Ok(d) = std::fs::File::open(folder) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

/// [`write_file_atomic`] with the error naming `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    write_file_atomic(path, bytes).map_err(io(path))
}

/// The safetensors file of `tensors` (f32, little-endian, in their order), to be written to
/// `path` (named in errors).
///
/// # Errors
/// [`CheckpointError::Shape`] for a tensor whose data does not fill its shape;
/// [`CheckpointError::BadTensors`] when safetensors refuses one.
pub fn safetensors_bytes(tensors: &[NamedTensor], path: &Path) -> Result<Vec<u8>, CheckpointError> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| {
            if t.shape.iter().product::<usize>() != t.data.len() {
                return Err(CheckpointError::Shape {
                    name: t.name.clone(),
                    len: t.data.len(),
                    shape: t.shape.clone(),
                });
            }
            Ok(t.data.iter().flat_map(|x| x.to_le_bytes()).collect())
        })
        .collect::<Result<_, _>>()?;
    let bad = |e: safetensors::SafeTensorError| CheckpointError::BadTensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let mut views = Vec::with_capacity(tensors.len());
    for (t, b) in tensors.iter().zip(&bytes) {
        views.push((t.name.clone(), TensorView::new(Dtype::F32, t.shape.clone(), b).map_err(bad)?));
    }
    safetensors::serialize(views, None).map_err(bad)
}

/// Saves a checkpoint for `step` into `dir` (created if needed) and returns the sidecar path.
///
/// # Errors
/// [`CheckpointError::Shape`] for a tensor whose data does not fill its shape; I/O errors.
pub fn save(
    dir: &Path,
    step: u64,
    tensors: &[NamedTensor],
    state: serde_json::Value,
) -> Result<PathBuf, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tensor_name = format!("step-{step:06}.safetensors");
    let tensor_path = dir.join(&tensor_name);
    let blob = safetensors_bytes(tensors, &tensor_path)?;
    write_atomic(&tensor_path, &blob)?;
    let sidecar = Sidecar { step, sha256: sha256_bytes(&blob), tensors: tensor_name, state };
    let json_path = dir.join(format!("step-{step:06}.json"));
    let json = serde_json::to_vec_pretty(&sidecar).expect("sidecar serialises");
    write_atomic(&json_path, &json)?;
    Ok(json_path)
}

/// The sidecars `step-N.json` in `dir`, by step, oldest first.
///
/// # Errors
/// [`CheckpointError::Io`] when `dir` cannot be read.
pub fn sidecars(dir: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io(dir))? {
        let p = e.map_err(io(dir))?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let step =
            name.strip_prefix("step-").and_then(|s| s.strip_suffix(".json")).and_then(|s| s.parse().ok());
        if let Some(step) = step {
            out.push((step, p));
        }
    }
    out.sort();
    Ok(out)
}

/// Deletes all but the newest `keep` checkpoints of `dir` (sidecar first, so a half-deleted
/// checkpoint never loads); returns the sidecars removed. `keep == 0` keeps everything.
///
/// # Errors
/// I/O errors naming the file.
pub fn prune(dir: &Path, keep: usize) -> Result<Vec<PathBuf>, CheckpointError> {
    let all = sidecars(dir)?;
    if keep == 0 || all.len() <= keep {
        return Ok(Vec::new());
    }
    let old = &all[..all.len() - keep];
    for (_, json) in old {
        std::fs::remove_file(json).map_err(io(json))?;
        let tensors = json.with_extension("safetensors");
        if tensors.exists() {
            std::fs::remove_file(&tensors).map_err(io(&tensors))?;
        }
    }
    Ok(old.iter().map(|(_, p)| p.clone()).collect())
}

/// Deletes every checkpoint in `dir` (sidecars first, so none is left half) and the temporary
/// files of interrupted writes; other files stay.
///
/// # Errors
/// I/O errors naming the file.
pub fn remove_all(dir: &Path) -> Result<(), CheckpointError> {
    for (_, json) in sidecars(dir)? {
        std::fs::remove_file(&json).map_err(io(&json))?;
    }
    remove_step_files(dir, |name| name.ends_with(".safetensors") || name.contains(".tmp-"))
}

/// Checks that files can be created in `dir` — or, when it does not exist yet, in the nearest
/// existing folder above it — by creating and removing a probe file, so that an unwritable
/// output folder is reported before training instead of at the first save.
///
/// # Errors
/// [`CheckpointError::Io`] naming the folder probed.
pub fn check_writable(dir: &Path) -> Result<(), CheckpointError> {
    if dir.exists() && !dir.is_dir() {
        let e = std::io::Error::new(std::io::ErrorKind::NotADirectory, "exists and is not a folder");
        return Err(io(dir)(e));
    }
    let existing = dir.ancestors().find(|d| d.is_dir()).unwrap_or(Path::new("."));
    let existing = if existing.as_os_str().is_empty() { Path::new(".") } else { existing };
    let probe = existing.join(format!(".graphpp-write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(io(existing))?;
    std::fs::remove_file(&probe).map_err(io(&probe))
}

/// Takes the exclusive lock of checkpoint folder `dir` (created if needed) for as long as the
/// returned file is open, so two runs — e.g. a job a scheduler requeued while the old one still
/// drains — never write into one folder. An advisory `flock` on `dir/.lock`, released by the OS
/// when the process ends, however it ends.
///
/// # Errors
/// [`CheckpointError::Locked`] when another process holds it; I/O errors naming the path.
pub fn lock(dir: &Path) -> Result<std::fs::File, CheckpointError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let path = dir.join(".lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io(&path))?;
    match file.try_lock() {
        Ok(()) => {
            remove_temporaries(dir)?;
            Ok(file)
        }
        Err(std::fs::TryLockError::WouldBlock) => Err(CheckpointError::Locked(dir.to_path_buf())),
        Err(std::fs::TryLockError::Error(e)) => Err(io(&path)(e)),
    }
}

/// Removes the temporary files of writes a killed run left in `dir` (`step-….tmp-PID`): with the
/// folder's lock held no other run writes there.
fn remove_temporaries(dir: &Path) -> Result<(), CheckpointError> {
    remove_step_files(dir, |name| name.contains(".tmp-"))
}

/// Removes the files `step-…` of `dir` whose name `which` selects.
fn remove_step_files(dir: &Path, which: impl Fn(&str) -> bool) -> Result<(), CheckpointError> {
    for e in std::fs::read_dir(dir).map_err(io(dir))? {
        let p = e.map_err(io(dir))?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("step-") && which(name) {
            std::fs::remove_file(&p).map_err(io(&p))?;
        }
    }
    Ok(())
}

/// Reads and parses a sidecar (no tensors, no checksum).
///
/// # Errors
/// [`CheckpointError::Io`], [`CheckpointError::BadSidecar`].
pub fn load_sidecar(json_path: &Path) -> Result<Sidecar, CheckpointError> {
    let text = std::fs::read(json_path).map_err(io(json_path))?;
    serde_json::from_slice(&text)
        .map_err(|e| CheckpointError::BadSidecar { path: json_path.to_path_buf(), message: e.to_string() })
}

/// Loads a checkpoint from a sidecar path, or from a folder its newest checkpoint that loads
/// ([`newest_loadable`]).
///
/// # Errors
/// [`CheckpointError::NotFound`] (no checkpoint in the folder loads); [`CheckpointError::BadSidecar`],
/// [`CheckpointError::BadTensors`] of the sidecar given.
pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
    if !path.is_dir() {
        return load_one(path);
    }
    let json = newest_loadable(path)?.ok_or_else(|| CheckpointError::NotFound(path.into()))?;
    load_one(&json)
}

/// The sidecar of `dir`'s newest checkpoint that loads — its sidecar parses, its step is its
/// name's, its tensors' checksum holds — or `None`. A newer damaged checkpoint (a crash or a
/// full disk during its save, a hand edit) is set aside with a warning: its sidecar is renamed
/// `step-N.json.damaged`, so that pruning, the next resume and every process of the run see
/// the same newest checkpoint (a process that finds it already set aside by another moves on).
///
/// # Errors
/// [`CheckpointError::Io`] when `dir` cannot be read or a sidecar cannot be set aside.
pub fn newest_loadable(dir: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    for (_, json) in sidecars(dir)?.iter().rev() {
        match check_one(json) {
            Ok(()) => return Ok(Some(json.clone())),
            Err(CheckpointError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(e @ (CheckpointError::BadSidecar { .. } | CheckpointError::BadTensors { .. })) => {
                let aside = json.with_extension("json.damaged");
                eprintln!(
                    "warning: checkpoint {} is damaged ({e}); set aside as {}",
                    json.display(),
                    aside.display()
                );
                match std::fs::rename(json, &aside) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(json)(e)),
                    _ => {}
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

/// Checks sidecar `json_path` as [`load_one`] does — parse, step, checksum — without reading
/// the tensors.
fn check_one(json_path: &Path) -> Result<(), CheckpointError> {
    let (sidecar, tensor_path) = checked_sidecar(json_path)?;
    let got = sha256_file(&tensor_path).map_err(|e| bad_tensors(&tensor_path, e.to_string()))?;
    check_sum(&sidecar, &tensor_path, &got)
}

/// Refuses tensors whose sha256 `got` is not the one `sidecar` records.
fn check_sum(sidecar: &Sidecar, tensor_path: &Path, got: &str) -> Result<(), CheckpointError> {
    if got != sidecar.sha256 {
        let message = format!("sha256 {got} does not match the recorded {}", sidecar.sha256);
        return Err(bad_tensors(tensor_path, message));
    }
    Ok(())
}

fn bad_tensors(path: &Path, message: String) -> CheckpointError {
    CheckpointError::BadTensors { path: path.to_path_buf(), message }
}

/// Sidecar `json_path` and the path of its tensors, refused when its step is not its name's or
/// its tensors' file that step's.
fn checked_sidecar(json_path: &Path) -> Result<(Sidecar, PathBuf), CheckpointError> {
    let sidecar = load_sidecar(json_path)?;
    let named_step = json_path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("step-"))
        .and_then(|n| n.strip_suffix(".json"))
        .and_then(|n| n.parse::<u64>().ok());
    let want_tensors = format!("step-{:06}.safetensors", sidecar.step);
    if named_step.is_some_and(|s| s != sidecar.step) || sidecar.tensors != want_tensors {
        return Err(CheckpointError::BadSidecar {
            path: json_path.to_path_buf(),
            message: format!(
                "it records step {} and tensors {}, but its name says step {} (a sidecar edited or copied by hand?)",
                sidecar.step,
                sidecar.tensors,
                named_step.map_or("?".into(), |s| s.to_string())
            ),
        });
    }
    let tensor_path = json_path.parent().unwrap_or(Path::new(".")).join(&sidecar.tensors);
    Ok((sidecar, tensor_path))
}

/// The checkpoint of sidecar `json_path`, its step and tensors checked against its name and its
/// recorded checksum.
fn load_one(json_path: &Path) -> Result<Checkpoint, CheckpointError> {
    let (sidecar, tensor_path) = checked_sidecar(json_path)?;
    let json_path = json_path.to_path_buf();
    let bad = |message: String| bad_tensors(&tensor_path, message);
    // Read once, checked in memory.
    let blob = std::fs::read(&tensor_path).map_err(|e| bad(e.to_string()))?;
    check_sum(&sidecar, &tensor_path, &sha256_bytes(&blob))?;
    let st = safetensors::SafeTensors::deserialize(&blob).map_err(|e| bad(e.to_string()))?;
    let mut tensors = BTreeMap::new();
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(bad(format!("tensor {name} is {:?}, expected F32", view.dtype())));
        }
        let data =
            view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        tensors.insert(name.clone(), NamedTensor { name, shape: view.shape().to_vec(), data });
    }
    Ok(Checkpoint { path: json_path, sidecar, tensors })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensors() -> Vec<NamedTensor> {
        vec![
            NamedTensor { name: "a".into(), shape: vec![2, 3], data: vec![1.0, 2.0, 3.0, 4.0, 5.0, -6.5] },
            NamedTensor { name: "b.m".into(), shape: vec![1], data: vec![0.25] },
        ]
    }

    #[test]
    fn round_trip_and_newest() {
        let d = tempfile::tempdir().unwrap();
        save(d.path(), 3, &tensors(), serde_json::json!({"lr": 0.1})).unwrap();
        save(d.path(), 12, &tensors()[..1], serde_json::json!({"pos": 12})).unwrap();
        let c = load(d.path()).unwrap();
        assert_eq!(c.sidecar.step, 12);
        assert_eq!(c.sidecar.state["pos"], 12);
        assert_eq!(c.tensors.len(), 1);
        let c = load(&d.path().join("step-000003.json")).unwrap();
        assert_eq!(c.tensors["a"], tensors()[0]);
        assert_eq!(c.tensors["b.m"].data, vec![0.25]);
        // No temporary files left behind.
        let names: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(names.iter().all(|n| !n.contains("tmp")), "{names:?}");
    }

    #[test]
    fn corrupt_files_are_named_errors() {
        let d = tempfile::tempdir().unwrap();
        let j = save(d.path(), 1, &tensors(), serde_json::Value::Null).unwrap();
        let t = d.path().join("step-000001.safetensors");
        let mut bytes = std::fs::read(&t).unwrap();
        let n = bytes.len();
        bytes[n - 1] ^= 0xff;
        std::fs::write(&t, bytes).unwrap();
        assert!(matches!(load(&j), Err(CheckpointError::BadTensors { .. })));
        std::fs::write(&j, b"{not json").unwrap();
        assert!(matches!(load(&j), Err(CheckpointError::BadSidecar { .. })));
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(load(empty.path()), Err(CheckpointError::NotFound(_))));
        let bad = [NamedTensor { name: "x".into(), shape: vec![2, 2], data: vec![1.0] }];
        assert!(matches!(
            save(d.path(), 2, &bad, serde_json::Value::Null),
            Err(CheckpointError::Shape { .. })
        ));
        assert!(!d.path().join("step-000002.json").exists());
    }

    #[test]
    fn prune_keeps_the_newest() {
        let d = tempfile::tempdir().unwrap();
        let t = [NamedTensor { name: "w".into(), shape: vec![1], data: vec![1.0] }];
        for step in [3, 10, 7] {
            save(d.path(), step, &t, serde_json::json!({})).unwrap();
        }
        assert!(prune(d.path(), 0).unwrap().is_empty());
        let removed = prune(d.path(), 2).unwrap();
        assert_eq!(removed, vec![d.path().join("step-000003.json")]);
        assert!(!d.path().join("step-000003.safetensors").exists());
        assert_eq!(newest_loadable(d.path()).unwrap(), Some(d.path().join("step-000010.json")));
        assert_eq!(load(&d.path().join("step-000007.json")).unwrap().sidecar.step, 7);
    }

    /// A damaged newest checkpoint (its tensors truncated by a crash or a full disk) no longer
    /// blocks a resume: the folder's newest checkpoint that loads is taken. A sidecar given by
    /// path is not replaced.
    #[test]
    fn a_damaged_newest_checkpoint_falls_back_to_the_one_before() {
        let d = tempfile::tempdir().unwrap();
        save(d.path(), 3, &tensors(), serde_json::json!({"pos": 3})).unwrap();
        save(d.path(), 6, &tensors(), serde_json::json!({"pos": 6})).unwrap();
        let newest = d.path().join("step-000006.safetensors");
        let len = std::fs::metadata(&newest).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&newest).unwrap().set_len(len / 2).unwrap();
        assert!(matches!(load(&d.path().join("step-000006.json")), Err(CheckpointError::BadTensors { .. })));
        assert_eq!(load(d.path()).unwrap().sidecar.step, 3);
        // Set aside: pruning and the next resume see step 3 as the newest.
        assert_eq!(sidecars(d.path()).unwrap().iter().map(|(s, _)| *s).collect::<Vec<_>>(), [3]);
        assert!(d.path().join("step-000006.json.damaged").exists());
        // None that loads: not found.
        std::fs::write(d.path().join("step-000003.json"), b"{").unwrap();
        assert!(matches!(load(d.path()), Err(CheckpointError::NotFound(_))));
    }

    /// A sidecar whose step was edited (step 299 on step-300 tensors) is refused: its step must
    /// be its name's and its tensors' file that step's.
    #[test]
    fn an_edited_sidecar_step_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let json = save(d.path(), 300, &tensors(), serde_json::json!({})).unwrap();
        let text = std::fs::read_to_string(&json).unwrap().replace("\"step\": 300", "\"step\": 299");
        std::fs::write(&json, text).unwrap();
        let e = load(&json).unwrap_err();
        assert!(matches!(e, CheckpointError::BadSidecar { .. }), "{e}");
        assert!(e.to_string().contains("records step 299"), "{e}");
    }

    /// The temporary files of a killed save are removed when the next run takes the folder.
    #[test]
    fn taking_the_lock_removes_a_killed_saves_temporaries() {
        let d = tempfile::tempdir().unwrap();
        save(d.path(), 1, &tensors(), serde_json::json!({})).unwrap();
        let stale = d.path().join("step-000002.tmp-99999");
        std::fs::write(&stale, b"half").unwrap();
        let _lock = lock(d.path()).unwrap();
        assert!(!stale.exists());
        assert!(d.path().join("step-000001.json").exists());
    }
}
