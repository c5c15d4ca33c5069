//! One side's resources — context, protection domain, CQs, the data buffer, the control
//! channel and the data QPs — and the ways two sides get connected.
//!
//! Buffer layout, the same on both sides: QP `i` owns `stride` bytes at `i * stride`, a send
//! half (`[0, half)`: Send and Write sources, Read targets) and a receive half
//! (`[half, 2 * half)`: Receive buffers, where the peer's Writes land and its Atomics work).

use std::ops::{Deref, DerefMut};

use shmhca::cm::{ConnectParams, Connection, Listener};
use shmhca::{
    AccessFlags, CompChannel, Context, Cq, Destination, EngineMode, IdlePolicy, LinkId, Mr, Mtu,
    Pd, Qp, QpAttr, QpCaps, QpState,
};

use crate::perf::control::{self, Control};
use crate::perf::error::PerfError;
use crate::perf::opts::{ModeArg, Options, Role, TestKind, Verb, arena_bytes};
use crate::perf::params::RunParams;
use crate::perf::report::AddrLine;

/// A data or control QP: one this tool connected by hand, or a connection manager's.
pub enum DataQp {
    /// Connected by hand (in-process runs).
    Own(Qp),
    /// Connected through `shmhca::cm` (two processes).
    Cm(Connection),
}

impl DataQp {
    /// Why the peer is gone, if the connection manager knows it is.
    pub fn peer_gone(&self) -> Option<String> {
        match self {
            DataQp::Own(_) => None,
            DataQp::Cm(c) => (!c.is_peer_connected()).then(|| {
                c.peer_gone_reason()
                    .unwrap_or_else(|| "its connection closed".into())
            }),
        }
    }
}

impl Deref for DataQp {
    type Target = Qp;
    #[inline]
    fn deref(&self) -> &Qp {
        match self {
            DataQp::Own(q) => q,
            DataQp::Cm(c) => c.qp(),
        }
    }
}

impl DerefMut for DataQp {
    #[inline]
    fn deref_mut(&mut self) -> &mut Qp {
        match self {
            DataQp::Own(q) => q,
            DataQp::Cm(c) => c.qp_mut(),
        }
    }
}

/// The memory and queues of one side, before its QPs are connected.
pub struct Resources {
    /// The context (this side's HCA).
    pub ctx: Context,
    /// The protection domain.
    pub pd: Pd,
    /// The CQ of every data QP (send and receive completions).
    pub cq: Cq,
    /// The data buffer.
    pub buf: Mr,
    /// Bytes per QP in `buf`.
    pub stride: u64,
    /// Bytes of each half.
    pub half: u64,
    /// RSS (KiB) before the context was created.
    pub rss_before_kib: u64,
    /// With `-e`: the completion channel `cq` reports to.
    pub channel: Option<CompChannel>,
}

impl std::fmt::Debug for Resources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resources")
            .field("stride", &self.stride)
            .finish_non_exhaustive()
    }
}

/// The caps of the data QPs of a run.
pub fn data_caps(opts: &Options) -> QpCaps {
    QpCaps {
        max_send_wr: opts.tx_depth,
        max_recv_wr: if opts.test.verb() == Verb::Send {
            opts.rx_depth
        } else {
            1
        },
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: opts.inline,
    }
}

/// The caps of the control QP.
pub fn control_caps() -> QpCaps {
    QpCaps {
        max_send_wr: 16,
        max_recv_wr: control::SLOTS,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 64,
    }
}

/// The capture file of the server side when `SHMHCA_PCAP` names `client`: `.server`
/// before the extension (`run.pcap` → `run.server.pcap`), or after a name without one.
/// The client writes `client` itself: two processes never write one file.
pub fn server_capture(client: &std::path::Path) -> std::path::PathBuf {
    let name = match (client.file_stem(), client.extension()) {
        (Some(stem), Some(ext)) => {
            let mut n = stem.to_os_string();
            n.push(".server.");
            n.push(ext);
            n
        }
        _ => {
            let mut n = client.file_name().unwrap_or_default().to_os_string();
            n.push(".server");
            n
        }
    };
    client.with_file_name(name)
}

/// Remote access the data QPs and buffer allow.
pub fn remote_access() -> AccessFlags {
    AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC
}

impl Resources {
    /// Creates the context and memory for one side. `engine_cpu` pins a poll-mode engine.
    ///
    /// # Errors
    /// The context, CQ or buffer cannot be created (the error says which).
    pub fn new(opts: &Options, engine_cpu: Option<usize>) -> Result<Resources, PerfError> {
        let rss_before_kib = crate::perf::stats::rss_kib();
        let mode = match opts.mode {
            ModeArg::Inline => EngineMode::Inline,
            ModeArg::Poll => EngineMode::Poll { cpu: engine_cpu },
        };
        let mut builder = Context::builder();
        // SHMHCA_PCAP reaches the server (its own peer process inherits it): the server
        // captures to a file of its own (see `server_capture`).
        if matches!(opts.role, Role::Server(_))
            && let Some(path) = std::env::var_os("SHMHCA_PCAP")
        {
            builder = builder.pcap(server_capture(std::path::Path::new(&path)));
        }
        let ctx = builder
            .arena_size(arena_bytes(
                opts.max_size(),
                opts.qps,
                opts.tx_depth,
                opts.inline,
            ))
            .mode(mode)
            .faults(opts.faults)
            // -e: nothing spins. The application sleeps on the completion channel and the
            // engine (thread, or the waiting application in inline mode) sleeps when idle,
            // woken by a peer's packet.
            .idle(if opts.events {
                IdlePolicy::Backoff {
                    spins: 1,
                    max_sleep: std::time::Duration::from_millis(10),
                }
            } else {
                IdlePolicy::Spin
            })
            .build()
            .map_err(PerfError::engine("creating the shmhca context"))?;
        let pd = ctx
            .alloc_pd()
            .map_err(PerfError::engine("allocating a protection domain"))?;
        let caps = data_caps(opts);
        let cq_depth = (opts.qps * (caps.max_send_wr + caps.max_recv_wr) + 64)
            .next_power_of_two()
            .min(1 << 20);
        let channel = if opts.events {
            Some(
                ctx.create_comp_channel()
                    .map_err(PerfError::engine("creating the completion channel"))?,
            )
        } else {
            None
        };
        let cq = match &channel {
            Some(ch) => ctx.create_cq_with_channel(cq_depth, ch),
            None => ctx.create_cq(cq_depth),
        }
        .map_err(PerfError::engine("creating the completion queue"))?;
        let half = opts.max_size().div_ceil(64) * 64;
        let stride = 2 * half;
        let buf = pd
            .alloc_mr(
                stride * u64::from(opts.qps),
                AccessFlags::LOCAL_WRITE | remote_access(),
            )
            .map_err(PerfError::engine("registering the data buffer"))?;
        Ok(Resources {
            ctx,
            pd,
            cq,
            buf,
            stride,
            half,
            rss_before_kib,
            channel,
        })
    }

    /// This side's parameters to send to the peer.
    pub fn params(&self, opts: &Options) -> RunParams {
        RunParams::new(opts, self.buf.remote(0), self.stride)
    }

    /// A control channel (unconnected QP, its CQ and slots).
    ///
    /// # Errors
    /// The engine refuses an object.
    pub fn control_parts(&self) -> Result<(Cq, Mr), PerfError> {
        let cq = self
            .ctx
            .create_cq(64)
            .map_err(PerfError::engine("creating the control CQ"))?;
        let mr = self
            .pd
            .alloc_mr(
                u64::from(control::SLOTS) * control::SLOT_LEN,
                AccessFlags::LOCAL_WRITE,
            )
            .map_err(PerfError::engine("registering the control buffers"))?;
        Ok((cq, mr))
    }
}

/// A connected side, ready to run.
///
/// The fields drop in their order here: the data QPs first, then the control channel, and
/// only then the memory they reach. A side that stops while its peer still writes into it
/// (it failed, or gave up waiting) thus closes its QPs before its buffer's key goes away;
/// the other way round (issue 24), its engine went on answering the peer's Writes on the
/// still-connected data QPs in between (the context, then the control connection, were
/// being closed) with Remote Access Error Naks for the freed key, and the peer reported
/// RemAccessErr as if its own request had been bad.
pub struct Side {
    /// The data QPs.
    pub qps: Vec<DataQp>,
    /// The control channel.
    pub ctl: Control,
    /// Memory and queues.
    pub res: Resources,
    /// The peer's parameters (its buffer address and key among them).
    pub peer: RunParams,
    /// How the sides connected (for the header).
    pub exchange: &'static str,
    /// RSS (KiB) once everything was set up.
    pub rss_after_kib: u64,
    /// The RoCEv2 port the QPs run over (`--roce`), kept as long as they are.
    pub udp: Option<shmhca::UdpPort>,
    /// `--roce`: the exchange's TCP connection, watched as the peer's
    /// [pulse](crate::perf::pulse) (closed last).
    pub pulse: Option<crate::perf::pulse::Pulse>,
}

impl std::fmt::Debug for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Side")
            .field("qps", &self.qps.len())
            .finish_non_exhaustive()
    }
}

impl Side {
    /// The header's address lines: this side's and the peer's, one pair per data QP.
    pub fn addr_lines(&self, test: TestKind, outs: u8) -> (Vec<AddrLine>, Vec<AddrLine>) {
        let rdma = test.verb() != Verb::Send;
        let outs = matches!(test.verb(), Verb::Read | Verb::Atomic).then_some(outs);
        let mut local = Vec::new();
        let mut remote = Vec::new();
        for (i, qp) in self.qps.iter().enumerate() {
            let cfg = qp.config();
            let off = i as u64 * self.res.stride;
            local.push(AddrLine {
                qpn: qp.qpn().get(),
                psn: cfg.sq_psn.get(),
                outs,
                rkey_vaddr: rdma.then(|| (self.res.buf.rkey(), self.res.buf.addr() + off)),
            });
            remote.push(AddrLine {
                qpn: cfg.dest.map_or(0, |d| d.qpn.get()),
                psn: cfg.rq_psn.get(),
                outs,
                rkey_vaddr: rdma.then(|| (self.peer.buf.rkey, self.peer.buf.addr + off)),
            });
        }
        (local, remote)
    }
}

/// A start PSN that differs between runs.
pub(crate) fn start_psn(salt: u32) -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    (nanos ^ salt.wrapping_mul(0x9E37_79B9) ^ std::process::id()) & 0x00ff_ffff
}

/// Brings a QP from Reset to RTS by hand, talking to `remote` over `link`.
fn connect_by_hand(
    qp: &mut Qp,
    link: LinkId,
    remote: shmhca::Qpn,
    rq_psn: u32,
    mtu: Mtu,
) -> Result<(), PerfError> {
    let qpn = qp.qpn().get();
    let what = || format!("connecting QP {qpn:#x}");
    qp.modify(&QpAttr::new(QpState::Init).access(remote_access()))
        .map_err(PerfError::engine(what()))?;
    qp.modify(
        &QpAttr::new(QpState::Rtr)
            .path_mtu(mtu)
            .dest(Destination { link, qpn: remote })
            .rq_psn(rq_psn)
            .max_dest_rd_atomic(shmhca::qp::MAX_RD_ATOMIC)
            .min_rnr_timer(1),
    )
    .map_err(PerfError::engine(what()))
}

pub(crate) fn to_rts(qp: &mut Qp, sq_psn: u32, opts: &Options, outs: u8) -> Result<(), PerfError> {
    qp.modify(
        &QpAttr::new(QpState::Rts)
            .sq_psn(sq_psn)
            .timeout(opts.qp_timeout)
            .retry_cnt(opts.retry_count)
            .rnr_retry(7)
            .max_rd_atomic(outs),
    )
    .map_err(PerfError::engine(format!(
        "moving QP {:#x} to RTS",
        qp.qpn().get()
    )))
}

/// Both sides in this process, linked directly, every QP connected by hand: returns
/// `(client, server)`. Used by `--in-process` and to test the loops without a second
/// process.
///
/// # Errors
/// Any resource or transition fails.
pub fn in_process_pair(
    opts: &Options,
    engine_cpus: (Option<usize>, Option<usize>),
) -> Result<(Side, Side), PerfError> {
    let ra = Resources::new(opts, engine_cpus.0)?;
    let rb = Resources::new(opts, engine_cpus.1)?;
    let (la, lb) = ra
        .ctx
        .link_with(&rb.ctx)
        .map_err(PerfError::engine("linking the two contexts"))?;
    let mtu = Mtu::from_bytes(opts.mtu).map_err(|e| PerfError::engine("the PMTU")(e.into()))?;
    let caps = data_caps(opts);
    let (cqa, mra) = ra.control_parts()?;
    let (cqb, mrb) = rb.control_parts()?;
    // Index 0 is the control QP (on its own CQ), then the data QPs.
    let make = |r: &Resources, ccq: &Cq, control: bool| -> Result<Qp, PerfError> {
        let (cq, c, k) = if control {
            (ccq, control_caps(), "control")
        } else {
            (&r.cq, caps, "data")
        };
        r.ctx
            .create_qp(&r.pd, cq, cq, c)
            .map_err(PerfError::engine(format!("creating the {k} QP")))
    };
    let mut qa = Vec::new();
    let mut qb = Vec::new();
    for i in 0..=opts.qps {
        qa.push(make(&ra, &cqa, i == 0)?);
        qb.push(make(&rb, &cqb, i == 0)?);
    }
    for (i, (a, b)) in qa.iter_mut().zip(qb.iter_mut()).enumerate() {
        let (pa, pb) = (start_psn(2 * i as u32), start_psn(2 * i as u32 + 1));
        let (na, nb) = (a.qpn(), b.qpn());
        connect_by_hand(a, la, nb, pb, mtu)?;
        connect_by_hand(b, lb, na, pa, mtu)?;
        to_rts(a, pa, opts, opts.outs)?;
        to_rts(b, pb, opts, opts.outs)?;
    }
    let pa = ra.params(opts);
    let pb = rb.params(opts);
    pa.check_peer(&pb)?;
    let mut qa = qa.into_iter().map(DataQp::Own);
    let mut qb = qb.into_iter().map(DataQp::Own);
    let mut ctla = Control::new(qa.next().expect("control QP"), cqa, mra);
    let mut ctlb = Control::new(qb.next().expect("control QP"), cqb, mrb);
    ctla.post_slots()?;
    ctlb.post_slots()?;
    let side = |res: Resources, ctl, qps: Vec<DataQp>, peer| Side {
        res,
        ctl,
        qps,
        peer,
        exchange: "in-process link",
        rss_after_kib: crate::perf::stats::rss_kib(),
        udp: None,
        pulse: None,
    };
    Ok((
        side(ra, ctla, qa.collect(), pb),
        side(rb, ctlb, qb.collect(), pa),
    ))
}

/// The connection parameters of the control QP (`private`: this side's [`RunParams`]) or of
/// a data QP (`private` empty).
fn cm_params(opts: &Options, caps: QpCaps, private: Vec<u8>) -> Result<ConnectParams, PerfError> {
    let mtu = Mtu::from_bytes(opts.mtu).map_err(|e| PerfError::engine("the PMTU")(e.into()))?;
    let p = ConnectParams::default()
        .caps(caps)
        .mtu(mtu)
        .access(remote_access())
        .min_rnr_timer(1)
        // ~1 s per try (×8 tries): in inline mode a peer busy outside its polling loop
        // (checking 8 MiB of data, or descheduled on a loaded machine) acknowledges late;
        // nothing is ever lost on a link, and peer death is seen on the socket anyway.
        .local_ack_timeout(opts.qp_timeout)
        .retry_count(opts.retry_count)
        .responder_resources(shmhca::qp::MAX_RD_ATOMIC)
        .initiator_depth(opts.outs)
        .handshake_timeout(std::time::Duration::from_secs(opts.connect_timeout))
        .private_data(private);
    p.validate()
        .map_err(PerfError::engine("the connection parameters"))?;
    Ok(p)
}

/// The server side through the connection manager: listens on `listener`, accepts the
/// control connection (checking the client's parameters) and then `-q` data connections.
/// `first_timeout` bounds the wait for the client (`None`: wait for ever, as perftest's
/// server does).
///
/// # Errors
/// A connection fails, the client is not shmhca-perf, or its parameters differ.
pub fn cm_server(
    opts: &Options,
    res: Resources,
    listener: &Listener,
    first_timeout: Option<std::time::Duration>,
) -> Result<Side, PerfError> {
    let mine = res.params(opts);
    let (ccq, cmr) = res.control_parts()?;
    let cp = cm_params(opts, control_caps(), mine.encode().to_vec())?;
    // A connection that closes before its handshake (another server probing whether this
    // socket is live, a port scanner) is not the client: keep listening for the real one.
    // Anything else (a timeout, a client that is not shmhca-perf) ends the server.
    let deadline = first_timeout.map(|t| std::time::Instant::now() + t);
    let mut strays = 0u32;
    let ctl = loop {
        let r = match deadline {
            Some(d) => listener.accept_timeout(
                d.saturating_duration_since(std::time::Instant::now()),
                &res.pd,
                &ccq,
                &ccq,
                &cp,
            ),
            None => listener.accept(&res.pd, &ccq, &ccq, &cp),
        };
        match r {
            Ok(c) => break c,
            Err(e) if strays < 100 && is_stray(&e) => {
                strays += 1;
                eprintln!(
                    "shmhca-perf: note: a connection to {} closed before its handshake ({e}); still listening",
                    listener.path().display()
                );
            }
            Err(e) => {
                return Err(PerfError::engine(format!(
                    "accepting the client on {}",
                    listener.path().display()
                ))(e));
            }
        }
    };
    let who = format!("the client (pid {})", ctl.peer_pid());
    let peer = RunParams::decode(ctl.peer_private_data(), &who)?;
    mine.check_peer(&peer)?;
    let mut ctl = Control::new(DataQp::Cm(ctl), ccq, cmr);
    ctl.post_slots()?;
    let dp = cm_params(opts, data_caps(opts), Vec::new())?;
    let timeout = std::time::Duration::from_secs(opts.connect_timeout);
    let mut qps = Vec::with_capacity(opts.qps as usize);
    for i in 0..opts.qps {
        let c = listener
            .accept_timeout(timeout, &res.pd, &res.cq, &res.cq, &dp)
            .map_err(PerfError::engine(format!(
                "accepting data QP {} of {}",
                i + 1,
                opts.qps
            )))?;
        qps.push(DataQp::Cm(c));
    }
    Ok(Side {
        res,
        ctl,
        qps,
        peer,
        exchange: "shmhca::cm",
        rss_after_kib: crate::perf::stats::rss_kib(),
        udp: None,
        pulse: None,
    })
}

/// The client side through the connection manager: connects the control QP to the server
/// at `path` (checking the server's parameters), then `-q` data QPs.
///
/// # Errors
/// A connection fails (the error names the path and why), the server is not shmhca-perf,
/// or its parameters differ.
pub fn cm_client(
    opts: &Options,
    res: Resources,
    path: &std::path::Path,
) -> Result<Side, PerfError> {
    let mine = res.params(opts);
    let (ccq, cmr) = res.control_parts()?;
    let cp = cm_params(opts, control_caps(), mine.encode().to_vec())?;
    let ctl = res
        .ctx
        .connect(path, &res.pd, &ccq, &ccq, &cp)
        .map_err(PerfError::engine(format!(
            "connecting to the server at {}",
            path.display()
        )))?;
    let who = format!("the server at {} (pid {})", path.display(), ctl.peer_pid());
    let peer = RunParams::decode(ctl.peer_private_data(), &who)?;
    mine.check_peer(&peer)?;
    let mut ctl = Control::new(DataQp::Cm(ctl), ccq, cmr);
    ctl.post_slots()?;
    let dp = cm_params(opts, data_caps(opts), Vec::new())?;
    let mut qps = Vec::with_capacity(opts.qps as usize);
    for i in 0..opts.qps {
        let c = res
            .ctx
            .connect(path, &res.pd, &res.cq, &res.cq, &dp)
            .map_err(PerfError::engine(format!(
                "connecting data QP {} of {} to {}",
                i + 1,
                opts.qps,
                path.display()
            )))?;
        qps.push(DataQp::Cm(c));
    }
    Ok(Side {
        res,
        ctl,
        qps,
        peer,
        exchange: "shmhca::cm",
        rss_after_kib: crate::perf::stats::rss_kib(),
        udp: None,
        pulse: None,
    })
}

/// Whether an accept failed because the connection closed before sending its REQ (not a
/// client at all: e.g. another server checking whether the socket is live). The library
/// reports this as text only, so the text is what is matched.
fn is_stray(e: &shmhca::Error) -> bool {
    match e {
        shmhca::Error::Connect(m) => {
            m.contains("receiving REQ from the client")
                || m.contains("closed the connection while this side waited for REQ")
        }
        _ => false,
    }
}
