//! Devices: which device a run computes on ([`DeviceSpec`], `--device`), and which kernels run a
//! tensor — the CPU kernels of this layer (they read candle's CPU storage in place) or candle's
//! own operations, composed, on whatever device the tensor lives on.
//!
//! Every kernel of this layer that reads CPU storage first asks [`composed`] of its operand;
//! where it says yes the kernel runs its candle composition instead (the same formula, without
//! the CPU kernel's fixed summation order, so values agree within rounding rather than bit for
//! bit). That is the path a CUDA tensor takes (candle's CUDA backend: cuBLAS products, its
//! elementwise and reduction kernels), and the path `GRAPHPP_KERNELS=composed` forces on the CPU
//! so that CI runs it without a GPU. Reads of small index tensors to the host (the experts' row
//! counts a mixture-of-experts layer routes by) are counted by [`count_host_read`] and reported
//! by [`host_reads`] (docs/ARCHITECTURE.md, "Devices").

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use candle_core::{Device, Tensor};

/// The environment variable that forces the compositions on the CPU: `composed`, or `compiled`
/// (the default: the CPU kernels). Read once per process.
pub const KERNELS_VAR: &str = "GRAPHPP_KERNELS";

/// What [`KERNELS_VAR`] says: whether the compositions are forced on the CPU.
///
/// # Errors
/// [`DeviceError::KernelsVar`] for a value other than `composed` and `compiled`.
pub fn kernels_choice() -> Result<bool, DeviceError> {
    static CHOICE: OnceLock<Result<bool, DeviceError>> = OnceLock::new();
    CHOICE
        .get_or_init(|| match std::env::var(KERNELS_VAR) {
            Err(_) => Ok(false),
            Ok(v) if v.eq_ignore_ascii_case("composed") => Ok(true),
            Ok(v) if v.eq_ignore_ascii_case("compiled") || v.is_empty() => Ok(false),
            Ok(v) => Err(DeviceError::KernelsVar(v)),
        })
        .clone()
}

/// Whether the compositions are forced on the CPU ([`KERNELS_VAR`] is `composed`; an unknown
/// value forces nothing: [`kernels_choice`] refuses it at a run's setup).
pub fn forced_composed() -> bool {
    kernels_choice().unwrap_or(false)
}

thread_local! {
    /// This thread's choice, over [`KERNELS_VAR`]'s, while [`with_composed`] runs.
    static CHOSEN: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with this thread's CPU tensors on the compositions (`true`) or on the CPU kernels
/// (`false`), whatever [`KERNELS_VAR`] says: `verify`'s single-device reference keeps the CPU
/// kernels when the compositions are forced, and tests compare the two paths in one process.
/// Kernels that run inside `f` on other threads (a rank's pool) are not covered: the choice is
/// made by the thread that calls a kernel.
pub fn with_composed<R>(composed: bool, f: impl FnOnce() -> R) -> R {
    let before = CHOSEN.with(|c| c.replace(Some(composed)));
    let out = f();
    CHOSEN.with(|c| c.set(before));
    out
}

/// Whether an op on `x` runs as a candle composition: `x` is not on the CPU, or the
/// compositions are chosen for this thread ([`with_composed`]) or forced ([`forced_composed`]).
pub fn composed(x: &Tensor) -> bool {
    !x.device().is_cpu() || CHOSEN.with(|c| c.get()).unwrap_or_else(forced_composed)
}

static HOST_READS: AtomicU64 = AtomicU64::new(0);
static HOST_READ_BYTES: AtomicU64 = AtomicU64::new(0);

/// Counts one read of `x` to the host made by a kernel that has no device form, when `x` is not
/// on the CPU (a CPU tensor's read is no copy).
pub fn count_host_read(x: &Tensor) {
    if !x.device().is_cpu() {
        HOST_READS.fetch_add(1, Ordering::Relaxed);
        HOST_READ_BYTES.fetch_add((x.elem_count() * x.dtype().size_in_bytes()) as u64, Ordering::Relaxed);
    }
}

/// Reads to the host counted so far in this process: (reads, bytes).
pub fn host_reads() -> (u64, u64) {
    (HOST_READS.load(Ordering::Relaxed), HOST_READ_BYTES.load(Ordering::Relaxed))
}

/// The device a run's ranks compute on (`--device`, a strategy's `place.device`): `cpu`, or
/// `cuda` / `cuda:N` (CUDA device N, 0 by default; ranks run as threads sharing it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceSpec {
    /// The host's cores, with the CPU kernels of this layer.
    #[default]
    Cpu,
    /// CUDA device N, through candle's CUDA backend (a build with the `cuda` feature).
    Cuda(usize),
}

/// Why a [`DeviceSpec`] cannot be read or opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// Text that names no device.
    #[error("device `{0}`: expected cpu, cuda or cuda:N")]
    Unknown(String),
    /// A CUDA device asked of a build without the `cuda` feature.
    #[error(
        "device {0}: this graphpp was built without CUDA (build it with `--features cuda` on a machine \
         with CUDA's libraries, or with tools/gpu/build.sh anywhere: docs/ARCHITECTURE.md, \"Devices\")"
    )]
    NotBuilt(DeviceSpec),
    /// [`KERNELS_VAR`] names no choice.
    #[error("{KERNELS_VAR}={0}: expected composed or compiled")]
    KernelsVar(String),
    /// The device could not be opened (no GPU, no driver, an index past the last device).
    #[error("device {spec}: {reason}")]
    Open {
        /// The device asked for.
        spec: DeviceSpec,
        /// The driver's or candle's reason.
        reason: String,
    },
}

impl DeviceSpec {
    /// Whether this is the CPU.
    pub fn is_cpu(&self) -> bool {
        *self == DeviceSpec::Cpu
    }

    /// The candle device (a CUDA device is opened once per call: open it once per run).
    ///
    /// # Errors
    /// [`DeviceError::NotBuilt`] for CUDA in a build without it; [`DeviceError::Open`] when the
    /// driver has no such device.
    pub fn open(self) -> Result<Device, DeviceError> {
        match self {
            DeviceSpec::Cpu => Ok(Device::Cpu),
            DeviceSpec::Cuda(_) if !candle_core::utils::cuda_is_available() => {
                Err(DeviceError::NotBuilt(self))
            }
            DeviceSpec::Cuda(n) => Device::new_cuda(n).map_err(|e| DeviceError::Open {
                spec: self,
                // candle appends a backtrace when RUST_BACKTRACE is set: the first line says why.
                reason: e.to_string().lines().next().unwrap_or_default().to_string(),
            }),
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, DeviceError> {
        let unknown = || DeviceError::Unknown(s.to_string());
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            t => match t.strip_prefix("cuda:") {
                Some(n) => n.parse().map(DeviceSpec::Cuda).map_err(|_| unknown()),
                None => Err(unknown()),
            },
        }
    }
}

impl TryFrom<String> for DeviceSpec {
    type Error = DeviceError;

    fn try_from(s: String) -> Result<Self, DeviceError> {
        s.parse()
    }
}

impl From<DeviceSpec> for String {
    fn from(d: DeviceSpec) -> String {
        d.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_chooses_its_kernels_for_cpu_tensors_and_their_reads_are_not_copies() {
        let x = Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap();
        assert!(with_composed(true, || composed(&x)));
        assert!(!with_composed(false, || composed(&x)));
        // Nested choices restore the outer one.
        assert!(with_composed(true, || with_composed(false, || !composed(&x)) && composed(&x)));
        let before = host_reads();
        count_host_read(&x);
        assert_eq!(host_reads(), before);
    }
}

#[cfg(test)]
mod spec_tests {
    use super::*;

    #[test]
    fn devices_read_and_print_as_the_flag_writes_them() {
        for (text, want) in
            [("cpu", DeviceSpec::Cpu), ("cuda", DeviceSpec::Cuda(0)), ("CUDA:3", DeviceSpec::Cuda(3))]
        {
            let d: DeviceSpec = text.parse().unwrap();
            assert_eq!(d, want);
            assert_eq!(d.to_string().parse::<DeviceSpec>().unwrap(), d);
        }
        for bad in ["tpu", "gpu", "cuda:", "cuda:-1", "cuda:x", ""] {
            assert_eq!(bad.parse::<DeviceSpec>(), Err(DeviceError::Unknown(bad.to_string())), "{bad}");
        }
    }

    #[test]
    fn a_cuda_device_in_a_build_without_cuda_is_refused_by_name() {
        if candle_core::utils::cuda_is_available() {
            eprintln!("skipped: this build has CUDA (tools/gpu/check.sh checks a device)");
            return;
        }
        let e = DeviceSpec::Cuda(1).open().unwrap_err();
        assert_eq!(e, DeviceError::NotBuilt(DeviceSpec::Cuda(1)));
        assert!(
            e.to_string().contains("--features cuda") && e.to_string().contains("tools/gpu/build.sh"),
            "{e}"
        );
        assert!(DeviceSpec::Cpu.open().unwrap().is_cpu());
    }
}
