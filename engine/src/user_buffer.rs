//! What memory an application can register: the sealed [`UserBuffer`] trait and its
//! implementations for heap buffers and anonymous mappings (a memfd's is beside
//! [`Memfd`](crate::Memfd)). A leaf: the memory layer below and the registration code above
//! both name it.

/// The seal: only this crate implements [`UserBuffer`].
pub(crate) mod sealed {
    /// Implemented for the buffer types shmhca accepts, by shmhca only.
    pub trait Sealed {}
}

/// Memory [`Pd::reg_mr`](crate::Pd::reg_mr) can register: a buffer whose bytes stay at one
/// address however the value moves (a heap allocation or a mapping). Sealed: implemented
/// for `Vec<u8>`, `Box<[u8]>`, [`memmap2::MmapMut`], [`Memfd`](crate::Memfd) and
/// [`RawBuffer`].
pub trait UserBuffer: sealed::Sealed + Send + std::fmt::Debug + 'static {
    /// Its length in bytes.
    fn byte_len(&self) -> usize;
    /// Whether only this process can write the bytes (false for a memfd, which another
    /// holder of the file could map writable): only then may the registered region hand
    /// out a mutable slice.
    #[doc(hidden)]
    fn exclusive(&self) -> bool {
        true
    }
    /// Start and length of the bytes (taken once, at registration).
    #[doc(hidden)]
    fn raw_parts(&mut self) -> (*mut u8, usize);
}

impl sealed::Sealed for Vec<u8> {}
impl UserBuffer for Vec<u8> {
    fn byte_len(&self) -> usize {
        self.len()
    }
    fn raw_parts(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

impl sealed::Sealed for Box<[u8]> {}
impl UserBuffer for Box<[u8]> {
    fn byte_len(&self) -> usize {
        self.len()
    }
    fn raw_parts(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

impl sealed::Sealed for memmap2::MmapMut {}
impl UserBuffer for memmap2::MmapMut {
    fn byte_len(&self) -> usize {
        self.len()
    }
    fn exclusive(&self) -> bool {
        // A file mapping may be shared with other writers; `MmapMut::map_mut` is `unsafe`
        // for that reason, and `map_anon` is not. The region cannot tell them apart.
        false
    }
    fn raw_parts(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

/// Memory the caller vouches for by address and length — a C program's buffer registered
/// through shmhca's libibverbs (`ibv_reg_mr` over any pointer) — to register with
/// [`Pd::reg_mr`](crate::Pd::reg_mr). Nothing is freed when it is dropped: the memory stays
/// the caller's.
///
/// Like any registered buffer it is written in place (received data, RDMA Write and Atomic
/// targets) and read through the region's shadow. It may be written by others than this
/// process (a C program's buffer can be a shared mapping), so the region never hands out a
/// mutable slice of it.
#[derive(Debug)]
pub struct RawBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a `RawBuffer` is an address and a length; the memory they name is accessed only
// through the engine's views (`Mem`), which are shared between threads by design, and
// whoever made it vouched (`RawBuffer::new`) that the memory stays valid on any thread.
#[allow(unsafe_code)]
unsafe impl Send for RawBuffer {}

impl RawBuffer {
    /// The `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The bytes must stay mapped, readable and writable (by this process) until the
    /// region registered over them is deregistered and every view of it dropped (the
    /// [`UserMr`](crate::UserMr) is dropped or [`into_inner`](crate::UserMr::into_inner)
    /// succeeds), and the caller must not rely on Rust's aliasing rules for them (they are
    /// written by the engine at any time while registered, like memory a NIC writes).
    #[allow(unsafe_code)]
    pub unsafe fn new(ptr: *mut u8, len: usize) -> RawBuffer {
        RawBuffer { ptr, len }
    }
}

impl sealed::Sealed for RawBuffer {}
impl UserBuffer for RawBuffer {
    fn byte_len(&self) -> usize {
        self.len
    }
    fn exclusive(&self) -> bool {
        false
    }
    fn raw_parts(&mut self) -> (*mut u8, usize) {
        (self.ptr, self.len)
    }
}
