//! The slot allocator and the checkpoint store under load from many threads at once.
//!
//! Each test is seeded (every thread draws its operations from `StdRng` keyed by the seed and
//! its thread number) and bounded in time (threads stop after a fixed number of operations or
//! a wall-clock budget, whichever comes first), so it stays fast on a small machine while the
//! interleavings still vary from run to run.
//!
//! Ownership is tracked outside the allocator: a table with one owner word per slot index,
//! claimed with a compare-and-swap when a handle is received and released when it is given
//! back. A slot handed to two holders at once, or freed by a holder that does not own it,
//! fails the claim. Slot contents carry a signature of their writer, so a slot that two
//! threads believed they held would also show up as a foreign signature.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use state_pool::{
    Dtype, HostMemory, ImportMode, Plane, PoolError, PoolGeometry, SlotAllocator, SlotHandle,
    SlotKind, StateLayout, StatePool,
};

const FREE: u64 = u64::MAX;
const SEED: u64 = 0x5eed_c0de;
/// Wall-clock budget of one stress test.
const BUDGET: Duration = Duration::from_millis(400);

/// One owner word per slot index, claimed and released by compare-and-swap.
struct Owners {
    words: Vec<AtomicU64>,
    /// Claims that found the slot already owned, or releases by a non-owner.
    violations: AtomicUsize,
}

impl Owners {
    fn new(n: usize) -> Self {
        Self {
            words: (0..n).map(|_| AtomicU64::new(FREE)).collect(),
            violations: AtomicUsize::new(0),
        }
    }

    fn claim(&self, slot: usize, who: u64) {
        if self.words[slot]
            .compare_exchange(FREE, who, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn release(&self, slot: usize, who: u64) {
        if self.words[slot]
            .compare_exchange(who, FREE, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Hands a slot from one holder to another (a handle sent over a channel).
    fn transfer(&self, slot: usize, from: u64, to: u64) {
        if self.words[slot]
            .compare_exchange(from, to, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn rng_for(thread: usize) -> StdRng {
    StdRng::seed_from_u64(SEED ^ (thread as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Every slot of `alloc` can be taken once more and no more: none was lost, none duplicated.
fn assert_all_slots_come_back(alloc: &SlotAllocator) {
    let s = alloc.stats();
    assert_eq!(
        (s.in_use, s.free),
        (0, s.capacity),
        "after the stress: {s:?}"
    );
    let all: Vec<SlotHandle> = (0..s.capacity).map(|_| alloc.allocate().unwrap()).collect();
    let mut idx: Vec<usize> = all.iter().map(SlotHandle::index).collect();
    idx.sort_unstable();
    let want: Vec<usize> = (alloc.base()..alloc.base() + s.capacity).collect();
    assert_eq!(idx, want, "every slot exactly once");
    assert!(alloc.allocate().is_err(), "one slot more than the capacity");
}

#[test]
fn many_threads_never_hold_a_slot_twice_and_lose_none() {
    const THREADS: usize = 8;
    const CAPACITY: usize = 13;
    const MAX_OPS: usize = 40_000;
    let alloc = SlotAllocator::new(CAPACITY).unwrap();
    let owners = Owners::new(CAPACITY);
    let allocated = AtomicUsize::new(0);
    let freed = AtomicUsize::new(0);
    let exhausted = AtomicUsize::new(0);
    let start = Instant::now();
    // A ring of channels: thread t sends handles to thread t + 1, which drops them.
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..THREADS).map(|_| mpsc::channel::<SlotHandle>()).unzip();
    let receivers = std::thread::scope(|scope| {
        let joins: Vec<_> = receivers
            .into_iter()
            .enumerate()
            .map(|(t, rx)| {
                let next = senders[(t + 1) % THREADS].clone();
                let (alloc, owners) = (alloc.clone(), &owners);
                let (allocated, freed, exhausted) = (&allocated, &freed, &exhausted);
                scope.spawn(move || {
                    let me = t as u64;
                    let mut rng = rng_for(t);
                    let mut mine: Vec<SlotHandle> = Vec::new();
                    for op in 0..MAX_OPS {
                        if op % 256 == 0 && start.elapsed() > BUDGET {
                            break;
                        }
                        // Handles other threads sent us are ours now; drop them at once.
                        while let Ok(h) = rx.try_recv() {
                            owners.release(h.index(), me);
                            drop(h);
                            freed.fetch_add(1, Ordering::SeqCst);
                        }
                        match rng.random_range(0..10) {
                            0..=4 => match alloc.allocate() {
                                Ok(h) => {
                                    owners.claim(h.index(), me);
                                    allocated.fetch_add(1, Ordering::SeqCst);
                                    mine.push(h);
                                }
                                Err(PoolError::Exhausted { capacity }) => {
                                    assert_eq!(capacity, CAPACITY);
                                    exhausted.fetch_add(1, Ordering::SeqCst);
                                }
                                Err(e) => panic!("unexpected error: {e}"),
                            },
                            5..=7 if !mine.is_empty() => {
                                let h = mine.swap_remove(rng.random_range(0..mine.len()));
                                owners.release(h.index(), me);
                                h.release();
                                freed.fetch_add(1, Ordering::SeqCst);
                            }
                            8 if !mine.is_empty() => {
                                let h = mine.swap_remove(rng.random_range(0..mine.len()));
                                let to = ((t + 1) % THREADS) as u64;
                                owners.transfer(h.index(), me, to);
                                next.send(h).unwrap();
                            }
                            _ => {
                                let s = alloc.stats();
                                assert_eq!(s.in_use + s.free, CAPACITY, "{s:?}");
                                assert!(s.high_water <= CAPACITY, "{s:?}");
                                for h in &mine {
                                    assert!(alloc.is_held(h.index()));
                                }
                            }
                        }
                    }
                    for h in mine {
                        owners.release(h.index(), me);
                        drop(h);
                        freed.fetch_add(1, Ordering::SeqCst);
                    }
                    // Handles sent after this thread stopped wait in its channel.
                    rx
                })
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().unwrap())
            .collect::<Vec<_>>()
    });
    // The handles still in flight: their receivers are the stopped threads.
    for (t, rx) in receivers.iter().enumerate() {
        while let Ok(h) = rx.try_recv() {
            owners.release(h.index(), t as u64);
            drop(h);
            freed.fetch_add(1, Ordering::SeqCst);
        }
    }
    drop(senders);
    assert_eq!(owners.violations.load(Ordering::SeqCst), 0);
    assert!(owners
        .words
        .iter()
        .all(|w| w.load(Ordering::SeqCst) == FREE));
    let (a, f) = (
        allocated.load(Ordering::SeqCst),
        freed.load(Ordering::SeqCst),
    );
    assert!(
        a > 0 && exhausted.load(Ordering::SeqCst) > 0,
        "the stress must hit exhaustion"
    );
    assert_eq!(f, a, "every allocation freed exactly once");
    assert_eq!(alloc.stats().high_water, CAPACITY);
    assert_all_slots_come_back(&alloc);
}

/// The writer's signature: `[thread, serial]` as f32 bit patterns, repeated over the plane.
fn signature(g: &PoolGeometry, thread: u64, serial: u64) -> Vec<u8> {
    let words = [thread as u32 ^ 0xA5A5_0000, serial as u32];
    (0..g.ssm_slot_bytes() / 4)
        .flat_map(|i| words[i % 2].to_le_bytes())
        .collect()
}

fn small_geometry() -> PoolGeometry {
    PoolGeometry {
        layers: 2,
        h: 1,
        hv: 2,
        k: 4,
        v: 4,
        conv_rows: 2,
        conv_channels: 3,
        conv_dtype: Dtype::Bf16,
        state_dtype: Dtype::Fp32,
        layout: StateLayout::KFirst,
        ring_len: 0,
        ring_dtype: Dtype::Bf16,
        ring_deltas: false,
        slots: 6,
        checkpoint_slots: 4,
        rounding: Default::default(),
    }
}

#[test]
fn checkpoint_store_under_many_threads_keeps_every_state_with_its_owner() {
    const THREADS: usize = 6;
    const MAX_OPS: usize = 4_000;
    let g = small_geometry();
    let pool = Mutex::new(StatePool::new(HostMemory, g.clone()).unwrap());
    let (slots, ckpts) = {
        let p = pool.lock();
        (p.allocator().clone(), p.checkpoint_allocator().clone())
    };
    let owners = Owners::new(g.total_slots());
    let serial = AtomicU64::new(1);
    let restores = AtomicUsize::new(0);
    let ckpt_exhausted = AtomicUsize::new(0);
    let start = Instant::now();
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (pool, slots, ckpts, owners) = (&pool, slots.clone(), ckpts.clone(), &owners);
            let (serial, restores, ckpt_exhausted) = (&serial, &restores, &ckpt_exhausted);
            let g = &g;
            scope.spawn(move || {
                let me = t as u64;
                let mut rng = rng_for(100 + t);
                // (handle, signature serial written into it)
                let mut held: Vec<(SlotHandle, u64)> = Vec::new();
                let mut saved: Vec<(SlotHandle, u64)> = Vec::new();
                for op in 0..MAX_OPS {
                    if op % 64 == 0 && start.elapsed() > BUDGET {
                        break;
                    }
                    match rng.random_range(0..12) {
                        // Take a request slot and sign it.
                        0..=2 => {
                            let Ok(h) = slots.allocate() else { continue };
                            owners.claim(h.index(), me);
                            let s = serial.fetch_add(1, Ordering::SeqCst);
                            let sig = signature(g, me, s);
                            let mut p = pool.lock();
                            for layer in 0..g.layers {
                                p.write_slot_plane(layer, Plane::Ssm, h.index(), &sig)
                                    .unwrap();
                            }
                            drop(p);
                            held.push((h, s));
                        }
                        // Checkpoint one of ours.
                        3..=4 if !held.is_empty() => {
                            let (h, s) = &held[rng.random_range(0..held.len())];
                            let ck = match ckpts.allocate() {
                                Ok(ck) => ck,
                                Err(PoolError::CheckpointsExhausted { .. }) => {
                                    ckpt_exhausted.fetch_add(1, Ordering::SeqCst);
                                    continue;
                                }
                                Err(e) => panic!("unexpected error: {e}"),
                            };
                            owners.claim(ck.index(), me);
                            pool.lock().checkpoint_into(h.index(), &ck).unwrap();
                            saved.push((ck, *s));
                        }
                        // Restore a checkpoint into one of our slots and check the signature.
                        5..=6 if !held.is_empty() && !saved.is_empty() => {
                            let i = rng.random_range(0..held.len());
                            let (ck, s) = &saved[rng.random_range(0..saved.len())];
                            let mut p = pool.lock();
                            p.restore(ck, held[i].0.index()).unwrap();
                            let sig = signature(g, me, *s);
                            for layer in 0..g.layers {
                                let got = p
                                    .read_slot_plane(layer, Plane::Ssm, held[i].0.index())
                                    .unwrap();
                                assert!(got == sig, "thread {t}: a foreign state in its slot");
                            }
                            drop(p);
                            held[i].1 = *s;
                            restores.fetch_add(1, Ordering::SeqCst);
                        }
                        // Export a held slot and import it into another one of ours.
                        7 if held.len() >= 2 => {
                            let mut p = pool.lock();
                            let image = p.export_slot(held[0].0.index()).unwrap();
                            p.import_slot(held[1].0.index(), &image, ImportMode::Exact)
                                .unwrap();
                            drop(p);
                            held[1].1 = held[0].1;
                        }
                        // Give back a request slot or a checkpoint.
                        8..=9 if !held.is_empty() => {
                            let (h, _) = held.swap_remove(rng.random_range(0..held.len()));
                            owners.release(h.index(), me);
                            h.release();
                        }
                        10 if !saved.is_empty() => {
                            let (ck, _) = saved.swap_remove(rng.random_range(0..saved.len()));
                            owners.release(ck.index(), me);
                            drop(ck);
                        }
                        _ => {
                            // Our slots still hold what we wrote last.
                            let p = pool.lock();
                            for (h, s) in held.iter().chain(&saved) {
                                let got = p.read_slot_plane(0, Plane::Ssm, h.index()).unwrap();
                                assert!(
                                    got == signature(g, me, *s),
                                    "thread {t}: slot {}",
                                    h.index()
                                );
                            }
                        }
                    }
                    let (a, c) = (slots.stats(), ckpts.stats());
                    assert_eq!(a.in_use + a.free, g.slots);
                    assert_eq!(c.in_use + c.free, g.checkpoint_slots);
                }
                for (h, _) in held.into_iter().chain(saved) {
                    owners.release(h.index(), me);
                    drop(h);
                }
            });
        }
    });
    assert_eq!(owners.violations.load(Ordering::SeqCst), 0);
    assert!(
        restores.load(Ordering::SeqCst) > 0,
        "the stress must restore"
    );
    assert!(
        ckpt_exhausted.load(Ordering::SeqCst) > 0,
        "the stress must run out of checkpoint slots"
    );
    assert_all_slots_come_back(&slots);
    assert_all_slots_come_back(&ckpts);
    assert_eq!(ckpts.base(), g.slots);
}

#[test]
fn handles_dropped_by_panicking_threads_return_exactly_once() {
    const THREADS: usize = 4;
    let alloc = SlotAllocator::with_base(10, 8, SlotKind::Checkpoint).unwrap();
    let results: Vec<bool> = std::thread::scope(|scope| {
        let joins: Vec<_> = (0..THREADS)
            .map(|t| {
                let alloc = alloc.clone();
                scope.spawn(move || {
                    let _a = alloc.allocate().unwrap();
                    let _b = alloc.allocate().unwrap();
                    if t % 2 == 0 {
                        panic!("thread {t} fails while holding two slots");
                    }
                })
            })
            .collect();
        joins.into_iter().map(|j| j.join().is_ok()).collect()
    });
    assert_eq!(results, [false, true, false, true]);
    let s = alloc.stats();
    assert_eq!((s.in_use, s.free), (0, 8), "{s:?}");
    assert!((2..=8).contains(&s.high_water), "{s:?}");
    assert_all_slots_come_back(&alloc);
}
