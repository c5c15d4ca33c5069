//! What can go wrong in a run, each with what to do about it.

/// The errors of `shmhca-perf`. Every one ends the run with exit code 1 (except
/// `--help`/`--version`), after the temp dir, the socket and the peer process are cleaned up.
#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    /// A flag has a bad value or flags do not go together.
    #[error("{0}")]
    Usage(String),
    /// The command line could not be parsed (or `--help`/`--version` was asked for).
    #[error("{0}")]
    Clap(clap::Error),
    /// A verbs call failed.
    #[error("{what}: {source}")]
    Engine {
        /// What was being done.
        what: String,
        /// The engine's error.
        #[source]
        source: shmhca::Error,
    },
    /// The peer runs with other parameters.
    #[error("the peer runs with other parameters: {0}; run both sides with the same flags")]
    Mismatch(String),
    /// The peer is not shmhca-perf.
    #[error("{0}")]
    NotPerf(String),
    /// The peer went away during the run.
    #[error("the peer went away: {0}")]
    PeerGone(String),
    /// The peer stopped with an error and said which (its abort message on the control
    /// channel).
    #[error("the peer stopped with an error: {0}")]
    PeerFailed(String),
    /// The peer sent nothing for `--idle-timeout` seconds (stopped or hung).
    #[error("the peer is silent: {0}")]
    PeerIdle(String),
    /// A work completion reported an error.
    #[error("{what} completed with status {status:?}")]
    Completion {
        /// Which operation.
        what: &'static str,
        /// Its status.
        status: shmhca::WcStatus,
    },
    /// The run completed nothing it could measure (a `-D` run whose measurement window
    /// closed with no completion in it).
    #[error("nothing measured: {0}")]
    NothingMeasured(String),
    /// A check of the data moved failed.
    #[error("data check failed: {0}")]
    Check(String),
    /// Starting or talking to the peer process failed.
    #[error("{0}")]
    Peer(String),
    /// An operating-system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl PerfError {
    /// Wraps a verbs error with what was being done. The description becomes a `String`
    /// only if there is an error: the measurement loops call this on every post, and a
    /// `&'static str` costs nothing until then.
    pub fn engine(what: impl Into<String>) -> impl FnOnce(shmhca::Error) -> PerfError {
        move |source| PerfError::Engine {
            what: what.into(),
            source,
        }
    }

    /// Wraps an I/O error with what was being done (converted only on error, as
    /// [`PerfError::engine`]).
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> PerfError {
        move |source| PerfError::Io {
            what: what.into(),
            source,
        }
    }
}
