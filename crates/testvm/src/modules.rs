//! Kernel-module selection for the initramfs: finds modules by name in an
//! extracted `/lib/modules/<version>` tree, follows their dependencies and
//! writes the `modules.dep` and alias file that busybox `modprobe` reads in
//! the guest.
//!
//! Debian's kernel package ships no `modules.dep` (depmod runs at install
//! time) and the host may have no kmod, so dependencies are read straight
//! from each module's ELF `.modinfo` section (`depends=`, `alias=`).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{GuestError, Result};

/// One module selected for the guest.
#[derive(Debug, Clone)]
pub struct Module {
    /// Normalized name (dashes folded to underscores), e.g. `nvme_tcp`.
    pub name: String,
    /// Path relative to the version directory, e.g. `kernel/drivers/...ko`.
    pub relpath: String,
    /// Normalized names of the modules this one needs loaded first.
    pub depends: Vec<String>,
    /// Aliases that the kernel may request (`crypto-crc32c`, `fs-ext4`).
    pub aliases: Vec<String>,
}

/// An extracted module tree for one kernel version.
pub struct ModuleTree {
    root: PathBuf,
    by_name: HashMap<String, String>,
    builtin: HashSet<String>,
}

/// Folds the two spellings module names come in (`nvme-tcp`, `nvme_tcp`).
pub fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

fn module_name_of(relpath: &str) -> Option<String> {
    let file = relpath.rsplit('/').next()?;
    file.strip_suffix(".ko").map(normalize)
}

impl ModuleTree {
    /// Indexes `<root>` = `.../lib/modules/<version>`.
    pub fn open(root: &Path) -> Result<Self> {
        let mut by_name = HashMap::new();
        let kernel_dir = root.join("kernel");
        let mut stack = vec![kernel_dir.clone()];
        while let Some(dir) = stack.pop() {
            let rd = fs::read_dir(&dir)
                .map_err(|e| GuestError::io(format!("read module dir {}", dir.display()), e))?;
            for entry in rd {
                let entry = entry.map_err(|e| GuestError::io("read module dir entry", e))?;
                let path = entry.path();
                let ft = entry
                    .file_type()
                    .map_err(|e| GuestError::io(format!("stat {}", path.display()), e))?;
                if ft.is_dir() {
                    stack.push(path);
                    continue;
                }
                let Ok(rel) = path.strip_prefix(root) else {
                    continue;
                };
                let rel = rel.to_string_lossy().to_string();
                if rel.ends_with(".ko.xz") || rel.ends_with(".ko.zst") || rel.ends_with(".ko.gz") {
                    // Busybox modprobe cannot load these; say so instead of
                    // booting a guest that lacks its drivers.
                    return Err(GuestError::Asset(format!(
                        "compressed kernel modules ({rel}) are not supported; pick a kernel with \
                         CONFIG_MODULE_COMPRESS_NONE"
                    )));
                }
                if let Some(name) = module_name_of(&rel) {
                    by_name.insert(name, rel);
                }
            }
        }
        let builtin = match fs::read_to_string(root.join("modules.builtin")) {
            Ok(text) => text.lines().filter_map(module_name_of).collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => HashSet::new(),
            Err(e) => return Err(GuestError::io("read modules.builtin", e)),
        };
        if by_name.is_empty() {
            return Err(GuestError::Asset(format!(
                "no kernel modules under {}",
                kernel_dir.display()
            )));
        }
        Ok(ModuleTree {
            root: root.to_path_buf(),
            by_name,
            builtin,
        })
    }

    /// Absolute path of a module file from its relpath.
    pub fn path_of(&self, relpath: &str) -> PathBuf {
        self.root.join(relpath)
    }

    /// The wanted modules and everything they depend on, dependencies first.
    /// Built-in modules are skipped; a name that is neither a module file nor
    /// built in is an error, so a typo or a config change shows up at build.
    pub fn closure(&self, wanted: &[&str]) -> Result<Vec<Module>> {
        let mut done: HashMap<String, Module> = HashMap::new();
        let mut order = Vec::new();
        for name in wanted {
            self.visit(&normalize(name), &mut done, &mut order, &mut Vec::new())?;
        }
        Ok(order
            .into_iter()
            .filter_map(|n: String| done.remove(&n))
            .collect())
    }

    fn visit(
        &self,
        name: &str,
        done: &mut HashMap<String, Module>,
        order: &mut Vec<String>,
        path: &mut Vec<String>,
    ) -> Result<()> {
        if done.contains_key(name) {
            return Ok(());
        }
        if path.iter().any(|p| p == name) {
            return Err(GuestError::Asset(format!(
                "module dependency cycle: {} -> {name}",
                path.join(" -> ")
            )));
        }
        let Some(relpath) = self.by_name.get(name) else {
            if self.builtin.contains(name) {
                return Ok(());
            }
            return Err(GuestError::Asset(format!(
                "kernel module {name} is neither a module file nor built in"
            )));
        };
        let file = self.path_of(relpath);
        let bytes = fs::read(&file)
            .map_err(|e| GuestError::io(format!("read module {}", file.display()), e))?;
        let info = read_modinfo(&bytes).ok_or_else(|| {
            GuestError::Asset(format!("no .modinfo section in {}", file.display()))
        })?;
        path.push(name.to_string());
        for dep in &info.depends {
            self.visit(dep, done, order, path)?;
        }
        path.pop();
        order.push(name.to_string());
        done.insert(
            name.to_string(),
            Module {
                name: name.to_string(),
                relpath: relpath.clone(),
                depends: info.depends,
                aliases: info.aliases,
            },
        );
        Ok(())
    }
}

/// `modules.dep` text for a module set, in the format kmod writes:
/// `path: dep-path dep-path`, listing *all* transitive dependencies with
/// each module before the modules it needs. Busybox modprobe does not follow
/// the chain itself: it loads the listed paths from last to first, then the
/// module, so the full, ordered list is required.
pub fn modules_dep(modules: &[Module]) -> String {
    // `modules` is in load order (dependencies first), so a module's index
    // is larger than any of its dependencies'.
    let index: HashMap<&str, usize> = modules
        .iter()
        .enumerate()
        .map(|(i, m)| (m.name.as_str(), i))
        .collect();
    let mut out = String::new();
    for m in modules {
        let mut all = BTreeSet::new();
        let mut stack: Vec<&str> = m.depends.iter().map(String::as_str).collect();
        while let Some(dep) = stack.pop() {
            if let Some(&i) = index.get(dep) {
                if all.insert(i) {
                    stack.extend(modules[i].depends.iter().map(String::as_str));
                }
            }
        }
        out.push_str(&m.relpath);
        out.push(':');
        for i in all.into_iter().rev() {
            out.push(' ');
            out.push_str(&modules[i].relpath);
        }
        out.push('\n');
    }
    out
}

/// A modprobe.d file mapping the aliases the kernel requests by name
/// (`crypto-crc32c`, `fs-9p`) to the modules that provide them. Device-ID
/// aliases (with wildcards or bus prefixes) are left out: the init script
/// loads drivers explicitly.
pub fn alias_conf(modules: &[Module]) -> String {
    let mut out = String::new();
    for m in modules {
        for alias in &m.aliases {
            if alias.contains(['*', '?', '[', ':']) || alias == &m.name {
                continue;
            }
            out.push_str(&format!("alias {alias} {}\n", m.name));
        }
    }
    out
}

const SIG_MAGIC: &[u8] = b"~Module signature appended~\n";

/// The module without its appended signature. Debian signs its modules;
/// the guest does not enforce signatures, and checking each one (hash the
/// whole module, verify RSA) is measurable under TCG, so the initramfs
/// carries them unsigned. Unsigned or malformed input is returned as is.
pub fn strip_signature(ko: &[u8]) -> &[u8] {
    // struct module_signature: algo, hash, id_type, signer_len, key_id_len,
    // 3 bytes pad, big-endian u32 sig_len.
    const INFO_LEN: usize = 12;
    let Some(body) = ko.strip_suffix(SIG_MAGIC) else {
        return ko;
    };
    let Some(info_at) = body.len().checked_sub(INFO_LEN) else {
        return ko;
    };
    let info = &body[info_at..];
    let signer_len = usize::from(info[3]);
    let key_id_len = usize::from(info[4]);
    let sig_len = u32::from_be_bytes([info[8], info[9], info[10], info[11]]) as usize;
    match info_at.checked_sub(sig_len + signer_len + key_id_len) {
        Some(end) => &ko[..end],
        None => ko,
    }
}

#[derive(Debug, Default, PartialEq)]
struct ModInfo {
    depends: Vec<String>,
    aliases: Vec<String>,
}

/// Reads `.modinfo` from an ELF64 little-endian relocatable object. Every
/// offset is bounds-checked: a truncated file gives `None`, never a panic.
fn read_modinfo(elf: &[u8]) -> Option<ModInfo> {
    if elf.get(..4)? != b"\x7fELF" || *elf.get(4)? != 2 || *elf.get(5)? != 1 {
        return None;
    }
    let u16_at =
        |o: usize| -> Option<u16> { Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?)) };
    let u32_at =
        |o: usize| -> Option<u32> { Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?)) };
    let u64_at =
        |o: usize| -> Option<u64> { Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?)) };
    let shoff = usize::try_from(u64_at(0x28)?).ok()?;
    let shentsize = usize::from(u16_at(0x3a)?);
    let shnum = usize::from(u16_at(0x3c)?);
    let shstrndx = usize::from(u16_at(0x3e)?);
    if shentsize < 0x40 {
        return None;
    }
    let section = |i: usize| -> Option<(u32, usize, usize)> {
        let base = shoff.checked_add(i.checked_mul(shentsize)?)?;
        let name = u32_at(base)?;
        let off = usize::try_from(u64_at(base + 0x18)?).ok()?;
        let size = usize::try_from(u64_at(base + 0x20)?).ok()?;
        Some((name, off, size))
    };
    let (_, stroff, strsize) = section(shstrndx)?;
    let strtab = elf.get(stroff..stroff.checked_add(strsize)?)?;
    for i in 0..shnum {
        let (name_off, off, size) = section(i)?;
        let name = strtab.get(name_off as usize..)?;
        let name = &name[..name.iter().position(|&b| b == 0)?];
        if name != b".modinfo" {
            continue;
        }
        let data = elf.get(off..off.checked_add(size)?)?;
        let mut info = ModInfo::default();
        for field in data.split(|&b| b == 0) {
            let field = String::from_utf8_lossy(field);
            if let Some(deps) = field.strip_prefix("depends=") {
                info.depends
                    .extend(deps.split(',').filter(|d| !d.is_empty()).map(normalize));
            } else if let Some(alias) = field.strip_prefix("alias=") {
                info.aliases.push(alias.to_string());
            }
        }
        return Some(info);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a minimal ELF64 with a section-name table and a .modinfo
    /// section, laid out the way the kernel's modpost emits them.
    fn elf_with_modinfo(modinfo: &[u8]) -> Vec<u8> {
        let shstr = b"\0.shstrtab\0.modinfo\0";
        let mut elf = vec![0u8; 0x40];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[5] = 1;
        let shstr_off = elf.len();
        elf.extend_from_slice(shstr);
        let modinfo_off = elf.len();
        elf.extend_from_slice(modinfo);
        while elf.len() % 8 != 0 {
            elf.push(0);
        }
        let shoff = elf.len();
        let mut sh = |name: u32, off: usize, size: usize| {
            let mut s = vec![0u8; 0x40];
            s[..4].copy_from_slice(&name.to_le_bytes());
            s[0x18..0x20].copy_from_slice(&(off as u64).to_le_bytes());
            s[0x20..0x28].copy_from_slice(&(size as u64).to_le_bytes());
            elf.extend_from_slice(&s);
        };
        sh(0, 0, 0);
        sh(1, shstr_off, shstr.len());
        sh(11, modinfo_off, modinfo.len());
        elf[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&0x40u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        elf[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        elf
    }

    #[test]
    fn reads_depends_and_aliases() {
        let elf = elf_with_modinfo(
            b"license=GPL\0alias=crypto-crc32c\0depends=nvme-fabrics,nvme-core\0alias=fs-ext4\0",
        );
        let info = read_modinfo(&elf).expect("modinfo");
        assert_eq!(info.depends, ["nvme_fabrics", "nvme_core"]);
        assert_eq!(info.aliases, ["crypto-crc32c", "fs-ext4"]);
    }

    #[test]
    fn strips_appended_signature() {
        let module = b"\x7fELF module body".to_vec();
        let mut signed = module.clone();
        signed.extend_from_slice(&[0xab; 5]); // the PKCS#7 blob
        signed.extend_from_slice(&[0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 5]);
        signed.extend_from_slice(SIG_MAGIC);
        assert_eq!(strip_signature(&signed), &module[..]);
        assert_eq!(strip_signature(&module), &module[..]);
        // A length larger than the file leaves it alone instead of panicking.
        let mut bogus = vec![0, 0, 2, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff];
        bogus.extend_from_slice(SIG_MAGIC);
        assert_eq!(strip_signature(&bogus), &bogus[..]);
    }

    #[test]
    fn truncated_input_is_none_not_panic() {
        let elf = elf_with_modinfo(b"depends=a\0");
        for len in 0..elf.len() {
            let _ = read_modinfo(&elf[..len]);
        }
        assert!(read_modinfo(b"not an elf").is_none());
    }

    #[test]
    fn dep_and_alias_files() {
        let mods = vec![
            Module {
                name: "crc32c_generic".into(),
                relpath: "kernel/crypto/crc32c_generic.ko".into(),
                depends: vec![],
                aliases: vec!["crypto-crc32c".into(), "crc32c".into()],
            },
            Module {
                name: "libcrc32c".into(),
                relpath: "kernel/lib/libcrc32c.ko".into(),
                depends: vec!["crc32c_generic".into()],
                aliases: vec!["pci:v*".into()],
            },
        ];
        assert_eq!(
            modules_dep(&mods),
            "kernel/crypto/crc32c_generic.ko:\nkernel/lib/libcrc32c.ko: kernel/crypto/crc32c_generic.ko\n"
        );
        // Transitive: c needs b needs a; c's line lists b before a, because
        // busybox modprobe loads the list from the end.
        let chain: Vec<Module> = ["a", "b", "c"]
            .iter()
            .enumerate()
            .map(|(i, n)| Module {
                name: n.to_string(),
                relpath: format!("{n}.ko"),
                depends: if i == 0 {
                    vec![]
                } else {
                    vec![["a", "b"][i - 1].to_string()]
                },
                aliases: vec![],
            })
            .collect();
        assert_eq!(modules_dep(&chain), "a.ko:\nb.ko: a.ko\nc.ko: b.ko a.ko\n");
        assert_eq!(
            alias_conf(&mods),
            "alias crypto-crc32c crc32c_generic\nalias crc32c crc32c_generic\n"
        );
    }
}
