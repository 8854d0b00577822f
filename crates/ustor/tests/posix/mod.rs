//! A table of POSIX calls, run in order in a directory; each row's outcome
//! (a value, or the errno name) is recorded, so running it on a mount and
//! on a reference file system (tmpfs) and comparing the lists shows every
//! call that behaves differently. Rows record only what POSIX fixes (no
//! inode numbers, block counts or directory sizes, which differ by design).
#![allow(dead_code)]

use std::ffi::CString;
use std::fs::{self, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{symlink, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

type Out = Result<String, i32>;
type Row<'a> = (&'static str, Box<dyn Fn() -> Out + 'a>);

fn row<'a>(name: &'static str, f: impl Fn() -> Out + 'a) -> Row<'a> {
    (name, Box::new(f))
}

fn errno_name(e: i32) -> String {
    let n = match e {
        libc::ENOENT => "ENOENT",
        libc::EEXIST => "EEXIST",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::EISDIR => "EISDIR",
        libc::ENOTDIR => "ENOTDIR",
        libc::EINVAL => "EINVAL",
        libc::EBADF => "EBADF",
        libc::EPERM => "EPERM",
        libc::EACCES => "EACCES",
        libc::ENAMETOOLONG => "ENAMETOOLONG",
        libc::EXDEV => "EXDEV",
        libc::EIO => "EIO",
        libc::ELOOP => "ELOOP",
        libc::EFBIG => "EFBIG",
        libc::ENOSPC => "ENOSPC",
        _ => return format!("errno {e}"),
    };
    n.to_string()
}

fn os(r: io::Result<impl Into<String>>) -> Out {
    r.map(Into::into)
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))
}

fn ok<T>(r: io::Result<T>) -> Out {
    os(r.map(|_| "ok"))
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// The names and d_ino of a directory's entries as readdir(3) gives them
/// ("." and ".." included; std's read_dir leaves them out), sorted by name.
pub fn readdir(p: &Path) -> io::Result<Vec<(String, u64)>> {
    let c = cpath(p);
    // SAFETY: opendir on a NUL-terminated path; the handle is closed below
    // and each dirent is read before the next readdir call.
    unsafe {
        let d = libc::opendir(c.as_ptr());
        if d.is_null() {
            return Err(io::Error::last_os_error());
        }
        let mut v = Vec::new();
        loop {
            let e = libc::readdir(d);
            if e.is_null() {
                break;
            }
            let name = std::ffi::CStr::from_ptr((*e).d_name.as_ptr());
            v.push((name.to_string_lossy().into_owned(), (*e).d_ino));
        }
        libc::closedir(d);
        v.sort();
        Ok(v)
    }
}

fn names(p: &Path) -> Out {
    os(readdir(p).map(|v| v.into_iter().map(|e| e.0).collect::<Vec<_>>().join(",")))
}

fn utimens(p: &Path, at: (i64, i64), mt: (i64, i64)) -> io::Result<()> {
    let ts = [
        libc::timespec {
            tv_sec: at.0,
            tv_nsec: at.1,
        },
        libc::timespec {
            tv_sec: mt.0,
            tv_nsec: mt.1,
        },
    ];
    let c = cpath(p);
    // SAFETY: a NUL-terminated path and two initialised timespecs.
    let r = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), ts.as_ptr(), 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn statfs(p: &Path) -> io::Result<libc::statfs> {
    let c = cpath(p);
    // SAFETY: a NUL-terminated path and a zeroed out-struct statfs fills.
    unsafe {
        let mut s: libc::statfs = std::mem::zeroed();
        if libc::statfs(c.as_ptr(), &mut s) == 0 {
            Ok(s)
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

fn read_s(p: &Path) -> Out {
    os(fs::read(p).map(|b| String::from_utf8_lossy(&b).into_owned()))
}

fn size(p: &Path) -> Out {
    os(fs::metadata(p).map(|m| m.len().to_string()))
}

fn write_at(p: &Path, off: u64, b: &[u8]) -> io::Result<()> {
    let mut f = OpenOptions::new().write(true).open(p)?;
    f.seek(SeekFrom::Start(off))?;
    f.write_all(b)
}

/// Runs the table in `root` (an empty directory) and returns one line per
/// row: `name: outcome`.
pub fn run(root: &Path) -> Vec<String> {
    let j = |s: &str| root.join(s);
    let (d, f, g, h) = (j("d"), j("f"), j("g"), j("h"));
    let rows: Vec<Row<'_>> = vec![
        row("mkdir", || ok(fs::create_dir(&d))),
        row("mkdir existing", || ok(fs::create_dir(&d))),
        row("mkdir in missing dir", || ok(fs::create_dir(j("no/x")))),
        row("create excl", || {
            let mut o = OpenOptions::new();
            o.write(true).create_new(true).mode(0o644);
            os(o.open(&f)
                .and_then(|mut x| x.write_all(b"hello"))
                .map(|_| "ok"))
        }),
        row("create excl existing", || {
            ok(OpenOptions::new().write(true).create_new(true).open(&f))
        }),
        row("open missing", || ok(fs::File::open(j("missing")))),
        row("write on O_RDONLY", || {
            ok(fs::File::open(&f).and_then(|mut x| x.write_all(b"x")))
        }),
        row("read", || read_s(&f)),
        row("O_APPEND", || {
            let mut o = OpenOptions::new();
            o.append(true);
            o.open(&f)
                .and_then(|mut x| x.write_all(b" world"))
                .map_err(|e| e.raw_os_error().unwrap_or(0))?;
            read_s(&f)
        }),
        row("pwrite past the end", || {
            write_at(&f, 20, b"x").map_err(|e| e.raw_os_error().unwrap_or(0))?;
            let b = fs::read(&f).map_err(|e| e.raw_os_error().unwrap_or(0))?;
            Ok(format!("{} {:?}", b.len(), &b[9..]))
        }),
        row("O_TRUNC", || {
            ok(OpenOptions::new().write(true).truncate(true).open(&f))?;
            size(&f)
        }),
        row("truncate up", || {
            fs::write(&f, b"abcdef").map_err(|e| e.raw_os_error().unwrap_or(0))?;
            ok(OpenOptions::new()
                .write(true)
                .open(&f)
                .and_then(|x| x.set_len(10_000)))?;
            let b = fs::read(&f).map_err(|e| e.raw_os_error().unwrap_or(0))?;
            Ok(format!("{} {}", b.len(), b[6..].iter().all(|&c| c == 0)))
        }),
        row("truncate down", || {
            ok(OpenOptions::new()
                .write(true)
                .open(&f)
                .and_then(|x| x.set_len(3)))?;
            read_s(&f)
        }),
        row("read at EOF", || {
            let mut x = fs::File::open(&f).map_err(|e| e.raw_os_error().unwrap_or(0))?;
            x.seek(SeekFrom::Start(100))
                .map_err(|e| e.raw_os_error().unwrap_or(0))?;
            let mut b = [0u8; 8];
            os(x.read(&mut b).map(|n| n.to_string()))
        }),
        row("lseek SEEK_END", || {
            let mut x = fs::File::open(&f).map_err(|e| e.raw_os_error().unwrap_or(0))?;
            os(x.seek(SeekFrom::End(0)).map(|n| n.to_string()))
        }),
        row("chmod", || {
            ok(fs::set_permissions(&f, fs::Permissions::from_mode(0o640)))?;
            os(fs::metadata(&f).map(|m| format!("{:o}", m.mode())))
        }),
        row("utimens", || {
            ok(utimens(
                &f,
                (1_000_000_000, 123_456_789),
                (1_500_000_000, 987_654_321),
            ))?;
            let m = fs::metadata(&f).map_err(|e| e.raw_os_error().unwrap_or(0))?;
            Ok(format!(
                "{}.{} {}.{}",
                m.atime(),
                m.atime_nsec(),
                m.mtime(),
                m.mtime_nsec()
            ))
        }),
        row(
            "fsync",
            || ok(fs::File::open(&f).and_then(|x| x.sync_all())),
        ),
        row("mkdir sub", || ok(fs::create_dir(d.join("sub")))),
        row("dir nlink", || {
            os(fs::metadata(&d).map(|m| m.nlink().to_string()))
        }),
        row("create in sub", || ok(fs::write(d.join("sub/x"), b"x"))),
        row("rmdir non-empty", || ok(fs::remove_dir(&d))),
        row("rmdir a file", || ok(fs::remove_dir(&f))),
        row("unlink a dir", || ok(fs::remove_file(&d))),
        row("open a dir for writing", || {
            ok(OpenOptions::new().write(true).open(&d))
        }),
        row("create under a file", || ok(fs::write(f.join("x"), b""))),
        row("rename", || {
            ok(fs::rename(&f, &g))?;
            Ok(format!("{:?} {:?}", size(&f), read_s(&g)))
        }),
        row("rename over existing", || {
            ok(fs::write(&h, b"old contents"))?;
            ok(fs::rename(&g, &h))?;
            Ok(format!("{:?} {:?}", size(&g), read_s(&h)))
        }),
        row("rename dir over non-empty dir", || {
            ok(fs::create_dir(j("e")))?;
            ok(fs::write(j("e/y"), b"y"))?;
            ok(fs::rename(&d, j("e")))
        }),
        row("rename dir over empty dir", || {
            ok(fs::create_dir(j("empty")))?;
            ok(fs::rename(j("e"), j("empty")))?;
            names(&j("empty"))
        }),
        row("rename file over dir", || ok(fs::rename(&h, j("empty")))),
        row("rename dir over file", || ok(fs::rename(j("empty"), &h))),
        row("rename dir into itself", || {
            ok(fs::rename(&d, d.join("sub/in")))
        }),
        row("rename missing", || ok(fs::rename(j("missing"), j("m2")))),
        row("rename to itself", || ok(fs::rename(&h, &h))),
        row("link", || {
            ok(fs::hard_link(&h, j("h2")))?;
            os(fs::metadata(&h).map(|m| m.nlink().to_string()))
        }),
        row("link existing name", || ok(fs::hard_link(&h, j("h2")))),
        row("unlink a link", || {
            ok(fs::remove_file(j("h2")))?;
            os(fs::metadata(&h).map(|m| m.nlink().to_string()))
        }),
        row("link a dir", || ok(fs::hard_link(&d, j("dl")))),
        row("symlink", || {
            ok(symlink("target/path", j("s")))?;
            os(fs::read_link(j("s")).map(|t| t.display().to_string()))
        }),
        row("lstat symlink", || {
            os(fs::symlink_metadata(j("s"))
                .map(|m| format!("{} {}", m.file_type().is_symlink(), m.len())))
        }),
        row("symlink existing name", || ok(symlink("x", j("s")))),
        row("readlink a file", || ok(fs::read_link(&h))),
        row("stat dangling symlink", || ok(fs::metadata(j("s")))),
        row("follow symlink", || {
            ok(symlink("h", j("s2")))?;
            read_s(&j("s2"))
        }),
        row("unlink missing", || ok(fs::remove_file(j("missing")))),
        row("name too long", || ok(fs::write(j(&"n".repeat(300)), b""))),
        row("readdir", || names(root)),
        row("readdir sub", || names(&d)),
        row("readdir . and ..", || {
            let v = readdir(&d).map_err(|e| e.raw_os_error().unwrap_or(0))?;
            let ino = |n: &str| v.iter().find(|e| e.0 == n).map(|e| e.1);
            let me = fs::metadata(&d)
                .map_err(|e| e.raw_os_error().unwrap_or(0))?
                .ino();
            let up = fs::metadata(root)
                .map_err(|e| e.raw_os_error().unwrap_or(0))?
                .ino();
            Ok(format!(
                "{} {}",
                ino(".") == Some(me),
                ino("..") == Some(up)
            ))
        }),
        row("readdir many", || {
            ok(fs::create_dir(j("many")))?;
            for i in 0..300 {
                ok(fs::write(j(&format!("many/f{i:03}")), b""))?;
            }
            os(readdir(&j("many")).map(|v| format!("{} {} {}", v.len(), v[0].0, v[301].0)))
        }),
        row("statfs", || {
            os(statfs(root).map(|s| format!("{}", s.f_bsize > 0 && s.f_blocks > 0)))
        }),
        row("rmdir emptied", || {
            ok(fs::remove_file(d.join("sub/x")))?;
            ok(fs::remove_dir(d.join("sub")))?;
            os(fs::metadata(&d).map(|m| m.nlink().to_string()))
        }),
        row("unlink open file", || {
            let mut x = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(j("open"))
                .map_err(|e| e.raw_os_error().unwrap_or(0))?;
            x.write_all(b"still here")
                .map_err(|e| e.raw_os_error().unwrap_or(0))?;
            ok(fs::remove_file(j("open")))?;
            x.seek(SeekFrom::Start(0))
                .map_err(|e| e.raw_os_error().unwrap_or(0))?;
            let mut s = String::new();
            os(x.read_to_string(&mut s).map(|_| s))
        }),
    ];
    rows.iter()
        .map(|(name, f)| {
            let o = match f() {
                Ok(v) => v,
                Err(e) => errno_name(e),
            };
            format!("{name}: {o}")
        })
        .collect()
}
