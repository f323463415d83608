// Package fs is berth's filesystem layer: it decides whether a block device
// may be formatted, formats it, checks it, mounts and bind-mounts it, grows
// it online and reports its usage.
//
// # Formatting
//
// A device is formatted only when it provably holds nothing. [Probe]
// reads the first and the last MiB of the device and the few places
// beyond them where libblkid looks for a signature (LUKS2 secondary
// headers up to 4 MiB, VMFS at 1 and 2 MiB, a Promise RAID signature 3087
// sectors before the end). No libblkid prober matches all-zero bytes, so
// when all of those bytes are zero the device is blank and blkid need not
// run. Otherwise Probe runs `blkid -p` (low-level superblock and
// partition-table probing that bypasses the blkid cache), started as soon
// as the first block shows data. Zoned devices and CD-ROMs, where libblkid
// looks elsewhere, always go to blkid. A GPT backup header left alone at
// the end (primary table and protective MBR erased), which blkid ignores,
// is caught by Probe's own read of the last block.
// libblkid's places say nothing of data an application wrote elsewhere (a
// raw block database that leaves its first MiB zero): when the first
// block is zero, Probe also reads 16 KiB samples between the ends, at
// the start of every MiB from 1 to 16 MiB, at every power-of-two MiB
// offset from 32 MiB on, and at 31 points evenly spaced over the device
// (see sampleOffsets), a few at a time alongside its other reads. Any
// non-zero byte there is "unknown-data". Sampling is not proof: data
// wholly between the places read is not seen. A loop device's image is
// read whole instead, up to a bound (see [EnsureFilesystem] and
// [MkfsOptions].Image).
// [EnsureFilesystem] formats only when nothing was found: no filesystem,
// partition table, RAID member, LUKS header, swap area, LVM PV or other
// signature, and every byte read (both MiBs, the libblkid places, the
// samples) zero. Anything else is refused with an error wrapping
// errdefs.ErrFailedPrecondition that names what was found (for unknown
// data, the offset of its first non-zero byte), and the device is left
// untouched. A device that already holds the
// requested filesystem type is used as it is. The force flags of mkfs (-F,
// -f) are passed only after that probe: they turn off mkfs' own, weaker
// checks, never ours (mkfs still refuses a mounted device). After mkfs,
// the new superblock's magic number is read back from the device.
// mkfs killed halfway (the node died) leaves writes that every later
// probe refuses; [MkfsOptions].BeforeMkfs lets the caller record that it
// started the format, and [Format] finishes it without a probe. berth's
// agent calls Format only for the device it recorded, identity checked.
//
// mkfs runs with production defaults: no discard pass at mkfs time (a full
// device TRIM can take minutes on thin-provisioned LUNs and some arrays
// zero slowly); ext4 initialises its inode tables and journal lazily in the
// background after the first mount.
//
// # Checking (fsck policy)
//
// ext4: before the staging mount [Fsck] runs `e2fsck -p` (preen: replays
// the journal and fixes only what is safe to fix without a human) when the
// filesystem is not mounted anywhere on this node. Exit status 0 and the
// "errors corrected" statuses 1 and 2 let the mount proceed. Status 4
// (errors left uncorrected) returns an error wrapping
// errdefs.ErrFailedPrecondition with e2fsck's output: the volume needs an
// operator running e2fsck by hand. Any other status (8 operational error,
// 16 usage, 32 cancelled, 128 shared-library error) is an error as well.
// A mounted filesystem is never checked.
//
// xfs: no automatic check or repair. XFS replays its log at mount time,
// which is the only recovery that is safe to run unattended; xfs_repair
// may discard metadata (and `xfs_repair -n` reports problems that need a
// human decision, so acting on it automatically is unsafe). A corrupt XFS
// fails to mount and the mount error is returned.
//
// # Mounting
//
// Mounts, bind mounts and unmounts use mount(2) and umount2(2) directly,
// on paths resolved once into a [Handle]: openat2(2) with
// RESOLVE_NO_SYMLINKS opens the path (or its parent directory) as an
// O_PATH descriptor, mkdir and create act relative to it, mount(2) takes
// the target as /proc/self/fd/N, and [UnmountAt] checks each mount through
// a descriptor before it unmounts it at its name in the held directory.
// A symlink swapped into the path after the check redirects nothing.
// A filesystem shut down after I/O errors answers statx with EIO; its
// mount is then described without getattr (see [StatFd]), so that it can
// still be checked and unmounted.
// Mount options come from users (CSI mount_flags) and pass through
// [ParseMountOptions], an allowlist that refuses unknown options and
// options that weaken data safety (nobarrier, norecovery, data=writeback,
// errors=panic). [IsMountPoint] answers with one statx(2) call where the
// kernel reports STATX_ATTR_MOUNT_ROOT (Linux 5.8), else with openat2(2)
// and RESOLVE_NO_XDEV (Linux 5.6), else from /proc/self/mountinfo.
//
// # Concurrency
//
// mkfs, fsck and resize are CPU and I/O heavy; at most 8*NumCPU of them
// (at least 32) run at once in a process. Waiting for a slot honours the
// context.
package fs
