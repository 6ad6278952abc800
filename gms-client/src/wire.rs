//! Framed transport over a Unix stream socket with SCM_RIGHTS file-descriptor passing.
//!
//! A frame's fd is sent with `sendmsg` on the same call as the frame's first bytes. The
//! receiver reads with `recvmsg` into a 64 KiB buffer; a received fd is attached to the
//! next frame completed after it arrived, and only when that frame is the one message that
//! carries an fd (`export_allocation_response`). Every other received fd, and every fd past
//! the first, is closed at once.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use tokio::io::Interest;
use tokio::net::UnixStream;

use crate::protocol::{frame_len, DecodeError, Message, RECV_BUFFER_LEN};

/// Most fds one `recvmsg` can bring in; more are truncated by the kernel (and closed).
const MAX_FDS_PER_RECV: usize = 8;

/// Transport failures.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The socket failed.
    #[error("socket error: {0}")]
    Io(#[from] io::Error),
    /// The peer sent bytes that are not a valid message.
    #[error("protocol error: {0}")]
    Decode(#[from] DecodeError),
    /// The peer closed the connection (a GMS that closes is "gone").
    #[error("connection closed by peer")]
    Closed,
}

/// A received message and the fd that came with it.
pub type Received = (Message, Option<OwnedFd>);

/// One framed connection. `recv` is cancel-safe: partial frames stay in the buffer.
#[derive(Debug)]
pub struct FramedStream {
    /// The socket.
    stream: UnixStream,
    /// Bytes received but not yet consumed as frames.
    buf: Vec<u8>,
    /// Fds received and not yet attached to a frame (in arrival order).
    pending_fds: Vec<OwnedFd>,
    /// The peer has shut down its side.
    eof: bool,
}

impl FramedStream {
    /// Wraps a connected socket.
    pub fn new(stream: UnixStream) -> Self {
        Self {
            stream,
            buf: Vec::with_capacity(RECV_BUFFER_LEN),
            pending_fds: Vec::new(),
            eof: false,
        }
    }

    /// The underlying socket.
    pub fn get_ref(&self) -> &UnixStream {
        &self.stream
    }

    /// Sends one message, with `fd` attached (SCM_RIGHTS) to the first bytes.
    pub async fn send(&self, msg: &Message, fd: Option<BorrowedFd<'_>>) -> Result<(), WireError> {
        let frame = msg.encode_frame();
        self.send_frame(&frame, fd).await
    }

    /// Sends pre-encoded frame bytes (tests use this to send hostile bytes).
    pub async fn send_frame(
        &self,
        frame: &[u8],
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<(), WireError> {
        let mut sent = 0usize;
        let mut fd = fd.map(|f| f.as_raw_fd());
        while sent < frame.len() {
            let chunk = &frame[sent..];
            let n = self
                .stream
                .async_io(Interest::WRITABLE, || {
                    raw_send(self.stream.as_raw_fd(), chunk, fd)
                })
                .await?;
            if n == 0 {
                return Err(WireError::Closed);
            }
            fd = None;
            sent += n;
        }
        Ok(())
    }

    /// Receives one message. `Ok(None)` on a clean close at a frame boundary.
    pub async fn recv(&mut self) -> Result<Option<Received>, WireError> {
        loop {
            if let Some(r) = self.try_frame()? {
                return Ok(Some(r));
            }
            if self.eof {
                self.pending_fds.clear();
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(WireError::Closed)
                };
            }
            self.fill().await?;
        }
    }

    /// Reads once from the socket into the buffer (cancel-safe). Returns the byte count;
    /// 0 means the peer closed.
    pub async fn fill(&mut self) -> Result<usize, WireError> {
        let mut chunk = vec![0u8; RECV_BUFFER_LEN];
        let raw = self.stream.as_raw_fd();
        let (n, fds) = self
            .stream
            .async_io(Interest::READABLE, || raw_recv(raw, &mut chunk))
            .await?;
        self.pending_fds.extend(fds);
        if n == 0 {
            self.eof = true;
        } else {
            self.buf.extend_from_slice(&chunk[..n]);
        }
        Ok(n)
    }

    /// True once the peer has closed its side.
    pub fn is_eof(&self) -> bool {
        self.eof
    }

    /// Extracts one complete frame from the buffer, if there is one.
    pub fn try_frame(&mut self) -> Result<Option<Received>, WireError> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let n = frame_len([self.buf[0], self.buf[1], self.buf[2], self.buf[3]])?;
        if self.buf.len() < 4 + n {
            return Ok(None);
        }
        let msg = Message::decode(&self.buf[4..4 + n]);
        self.buf.drain(..4 + n);
        let mut fds = std::mem::take(&mut self.pending_fds).into_iter();
        let first = fds.next();
        drop(fds); // extra fds are closed here
        let msg = msg?;
        let fd = if msg.carries_fd() { first } else { None };
        Ok(Some((msg, fd)))
    }
}

/// `sendmsg` with an optional SCM_RIGHTS fd. Returns bytes sent.
fn raw_send(sock: RawFd, data: &[u8], fd: Option<RawFd>) -> io::Result<usize> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let iov = [io::IoSlice::new(data)];
    let fds = fd.map(|fd| [fd]);
    let cmsg = fds.as_ref().map(|fds| ControlMessage::ScmRights(fds));
    Ok(sendmsg::<()>(
        sock,
        &iov,
        cmsg.as_slice(),
        MsgFlags::MSG_NOSIGNAL | MsgFlags::MSG_DONTWAIT,
        None,
    )?)
}

/// `recvmsg` into `buf`; returns the byte count and every fd received (owned, so that the
/// ones nobody wants are closed on drop). Fds are received with MSG_CMSG_CLOEXEC.
///
/// Raw libc, not nix: nix 0.29's `RecvMsg::cmsgs` refuses to walk a truncated control
/// buffer (MSG_CTRUNC), which would leak the fds the kernel did install.
fn raw_recv(sock: RawFd, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // Room for MAX_FDS_PER_RECV fds (u64 storage for alignment).
    let mut control = [0u64; 8 + MAX_FDS_PER_RECV / 2];
    // SAFETY: zeroed msghdr is valid; fields set below point at live buffers.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    hdr.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    hdr.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: as above.
    let n = unsafe { libc::recvmsg(sock, &mut hdr, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // Walk every control message, even when MSG_CTRUNC is set: the kernel installed the fds
    // that fit, and they must be owned (and closed) rather than leaked.
    // SAFETY: CMSG_* walk the control buffer the kernel filled, bounded by msg_controllen.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&hdr);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg) as *const u8;
                let header = data.offset_from(cmsg as *const u8) as usize;
                let len = ((*cmsg).cmsg_len as usize).saturating_sub(header);
                let count = len / std::mem::size_of::<RawFd>();
                for i in 0..count {
                    let fd = std::ptr::read_unaligned(
                        data.add(i * std::mem::size_of::<RawFd>()) as *const RawFd
                    );
                    if fd >= 0 {
                        fds.push(OwnedFd::from_raw_fd(fd));
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&hdr, cmsg);
        }
    }
    Ok((n as usize, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::AllocationInfo;
    use std::os::fd::AsFd;

    fn inode(fd: &OwnedFd) -> u64 {
        nix::sys::stat::fstat(fd.as_raw_fd())
            .map(|s| s.st_ino)
            .unwrap_or(0)
    }

    #[tokio::test]
    async fn fd_travels_only_with_export_responses() {
        let (a, b) = UnixStream::pair().unwrap();
        let (tx, mut rx) = (FramedStream::new(a), FramedStream::new(b));
        let file = tempfile::tempfile().unwrap();
        let owned = OwnedFd::from(file);
        let export = Message::ExportAllocationResponse(AllocationInfo {
            allocation_id: "x".into(),
            size: 1,
            aligned_size: 2,
            tag: "t".into(),
            layout_slot: 0,
        });
        // An fd on a message that carries none is closed by the receiver.
        tx.send(&Message::CommitRequest, Some(owned.as_fd()))
            .await
            .unwrap();
        let (m, fd) = rx.recv().await.unwrap().unwrap();
        assert_eq!(m, Message::CommitRequest);
        assert!(fd.is_none());
        // The export's fd arrives and names the same file.
        tx.send(&export, Some(owned.as_fd())).await.unwrap();
        let (m, fd) = rx.recv().await.unwrap().unwrap();
        assert_eq!(m, export);
        let fd = fd.expect("fd attached");
        assert_ne!(fd.as_raw_fd(), owned.as_raw_fd());
        assert_eq!(inode(&fd), inode(&owned));
        // A big frame (larger than one 64 KiB read) is reassembled.
        let big = Message::MetadataPutRequest {
            key: "k".into(),
            allocation_id: "a".into(),
            offset_bytes: 0,
            value: vec![7; 300_000],
        };
        let sender = tokio::spawn(async move {
            tx.send(&big, None).await.unwrap();
            tx
        });
        let (m, _) = rx.recv().await.unwrap().unwrap();
        assert!(
            matches!(m, Message::MetadataPutRequest { ref value, .. } if value.len() == 300_000)
        );
        // Clean close at a frame boundary reads as None.
        drop(sender.await.unwrap());
        assert!(rx.recv().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn close_mid_frame_is_an_error() {
        let (a, b) = UnixStream::pair().unwrap();
        let (tx, mut rx) = (FramedStream::new(a), FramedStream::new(b));
        tx.send_frame(&[0, 0, 0, 9, 0x80], None).await.unwrap();
        drop(tx);
        assert!(matches!(rx.recv().await, Err(WireError::Closed)));
    }

    #[test]
    fn fds_of_a_truncated_control_message_are_owned_not_leaked() {
        use nix::sys::socket::{
            sendmsg, socketpair, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType,
        };
        let (a, b) = socketpair(
            AddressFamily::Unix,
            SockType::Stream,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .unwrap();
        let file = OwnedFd::from(tempfile::tempfile().unwrap());
        // Far more fds than raw_recv's control buffer holds: the kernel truncates (MSG_CTRUNC).
        let many = vec![file.as_raw_fd(); 64];
        let sent = sendmsg::<()>(
            a.as_raw_fd(),
            &[io::IoSlice::new(b"x")],
            &[ControlMessage::ScmRights(&many)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        assert_eq!(sent, 1);
        let mut buf = [0u8; 16];
        let (n, fds) = raw_recv(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!(n, 1);
        assert!(!fds.is_empty(), "the fds that fit are handed back");
        assert!(fds.len() < many.len(), "the control buffer was truncated");
        for fd in &fds {
            assert_eq!(inode(fd), inode(&file), "each received fd is the sent file");
        }
        // And raw_send's single fd arrives whole.
        assert_eq!(
            raw_send(a.as_raw_fd(), b"y", Some(file.as_raw_fd())).unwrap(),
            1
        );
        let (n, fds) = raw_recv(b.as_raw_fd(), &mut buf).unwrap();
        assert_eq!((n, fds.len()), (1, 1));
        assert_eq!(inode(&fds[0]), inode(&file));
    }
}
