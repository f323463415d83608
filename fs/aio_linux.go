package fs

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Linux native AIO (io_setup, io_submit, io_getevents) reads many small
// ranges of one device with one system call: the kernel queues all of
// them at once, and the caller sleeps once until the last is done. A
// thread per read hands them to the device one at a time and wakes once
// per read; on a network device every hand-off and wake-up costs CPU on
// the node. Reads of a file opened with O_DIRECT are asynchronous; on
// other files io_submit reads each range before it returns, which is
// still correct.

// iocb is struct iocb of linux/aio_abi.h: 64 bytes, with the fields
// set here at the same offsets on every architecture.
type iocb struct {
	data   uint64 // returned in ioEvent.data: the index in the batch
	_      uint32 // aio_key (the order of these two is the endianness's)
	_      int32  // aio_rw_flags
	opcode uint16
	_      int16 // aio_reqprio
	fildes uint32
	buf    uint64
	nbytes uint64
	offset int64
	_      uint64 // aio_reserved2
	_      uint32 // aio_flags
	_      uint32 // aio_resfd
}

// ioEvent is struct io_event of linux/aio_abi.h.
type ioEvent struct {
	data uint64
	_    uint64 // obj
	res  int64  // bytes read, or -errno
	_    int64  // res2
}

const iocbCmdPread = 0

// batchRead is one range for readBatch: len(buf) bytes at off. n and err
// are what the read gave; a read that ends early because the file does
// is not an error.
type batchRead struct {
	off int64
	buf []byte
	n   int
	err error
}

// errNoAIO is returned by newAIOContext when the kernel offers no AIO
// context: no AIO support, a seccomp filter, or fs.aio-max-nr used up.
var errNoAIO = errors.New("native AIO unavailable")

// aioContext is a kernel AIO context (aio_context_t), 0 for none. One
// serves one readBatch at a time. Set up, it is kept and reused: its
// io_destroy waits for an RCU grace period (tens of milliseconds), too
// long to pay once per probe.
type aioContext uintptr

// newAIOContext sets up a context for up to n reads in flight. It
// returns errNoAIO when the kernel offers none.
func newAIOContext(n int) (aioContext, error) {
	var ctx aioContext
	if _, _, e := unix.Syscall(unix.SYS_IO_SETUP, uintptr(n), uintptr(unsafe.Pointer(&ctx)), 0); e != 0 {
		return 0, fmt.Errorf("%w: io_setup: %w", errNoAIO, e)
	}
	return ctx, nil
}

// destroy releases the context, once no read is in flight on it.
func (c aioContext) destroy() {
	if c != 0 {
		unix.Syscall(unix.SYS_IO_DESTROY, uintptr(c), 0, 0)
	}
}

// readBatch reads every range of reads from f through c, set up for
// len(reads) at least: all submitted with one io_submit, then waited for
// with one io_getevents. What the kernel does not take, and a read that
// comes back short before the end of the file, is read with pread. The
// buffers must stay mapped until readBatch returns (the kernel writes
// them, not Go). An error means c can no longer be used (reads may be
// in flight on it: destroy it, which waits for them); a read's own
// failure is in its err.
func (c aioContext) readBatch(f *os.File, reads []batchRead) error {
	if len(reads) == 0 {
		return nil
	}
	fd := f.Fd()
	cbs := make([]iocb, len(reads))
	ptrs := make([]*iocb, len(reads))
	for i := range reads {
		r := &reads[i]
		r.n, r.err = 0, nil
		cbs[i] = iocb{data: uint64(i), opcode: iocbCmdPread, fildes: uint32(fd), nbytes: uint64(len(r.buf)), offset: r.off}
		if len(r.buf) > 0 {
			cbs[i].buf = uint64(uintptr(unsafe.Pointer(&r.buf[0])))
		}
		ptrs[i] = &cbs[i]
	}
	// The kernel takes a prefix of the array on each io_submit; what it
	// does not take (it refused the next iocb) is read with pread below,
	// which gives that read's error.
	pending := 0
	for pending < len(ptrs) {
		n, _, e := unix.Syscall(unix.SYS_IO_SUBMIT, uintptr(c), uintptr(len(ptrs)-pending), uintptr(unsafe.Pointer(&ptrs[pending])))
		if e == unix.EINTR {
			continue
		}
		if e != 0 || n == 0 {
			break
		}
		pending += int(n)
	}
	events := make([]ioEvent, pending)
	for done := 0; done < pending; {
		n, _, e := unix.Syscall6(unix.SYS_IO_GETEVENTS, uintptr(c), uintptr(pending-done), uintptr(pending-done),
			uintptr(unsafe.Pointer(&events[done])), 0, 0)
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return fmt.Errorf("io_getevents: %w", e)
		}
		done += int(n)
	}
	runtime.KeepAlive(cbs)
	runtime.KeepAlive(f)
	for _, ev := range events {
		r := &reads[ev.data]
		if ev.res < 0 {
			r.err = &os.PathError{Op: "read", Path: f.Name(), Err: unix.Errno(-ev.res)}
			continue
		}
		r.n = int(ev.res)
	}
	for i := range reads {
		r := &reads[i]
		if r.err != nil {
			continue
		}
		if i >= pending || (r.n > 0 && r.n < len(r.buf)) {
			// Not submitted, or short: read what is left.
			m, err := readAtFull(f, r.buf[r.n:], r.off+int64(r.n))
			r.n += m
			r.err = err
		}
	}
	return nil
}
