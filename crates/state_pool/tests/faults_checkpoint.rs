//! Faults in checkpoint images: every truncation, every corrupted byte, forged headers whose
//! checksum is right but whose facts are wrong, and images of another layout are refused
//! with an error, and a refused import leaves every byte of the pool as it was.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use state_pool::checkpoint::{parse_image, IMAGE_MAGIC, IMAGE_VERSION};
use state_pool::{
    Dtype, HostMemory, ImportMode, Plane, PoolError, PoolGeometry, StateLayout, StatePool,
};

fn geometry(state: Dtype) -> PoolGeometry {
    PoolGeometry {
        layers: 2,
        h: 1,
        hv: 2,
        k: 4,
        v: 4,
        conv_rows: 2,
        conv_channels: 5,
        conv_dtype: Dtype::Bf16,
        state_dtype: state,
        layout: StateLayout::KFirst,
        ring_len: 0,
        ring_dtype: Dtype::Bf16,
        ring_deltas: false,
        slots: 3,
        checkpoint_slots: 1,
        rounding: Default::default(),
    }
}

/// Random finite values in the ssm and conv planes of every slot.
fn filled_pool(g: PoolGeometry, rng: &mut StdRng) -> StatePool<HostMemory> {
    let mut p = StatePool::new(HostMemory, g.clone()).unwrap();
    for slot in 0..g.total_slots() {
        for layer in 0..g.layers {
            for (plane, dtype) in [(Plane::Ssm, g.state_dtype), (Plane::Conv, g.conv_dtype)] {
                let n = plane.slot_bytes(&g) / dtype.size();
                let values: Vec<f32> = (0..n).map(|_| rng.random_range(-4.0f32..4.0)).collect();
                let bytes = state_pool::checkpoint::convert_elements(
                    bytemuck::cast_slice(&values),
                    Dtype::Fp32,
                    dtype,
                );
                p.write_slot_plane(layer, plane, slot, &bytes).unwrap();
            }
        }
    }
    p
}

/// Every byte of every plane of every slot.
fn snapshot(p: &StatePool<HostMemory>) -> Vec<u8> {
    let g = p.geometry();
    let mut all = Vec::new();
    for layer in 0..g.layers {
        for plane in Plane::ALL {
            for slot in 0..g.total_slots() {
                all.extend(p.read_slot_plane(layer, plane, slot).unwrap());
            }
        }
    }
    all
}

/// An image as the module docs describe it, with a correct checksum over whatever is given.
fn forge(layout_id: &str, conv_bytes: u64, ssm_bytes: u64, planes: &[u8]) -> Vec<u8> {
    let mut image = Vec::new();
    image.extend_from_slice(&IMAGE_MAGIC);
    image.extend_from_slice(&IMAGE_VERSION.to_le_bytes());
    image.extend_from_slice(&(layout_id.len() as u32).to_le_bytes());
    image.extend_from_slice(layout_id.as_bytes());
    image.extend_from_slice(&conv_bytes.to_le_bytes());
    image.extend_from_slice(&ssm_bytes.to_le_bytes());
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&image);
    hasher.update(planes);
    image.extend_from_slice(&hasher.finalize().to_le_bytes());
    image.extend_from_slice(planes);
    image
}

/// Imports `image` into slot 1, expects a checkpoint error containing `word`, and checks
/// that the pool did not change.
fn assert_refused(p: &mut StatePool<HostMemory>, image: &[u8], mode: ImportMode, word: &str) {
    let before = snapshot(p);
    let e = p.import_slot(1, image, mode).unwrap_err();
    assert!(matches!(e, PoolError::Checkpoint(_)), "{e}");
    let text = e.to_string();
    assert!(text.contains(word), "expected {word:?} in: {text}");
    assert!(
        snapshot(p) == before,
        "a refused import changed the pool: {text}"
    );
}

#[test]
fn forged_image_is_accepted_so_the_forgeries_below_test_one_fault_each() {
    let mut rng = StdRng::seed_from_u64(10);
    let mut p = filled_pool(geometry(Dtype::Fp16), &mut rng);
    let image = p.export_slot(0).unwrap();
    let (header, planes) = parse_image(&image).unwrap();
    let again = forge(
        &header.layout_id,
        header.conv_bytes,
        header.ssm_bytes,
        planes,
    );
    assert_eq!(again, image, "the module docs describe the image exactly");
    p.import_slot(1, &again, ImportMode::Exact).unwrap();
    for layer in 0..2 {
        for plane in [Plane::Conv, Plane::Ssm] {
            assert_eq!(
                p.read_slot_plane(layer, plane, 1).unwrap(),
                p.read_slot_plane(layer, plane, 0).unwrap()
            );
        }
    }
}

#[test]
fn every_truncation_of_an_image_is_refused() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut p = filled_pool(geometry(Dtype::Fp32), &mut rng);
    let image = p.export_slot(0).unwrap();
    for len in 0..image.len() {
        assert_refused(&mut p, &image[..len], ImportMode::ConvertDtype, "truncated");
    }
}

#[test]
fn every_corrupted_byte_of_an_image_is_refused() {
    let mut rng = StdRng::seed_from_u64(12);
    let mut p = filled_pool(geometry(Dtype::Bf16), &mut rng);
    let image = p.export_slot(2).unwrap();
    for at in 0..image.len() {
        let mut bad = image.clone();
        // A random non-zero change of this byte (one bit or several).
        bad[at] ^= rng.random_range(1..=255u8);
        let before = snapshot(&p);
        let e = p
            .import_slot(1, &bad, ImportMode::ConvertDtype)
            .unwrap_err();
        assert!(
            matches!(e, PoolError::Checkpoint(_)),
            "byte {at} of {}: {e}",
            image.len()
        );
        assert!(snapshot(&p) == before, "byte {at}: the pool changed");
    }
    // Extra bytes after the planes too.
    let mut long = image.clone();
    long.extend_from_slice(&[0, 1, 2]);
    assert_refused(&mut p, &long, ImportMode::Exact, "corrupt");
}

#[test]
fn forged_headers_with_a_valid_checksum_are_refused() {
    let mut rng = StdRng::seed_from_u64(13);
    let mut p = filled_pool(geometry(Dtype::Fp16), &mut rng);
    let image = p.export_slot(0).unwrap();
    let (h, planes) = parse_image(&image).unwrap();
    let (id, c, s) = (h.layout_id.as_str(), h.conv_bytes, h.ssm_bytes);

    // Plane sizes that add up but do not match the layout id.
    assert_refused(
        &mut p,
        &forge(id, c + 2, s - 2, planes),
        ImportMode::Exact,
        "do not match",
    );
    assert_refused(
        &mut p,
        &forge(id, c - 2, s + 2, planes),
        ImportMode::Exact,
        "do not match",
    );
    // Sizes that overflow when added.
    assert_refused(
        &mut p,
        &forge(id, u64::MAX, 8, planes),
        ImportMode::Exact,
        "corrupt",
    );
    // A layout id that does not parse, or parses to a layout of other sizes.
    assert_refused(
        &mut p,
        &forge("", c, s, planes),
        ImportMode::ConvertDtype,
        "layout id",
    );
    assert_refused(
        &mut p,
        &forge("kda-state-v9:junk", c, s, planes),
        ImportMode::ConvertDtype,
        "layout id",
    );
    let fp32_id = id.replace("ssm=fp16", "ssm=fp32");
    assert_refused(
        &mut p,
        &forge(&fp32_id, c, s, planes),
        ImportMode::ConvertDtype,
        "do not match",
    );
    // The layout id is not UTF-8.
    let mut raw = forge(id, c, s, planes);
    raw[16] = 0xFF;
    let mut hasher = crc32fast::Hasher::new();
    let crc_at = 16 + id.len() + 16;
    hasher.update(&raw[..crc_at]);
    hasher.update(&raw[crc_at + 4..]);
    raw[crc_at..crc_at + 4].copy_from_slice(&hasher.finalize().to_le_bytes());
    assert_refused(&mut p, &raw, ImportMode::Exact, "UTF-8");
    // Another image version.
    let mut v2 = forge(id, c, s, planes);
    v2[8..12].copy_from_slice(&(IMAGE_VERSION + 1).to_le_bytes());
    assert_refused(&mut p, &v2, ImportMode::Exact, "version");
    // An absurd layout id length.
    let mut long_id = image.clone();
    long_id[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_refused(&mut p, &long_id, ImportMode::Exact, "corrupt");
}

/// Geometries that differ from [`geometry`] in one fact each, and whether an image of
/// `geometry(Fp16)` converts into them.
fn other_layouts() -> Vec<(&'static str, PoolGeometry, bool)> {
    let base = geometry(Dtype::Fp16);
    let with = |f: &dyn Fn(&mut PoolGeometry)| {
        let mut g = base.clone();
        f(&mut g);
        g
    };
    vec![
        ("layers", with(&|g| g.layers = 3), false),
        ("h", with(&|g| g.h = 2), false),
        ("hv", with(&|g| g.hv = 4), false),
        ("k", with(&|g| g.k = 8), false),
        ("v", with(&|g| g.v = 2), false),
        ("conv rows", with(&|g| g.conv_rows = 3), false),
        ("conv channels", with(&|g| g.conv_channels = 6), false),
        (
            "state layout",
            with(&|g| g.layout = StateLayout::VFirst),
            false,
        ),
        ("ssm dtype", with(&|g| g.state_dtype = Dtype::Fp32), true),
        ("conv dtype", with(&|g| g.conv_dtype = Dtype::Fp16), true),
        ("ring", with(&|g| g.ring_len = 4), true),
    ]
}

#[test]
fn import_into_another_layout_is_refused() {
    let mut rng = StdRng::seed_from_u64(14);
    let src = filled_pool(geometry(Dtype::Fp16), &mut rng);
    let image = src.export_slot(1).unwrap();
    for (fact, g, convertible) in other_layouts() {
        let mut dst = filled_pool(g, &mut rng);
        let (ids, dst_id) = (src.layout_id(), dst.layout_id());
        assert_ne!(ids, dst_id, "{fact}");
        let before = snapshot(&dst);
        let e = dst
            .import_slot(1, &image, ImportMode::Exact)
            .unwrap_err()
            .to_string();
        assert!(e.contains(&ids) && e.contains(&dst_id), "{fact}: {e}");
        assert!(
            snapshot(&dst) == before,
            "{fact}: a refused import changed the pool"
        );
        let converted = dst.import_slot(1, &image, ImportMode::ConvertDtype);
        match (convertible, converted) {
            (true, Ok(())) => {}
            (false, Err(e)) => {
                let e = e.to_string();
                assert!(e.contains("only dtypes"), "{fact}: {e}");
                assert!(
                    snapshot(&dst) == before,
                    "{fact}: a refused import changed the pool"
                );
            }
            (want, got) => panic!("{fact}: convertible {want}, import gave {got:?}"),
        }
    }
}
