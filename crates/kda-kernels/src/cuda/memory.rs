//! Device memory for the pool: [`CudaMemory`] implements [`state_pool::DeviceMemory`] over
//! cudarc allocations on the backend's stream, and over device memory another library owns
//! ([`CudaMemory::borrow`]: a serving engine's tensors, read and written in place). All copies
//! are ordered on that one stream; reads wait for it, so a read sees every kernel enqueued
//! before it.

use std::sync::Arc;

use cudarc::driver::{result, CudaSlice, CudaStream, DevicePtr};
use state_pool::memory::check_range;
use state_pool::{DeviceMemory, PoolError};

use crate::error::{KernelError, Result};

/// One device buffer: an allocation of its [`CudaMemory`] (freed with the buffer; a 0-byte
/// buffer holds none, the driver refuses 0 bytes) or borrowed device memory
/// ([`CudaMemory::borrow`], never freed here).
pub struct CudaBuffer {
    storage: Storage,
    len: usize,
}

/// Where a [`CudaBuffer`]'s bytes are.
enum Storage {
    /// No bytes.
    Empty,
    /// An allocation of this memory.
    Owned(CudaSlice<u8>),
    /// Device memory of another owner, at this address.
    Borrowed(u64),
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = if matches!(self.storage, Storage::Borrowed(_)) {
            ", borrowed"
        } else {
            ""
        };
        write!(f, "CudaBuffer({} bytes{how})", self.len)
    }
}

impl CudaBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the buffer is borrowed device memory ([`CudaMemory::borrow`]).
    pub fn is_borrowed(&self) -> bool {
        matches!(self.storage, Storage::Borrowed(_))
    }

    /// The device address of the first byte (0 for an empty buffer).
    pub(crate) fn device_ptr(&self, stream: &CudaStream) -> u64 {
        match &self.storage {
            Storage::Owned(s) => {
                let (ptr, _sync) = s.device_ptr(stream);
                ptr
            }
            Storage::Borrowed(ptr) => *ptr,
            Storage::Empty => 0,
        }
    }
}

/// The alignment of borrowed device memory: the kernels read and write rows as 16-byte
/// vectors and bulk copies, from addresses they take to be 16-byte aligned (the driver's
/// allocations are 256-byte aligned).
pub const BORROW_ALIGN: u64 = 16;

/// The device memory of one CUDA context, used through one stream.
#[derive(Clone)]
pub struct CudaMemory {
    stream: Arc<CudaStream>,
}

impl std::fmt::Debug for CudaMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaMemory(device {})", self.stream.context().ordinal())
    }
}

fn mem_err(what: &str, e: impl std::fmt::Display) -> PoolError {
    PoolError::Memory(format!("cuda {what}: {e}"))
}

impl CudaMemory {
    pub(crate) fn new(stream: Arc<CudaStream>) -> Self {
        Self { stream }
    }

    /// The stream every copy and kernel of this memory runs on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A buffer holding a copy of `bytes`.
    pub fn upload(&self, bytes: &[u8]) -> state_pool::Result<CudaBuffer> {
        let mut b = self.alloc_zeroed(bytes.len())?;
        self.write(&mut b, 0, bytes)?;
        Ok(b)
    }

    /// A buffer holding a copy of `values`.
    pub fn upload_slice<T: bytemuck::Pod>(&self, values: &[T]) -> state_pool::Result<CudaBuffer> {
        self.upload(bytemuck::cast_slice(values))
    }

    /// A buffer holding a copy of `values`, filled without waiting for the stream
    /// ([`CudaMemory::write_staged`]; `values` must be pageable memory).
    pub(crate) fn upload_staged<T: bytemuck::Pod>(
        &self,
        values: &[T],
    ) -> state_pool::Result<CudaBuffer> {
        let bytes: &[u8] = bytemuck::cast_slice(values);
        let mut b = self.alloc_zeroed(bytes.len())?;
        self.write_staged(&mut b, 0, bytes)?;
        Ok(b)
    }

    /// Copies `src` into `dst` at `offset`, ordered on the stream like every copy, without
    /// the wait of [`DeviceMemory::write`]: from pageable memory the driver returns once it
    /// has staged the bytes (CUDA's documented behaviour for asynchronous copies; it may wait
    /// for the stream to do so), so `src` may be reused at once. `src` must be pageable (a
    /// `Vec` or slice of this crate's own, as the batches' bounds and slots): from pinned
    /// memory the copy would still be reading it after the return.
    pub(crate) fn write_staged(
        &self,
        dst: &mut CudaBuffer,
        offset: usize,
        src: &[u8],
    ) -> state_pool::Result<()> {
        check_range("write", offset, src.len(), dst.len)?;
        if src.is_empty() {
            return Ok(());
        }
        let at = dst.device_ptr(&self.stream) + offset as u64;
        self.bind("write")?;
        // SAFETY: the range lies inside the buffer's bytes (checked above: an allocation, or
        // borrowed bytes that `borrow`'s caller keeps valid); the copy is ordered on the
        // stream, and the driver has taken `src`'s bytes when it returns (a pageable source,
        // the caller's contract; `write` waits for the stream besides).
        unsafe { result::memcpy_htod_async(at, src, self.stream.cu_stream()) }
            .map_err(|e| mem_err("write", e))
    }

    /// The whole buffer copied to the host.
    pub fn download(&self, buf: &CudaBuffer) -> state_pool::Result<Vec<u8>> {
        let mut v = vec![0u8; buf.len];
        self.read(buf, 0, &mut v)?;
        Ok(v)
    }

    /// A buffer over the `len` bytes of device memory at `ptr`, which another library owns (a
    /// serving engine's tensor: `data_ptr()` and its size in bytes), so the kernels read their
    /// inputs from it and write their outputs into it in place, with no copy; the memory's
    /// copies (`write`, `read`, `zero`, `copy_within`) work on it too. Dropping the buffer frees
    /// nothing. `ptr` must be a multiple of [`BORROW_ALIGN`] (else
    /// [`KernelError::InvalidArgument`], and no buffer); `len` 0 gives an empty buffer.
    ///
    /// # Safety
    ///
    /// `ptr .. ptr + len` must be device memory of this memory's device, valid for reads and
    /// writes for as long as the buffer is used, including by work still queued on this
    /// memory's stream; the caller orders any other work on those bytes with that stream (the
    /// simplest: the engine's stream is the backend's, `CudaBackend::on_stream`).
    pub unsafe fn borrow(&self, ptr: u64, len: usize) -> Result<CudaBuffer> {
        if len == 0 {
            return Ok(CudaBuffer {
                storage: Storage::Empty,
                len: 0,
            });
        }
        if ptr == 0 || !ptr.is_multiple_of(BORROW_ALIGN) {
            return Err(KernelError::arg(
                "ptr",
                format!(
                    "{ptr:#x} is not accepted; expected a non-null device address that is a multiple of {BORROW_ALIGN}"
                ),
            ));
        }
        if ptr.checked_add(len as u64).is_none() {
            return Err(KernelError::arg(
                "len",
                format!("{len} bytes from {ptr:#x} run past the end of the address space"),
            ));
        }
        Ok(CudaBuffer {
            storage: Storage::Borrowed(ptr),
            len,
        })
    }

    /// Binds the stream's context to this thread (the raw copies below need it current).
    fn bind(&self, what: &str) -> state_pool::Result<()> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| mem_err(what, e))
    }
}

impl DeviceMemory for CudaMemory {
    type Buffer = CudaBuffer;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc_zeroed(&self, bytes: usize) -> state_pool::Result<CudaBuffer> {
        if bytes == 0 {
            return Ok(CudaBuffer {
                storage: Storage::Empty,
                len: 0,
            });
        }
        let slice = self
            .stream
            .alloc_zeros::<u8>(bytes)
            .map_err(|e| mem_err("alloc", e))?;
        Ok(CudaBuffer {
            storage: Storage::Owned(slice),
            len: bytes,
        })
    }

    fn len(&self, buf: &CudaBuffer) -> usize {
        buf.len
    }

    fn write(&self, dst: &mut CudaBuffer, offset: usize, src: &[u8]) -> state_pool::Result<()> {
        self.write_staged(dst, offset, src)?;
        // `src` may be pinned memory, which the copy reads until it is done: wait for it, so
        // the caller may reuse `src` at once.
        if !src.is_empty() {
            self.stream.synchronize().map_err(|e| mem_err("write", e))?;
        }
        Ok(())
    }

    fn read(&self, src: &CudaBuffer, offset: usize, dst: &mut [u8]) -> state_pool::Result<()> {
        check_range("read", offset, dst.len(), src.len)?;
        if dst.is_empty() {
            return Ok(());
        }
        let at = src.device_ptr(&self.stream) + offset as u64;
        self.bind("read")?;
        // SAFETY: as in `write`; `dst` is not touched until the stream is synchronised below.
        unsafe { result::memcpy_dtoh_async(dst, at, self.stream.cu_stream()) }
            .map_err(|e| mem_err("read", e))?;
        self.stream.synchronize().map_err(|e| mem_err("read", e))
    }

    fn zero(&self, buf: &mut CudaBuffer, offset: usize, len: usize) -> state_pool::Result<()> {
        check_range("zero", offset, len, buf.len)?;
        if len == 0 {
            return Ok(());
        }
        let at = buf.device_ptr(&self.stream) + offset as u64;
        self.bind("zero")?;
        // SAFETY: as in `write`; ordered on the stream.
        unsafe { result::memset_d8_async(at, 0, len, self.stream.cu_stream()) }
            .map_err(|e| mem_err("zero", e))
    }

    fn copy_within(
        &self,
        buf: &mut CudaBuffer,
        src_offset: usize,
        dst_offset: usize,
        len: usize,
    ) -> state_pool::Result<()> {
        check_range("copy source", src_offset, len, buf.len)?;
        check_range("copy destination", dst_offset, len, buf.len)?;
        if src_offset < dst_offset + len && dst_offset < src_offset + len {
            return Err(PoolError::Memory(format!(
                "copy ranges overlap: {src_offset}..{} and {dst_offset}..{}",
                src_offset + len,
                dst_offset + len
            )));
        }
        if len == 0 {
            return Ok(());
        }
        let base = buf.device_ptr(&self.stream);
        self.bind("copy")?;
        // SAFETY: both ranges lie inside the buffer's bytes (checked above: an allocation, or
        // borrowed bytes that `borrow`'s caller keeps valid) and do not overlap; the copy is
        // ordered on the stream every other use of the buffer goes through.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                base + dst_offset as u64,
                base + src_offset as u64,
                len,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| mem_err("copy", e))
    }
}
