//! Large files written and read past the page cache (DESIGN.md §7): checkpoints of tens of
//! gigabytes are written ([`FileOut`]) and read ([`FileIn`]) with `O_DIRECT` where the file
//! system takes it, through aligned buffers that a writer (reader) thread empties (fills) while
//! the caller fills (empties) the next ones, and buffered where it does not (tmpfs, say).
//!
//! Measured on the H200 machine's disk: 16 GiB written buffered and fsynced at 1.13 GB/s, with
//! `O_DIRECT` at 2.26 GB/s (BENCHMARKS.md, "Saving a checkpoint past the page cache"); and a
//! buffered save of a large model fills the page cache with dirty pages beside a run that holds
//! most of the host's memory. Reads: 1.9 GB/s either way (`dd` of 64 MiB blocks), but a resume's
//! small synchronous reads, each decoded before the next was asked for, reached about half of
//! that; [`FileIn::read_ranges`] asks for several pieces at once and converts them on the threads
//! that read them.

use std::fs::File;
use std::io::{self, Write};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

/// The alignment `O_DIRECT` asks of buffers, file offsets and lengths: the largest logical block
/// size of common devices.
const ALIGN: usize = 4096;

/// Bytes per buffer.
pub const BUFFER_BYTES: usize = 16 << 20;

/// Buffers of a direct write: one filled while the others wait for the writer or are written, so
/// that a piece of a checkpoint can be fetched while the last one is still being written.
pub const BUFFERS: usize = 5;

/// A buffer whose start is [`ALIGN`]-aligned: `capacity` bytes of `bytes` from `start`, the
/// first aligned byte (one block more is allocated than the buffer holds).
struct Buffer {
    bytes: Vec<u8>,
    start: usize,
    capacity: usize,
    len: usize,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer({} bytes)", self.capacity())
    }
}

impl Buffer {
    fn new(bytes: usize) -> Self {
        let capacity = bytes.div_ceil(ALIGN) * ALIGN;
        let bytes = vec![0u8; capacity + ALIGN];
        let start = bytes.as_ptr().align_offset(ALIGN);
        assert!(start < ALIGN, "a byte buffer's start can be aligned");
        Buffer { bytes, start, capacity, len: 0 }
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes[self.start..self.start + self.capacity]
    }

    fn filled(&mut self) -> &[u8] {
        let len = self.len;
        &self.bytes_mut()[..len]
    }
}

/// How a [`FileOut`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `O_DIRECT`, through aligned buffers and a writer thread.
    Direct,
    /// Through the page cache.
    Buffered,
}

/// A file being written a piece at a time ([`FileOut::create`]); [`FileOut::finish`] fsyncs it.
pub struct FileOut {
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

impl std::fmt::Debug for FileOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileOut").field("mode", &self.mode).field("sent", &self.sent).finish()
    }
}

impl FileOut {
    /// Creates (or truncates) `path` for a file of about `len` bytes (the buffers' size: a small
    /// file gets small ones), bypassing the page cache where `direct` and the file system allow
    /// it, else buffered.
    pub fn create(path: &Path, direct: bool, len: u64) -> io::Result<FileOut> {
        let buffer_bytes = usize::try_from(len).unwrap_or(usize::MAX).clamp(ALIGN, BUFFER_BYTES);
        let mut write = std::fs::OpenOptions::new();
        write.write(true).create(true).truncate(true);
        if direct && let Some(file) = open_direct(&mut write, path)? {
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

    /// How the file is written.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Appends `bytes`.
    pub fn write_all(&mut self, mut bytes: &[u8]) -> io::Result<()> {
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
    pub fn finish(mut self) -> io::Result<()> {
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

/// `path` opened as `options` say, with `O_DIRECT`, or `None` where the file system does not
/// take it (the file is then left to be opened buffered).
#[cfg(target_os = "linux")]
fn open_direct(options: &mut std::fs::OpenOptions, path: &Path) -> io::Result<Option<File>> {
    use std::os::unix::fs::OpenOptionsExt;
    match options.custom_flags(libc::O_DIRECT).open(path) {
        Ok(file) => Ok(Some(file)),
        Err(error) if error.raw_os_error() == Some(libc::EINVAL) => Ok(None),
        Err(error) => Err(error),
    }
}

#[cfg(not(target_os = "linux"))]
fn open_direct(_options: &mut std::fs::OpenOptions, _path: &Path) -> io::Result<Option<File>> {
    Ok(None)
}

/// The bytes [`FileIn::read_ranges`] reads at a time.
pub const READ_BUFFER_BYTES: usize = 16 << 20;

/// Reader threads of a read over several pieces: each reads a piece at a time and hands it to
/// the caller's function on its own thread, so that this many pieces are asked of the disk at
/// once (one 16 MiB request at a time reached about 1.2 GB/s of the H200 machine's disk, which
/// gives 1.9 with 64 MiB in flight) and converted at once (one thread converting every piece,
/// with the H200 host's 7 GB/s of one core's memory bandwidth, read about 1.1 GB/s).
pub const READERS: usize = 4;

/// The host memory one [`FileIn::read_ranges`] holds at most: a buffer per reader, each a block
/// larger on both sides (a piece that starts or ends inside a block reads all of it).
pub const READ_BUFFERS_BYTES: usize = READERS * (READ_BUFFER_BYTES + 2 * ALIGN);

/// A file being read a range at a time ([`FileIn::read_ranges`]): with `O_DIRECT` where the
/// file system takes it (a second descriptor beside the buffered one, which serves the rest:
/// headers, small reads, and every read after the file system refused a direct one).
#[derive(Debug)]
pub struct FileIn {
    file: File,
    direct: Option<File>,
    /// Cleared where a direct read was refused (`EINVAL`: an alignment the file system asks
    /// beyond [`ALIGN`]); the reads are then buffered.
    direct_works: AtomicBool,
    /// The readers' buffers of the last read, kept for the next while the file is open: a
    /// checkpoint's part is read a piece at a time (a device share's restore, 64 MiB a call),
    /// and making and zeroing fresh buffers for each call took half the time of the reading.
    spare: std::sync::Mutex<Vec<Buffer>>,
}

/// A piece of a read: which of its ranges, its number in that range, and its bytes.
type Piece = (usize, usize, Range<u64>);

impl FileIn {
    /// Opens `path` for reading, past the page cache where `direct` and the file system allow it.
    pub fn open(path: &Path, direct: bool) -> io::Result<FileIn> {
        let file = File::open(path)?;
        let direct = match direct {
            true => open_direct(std::fs::OpenOptions::new().read(true), path)?,
            false => None,
        };
        let spare = std::sync::Mutex::new(Vec::new());
        Ok(FileIn { file, direct, direct_works: AtomicBool::new(true), spare })
    }

    /// The file, buffered.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// How the file's large ranges are read.
    pub fn mode(&self) -> Mode {
        match (&self.direct, self.direct_works.load(Ordering::Relaxed)) {
            (Some(_), true) => Mode::Direct,
            _ => Mode::Buffered,
        }
    }

    /// The bytes of `ranges` (each with its unit: a power of two that divides
    /// [`READ_BUFFER_BYTES`], and of which the range is whole units), read in pieces of at most
    /// [`READ_BUFFER_BYTES`], whole units each, the `k`th piece of a range starting `k` pieces
    /// into it. Each piece is handed to `each(range, k, bytes)` on the thread that read it:
    /// [`READERS`] threads read and hand on pieces at once, in no set order (a range of one piece
    /// is read on the caller's thread). The first error, of a read (a range past the end of the
    /// file is `UnexpectedEof`) or of `each`, stops the reading and is returned.
    pub fn read_ranges(
        &self,
        ranges: &[(Range<u64>, usize)],
        each: impl Fn(usize, usize, &[u8]) -> io::Result<()> + Sync,
    ) -> io::Result<()> {
        self.read_in_pieces(ranges, READ_BUFFER_BYTES, each)
    }

    /// [`FileIn::read_ranges`] with pieces of at most `piece` bytes (tests use small ones).
    fn read_in_pieces(
        &self,
        ranges: &[(Range<u64>, usize)],
        piece: usize,
        each: impl Fn(usize, usize, &[u8]) -> io::Result<()> + Sync,
    ) -> io::Result<()> {
        let mut pieces: Vec<Piece> = Vec::new();
        for (which, (range, unit)) in ranges.iter().enumerate() {
            assert!(
                unit.is_power_of_two() && piece.is_multiple_of(*unit),
                "read_ranges: a unit of {unit} bytes does not divide pieces of {piece}"
            );
            assert!(
                range.start <= range.end && (range.end - range.start).is_multiple_of(*unit as u64),
                "read_ranges: {range:?} is not whole units of {unit} bytes"
            );
            let starts = (range.start..range.end).step_by(piece).enumerate();
            pieces.extend(starts.map(|(k, at)| (which, k, at..(at + piece as u64).min(range.end))));
        }
        // Buffers no larger than the largest piece: a small file's reads allocate little.
        let largest = pieces.iter().map(|(.., p)| (p.end - p.start) as usize).max();
        let capacity = largest.unwrap_or(0) + 2 * ALIGN;
        // A spare buffer from an earlier read where one is large enough, else a new one; given
        // back for the next read once this one is done.
        let take = || {
            let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
            let fits = spare.iter().position(|buffer| buffer.capacity() >= capacity);
            fits.map(|at| spare.swap_remove(at)).unwrap_or_else(|| Buffer::new(capacity))
        };
        let give_back = |buffer: Buffer| {
            let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
            if spare.len() < READERS {
                spare.push(buffer);
            }
        };
        if let [(which, k, only)] = pieces.as_slice() {
            let mut buffer = take();
            let at = self.read_piece(only.clone(), &mut buffer)?;
            let done = each(*which, *k, &buffer.filled()[at..]);
            give_back(buffer);
            return done;
        }
        // The readers take the pieces in the file's order, so that the disk is asked for a run
        // of neighbouring pieces at once.
        let next = AtomicUsize::new(0);
        let failed = std::sync::Mutex::new(None::<io::Error>);
        let read = |buffer: &mut Buffer| loop {
            let index = next.fetch_add(1, Ordering::Relaxed);
            if index >= pieces.len() {
                return;
            }
            let (which, k, range) = &pieces[index];
            let done = self.read_piece(range.clone(), buffer).and_then(|at| {
                let bytes = &buffer.filled()[at..];
                each(*which, *k, bytes)
            });
            if let Err(error) = done {
                // No further piece is taken.
                next.store(pieces.len(), Ordering::Relaxed);
                failed.lock().expect("no reader panics holding it").get_or_insert(error);
                return;
            }
        };
        let read_with_a_buffer = || {
            let mut buffer = take();
            read(&mut buffer);
            give_back(buffer);
        };
        std::thread::scope(|scope| -> io::Result<()> {
            for _ in 1..READERS.min(pieces.len()) {
                let reader = std::thread::Builder::new().name("checkpoint-reader".into());
                reader.spawn_scoped(scope, read_with_a_buffer)?;
            }
            // The caller's thread is a reader too.
            read_with_a_buffer();
            Ok(())
        })?;
        match failed.into_inner().expect("no reader panics holding it") {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    /// Reads `piece` into `buffer`: with `O_DIRECT`, the whole blocks that hold it. Gives where
    /// in the buffer's filled bytes the piece starts (they end where it ends).
    fn read_piece(&self, piece: Range<u64>, buffer: &mut Buffer) -> io::Result<usize> {
        let len = (piece.end - piece.start) as usize;
        if let Some(direct) = &self.direct
            && self.direct_works.load(Ordering::Relaxed)
        {
            let align = ALIGN as u64;
            let start = piece.start / align * align;
            let end = piece.end.next_multiple_of(align);
            let at = (piece.start - start) as usize;
            let bytes = &mut buffer.bytes_mut()[..(end - start) as usize];
            match read_until_end(direct, bytes, start) {
                Ok(read) if read >= at + len => {
                    buffer.len = at + len;
                    return Ok(at);
                }
                Ok(_) => return Err(past_end(&piece)),
                Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                    self.direct_works.store(false, Ordering::Relaxed);
                }
                Err(error) => return Err(error),
            }
        }
        let bytes = &mut buffer.bytes_mut()[..len];
        match self.file.read_exact_at(bytes, piece.start) {
            Ok(()) => {
                buffer.len = len;
                Ok(0)
            }
            Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => Err(past_end(&piece)),
            Err(error) => Err(error),
        }
    }
}

/// Reads into `bytes` from `offset` until they are full or the file ends: how many were read.
fn read_until_end(file: &File, bytes: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut read = 0;
    while read < bytes.len() {
        match file.read_at(&mut bytes[read..], offset + read as u64) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(read)
}

fn past_end(piece: &Range<u64>) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("bytes {}..{} are past the end of the file", piece.start, piece.end),
    )
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

    /// A file of `bytes` in a temporary directory, and its path.
    fn file_of(bytes: &[u8]) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("in.bin");
        std::fs::write(&path, bytes).unwrap();
        (dir, path)
    }

    /// The bytes of `ranges` read in pieces of `piece` bytes (each checked to be whole units of
    /// its range, and no longer than a piece), put back in order: one vector per range.
    fn read_back(
        file: &FileIn,
        ranges: &[(Range<u64>, usize)],
        piece: usize,
    ) -> io::Result<Vec<Vec<u8>>> {
        let got = std::sync::Mutex::new(std::collections::BTreeMap::new());
        file.read_in_pieces(ranges, piece, |which, k, bytes| {
            let unit = ranges[which].1;
            assert!(bytes.len() <= piece && bytes.len().is_multiple_of(unit), "{}", bytes.len());
            let fresh = got.lock().unwrap().insert((which, k), bytes.to_vec()).is_none();
            assert!(fresh, "piece {k} of range {which} handed on twice");
            Ok(())
        })?;
        let mut back = vec![Vec::new(); ranges.len()];
        for ((which, k), bytes) in got.into_inner().unwrap() {
            let at = k * piece;
            assert_eq!(back[which].len(), at, "range {which}: a piece missing before piece {k}");
            back[which].extend(bytes);
        }
        Ok(back)
    }

    /// Bytes `range`, read as [`read_back`] does.
    fn read_all(
        file: &FileIn,
        range: Range<u64>,
        unit: usize,
        piece: usize,
    ) -> io::Result<Vec<u8>> {
        Ok(read_back(file, &[(range, unit)], piece)?.remove(0))
    }

    /// Any range, starting and ending inside blocks or on their edges, one piece or many (read
    /// ahead by the reader threads), of any unit, reads back exactly the file's bytes, direct
    /// (where the file system takes it) and buffered.
    #[test]
    fn a_range_reads_back_exactly_in_either_mode() {
        let piece = 3 * ALIGN + 16;
        let len = 4 * piece + 5_000;
        let bytes = pattern(len);
        let (_dir, path) = file_of(&bytes);
        for direct in [true, false] {
            let file = FileIn::open(&path, direct).unwrap();
            match (direct, file.mode()) {
                (false, mode) => assert_eq!(mode, Mode::Buffered),
                (true, Mode::Buffered) => eprintln!(
                    "note: the temporary directory's file system does not take O_DIRECT: the \
                     direct path is not exercised here"
                ),
                (true, Mode::Direct) => {}
            }
            let ranges = [
                (0, 0, 1),
                (0, len, 1),
                (0, len, 4),
                (1, len - 3, 4),
                (ALIGN, ALIGN + piece, 2),
                (7, 7 + piece, 4),
                (3, 3 + 2 * piece + 8, 8),
                (len - 6, len, 2),
                (ALIGN - 2, ALIGN + 2, 4),
            ];
            for (start, end, unit) in ranges {
                let back = read_all(&file, start as u64..end as u64, unit, piece).unwrap();
                assert!(back == bytes[start..end], "direct {direct}, {start}..{end}: differs");
            }
            // Several ranges at once, in the order given (not the file's), small and large:
            // each piece is told its range.
            let several = [(piece + 6, 3 * piece + 2, 2), (0, 8, 4), (5, 5, 1), (2, len, 2)];
            let ranges: Vec<(Range<u64>, usize)> =
                several.iter().map(|&(a, b, unit)| (a as u64..b as u64, unit)).collect();
            let back = read_back(&file, &ranges, piece).unwrap();
            for (&(start, end, _), back) in several.iter().zip(&back) {
                assert!(*back == bytes[start..end], "direct {direct}, {start}..{end}: differs");
            }
            // The default pieces, over a range of several.
            let big = pattern(2 * READ_BUFFER_BYTES + 4_100);
            let (_dir, big_path) = file_of(&big);
            let file = FileIn::open(&big_path, direct).unwrap();
            let back = read_all(&file, 6..big.len() as u64 - 2, 2, READ_BUFFER_BYTES).unwrap();
            assert!(back == big[6..big.len() - 2], "direct {direct}: the large range differs");
            // Its readers' buffers are kept for the next read of the file (the reads above ran
            // on kept buffers holding earlier bytes): one for each reader that held one at once,
            // up to the three pieces' three readers (a reader that starts after another is done
            // takes the buffer it gave back).
            let kept = file.spare.lock().unwrap().len();
            assert!((1..=READERS.min(3)).contains(&kept), "direct {direct}: {kept} kept");
        }
    }

    /// A range that runs past the end of the file is an `UnexpectedEof` error, in one piece or
    /// many, and so is the caller's own error: each stops the reading (no hang, no panic; no
    /// piece taken after it).
    #[test]
    fn a_range_past_the_end_or_a_callers_error_stops_the_reading() {
        let piece = 2 * ALIGN;
        let pieces = 16 * READERS;
        let len = pieces * piece + 100;
        let (_dir, path) = file_of(&pattern(len));
        for direct in [true, false] {
            let file = FileIn::open(&path, direct).unwrap();
            for start in [len - 10, 0] {
                let error = read_all(&file, start as u64..len as u64 + 10, 1, piece).unwrap_err();
                assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof, "direct {direct}: {error}");
            }
            let calls = AtomicUsize::new(0);
            let error = file
                .read_in_pieces(&[(0..len as u64, 1)], piece, |_, _, _| {
                    match calls.fetch_add(1, Ordering::Relaxed) {
                        1 => Err(io::Error::other("the caller's")),
                        _ => Ok(()),
                    }
                })
                .unwrap_err();
            assert_eq!(error.to_string(), "the caller's");
            // The pieces the other readers had taken when it failed, at most.
            let calls = calls.into_inner();
            let all = len.div_ceil(piece);
            assert!(calls <= 2 + READERS, "direct {direct}: {calls} of {all} pieces handed on");
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
