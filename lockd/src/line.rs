//! Bounded line splitting for the line-delimited protocol (both ends).

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
            buf: Vec::with_capacity(4096),
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

    /// The next complete line, `None` when more bytes are needed, or `TooLong` (after which
    /// the buffer is cleared; callers close the connection).
    pub fn next_line(&mut self) -> Option<Result<Vec<u8>, TooLong>> {
        match self.buf[self.scanned..].iter().position(|b| *b == b'\n') {
            Some(i) => {
                let end = self.scanned + i;
                self.scanned = 0;
                if end > self.max {
                    self.buf.clear();
                    return Some(Err(TooLong { max: self.max }));
                }
                let mut line: Vec<u8> = self.buf.drain(..=end).collect();
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                Some(Ok(line))
            }
            None => {
                if self.buf.len() > self.max {
                    self.buf.clear();
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
}
