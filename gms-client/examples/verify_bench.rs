//! Benchmark: `gmsctl verify` on a store of COUNT allocations of SIZE bytes with one
//! metadata entry each (host backend). Reports the median wall time of the `gmsctl verify`
//! process (spawn included) and of the in-process `verify()` call. The median is the
//! nearest-rank p50 of `harness::stats` (the workspace's one percentile definition).
//!
//!     cargo build --release -p gms-client --bins --examples
//!     target/release/examples/verify_bench [--count 1000] [--size 2097152] [--iterations 21] [--fill]
//!
//! Uses `gmsd` and `gmsctl` from the same target directory as this example.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use gms_client::client::{ConnectOptions, GmsClient};
use gms_client::load::{write_one, LoadSpec};
use gms_client::protocol::RequestedLockType;
use gms_client::verify::{verify, VerifyOptions};

fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Nearest-rank median (p50) of `v` (0 for no samples).
fn median(mut v: Vec<f64>) -> f64 {
    harness::stats::percentile_of(&mut v, 50.0).unwrap_or(0.0)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let count: u64 = arg("--count", 1000);
    let size: u64 = arg("--size", 2 << 20);
    let iterations: usize = arg("--iterations", 21);
    let fill = std::env::args().any(|a| a == "--fill");
    let bin_dir: PathBuf = std::env::current_exe()?
        .parent()
        .and_then(|p| p.parent())
        .context("exe dir")?
        .to_path_buf();
    let gmsd = bin_dir.join("gmsd");
    let gmsctl = bin_dir.join("gmsctl");
    if !gmsd.exists() || !gmsctl.exists() {
        bail!("build the binaries first: cargo build --release -p gms-client --bins --examples");
    }
    let dir = tempfile::Builder::new().prefix("gms-bench-").tempdir()?;
    let socket = dir.path().join("gms.sock");
    // The workspace's one gmsd launcher: own process group, killed on drop.
    let _server = harness::gmsd::Gmsd::try_start(
        harness::gmsd::GmsdSpec::new(&socket)
            .bin(&gmsd)
            .log_filter("warn"),
    )?;
    let opts = ConnectOptions {
        connect_timeout: Duration::from_secs(10),
        ..ConnectOptions::default()
    };
    let t0 = Instant::now();
    let mut w = GmsClient::connect(&socket, opts.clone()).await?;
    let hs = w
        .handshake(RequestedLockType::Rw, Some(Duration::from_secs(10)))
        .await?;
    if !hs.success {
        bail!("no rw lock");
    }
    let spec = LoadSpec {
        count,
        size,
        tag: "weights".into(),
        fill,
    };
    for i in 0..count {
        write_one(&mut w, i, &spec).await?;
    }
    if !w.commit().await? {
        bail!("commit failed");
    }
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;

    let vopts = VerifyOptions::default();
    let mut inproc = Vec::new();
    for _ in 0..iterations {
        let v = verify(&socket, &vopts).await;
        if !v.ok {
            bail!("verify failed: {:?}", v.reason);
        }
        assert_eq!(v.allocations, count);
        inproc.push(v.elapsed_ms);
    }
    let mut cli = Vec::new();
    for _ in 0..iterations {
        let t = Instant::now();
        let out = Command::new(&gmsctl)
            .args(["verify", "--socket"])
            .arg(&socket)
            .stderr(Stdio::null())
            .output()?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        if !out.status.success() {
            bail!(
                "gmsctl verify exited {:?}: {}",
                out.status.code(),
                String::from_utf8_lossy(&out.stdout)
            );
        }
        cli.push(ms);
    }
    let report = serde_json::json!({
        "allocations": count,
        "size_bytes": size,
        "filled": fill,
        "iterations": iterations,
        "load_ms": load_ms,
        "gmsctl_verify_median_ms": median(cli.clone()),
        "gmsctl_verify_min_ms": cli.iter().cloned().fold(f64::INFINITY, f64::min),
        "gmsctl_verify_max_ms": cli.iter().cloned().fold(0.0, f64::max),
        "inprocess_verify_median_ms": median(inproc),
        "target_ms": 200,
    });
    println!("{report}");
    Ok(())
}
