//! The slot allocator: a flat array of slot states and an O(1) free list behind a
//! `parking_lot::Mutex`, shared by every clone of a [`SlotAllocator`] and every thread.
//!
//! [`SlotAllocator::allocate`] hands out a [`SlotHandle`], which frees its slot when dropped or
//! when [`SlotHandle::release`] is called. A handle is the only way to hold a slot and it cannot
//! be cloned, so no slot is ever held twice. Exhaustion is an error value.
//!
//! The allocator only tracks ownership; zeroing a fresh slot's planes is
//! [`crate::StatePool::allocate`]'s job.

use std::sync::Arc;

use parking_lot::Mutex;
use serde::Serialize;

use crate::error::{PoolError, Result};

/// Which slots an allocator hands out (selects the exhaustion error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotKind {
    /// Request slots (one per running sequence).
    Request,
    /// Checkpoint slots (copies of request slots).
    Checkpoint,
}

/// Counts of an allocator at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AllocStats {
    /// Slots the allocator manages.
    pub capacity: usize,
    /// Slots held now.
    pub in_use: usize,
    /// Slots free now (`capacity - in_use`).
    pub free: usize,
    /// The most slots ever held at once.
    pub high_water: usize,
}

#[derive(Debug)]
struct State {
    /// Free slots (offsets from `base`), a stack: allocate pops, free pushes.
    free: Vec<u32>,
    /// Per slot: whether a handle holds it.
    held: Vec<bool>,
    high_water: usize,
}

#[derive(Debug)]
struct Shared {
    base: u32,
    kind: SlotKind,
    state: Mutex<State>,
}

impl Shared {
    fn free(&self, index: u32) {
        let offset = index - self.base;
        let mut st = self.state.lock();
        let held = &mut st.held[offset as usize];
        // A handle is unique and frees once, so this holds by construction.
        debug_assert!(*held, "slot {index} freed while not held");
        if *held {
            *held = false;
            st.free.push(offset);
        }
    }
}

/// A thread-safe O(1) slot allocator over the indices `base..base + capacity`. Clones share the
/// same slots.
#[derive(Debug, Clone)]
pub struct SlotAllocator {
    shared: Arc<Shared>,
}

impl SlotAllocator {
    /// An allocator of the request slots `0..capacity`.
    pub fn new(capacity: usize) -> Result<Self> {
        Self::with_base(0, capacity, SlotKind::Request)
    }

    /// An allocator of the slots `base..base + capacity` (checkpoint slots follow the request
    /// slots in every plane). The indices must fit in `u32`.
    pub fn with_base(base: usize, capacity: usize, kind: SlotKind) -> Result<Self> {
        let end = base
            .checked_add(capacity)
            .filter(|&e| u32::try_from(e).is_ok())
            .ok_or_else(|| {
                PoolError::arg(
                    "slots",
                    format!("{base} + {capacity} slots do not fit 32-bit slot indices"),
                )
            })?;
        debug_assert!(end >= base);
        Ok(Self {
            shared: Arc::new(Shared {
                base: base as u32,
                kind,
                state: Mutex::new(State {
                    // Reversed so the lowest index is handed out first.
                    free: (0..capacity as u32).rev().collect(),
                    held: vec![false; capacity],
                    high_water: 0,
                }),
            }),
        })
    }

    /// Takes a free slot in O(1). Exhaustion is an error ([`PoolError::Exhausted`] or
    /// [`PoolError::CheckpointsExhausted`]).
    pub fn allocate(&self) -> Result<SlotHandle> {
        let mut st = self.shared.state.lock();
        let Some(offset) = st.free.pop() else {
            let capacity = st.held.len();
            return Err(match self.shared.kind {
                SlotKind::Request => PoolError::Exhausted { capacity },
                SlotKind::Checkpoint => PoolError::CheckpointsExhausted { capacity },
            });
        };
        st.held[offset as usize] = true;
        let in_use = st.held.len() - st.free.len();
        st.high_water = st.high_water.max(in_use);
        drop(st);
        Ok(SlotHandle {
            index: self.shared.base + offset,
            owner: Arc::clone(&self.shared),
        })
    }

    /// Counts now.
    pub fn stats(&self) -> AllocStats {
        let st = self.shared.state.lock();
        let capacity = st.held.len();
        AllocStats {
            capacity,
            in_use: capacity - st.free.len(),
            free: st.free.len(),
            high_water: st.high_water,
        }
    }

    /// Slots managed.
    pub fn capacity(&self) -> usize {
        self.shared.state.lock().held.len()
    }

    /// The first slot index managed.
    pub fn base(&self) -> usize {
        self.shared.base as usize
    }

    /// Whether slot `index` is held by some handle now.
    pub fn is_held(&self, index: usize) -> bool {
        let st = self.shared.state.lock();
        index
            .checked_sub(self.base())
            .and_then(|o| st.held.get(o).copied())
            .unwrap_or(false)
    }

    /// Whether `handle` came from this allocator (or a clone of it).
    pub fn owns(&self, handle: &SlotHandle) -> bool {
        Arc::ptr_eq(&self.shared, &handle.owner)
    }
}

/// A held slot. Frees the slot when dropped; [`SlotHandle::release`] frees it explicitly.
#[derive(Debug)]
pub struct SlotHandle {
    index: u32,
    owner: Arc<Shared>,
}

impl SlotHandle {
    /// The slot's index in the pool's planes.
    pub fn index(&self) -> usize {
        self.index as usize
    }

    /// The slot's index as the kernels take it.
    pub fn index_u32(&self) -> u32 {
        self.index
    }

    /// Which kind of slot this is.
    pub fn kind(&self) -> SlotKind {
        self.owner.kind
    }

    /// Frees the slot now (the same as dropping the handle).
    pub fn release(self) {
        drop(self)
    }
}

impl Drop for SlotHandle {
    fn drop(&mut self) {
        self.owner.free(self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[test]
    fn allocation_fails_when_exhausted_and_recovers_after_release() {
        let a = SlotAllocator::new(2).unwrap();
        let s0 = a.allocate().unwrap();
        let s1 = a.allocate().unwrap();
        assert_eq!((s0.index(), s1.index()), (0, 1));
        let e = a.allocate().unwrap_err();
        assert!(matches!(e, PoolError::Exhausted { capacity: 2 }), "{e}");
        s1.release();
        assert_eq!(a.allocate().unwrap().index(), 1);
        drop(s0);
    }

    #[test]
    fn checkpoint_allocator_hands_out_indices_after_its_base() {
        let a = SlotAllocator::with_base(8, 2, SlotKind::Checkpoint).unwrap();
        let c = a.allocate().unwrap();
        assert_eq!(c.index(), 8);
        assert_eq!(c.kind(), SlotKind::Checkpoint);
        let _d = a.allocate().unwrap();
        let e = a.allocate().unwrap_err();
        assert!(
            matches!(e, PoolError::CheckpointsExhausted { capacity: 2 }),
            "{e}"
        );
        assert!(a.is_held(8) && !a.is_held(0) && !a.is_held(10));
    }

    #[test]
    fn stats_track_use_and_high_water() {
        let a = SlotAllocator::new(4).unwrap();
        let h: Vec<_> = (0..3).map(|_| a.allocate().unwrap()).collect();
        drop(h);
        let _x = a.allocate().unwrap();
        let s = a.stats();
        assert_eq!(
            s,
            AllocStats {
                capacity: 4,
                in_use: 1,
                free: 3,
                high_water: 3
            }
        );
    }

    #[test]
    fn handles_know_their_allocator() {
        let a = SlotAllocator::new(1).unwrap();
        let b = SlotAllocator::new(1).unwrap();
        let h = a.allocate().unwrap();
        assert!(a.owns(&h) && a.clone().owns(&h) && !b.owns(&h));
    }

    #[test]
    fn indices_beyond_u32_are_refused() {
        assert!(SlotAllocator::with_base(u32::MAX as usize, 2, SlotKind::Request).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Several threads allocate and release at random; a slot is never held by two handles,
        /// the counts add up, and every slot comes back.
        #[test]
        fn random_concurrent_use_never_holds_a_slot_twice(
            capacity in 1usize..24,
            scripts in prop::collection::vec(prop::collection::vec(any::<bool>(), 1..200), 2..5),
        ) {
            let alloc = SlotAllocator::new(capacity).unwrap();
            let held: Vec<AtomicBool> = (0..capacity).map(|_| AtomicBool::new(false)).collect();
            let twice = AtomicBool::new(false);
            std::thread::scope(|scope| {
                for script in &scripts {
                    let (alloc, held, twice) = (alloc.clone(), &held, &twice);
                    scope.spawn(move || {
                        let mut mine: Vec<SlotHandle> = Vec::new();
                        for &take in script {
                            if take || mine.is_empty() {
                                match alloc.allocate() {
                                    Ok(h) => {
                                        if held[h.index()].swap(true, Ordering::SeqCst) {
                                            twice.store(true, Ordering::SeqCst);
                                        }
                                        mine.push(h);
                                    }
                                    Err(PoolError::Exhausted { .. }) => {}
                                    Err(e) => panic!("unexpected error {e}"),
                                }
                            } else {
                                let h = mine.swap_remove(mine.len() / 2);
                                if !held[h.index()].swap(false, Ordering::SeqCst) {
                                    twice.store(true, Ordering::SeqCst);
                                }
                                h.release();
                            }
                            let s = alloc.stats();
                            assert_eq!(s.in_use + s.free, capacity);
                            assert!(s.high_water <= capacity);
                        }
                        for h in mine {
                            held[h.index()].store(false, Ordering::SeqCst);
                        }
                    });
                }
            });
            prop_assert!(!twice.load(Ordering::SeqCst));
            let s = alloc.stats();
            prop_assert_eq!((s.in_use, s.free), (0, capacity));
            let all: Vec<SlotHandle> = (0..capacity).map(|_| alloc.allocate().unwrap()).collect();
            let mut idx: Vec<usize> = all.iter().map(|h| h.index()).collect();
            idx.sort_unstable();
            prop_assert_eq!(idx, (0..capacity).collect::<Vec<_>>());
            prop_assert!(alloc.allocate().is_err());
        }
    }
}
