//! What is on a device: a quick look for the mount path's common case, and
//! blkid's full probe for everything else. Only the full probe may call a
//! device blank: a RAID or DRBD member keeps its superblock at the end of
//! the device, where a look at the first blocks never gets.

use std::fs::File;
use std::os::unix::fs::FileExt;

/// How much of the end of a device is searched for the superblocks that
/// live there: md 0.90 (within the last 128 KiB), md 1.0 (8 KiB from the
/// end) and DRBD's internal metadata (the last 4 KiB).
const TAIL_BYTES: u64 = 132 << 10;

/// md's superblock magic, little-endian in 1.x, host order (so also
/// little-endian here) in 0.90.
const MD_MAGIC: [u8; 4] = 0xa92b4efc_u32.to_le_bytes();

/// The byte ranges [`quick`] reads of `size` bytes: the first 4 KiB and
/// the tail.
pub fn regions(size: u64) -> [(u64, u64); 2] {
    let start = size.saturating_sub(TAIL_BYTES) & !511;
    [(0, 4096), (start, size - start)]
}

/// The quick answer for the common case of the mount path, which saves
/// running blkid (about 5 ms): the ext4 or xfs superblock at its place at
/// the start, and no RAID or DRBD superblock at the end. None is for the
/// full probe to decide, blank included. `f` is `size` bytes long.
pub fn quick(f: &File, size: u64) -> Option<String> {
    let mut head = vec![0u8; 4096];
    f.read_exact_at(&mut head, 0).ok()?;
    // ext2/3/4: magic 0xEF53 at 1024 + 56; a journal (ext3+) and extents
    // (ext4) are features blkid would look at, so only claim ext4 when the
    // incompat "extents" flag (0x40) at 1024 + 96 is set.
    let found = if head[1080..1082] == [0x53, 0xEF] && head[1120] & 0x40 != 0 {
        "ext4"
    } else if &head[0..4] == b"XFSB" {
        "xfs"
    } else {
        return None;
    };
    // A RAID 1 member with its superblock at the end (md 0.90, 1.0) holds
    // the array's filesystem at its start: mounting it directly would
    // corrupt the array. Any magic there sends the device to blkid.
    let [_, (start, len)] = regions(size);
    let mut tail = vec![0u8; len as usize];
    f.read_exact_at(&mut tail, start).ok()?;
    let suspicious = tail.chunks_exact(512).any(|sector| {
        sector[..4] == MD_MAGIC
            || (sector[..3] == [0x83, 0x74, 0x02] && (0x67..=0x6f).contains(&sector[3]))
    });
    (!suspicious).then(|| found.to_string())
}

/// blkid's full probe's answer, from `blkid -p -o export`: TYPE, else
/// PTTYPE, else "unknown signature" for anything it saw.
pub fn parse_blkid_export(text: &str) -> String {
    let field = |key: &str| {
        text.lines().find_map(|l| l.strip_prefix(key)).filter(|v| !v.is_empty()).map(str::to_string)
    };
    field("TYPE=").or_else(|| field("PTTYPE=")).unwrap_or_else(|| "unknown signature".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(size: u64, bytes: &[(u64, &[u8])]) -> File {
        let f = tempfile::tempfile().unwrap();
        f.set_len(size).unwrap();
        for (at, b) in bytes {
            f.write_all_at(b, *at).unwrap();
        }
        f
    }

    fn look(f: File) -> Option<String> {
        quick(&f, f.metadata().unwrap().len())
    }

    const EXT4: [(u64, &[u8]); 2] = [(1080, &[0x53, 0xEF]), (1120, &[0x40])];

    #[test]
    fn knows_ext4_and_xfs_and_defers_the_rest() {
        assert_eq!(look(image(1 << 20, &EXT4)), Some("ext4".into()));
        assert_eq!(look(image(1 << 20, &[(0, b"XFSB")])), Some("xfs".into()));
        // Blank is never the quick answer; nor ext2, a GPT, LUKS.
        assert_eq!(look(image(1 << 20, &[])), None);
        assert_eq!(look(image(1 << 20, &[(1080, &[0x53, 0xEF])])), None);
        assert_eq!(look(image(1 << 20, &[(512, b"EFI PART")])), None);
        assert_eq!(look(image(1 << 20, &[(0, b"LUKS\xba\xbe")])), None);
        assert_eq!(look(tempfile::tempfile().unwrap()), None, "too small");
    }

    #[test]
    fn a_raid_or_drbd_superblock_at_the_end_goes_to_blkid() {
        let size = 4u64 << 20;
        let md10 = ((size - 8192) & !4095, &MD_MAGIC[..]);
        let md090 = ((size & !65535) - 65536, &MD_MAGIC[..]);
        let drbd = (size - 4096, &[0x83u8, 0x74, 0x02, 0x6b][..]);
        for (at, magic) in [md10, md090, drbd] {
            let f = image(size, &[EXT4[0], EXT4[1], (at, magic)]);
            assert_eq!(look(f), None, "magic at {at}");
        }
    }

    #[test]
    fn blkid_export_answers() {
        assert_eq!(parse_blkid_export("DEVNAME=/dev/loop0\nUUID=x\nTYPE=ext4\n"), "ext4");
        assert_eq!(parse_blkid_export("PTUUID=x\nPTTYPE=gpt\n"), "gpt");
        assert_eq!(
            parse_blkid_export("DEVNAME=/dev/loop0\nTYPE=linux_raid_member\n"),
            "linux_raid_member"
        );
        assert_eq!(parse_blkid_export("DEVNAME=/dev/loop0\n"), "unknown signature");
    }
}
