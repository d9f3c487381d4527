//! The mount options a plan may use, per filesystem. An allow-list: an
//! option can name another device or file (ext4's `journal_dev` and
//! `journal_path`, xfs's `logdev` and `rtdev`, quota files), take the node
//! down (`errors=panic`) or skip a journal's recovery (`noload`,
//! `norecovery`), and the host cannot know what a new one does.

/// What value an option takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value {
    /// A flag: no value.
    None,
    /// A decimal number.
    Number,
    /// One of these words.
    OneOf(&'static [&'static str]),
    /// A name: letters, digits, `-`, `_`, `.`.
    Name,
    /// Host names separated by `:` (gluster's volfile servers).
    Servers,
    /// An absolute path within the volume's state or staging dir.
    Path,
}

/// Options of the mount itself, good for any filesystem: the host turns
/// them into mount flags.
const COMMON: &[(&str, Value)] = &[
    ("noatime", Value::None),
    ("nodiratime", Value::None),
    ("relatime", Value::None),
    ("strictatime", Value::None),
    ("lazytime", Value::None),
    ("noexec", Value::None),
    ("sync", Value::None),
    ("dirsync", Value::None),
];

const EXT4: &[(&str, Value)] = &[
    ("acl", Value::None),
    ("noacl", Value::None),
    ("user_xattr", Value::None),
    ("nouser_xattr", Value::None),
    ("discard", Value::None),
    ("nodiscard", Value::None),
    ("barrier", Value::None),
    ("nobarrier", Value::None),
    ("auto_da_alloc", Value::None),
    ("noauto_da_alloc", Value::None),
    ("delalloc", Value::None),
    ("nodelalloc", Value::None),
    ("block_validity", Value::None),
    ("noblock_validity", Value::None),
    ("dioread_lock", Value::None),
    ("dioread_nolock", Value::None),
    ("i_version", Value::None),
    ("nombcache", Value::None),
    ("init_itable", Value::Number),
    ("noinit_itable", Value::None),
    ("grpid", Value::None),
    ("bsdgroups", Value::None),
    ("nogrpid", Value::None),
    ("sysvgroups", Value::None),
    ("quota", Value::None),
    ("noquota", Value::None),
    ("usrquota", Value::None),
    ("grpquota", Value::None),
    ("prjquota", Value::None),
    ("journal_checksum", Value::None),
    ("nojournal_checksum", Value::None),
    ("journal_async_commit", Value::None),
    ("data", Value::OneOf(&["journal", "ordered", "writeback"])),
    ("errors", Value::OneOf(&["continue", "remount-ro"])),
    ("commit", Value::Number),
    ("stripe", Value::Number),
    ("inode_readahead_blks", Value::Number),
    ("max_batch_time", Value::Number),
    ("min_batch_time", Value::Number),
    ("journal_ioprio", Value::Number),
    ("resuid", Value::Number),
    ("resgid", Value::Number),
];

const XFS: &[(&str, Value)] = &[
    ("attr2", Value::None),
    ("noattr2", Value::None),
    ("discard", Value::None),
    ("nodiscard", Value::None),
    ("grpid", Value::None),
    ("bsdgroups", Value::None),
    ("nogrpid", Value::None),
    ("sysvgroups", Value::None),
    ("filestreams", Value::None),
    ("ikeep", Value::None),
    ("noikeep", Value::None),
    ("inode32", Value::None),
    ("inode64", Value::None),
    ("largeio", Value::None),
    ("nolargeio", Value::None),
    ("noalign", Value::None),
    ("nouuid", Value::None),
    ("noquota", Value::None),
    ("uquota", Value::None),
    ("usrquota", Value::None),
    ("uqnoenforce", Value::None),
    ("qnoenforce", Value::None),
    ("gquota", Value::None),
    ("grpquota", Value::None),
    ("gqnoenforce", Value::None),
    ("pquota", Value::None),
    ("prjquota", Value::None),
    ("pqnoenforce", Value::None),
    ("swalloc", Value::None),
    ("wsync", Value::None),
    ("allocsize", Value::Number),
    ("logbufs", Value::Number),
    ("logbsize", Value::Number),
    ("sunit", Value::Number),
    ("swidth", Value::Number),
];

const GLUSTERFS: &[(&str, Value)] = &[
    ("auto_unmount", Value::None),
    ("acl", Value::None),
    ("selinux", Value::None),
    ("fopen-keep-cache", Value::None),
    ("backup-volfile-servers", Value::Servers),
    ("log-file", Value::Path),
    (
        "log-level",
        Value::OneOf(&["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "TRACE", "NONE"]),
    ),
    ("transport", Value::OneOf(&["tcp", "rdma", "socket"])),
    ("direct-io-mode", Value::OneOf(&["enable", "disable", "auto"])),
    ("attribute-timeout", Value::Number),
    ("entry-timeout", Value::Number),
    ("negative-timeout", Value::Number),
    ("reader-thread-count", Value::Number),
    ("volfile-max-fetch-attempts", Value::Number),
    ("volfile-id", Value::Name),
];

/// The kernel NFS client's. Not among them: what names another address
/// (`addr`, `clientaddr`, `mountaddr`, `mounthost`: the source is the one
/// server), what outlives the call (`bg`, a mount that retries on its own),
/// `retry` and `sloppy` (the host sets one attempt and strict parsing),
/// `fsc` (a local cache daemon), SELinux contexts, and security flavours
/// other than `sys`, which need a credential daemon the agent does not run.
const NFS: &[(&str, Value)] = &[
    ("vers", Value::OneOf(&["3", "4", "4.0", "4.1", "4.2"])),
    ("nfsvers", Value::OneOf(&["3", "4", "4.0", "4.1", "4.2"])),
    ("minorversion", Value::OneOf(&["0", "1", "2"])),
    ("proto", Value::OneOf(&["tcp", "tcp6"])),
    ("mountproto", Value::OneOf(&["tcp", "tcp6"])),
    ("port", Value::Number),
    ("mountport", Value::Number),
    ("sec", Value::OneOf(&["sys"])),
    ("hard", Value::None),
    ("soft", Value::None),
    ("softerr", Value::None),
    ("fg", Value::None),
    ("timeo", Value::Number),
    ("retrans", Value::Number),
    ("rsize", Value::Number),
    ("wsize", Value::Number),
    ("nconnect", Value::Number),
    ("max_connect", Value::Number),
    ("ac", Value::None),
    ("noac", Value::None),
    ("acregmin", Value::Number),
    ("acregmax", Value::Number),
    ("acdirmin", Value::Number),
    ("acdirmax", Value::Number),
    ("actimeo", Value::Number),
    ("cto", Value::None),
    ("nocto", Value::None),
    ("lock", Value::None),
    ("nolock", Value::None),
    ("local_lock", Value::OneOf(&["none", "all", "flock", "posix"])),
    ("lookupcache", Value::OneOf(&["all", "none", "pos", "positive"])),
    ("rdirplus", Value::None),
    ("nordirplus", Value::None),
    ("sharecache", Value::None),
    ("nosharecache", Value::None),
    ("resvport", Value::None),
    ("noresvport", Value::None),
    ("acl", Value::None),
    ("noacl", Value::None),
];

/// What `key` takes on filesystem `fs`, or none when it is not allowed.
pub fn allowed(fs: &str, key: &str) -> Option<Value> {
    let own: &[(&str, Value)] = match fs {
        "ext4" => EXT4,
        "xfs" => XFS,
        "glusterfs" => GLUSTERFS,
        "nfs" | "nfs4" => NFS,
        _ => &[],
    };
    COMMON.iter().chain(own).find(|(k, _)| *k == key).map(|(_, v)| *v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_naming_other_devices_or_files_are_not_allowed() {
        for (fs, key) in [
            ("ext4", "journal_dev"),
            ("ext4", "journal_path"),
            ("ext4", "usrjquota"),
            ("ext4", "noload"),
            ("ext4", "norecovery"),
            ("ext4", "dax"),
            ("ext4", "sb"),
            ("xfs", "logdev"),
            ("xfs", "rtdev"),
            ("xfs", "norecovery"),
            ("btrfs", "device"),
            ("ext4", "suid"),
            ("ext4", "dev"),
        ] {
            assert_eq!(allowed(fs, key), None, "{fs} {key}");
        }
        assert_eq!(
            allowed("ext4", "errors"),
            Some(Value::OneOf(&["continue", "remount-ro"])),
            "errors=panic is not among them"
        );
        assert_eq!(allowed("btrfs", "noatime"), Some(Value::None), "mount flags are good anywhere");
        assert_eq!(allowed("glusterfs", "log-file"), Some(Value::Path));
    }

    #[test]
    fn nfs_takes_no_other_address_no_retries_and_no_daemon() {
        for key in [
            "addr",
            "clientaddr",
            "mountaddr",
            "mounthost",
            "bg",
            "retry",
            "sloppy",
            "fsc",
            "context",
            "suid",
            "dev",
        ] {
            assert_eq!(allowed("nfs", key), None, "{key}");
            assert_eq!(allowed("nfs4", key), None, "{key}");
        }
        assert_eq!(allowed("nfs", "sec"), Some(Value::OneOf(&["sys"])), "no krb5: no gssd");
        assert_eq!(allowed("nfs4", "nconnect"), Some(Value::Number));
        assert_eq!(allowed("nfs", "noatime"), Some(Value::None));
    }
}
