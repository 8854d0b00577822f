//! A writer for the cpio "newc" format, the one the kernel unpacks as an
//! initramfs. Written here rather than by calling `cpio(1)` so the archive can
//! hold device nodes and root-owned files without privileges, and so the
//! layout is decided by code, not by a staging tree on disk.

use std::collections::HashSet;
use std::io::{self, Write};

const MAGIC: &str = "070701";
const TRAILER: &str = "TRAILER!!!";

const S_IFDIR: u32 = 0o040_000;
const S_IFREG: u32 = 0o100_000;
const S_IFLNK: u32 = 0o120_000;
const S_IFCHR: u32 = 0o020_000;

/// Streams entries into a newc archive. Paths are relative ("bin/sh"); a
/// leading '/' is stripped. Parent directories are emitted automatically
/// because the kernel's unpacker does not create them.
pub struct CpioWriter<W: Write> {
    out: W,
    offset: u64,
    next_ino: u32,
    dirs: HashSet<String>,
}

impl<W: Write> CpioWriter<W> {
    pub fn new(out: W) -> Self {
        CpioWriter {
            out,
            offset: 0,
            // Inode numbers only need to be unique within the archive; start
            // high so they never collide with a concatenated base archive's.
            next_ino: 1000,
            dirs: HashSet::new(),
        }
    }

    /// Adds a directory (and its parents).
    pub fn dir(&mut self, path: &str, mode: u32) -> io::Result<()> {
        let path = normalize(path);
        if path.is_empty() || self.dirs.contains(&path) {
            return Ok(());
        }
        self.parents(&path)?;
        self.dirs.insert(path.clone());
        self.entry(&path, S_IFDIR | (mode & 0o7777), 2, 0, 0, &[])
    }

    /// Adds a regular file with the given contents.
    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        let path = normalize(path);
        self.parents(&path)?;
        self.entry(&path, S_IFREG | (mode & 0o7777), 1, 0, 0, data)
    }

    /// Adds a symbolic link `path -> target`.
    pub fn symlink(&mut self, path: &str, target: &str) -> io::Result<()> {
        let path = normalize(path);
        self.parents(&path)?;
        self.entry(&path, S_IFLNK | 0o777, 1, 0, 0, target.as_bytes())
    }

    /// Adds a character device node (e.g. /dev/console, which must exist
    /// before devtmpfs is mounted or init has no stdout).
    pub fn char_dev(&mut self, path: &str, mode: u32, major: u32, minor: u32) -> io::Result<()> {
        let path = normalize(path);
        self.parents(&path)?;
        self.entry(&path, S_IFCHR | (mode & 0o7777), 1, major, minor, &[])
    }

    /// Writes the trailer and returns the underlying writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.entry(TRAILER, 0, 1, 0, 0, &[])?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn parents(&mut self, path: &str) -> io::Result<()> {
        let mut parents = Vec::new();
        let mut p = path;
        while let Some(idx) = p.rfind('/') {
            p = &p[..idx];
            if p.is_empty() || self.dirs.contains(p) {
                break;
            }
            parents.push(p.to_string());
        }
        for dir in parents.into_iter().rev() {
            self.dirs.insert(dir.clone());
            self.entry(&dir, S_IFDIR | 0o755, 2, 0, 0, &[])?;
        }
        Ok(())
    }

    fn entry(
        &mut self,
        name: &str,
        mode: u32,
        nlink: u32,
        rdev_major: u32,
        rdev_minor: u32,
        data: &[u8],
    ) -> io::Result<()> {
        let ino = self.next_ino;
        self.next_ino = self.next_ino.wrapping_add(1);
        let filesize = u32::try_from(data.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "cpio entry over 4 GiB"))?;
        // namesize counts the terminating NUL.
        let namesize = name.len() + 1;
        let header = format!(
            "{MAGIC}{ino:08x}{mode:08x}{uid:08x}{gid:08x}{nlink:08x}{mtime:08x}{filesize:08x}\
             {devmajor:08x}{devminor:08x}{rdev_major:08x}{rdev_minor:08x}{namesize:08x}{check:08x}",
            uid = 0,
            gid = 0,
            mtime = 0,
            devmajor = 0,
            devminor = 0,
            check = 0,
        );
        debug_assert_eq!(header.len(), 110);
        self.write(header.as_bytes())?;
        self.write(name.as_bytes())?;
        self.write(&[0])?;
        self.pad()?;
        self.write(data)?;
        self.pad()
    }

    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.offset += bytes.len() as u64;
        Ok(())
    }

    /// newc aligns both the header+name and the data to 4 bytes.
    fn pad(&mut self) -> io::Result<()> {
        let rem = (self.offset % 4) as usize;
        if rem != 0 {
            self.write(&[0u8; 4][..4 - rem])?;
        }
        Ok(())
    }
}

fn normalize(path: &str) -> String {
    path.trim_start_matches('/')
        .trim_end_matches('/')
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses a newc archive back into (name, mode, data) triples, so the
    /// writer is checked against the format rather than against itself.
    fn parse(buf: &[u8]) -> Vec<(String, u32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut off = 0usize;
        loop {
            let hdr = std::str::from_utf8(&buf[off..off + 110]).expect("ascii header");
            assert_eq!(&hdr[..6], MAGIC);
            let field =
                |i: usize| u32::from_str_radix(&hdr[6 + i * 8..14 + i * 8], 16).expect("hex");
            let mode = field(1);
            let filesize = field(6) as usize;
            let namesize = field(11) as usize;
            let name_start = off + 110;
            let name = std::str::from_utf8(&buf[name_start..name_start + namesize - 1])
                .expect("utf8 name")
                .to_string();
            assert_eq!(buf[name_start + namesize - 1], 0);
            let data_start = (name_start + namesize + 3) & !3;
            let data = buf[data_start..data_start + filesize].to_vec();
            off = (data_start + filesize + 3) & !3;
            if name == TRAILER {
                assert_eq!(off, buf.len());
                return out;
            }
            out.push((name, mode, data));
        }
    }

    #[test]
    fn round_trips_entries_and_creates_parents() {
        let mut w = CpioWriter::new(Vec::new());
        w.file("/usr/sbin/tool", 0o755, b"hello world")
            .expect("file");
        w.symlink("bin/sh", "busybox").expect("symlink");
        w.char_dev("dev/console", 0o600, 5, 1).expect("dev");
        w.dir("usr", 0o755).expect("dup dir is a no-op");
        let buf = w.finish().expect("finish");
        assert_eq!(buf.len() % 4, 0);
        let entries = parse(&buf);
        let names: Vec<&str> = entries.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "usr",
                "usr/sbin",
                "usr/sbin/tool",
                "bin",
                "bin/sh",
                "dev",
                "dev/console"
            ]
        );
        assert_eq!(entries[2].1, S_IFREG | 0o755);
        assert_eq!(entries[2].2, b"hello world");
        assert_eq!(entries[4].1, S_IFLNK | 0o777);
        assert_eq!(entries[4].2, b"busybox");
        assert_eq!(entries[6].1, S_IFCHR | 0o600);
    }
}
