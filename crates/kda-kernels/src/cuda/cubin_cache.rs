//! An opt-in directory of compiled kernel modules: with `KDA_KERNEL_CACHE=DIR` the registry
//! keeps each module's CUBIN in `DIR`, named by a SHA-256 of everything that decides its bytes
//! (the specialised source, NVRTC's options and version), so a later process (a restart, the
//! other ranks of a tensor-parallel group) loads it instead of compiling it again (NVRTC takes
//! seconds per module). Files are written whole under a temporary name and renamed into
//! place, so processes sharing the directory never read a partial file; a file that is not a
//! CUBIN, or that the driver refuses, is compiled again and replaced. A directory that cannot
//! be written only costs the cache (a warning), never the compile.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

/// The environment variable naming the cache's directory (unset or empty: no cache).
pub(crate) const CACHE_ENV: &str = "KDA_KERNEL_CACHE";

/// The first bytes of every CUBIN (an ELF image).
const ELF_MAGIC: &[u8] = b"\x7fELF";

/// A directory of CUBINs, each named by its key.
#[derive(Debug, Clone)]
pub(crate) struct CubinCache {
    dir: PathBuf,
}

impl CubinCache {
    /// The cache `KDA_KERNEL_CACHE` names, if any.
    pub(crate) fn from_env() -> Option<Self> {
        std::env::var_os(CACHE_ENV)
            .filter(|d| !d.is_empty())
            .map(|d| Self::at(d.into()))
    }

    /// The cache in `dir` (created on the first write).
    pub(crate) fn at(dir: PathBuf) -> Self {
        CubinCache { dir }
    }

    /// The key of a module built from `parts` (each part's length goes into the hash before
    /// it, so parts cannot run into each other): 64 hex digits.
    pub(crate) fn key(parts: &[&[u8]]) -> String {
        let mut h = Sha256::new();
        for p in parts {
            h.update((p.len() as u64).to_le_bytes());
            h.update(p);
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The file of `key`'s CUBIN.
    pub(crate) fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.cubin"))
    }

    /// The cached CUBIN of `key`, if the file is there and is one.
    pub(crate) fn get(&self, key: &str) -> Option<Vec<u8>> {
        std::fs::read(self.path(key))
            .ok()
            .filter(|b| b.starts_with(ELF_MAGIC))
    }

    /// Stores `cubin` as `key`'s (replacing any file there).
    pub(crate) fn store(&self, key: &str, cubin: &[u8]) -> std::io::Result<()> {
        write_whole(&self.dir, &self.path(key), cubin)
    }

    /// Stores `cubin` as `key`'s (replacing any file there); a failure is only logged.
    pub(crate) fn put(&self, key: &str, cubin: &[u8]) {
        if let Err(e) = self.store(key, cubin) {
            tracing::warn!(
                "{CACHE_ENV}: could not store a kernel module in {}: {e}",
                self.dir.display()
            );
        }
    }
}

/// Writes `bytes` to `path` in `dir` under a temporary name first, then renames it into place.
fn write_whole(dir: &Path, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    // unique among this process's writes (two devices may store the same module at once) and,
    // by the process id, among the processes sharing the directory
    static WRITES: AtomicU64 = AtomicU64::new(0);
    std::fs::create_dir_all(dir)?;
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp.{}.{n}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh, empty directory for one test.
    fn fresh_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kda-cubin-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn fake_cubin(tag: u8) -> Vec<u8> {
        [ELF_MAGIC, &[tag; 29]].concat()
    }

    #[test]
    fn a_stored_module_is_found_by_another_process_and_replaced_whole() {
        let dir = fresh_dir("hit");
        let cache = CubinCache::at(dir.clone());
        let key = CubinCache::key(&[b"src", b"--gpu-architecture=sm_90", b"13.0"]);
        assert_eq!(cache.get(&key), None);
        cache.put(&key, &fake_cubin(7));
        // another process's view of the same directory
        assert_eq!(CubinCache::at(dir.clone()).get(&key), Some(fake_cubin(7)));
        cache.put(&key, &fake_cubin(8));
        assert_eq!(cache.get(&key), Some(fake_cubin(8)));
        // nothing but the module is left behind (no temporary file)
        let files: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(files.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_that_is_no_cubin_is_not_returned() {
        let dir = fresh_dir("junk");
        let cache = CubinCache::at(dir.clone());
        let key = CubinCache::key(&[b"src"]);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(cache.path(&key), b"half a fi").unwrap();
        assert_eq!(cache.get(&key), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_directory_that_cannot_be_written_is_only_a_missed_store() {
        let blocker = fresh_dir("blocked");
        // a file where the directory should be: nothing can be created under it
        std::fs::write(&blocker, b"not a directory").unwrap();
        let cache = CubinCache::at(blocker.join("cache"));
        let key = CubinCache::key(&[b"src"]);
        cache.put(&key, &fake_cubin(5));
        assert_eq!(cache.get(&key), None);
        let _ = std::fs::remove_file(&blocker);
    }

    #[test]
    fn keys_differ_whenever_a_part_differs_and_parts_do_not_run_together() {
        let k = CubinCache::key(&[b"ab", b"c"]);
        assert_eq!(k.len(), 64);
        assert!(k.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(k, CubinCache::key(&[b"ab", b"c"]));
        assert_ne!(k, CubinCache::key(&[b"a", b"bc"]));
        assert_ne!(k, CubinCache::key(&[b"ab", b"d"]));
        assert_ne!(k, CubinCache::key(&[b"ab", b"c", b""]));
    }
}
