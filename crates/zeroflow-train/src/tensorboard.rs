//! A TensorBoard scalar event file beside `metrics.jsonl`: TFRecords (`u64` length, masked
//! CRC-32C of the length, the data, masked CRC-32C of the data) of `Event` protobufs — the first
//! holds `file_version: "brain.Event:2"`, each later one a `Summary` of `simple_value` scalars at
//! a step — encoded by hand (the few fields TensorBoard reads).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The event file of one process of a run.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<File>,
}

impl EventWriter {
    /// Creates `events.out.tfevents.<unix seconds>.<host>.zeroflow` in `dir`, its version record
    /// first.
    pub fn create(dir: &Path) -> std::io::Result<EventWriter> {
        let now = wall_time();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|h| h.trim().replace(['/', '\\'], "_"))
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "localhost".to_owned());
        let path = dir.join(format!("events.out.tfevents.{}.{host}.zeroflow", now as u64));
        let mut writer = EventWriter { file: BufWriter::new(File::create(&path)?), path };
        let mut event = Vec::new();
        double_field(&mut event, 1, now);
        bytes_field(&mut event, 3, b"brain.Event:2");
        writer.record(&event)?;
        Ok(writer)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the scalars `(tag, value)` of `step` as one event, and flushes it.
    pub fn scalars(&mut self, step: u64, scalars: &[(&str, f64)]) -> std::io::Result<()> {
        let mut summary = Vec::new();
        for &(tag, value) in scalars {
            let mut entry = Vec::new();
            bytes_field(&mut entry, 1, tag.as_bytes());
            key(&mut entry, 2, 5);
            entry.extend_from_slice(&(value as f32).to_le_bytes());
            bytes_field(&mut summary, 1, &entry);
        }
        let mut event = Vec::new();
        double_field(&mut event, 1, wall_time());
        key(&mut event, 2, 0);
        varint(&mut event, step);
        bytes_field(&mut event, 5, &summary);
        self.record(&event)
    }

    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let length = (data.len() as u64).to_le_bytes();
        self.file.write_all(&length)?;
        self.file.write_all(&masked_crc32c(&length).to_le_bytes())?;
        self.file.write_all(data)?;
        self.file.write_all(&masked_crc32c(data).to_le_bytes())?;
        self.file.flush()
    }
}

fn wall_time() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// A protobuf field key: the field number and the wire type (0 varint, 1 fixed64, 2 bytes, 5
/// fixed32).
fn key(out: &mut Vec<u8>, field: u64, wire: u64) {
    varint(out, field << 3 | wire);
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn double_field(out: &mut Vec<u8>, field: u64, value: f64) {
    key(out, field, 1);
    out.extend_from_slice(&value.to_le_bytes());
}

fn bytes_field(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    key(out, field, 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bit by bit: the records are small.
pub fn crc32c(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

/// TFRecord's masked CRC: rotated right by 15 and offset, so that a CRC of CRCs is not trivial.
pub fn masked_crc32c(bytes: &[u8]) -> u32 {
    crc32c(bytes).rotate_right(15).wrapping_add(0xA282_EAD8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 3720's test vectors (B.4) and the standard check value.
    #[test]
    fn crc32c_matches_its_test_vectors() {
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(crc32c(&[0xFFu8; 32]), 0x62A8_AB43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&ascending), 0x46DD_794E);
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    /// An event as read back: its step, its (tag, value) scalars, its file version.
    type Event = (Option<u64>, Vec<(String, f32)>, Option<String>);

    /// A minimal reader of what the writer writes: the records (checking both CRCs) and, per
    /// event, its step and (tag, value) scalars, or its file version.
    fn read_events(path: &Path) -> Vec<Event> {
        let bytes = std::fs::read(path).unwrap();
        let (mut at, mut events) = (0, Vec::new());
        while at < bytes.len() {
            let length = &bytes[at..at + 8];
            let len = u64::from_le_bytes(length.try_into().unwrap()) as usize;
            let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(crc, masked_crc32c(length));
            let data = &bytes[at + 12..at + 12 + len];
            let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc32c(data));
            events.push(decode_event(data));
            at += 16 + len;
        }
        events
    }

    fn read_varint(data: &[u8], at: &mut usize) -> u64 {
        let (mut value, mut shift) = (0, 0);
        loop {
            let byte = data[*at];
            *at += 1;
            value |= u64::from(byte & 0x7F) << shift;
            shift += 7;
            if byte < 0x80 {
                return value;
            }
        }
    }

    /// The fields of a message: (field number, varint or the bytes of fixed and length-delimited).
    fn fields(data: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
        let (mut at, mut out) = (0, Vec::new());
        while at < data.len() {
            let key = read_varint(data, &mut at);
            let (field, wire) = (key >> 3, key & 7);
            let (value, bytes) = match wire {
                0 => (read_varint(data, &mut at), Vec::new()),
                1 | 5 => {
                    let n = if wire == 1 { 8 } else { 4 };
                    at += n;
                    (0, data[at - n..at].to_vec())
                }
                2 => {
                    let n = read_varint(data, &mut at) as usize;
                    at += n;
                    (0, data[at - n..at].to_vec())
                }
                other => panic!("wire type {other}"),
            };
            out.push((field, value, bytes));
        }
        out
    }

    fn decode_event(data: &[u8]) -> Event {
        let (mut step, mut scalars, mut version) = (None, Vec::new(), None);
        for (field, value, bytes) in fields(data) {
            match field {
                1 => assert!(f64::from_le_bytes(bytes.try_into().unwrap()) > 1.0e9),
                2 => step = Some(value),
                3 => version = Some(String::from_utf8(bytes).unwrap()),
                5 => {
                    for (_, _, entry) in fields(&bytes) {
                        let entry = fields(&entry);
                        let tag = String::from_utf8(entry[0].2.clone()).unwrap();
                        let value = f32::from_le_bytes(entry[1].2.clone().try_into().unwrap());
                        scalars.push((tag, value));
                    }
                }
                other => panic!("field {other}"),
            }
        }
        (step, scalars, version)
    }

    #[test]
    fn the_event_file_reads_back() {
        let dir = std::env::temp_dir().join(format!("zeroflow-tb-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut writer = EventWriter::create(&dir).unwrap();
        writer.scalars(1, &[("train/loss", 5.25), ("train/lr", 3e-4)]).unwrap();
        writer.scalars(300, &[("eval/loss", 4.5)]).unwrap();
        let events = read_events(writer.path());
        assert_eq!(events.len(), 3);
        assert_eq!(events[0].2.as_deref(), Some("brain.Event:2"));
        assert_eq!(events[1].0, Some(1));
        let expected = vec![("train/loss".to_owned(), 5.25), ("train/lr".to_owned(), 3e-4f32)];
        assert_eq!(events[1].1, expected);
        assert_eq!(events[2].0, Some(300));
        assert_eq!(events[2].1, vec![("eval/loss".to_owned(), 4.5)]);
        let name = writer.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("events.out.tfevents.") && name.ends_with(".zeroflow"), "{name}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
