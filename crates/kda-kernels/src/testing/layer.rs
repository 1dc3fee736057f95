//! A one-layer pool in any backend's memory, its states read and written as logical f32,
//! snapshots of its bytes, and guarded runners of the four operations: every run poisons the
//! output first and asserts that every element was written, that the slots not named and the
//! conv plane kept their bytes, and that a refused call changed nothing at all.

use rand::rngs::StdRng;
use rand::Rng;
use state_pool::{DeviceMemory, Dtype, LayerMut, LayerPlanes, PoolGeometry, RingMeta};

use super::data::{batch_plan, HostInputs};
use crate::api::{Backend, Buf, IndexView, KdaOptions, StepInputs, TensorView, TensorViewMut};
use crate::error::Result;

/// Uploads `values` as `dtype` elements.
pub fn upload<M: DeviceMemory>(mem: &M, values: &[f32], dtype: Dtype) -> Result<M::Buffer> {
    upload_bytes(mem, &dtype.encode_f32(values))
}

/// Uploads raw bytes.
pub fn upload_bytes<M: DeviceMemory>(mem: &M, bytes: &[u8]) -> Result<M::Buffer> {
    let mut buf = mem.alloc_zeroed(bytes.len())?;
    mem.write(&mut buf, 0, bytes)?;
    Ok(buf)
}

/// Reads `len` `dtype` elements back as f32.
pub fn download<M: DeviceMemory>(
    mem: &M,
    buf: &M::Buffer,
    dtype: Dtype,
    len: usize,
) -> Result<Vec<f32>> {
    let mut bytes = vec![0u8; len * dtype.size()];
    mem.read(buf, 0, &mut bytes)?;
    Ok(dtype.decode_f32(&bytes))
}

/// The inputs of one call uploaded to a backend's memory.
pub struct DeviceInputs<Bf> {
    /// `[T, H, K]`.
    pub q: Bf,
    /// `[T, H, K]`.
    pub k: Bf,
    /// `[T, HV, V]`.
    pub v: Bf,
    /// `[T, HV, K]`.
    pub g: Bf,
    /// `[T, HV]`.
    pub beta: Bf,
    /// `[HV]` f32.
    pub a_log: Bf,
    /// `[HV * K]` f32.
    pub dt_bias: Bf,
    /// Element type of the token inputs.
    pub dtype: Dtype,
    /// Lengths of q, v, g, beta, a_log, dt_bias.
    lens: [usize; 6],
    /// Whether the views carry `A_log` and `dt_bias`.
    pub with_gate_params: bool,
}

impl<Bf> DeviceInputs<Bf> {
    /// Uploads `host`; the views carry the gate parameters when `opts` needs them.
    pub fn upload<M: DeviceMemory<Buffer = Bf>>(
        mem: &M,
        host: &HostInputs,
        opts: &KdaOptions,
    ) -> Result<Self> {
        let d = host.dtype;
        Ok(Self {
            q: upload(mem, &host.q, d)?,
            k: upload(mem, &host.k, d)?,
            v: upload(mem, &host.v, d)?,
            g: upload(mem, &host.g, d)?,
            beta: upload(mem, &host.beta, d)?,
            a_log: upload(mem, &host.a_log, Dtype::Fp32)?,
            dt_bias: upload(mem, &host.dt_bias, Dtype::Fp32)?,
            dtype: d,
            lens: [
                host.q.len(),
                host.v.len(),
                host.g.len(),
                host.beta.len(),
                host.a_log.len(),
                host.dt_bias.len(),
            ],
            with_gate_params: opts.needs_gate_params(),
        })
    }

    /// The view an operation takes.
    pub fn view(&self) -> StepInputs<'_, Bf> {
        let [lq, lv, lg, lb, la, ld] = self.lens;
        let t = |buf, len| TensorView {
            buf,
            dtype: self.dtype,
            len,
        };
        let f = |buf, len| TensorView {
            buf,
            dtype: Dtype::Fp32,
            len,
        };
        StepInputs {
            q: t(&self.q, lq),
            k: t(&self.k, lq),
            v: t(&self.v, lv),
            g: t(&self.g, lg),
            beta: t(&self.beta, lb),
            a_log: self.with_gate_params.then(|| f(&self.a_log, la)),
            dt_bias: self.with_gate_params.then(|| f(&self.dt_bias, ld)),
        }
    }
}

/// All bytes of a layer and its epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The ssm plane.
    pub ssm: Vec<u8>,
    /// The conv plane.
    pub conv: Vec<u8>,
    /// The ring data plane.
    pub ring: Vec<u8>,
    /// The ring bookkeeping plane.
    pub meta: Vec<u8>,
    /// The delta plane.
    pub delta: Vec<u8>,
    /// The store epoch.
    pub epoch: u64,
}

impl Snapshot {
    /// Asserts that `slot`'s ssm, ring, meta and delta bytes are the same in both snapshots.
    pub fn assert_slot_unchanged(
        &self,
        after: &Snapshot,
        g: &PoolGeometry,
        slot: usize,
        why: &str,
    ) {
        for (name, a, b, per) in [
            ("ssm", &self.ssm, &after.ssm, g.ssm_slot_bytes()),
            ("ring", &self.ring, &after.ring, g.ring_slot_bytes()),
            ("meta", &self.meta, &after.meta, g.meta_slot_bytes()),
            ("delta", &self.delta, &after.delta, g.delta_slot_bytes()),
        ] {
            let r = slot * per..(slot + 1) * per;
            assert!(
                a[r.clone()] == b[r],
                "{why}: the {name} bytes of slot {slot} changed"
            );
        }
    }
}

/// One layer of a pool in a backend's memory, with its geometry.
pub struct TestLayer<Bf> {
    /// The geometry.
    pub geometry: PoolGeometry,
    /// The planes.
    pub planes: LayerPlanes<Bf>,
}

impl<Bf> TestLayer<Bf> {
    /// A zeroed layer (layer index 0) of `geometry`.
    pub fn new<M: DeviceMemory<Buffer = Bf>>(mem: &M, geometry: PoolGeometry) -> Result<Self> {
        let planes = LayerPlanes::new(mem, &geometry, 0)?;
        Ok(Self { geometry, planes })
    }

    /// The kernels' view.
    pub fn view(&mut self) -> LayerMut<'_, Bf> {
        self.planes.view(&self.geometry)
    }

    /// The store epoch.
    pub fn epoch(&self) -> u64 {
        self.planes.epoch
    }

    /// Fills the ssm, ring, meta and delta bytes of every slot not in `keep`, and the whole conv
    /// plane, with random bytes.
    pub fn poison<M: DeviceMemory<Buffer = Bf>>(
        &mut self,
        mem: &M,
        keep: &[u32],
        rng: &mut StdRng,
    ) -> Result<()> {
        let g = self.geometry.clone();
        let p = &mut self.planes;
        for slot in 0..g.total_slots() {
            if keep.contains(&(slot as u32)) {
                continue;
            }
            for (buf, per) in [
                (&mut p.ssm, g.ssm_slot_bytes()),
                (&mut p.ring, g.ring_slot_bytes()),
                (&mut p.meta, g.meta_slot_bytes()),
                (&mut p.delta, g.delta_slot_bytes()),
            ] {
                let bytes: Vec<u8> = (0..per).map(|_| rng.random()).collect();
                mem.write(buf, slot * per, &bytes)?;
            }
        }
        let conv: Vec<u8> = (0..mem.len(&p.conv)).map(|_| rng.random()).collect();
        mem.write(&mut p.conv, 0, &conv)?;
        Ok(())
    }

    /// Writes logical `[N][HV][K][V]` f32 states into `slots` (nearest rounding to the state
    /// dtype, the geometry's layout).
    pub fn write_states<M: DeviceMemory<Buffer = Bf>>(
        &mut self,
        mem: &M,
        slots: &[u32],
        states: &[f32],
    ) -> Result<()> {
        let g = &self.geometry;
        let per = g.ssm_slot_elems();
        for (i, &slot) in slots.iter().enumerate() {
            let stored = to_layout(g, &states[i * per..(i + 1) * per]);
            let bytes = g.state_dtype.encode_f32(&stored);
            mem.write(
                &mut self.planes.ssm,
                slot as usize * g.ssm_slot_bytes(),
                &bytes,
            )?;
        }
        Ok(())
    }

    /// Reads the states of `slots` as logical `[N][HV][K][V]` f32 (exact up-cast).
    pub fn read_states<M: DeviceMemory<Buffer = Bf>>(
        &self,
        mem: &M,
        slots: &[u32],
    ) -> Result<Vec<f32>> {
        let g = &self.geometry;
        let mut out = Vec::with_capacity(slots.len() * g.ssm_slot_elems());
        for &slot in slots {
            out.extend(from_layout(g, &self.read_slot_elems(mem, slot)?));
        }
        Ok(out)
    }

    /// The stored elements of `slot` in storage order (layout order), up-cast.
    pub fn read_slot_elems<M: DeviceMemory<Buffer = Bf>>(
        &self,
        mem: &M,
        slot: u32,
    ) -> Result<Vec<f32>> {
        let g = &self.geometry;
        let mut bytes = vec![0u8; g.ssm_slot_bytes()];
        mem.read(
            &self.planes.ssm,
            slot as usize * g.ssm_slot_bytes(),
            &mut bytes,
        )?;
        Ok(g.state_dtype.decode_f32(&bytes))
    }

    /// Overwrites the stored elements of `slot` (storage order, rounded to nearest).
    pub fn write_slot_elems<M: DeviceMemory<Buffer = Bf>>(
        &mut self,
        mem: &M,
        slot: u32,
        values: &[f32],
    ) -> Result<()> {
        let g = &self.geometry;
        let bytes = g.state_dtype.encode_f32(values);
        mem.write(
            &mut self.planes.ssm,
            slot as usize * g.ssm_slot_bytes(),
            &bytes,
        )?;
        Ok(())
    }

    /// The ring bookkeeping of `slot` (default without a ring).
    pub fn meta<M: DeviceMemory<Buffer = Bf>>(&self, mem: &M, slot: u32) -> Result<RingMeta> {
        if self.geometry.ring_len == 0 {
            return Ok(RingMeta::default());
        }
        let mut bytes = [0u8; 16];
        mem.read(&self.planes.meta, slot as usize * 16, &mut bytes)?;
        Ok(bytemuck::pod_read_unaligned(&bytes))
    }

    /// All bytes and the epoch.
    pub fn snapshot<M: DeviceMemory<Buffer = Bf>>(&self, mem: &M) -> Result<Snapshot> {
        let all = |buf: &Bf| -> Result<Vec<u8>> {
            let mut b = vec![0u8; mem.len(buf)];
            mem.read(buf, 0, &mut b)?;
            Ok(b)
        };
        let p = &self.planes;
        Ok(Snapshot {
            ssm: all(&p.ssm)?,
            conv: all(&p.conv)?,
            ring: all(&p.ring)?,
            meta: all(&p.meta)?,
            delta: all(&p.delta)?,
            epoch: p.epoch,
        })
    }
}

/// Logical `[HV][K][V]` values of one slot in the geometry's storage order.
pub fn to_layout(g: &PoolGeometry, logical: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; logical.len()];
    for (hv, head) in logical.chunks_exact(g.head_elems()).enumerate() {
        for k in 0..g.k {
            for v in 0..g.v {
                out[hv * g.head_elems() + g.layout.offset(k, v, g.k, g.v)] = head[k * g.v + v];
            }
        }
    }
    out
}

/// One slot's values in storage order back to logical `[HV][K][V]`.
pub fn from_layout(g: &PoolGeometry, stored: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; stored.len()];
    for (hv, head) in stored.chunks_exact(g.head_elems()).enumerate() {
        for k in 0..g.k {
            for v in 0..g.v {
                out[hv * g.head_elems() + k * g.v + v] = head[g.layout.offset(k, v, g.k, g.v)];
            }
        }
    }
    out
}

/// Runs `f` on `layer` and checks the guarantees every call gives: on success the slots not
/// in `named` and the conv plane keep their bytes; on error nothing changed at all.
pub fn guarded<B: Backend, R>(
    be: &B,
    layer: &mut TestLayer<Buf<B>>,
    named: &[u32],
    f: impl FnOnce(&mut LayerMut<'_, Buf<B>>) -> Result<R>,
) -> Result<R> {
    let mem = be.memory();
    let before = layer.snapshot(mem)?;
    let r = f(&mut layer.view());
    let after = layer.snapshot(mem)?;
    match &r {
        Ok(_) => {
            assert!(before.conv == after.conv, "the conv plane changed");
            for slot in 0..layer.geometry.total_slots() {
                if !named.contains(&(slot as u32)) {
                    before.assert_slot_unchanged(
                        &after,
                        &layer.geometry,
                        slot,
                        "a slot not in the call",
                    );
                }
            }
        }
        Err(e) => assert!(before == after, "a refused call ({e}) changed the pool"),
    }
    r
}

/// An output buffer of `len` elements of `dtype` with every byte 0xff (NaN in every dtype).
pub fn poisoned_output<M: DeviceMemory>(mem: &M, dtype: Dtype, len: usize) -> Result<M::Buffer> {
    upload_bytes(mem, &vec![0xff; len * dtype.size()])
}

/// Downloads an output and asserts that every element was written (none is the poison).
fn checked_output<M: DeviceMemory>(
    mem: &M,
    buf: &M::Buffer,
    dtype: Dtype,
    len: usize,
) -> Result<Vec<f32>> {
    let out = download(mem, buf, dtype, len)?;
    if let Some(i) = out.iter().position(|x| x.is_nan()) {
        panic!("output element {i} of {len} was not written (still the NaN poison)");
    }
    Ok(out)
}

/// Which token operation [`run_tokens`] performs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenOp<'a> {
    /// [`Backend::prefill`].
    Prefill,
    /// [`Backend::decode`].
    Decode,
    /// [`Backend::spec_verify`] with these accepted counts.
    SpecVerify(&'a [u32]),
}

/// Runs a token operation on sequences `bounds` in `slots` with `inputs`, guarded (see
/// [`guarded`]) and with a poisoned output; returns the outputs `[T, HV, V]` as f32.
pub fn run_tokens<B: Backend>(
    be: &B,
    layer: &mut TestLayer<Buf<B>>,
    op: TokenOp<'_>,
    bounds: &[usize],
    slots: &[u32],
    inputs: &HostInputs,
    opts: &KdaOptions,
) -> Result<Vec<f32>> {
    let mem = be.memory();
    let batch = be.prepare(batch_plan(bounds, slots)?)?;
    let dev = DeviceInputs::upload(mem, inputs, opts)?;
    let len = inputs.tokens * inputs.dims.hv * inputs.dims.v;
    let mut out_buf = poisoned_output(mem, inputs.dtype, len)?;
    let acc_buf = match op {
        TokenOp::SpecVerify(acc) => Some(upload_bytes(mem, bytemuck::cast_slice(acc))?),
        _ => None,
    };
    guarded(be, layer, slots, |view| {
        let mut out = TensorViewMut {
            buf: &mut out_buf,
            dtype: inputs.dtype,
            len,
        };
        let inp = dev.view();
        match (op, &acc_buf) {
            (TokenOp::Prefill, _) => be.prefill(&batch, &inp, opts, view, &mut out),
            (TokenOp::Decode, _) => be.decode(&batch, &inp, opts, view, &mut out),
            (TokenOp::SpecVerify(acc), Some(buf)) => {
                let accepted = IndexView {
                    buf,
                    len: acc.len(),
                };
                be.spec_verify(&batch, &accepted, &inp, opts, view, &mut out)
            }
            (TokenOp::SpecVerify(_), None) => unreachable!("accepted counts uploaded above"),
        }
    })?;
    checked_output(mem, &out_buf, inputs.dtype, len)
}

/// Runs [`Backend::replay`] on `slots` (optionally with accepted counts), guarded.
pub fn run_replay<B: Backend>(
    be: &B,
    layer: &mut TestLayer<Buf<B>>,
    slots: &[u32],
    accepted: Option<&[u32]>,
    opts: &KdaOptions,
    a_log: &[f32],
    dt_bias: &[f32],
) -> Result<()> {
    let mem = be.memory();
    let batch = be.prepare(batch_plan(&vec![0; slots.len() + 1], slots)?)?;
    let acc_buf = accepted
        .map(|a| upload_bytes(mem, bytemuck::cast_slice(a)))
        .transpose()?;
    let a_buf = upload(mem, a_log, Dtype::Fp32)?;
    let d_buf = upload(mem, dt_bias, Dtype::Fp32)?;
    let with = opts.needs_gate_params();
    let a_view = TensorView {
        buf: &a_buf,
        dtype: Dtype::Fp32,
        len: a_log.len(),
    };
    let d_view = TensorView {
        buf: &d_buf,
        dtype: Dtype::Fp32,
        len: dt_bias.len(),
    };
    guarded(be, layer, slots, |view| {
        let acc = acc_buf.as_ref().map(|buf| IndexView {
            buf,
            len: slots.len(),
        });
        be.replay(
            &batch,
            acc.as_ref(),
            opts,
            with.then_some(&a_view),
            with.then_some(&d_view),
            view,
        )
    })
}
