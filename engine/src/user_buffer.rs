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
/// for `Vec<u8>`, `Box<[u8]>`, [`memmap2::MmapMut`] and [`Memfd`](crate::Memfd).
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
