//! What an RDMA programmer expects of the verbs API: refusals that work with `?` and still
//! hand back what they took, the access rights verbs refuses, and no wait that can never end.

use std::sync::mpsc;
use std::time::Duration;

use shmhca::{AccessFlags, Context, EngineMode, Error};

fn ctx(mode: EngineMode) -> Context {
    Context::builder()
        .mode(mode)
        .arena_size(1 << 20)
        .build()
        .unwrap()
}

/// `?` turns every refusal that hands a value back into `shmhca::Error`.
fn register_and_release(pd: &shmhca::Pd, len: usize) -> shmhca::Result<Vec<u8>> {
    let mr = pd.reg_mr(vec![7u8; len], AccessFlags::LOCAL_WRITE)?;
    let region = pd.alloc_mr(64, AccessFlags::NONE)?;
    region.deregister()?;
    Ok(mr.into_inner()?)
}

#[test]
fn refusals_work_with_the_question_mark_and_give_the_value_back() {
    let c = ctx(EngineMode::Inline);
    let pd = c.alloc_pd().unwrap();
    assert_eq!(register_and_release(&pd, 64).unwrap(), vec![7u8; 64]);
    let err = register_and_release(&pd, 0).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                name: "memory region length",
                ..
            }
        ),
        "{err}"
    );
    // The refusal itself keeps the buffer, names the problem, and is a std error.
    let refused = pd.reg_mr(Vec::<u8>::new(), AccessFlags::NONE).unwrap_err();
    assert!(refused.to_string().contains("1 byte to 2 GiB"), "{refused}");
    let boxed: Box<dyn std::error::Error + Send + Sync> =
        Box::new(pd.reg_mr(Vec::<u8>::new(), AccessFlags::NONE).unwrap_err());
    assert!(
        boxed.to_string().contains("memory region length"),
        "{boxed}"
    );
    assert!(
        format!("{refused:?}").contains("InvalidArgument"),
        "{refused:?}"
    );
    let (buf, why) = refused.into_parts();
    assert!(buf.is_empty());
    assert!(matches!(why, Error::InvalidArgument { .. }));
}

/// The error of a call that must fail.
fn refused<T>(r: shmhca::Result<T>) -> Error {
    match r {
        Ok(_) => panic!("accepted"),
        Err(e) => e,
    }
}

#[test]
fn remote_write_or_atomic_without_local_write_is_refused_as_verbs_does() {
    let c = ctx(EngineMode::Inline);
    let pd = c.alloc_pd().unwrap();
    for rights in [
        AccessFlags::REMOTE_WRITE,
        AccessFlags::REMOTE_ATOMIC,
        AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        AccessFlags::REMOTE_ATOMIC | AccessFlags::MW_BIND,
    ] {
        let err = refused(pd.alloc_mr(64, rights));
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    name: "memory region access",
                    ..
                }
            ) && err.to_string().contains("LOCAL_WRITE"),
            "alloc_mr {rights:?}: {err}"
        );
        let (buf, err) = pd.reg_mr(vec![1u8; 64], rights).unwrap_err().into_parts();
        assert_eq!(buf, vec![1u8; 64], "the buffer comes back as it was");
        assert!(
            err.to_string().contains("LOCAL_WRITE"),
            "reg_mr {rights:?}: {err}"
        );
        // Checked before anything else: this domain's arena is not a memfd of ours.
        let err = refused(pd.reg_mr_at(0, 64, rights));
        assert!(
            err.to_string().contains("LOCAL_WRITE"),
            "reg_mr_at {rights:?}: {err}"
        );
    }
    // With LOCAL_WRITE, or without any remote write right, they are fine.
    for rights in [
        AccessFlags::NONE,
        AccessFlags::REMOTE_READ,
        AccessFlags::MW_BIND,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_ATOMIC,
        AccessFlags::ALL,
    ] {
        pd.alloc_mr(64, rights).unwrap();
        pd.reg_mr(vec![0u8; 64], rights).unwrap();
    }
}

/// Runs `f` on a thread and gives its result, or `None` if it has not returned after a
/// minute (it is then left blocked: on the old code, `get_event` never returned).
fn returns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(60)).ok()
}

#[test]
fn get_event_without_a_queue_to_wait_for_is_an_error_not_a_wait_for_ever() {
    for mode in [EngineMode::Inline, EngineMode::Poll { cpu: None }] {
        let c = ctx(mode);
        let mut channel = c.create_comp_channel().unwrap();
        // A timeout bounds the wait: no error, just no event.
        assert_eq!(
            channel.get_event(Some(Duration::from_millis(1))).unwrap(),
            None
        );
        let got = returns(move || channel.get_event(None)).expect("get_event(None) returned");
        let err = got.unwrap_err();
        assert!(
            err.to_string().contains("no completion queue is attached"),
            "{mode:?}: {err}"
        );
    }
}

#[test]
fn destroying_the_last_queue_ends_a_wait_for_ever() {
    for mode in [EngineMode::Inline, EngineMode::Poll { cpu: None }] {
        let c = ctx(mode);
        let mut channel = c.create_comp_channel().unwrap();
        let mut cq = c.create_cq_with_channel(16, &channel).unwrap();
        cq.req_notify(false).unwrap();
        let (started_tx, started_rx) = mpsc::channel();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            started_tx.send(()).unwrap();
            let _ = tx.send(channel.get_event(None));
        });
        started_rx.recv().unwrap();
        // Whether the waiter is already asleep or not, dropping the queue ends its wait.
        drop(cq);
        let got = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("get_event(None) returned after the queue was destroyed");
        let err = got.unwrap_err();
        assert!(
            err.to_string().contains("no completion queue is attached"),
            "{mode:?}: {err}"
        );
    }
}
