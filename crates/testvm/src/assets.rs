//! The guest's kernel and base initramfs, built once and cached.
//!
//! Owns: choosing the Debian kernel package, `apt-get download` of it and of
//! the initiator tools (nvme-cli, open-iscsi, nbd-client, e2fsprogs,
//! busybox-static), unpacking them with `dpkg -x`, resolving the tools'
//! shared libraries with `ldd`, extracting the ELF `vmlinux` from the
//! compressed `vmlinuz` (PVH boot of the ELF skips the real-mode setup and
//! in-guest decompression, which cost seconds under TCG), and writing the
//! base initramfs. Everything lands under the cache dir
//! (`$USTOR_TESTVM_CACHE` or `<target>/testvm-cache`); a finished build is
//! marked by a `ready` file and reused without touching apt.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::cpio::CpioWriter;
use crate::error::{GuestError, Result};
use crate::lock::FileLock;
use crate::modules::{self, ModuleTree};

/// Bump when the layout of the built assets changes, so stale caches are
/// rebuilt instead of booting a guest that lacks something new.
const ASSET_VERSION: u32 = 9;

/// The guest's init (PID 1), a busybox shell script.
const INIT_SCRIPT: &str = include_str!("init.sh");

const MULTIARCH: &str = "x86_64-linux-gnu";

/// Debian packages whose binaries go into the guest.
const TOOL_PACKAGES: &[&str] = &[
    "busybox-static",
    "nvme-cli",
    "open-iscsi",
    "nbd-client",
    "e2fsprogs",
];

/// Binaries copied from the tool packages: (name, required).
const TOOLS: &[(&str, bool)] = &[
    ("nvme", true),
    ("iscsiadm", true),
    ("iscsid", true),
    ("iscsi-iname", false),
    ("nbd-client", true),
    ("mke2fs", true),
    ("e2fsck", true),
    ("tune2fs", false),
    ("dumpe2fs", false),
    ("debugfs", false),
];

/// Names under which e2fsprogs is invoked (`mkfs.ext4`, `fsck -t ext4`).
const TOOL_LINKS: &[(&str, &str)] = &[
    ("usr/sbin/mkfs.ext4", "mke2fs"),
    ("usr/sbin/mkfs.ext3", "mke2fs"),
    ("usr/sbin/mkfs.ext2", "mke2fs"),
    ("usr/sbin/fsck.ext4", "e2fsck"),
    ("usr/sbin/fsck.ext3", "e2fsck"),
    ("usr/sbin/fsck.ext2", "e2fsck"),
];

/// Config files taken from the unpacked packages when present.
const ETC_FILES: &[&str] = &["etc/iscsi/iscsid.conf", "etc/mke2fs.conf"];

/// Modules in the initramfs (with their dependencies). The initiators' own
/// modules are loaded by the guest scripts; the boot set below by init.
const MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_net",
    "virtio_blk",
    "virtio_scsi",
    "sd_mod",
    "sg",
    "scsi_debug",
    "loop",
    "configfs",
    "nbd",
    "nvme_tcp",
    "nvme_fabrics",
    "nvme_core",
    "nvmet",
    "nvmet_tcp",
    "iscsi_tcp",
    "libiscsi",
    "libiscsi_tcp",
    "scsi_transport_iscsi",
    "crc32c_generic",
    "crc32c_intel",
    "libcrc32c",
    "ext4",
    "9p",
    "9pnet_virtio",
    "vfio_pci",
    "vfio_iommu_type1",
    // PCI NVMe (poll queues) and device mapper: the DM polling comparison.
    "nvme",
    "dm_mod",
    // The kernel's NFSv3 client and FUSE: the file service's in-guest
    // comparison (bench/fs-guest.sh).
    "nfsv3",
    "fuse",
];

/// Loaded by init before every test script: the network, SCSI disks (iSCSI
/// LUNs need sd_mod) and crc32c, which ext4 and iSCSI digests request by
/// alias from inside the kernel. Device drivers for optional devices are
/// added per run (see `guest::GuestBuilder`) to keep boots short.
const BOOT_MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_net",
    "sd_mod",
    "crc32c_generic",
    "crc32c_intel",
    "ext4",
];

/// A built kernel + base initramfs.
#[derive(Debug, Clone)]
pub struct Assets {
    /// Uncompressed ELF kernel, booted by PVH.
    pub vmlinux: PathBuf,
    /// Base initramfs (uncompressed newc cpio): init, busybox, tools, libs,
    /// modules. A per-run archive with the test script is appended to it.
    pub initramfs: PathBuf,
    /// `uname -r` of the guest kernel.
    pub kernel_version: String,
}

/// The workspace root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or(manifest)
}

/// Where downloads and built assets live.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("USTOR_TESTVM_CACHE") {
        return PathBuf::from(dir);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    target.join("testvm-cache")
}

/// Returns the cached assets, building them first if needed. Safe to call
/// from several test processes at once: builds are serialized by a lock
/// file and published by an atomic rename.
pub fn ensure() -> Result<Assets> {
    let cache = cache_dir();
    let dir = cache.join(format!("assets-v{ASSET_VERSION}"));
    if let Some(assets) = load(&dir)? {
        return Ok(assets);
    }
    fs::create_dir_all(&cache)
        .map_err(|e| GuestError::io(format!("create cache dir {}", cache.display()), e))?;
    let _lock = FileLock::exclusive(&cache.join("build.lock"))?;
    if let Some(assets) = load(&dir)? {
        return Ok(assets);
    }
    build(&cache, &dir)?;
    load(&dir)?.ok_or_else(|| GuestError::Asset(format!("{} not ready after build", dir.display())))
}

fn load(dir: &Path) -> Result<Option<Assets>> {
    let ready = dir.join("ready");
    match fs::read_to_string(&ready) {
        Ok(version) => Ok(Some(Assets {
            vmlinux: dir.join("vmlinux"),
            initramfs: dir.join("base.cpio"),
            kernel_version: version.trim().to_string(),
        })),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(GuestError::io(format!("read {}", ready.display()), e)),
    }
}

fn build(cache: &Path, dir: &Path) -> Result<()> {
    if !cfg!(target_arch = "x86_64") {
        return Err(GuestError::Asset(
            "the guest copies host x86_64 libraries; other host arches are unsupported".into(),
        ));
    }
    for tool in ["apt-get", "apt-cache", "dpkg", "dpkg-query", "ldd"] {
        which(tool).ok_or_else(|| GuestError::MissingTool(format!("{tool} not in PATH")))?;
    }
    let debs = cache.join("debs");
    let stage = cache.join(format!("stage-v{ASSET_VERSION}"));
    let tmp = cache.join(format!(
        "assets-v{ASSET_VERSION}.tmp-{}",
        std::process::id()
    ));
    for d in [&stage, &tmp] {
        remove_dir_if_exists(d)?;
    }
    for d in [&debs, &stage, &tmp] {
        fs::create_dir_all(d).map_err(|e| GuestError::io(format!("create {}", d.display()), e))?;
    }

    let kernel_pkg = kernel_package()?;
    let mut packages: BTreeSet<String> = TOOL_PACKAGES.iter().map(|s| s.to_string()).collect();
    packages.insert(kernel_pkg.clone());
    let mut extracted = BTreeSet::new();

    // Fetch packages until every tool's libraries resolve: first the tools,
    // then the library packages they depend on that the host lacks.
    let (tools, libs) = loop {
        let todo: Vec<String> = packages.difference(&extracted).cloned().collect();
        download(&debs, &todo)?;
        for pkg in &todo {
            extract(&debs, pkg, &stage)?;
            extracted.insert(pkg.clone());
        }
        let tools = find_tools(&stage)?;
        let (libs, missing) = resolve_libs(&stage, &tools)?;
        if missing.is_empty() {
            break (tools, libs);
        }
        let more = library_packages_missing_on_host(&packages)?;
        let new: Vec<String> = more.difference(&packages).cloned().collect();
        if new.is_empty() {
            return Err(GuestError::Asset(format!(
                "unresolved shared libraries {missing:?} after fetching {packages:?}"
            )));
        }
        packages.extend(new);
    };

    let vmlinuz = find_vmlinuz(&stage)?;
    extract_vmlinux(&vmlinuz, &tmp.join("vmlinux"))?;
    let (kver, moddir) = module_dir(&stage)?;
    let tree = ModuleTree::open(&moddir)?;
    let mods = tree.closure(MODULES)?;

    let cpio_path = tmp.join("base.cpio");
    let file = File::create(&cpio_path)
        .map_err(|e| GuestError::io(format!("create {}", cpio_path.display()), e))?;
    let mut w = CpioWriter::new(BufWriter::new(file));
    write_base(&mut w, &stage, &tools, &libs, &kver, &tree, &mods)
        .map_err(|e| GuestError::io(format!("write {}", cpio_path.display()), e))?;
    w.finish()
        .map_err(|e| GuestError::io(format!("finish {}", cpio_path.display()), e))?;
    fs::write(
        tmp.join("packages"),
        packages.iter().cloned().collect::<Vec<_>>().join("\n"),
    )
    .map_err(|e| GuestError::io("write package list", e))?;
    fs::write(tmp.join("ready"), format!("{kver}\n"))
        .map_err(|e| GuestError::io("write ready marker", e))?;
    remove_dir_if_exists(dir)?;
    fs::rename(&tmp, dir).map_err(|e| GuestError::io(format!("publish {}", dir.display()), e))?;
    // The stage holds ~500 MB of unpacked modules; the debs stay for rebuilds.
    remove_dir_if_exists(&stage)
}

fn remove_dir_if_exists(dir: &Path) -> Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(GuestError::io(format!("remove {}", dir.display()), e)),
    }
}

/// Finds an executable in PATH.
pub(crate) fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Runs a command to completion and returns its stdout, or a
/// [`GuestError::Command`] naming the command and carrying its stderr.
pub(crate) fn run_cmd(cmd: &mut Command) -> Result<String> {
    let desc = describe(cmd);
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| GuestError::io(format!("spawn `{desc}`"), e))?;
    if !out.status.success() {
        return Err(GuestError::Command {
            cmd: desc,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub(crate) fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// The kernel package: `$USTOR_TESTVM_KERNEL_PKG`, else what the
/// `linux-image-amd64` metapackage depends on (6.1 on Debian 12).
fn kernel_package() -> Result<String> {
    if let Ok(pkg) = std::env::var("USTOR_TESTVM_KERNEL_PKG") {
        return Ok(pkg);
    }
    let out = run_cmd(Command::new("apt-cache").args(["depends", "linux-image-amd64"]))?;
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends:"))
        .map(str::trim)
        .find(|p| p.starts_with("linux-image-") && p.ends_with("-amd64"))
        .map(str::to_string)
        .ok_or_else(|| {
            GuestError::Asset(format!(
                "linux-image-amd64 names no linux-image-*-amd64 dependency: {out}"
            ))
        })
}

fn deb_of(debs: &Path, pkg: &str) -> Result<Option<PathBuf>> {
    let prefix = format!("{pkg}_");
    let rd =
        fs::read_dir(debs).map_err(|e| GuestError::io(format!("list {}", debs.display()), e))?;
    for entry in rd {
        let entry = entry.map_err(|e| GuestError::io("list debs", e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(&prefix) && name.ends_with(".deb") {
            return Ok(Some(entry.path()));
        }
    }
    Ok(None)
}

fn download(debs: &Path, pkgs: &[String]) -> Result<()> {
    let mut missing = Vec::new();
    for p in pkgs {
        if deb_of(debs, p)?.is_none() {
            missing.push(p.clone());
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    run_cmd(
        Command::new("apt-get")
            .arg("download")
            .args(&missing)
            .current_dir(debs),
    )?;
    Ok(())
}

fn extract(debs: &Path, pkg: &str, stage: &Path) -> Result<()> {
    let deb = deb_of(debs, pkg)?
        .ok_or_else(|| GuestError::Asset(format!("apt-get download left no .deb for {pkg}")))?;
    run_cmd(Command::new("dpkg").arg("-x").arg(&deb).arg(stage))?;
    Ok(())
}

/// Locates each tool binary in the stage: name -> path.
fn find_tools(stage: &Path) -> Result<BTreeMap<String, PathBuf>> {
    let mut found = BTreeMap::new();
    for (name, required) in TOOLS {
        let hit = ["usr/sbin", "sbin", "usr/bin", "bin"]
            .iter()
            .map(|d| stage.join(d).join(name))
            .find(|p| p.is_file());
        match hit {
            Some(p) => {
                found.insert(name.to_string(), p);
            }
            None if *required => {
                return Err(GuestError::Asset(format!(
                    "{name} not found in the unpacked packages"
                )))
            }
            None => {}
        }
    }
    Ok(found)
}

/// Runs `ldd` on each tool with the stage's library dirs first in the search
/// path. Returns soname -> file to copy, and sonames nothing provides.
fn resolve_libs(
    stage: &Path,
    tools: &BTreeMap<String, PathBuf>,
) -> Result<(BTreeMap<String, PathBuf>, BTreeSet<String>)> {
    let lib_path = [
        stage.join("lib").join(MULTIARCH),
        stage.join("usr/lib").join(MULTIARCH),
    ]
    .iter()
    .map(|p| p.to_string_lossy().into_owned())
    .collect::<Vec<_>>()
    .join(":");
    let mut libs = BTreeMap::new();
    let mut missing = BTreeSet::new();
    for path in tools.values() {
        let out = run_cmd(
            Command::new("ldd")
                .arg(path)
                .env("LD_LIBRARY_PATH", &lib_path),
        )?;
        for line in out.lines() {
            let line = line.trim();
            if let Some((soname, rest)) = line.split_once(" => ") {
                let target = rest.split(" (").next().unwrap_or("").trim();
                if target == "not found" || target.is_empty() {
                    missing.insert(soname.to_string());
                } else {
                    libs.insert(soname.to_string(), PathBuf::from(target));
                }
            } else if line.starts_with('/') {
                // The program interpreter, e.g. /lib64/ld-linux-x86-64.so.2.
                let interp = line.split(" (").next().unwrap_or(line).trim();
                libs.insert(interp.to_string(), PathBuf::from(interp));
            }
        }
    }
    // glibc dlopens libgcc_s for thread cancellation (iscsid uses threads);
    // ldd cannot see that.
    let gcc_s = Path::new("/lib").join(MULTIARCH).join("libgcc_s.so.1");
    if gcc_s.is_file() {
        libs.entry("libgcc_s.so.1".into()).or_insert(gcc_s);
    }
    Ok((libs, missing))
}

/// Library packages (`lib*`, `zlib1g`) that the given packages depend on
/// directly and that are not installed on the host.
fn library_packages_missing_on_host(pkgs: &BTreeSet<String>) -> Result<BTreeSet<String>> {
    let out = run_cmd(Command::new("apt-cache").arg("depends").args(pkgs))?;
    let mut wanted = BTreeSet::new();
    for line in out.lines() {
        let line = line.trim().trim_start_matches('|');
        let Some((kind, name)) = line.split_once(':') else {
            continue;
        };
        let name = name.trim();
        if !(kind == "Depends" || kind == "PreDepends")
            || name.starts_with('<')
            || !(name.starts_with("lib") || name == "zlib1g")
            || name == "libc6"
        {
            continue;
        }
        wanted.insert(name.to_string());
    }
    let mut missing = BTreeSet::new();
    for name in wanted {
        let installed = Command::new("dpkg-query")
            .args(["-W", "-f=${db:Status-Status}", &name])
            .stderr(Stdio::null())
            .output()
            .map(|o| o.status.success() && o.stdout == b"installed")
            .unwrap_or(false);
        if !installed {
            missing.insert(name);
        }
    }
    Ok(missing)
}

fn find_vmlinuz(stage: &Path) -> Result<PathBuf> {
    let boot = stage.join("boot");
    let rd =
        fs::read_dir(&boot).map_err(|e| GuestError::io(format!("list {}", boot.display()), e))?;
    for entry in rd {
        let entry = entry.map_err(|e| GuestError::io("list boot", e))?;
        if entry.file_name().to_string_lossy().starts_with("vmlinuz-") {
            return Ok(entry.path());
        }
    }
    Err(GuestError::Asset(format!(
        "no vmlinuz-* in {}",
        boot.display()
    )))
}

fn module_dir(stage: &Path) -> Result<(String, PathBuf)> {
    for base in ["lib/modules", "usr/lib/modules"] {
        let dir = stage.join(base);
        let Ok(rd) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in rd {
            let entry = entry.map_err(|e| GuestError::io("list modules", e))?;
            if entry.path().join("kernel").is_dir() {
                return Ok((
                    entry.file_name().to_string_lossy().into_owned(),
                    entry.path(),
                ));
            }
        }
    }
    Err(GuestError::Asset(
        "no lib/modules/<version>/kernel in the kernel package".into(),
    ))
}

/// Compression formats a bzImage payload may use, as the kernel's
/// scripts/extract-vmlinux tries them: (magic, decompressor argv).
const KERNEL_CODECS: &[(&[u8], &[&str])] = &[
    (b"\xfd7zXZ\x00", &["xz", "-dc", "--single-stream"]),
    (b"\x28\xb5\x2f\xfd", &["zstd", "-dc"]),
    (b"\x1f\x8b\x08", &["gzip", "-dc"]),
    (b"\x02\x21\x4c\x18", &["lz4", "-dc"]),
];

/// Extracts the ELF vmlinux from a bzImage: finds each compression magic,
/// feeds the bytes from there to the decompressor, and keeps the first
/// output that is an ELF file (trailing data after the stream makes some
/// decompressors exit non-zero, so the output is judged, not the status).
pub(crate) fn extract_vmlinux(vmlinuz: &Path, out: &Path) -> Result<()> {
    let image =
        fs::read(vmlinuz).map_err(|e| GuestError::io(format!("read {}", vmlinuz.display()), e))?;
    let mut tried = Vec::new();
    for (magic, argv) in KERNEL_CODECS {
        if which(argv[0]).is_none() {
            tried.push(format!("{} (not installed)", argv[0]));
            continue;
        }
        let mut start = 0;
        // A few candidates per codec: the magic can occur by chance earlier.
        for _ in 0..8 {
            let Some(pos) = find(&image[start..], magic).map(|p| p + start) else {
                break;
            };
            start = pos + 1;
            if decompress_to(argv, &image[pos..], out)? {
                return Ok(());
            }
            tried.push(format!("{} at offset {pos}", argv[0]));
        }
    }
    Err(GuestError::Asset(format!(
        "no ELF kernel found in {} (tried: {})",
        vmlinuz.display(),
        tried.join(", ")
    )))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn decompress_to(argv: &[&str], input: &[u8], out: &Path) -> Result<bool> {
    let file =
        File::create(out).map_err(|e| GuestError::io(format!("create {}", out.display()), e))?;
    let mut child = Command::new(argv[0])
        .args(&argv[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::from(file))
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| GuestError::io(format!("spawn {}", argv.join(" ")), e))?;
    if let Some(mut stdin) = child.stdin.take() {
        // A decompressor that stops reading at the end of its stream closes
        // the pipe early; that is expected, so the write error is ignored.
        let _ = stdin.write_all(input);
    }
    child
        .wait()
        .map_err(|e| GuestError::io(format!("wait {}", argv.join(" ")), e))?;
    let head = fs::read(out)
        .map(|d| d.len() > 1 << 20 && d.starts_with(b"\x7fELF"))
        .map_err(|e| GuestError::io(format!("read {}", out.display()), e))?;
    Ok(head)
}

fn read(path: &Path) -> std::io::Result<Vec<u8>> {
    fs::read(path).map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

/// Lays out the base initramfs.
fn write_base<W: Write>(
    w: &mut CpioWriter<W>,
    stage: &Path,
    tools: &BTreeMap<String, PathBuf>,
    libs: &BTreeMap<String, PathBuf>,
    kver: &str,
    tree: &ModuleTree,
    mods: &[modules::Module],
) -> std::io::Result<()> {
    for d in [
        "proc",
        "sys",
        "dev",
        "tmp",
        "run",
        "mnt",
        "root",
        "etc",
        "var/lib/iscsi",
        "var/lock",
        "ustor",
    ] {
        w.dir(d, 0o755)?;
    }
    w.char_dev("dev/console", 0o600, 5, 1)?;
    w.char_dev("dev/null", 0o666, 1, 3)?;
    w.file("init", 0o755, INIT_SCRIPT.as_bytes())?;

    // busybox provides the shell and coreutils; an applet is linked only
    // where no real tool of the same name is installed.
    let busybox = stage.join("bin/busybox");
    w.file("bin/busybox", 0o755, &read(&busybox)?)?;
    let list = Command::new(&busybox).arg("--list-full").output()?;
    if !list.status.success() {
        return Err(std::io::Error::other(format!(
            "{} --list-full failed: {}",
            busybox.display(),
            String::from_utf8_lossy(&list.stderr)
        )));
    }
    let shadowed: BTreeSet<&str> = tools
        .keys()
        .map(String::as_str)
        .chain(
            TOOL_LINKS
                .iter()
                .map(|(p, _)| p.rsplit('/').next().unwrap_or(p)),
        )
        .collect();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let applet = applet.trim();
        let name = applet.rsplit('/').next().unwrap_or(applet);
        if applet.is_empty() || applet == "bin/busybox" || shadowed.contains(name) {
            continue;
        }
        w.symlink(applet, "/bin/busybox")?;
    }

    for (name, path) in tools {
        w.file(&format!("usr/sbin/{name}"), 0o755, &read(path)?)?;
    }
    for (link, target) in TOOL_LINKS {
        w.symlink(link, target)?;
    }
    for (soname, path) in libs {
        let data = read(path)?;
        if soname.starts_with('/') {
            // The interpreter must sit at the path compiled into binaries.
            w.file(soname, 0o755, &data)?;
        } else {
            w.file(&format!("lib/{MULTIARCH}/{soname}"), 0o755, &data)?;
        }
    }

    for etc in ETC_FILES {
        let p = stage.join(etc);
        if p.is_file() {
            w.file(etc, 0o644, &read(&p)?)?;
        }
    }
    w.file("etc/passwd", 0o644, b"root:x:0:0:root:/root:/bin/sh\n")?;
    w.file("etc/group", 0o644, b"root:x:0:\n")?;
    w.file("etc/hostname", 0o644, b"ustor-guest\n")?;
    w.file(
        "etc/hosts",
        0o644,
        b"127.0.0.1 localhost ustor-guest\n10.0.2.2 host\n",
    )?;
    w.file(
        "etc/iscsi/initiatorname.iscsi",
        0o644,
        b"InitiatorName=iqn.2024-01.io.ustor:guest\n",
    )?;
    w.file(
        "etc/nvme/hostnqn",
        0o644,
        b"nqn.2014-08.org.nvmexpress:uuid:7c1e5e3a-0b55-4e4b-9d33-0a7c1e5e3a00\n",
    )?;
    w.file(
        "etc/nvme/hostid",
        0o644,
        b"7c1e5e3a-0b55-4e4b-9d33-0a7c1e5e3a00\n",
    )?;

    let mroot = format!("lib/modules/{kver}");
    for m in mods {
        let ko = read(&tree.path_of(&m.relpath))?;
        w.file(
            &format!("{mroot}/{}", m.relpath),
            0o644,
            modules::strip_signature(&ko),
        )?;
    }
    w.file(
        &format!("{mroot}/modules.dep"),
        0o644,
        modules::modules_dep(mods).as_bytes(),
    )?;
    w.file(
        "etc/modprobe.d/ustor-aliases.conf",
        0o644,
        modules::alias_conf(mods).as_bytes(),
    )?;
    // Only boot modules that exist as files; built-ins need no loading.
    let present: BTreeSet<&str> = mods.iter().map(|m| m.name.as_str()).collect();
    let boot: Vec<&str> = BOOT_MODULES
        .iter()
        .copied()
        .filter(|m| present.contains(modules::normalize(m).as_str()))
        .collect();
    w.file(
        "etc/ustor-boot-modules",
        0o644,
        format!("{}\n", boot.join(" ")).as_bytes(),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extracts_gzip_payload_after_garbage() {
        if which("gzip").is_none() {
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        // A fake "kernel": ELF magic plus 2 MiB of data, gzip-compressed and
        // wrapped in a setup header and trailing bytes, like a bzImage.
        let mut elf = b"\x7fELF".to_vec();
        elf.extend((0..(2u32 << 20)).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8));
        let raw = dir.path().join("raw");
        fs::write(&raw, &elf).expect("write raw");
        let gz = Command::new("gzip")
            .arg("-c")
            .arg(&raw)
            .output()
            .expect("run gzip");
        assert!(gz.status.success());
        let mut image = vec![0x55u8; 4096];
        image.extend_from_slice(&gz.stdout);
        image.extend_from_slice(&[0xaa; 512]);
        let vmlinuz = dir.path().join("vmlinuz");
        fs::write(&vmlinuz, &image).expect("write image");
        let out = dir.path().join("vmlinux");
        extract_vmlinux(&vmlinuz, &out).expect("extract");
        assert_eq!(fs::read(&out).expect("read out"), elf);
    }
}
