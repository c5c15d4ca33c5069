//! A non-local address is refused with EADDRNOTAVAIL by `rdma_resolve_addr` and
//! `rdma_bind_addr`, called through the C ABI of the built `librdmacm.so.1` (loaded with
//! `dlopen`; neither call reaches the verbs library).
#![allow(clippy::multiple_unsafe_ops_per_block)] // FFI calls, each block SAFETY-commented

use std::ffi::{CString, c_int, c_void};
use std::path::{Path, PathBuf};

fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

fn sym(lib: *mut c_void, name: &str) -> *mut c_void {
    let n = CString::new(name).unwrap();
    // SAFETY: a handle from dlopen and a C string.
    let p = unsafe { libc::dlsym(lib, n.as_ptr()) };
    assert!(!p.is_null(), "{name} not exported");
    p
}

fn sockaddr_in(ip: [u8; 4], port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_be_bytes(ip).to_be(),
        },
        sin_zero: [0; 8],
    }
}

#[test]
fn non_local_addresses_are_refused_with_eaddrnotavail() {
    let path = target_dir().join("librdmacm.so.1");
    if !path.exists() {
        // A cdylib only: `cargo test` does not build it, `cargo build` does.
        let msg = format!(
            "{} is not built (cargo build -p shmhca-verbs -p shmhca-rdmacm)",
            path.display()
        );
        if std::env::var_os("SHMHCA_REQUIRE_VERBS_TOOLS").is_some_and(|v| v == "1") {
            panic!("{msg}, and SHMHCA_REQUIRE_VERBS_TOOLS=1 requires it");
        }
        eprintln!("skipped: {msg}");
        return;
    }
    let c = CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: loading our library (its constructors are Rust's only).
    let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!lib.is_null(), "dlopen {}", path.display());
    type CreateChannel = unsafe extern "C" fn() -> *mut c_void;
    type DestroyChannel = unsafe extern "C" fn(*mut c_void);
    type CreateId =
        unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut c_void, c_int) -> c_int;
    type DestroyId = unsafe extern "C" fn(*mut c_void) -> c_int;
    type Resolve = unsafe extern "C" fn(*mut c_void, *mut c_void, *mut c_void, c_int) -> c_int;
    type Bind = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;
    // SAFETY: the exported functions have these C signatures (rdma_cma.h).
    let (create_channel, destroy_channel, create_id, destroy_id, resolve, bind) = unsafe {
        (
            std::mem::transmute::<*mut c_void, CreateChannel>(sym(
                lib,
                "rdma_create_event_channel",
            )),
            std::mem::transmute::<*mut c_void, DestroyChannel>(sym(
                lib,
                "rdma_destroy_event_channel",
            )),
            std::mem::transmute::<*mut c_void, CreateId>(sym(lib, "rdma_create_id")),
            std::mem::transmute::<*mut c_void, DestroyId>(sym(lib, "rdma_destroy_id")),
            std::mem::transmute::<*mut c_void, Resolve>(sym(lib, "rdma_resolve_addr")),
            std::mem::transmute::<*mut c_void, Bind>(sym(lib, "rdma_bind_addr")),
        )
    };
    const RDMA_PS_TCP: c_int = 0x0106;
    // SAFETY: the C API as documented; every pointer is valid for the call.
    unsafe {
        let ch = create_channel();
        assert!(!ch.is_null());
        let mut id = std::ptr::null_mut();
        assert_eq!(create_id(ch, &mut id, std::ptr::null_mut(), RDMA_PS_TCP), 0);
        for ip in [[192, 0, 2, 1], [8, 8, 8, 8]] {
            let mut dst = sockaddr_in(ip, 7471);
            let rc = resolve(id, std::ptr::null_mut(), (&raw mut dst).cast(), 2000);
            let e = std::io::Error::last_os_error().raw_os_error();
            assert_eq!((rc, e), (-1, Some(libc::EADDRNOTAVAIL)), "resolve {ip:?}");
            let mut src = sockaddr_in(ip, 0);
            let rc = bind(id, (&raw mut src).cast());
            let e = std::io::Error::last_os_error().raw_os_error();
            assert_eq!((rc, e), (-1, Some(libc::EADDRNOTAVAIL)), "bind {ip:?}");
        }
        assert_eq!(destroy_id(id), 0);
        destroy_channel(ch);
    }
}
