//! The verbs API: device context, protection domains, memory regions, completion queues
//! and queue pairs, shaped after ibverbs.
//!
//! # Ownership: why a posted buffer cannot be freed or mutably borrowed
//!
//! Buffers live in memory regions ([`Mr`]) carved from their protection domain's arena. A work request
//! names its buffers with [`Sge`]s, which borrow their `Mr` only for the duration of the
//! `post_*` call; posting records each element in the region's *in-flight count*, and the
//! engine drops it when the work request retires — before its completion becomes visible.
//! Once the application has polled a completion, the work request's queue slot is free and
//! its regions no longer count it: posting again and [`Mr::deregister`] succeed. Work
//! requests retire in order, so a completion also frees the unsignaled sends before it. So:
//!
//! * **no mutable borrow while in flight**: [`Mr::as_mut_slice`] takes `&mut self` and
//!   refuses ([`Error::MrBusy`]) while the count is non-zero; while the slice lives, the
//!   borrow checker forbids posting from that region. Regions a peer may write
//!   (`REMOTE_WRITE`/`REMOTE_ATOMIC`, or through a window: `MW_BIND` with `LOCAL_WRITE`) never hand out a slice at all — a peer could change
//!   them at any moment — and are read and written with copies ([`Mr::read_at`],
//!   [`Mr::write_at`]), like host memory a NIC may DMA into at any time.
//! * **no free while in flight**: [`Mr::deregister`] refuses while the count is non-zero
//!   and gives the region back; dropping an `Mr` that is in flight revokes its keys at once
//!   but frees its memory only when the last work request using it retires.
//!
//! No `unsafe` is needed anywhere in this API.
//!
//! # Memory windows and shared receive queues
//!
//! [`Mw`] (type 1 and type 2 memory windows: Bind MW, Local Invalidate, Send with
//! Invalidate, and the checks and errors of each) and [`Srq`] (one receive queue feeding
//! many QPs, its limit event and the credits of its QPs) document how they work and map
//! to ibverbs.
//!
//! # Security model: what a connected peer can read and write
//!
//! A peer is a process that completed the connection handshake (by default, of the same
//! user: [`PeerPolicy`](crate::PeerPolicy)). Whatever it does afterwards — map what it
//! received writable, rewrite shared memory, send any bytes — the rule is:
//!
//! * **It writes nothing of yours.** Your memory regions are only ever written by your own
//!   engine, after it checked the R_Key, the protection domain, the access flags and the
//!   bounds of a remote request. The arena descriptors a peer receives are read-only
//!   reopens of memfds sealed with `F_SEAL_FUTURE_WRITE`: the kernel refuses a writable
//!   mapping, an `mprotect` to writable, `write(2)`, hole punching and truncation, however
//!   the peer obtained the descriptor.
//! * **It reads exactly the arenas of the protection domains connected to it.** Each
//!   [`Pd`] has its own arena; a peer receives a domain's arena when one of that domain's
//!   QPs connects to it, and can then read every region of that domain (zero-copy needs the
//!   receiver to read the sender's buffers) and the domain's inline staging — nothing of
//!   other domains, nothing of your heap. Freed regions are zeroed before a peer could read
//!   them again. To keep peers apart, give each its own protection domain.
//! * **It sees no engine bookkeeping.** Queues, scatter/gather tables, keys, in-flight
//!   counts and QP state live in private memory. Besides the arenas a peer shares the link
//!   segment (the two packet rings, which both sides write) and reads your engine page
//!   (one word saying whether your engine sleeps).
//! * **It can hurt only its own connections.** Every index, length, offset, key and opcode
//!   read from a link is checked before use; a peer that breaks the ring protocol gets its
//!   link torn down. Sizes are capped before anything is mapped
//!   ([`ConnectParams::max_peer_arena`](crate::cm::ConnectParams::max_peer_arena)), and a
//!   peer's segments are never populated, so a peer cannot make you commit memory.
//!
//! Memory you register yourself ([`Pd::reg_mr`]: a `Vec<u8>`, a `Box<[u8]>`, a
//! `memmap2::MmapMut`, a [`Memfd`]) stays private under the same rule: your engine writes
//! received data and results into it in place, and copies what a peer must read (a Send or
//! RDMA Write you post from it, a peer's RDMA Read of it) into the region's shadow, a block
//! of its domain's arena; the README's "Registering your own memory" gives the costs.
//!
//! What this does not cover: the operating system's own boundary. A process of the same
//! user may `ptrace` you or open `/proc/PID/mem` unless Yama or `prctl(PR_SET_DUMPABLE, 0)`
//! forbids it; for a boundary against such a process, run peers as another user and admit
//! them with [`PeerPolicy`](crate::PeerPolicy).

pub mod channel;
pub(crate) mod cq;
pub(crate) mod loopback;
pub(crate) mod mr;
pub(crate) mod mw;
pub(crate) mod qp;
mod remap;
pub(crate) mod srq;
pub mod wr;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use shmhca_rings::segment::{HugePages, PageSize};

use crate::device::Device;

use crate::context::Stats;
use crate::engine::Engine;
use crate::engine::cell::EngineCell;
use crate::engine::doorbell::Doorbell;
use crate::error::{Error, Result};
use crate::link::{self, Link, LinkId, Side};
use crate::mem::Mem;
use crate::trace::PacketEvent;
use crate::trace::tap::{Tap, Trace};

pub use crate::async_events::AsyncEvent;
pub use crate::device::{EngineMode, IdlePolicy};
pub use crate::engine::progress::Progress;
pub use crate::user_mem::{Memfd, RawBuffer, UserBuffer};
pub use channel::CompChannel;
pub use cq::Cq;
pub use loopback::{Loopback, LoopbackEnd};
pub use mr::{Mr, Pd, Sge, UserMr};
pub use mw::{Mw, MwType};
pub use qp::{Qp, QpInfo};
pub use srq::Srq;

/// Options of a [`Context`].
///
/// ```
/// use shmhca::{Context, EngineMode, IdlePolicy};
///
/// let capture = std::env::temp_dir().join(format!("shmhca-doc-{}.pcap", std::process::id()));
/// let ctx = Context::builder()
///     .mode(EngineMode::Inline)  // the application's calls run the engine
///     .idle(IdlePolicy::default())
///     .arena_size(8 << 20)       // each protection domain's shared arena
///     .pcap(&capture)            // every packet, for Wireshark/tshark (RoCEv2 framing)
///     .build()?;
/// # drop(ctx);
/// # let _ = std::fs::remove_file(&capture);
/// # Ok::<(), shmhca::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct ContextBuilder {
    arena_size: u64,
    huge_pages: HugePages,
    mode: EngineMode,
    /// `None`: the mode's default (see [`ContextBuilder::idle`]).
    idle: Option<IdlePolicy>,
    pcap: Option<PathBuf>,
    /// Whether `pcap` came from `SHMHCA_PCAP` (inherited by child processes: see
    /// [`crate::trace`]) rather than from [`ContextBuilder::pcap`].
    pcap_from_env: bool,
    link_slots: usize,
    faults: crate::fault::FaultConfig,
    fault_rule: RuleSlot,
    progress: Progress,
    clock: crate::timer::EngineClock,
    peer_loss_grace: Option<Duration>,
}

/// A fault rule waiting in a builder (taken by the first `build`).
#[derive(Clone, Default)]
struct RuleSlot(Option<Arc<Mutex<Option<crate::fault::FaultRule>>>>);

impl std::fmt::Debug for RuleSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Some(rule)"
        } else {
            "None"
        })
    }
}

impl Default for ContextBuilder {
    fn default() -> ContextBuilder {
        ContextBuilder {
            arena_size: 64 << 20,
            huge_pages: HugePages::Auto,
            mode: EngineMode::default_for_this_machine(),
            idle: None,
            pcap: std::env::var_os("SHMHCA_PCAP").map(PathBuf::from),
            pcap_from_env: true,
            link_slots: link::DEFAULT_LINK_SLOTS,
            faults: crate::fault::FaultConfig::default(),
            fault_rule: RuleSlot::default(),
            progress: Progress::from_env(),
            clock: Default::default(),
            peer_loss_grace: Some(crate::fabric::DEFAULT_PEER_LOSS_GRACE),
        }
    }
}

impl ContextBuilder {
    /// Runs the engine's protocol timers (transport timer, RNR waits, and so the retry
    /// counts) on `clock` instead of the system's: they expire when the test moves the
    /// clock past them, never by themselves, so a test of timeouts takes no wall time. Waits
    /// of the application (`Cq::wait`, `get_event` timeouts) and the idle engine's sleeps stay
    /// on the system clock. See [`TestClock`](crate::timer::TestClock) for an example.
    pub fn test_clock(mut self, clock: &crate::timer::TestClock) -> ContextBuilder {
        self.clock = crate::timer::EngineClock::Test(clock.clone());
        self
    }

    /// Bytes of shared memory of each protection domain's arena, for its memory regions and
    /// its QPs' inline staging (default 64 MiB). An arena's pages are committed as regions
    /// are allocated in it, not when it is made; [`ContextBuilder::build`] refuses a size of
    /// 0 or one larger than this machine's memory.
    pub fn arena_size(mut self, bytes: u64) -> ContextBuilder {
        self.arena_size = bytes;
        self
    }

    /// Whether the arena uses huge pages (default: when available).
    pub fn huge_pages(mut self, h: HugePages) -> ContextBuilder {
        self.huge_pages = h;
        self
    }

    /// How the engine runs (default: [`EngineMode::default_for_this_machine`]).
    pub fn mode(mut self, mode: EngineMode) -> ContextBuilder {
        self.mode = mode;
        self
    }

    /// What an idle engine does (see [`IdlePolicy`]).
    ///
    /// Default: in poll mode [`IdlePolicy::default`], which spins a bounded while, then
    /// yields while work is in flight and sleeps once there is none, woken by posts and
    /// peers' packets — so that an engine thread with nothing to do does not burn a core;
    /// ask for [`IdlePolicy::Spin`] for the lowest latency. In inline mode `Spin`: an
    /// inline engine has no thread of its own that could spin, and `Backoff` would make
    /// every peer pay a fence per burst it sends to this engine (see [`IdlePolicy`]); ask
    /// for `Backoff` to have [`Cq::wait`] and [`CompChannel::get_event`] sleep instead of
    /// yielding.
    ///
    /// A poll-mode engine with `Spin` on a machine where this process's spinning engine
    /// threads and one application thread would outnumber its cores is built all the
    /// same, with a one-line warning on stderr (once per process) saying what to do.
    pub fn idle(mut self, idle: IdlePolicy) -> ContextBuilder {
        self.idle = Some(idle);
        self
    }

    /// How long the QPs facing a lost fabric peer (its process ended, or dropped its
    /// context) stay as they are when they have nothing outstanding, before they go to the
    /// Error state (their receives then complete with `WrFlushErr`); default
    /// [`DEFAULT_PEER_LOSS_GRACE`](crate::fabric::DEFAULT_PEER_LOSS_GRACE). `None`: never, InfiniBand's behaviour, where nothing
    /// tells an RC QP its peer vanished. Whatever the grace, a request outstanding when the
    /// peer went, or posted after, fails at once with `RetryExcErr` (what its retries
    /// would end in). The grace lets a program whose peer exits right after the last
    /// message of a ping-pong finish its loop without seeing its spare receives flushed.
    /// See [`crate::fabric`]; links made by the connection manager end with their
    /// connection instead.
    pub fn peer_loss_grace(mut self, grace: Option<Duration>) -> ContextBuilder {
        self.peer_loss_grace = grace;
        self
    }

    /// Who drives an inline engine while the application does not call into shmhca
    /// (default [`Progress::Auto`]: a sleeping helper thread, so a busy application never
    /// lets a peer's transport timer expire; `SHMHCA_PROGRESS=manual` in the environment
    /// changes the default). Poll mode has its engine thread and ignores this.
    pub fn progress(mut self, progress: Progress) -> ContextBuilder {
        self.progress = progress;
        self
    }

    /// Writes every packet to a pcap file (default: `$SHMHCA_PCAP` if set). Contexts of
    /// this process naming one file share it; a file another process writes is refused
    /// by [`ContextBuilder::build`] (the default from `SHMHCA_PCAP` instead moves to
    /// `NAME.PID.EXT`: see [`crate::trace`]).
    pub fn pcap(mut self, path: impl Into<PathBuf>) -> ContextBuilder {
        self.pcap = Some(path.into());
        self.pcap_from_env = false;
        self
    }

    /// Lines per direction of each link this context creates (64 bytes each; a small
    /// packet takes one, a packet with a gather list up to 7): a power of two from 8 to
    /// 16,384, default 1024. A peer's link is accepted up to the same size.
    pub fn link_slots(mut self, slots: usize) -> ContextBuilder {
        self.link_slots = slots;
        self
    }

    /// Injects faults into the packets this context sends (see [`crate::fault`]): drops,
    /// duplicates, reorders, delays and corruptions at the given per-packet rates, drawn
    /// from the given seed. Default: none. [`ContextBuilder::build`] checks the rates.
    pub fn faults(mut self, faults: crate::fault::FaultConfig) -> ContextBuilder {
        self.faults = faults;
        self
    }

    /// Decides the fault of each packet this context sends, for tests that target one
    /// packet ("drop the second Ack"): `rule` sees the packet's headers; an answer other
    /// than [`FaultAction::Pass`](crate::fault::FaultAction::Pass) takes precedence over the
    /// rates of [`ContextBuilder::faults`], and `Pass` leaves the packet to them. The rule
    /// goes to the first context built from this builder (or its clones).
    pub fn fault_rule(
        mut self,
        rule: impl FnMut(&PacketEvent<'_>) -> crate::fault::FaultAction + Send + 'static,
    ) -> ContextBuilder {
        self.fault_rule = RuleSlot(Some(Arc::new(Mutex::new(Some(Box::new(rule))))));
        self
    }

    /// Opens the context: creates its engine page and starts the engine. Arenas are made
    /// per protection domain, by [`Context::alloc_pd`].
    ///
    /// # Errors
    /// The engine page cannot be created (see [`Error::SegmentCreate`]), the pcap file
    /// cannot be created or another process writes it ([`Error::InvalidArgument`] naming
    /// the file), or an option is out of range (an arena size of 0 or above this machine's
    /// memory, link slots not a power of two).
    pub fn build(self) -> Result<Context> {
        if !self.link_slots.is_power_of_two()
            || !(link::MIN_LINK_SLOTS..=link::MAX_LINK_SLOTS).contains(&self.link_slots)
        {
            return Err(Error::invalid(
                "link_slots",
                format!(
                    "{}; use a power of two from {} to {} such as 1024",
                    self.link_slots,
                    link::MIN_LINK_SLOTS,
                    link::MAX_LINK_SLOTS
                ),
            ));
        }
        check_arena_size(self.arena_size)?;
        self.faults.validate()?;
        let idle = self.idle.unwrap_or(match self.mode {
            EngineMode::Poll { .. } => IdlePolicy::default(),
            EngineMode::Inline => IdlePolicy::Spin,
        });
        let may_sleep = matches!(idle, IdlePolicy::Backoff { .. });
        // Announce to peers whether they must wake this engine (see `engine::wake`).
        let engine_page = crate::arena::create_engine_page(may_sleep)?;
        let engine_page_mem = Mem::from_segment(engine_page.clone());
        let id = next_engine_id();
        let async_events = Arc::new(crate::async_events::AsyncQueue::new()?);
        let mut engine = Engine::new(async_events.clone());
        engine.res.clock = self.clock.clone();
        // A poll-mode engine thread watches busy send queues, so that posting to them rings
        // no doorbell (see `Engine::watch_sq`); it needs `membarrier` to stop watching.
        engine.watch_sq = matches!(self.mode, EngineMode::Poll { .. })
            && crate::engine::cell::barrier_available();
        // Owed Acks wait one iteration for a request to ride in only where someone runs the
        // next iteration whatever the application does: the engine thread, or the
        // progress helper (see `Engine::hold_acks`).
        engine.hold_acks =
            matches!(self.mode, EngineMode::Poll { .. }) || self.progress == Progress::Auto;
        let notify_armed = engine.res.cqs.armed_mirror();
        engine.stats_area =
            crate::stats_area::StatsArea::create(id, matches!(self.mode, EngineMode::Poll { .. }));
        let rule = self
            .fault_rule
            .0
            .as_ref()
            .and_then(|r| r.lock().unwrap_or_else(|e| e.into_inner()).take());
        if !self.faults.is_none() || rule.is_some() {
            engine.faults = Some(Box::new(crate::fault::Faults::new(self.faults, rule)));
        }
        if let Some(path) = &self.pcap {
            let tap = if self.pcap_from_env {
                env_tap(path)?
            } else {
                shared_tap(path)?
            };
            engine.trace = Some(Box::new(Trace {
                pcap: Some(tap),
                observer: None,
            }));
        }
        let shared = Arc::new(Device {
            engine: EngineCell::new(engine),
            doorbell: Doorbell::new(crate::engine::doorbell::MAX_QPS),
            engine_page,
            engine_page_mem,
            arena_size: self.arena_size,
            id,
            mode: self.mode,
            link_slots: self.link_slots,
            huge_pages: self.huge_pages,
            peer_loss_grace: self.peer_loss_grace,
            may_sleep,
            fd_sleep: Arc::default(),
            cm: std::sync::OnceLock::new(),
            local_peers: Mutex::default(),
            progress_mark: Default::default(),
            blocked: AtomicU32::new(0),
            notify_armed,
            helper_word: Arc::default(),
            empty_polls: Default::default(),
            step_looks: Default::default(),
            app_drives: Default::default(),
            engine_beat: Default::default(),
            unserved_seen: Mutex::new((0, std::time::Instant::now())),
            serving: Default::default(),
            #[cfg(test)]
            unserved_runs: Default::default(),
            kick: Default::default(),
            fabric: std::sync::OnceLock::new(),
            fabric_resolve: std::sync::OnceLock::new(),
            async_events,
        });
        // Under loom there is no helper or engine thread: a model drives the engine with
        // `Context::progress` from a thread of its own.
        #[cfg(not(shmhca_loom))]
        if self.mode == EngineMode::Inline && self.progress == Progress::Auto {
            crate::engine::progress::spawn(&shared)
                .map_err(|e| Error::io("spawning the progress helper thread", e))?;
        }
        #[cfg(not(shmhca_loom))]
        if let EngineMode::Poll { cpu } = self.mode {
            let s = shared.clone();
            // Counted while the thread lives (it holds the count).
            let spinning = (idle == IdlePolicy::Spin).then(|| {
                use crate::engine::idle;
                let (counted, engines) = idle::SPINNING_ENGINES.count();
                if let Some(warning) = idle::oversubscription(engines, idle::cores()) {
                    idle::warn_once(&warning);
                }
                counted
            });
            // Detached: it ends by itself when the last handle of the context is gone.
            std::thread::Builder::new()
                .name("shmhca-engine".into())
                .spawn(move || {
                    let _spinning = spinning;
                    crate::device::engine_thread(s, cpu, idle)
                })
                .map_err(|e| Error::io("spawning the engine thread", e))?;
        }
        Ok(Context { shared })
    }
}

/// Refuses an arena size this machine cannot back.
fn check_arena_size(bytes: u64) -> Result<()> {
    if bytes == 0 {
        return Err(Error::invalid(
            "arena_size",
            "0 bytes; an arena must hold at least one memory region (the default is 64 MiB)",
        ));
    }
    let info = rustix::system::sysinfo();
    let ram = u64::from(info.mem_unit).saturating_mul(info.totalram as u64);
    if ram > 0 && bytes > ram {
        return Err(Error::invalid(
            "arena_size",
            format!(
                "{bytes} bytes is more than this machine's {ram} bytes of memory; \
                 ask for at most what the regions of one protection domain need"
            ),
        ));
    }
    Ok(())
}

/// Engine identities: the process id and a per-process counter, so captures of several
/// engines and processes tell them apart.
fn next_engine_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed) & 0xff;
    (std::process::id() & 0xffff) << 8 | n
}

/// Contexts of one process tracing to the same file (however they name it) share one
/// tap; a file another process writes is refused, untouched.
fn shared_tap(path: &Path) -> Result<Arc<Tap>> {
    static TAPS: Mutex<Vec<(crate::trace::tap::FileId, std::sync::Weak<Tap>)>> =
        Mutex::new(Vec::new());
    let creating = |e| Error::io(format!("creating the capture file {}", path.display()), e);
    let mut taps = TAPS.lock().unwrap_or_else(|e| e.into_inner());
    taps.retain(|(_, w)| w.strong_count() > 0);
    let (file, id) = crate::trace::tap::open_capture(path).map_err(creating)?;
    if let Some(t) = taps
        .iter()
        .find(|(i, _)| *i == id)
        .and_then(|(_, w)| w.upgrade())
    {
        return Ok(t);
    }
    let tap = Tap::start(file).map_err(|e| {
        if crate::trace::tap::held_elsewhere(&e) {
            Error::invalid(
                "pcap",
                format!(
                    "{}: another process is writing this capture file (two writers would \
                     interleave their records into a file no reader can parse); give each \
                     process a file of its own",
                    path.display()
                ),
            )
        } else {
            creating(e)
        }
    })?;
    taps.push((id, Arc::downgrade(&tap)));
    Ok(tap)
}

/// The tap of a capture named by `SHMHCA_PCAP`, which the processes this one starts
/// inherit: `path` if no other process writes it, else `NAME.PID.EXT` (this process's
/// id), said once on stderr.
fn env_tap(path: &Path) -> Result<Arc<Tap>> {
    match shared_tap(path) {
        Err(Error::InvalidArgument { name: "pcap", .. }) => {
            let own = crate::trace::per_process_path(path, std::process::id());
            let tap = shared_tap(&own)?;
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                eprintln!(
                    "shmhca: SHMHCA_PCAP={} is being written by another process; this \
                     process (pid {}) writes its capture to {}",
                    path.display(),
                    std::process::id(),
                    own.display()
                );
            });
            Ok(tap)
        }
        r => r,
    }
}

/// A device context: this process's HCA. Create one with [`Context::builder`] or
/// [`Context::new`]; every other object comes from it.
///
/// ```
/// use shmhca::{Context, AccessFlags, QpCaps};
/// let ctx = Context::builder().arena_size(1 << 20).build()?;
/// let pd = ctx.alloc_pd()?;
/// let cq = ctx.create_cq(16)?;
/// let qp = ctx.create_qp(&pd, &cq, &cq, QpCaps::default())?;
/// let mr = pd.alloc_mr(4096, AccessFlags::LOCAL_WRITE)?;
/// assert_eq!(mr.len(), 4096);
/// # let _ = qp;
/// # Ok::<(), shmhca::Error>(())
/// ```
pub struct Context {
    pub(crate) shared: Arc<Device>,
}

impl Context {
    /// A context with default options.
    ///
    /// # Errors
    /// See [`ContextBuilder::build`].
    pub fn new() -> Result<Context> {
        ContextBuilder::default().build()
    }

    /// Options for a new context.
    pub fn builder() -> ContextBuilder {
        ContextBuilder::default()
    }

    /// The engine mode.
    pub fn mode(&self) -> EngineMode {
        self.shared.mode
    }

    /// The page size this context's arenas really got: that of its first protection
    /// domain's arena (4 KiB pages while it has none).
    pub fn page_size(&self) -> PageSize {
        self.shared
            .engine
            .with(|e| e.res.pds.first_page_size())
            .unwrap_or(PageSize::Base4K)
    }

    /// Bytes still free in all protection domains' arenas.
    pub fn arena_free(&self) -> u64 {
        self.shared.engine.with(|e| e.res.pds.free_bytes())
    }

    /// A new protection domain, with an arena of its own
    /// ([`ContextBuilder::arena_size`] bytes of shared memory).
    ///
    /// # Errors
    /// The arena cannot be created ([`Error::SegmentCreate`]), or the context has 65,536
    /// protection domains ([`Error::LimitReached`]).
    pub fn alloc_pd(&self) -> Result<Pd> {
        let (size, huge) = (self.shared.arena_size, self.shared.huge_pages);
        let (pdn, mem) = self.shared.engine.with(|e| {
            let pdn = e.res.pds.create(size, huge)?;
            let mem = e.res.pds.get(pdn).map(|a| a.mem().share());
            Ok::<_, Error>((pdn, mem))
        })?;
        Ok(Pd {
            shared: self.shared.clone(),
            pdn,
            mem: Arc::new(mem.ok_or(Error::ForeignObject {
                what: "the protection domain",
            })?),
        })
    }

    /// A new protection domain whose arena is the application's memfd `memfd`: the
    /// zero-copy way to send from memory the application fills itself.
    ///
    /// `memfd` is a memfd the application created with `MFD_ALLOW_SEALING` (plain, or
    /// `MFD_HUGETLB | MFD_HUGE_2MB` for huge pages), sized with `ftruncate` and mapped
    /// read-write (`MAP_SHARED`) by the application *before* this call. shmhca maps it too
    /// (never populating it) and seals it with `F_SEAL_SHRINK | F_SEAL_GROW |
    /// F_SEAL_FUTURE_WRITE`: its size is fixed for good, and from now on no new writable
    /// mapping of it can be made (by anyone, the application included), while the writable
    /// mappings made before keep working. Peers a QP of this domain connects to receive a
    /// read-only descriptor of it, as of any arena, and read it for Sends, RDMA Writes and
    /// RDMA Reads; they can never write it.
    ///
    /// The first `len - staging` bytes stay the application's: shmhca never writes them.
    /// Register ranges of them in place with [`Pd::reg_mr_at`] (no copy at all: packets
    /// reference the memfd directly). The last `staging` bytes are shmhca's: it zeroes them
    /// and carves QP inline staging ([`QpCaps::max_inline_data`](crate::QpCaps::max_inline_data) × `max_send_wr`, rounded
    /// to cache lines) and [`Pd::alloc_mr`]/[`Pd::reg_mr`] regions from them. With
    /// `staging` 0 the whole file is the application's, and the domain's QPs must have
    /// `max_inline_data` 0.
    ///
    /// # Errors
    /// [`Error::MemfdAdopt`] naming what is wrong with the memfd and what to do (not a
    /// memfd, created without `MFD_ALLOW_SEALING`, `F_SEAL_SEAL` or a write seal already
    /// set, opened read-only, empty, above 1 TiB), [`Error::InvalidArgument`] for a
    /// `staging` larger than the file, [`Error::LimitReached`] past 65,536 domains.
    ///
    /// ```
    /// use std::os::unix::fs::FileExt;
    /// use rustix::fs::{MemfdFlags, ftruncate, memfd_create};
    /// use shmhca::{AccessFlags, Context, EngineMode};
    ///
    /// let ctx = Context::builder().mode(EngineMode::Inline).build()?;
    /// let fd = memfd_create("frames", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
    /// ftruncate(&fd, 1 << 20)?;
    /// // The application's view: a real one maps the file read-write (MAP_SHARED) here,
    /// // before the call, and keeps writing through that mapping afterwards.
    /// let mine = std::fs::File::from(fd.try_clone()?);
    /// mine.write_all_at(b"frame 0", 0)?;
    /// let pd = ctx.alloc_pd_over(fd, 256 << 10)?; // the last 256 KiB are shmhca's
    /// let frames = pd.reg_mr_at(0, 4096, AccessFlags::NONE)?; // in place: no copy, ever
    /// let mut got = [0u8; 7];
    /// frames.read_at(0, &mut got)?;
    /// assert_eq!(&got, b"frame 0");
    /// // Sealed: no new way to write it (write(2), a writable mapping), for anyone.
    /// assert!(mine.write_all_at(b"frame 1", 0).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn alloc_pd_over(&self, memfd: std::os::fd::OwnedFd, staging: u64) -> Result<Pd> {
        let (pdn, mem) = self.shared.engine.with(|e| {
            let pdn = e.res.pds.adopt(memfd, staging)?;
            let mem = e.res.pds.get(pdn).map(|a| a.mem().share());
            Ok::<_, Error>((pdn, mem))
        })?;
        Ok(Pd {
            shared: self.shared.clone(),
            pdn,
            mem: Arc::new(mem.ok_or(Error::ForeignObject {
                what: "the protection domain",
            })?),
        })
    }

    /// A completion queue of `depth` entries (rounded up to a power of two).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a depth of 0 or above 2^20.
    pub fn create_cq(&self, depth: u32) -> Result<Cq> {
        Cq::create(&self.shared, depth)
    }

    /// Waits for the next asynchronous event of this context (`ibv_get_async_event`), up
    /// to `timeout` (`None`: for ever); `None` when the time ran out. See
    /// [`crate::async_events`] for the events and the ibverbs mapping.
    ///
    /// In poll mode it sleeps in `poll(2)` on [`Context::async_event_fd`]. In inline mode
    /// the calling thread runs the engine, and between runs sleeps on its kick words (with
    /// [`IdlePolicy::Backoff`]) or yields (with `Spin`), as
    /// [`CompChannel::get_event`] does.
    ///
    /// ```
    /// use std::time::Duration;
    /// use shmhca::{AsyncEvent, Context};
    ///
    /// let ctx = Context::builder().arena_size(1 << 20).build()?;
    /// // Nothing happened: the wait times out.
    /// assert_eq!(ctx.get_async_event(Some(Duration::from_millis(1)))?, None);
    /// while let Some(ev) = ctx.try_get_async_event() {
    ///     if let AsyncEvent::QpLastWqeReached { qpn } = ev {
    ///         eprintln!("QP {:#x} takes nothing more from its SRQ", qpn.get());
    ///     }
    /// }
    /// # Ok::<(), shmhca::Error>(())
    /// ```
    ///
    /// # Errors
    /// Polling the eventfd failed (not expected).
    pub fn get_async_event(&self, timeout: Option<Duration>) -> Result<Option<AsyncEvent>> {
        let deadline = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            if let Some(ev) = self.try_get_async_event() {
                return Ok(Some(ev));
            }
            let left = match deadline {
                Some(d) => match d.checked_duration_since(std::time::Instant::now()) {
                    Some(l) if !l.is_zero() => Some(l),
                    _ => return Ok(None),
                },
                None => None,
            };
            let queue = &self.shared.async_events;
            if self.shared.mode == EngineMode::Inline {
                let _blocked = self.shared.block();
                self.shared
                    .idle_wait(left, || channel::readable(queue.fd()));
            } else {
                channel::wait_readable(queue.fd(), left)?;
            }
        }
    }

    /// The next asynchronous event without waiting, or `None` (`ibv_get_async_event` on a
    /// non-blocking `async_fd`). In inline mode it first runs the engine once.
    pub fn try_get_async_event(&self) -> Option<AsyncEvent> {
        self.shared.progress_inline();
        self.shared.async_events.take()
    }

    /// An fd (an eventfd) that is readable exactly while asynchronous events are queued:
    /// wait on it with `poll`/`epoll` or an async runtime, then take the events with
    /// [`Context::try_get_async_event`]. Do not read it yourself. In inline mode someone
    /// must run the engine meanwhile (the progress helper, [`Progress::Auto`], does).
    pub fn async_event_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.shared.async_events.fd()
    }

    /// Asynchronous events lost because the queue held
    /// [`MAX_ASYNC_EVENTS`](crate::async_events::MAX_ASYNC_EVENTS) already (the
    /// application did not take them).
    pub fn async_events_dropped(&self) -> u64 {
        self.shared.async_events.dropped()
    }

    /// A completion channel: an fd that becomes readable when a completion queue attached
    /// to it has an event (see [`channel`]).
    ///
    /// # Errors
    /// The eventfd cannot be created.
    pub fn create_comp_channel(&self) -> Result<CompChannel> {
        CompChannel::create(&self.shared)
    }

    /// A completion queue of `depth` entries whose events ([`Cq::req_notify`]) go to
    /// `channel`.
    ///
    /// # Errors
    /// As [`Context::create_cq`]; the channel belongs to another context, or it serves
    /// [`channel::MAX_CQS_PER_CHANNEL`] queues already.
    pub fn create_cq_with_channel(&self, depth: u32, channel: &CompChannel) -> Result<Cq> {
        if !channel.same_context(&self.shared) {
            return Err(Error::ForeignObject {
                what: "completion channel",
            });
        }
        let mut cq = Cq::create(&self.shared, depth)?;
        cq.attach(channel)?;
        Ok(cq)
    }

    /// A reliable-connected QP in `pd`, completing sends on `send_cq` and receives on
    /// `recv_cq`.
    ///
    /// # Errors
    /// Capabilities out of range ([`QpCaps::validate`]), objects of another context, the
    /// arena has no room for the QP's staging areas, or the context has 4096 QPs.
    ///
    /// [`QpCaps::validate`]: crate::QpCaps::validate
    pub fn create_qp(
        &self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        caps: crate::QpCaps,
    ) -> Result<Qp> {
        Qp::create(&self.shared, pd, send_cq, recv_cq, caps)
    }

    /// A reliable-connected QP in `pd` that takes its receives from shared receive queue
    /// `srq` (`ibv_qp_init_attr.srq`); `caps.max_recv_wr` and `caps.max_recv_sge` are
    /// ignored (the SRQ's depth and elements apply). See [`Srq`] for credits.
    ///
    /// # Errors
    /// As [`Context::create_qp`]; [`Error::InvalidArgument`] for an SRQ of another
    /// protection domain.
    pub fn create_qp_with_srq(
        &self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        srq: &Srq,
        caps: crate::QpCaps,
    ) -> Result<Qp> {
        Qp::create_in(&self.shared, pd, send_cq, recv_cq, Some(srq), caps)
    }

    /// Runs one engine iteration now (inline mode: the application drives its engine;
    /// in poll mode this only helps if the engine thread is between iterations). Returns
    /// the packets moved.
    pub fn progress(&self) -> usize {
        self.shared.progress()
    }

    /// The device's limits and this context's configuration (`ibv_query_device`): the
    /// limits are the ones the code enforces ([`crate::limits`]).
    ///
    /// ```
    /// let ctx = shmhca::Context::builder().arena_size(1 << 20).build()?;
    /// let dev = ctx.query_device();
    /// assert_eq!(dev.max_msg_size, 1 << 31);
    /// assert_eq!(dev.arena_size, 1 << 20);
    /// # Ok::<(), shmhca::Error>(())
    /// ```
    pub fn query_device(&self) -> crate::DeviceAttr {
        use crate::limits::*;
        crate::DeviceAttr {
            max_qp: MAX_QPS,
            max_qp_wr: MAX_QUEUE_DEPTH,
            max_sge: MAX_SGE,
            max_inline_data: MAX_INLINE_DATA,
            max_cq: MAX_CQS,
            max_cqe: MAX_CQ_DEPTH,
            max_pd: MAX_PDS,
            max_mr: MAX_MRS,
            max_mw: MAX_MWS,
            max_srq: MAX_SRQS,
            max_mr_size: MAX_MESSAGE,
            max_msg_size: MAX_MESSAGE,
            max_qp_init_rd_atom: MAX_RD_ATOMIC,
            max_qp_rd_atom: MAX_RD_ATOMIC,
            atomic_cap: crate::AtomicCap::Global,
            max_mtu: crate::Mtu::Mtu4096,
            page_size: self.page_size(),
            arena_size: self.shared.arena_size,
            max_links: MAX_LINKS,
            link_slots: self.shared.link_slots,
            max_link_slots: MAX_LINK_SLOTS,
        }
    }

    /// How long until this engine's next timer expires — a QP's transport timer (its
    /// Local Ack Timeout) or the end of an RNR wait — or `None` when no timer is armed
    /// (zero: one is due now). An inline-mode application that sleeps between its calls
    /// should call [`Context::progress`] again within this time, so that retransmissions
    /// and RNR retries go out when they should. Timers armed by a later engine iteration
    /// are not counted: ask again after driving the engine.
    pub fn next_timer(&self) -> Option<std::time::Duration> {
        let (deadline, now) = self.shared.engine.with(|e| {
            let deadline = e.next_deadline()?;
            Some((deadline, crate::timer::Clock::now(&e.res.clock)))
        })?;
        Some(deadline.saturating_duration_since(now))
    }

    /// A snapshot of the engine's counters.
    pub fn stats(&self) -> Stats {
        self.shared.engine.with(|e| e.stats())
    }

    /// What the fault stage did ([`ContextBuilder::faults`]) and how many received packets
    /// were dropped for a bad ICRC (all zero without faults).
    pub fn fault_stats(&self) -> crate::fault::FaultStats {
        self.shared.engine.with(|e| e.fault_stats())
    }

    /// Starts writing every packet this engine sends and receives to a pcap file
    /// (Ethernet / IPv4 / UDP 4791 / InfiniBand, as RoCEv2), replacing any capture in
    /// progress. Contexts of this process tracing to the same file share it, and then
    /// packets between them are recorded once, by their sender.
    ///
    /// # Errors
    /// The file cannot be created, or another process writes it
    /// ([`Error::InvalidArgument`] naming the file; it is left as it is).
    pub fn trace_to(&self, path: impl AsRef<Path>) -> Result<()> {
        let tap = shared_tap(path.as_ref())?;
        self.shared
            .engine
            .with(|e| e.trace.get_or_insert_with(Default::default).pcap = Some(tap));
        Ok(())
    }

    /// Stops the capture (flushing the file).
    pub fn stop_trace(&self) {
        self.shared.engine.with(|e| {
            e.flush_trace();
            if let Some(t) = e.trace.as_mut() {
                t.pcap = None;
            }
            if e.trace.as_ref().is_some_and(|t| t.is_empty()) {
                e.trace = None;
            }
        });
    }

    /// Calls `observer` with every packet this engine sends and receives (on the engine's
    /// thread; keep it short). Replaces any previous observer.
    pub fn observe_packets(&self, observer: impl FnMut(&PacketEvent<'_>) + Send + 'static) {
        self.shared.engine.with(|e| {
            e.trace.get_or_insert_with(Default::default).observer = Some(Box::new(observer));
        });
    }

    /// Removes the packet observer.
    pub fn stop_observing(&self) {
        self.shared.engine.with(|e| {
            if let Some(t) = e.trace.as_mut() {
                t.observer = None;
            }
            if e.trace.as_ref().is_some_and(|t| t.is_empty()) {
                e.trace = None;
            }
        });
    }

    /// Connects this context's engine with `peer`'s (both in this process) by a new link.
    /// Returns the link's id in this context and in `peer`, to use in
    /// [`Destination`](crate::Destination)s. A context may link with itself (loopback).
    ///
    /// # Errors
    /// The link segment cannot be created or mapped, or either context has 4,096 links
    /// ([`Error::LimitReached`]).
    pub fn link_with(&self, peer: &Context) -> Result<(LinkId, LinkId)> {
        let seg = link::create_link_segment(self.shared.link_slots, self.shared.huge_pages)?;
        // Both engines live in this process: each sees the other's engine page and arenas
        // through read-only views of the mappings it already has (nothing is mapped again);
        // a QP's peer arena is found when the QP is given its destination.
        let page = |s: &Arc<Device>| s.engine_page_mem.read_only();
        if Arc::ptr_eq(&self.shared, &peer.shared) {
            let ends = link::attach(&seg, Side::Loopback)?;
            let mut l = Link::new(
                seg,
                ends,
                page(&self.shared),
                (self.shared.id, self.shared.id),
            );
            l.rx_tap = false;
            let id = self.shared.engine.with(|e| e.add_link(l))?;
            self.shared.add_local_peer(id, &self.shared);
            // A sleeping engine thread waits on the kick words of the links it knew of.
            self.shared.kick();
            return Ok((id, id));
        }
        let seg_b = link::open_link_segment(
            seg.try_clone_fd()
                .map_err(|e| Error::io("duplicating the link segment fd", e))?,
        )?;
        let ends_a = link::attach(&seg, Side::Creator)?;
        let ends_b = link::attach(&seg_b, Side::Opener)?;
        let (ida, idb) = (self.shared.id, peer.shared.id);
        let same_tap = {
            let pcap = |e: &mut Engine| e.trace.as_ref().and_then(|t| t.pcap.clone());
            let ta = self.shared.engine.with(pcap);
            let tb = peer.shared.engine.with(pcap);
            matches!((ta, tb), (Some(a), Some(b)) if Arc::ptr_eq(&a, &b))
        };
        let mut la = Link::new(seg, ends_a, page(&peer.shared), (ida, idb));
        let mut lb = Link::new(seg_b, ends_b, page(&self.shared), (idb, ida));
        la.rx_tap = !same_tap;
        lb.rx_tap = !same_tap;
        let a = self.shared.engine.with(|e| e.add_link(la))?;
        let b = match peer.shared.engine.with(|e| e.add_link(lb)) {
            Ok(b) => b,
            Err(err) => {
                self.shared.engine.with(|e| e.remove_link(a));
                return Err(err);
            }
        };
        self.shared.add_local_peer(a, &peer.shared);
        peer.shared.add_local_peer(b, &self.shared);
        self.shared.kick();
        peer.shared.kick();
        Ok((a, b))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        self.shared.engine.with(|e| e.flush_trace());
        // A sleeping engine thread looks at the handle count when it wakes (and every 1024
        // iterations): wake it, so that it ends soon if this was the last handle.
        self.shared.kick();
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("id", &self.shared.id)
            .field("mode", &self.shared.mode)
            .finish_non_exhaustive()
    }
}
