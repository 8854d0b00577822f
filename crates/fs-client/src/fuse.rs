//! The FUSE file system (placeholder until the mount lands).
