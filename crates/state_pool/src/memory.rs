//! The small device-memory trait the pool allocates through, and its host implementation.

use crate::error::{PoolError, Result};

/// Byte-addressed device memory: what the pool needs to own its planes, zero fresh slots,
/// copy slots into checkpoint slots and export/import images. The GPU backends implement it
/// for their device buffers; [`HostMemory`] implements it for host memory.
pub trait DeviceMemory: Send + Sync {
    /// One allocation.
    type Buffer: Send + Sync;

    /// A short name for logs and errors (`host`, `cuda`).
    fn name(&self) -> &'static str;
    /// Allocates `bytes` zeroed bytes (`bytes` may be 0).
    fn alloc_zeroed(&self, bytes: usize) -> Result<Self::Buffer>;
    /// Length of a buffer in bytes.
    fn len(&self, buf: &Self::Buffer) -> usize;
    /// Copies `src` into `dst[offset..offset + src.len()]`.
    fn write(&self, dst: &mut Self::Buffer, offset: usize, src: &[u8]) -> Result<()>;
    /// Copies `src[offset..offset + dst.len()]` into `dst`.
    fn read(&self, src: &Self::Buffer, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// Zeroes `buf[offset..offset + len]`.
    fn zero(&self, buf: &mut Self::Buffer, offset: usize, len: usize) -> Result<()>;
    /// Copies `len` bytes from `src_offset` to `dst_offset` inside one buffer (ranges must not
    /// overlap).
    fn copy_within(
        &self,
        buf: &mut Self::Buffer,
        src_offset: usize,
        dst_offset: usize,
        len: usize,
    ) -> Result<()>;
}

/// Checks that `offset..offset + len` lies inside a buffer of `size` bytes.
pub fn check_range(what: &'static str, offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(PoolError::Memory(format!(
            "{what}: range {offset}..{} is outside a buffer of {size} bytes",
            offset.saturating_add(len)
        ))),
    }
}

/// A host allocation, 8-byte aligned so it can be viewed as `f32`, `f16`, `bf16`, `u32`.
#[derive(Clone, Default)]
pub struct HostBuffer {
    words: Vec<u64>,
    len: usize,
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBuffer({} bytes)", self.len)
    }
}

impl HostBuffer {
    /// A zeroed buffer of `len` bytes.
    pub fn zeroed(len: usize) -> Self {
        Self {
            words: vec![0; len.div_ceil(8)],
            len,
        }
    }

    /// A buffer holding a copy of `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        let mut b = Self::zeroed(bytes.len());
        b.bytes_mut().copy_from_slice(bytes);
        b
    }

    /// A buffer holding a copy of `values`.
    pub fn from_slice<T: bytemuck::Pod>(values: &[T]) -> Self {
        Self::from_bytes(bytemuck::cast_slice(values))
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    /// The bytes, mutable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// A typed view (`len` must be a multiple of `size_of::<T>()`).
    pub fn typed<T: bytemuck::Pod>(&self) -> &[T] {
        bytemuck::cast_slice(self.bytes())
    }

    /// A typed mutable view (`len` must be a multiple of `size_of::<T>()`).
    pub fn typed_mut<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.bytes_mut())
    }
}

/// Host memory: the pool's planes in ordinary RAM (the CPU backend's memory).
#[derive(Debug, Clone, Copy, Default)]
pub struct HostMemory;

impl DeviceMemory for HostMemory {
    type Buffer = HostBuffer;

    fn name(&self) -> &'static str {
        "host"
    }

    fn alloc_zeroed(&self, bytes: usize) -> Result<HostBuffer> {
        Ok(HostBuffer::zeroed(bytes))
    }

    fn len(&self, buf: &HostBuffer) -> usize {
        buf.len()
    }

    fn write(&self, dst: &mut HostBuffer, offset: usize, src: &[u8]) -> Result<()> {
        check_range("write", offset, src.len(), dst.len())?;
        dst.bytes_mut()[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn read(&self, src: &HostBuffer, offset: usize, dst: &mut [u8]) -> Result<()> {
        check_range("read", offset, dst.len(), src.len())?;
        dst.copy_from_slice(&src.bytes()[offset..offset + dst.len()]);
        Ok(())
    }

    fn zero(&self, buf: &mut HostBuffer, offset: usize, len: usize) -> Result<()> {
        check_range("zero", offset, len, buf.len())?;
        buf.bytes_mut()[offset..offset + len].fill(0);
        Ok(())
    }

    fn copy_within(
        &self,
        buf: &mut HostBuffer,
        src_offset: usize,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_range("copy source", src_offset, len, buf.len())?;
        check_range("copy destination", dst_offset, len, buf.len())?;
        if src_offset < dst_offset + len && dst_offset < src_offset + len {
            return Err(PoolError::Memory(format!(
                "copy ranges overlap: {src_offset}..{} and {dst_offset}..{}",
                src_offset + len,
                dst_offset + len
            )));
        }
        buf.bytes_mut()
            .copy_within(src_offset..src_offset + len, dst_offset);
        Ok(())
    }
}
