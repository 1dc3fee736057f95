//! Device memory for the pool: [`CudaMemory`] implements [`state_pool::DeviceMemory`] over
//! cudarc allocations on the backend's stream. All copies are ordered on that one stream; reads
//! wait for it, so a read sees every kernel enqueued before it.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use state_pool::memory::check_range;
use state_pool::{DeviceMemory, PoolError};

/// One device allocation. A 0-byte buffer holds no allocation (the driver refuses 0 bytes).
pub struct CudaBuffer {
    slice: Option<CudaSlice<u8>>,
    len: usize,
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBuffer({} bytes)", self.len)
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

    /// The device address of the first byte (0 for an empty buffer).
    pub(crate) fn device_ptr(&self, stream: &CudaStream) -> u64 {
        match &self.slice {
            Some(s) => {
                let (ptr, _sync) = s.device_ptr(stream);
                ptr
            }
            None => 0,
        }
    }
}

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

    /// The whole buffer copied to the host.
    pub fn download(&self, buf: &CudaBuffer) -> state_pool::Result<Vec<u8>> {
        let mut v = vec![0u8; buf.len];
        self.read(buf, 0, &mut v)?;
        Ok(v)
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
                slice: None,
                len: 0,
            });
        }
        let slice = self
            .stream
            .alloc_zeros::<u8>(bytes)
            .map_err(|e| mem_err("alloc", e))?;
        Ok(CudaBuffer {
            slice: Some(slice),
            len: bytes,
        })
    }

    fn len(&self, buf: &CudaBuffer) -> usize {
        buf.len
    }

    fn write(&self, dst: &mut CudaBuffer, offset: usize, src: &[u8]) -> state_pool::Result<()> {
        check_range("write", offset, src.len(), dst.len)?;
        let Some(slice) = dst.slice.as_mut() else {
            return Ok(());
        };
        if src.is_empty() {
            return Ok(());
        }
        let mut view = slice.slice_mut(offset..offset + src.len());
        self.stream
            .memcpy_htod(src, &mut view)
            .map_err(|e| mem_err("write", e))?;
        // A pageable source: wait, so the caller may reuse it at once.
        self.stream.synchronize().map_err(|e| mem_err("write", e))
    }

    fn read(&self, src: &CudaBuffer, offset: usize, dst: &mut [u8]) -> state_pool::Result<()> {
        check_range("read", offset, dst.len(), src.len)?;
        let Some(slice) = src.slice.as_ref() else {
            return Ok(());
        };
        if dst.is_empty() {
            return Ok(());
        }
        let view = slice.slice(offset..offset + dst.len());
        self.stream
            .memcpy_dtoh(&view, dst)
            .map_err(|e| mem_err("read", e))?;
        self.stream.synchronize().map_err(|e| mem_err("read", e))
    }

    fn zero(&self, buf: &mut CudaBuffer, offset: usize, len: usize) -> state_pool::Result<()> {
        check_range("zero", offset, len, buf.len)?;
        let Some(slice) = buf.slice.as_mut() else {
            return Ok(());
        };
        if len == 0 {
            return Ok(());
        }
        let mut view = slice.slice_mut(offset..offset + len);
        self.stream
            .memset_zeros(&mut view)
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
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| mem_err("copy", e))?;
        // SAFETY: both ranges lie inside the allocation (checked above) and do not overlap; the
        // copy is ordered on the stream every other use of the buffer goes through.
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
