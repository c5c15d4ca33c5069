//! A child made by `fork()` does not count as registered for the sleepers' global barrier
//! (the kernel may not carry the registration over): its wakers keep their SeqCst fence
//! until it makes a context of its own, which registers it again.

use shmhca::{Context, EngineMode};

unsafe extern "C" {
    fn fork() -> i32;
    fn _exit(code: i32) -> !;
}

#[test]
fn a_forked_child_keeps_the_wakers_fence_until_it_registers() {
    let make = || {
        Context::builder()
            .mode(EngineMode::Inline)
            .huge_pages(shmhca_rings::HugePages::Never)
            .build()
            .unwrap()
    };
    let ctx = make();
    let (registered, barrier) = shmhca::testing::waker_registration();
    assert_eq!(registered, barrier, "a context registers the process");
    if !barrier {
        eprintln!("skipped: this kernel has no membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)");
        return;
    }
    // SAFETY: the child runs only async-signal-safe code (an atomic load and `_exit`)
    // before it exits: no allocation, no lock, no unwinding.
    let pid = unsafe { fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = if shmhca::testing::waker_registration().0 {
            1
        } else {
            0
        };
        // SAFETY: exits the child without running the test harness's code.
        unsafe { _exit(code) };
    }
    let status = rustix::process::waitpid(
        Some(rustix::process::Pid::from_raw(pid).unwrap()),
        rustix::process::WaitOptions::empty(),
    )
    .unwrap()
    .unwrap()
    .1;
    assert_eq!(
        status.exit_status(),
        Some(0),
        "the child took itself for registered"
    );
    assert!(
        shmhca::testing::waker_registration().0,
        "the parent stays registered"
    );
    drop(ctx);
    drop(make());
}
