//! Checkpoints: the layout id, copies between request and checkpoint slots, and slot images.
//!
//! A slot's state is its conv and ssm planes in every layer. Every operation here reads or
//! replaces that state directly, so it requires the slots involved to have an empty replay ring
//! (`len == 0` in every layer): a slot with ring entries must be flushed (replayed) by the
//! kernels first, and the error says so.
//!
//! An image (all integers little-endian):
//!
//! | bytes | content |
//! |---|---|
//! | 8 | magic `KDASTATE` |
//! | 4 | image version (1) |
//! | 4 | length `L` of the layout id |
//! | L | the layout id, UTF-8 |
//! | 8 | bytes of the conv planes (all layers) |
//! | 8 | bytes of the ssm planes (all layers) |
//! | 4 | CRC-32 of every header byte before it and of all the plane bytes |
//! | .. | the conv plane of layer 0, 1, .., then the ssm plane of layer 0, 1, .. |

use std::fmt;

use crate::alloc::SlotHandle;
use crate::dtype::Dtype;
use crate::error::{PoolError, Result};
use crate::geometry::PoolGeometry;
use crate::layout::StateLayout;
use crate::memory::DeviceMemory;
use crate::pool::{buffer, buffer_mut, Plane, StatePool};

/// The version prefix of layout ids.
pub const LAYOUT_VERSION: &str = "kda-state-v1";
/// The first bytes of a slot image.
pub const IMAGE_MAGIC: [u8; 8] = *b"KDASTATE";
/// The image format version written and read.
pub const IMAGE_VERSION: u32 = 1;
/// The longest layout id an image may carry.
const MAX_LAYOUT_ID: usize = 1024;

/// Every fact of a pool's layout, printed as a versioned string:
/// `kda-state-v1:layers=69:h=12:hv=12:k=128:v=128:ssm=fp16:conv=bf16:convw=3:convc=4608:ring=0:bf16:kfirst`
/// (`convw` is the conv state's rows, `conv_kernel - 1`; `convc` its channels; `ring=<len>:<dtype>`
/// the replay ring).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutId {
    /// KDA layers.
    pub layers: usize,
    /// q/k heads per rank.
    pub h: usize,
    /// Value heads per rank.
    pub hv: usize,
    /// Key head dim.
    pub k: usize,
    /// Value head dim.
    pub v: usize,
    /// State dtype.
    pub ssm: Dtype,
    /// Conv dtype.
    pub conv: Dtype,
    /// Conv rows per slot and layer.
    pub conv_rows: usize,
    /// Conv channels.
    pub conv_channels: usize,
    /// Ring length in tokens.
    pub ring_len: usize,
    /// Ring dtype.
    pub ring_dtype: Dtype,
    /// Storage layout of each head's state.
    pub layout: StateLayout,
}

impl LayoutId {
    /// The layout facts of `g`.
    pub fn of(g: &PoolGeometry) -> Self {
        Self {
            layers: g.layers,
            h: g.h,
            hv: g.hv,
            k: g.k,
            v: g.v,
            ssm: g.state_dtype,
            conv: g.conv_dtype,
            conv_rows: g.conv_rows,
            conv_channels: g.conv_channels,
            ring_len: g.ring_len,
            ring_dtype: g.ring_dtype,
            layout: g.layout,
        }
    }

    /// Parses a layout id as printed by [`fmt::Display`].
    pub fn parse(s: &str) -> Result<Self> {
        let bad = |why: &str| PoolError::Checkpoint(format!("malformed layout id {s:?}: {why}"));
        let parts: Vec<&str> = s.split(':').collect();
        if parts.len() != 13 {
            return Err(bad("expected 13 ':'-separated parts"));
        }
        if parts[0] != LAYOUT_VERSION {
            return Err(bad(&format!("unknown version {:?}", parts[0])));
        }
        let field = |i: usize, key: &str| -> Result<&str> {
            parts[i]
                .strip_prefix(key)
                .and_then(|r| r.strip_prefix('='))
                .ok_or_else(|| bad(&format!("expected `{key}=` at part {i}")))
        };
        let num = |i: usize, key: &str| -> Result<usize> {
            field(i, key)?
                .parse()
                .map_err(|_| bad(&format!("`{key}` is not a number")))
        };
        let dtype = |v: &str| Dtype::parse(v).ok_or_else(|| bad(&format!("unknown dtype {v:?}")));
        Ok(Self {
            layers: num(1, "layers")?,
            h: num(2, "h")?,
            hv: num(3, "hv")?,
            k: num(4, "k")?,
            v: num(5, "v")?,
            ssm: dtype(field(6, "ssm")?)?,
            conv: dtype(field(7, "conv")?)?,
            conv_rows: num(8, "convw")?,
            conv_channels: num(9, "convc")?,
            ring_len: num(10, "ring")?,
            ring_dtype: dtype(parts[11])?,
            layout: StateLayout::parse(parts[12])
                .ok_or_else(|| bad(&format!("unknown state layout {:?}", parts[12])))?,
        })
    }

    /// Bytes of one slot's conv planes over all layers (saturating at `u64::MAX`).
    pub fn conv_image_bytes(&self) -> u64 {
        saturating_product(&[
            self.layers,
            self.conv_rows,
            self.conv_channels,
            self.conv.size(),
        ])
    }

    /// Bytes of one slot's ssm planes over all layers (saturating at `u64::MAX`).
    pub fn ssm_image_bytes(&self) -> u64 {
        saturating_product(&[self.layers, self.hv, self.k, self.v, self.ssm.size()])
    }

    /// Whether an image of `self` can be converted into `target`: only the dtypes (ssm, conv)
    /// and the ring (which images do not carry) may differ.
    pub fn convertible_to(&self, target: &LayoutId) -> bool {
        Self {
            ssm: target.ssm,
            conv: target.conv,
            ring_len: target.ring_len,
            ring_dtype: target.ring_dtype,
            ..self.clone()
        } == *target
    }
}

fn saturating_product(factors: &[usize]) -> u64 {
    factors
        .iter()
        .fold(1u64, |acc, &f| acc.saturating_mul(f as u64))
}

impl fmt::Display for LayoutId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{LAYOUT_VERSION}:layers={}:h={}:hv={}:k={}:v={}:ssm={}:conv={}:convw={}:convc={}:ring={}:{}:{}",
            self.layers,
            self.h,
            self.hv,
            self.k,
            self.v,
            self.ssm,
            self.conv,
            self.conv_rows,
            self.conv_channels,
            self.ring_len,
            self.ring_dtype,
            self.layout.name()
        )
    }
}

/// What an import does when the image's layout id differs from the pool's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImportMode {
    /// Refuse any difference.
    #[default]
    Exact,
    /// Accept different dtypes (ssm, conv) and convert the values, rounding to nearest even;
    /// everything else must match.
    ConvertDtype,
}

/// The header of a slot image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageHeader {
    /// The exporting pool's layout id.
    pub layout_id: String,
    /// Bytes of the conv planes (all layers).
    pub conv_bytes: u64,
    /// Bytes of the ssm planes (all layers).
    pub ssm_bytes: u64,
    /// CRC-32 of the header bytes before it and of the planes.
    pub crc32: u32,
}

/// Reads and checks an image: magic, version, lengths and checksum. Returns the header and the
/// plane bytes (conv planes then ssm planes). A corrupt or truncated image is refused.
pub fn parse_image(image: &[u8]) -> Result<(ImageHeader, &[u8])> {
    let refuse = |msg: String| PoolError::Checkpoint(msg);
    let mut r = Reader {
        bytes: image,
        at: 0,
    };
    let magic = r.take(8).ok_or_else(|| {
        refuse(format!(
            "truncated image: {} bytes, shorter than the magic",
            image.len()
        ))
    })?;
    if magic != IMAGE_MAGIC {
        return Err(refuse("not a KDA state image (bad magic)".into()));
    }
    let truncated_header = || {
        refuse(format!(
            "truncated image: its {} bytes end inside the header",
            image.len()
        ))
    };
    let version = r.u32().ok_or_else(truncated_header)?;
    if version != IMAGE_VERSION {
        return Err(refuse(format!(
            "image version {version} is not supported; this build reads version {IMAGE_VERSION}"
        )));
    }
    let id_len = r.u32().ok_or_else(truncated_header)? as usize;
    if id_len > MAX_LAYOUT_ID {
        return Err(refuse(format!(
            "corrupt image: a layout id of {id_len} bytes (at most {MAX_LAYOUT_ID})"
        )));
    }
    let id = r.take(id_len).ok_or_else(truncated_header)?;
    let layout_id = std::str::from_utf8(id)
        .map_err(|_| refuse("corrupt image: the layout id is not UTF-8".into()))?
        .to_string();
    let conv_bytes = r.u64().ok_or_else(truncated_header)?;
    let ssm_bytes = r.u64().ok_or_else(truncated_header)?;
    let crc_at = r.at;
    let crc32 = r.u32().ok_or_else(truncated_header)?;
    let payload = &image[r.at..];
    let announced = conv_bytes.checked_add(ssm_bytes);
    match announced {
        Some(n) if n == payload.len() as u64 => {}
        Some(n) if n > payload.len() as u64 => {
            return Err(refuse(format!(
                "truncated image: the header announces {n} plane bytes, {} follow it",
                payload.len()
            )))
        }
        _ => {
            return Err(refuse(format!(
                "corrupt image: the header announces {conv_bytes} + {ssm_bytes} plane bytes, {} follow it",
                payload.len()
            )))
        }
    }
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&image[..crc_at]);
    hasher.update(payload);
    let actual = hasher.finalize();
    if actual != crc32 {
        return Err(refuse(format!(
            "corrupt image: checksum {actual:#010x} does not match the header's {crc32:#010x}"
        )));
    }
    Ok((
        ImageHeader {
            layout_id,
            conv_bytes,
            ssm_bytes,
            crc32,
        },
        payload,
    ))
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let out = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(out)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

/// Converts little-endian elements of `from` into `to`, rounding to nearest even.
pub fn convert_elements(bytes: &[u8], from: Dtype, to: Dtype) -> Vec<u8> {
    if from == to {
        return bytes.to_vec();
    }
    to.encode_f32(&from.decode_f32(bytes))
}

impl<M: DeviceMemory> StatePool<M> {
    /// Copies the state (conv and ssm planes, every layer) of slot `src` into slot `dst`. Both
    /// must be flushed; the rings are untouched (empty).
    pub fn copy_slot(&mut self, src: usize, dst: usize) -> Result<()> {
        if src == dst {
            return Err(PoolError::arg(
                "dst",
                format!("slot {dst} is the source slot; expected another slot"),
            ));
        }
        self.require_flushed(src, "its state is copied")?;
        self.require_flushed(dst, "its state is replaced")?;
        let g = &self.geometry;
        for planes in &mut self.layers {
            for plane in [Plane::Conv, Plane::Ssm] {
                let n = plane.slot_bytes(g);
                self.mem
                    .copy_within(buffer_mut(planes, plane), src * n, dst * n, n)?;
            }
        }
        Ok(())
    }

    /// Copies `slot`'s state into a fresh checkpoint slot and returns it. The checkpoint slot
    /// goes back to its allocator when the handle drops.
    pub fn checkpoint(&mut self, slot: usize) -> Result<SlotHandle> {
        self.check_slot(slot)?;
        let ckpt = self.checkpoints.allocate()?;
        self.copy_slot(slot, ckpt.index())?;
        Ok(ckpt)
    }

    /// Copies `slot`'s state into the checkpoint slot `ckpt` (taken earlier from this pool).
    pub fn checkpoint_into(&mut self, slot: usize, ckpt: &SlotHandle) -> Result<()> {
        self.check_checkpoint(ckpt)?;
        self.copy_slot(slot, ckpt.index())
    }

    /// Restores the state saved in checkpoint slot `ckpt` into `slot`.
    pub fn restore(&mut self, ckpt: &SlotHandle, slot: usize) -> Result<()> {
        self.check_checkpoint(ckpt)?;
        self.copy_slot(ckpt.index(), slot)
    }

    fn check_checkpoint(&self, ckpt: &SlotHandle) -> Result<()> {
        if self.checkpoints.owns(ckpt) {
            Ok(())
        } else {
            Err(PoolError::arg(
                "checkpoint",
                format!(
                    "slot {} is not a checkpoint slot of this pool (checkpoint slots {}..{})",
                    ckpt.index(),
                    self.geometry.slots,
                    self.geometry.total_slots()
                ),
            ))
        }
    }

    /// Exports `slot`'s state as an image (see the module docs). The slot must be flushed.
    pub fn export_slot(&self, slot: usize) -> Result<Vec<u8>> {
        self.require_flushed(slot, "export")?;
        let g = &self.geometry;
        let id = g.layout_id();
        let (conv_n, ssm_n) = (g.conv_slot_bytes(), g.ssm_slot_bytes());
        let mut image = Vec::with_capacity(36 + id.len() + g.layers * (conv_n + ssm_n));
        image.extend_from_slice(&IMAGE_MAGIC);
        image.extend_from_slice(&IMAGE_VERSION.to_le_bytes());
        image.extend_from_slice(&(id.len() as u32).to_le_bytes());
        image.extend_from_slice(id.as_bytes());
        image.extend_from_slice(&((g.layers * conv_n) as u64).to_le_bytes());
        image.extend_from_slice(&((g.layers * ssm_n) as u64).to_le_bytes());
        let crc_at = image.len();
        image.extend_from_slice(&[0; 4]);
        for (plane, n) in [(Plane::Conv, conv_n), (Plane::Ssm, ssm_n)] {
            for planes in &self.layers {
                let start = image.len();
                image.resize(start + n, 0);
                self.mem
                    .read(buffer(planes, plane), slot * n, &mut image[start..])?;
            }
        }
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&image[..crc_at]);
        hasher.update(&image[crc_at + 4..]);
        let crc = hasher.finalize();
        image[crc_at..crc_at + 4].copy_from_slice(&crc.to_le_bytes());
        Ok(image)
    }

    /// Imports an image into `slot` (which must be flushed). An image of another layout id is
    /// refused with an error naming both ids, unless `mode` is [`ImportMode::ConvertDtype`]
    /// and only the dtypes differ (then values are rounded to nearest even). A corrupt or
    /// truncated image is refused. Nothing changes unless the import succeeds.
    pub fn import_slot(&mut self, slot: usize, image: &[u8], mode: ImportMode) -> Result<()> {
        let (header, payload) = parse_image(image)?;
        let target = LayoutId::of(&self.geometry);
        let target_id = target.to_string();
        let source = if header.layout_id == target_id {
            target.clone()
        } else {
            let differs = format!(
                "the image's layout id {} differs from the pool's {target_id}",
                header.layout_id
            );
            if mode == ImportMode::Exact {
                return Err(PoolError::Checkpoint(format!(
                    "{differs}; ask for a dtype conversion to convert between dtypes"
                )));
            }
            let source = LayoutId::parse(&header.layout_id)?;
            if !source.convertible_to(&target) {
                return Err(PoolError::Checkpoint(format!(
                    "{differs}; a conversion changes only dtypes (ssm, conv), the other facts must match"
                )));
            }
            source
        };
        if (header.conv_bytes, header.ssm_bytes)
            != (source.conv_image_bytes(), source.ssm_image_bytes())
        {
            return Err(PoolError::Checkpoint(format!(
                "corrupt image: plane bytes (conv {}, ssm {}) do not match its layout id (conv {}, ssm {})",
                header.conv_bytes,
                header.ssm_bytes,
                source.conv_image_bytes(),
                source.ssm_image_bytes()
            )));
        }
        self.require_flushed(slot, "import")?;

        let (conv, ssm) = payload.split_at(header.conv_bytes as usize);
        let conv = convert_elements(conv, source.conv, target.conv);
        let ssm = convert_elements(ssm, source.ssm, target.ssm);
        let g = &self.geometry;
        for (plane, bytes) in [(Plane::Conv, &conv), (Plane::Ssm, &ssm)] {
            let n = plane.slot_bytes(g);
            if n == 0 {
                continue;
            }
            for (planes, chunk) in self.layers.iter_mut().zip(bytes.chunks_exact(n)) {
                self.mem.write(buffer_mut(planes, plane), slot * n, chunk)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::RingMeta;
    use crate::memory::HostMemory;
    use crate::pool::tests::{scribble, small};
    use half::f16;
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn pool(state: Dtype, ring: usize) -> StatePool<HostMemory> {
        StatePool::new(HostMemory, small(state, ring)).unwrap()
    }

    fn state_of(p: &StatePool<HostMemory>, slot: usize) -> Vec<Vec<u8>> {
        (0..p.geometry().layers)
            .flat_map(|l| {
                [Plane::Conv, Plane::Ssm].map(|pl| p.read_slot_plane(l, pl, slot).unwrap())
            })
            .collect()
    }

    /// Writes random finite f32 values (as the pool's state dtype) into `slot`'s ssm planes and
    /// random bytes into its conv planes; returns the f32 values per layer.
    fn random_state(p: &mut StatePool<HostMemory>, slot: usize, rng: &mut StdRng) -> Vec<Vec<f32>> {
        let g = p.geometry().clone();
        let mut all = Vec::new();
        for layer in 0..g.layers {
            let values: Vec<f32> = (0..g.ssm_slot_elems())
                .map(|_| {
                    let mag = 10f32.powf(rng.random_range(-3.0..4.0));
                    if rng.random::<bool>() {
                        mag
                    } else {
                        -mag
                    }
                })
                .collect();
            let bytes = convert_elements(bytemuck::cast_slice(&values), Dtype::Fp32, g.state_dtype);
            p.write_slot_plane(layer, Plane::Ssm, slot, &bytes).unwrap();
            let mut conv = vec![0u8; g.conv_slot_bytes()];
            rng.fill(&mut conv[..]);
            p.write_slot_plane(layer, Plane::Conv, slot, &conv).unwrap();
            all.push(values);
        }
        all
    }

    #[test]
    fn layout_id_names_every_fact_and_parses_back() {
        let mut g = small(Dtype::Fp16, 8);
        g.layout = StateLayout::VFirst;
        let id = g.layout_id();
        assert_eq!(
            id,
            "kda-state-v1:layers=2:h=2:hv=4:k=8:v=4:ssm=fp16:conv=bf16:convw=3:convc=48:ring=8:bf16:vfirst"
        );
        assert_eq!(LayoutId::parse(&id).unwrap(), LayoutId::of(&g));
        for bad in [
            "",
            "kda-state-v2:layers=2",
            &id.replace("ssm=fp16", "ssm=fp8"),
        ] {
            assert!(LayoutId::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn checkpoint_and_restore_round_trip_a_slot() {
        let mut rng = StdRng::seed_from_u64(1);
        let mut p = pool(Dtype::Fp16, 4);
        let a = p.allocate().unwrap();
        scribble(&mut p, a.index(), &mut rng, 0);
        let saved = state_of(&p, a.index());
        let ck = p.checkpoint(a.index()).unwrap();
        assert_eq!(ck.index(), 3, "checkpoint slots follow the 3 request slots");
        assert_eq!(state_of(&p, ck.index()), saved);
        scribble(&mut p, a.index(), &mut rng, 0);
        assert_ne!(state_of(&p, a.index()), saved);
        p.restore(&ck, a.index()).unwrap();
        assert_eq!(state_of(&p, a.index()), saved);
        // Into another request slot too.
        let b = p.allocate().unwrap();
        p.restore(&ck, b.index()).unwrap();
        assert_eq!(state_of(&p, b.index()), saved);
        p.checkpoint_into(b.index(), &ck).unwrap();
    }

    #[test]
    fn checkpoint_slots_run_out_with_an_error() {
        let mut p = pool(Dtype::Fp32, 0);
        let _c1 = p.checkpoint(0).unwrap();
        let _c2 = p.checkpoint(1).unwrap();
        let e = p.checkpoint(2).unwrap_err();
        assert!(
            matches!(e, PoolError::CheckpointsExhausted { capacity: 2 }),
            "{e}"
        );
    }

    #[test]
    fn restore_refuses_a_request_slot_as_checkpoint() {
        let mut p = pool(Dtype::Fp32, 0);
        let a = p.allocate().unwrap();
        let e = p.restore(&a, 1).unwrap_err().to_string();
        assert!(e.contains("not a checkpoint slot"), "{e}");
    }

    #[test]
    fn unflushed_slot_is_refused_with_a_flush_hint() {
        let mut rng = StdRng::seed_from_u64(2);
        let mut p = pool(Dtype::Fp16, 4);
        scribble(&mut p, 1, &mut rng, 2);
        let before = state_of(&p, 1);
        for e in [
            p.export_slot(1).unwrap_err(),
            p.checkpoint(1).unwrap_err(),
            p.copy_slot(0, 1).unwrap_err(),
        ] {
            let e = e.to_string();
            assert!(e.contains("slot 1 must be flushed (replayed)"), "{e}");
        }
        let image = p.export_slot(0).unwrap();
        let e = p
            .import_slot(1, &image, ImportMode::Exact)
            .unwrap_err()
            .to_string();
        assert!(e.contains("flushed"), "{e}");
        assert_eq!(state_of(&p, 1), before);
        assert_eq!(p.checkpoint_allocator().stats().in_use, 0);
        // Flushed (meta cleared by the kernels): accepted.
        for layer in 0..2 {
            let empty = RingMeta::default();
            p.write_slot_plane(layer, Plane::Meta, 1, bytemuck::bytes_of(&empty))
                .unwrap();
        }
        p.export_slot(1).unwrap();
    }

    #[test]
    fn image_is_header_then_conv_planes_then_ssm_planes() {
        let mut rng = StdRng::seed_from_u64(3);
        let mut p = pool(Dtype::Bf16, 0);
        scribble(&mut p, 2, &mut rng, 0);
        let image = p.export_slot(2).unwrap();
        let (h, payload) = parse_image(&image).unwrap();
        assert_eq!(h.layout_id, p.layout_id());
        let g = p.geometry();
        assert_eq!(h.conv_bytes as usize, 2 * g.conv_slot_bytes());
        assert_eq!(h.ssm_bytes as usize, 2 * g.ssm_slot_bytes());
        let mut expected = Vec::new();
        for plane in [Plane::Conv, Plane::Ssm] {
            for l in 0..2 {
                expected.extend(p.read_slot_plane(l, plane, 2).unwrap());
            }
        }
        assert_eq!(payload, &expected[..]);
        assert_eq!(&image[..8], b"KDASTATE");
    }

    #[test]
    fn corrupt_or_truncated_images_are_refused_and_change_nothing() {
        let mut rng = StdRng::seed_from_u64(4);
        let mut p = pool(Dtype::Fp16, 0);
        scribble(&mut p, 0, &mut rng, 0);
        scribble(&mut p, 1, &mut rng, 0);
        let image = p.export_slot(0).unwrap();
        let before = state_of(&p, 1);
        let mut cases: Vec<(Vec<u8>, &str)> = Vec::new();
        for at in [0, 9, 20, image.len() / 2, image.len() - 1] {
            let mut bad = image.clone();
            bad[at] ^= 0x10;
            cases.push((bad, ""));
        }
        for len in [0, 5, 30, image.len() - 1] {
            cases.push((image[..len].to_vec(), "truncated"));
        }
        let mut long = image.clone();
        long.push(0);
        cases.push((long, "corrupt"));
        for (bad, word) in cases {
            let e = p
                .import_slot(1, &bad, ImportMode::ConvertDtype)
                .unwrap_err();
            assert!(matches!(e, PoolError::Checkpoint(_)), "{e}");
            assert!(e.to_string().contains(word), "{e}");
        }
        assert_eq!(state_of(&p, 1), before);
    }

    #[test]
    fn import_of_another_layout_is_refused_naming_both_ids() {
        let mut rng = StdRng::seed_from_u64(5);
        let mut src = pool(Dtype::Fp32, 0);
        random_state(&mut src, 0, &mut rng);
        let image = src.export_slot(0).unwrap();
        let mut dst = pool(Dtype::Fp16, 0);
        let e = dst
            .import_slot(0, &image, ImportMode::Exact)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&src.layout_id()) && e.contains(&dst.layout_id()),
            "{e}"
        );
        assert!(e.contains("dtype conversion"), "{e}");

        let mut other = small(Dtype::Fp16, 0);
        other.layout = StateLayout::VFirst;
        let mut vfirst = StatePool::new(HostMemory, other).unwrap();
        let e = vfirst
            .import_slot(0, &image, ImportMode::ConvertDtype)
            .unwrap_err()
            .to_string();
        assert!(e.contains("vfirst") && e.contains("kfirst"), "{e}");
    }

    #[test]
    fn conversion_ignores_the_ring_and_rounds_to_nearest_even() {
        // 1 + 2^-11 is the tie between fp16 1.0 and 1 + 2^-10: nearest even is 1.0.
        let tie = 1.0f32 + f32::powi(2.0, -11);
        let up = 1.0f32 + 3.0 * f32::powi(2.0, -11);
        let bytes = convert_elements(bytemuck::cast_slice(&[tie, up]), Dtype::Fp32, Dtype::Fp16);
        assert_eq!(
            bytes,
            [
                f16::from_f32(1.0).to_le_bytes(),
                f16::from_f32(1.0 + 2f32.powi(-9)).to_le_bytes()
            ]
            .concat()
        );
        let mut rng = StdRng::seed_from_u64(6);
        let mut src = pool(Dtype::Fp16, 0);
        random_state(&mut src, 0, &mut rng);
        let image = src.export_slot(0).unwrap();
        let mut dst = pool(Dtype::Bf16, 6);
        dst.import_slot(2, &image, ImportMode::ConvertDtype)
            .unwrap();
        let got = dst.read_slot_plane(1, Plane::Ssm, 2).unwrap();
        let want = convert_elements(
            &src.read_slot_plane(1, Plane::Ssm, 0).unwrap(),
            Dtype::Fp16,
            Dtype::Bf16,
        );
        assert_eq!(got, want);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        #[test]
        fn export_then_import_is_bit_exact(
            seed in any::<u64>(),
            dtype in prop::sample::select(Dtype::ALL.to_vec()),
            ring in 0usize..3,
            from in 0usize..5,
            to in 0usize..5,
        ) {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut a = pool(dtype, ring);
            scribble(&mut a, from, &mut rng, 0);
            let image = a.export_slot(from).unwrap();
            let mut b = pool(dtype, ring);
            scribble(&mut b, to, &mut rng, 0);
            b.import_slot(to, &image, ImportMode::Exact).unwrap();
            prop_assert_eq!(state_of(&b, to), state_of(&a, from));
            prop_assert_eq!(b.export_slot(to).unwrap(), image);
        }

        #[test]
        fn fp32_to_fp16_to_fp32_stays_within_fp16_rounding(seed in any::<u64>()) {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut a = pool(Dtype::Fp32, 0);
            let values = random_state(&mut a, 1, &mut rng);
            let mut b = pool(Dtype::Fp16, 0);
            b.import_slot(0, &a.export_slot(1).unwrap(), ImportMode::ConvertDtype).unwrap();
            let mut c = pool(Dtype::Fp32, 0);
            c.import_slot(2, &b.export_slot(0).unwrap(), ImportMode::ConvertDtype).unwrap();
            for (layer, want) in values.iter().enumerate() {
                let half = b.read_slot_plane(layer, Plane::Ssm, 0).unwrap();
                let back = c.read_slot_plane(layer, Plane::Ssm, 2).unwrap();
                let back: &[f32] = bytemuck::cast_slice(&back);
                for (i, (&x, &y)) in want.iter().zip(back).enumerate() {
                    let h = f16::from_le_bytes([half[2 * i], half[2 * i + 1]]);
                    prop_assert_eq!(h, f16::from_f32(x));
                    prop_assert_eq!(y, h.to_f32());
                    // Round to nearest: at most half an fp16 ulp (2^-11 relative for normals).
                    prop_assert!((y - x).abs() <= x.abs() * f32::powi(2.0, -11), "{} -> {}", x, y);
                }
                prop_assert_eq!(
                    c.read_slot_plane(layer, Plane::Conv, 2).unwrap(),
                    a.read_slot_plane(layer, Plane::Conv, 1).unwrap()
                );
            }
        }
    }
}
