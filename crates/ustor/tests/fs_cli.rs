//! `ustor fs format` and `ustor fs check` on a region file: clean after
//! format and after files are written through the library on the mapped
//! file, exit 1 once a bitmap bit is wrong, exit 2 for a missing file.

use std::path::{Path, PathBuf};
use std::process::Command;

use ustor_fs::{Fs, Geometry, MappedFile, BLOCK_SIZE, ROOT_INO};

fn ustor(args: &[&str]) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_ustor"))
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    (o.status.code().unwrap(), text)
}

struct Region(PathBuf);
impl Drop for Region {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn check(p: &Path) -> (i32, String) {
    ustor(&["fs", "check", p.to_str().unwrap()])
}

#[test]
fn format_check_write_corrupt() {
    let r = Region(std::env::temp_dir().join(format!("ustor-fs-cli-{}", std::process::id())));
    let p = r.0.to_str().unwrap();
    let size = 8 << 20;
    let (rc, out) = ustor(&["fs", "format", p, &size.to_string()]);
    assert_eq!(rc, 0, "{out}");
    let (rc, out) = check(&r.0);
    assert_eq!(rc, 0, "{out}");
    assert!(out.contains("clean"), "{out}");
    let data: Vec<u8> = (0..100_000u32).map(|k| (k % 253) as u8).collect();
    let file_ino;
    {
        let mut fs = Fs::open(Box::new(MappedFile::open(&r.0).unwrap())).unwrap();
        let d = fs.mkdir(ROOT_INO, b"dir", 0o755, 0, 0).unwrap();
        file_ino = fs.create(d.ino, b"file", 0o644, 0, 0).unwrap().ino;
        fs.write(file_ino, 0, &data).unwrap();
    }
    assert_eq!(check(&r.0).0, 0);
    // Reopened from the file, the data is there.
    let fs = Fs::open(Box::new(MappedFile::open(&r.0).unwrap())).unwrap();
    let mut got = vec![0u8; data.len()];
    assert_eq!(fs.read(file_ino, 0, &mut got).unwrap(), data.len());
    assert_eq!(got, data);
    drop(fs);
    // Clear the bitmap bit of the last data block in use.
    let mut bytes = std::fs::read(&r.0).unwrap();
    let g = Geometry::for_len(bytes.len()).unwrap();
    let start = g.bitmap_start as usize * BLOCK_SIZE;
    let used = (g.data_start()..g.blocks)
        .rev()
        .find(|&b| bytes[start + (b / 8) as usize] & (1 << (b % 8)) != 0)
        .unwrap();
    bytes[start + (used / 8) as usize] &= !(1 << (used % 8));
    std::fs::write(&r.0, &bytes).unwrap();
    let (rc, out) = check(&r.0);
    assert_eq!(rc, 1, "{out}");
    assert!(out.contains("bitmap"), "{out}");
    assert_eq!(check(Path::new("/nonexistent/region")).0, 2);
}
