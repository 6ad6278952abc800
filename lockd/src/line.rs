//! Bounded line splitting for the line-delimited protocol (both ends).

/// Room offered to the first read into an empty [`LineBuf`] (requests are ~100 bytes).
pub const MIN_READ: usize = 512;

/// Largest buffer an empty [`LineBuf`] keeps; a larger one is freed once empty. Zero: a
/// connection between requests holds no buffer at all (one small allocation per read
/// instead, cheap next to the read itself).
pub const KEEP: usize = 0;

/// A line exceeded the bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("line longer than {max} bytes")]
pub struct TooLong {
    /// The bound.
    pub max: usize,
}

/// Accumulates bytes read from a socket and yields complete lines (without `\n`).
///
/// Memory stays bounded: a partial line longer than `max` is reported as [`TooLong`] as
/// soon as it is seen, without waiting for its end.
///
/// Memory also follows use: a new `LineBuf` allocates nothing, [`LineBuf::read_with`]
/// reads straight into it, growing it by doubling (from [`MIN_READ`] bytes) only while a
/// line is longer than what it holds, and once every buffered line has been taken, a
/// buffer grown past [`KEEP`] bytes is freed. An idle connection costs at most `KEEP` bytes,
/// not a fixed read buffer.
#[derive(Debug)]
pub struct LineBuf {
    /// Bytes received and not yet returned as lines.
    buf: Vec<u8>,
    /// Longest accepted line, newline excluded.
    max: usize,
    /// How far `buf` has been scanned for `\n` (avoids rescanning on every read).
    scanned: usize,
}

impl LineBuf {
    /// A splitter for lines of at most `max` bytes.
    pub fn new(max: usize) -> LineBuf {
        LineBuf {
            buf: Vec::new(),
            max,
            scanned: 0,
        }
    }

    /// Append bytes read from the peer.
    pub fn push(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// Bytes buffered (partial line included).
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Bytes allocated for the buffer (what it costs in memory now).
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Read from the peer straight into the buffer: `read` is given room for at least one
    /// byte (at least [`MIN_READ`], or as much as is buffered already, so that a long line
    /// takes O(log n) reads; never more than a line of `max` bytes and its newline need) and
    /// returns how many bytes it wrote there (its errors, `WouldBlock` included, are passed
    /// through with nothing buffered). Call [`LineBuf::next_line`] until `None` before the
    /// next read.
    pub fn read_with(
        &mut self,
        read: impl FnOnce(&mut [u8]) -> std::io::Result<usize>,
    ) -> std::io::Result<usize> {
        let old = self.buf.len();
        // A partial line is at most `max` bytes (longer ones were reported), so there is
        // always room for one more byte within `max + 1`.
        let room = old
            .max(MIN_READ)
            .min((self.max + 1).saturating_sub(old))
            .max(1);
        self.buf.resize(old + room, 0);
        let r = read(&mut self.buf[old..]);
        let n = match &r {
            Ok(n) => (*n).min(room),
            Err(_) => 0,
        };
        self.buf.truncate(old + n);
        if self.buf.is_empty() {
            self.release();
        }
        r
    }

    /// Free a grown buffer once it holds nothing.
    fn release(&mut self) {
        if self.buf.is_empty() && self.buf.capacity() > KEEP {
            self.buf = Vec::new();
        }
    }

    /// The next complete line, `None` when more bytes are needed, or `TooLong` (after which
    /// the buffer is cleared; callers close the connection).
    pub fn next_line(&mut self) -> Option<Result<Vec<u8>, TooLong>> {
        match self.buf[self.scanned..].iter().position(|b| *b == b'\n') {
            Some(i) => {
                let end = self.scanned + i;
                self.scanned = 0;
                if end > self.max {
                    self.buf = Vec::new();
                    return Some(Err(TooLong { max: self.max }));
                }
                let mut line: Vec<u8> = self.buf.drain(..=end).collect();
                self.release();
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                Some(Ok(line))
            }
            None => {
                if self.buf.len() > self.max {
                    self.buf = Vec::new();
                    self.scanned = 0;
                    return Some(Err(TooLong { max: self.max }));
                }
                self.scanned = self.buf.len();
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_across_pushes() {
        let mut lb = LineBuf::new(16);
        lb.push(b"ab");
        assert_eq!(lb.next_line(), None);
        lb.push(b"c\r\nde\nf");
        assert_eq!(lb.next_line(), Some(Ok(b"abc".to_vec())));
        assert_eq!(lb.next_line(), Some(Ok(b"de".to_vec())));
        assert_eq!(lb.next_line(), None);
        lb.push(b"\n");
        assert_eq!(lb.next_line(), Some(Ok(b"f".to_vec())));
    }

    #[test]
    fn too_long_without_newline_is_reported_early() {
        let mut lb = LineBuf::new(4);
        lb.push(b"12345");
        assert_eq!(lb.next_line(), Some(Err(TooLong { max: 4 })));
        assert_eq!(lb.buffered(), 0);
        let mut lb = LineBuf::new(4);
        lb.push(b"1234\n12345\n");
        assert_eq!(lb.next_line(), Some(Ok(b"1234".to_vec())));
        assert_eq!(lb.next_line(), Some(Err(TooLong { max: 4 })));
    }

    /// Feed `data` through `read_with` in reads of whatever room is offered.
    fn feed(lb: &mut LineBuf, mut data: &[u8], lines: &mut Vec<Result<Vec<u8>, TooLong>>) -> usize {
        let mut reads = 0;
        while !data.is_empty() {
            let n = lb
                .read_with(|room| {
                    let n = room.len().min(data.len());
                    room[..n].copy_from_slice(&data[..n]);
                    Ok(n)
                })
                .unwrap();
            data = &data[n..];
            reads += 1;
            while let Some(l) = lb.next_line() {
                lines.push(l);
            }
        }
        reads
    }

    #[test]
    fn starts_empty_grows_for_a_long_line_and_shrinks_back() {
        let mut lb = LineBuf::new(1 << 20);
        assert_eq!(lb.capacity(), 0, "nothing allocated up front");
        let mut lines = Vec::new();
        feed(&mut lb, b"{\"op\":\"ping\"}\n", &mut lines);
        assert_eq!(lines, vec![Ok(b"{\"op\":\"ping\"}".to_vec())]);
        assert_eq!(lb.capacity(), KEEP, "an empty buffer is let go");
        // One 300 KB line: the buffer doubles (O(log n) reads), then is freed.
        let mut big = vec![b'x'; 300_000];
        big.push(b'\n');
        lines.clear();
        let reads = feed(&mut lb, &big, &mut lines);
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0].as_ref().unwrap().len(), 300_000);
        assert!(
            reads <= 12,
            "{reads} reads for 300 KB: growth is not geometric"
        );
        assert_eq!(lb.capacity(), 0, "a grown buffer is freed once empty");
        // A partial line keeps its bytes across reads.
        lines.clear();
        feed(&mut lb, b"ab", &mut lines);
        feed(&mut lb, b"c\n", &mut lines);
        assert_eq!(lines, vec![Ok(b"abc".to_vec())]);
    }

    #[test]
    fn a_huge_line_is_refused_within_the_bound_without_growing_past_it() {
        let mut lb = LineBuf::new(4096);
        let mut lines = Vec::new();
        let mut peak = 0;
        let mut sent = 0;
        // 10 MB without a newline: reported once the bound is passed; never buffered whole.
        while sent < 10_000_000 && lines.is_empty() {
            sent += lb
                .read_with(|room| {
                    room.fill(b'y');
                    Ok(room.len())
                })
                .unwrap();
            peak = peak.max(lb.capacity());
            while let Some(l) = lb.next_line() {
                lines.push(l);
            }
        }
        assert_eq!(lines, vec![Err(TooLong { max: 4096 })]);
        assert!(sent <= 4097, "refused after {sent} bytes");
        assert!(peak <= 2 * 4097, "buffer grew to {peak} bytes");
        assert_eq!(lb.capacity(), 0);
        // Errors (WouldBlock) buffer nothing.
        let e = lb.read_with(|_| Err(std::io::ErrorKind::WouldBlock.into()));
        assert!(e.is_err());
        assert_eq!(lb.buffered(), 0);
    }
}
