//! A large file written past the page cache (DESIGN.md §7): checkpoints of tens of gigabytes
//! are written with `O_DIRECT` where the file system takes it, from aligned buffers that a writer
//! thread empties while the next ones are filled, and buffered where it does not (tmpfs, say).
//!
//! Measured on the H200 machine's disk: 16 GiB written buffered and fsynced at 1.13 GB/s, with
//! `O_DIRECT` at 2.26 GB/s (BENCHMARKS.md, "Saving a checkpoint past the page cache"); and a
//! buffered save of a large model fills the page cache with dirty pages beside a run that holds
//! most of the host's memory.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

/// The alignment `O_DIRECT` asks of buffers, file offsets and lengths: the largest logical block
/// size of common devices.
const ALIGN: usize = 4096;

/// Bytes per buffer.
pub(crate) const BUFFER_BYTES: usize = 16 << 20;

/// Buffers of a direct write: one filled while the others wait for the writer or are written, so
/// that a piece of a checkpoint ([`crate::checkpoint::WRITE_CHUNK_BYTES`]) can be fetched while
/// the last one is still being written.
pub(crate) const BUFFERS: usize = 5;

/// One aligned block of a buffer.
#[repr(C, align(4096))]
#[derive(Clone, Copy)]
struct Block([u8; ALIGN]);

/// A buffer whose start is [`ALIGN`]-aligned.
struct Buffer {
    blocks: Vec<Block>,
    len: usize,
}

impl Buffer {
    fn new(bytes: usize) -> Self {
        Buffer { blocks: vec![Block([0; ALIGN]); bytes.div_ceil(ALIGN)], len: 0 }
    }

    fn capacity(&self) -> usize {
        self.blocks.len() * ALIGN
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let capacity = self.capacity();
        // SAFETY: `blocks` is `capacity` initialised bytes (`Block` is a byte array, no padding),
        // borrowed mutably for the slice's life.
        unsafe { std::slice::from_raw_parts_mut(self.blocks.as_mut_ptr().cast::<u8>(), capacity) }
    }

    fn filled(&mut self) -> &[u8] {
        let len = self.len;
        &self.bytes_mut()[..len]
    }
}

/// How a [`FileOut`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// `O_DIRECT`, through aligned buffers and a writer thread.
    Direct,
    /// Through the page cache.
    Buffered,
}

/// A file being written a piece at a time ([`FileOut::create`]); [`FileOut::finish`] fsyncs it.
pub(crate) struct FileOut {
    mode: Mode,
    /// The buffer being filled.
    current: Buffer,
    /// Bytes handed to the writer (or the file) so far, a multiple of [`ALIGN`] in `Direct`.
    sent: u64,
    /// `Direct`: full buffers to the writer thread, and empty ones back.
    to_writer: Option<SyncSender<Buffer>>,
    empties: Option<Receiver<Buffer>>,
    writer: Option<JoinHandle<io::Result<File>>>,
    /// `Buffered`: the file itself.
    file: Option<File>,
}

impl FileOut {
    /// Creates (or truncates) `path` for a file of about `len` bytes (the buffers' size: a small
    /// file gets small ones), bypassing the page cache where `direct` and the file system allow
    /// it, else buffered.
    pub(crate) fn create(path: &Path, direct: bool, len: u64) -> io::Result<FileOut> {
        let buffer_bytes = usize::try_from(len).unwrap_or(usize::MAX).clamp(ALIGN, BUFFER_BYTES);
        if direct && let Some(file) = open_direct(path)? {
            let (to_writer, from_filler) = sync_channel::<Buffer>(BUFFERS - 1);
            let (to_filler, empties) = sync_channel::<Buffer>(BUFFERS);
            for _ in 1..BUFFERS {
                to_filler.send(Buffer::new(buffer_bytes)).expect("the receiver is here");
            }
            let writer = std::thread::Builder::new()
                .name("checkpoint-writer".into())
                .spawn(move || write_buffers(file, &from_filler, &to_filler))?;
            return Ok(FileOut {
                mode: Mode::Direct,
                current: Buffer::new(buffer_bytes),
                sent: 0,
                to_writer: Some(to_writer),
                empties: Some(empties),
                writer: Some(writer),
                file: None,
            });
        }
        let file = File::create(path)?;
        let current = Buffer::new(buffer_bytes.min(1 << 20));
        Ok(FileOut {
            mode: Mode::Buffered,
            current,
            sent: 0,
            to_writer: None,
            empties: None,
            writer: None,
            file: Some(file),
        })
    }

    #[cfg(test)]
    fn mode(&self) -> Mode {
        self.mode
    }

    /// Appends `bytes`.
    pub(crate) fn write_all(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            let room = self.current.capacity() - self.current.len;
            let n = room.min(bytes.len());
            let at = self.current.len;
            self.current.bytes_mut()[at..at + n].copy_from_slice(&bytes[..n]);
            self.current.len += n;
            bytes = &bytes[n..];
            if self.current.len == self.current.capacity() {
                self.send()?;
            }
        }
        Ok(())
    }

    /// Hands the current buffer on: to the writer thread (taking an empty one back), or to the
    /// file.
    fn send(&mut self) -> io::Result<()> {
        self.sent += self.current.len as u64;
        match self.mode {
            Mode::Buffered => {
                let file = self.file.as_mut().expect("a buffered file");
                file.write_all(self.current.filled())?;
                self.current.len = 0;
                Ok(())
            }
            Mode::Direct => {
                let empty = match self.empties.as_ref().expect("direct").recv() {
                    Ok(empty) => empty,
                    // The writer stopped: its error says why.
                    Err(_) => return Err(self.writer_error()),
                };
                let full = std::mem::replace(&mut self.current, empty);
                let sender = self.to_writer.as_ref().expect("direct");
                if sender.send(full).is_err() {
                    return Err(self.writer_error());
                }
                Ok(())
            }
        }
    }

    /// The error the writer thread stopped with.
    fn writer_error(&mut self) -> io::Error {
        self.to_writer = None;
        match self.writer.take().map(JoinHandle::join) {
            Some(Ok(Err(error))) => error,
            Some(Err(_)) => io::Error::other("the checkpoint writer thread panicked"),
            _ => io::Error::other("the checkpoint writer thread stopped"),
        }
    }

    /// Writes what is left, fsyncs the file and closes it. `Direct`: the last buffer is padded
    /// to a whole block, and the file cut back to its length.
    pub(crate) fn finish(mut self) -> io::Result<()> {
        match self.mode {
            Mode::Buffered => {
                let file = self.file.as_mut().expect("a buffered file");
                file.write_all(self.current.filled())?;
                file.sync_all()
            }
            Mode::Direct => {
                let len = self.sent + self.current.len as u64;
                let padded = self.current.len.next_multiple_of(ALIGN);
                let at = self.current.len;
                self.current.bytes_mut()[at..padded].fill(0);
                self.current.len = padded;
                if padded > 0 {
                    self.send()?;
                }
                self.to_writer = None;
                let file = match self.writer.take().map(JoinHandle::join) {
                    Some(Ok(result)) => result?,
                    _ => return Err(io::Error::other("the checkpoint writer thread panicked")),
                };
                file.set_len(len)?;
                file.sync_all()
            }
        }
    }
}

impl Drop for FileOut {
    fn drop(&mut self) {
        // A write abandoned on an error: stop the writer thread.
        self.to_writer = None;
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

/// The writer thread: writes each full buffer it receives, in order, and hands it back empty.
fn write_buffers(
    mut file: File,
    full: &Receiver<Buffer>,
    empties: &SyncSender<Buffer>,
) -> io::Result<File> {
    for mut buffer in full {
        file.write_all(buffer.filled())?;
        buffer.len = 0;
        // The filler may have finished (its last buffer needs no empty one back).
        let _ = empties.send(buffer);
    }
    Ok(file)
}

/// `path` created (or truncated) for writing with `O_DIRECT`, or `None` where the file system
/// does not take it (the file is then left to be created buffered).
#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> io::Result<Option<File>> {
    use std::os::unix::fs::OpenOptionsExt;
    let opened = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path);
    match opened {
        Ok(file) => Ok(Some(file)),
        Err(error) if error.raw_os_error() == Some(libc::EINVAL) => Ok(None),
        Err(error) => Err(error),
    }
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_path: &Path) -> io::Result<Option<File>> {
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes `0..len` of a pattern no two nearby blocks share.
    fn pattern(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect()
    }

    /// Whatever the lengths of the pieces (none a whole block, some larger than a buffer), the
    /// file holds exactly the bytes written, direct (where the file system takes it) and
    /// buffered; written again, it is cut to the new length.
    #[test]
    fn a_file_holds_exactly_the_bytes_written_in_either_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.bin");
        for direct in [true, false] {
            for total in [0, 1, 4095, 4097, BUFFER_BYTES, 2 * BUFFER_BYTES + 12_345] {
                let bytes = pattern(total);
                // Told the length, or a smaller one (the buffers then smaller than the file).
                let mut out = FileOut::create(&path, direct, total as u64 / 2).unwrap();
                match (direct, out.mode()) {
                    (false, mode) => assert_eq!(mode, Mode::Buffered),
                    (true, Mode::Buffered) if total == 0 => eprintln!(
                        "note: the temporary directory's file system does not take O_DIRECT: \
                         the direct path is not exercised here"
                    ),
                    _ => {}
                }
                let mut at = 0;
                for (i, piece) in [8, 1000, 3 << 20, BUFFER_BYTES + 7].iter().cycle().enumerate() {
                    if at == total || i > 1000 {
                        break;
                    }
                    let end = (at + piece).min(total);
                    out.write_all(&bytes[at..end]).unwrap();
                    at = end;
                }
                out.finish().unwrap();
                let back = std::fs::read(&path).unwrap();
                assert!(back == bytes, "direct {direct}, {total} bytes: the file differs");
            }
        }
    }

    /// A write that fails (here: the file system refuses the file) is an error, not a panic or a
    /// hang.
    #[test]
    fn a_file_that_cannot_be_made_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("missing").join("out.bin");
        for direct in [true, false] {
            assert!(FileOut::create(&path, direct, 100).is_err(), "direct {direct}");
        }
    }
}
