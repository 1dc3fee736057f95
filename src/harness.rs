//! Running KDA operations on any [`Backend`] from host data: tensors uploaded to the backend's
//! memory, a one-layer pool whose slots are written and read as f32, and snapshots of a layer.

use kda_kernels::{api::Buf, Backend, KdaOptions, Result, StepInputs, TensorView, TensorViewMut};
use state_pool::{DeviceMemory, Dtype, LayerPlanes, PoolGeometry};

use crate::inputs::{GateParams, Tokens};

/// A tensor in a backend's memory.
pub struct DeviceTensor<B: Backend> {
    buf: Buf<B>,
    /// Element type.
    pub dtype: Dtype,
    /// Number of elements.
    pub len: usize,
}

impl<B: Backend> DeviceTensor<B> {
    /// Uploads `bytes`, `len` elements of `dtype`.
    pub fn from_bytes(be: &B, bytes: &[u8], dtype: Dtype, len: usize) -> Result<Self> {
        let mem = be.memory();
        let mut buf = mem.alloc_zeroed(bytes.len())?;
        mem.write(&mut buf, 0, bytes)?;
        Ok(Self { buf, dtype, len })
    }

    /// Uploads `values` converted to `dtype` (round to nearest even).
    pub fn from_f32(be: &B, values: &[f32], dtype: Dtype) -> Result<Self> {
        Self::from_bytes(be, &dtype.encode_f32(values), dtype, values.len())
    }

    /// A tensor of `len` NaNs: an output buffer whose unwritten elements show.
    pub fn poisoned(be: &B, dtype: Dtype, len: usize) -> Result<Self> {
        Self::from_f32(be, &vec![f32::NAN; len], dtype)
    }

    /// Overwrites the tensor with `bytes` (its whole size).
    pub fn overwrite(&mut self, be: &B, bytes: &[u8]) -> Result<()> {
        be.memory().write(&mut self.buf, 0, bytes)?;
        Ok(())
    }

    /// The read-only view the backend takes.
    pub fn view(&self) -> TensorView<'_, Buf<B>> {
        TensorView {
            buf: &self.buf,
            dtype: self.dtype,
            len: self.len,
        }
    }

    /// The writable view the backend takes.
    pub fn view_mut(&mut self) -> TensorViewMut<'_, Buf<B>> {
        TensorViewMut {
            buf: &mut self.buf,
            dtype: self.dtype,
            len: self.len,
        }
    }

    /// Downloads the raw bytes.
    pub fn to_bytes(&self, be: &B) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.len * self.dtype.size()];
        be.memory().read(&self.buf, 0, &mut out)?;
        Ok(out)
    }

    /// Downloads the values, up-cast to f32.
    pub fn to_f32(&self, be: &B) -> Result<Vec<f32>> {
        Ok(self.dtype.decode_f32(&self.to_bytes(be)?))
    }
}

/// The per-token input tensors of one call in a backend's memory.
pub struct DeviceInputs<B: Backend> {
    /// `[T, H, K]`.
    pub q: DeviceTensor<B>,
    /// `[T, H, K]`.
    pub k: DeviceTensor<B>,
    /// `[T, HV, V]`.
    pub v: DeviceTensor<B>,
    /// `[T, HV, K]`.
    pub g: DeviceTensor<B>,
    /// `[T, HV]`.
    pub beta: DeviceTensor<B>,
}

impl<B: Backend> DeviceInputs<B> {
    /// Uploads `tokens` as tensors of `dtype`.
    pub fn upload(be: &B, tokens: &Tokens, dtype: Dtype) -> Result<Self> {
        Ok(Self {
            q: DeviceTensor::from_f32(be, &tokens.q, dtype)?,
            k: DeviceTensor::from_f32(be, &tokens.k, dtype)?,
            v: DeviceTensor::from_f32(be, &tokens.v, dtype)?,
            g: DeviceTensor::from_f32(be, &tokens.g, dtype)?,
            beta: DeviceTensor::from_f32(be, &tokens.beta, dtype)?,
        })
    }

    /// The views the backend takes, with the layer's gate parameters.
    pub fn view<'a>(&'a self, params: &'a DeviceParams<B>) -> StepInputs<'a, Buf<B>> {
        StepInputs {
            q: self.q.view(),
            k: self.k.view(),
            v: self.v.view(),
            g: self.g.view(),
            beta: self.beta.view(),
            a_log: params.a_log.as_ref().map(DeviceTensor::view),
            dt_bias: params.dt_bias.as_ref().map(DeviceTensor::view),
        }
    }
}

/// A layer's gate parameters in a backend's memory (f32), when the kernel activates the gate.
pub struct DeviceParams<B: Backend> {
    /// `[HV]`.
    pub a_log: Option<DeviceTensor<B>>,
    /// `[HV * K]`.
    pub dt_bias: Option<DeviceTensor<B>>,
}

impl<B: Backend> DeviceParams<B> {
    /// Uploads `params` as f32.
    pub fn upload(be: &B, params: &GateParams) -> Result<Self> {
        Ok(Self {
            a_log: Some(DeviceTensor::from_f32(be, &params.a_log, Dtype::Fp32)?),
            dt_bias: Some(DeviceTensor::from_f32(be, &params.dt_bias, Dtype::Fp32)?),
        })
    }
}

/// The host copy of a layer's planes and store epoch (see [`DeviceLayer::snapshot`]).
pub struct LayerSnapshot {
    ssm: Vec<u8>,
    ring: Vec<u8>,
    meta: Vec<u8>,
    epoch: u64,
}

/// One layer of a pool in a backend's memory, with its geometry.
pub struct DeviceLayer<B: Backend> {
    /// The pool's geometry.
    pub geometry: PoolGeometry,
    planes: LayerPlanes<Buf<B>>,
}

impl<B: Backend> DeviceLayer<B> {
    /// Allocates layer 0 of a pool of `geometry`, every plane zeroed.
    pub fn new(be: &B, geometry: PoolGeometry) -> Result<Self> {
        let planes = LayerPlanes::new(be.memory(), &geometry, 0)?;
        Ok(Self { geometry, planes })
    }

    /// Writes `values` (`HV * K * V` f32 in the pool's layout) into `slot`'s state, rounded
    /// to nearest in the pool's dtype.
    pub fn write_state(&mut self, be: &B, slot: usize, values: &[f32]) -> Result<()> {
        let bytes = self.geometry.state_dtype.encode_f32(values);
        let offset = slot * self.geometry.ssm_slot_bytes();
        be.memory().write(&mut self.planes.ssm, offset, &bytes)?;
        Ok(())
    }

    /// Reads `slot`'s committed state as f32 (`HV * K * V` in the pool's layout).
    pub fn read_state(&self, be: &B, slot: usize) -> Result<Vec<f32>> {
        let mut bytes = vec![0u8; self.geometry.ssm_slot_bytes()];
        let offset = slot * self.geometry.ssm_slot_bytes();
        be.memory().read(&self.planes.ssm, offset, &mut bytes)?;
        Ok(self.geometry.state_dtype.decode_f32(&bytes))
    }

    /// Varlen prefill of `batch`.
    pub fn prefill(
        &mut self,
        be: &B,
        batch: &B::Batch,
        inputs: &DeviceInputs<B>,
        params: &DeviceParams<B>,
        opts: &KdaOptions,
        out: &mut DeviceTensor<B>,
    ) -> Result<()> {
        let mut layer = self.planes.view(&self.geometry);
        be.prefill(
            batch,
            &inputs.view(params),
            opts,
            &mut layer,
            &mut out.view_mut(),
        )
    }

    /// One decode step of `batch` (one token per sequence).
    pub fn decode(
        &mut self,
        be: &B,
        batch: &B::Batch,
        inputs: &DeviceInputs<B>,
        params: &DeviceParams<B>,
        opts: &KdaOptions,
        out: &mut DeviceTensor<B>,
    ) -> Result<()> {
        let mut layer = self.planes.view(&self.geometry);
        be.decode(
            batch,
            &inputs.view(params),
            opts,
            &mut layer,
            &mut out.view_mut(),
        )
    }

    /// Flushes the rings of `batch`'s slots (a batch of empty sequences).
    pub fn replay(
        &mut self,
        be: &B,
        batch: &B::Batch,
        params: &DeviceParams<B>,
        opts: &KdaOptions,
    ) -> Result<()> {
        let mut layer = self.planes.view(&self.geometry);
        let a_log = params.a_log.as_ref().map(DeviceTensor::view);
        let dt_bias = params.dt_bias.as_ref().map(DeviceTensor::view);
        be.replay(
            batch,
            None,
            opts,
            a_log.as_ref(),
            dt_bias.as_ref(),
            &mut layer,
        )
    }

    /// Copies the layer's planes and epoch to the host.
    pub fn snapshot(&self, be: &B) -> Result<LayerSnapshot> {
        let mem = be.memory();
        let read = |buf: &Buf<B>| -> Result<Vec<u8>> {
            let mut bytes = vec![0u8; mem.len(buf)];
            mem.read(buf, 0, &mut bytes)?;
            Ok(bytes)
        };
        Ok(LayerSnapshot {
            ssm: read(&self.planes.ssm)?,
            ring: read(&self.planes.ring)?,
            meta: read(&self.planes.meta)?,
            epoch: self.planes.epoch,
        })
    }

    /// Puts back a snapshot taken of this layer: the layer is as it was then.
    pub fn restore(&mut self, be: &B, snap: &LayerSnapshot) -> Result<()> {
        let mem = be.memory();
        mem.write(&mut self.planes.ssm, 0, &snap.ssm)?;
        mem.write(&mut self.planes.ring, 0, &snap.ring)?;
        mem.write(&mut self.planes.meta, 0, &snap.meta)?;
        self.planes.epoch = snap.epoch;
        Ok(())
    }
}
