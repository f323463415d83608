// Package devices finds the block devices that berth's transports create and
// proves they are the ones asked for.
//
// A Listener holds one NETLINK_KOBJECT_UEVENT socket for the whole agent and
// fans its events out to Waiters. A caller subscribes before the action that
// makes a device appear (an NVMe connect, an iSCSI login, a loop attach), then
// calls Wait: Wait reads sysfs once and after that only reacts to events, so
// nothing that happens between the action and the wait is missed and nothing
// is polled.
//
// When systemd-udevd runs (/run/udev/control exists) the listener also joins
// udev's multicast group, and a device is handed out only once udev has
// finished its rules for it: udev's own event arrived, or its database entry
// /run/udev/data/b<major>:<minor> exists and no newer kernel event for the
// device is still being processed. Without udevd (a minimal host, a container
// without /run/udev) kernel events and sysfs alone are used; devtmpfs makes the
// device node before the kernel announces the device.
//
// Identity comes from sysfs: H:C:T:L and the VPD page 0x83 designator for SCSI
// disks, subsystem NQN, namespace ID, UUID and NGUID for NVMe namespaces, the
// backing file for loop devices and the map UUID for device-mapper. Device.Verify
// reads it again, with stat(2) of the device node, right before anything
// destructive.
//
// Where sysfs, /dev and /run/udev are is a Roots value the caller passes in,
// not a setting of the package: its zero value is the host's trees, a Device
// keeps the Roots it was read from and a Listener the Roots it was opened
// with, so tests on fake trees need no shared state and run in parallel.
package devices
