//! A slot handle dropped mid-flight returns its slot exactly once: between the layers of a
//! step (a request aborted halfway), while unwinding from a panic in another thread, sent to
//! and dropped by another thread, and while a checkpoint of its slot lives on.

mod fault_kit;

use fault_kit::{plan, run_op, slot_bytes, Op, Rig, Tokens};
use kda_kernels::cpu::CpuBackend;
use rand::rngs::StdRng;
use rand::SeedableRng;
use state_pool::{AllocStats, Dtype, SlotAllocator, SlotHandle};

/// Every slot of `alloc` comes out once more, each exactly once.
fn assert_none_lost_none_twice(alloc: &SlotAllocator) {
    let s = alloc.stats();
    assert_eq!(s.in_use + s.free, s.capacity, "{s:?}");
    let all: Vec<SlotHandle> = std::iter::from_fn(|| alloc.allocate().ok()).collect();
    assert_eq!(all.len(), s.free, "{s:?}");
    let mut idx: Vec<usize> = all.iter().map(SlotHandle::index).collect();
    idx.sort_unstable();
    idx.dedup();
    assert_eq!(idx.len(), s.free, "a slot handed out twice");
}

fn freed_one(before: AllocStats, after: AllocStats) {
    assert_eq!(after.in_use + 1, before.in_use, "{before:?} -> {after:?}");
    assert_eq!(after.free, before.free + 1, "{before:?} -> {after:?}");
}

#[test]
fn a_request_aborted_between_layers_frees_its_slot_once_and_it_comes_back_zeroed() {
    let mut rng = StdRng::seed_from_u64(3);
    let g = fault_kit::geometry(Dtype::Fp16, 4, 4);
    let mut rig = Rig::new(g.clone(), &mut rng);
    let be = CpuBackend::new();
    let mut handles: Vec<SlotHandle> = (0..3).map(|_| rig.pool.allocate().unwrap()).collect();
    let toks: Vec<Tokens> = (0..3).map(|_| Tokens::random(&mut rng, &g, 6)).collect();
    let slots: Vec<u32> = handles.iter().map(SlotHandle::index_u32).collect();
    // Layer 0 of the step runs for all three.
    let all = Tokens::concat(&toks.iter().collect::<Vec<_>>());
    let p = plan(&[6, 6, 6], &slots);
    run_op(
        &be,
        &mut rig.pool,
        &rig.a_log[0],
        &rig.dt_bias[0],
        0,
        Op::Prefill,
        &p,
        &all,
        &[],
    )
    .unwrap();
    // The middle request is aborted before layer 1.
    let before = rig.pool.stats();
    let aborted = handles.remove(1);
    let index = aborted.index();
    assert!(
        slot_bytes(&rig.pool, index).iter().any(|&b| b != 0),
        "layer 0 wrote it"
    );
    drop(aborted);
    freed_one(before, rig.pool.stats());
    assert!(!rig.pool.allocator().is_held(index));
    // Layer 1 runs for the other two; nothing else is freed.
    let rest = Tokens::concat(&[&toks[0], &toks[2]]);
    let p = plan(&[6, 6], &[slots[0], slots[2]]);
    run_op(
        &be,
        &mut rig.pool,
        &rig.a_log[1],
        &rig.dt_bias[1],
        1,
        Op::Prefill,
        &p,
        &rest,
        &[],
    )
    .unwrap();
    assert_eq!(rig.pool.stats().in_use, 2);
    // The slot is handed out again, zeroed in every layer and plane.
    let again = rig.pool.allocate().unwrap();
    assert_eq!(again.index(), index);
    assert!(slot_bytes(&rig.pool, index).iter().all(|&b| b == 0));
    drop(again);
    assert_none_lost_none_twice(rig.pool.allocator());
}

#[test]
fn a_handle_dropped_while_unwinding_a_panic_frees_its_slot_once() {
    let alloc = SlotAllocator::new(4).unwrap();
    let keep = alloc.allocate().unwrap();
    let h = alloc.allocate().unwrap();
    let index = h.index();
    let before = alloc.stats();
    let joined = std::thread::spawn(move || {
        let _held = h;
        panic!("a worker fails mid-step");
    })
    .join();
    assert!(joined.is_err());
    freed_one(before, alloc.stats());
    assert!(!alloc.is_held(index) && alloc.is_held(keep.index()));
    assert_none_lost_none_twice(&alloc);
}

#[test]
fn a_handle_sent_to_another_thread_and_dropped_there_frees_its_slot_once() {
    let alloc = SlotAllocator::new(3).unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<SlotHandle>();
    let worker = std::thread::spawn(move || {
        let mut freed = Vec::new();
        while let Ok(h) = rx.recv() {
            freed.push(h.index());
            drop(h);
        }
        freed
    });
    let a = alloc.allocate().unwrap();
    let b = alloc.allocate().unwrap();
    let before = alloc.stats();
    let ia = a.index();
    tx.send(a).unwrap();
    drop(tx);
    assert_eq!(worker.join().unwrap(), vec![ia]);
    freed_one(before, alloc.stats());
    assert!(alloc.is_held(b.index()));
    drop(b);
    assert_eq!(alloc.stats().in_use, 0);
    assert_none_lost_none_twice(&alloc);
}

#[test]
fn a_checkpoint_outlives_the_request_slot_it_was_taken_from() {
    let mut rng = StdRng::seed_from_u64(4);
    let g = fault_kit::geometry(Dtype::Fp32, 0, 2);
    let mut rig = Rig::new(g.clone(), &mut rng);
    let h = rig.pool.allocate().unwrap();
    let t = Tokens::random(&mut rng, &g, 5);
    rig.run(Op::Prefill, &plan(&[5], &[h.index_u32()]), &t, &[])
        .unwrap();
    let state = slot_bytes(&rig.pool, h.index());
    let ck = rig.pool.checkpoint(h.index()).unwrap();
    let (slots_before, ckpts_before) = (rig.pool.stats(), rig.pool.checkpoint_allocator().stats());
    drop(h);
    freed_one(slots_before, rig.pool.stats());
    assert_eq!(rig.pool.checkpoint_allocator().stats(), ckpts_before);
    // The checkpoint still holds the state: a new request restores it.
    let n = rig.pool.allocate().unwrap();
    rig.pool.restore(&ck, n.index()).unwrap();
    assert!(slot_bytes(&rig.pool, n.index()) == state);
    drop(ck);
    freed_one(ckpts_before, rig.pool.checkpoint_allocator().stats());
    drop(n);
    assert_none_lost_none_twice(rig.pool.allocator());
    assert_none_lost_none_twice(rig.pool.checkpoint_allocator());
}
