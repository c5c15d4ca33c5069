//! The engine's packet tap: what is sent and received, into one pcap file per engine.
//!
//! Off, a tap costs each link one `Option` test per burst. On, it runs on the engine's
//! thread and takes a mutex per packet (tracing is for debugging, not for benchmarks).
//!
//! A capture file belongs to one process: it is opened without truncating, then locked
//! (`flock`, exclusive, which the kernel drops when the process closes it or dies), and
//! only then truncated and written. A file another live process holds is left as it is
//! (see [`crate::trace`]).

use std::fs::File;
use std::io::BufWriter;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::mem::Mem;
use crate::trace::pcap::PcapWriter;
use crate::trace::roce::Endpoint;
use crate::wire::slot::{KIND_DIRECT, KIND_GATHER, KIND_INLINE, PacketSlot, gather_entry};

/// The capture endpoint of engine `id` (see `Engine::id`): 10.x.y.z with the id's low 24
/// bits, and a locally administered MAC holding the same bits.
pub(crate) fn endpoint(id: u32) -> Endpoint {
    let [_, a, b, c] = id.to_be_bytes();
    Endpoint::new([0x02, 0x5e, 0, a, b, c], Ipv4Addr::new(10, a, b, c))
}

/// The most payload bytes recorded per packet: a peer names payloads of up to 4 GiB, and
/// what it claims must not decide what this process allocates.
const MAX_RECORDED_PAYLOAD: usize = 1 << 16;

struct Inner {
    writer: PcapWriter<BufWriter<File>>,
    scratch: Vec<u8>,
    failed: bool,
}

/// One capture file.
pub(crate) struct Tap {
    inner: Mutex<Inner>,
}

/// The identity of a file: its device and inode.
pub(crate) type FileId = (u64, u64);

/// Opens (creating if need be) the capture file at `path` for writing, without truncating
/// it; and its identity, so that contexts of one process naming it differently share it.
pub(crate) fn open_capture(path: &Path) -> std::io::Result<(File, FileId)> {
    use std::os::unix::fs::MetadataExt;
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    let meta = file.metadata()?;
    Ok((file, (meta.dev(), meta.ino())))
}

/// Whether an error of [`Tap::start`] says that another process writes the file.
pub(crate) fn held_elsewhere(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::WouldBlock
}

impl Tap {
    /// Starts a capture in `path` (truncated); an error of kind `WouldBlock` if another
    /// process writes it (then it is left as it is).
    #[cfg(test)]
    pub(crate) fn create(path: &Path) -> std::io::Result<Arc<Tap>> {
        let (file, _) = open_capture(path)?;
        Tap::start(file)
    }

    /// Starts a capture in `file` (from [`open_capture`]): takes the file's lock — an
    /// error of kind `WouldBlock`, with the file untouched, if another process (or another
    /// open of it) holds it — then truncates it and writes the pcap header.
    pub(crate) fn start(file: File) -> std::io::Result<Arc<Tap>> {
        rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive)
            .map_err(std::io::Error::from)?;
        // Freshly opened: its offset is 0, where the header goes.
        file.set_len(0)?;
        let writer = PcapWriter::new(BufWriter::new(file))?;
        Ok(Arc::new(Tap {
            inner: Mutex::new(Inner {
                writer,
                scratch: Vec::with_capacity(4096 + 128),
                failed: false,
            }),
        }))
    }

    /// Records one packet from `src` to `dst`: `slots` holds its slot and continuation
    /// slots; `sender_arena` is where payloads sent by reference live. A packet whose
    /// payload cannot be read is recorded with the bytes that could.
    pub(crate) fn record(&self, src: u32, dst: u32, slots: &[PacketSlot], sender_arena: &Mem) {
        let Some((slot, cont)) = slots.split_first() else {
            return;
        };
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.failed {
            return;
        }
        let Inner {
            writer, scratch, ..
        } = &mut *inner;
        scratch.clear();
        let hdr = slot.headers();
        let len = (slot.payload_len as usize).min(MAX_RECORDED_PAYLOAD);
        match slot.kind {
            KIND_INLINE => {
                let end = (hdr.len() + len).min(slot.data.len());
                scratch.extend_from_slice(&slot.data[hdr.len()..end]);
            }
            KIND_DIRECT => {
                scratch.resize(len, 0);
                let _ = sender_arena.read(slot.payload_off, scratch);
            }
            KIND_GATHER => {
                let skip = slot
                    .data
                    .get(hdr.len()..hdr.len() + 4)
                    .map_or(0, |b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
                let mut skip = u64::from(skip);
                for i in 0..usize::from(slot.sge_count) {
                    if scratch.len() >= len {
                        break;
                    }
                    let Some((off, elen)) = gather_entry(cont, i) else {
                        break;
                    };
                    let take =
                        (u64::from(elen).saturating_sub(skip) as usize).min(len - scratch.len());
                    let at = scratch.len();
                    scratch.resize(at + take, 0);
                    let _ = sender_arena.read(off.saturating_add(skip), &mut scratch[at..]);
                    skip = 0;
                }
            }
            _ => {}
        }
        // The BTH pad count says how many pad bytes follow the payload on the wire.
        let pad = hdr.get(1).map_or(0, |f| (f >> 4) & 3) as usize;
        scratch.extend(std::iter::repeat_n(0u8, pad));
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        // A packet the fault stage corrupted is recorded with the ICRC its sender stamped.
        let icrc_error = crate::fault::icrc_error(slots, sender_arena);
        if writer
            .write_packet_with_icrc_error(
                ts,
                endpoint(src),
                endpoint(dst),
                &[hdr, scratch],
                icrc_error,
            )
            .is_err()
        {
            inner.failed = true;
        }
    }

    /// Flushes the file.
    pub(crate) fn flush(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let _ = inner.writer.flush();
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        self.flush();
    }
}

/// A packet observer (see `Context::observe_packets`).
pub(crate) type Observer = Box<dyn FnMut(&super::PacketEvent<'_>) + Send>;

/// An engine's tracing: a pcap file and/or a packet observer. Boxed behind one `Option`
/// in the engine so that, off, it costs one branch per burst.
#[derive(Default)]
pub(crate) struct Trace {
    pub(crate) pcap: Option<Arc<Tap>>,
    pub(crate) observer: Option<Observer>,
}

impl Trace {
    /// Whether it does nothing (and can be dropped).
    pub(crate) fn is_empty(&self) -> bool {
        self.pcap.is_none() && self.observer.is_none()
    }

    /// Records a packet (its slot and continuation slots) on `link`; `sent` tells the
    /// direction. `record_pcap` is false for
    /// received packets when the sender writes the same capture file.
    pub(crate) fn packet(
        &mut self,
        link: crate::link::LinkId,
        endpoints: (u32, u32),
        sent: bool,
        record_pcap: bool,
        slots: &[PacketSlot],
        sender_arena: &Mem,
    ) {
        let Some(slot) = slots.first() else { return };
        if let Some(pcap) = self.pcap.as_ref().filter(|_| record_pcap) {
            let (src, dst) = if sent {
                endpoints
            } else {
                (endpoints.1, endpoints.0)
            };
            pcap.record(src, dst, slots, sender_arena);
        }
        if let Some(observer) = self.observer.as_mut() {
            if let Ok((headers, _)) = crate::wire::PacketRepr::parse(slot.headers()) {
                observer(&super::PacketEvent {
                    direction: if sent {
                        super::Direction::Sent
                    } else {
                        super::Direction::Received
                    },
                    link,
                    headers: &headers,
                    payload_len: slot.payload_len,
                });
            }
        }
        // A positive Ack riding in the line is a packet of its own on the wire it stands
        // for: recorded right after its carrier.
        if let Some(ack) = crate::wire::slot::riding_ack(slot) {
            let ack = [ack];
            self.packet(link, endpoints, sent, record_pcap, &ack, sender_arena);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::slot::{GatherList, KIND_GATHER};

    /// A second writer of a capture file (another process, here another open of it) is
    /// refused before it truncates anything; once the first is gone, the file is free.
    #[test]
    fn a_capture_file_in_use_is_refused_untouched_then_free_again() {
        let dir = std::env::temp_dir().join(format!("shmhca-tap-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("held.pcap");
        let first = Tap::create(&path).unwrap();
        let mut slots = [PacketSlot::default(); 1];
        slots[0].data[0] = 0x04;
        slots[0].hdr_len = 12;
        slots[0].kind = KIND_INLINE;
        first.record(1, 2, &slots, &Mem::private(0));
        first.flush();
        let before = std::fs::read(&path).unwrap();
        assert!(before.len() > 24, "a header and a record");
        let err = Tap::create(&path).err().expect("refused while held");
        assert!(held_elsewhere(&err), "{err:?}");
        assert_eq!(std::fs::read(&path).unwrap(), before, "left untouched");
        drop(first);
        let again = Tap::create(&path).expect("free once the first writer is gone");
        drop(again);
        assert_eq!(
            std::fs::read(&path).unwrap().len(),
            24,
            "truncated: a new capture"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A received gather packet's length and entries are the peer's claims: recording one
    /// that claims 4 GiB must not allocate 4 GiB (it did: the gather path resized its
    /// scratch buffer to whatever the entries said).
    #[test]
    fn a_peers_claimed_gather_length_does_not_size_the_recording() {
        let dir = std::env::temp_dir().join(format!("shmhca-tap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("huge-gather.pcap");
        let tap = Tap::create(&path).unwrap();
        let mut slots = [PacketSlot::default(); 2];
        // A SEND Only BTH: opcode 0x04, then zeroes.
        slots[0].data[0] = 0x04;
        slots[0].hdr_len = 12;
        slots[0].kind = KIND_GATHER;
        slots[0].sge_count = 1;
        slots[0].payload_len = u32::MAX;
        let mut list = GatherList::default();
        assert!(list.push(0, u32::MAX));
        crate::wire::slot::write_gather_for_tests(&list, &mut slots[1..]);
        tap.record(1, 2, &slots, &Mem::private(4096));
        let scratch = tap.inner.lock().unwrap().scratch.capacity();
        assert!(
            scratch <= 2 * MAX_RECORDED_PAYLOAD,
            "recording one packet grew the scratch buffer to {scratch} bytes"
        );
        drop(tap);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
