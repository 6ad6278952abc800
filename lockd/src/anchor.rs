//! Anchors and the descriptors that carry them, for both drivers (the file backend's
//! `server.rs` and the etcd backend's `etcd/server.rs`): reading a Unix socket with the
//! descriptors sent along (SCM_RIGHTS), telling what an anchor descriptor is, and waiting
//! until it closes.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use tracing::warn;

/// Most descriptors one read takes (the kernel's SCM_MAX_FD is 253), so that the control
/// buffer is never truncated. A truncated one (MSG_CTRUNC) cannot be walked with nix, and the
/// descriptors the kernel did install in it would leak; these are all owned, and the drivers
/// close those past [`MAX_PENDING_FDS`].
pub(crate) const MAX_FDS_PER_READ: usize = 253;

/// Descriptors received on one connection and not yet claimed by an `anchor` request.
pub(crate) const MAX_PENDING_FDS: usize = 4;

/// One non-blocking `recvmsg` on `fd`: bytes into `buf`, the descriptors sent along
/// (SCM_RIGHTS, received close-on-exec) appended to `fds`, owned.
pub(crate) fn recv_with_fds(
    fd: RawFd,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> std::io::Result<usize> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut cmsg = nix::cmsg_space!([RawFd; MAX_FDS_PER_READ]);
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let msg = recvmsg::<()>(
        fd,
        &mut iov,
        Some(&mut cmsg),
        MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
    )
    .map_err(std::io::Error::from)?;
    if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
        warn!("more descriptors than one read takes; the excess was dropped");
    }
    if let Ok(cmsgs) = msg.cmsgs() {
        for c in cmsgs {
            if let ControlMessageOwned::ScmRights(v) = c {
                // SAFETY: the kernel just installed these descriptors in this process for
                // us; nobody else owns them.
                fds.extend(v.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
            }
        }
    }
    Ok(msg.bytes)
}

/// What an anchor descriptor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AnchorKind {
    /// One end of a stream socket pair: closed at end-of-file, when every process holding the
    /// other end has closed it or died.
    Socket,
    /// A pidfd: closed when that process has exited. The kernel reports it only after the
    /// process released its files (GPU device files included), so no window is left.
    Process,
}

/// Check that `fd` can be an anchor: a stream (or seqpacket) socket, or a pidfd.
pub(crate) fn check_anchor(fd: &OwnedFd) -> Result<AnchorKind, String> {
    use nix::sys::socket::{getsockopt, sockopt, SockType};
    match getsockopt(fd, sockopt::SockType) {
        Ok(SockType::Stream) | Ok(SockType::SeqPacket) => Ok(AnchorKind::Socket),
        Ok(t) => Err(format!(
            "the descriptor is a {t:?} socket, not a stream socket"
        )),
        Err(e) => {
            let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            if link == "anon_inode:[pidfd]" {
                Ok(AnchorKind::Process)
            } else {
                Err(format!("the descriptor is not a socket ({e}) nor a pidfd"))
            }
        }
    }
}

/// Wait until the anchor closes (see [`AnchorKind`]); why it ended. Data written into a
/// socket anchor is read and dropped.
pub(crate) async fn closed(kind: AnchorKind, fd: OwnedFd) -> String {
    use nix::sys::socket::{recv, MsgFlags};
    // SAFETY: `fd` is an OwnedFd moved into the AsyncFd, which owns it until dropped.
    let afd = match unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE)
    } {
        Ok(a) => a,
        Err(e) => return format!("cannot watch it: {e}"),
    };
    let mut sink = [0u8; 512];
    loop {
        let mut guard = match afd.readable().await {
            Ok(g) => g,
            Err(e) => return format!("watch failed: {e}"),
        };
        if kind == AnchorKind::Process {
            // Readable = exited (the readiness may be spurious: ask poll).
            use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
            let mut p = [PollFd::new(
                std::os::fd::AsFd::as_fd(afd.get_ref()),
                PollFlags::POLLIN,
            )];
            if matches!(poll(&mut p, PollTimeout::ZERO), Ok(n) if n > 0) {
                return "process exited".into();
            }
            guard.clear_ready();
            continue;
        }
        match recv(afd.get_ref().as_raw_fd(), &mut sink, MsgFlags::MSG_DONTWAIT) {
            Ok(0) => return "eof".into(),
            Ok(_) => continue,
            Err(nix::errno::Errno::EAGAIN) => guard.clear_ready(),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return format!("read failed: {e}"),
        }
    }
}
