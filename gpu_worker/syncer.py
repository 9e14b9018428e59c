"""The fdatasync helper: a small child process that makes each tick durable while the device's
interpreter gathers the next one.

The device writes a tick's records itself (page cache, microseconds), then asks the helper to
fdatasync the segment file and admits the next tick while the disk works. A thread cannot do this
for an interpreter that is busy: it needs the GIL to start the fdatasync and again to report it,
and on two cores a device measured 0.3 to 0.9 ms per tick just waiting for that hand-off. The
helper has its own interpreter, so the only hand-off is one message each way on a socketpair.

fdatasync flushes the file (the inode), not the descriptor, so the helper's duplicate descriptor
(passed with SCM_RIGHTS whenever the device moves to a new segment) makes the device's writes
durable; a failed writeback is reported to the helper's descriptor too (Linux errseq), and the
device treats a non-zero errno exactly as a failed fdatasync of its own (journal._tick_failed).

Protocol (SOCK_SEQPACKET, one message each way per tick): the device sends b"s" (sync the current
file) or b"f" with one descriptor attached (this is the file from now on; sync it); the helper
answers a 4-byte little-endian errno, 0 for success. End of file on either side ends the other.
"""
import errno
import os
import signal
import socket
import struct
import subprocess
import sys

RESULT = struct.Struct("<i")


class Syncer:
    """The device's side: start the helper, ask for a sync, read its result."""

    def __init__(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # Run as a script (standard library only): it needs no package path, whatever the cwd.
            # In a session of its own: Ctrl-C or a supervisor's SIGTERM to the device's process
            # group must not reach it, not even while it starts (before it can ignore signals, a
            # group SIGTERM right after "device ready" killed it and the orderly stop exited 1).
            self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
                                            pass_fds=[theirs.fileno()], start_new_session=True)
        finally:
            theirs.close()
        self.sock = ours
        self._file = None

    def fileno(self):
        return self.sock.fileno()

    def request(self, file):
        """Ask for an fdatasync of `file` (an AppendFile); the result arrives on fileno()."""
        if file is self._file:
            self.sock.send(b"s")
        else:
            socket.send_fds(self.sock, [b"f"], [file.fileno()])
            self._file = file

    def result(self):
        """The errno of the last requested fdatasync, 0 when it succeeded."""
        data = self.sock.recv(RESULT.size)
        if len(data) != RESULT.size:
            raise RuntimeError(f"the fdatasync helper (pid {self.process.pid}) exited")
        return RESULT.unpack(data)[0]

    def close(self):
        self.sock.close()  # the helper sees end of file and exits
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def serve(sock):
    fd = None
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1, 1)
        if not msg:
            return  # the device closed its end (or died)
        if fds:
            if fd is not None:
                os.close(fd)
            fd = fds[0]
        try:
            os.fdatasync(fd)
            err = 0
        except OSError as e:
            err = e.errno or errno.EIO
        except TypeError:  # no file was ever sent: a protocol error of the device
            err = errno.EBADF
        sock.send(RESULT.pack(err))


if __name__ == "__main__":
    # It must outlive the device's own orderly stop and exit only when the device's end of the
    # socket closes (a stop, a crash or kill -9 alike). Group signals do not reach it (its own
    # session); a signal sent to it directly is ignored too.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    serve(socket.socket(fileno=int(sys.argv[1])))
