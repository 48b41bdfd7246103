//! Bytes the index keeps per pod, by kind, for pods like the scale bench's (one secondary
//! network, one pool entry and one reservation each): `cargo run --release -p ipreclaim-core
//! --example index_bytes [-- PODS]` (default 100,000). Counts live heap bytes with a counting
//! allocator, so a change to the index's records shows at once, without an apiserver.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use ipreclaim_core::api::lenient::Lenient;
use ipreclaim_core::api::slim::PodView;
use ipreclaim_core::api::{
    IPAllocation, IPPool, IPPoolSpec, OverlappingRangeIPReservation,
    OverlappingRangeIPReservationSpec,
};
use ipreclaim_core::index::Index;
use ipreclaim_core::index::kinds::{Pods, Pools, Reservations};
use ipreclaim_core::index::relist::{Relist, Step};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
/// What glibc's malloc takes for them: a chunk of at least 32 bytes, 8 of header, 16-aligned.
static CHUNKS: AtomicUsize = AtomicUsize::new(0);

fn chunk(size: usize) -> usize {
    ((size + 8 + 15) & !15).max(32)
}

// SAFETY: forwards to the system allocator, counting the bytes it hands out.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::Relaxed);
        CHUNKS.fetch_add(chunk(l.size()), Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        CHUNKS.fetch_sub(chunk(l.size()), Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new, Ordering::Relaxed);
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        CHUNKS.fetch_add(chunk(new), Ordering::Relaxed);
        CHUNKS.fetch_sub(chunk(l.size()), Ordering::Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

fn now_bytes() -> (usize, usize) {
    (LIVE.load(Ordering::Relaxed), CHUNKS.load(Ordering::Relaxed))
}

const PER_POOL: usize = 5000;

fn pod(ns: &str, i: usize) -> PodView {
    let pool = i / PER_POOL;
    let offset = i % PER_POOL + 1;
    let status = serde_json::json!([{
        "name": format!("{ns}/net-{pool}"), "interface": "net1",
        "ips": [format!("10.{}.{}.{}", 20 + pool, offset / 256, offset % 256)],
        "mac": "02:00:00:00:00:01", "dns": {},
    }]);
    let text = serde_json::json!({
        "metadata": {"name": format!("k1-{i}"), "namespace": ns,
            "uid": format!("6f1c9d2e-8a4b-4c3d-9e2f-{i:012x}"), "resourceVersion": "1",
            "annotations": {"k8s.v1.cni.cncf.io/network-status": status.to_string()}},
        "spec": {"nodeName": "bench-node"},
        "status": {"phase": "Running"},
    });
    serde_json::from_value(text).unwrap()
}

fn main() {
    let pods: usize = std::env::args()
        .nth(1)
        .map_or(100_000, |n| n.parse().unwrap());
    let ns = "scale-bench-ns";
    let now = Instant::now();
    let mut ix = Index::default();
    eprintln!(
        "LiveInfo {} NA {} PoolEntry {}",
        std::mem::size_of::<ipreclaim_core::index::LiveInfo>(),
        std::mem::size_of::<ipreclaim_core::ipam::NetworkAttachment>(),
        std::mem::size_of::<ipreclaim_core::ipam::PoolEntry>()
    );
    let base = now_bytes();

    let mut relist = Relist::<Pods>::default();
    relist.step(&mut ix, Step::Begin, now);
    for i in 0..pods {
        relist.step(&mut ix, Step::Listed(pod(ns, i)), now);
    }
    relist.step(&mut ix, Step::Done, now);
    let after_pods = now_bytes();

    let mut relist = Relist::<Pools>::default();
    relist.step(&mut ix, Step::Begin, now);
    for p in 0..pods.div_ceil(PER_POOL) {
        let allocations: BTreeMap<String, IPAllocation> = (0..PER_POOL.min(pods - p * PER_POOL))
            .map(|o| {
                let i = p * PER_POOL + o;
                let entry = IPAllocation {
                    id: format!("sandbox-k1-{i}"),
                    podref: format!("{ns}/k1-{i}"),
                    ifname: Some("net1".into()),
                    ipamclaimref: None,
                };
                ((o + 1).to_string(), entry)
            })
            .collect();
        let mut pool = IPPool::new(
            &format!("10.{}.0.0-18", 20 + p),
            IPPoolSpec {
                range: format!("10.{}.0.0/18", 20 + p),
                allocations,
            },
        );
        pool.metadata.uid = Some(format!("pool-{p}"));
        relist.step(&mut ix, Step::Listed(Lenient::Valid(pool)), now);
    }
    relist.step(&mut ix, Step::Done, now);
    let after_pools = now_bytes();

    let mut relist = Relist::<Reservations>::default();
    relist.step(&mut ix, Step::Begin, now);
    for i in 0..pods {
        let (pool, offset) = (i / PER_POOL, i % PER_POOL + 1);
        let mut r = OverlappingRangeIPReservation::new(
            &format!("10.{}.{}.{}", 20 + pool, offset / 256, offset % 256),
            OverlappingRangeIPReservationSpec {
                containerid: Some(format!("sandbox-k1-{i}")),
                podref: format!("{ns}/k1-{i}"),
                ifname: Some("net1".into()),
                ipamclaimref: None,
            },
        );
        r.metadata.uid = Some(format!("7a2c9d2e-8a4b-4c3d-9e2f-{i:012x}"));
        relist.step(&mut ix, Step::Listed(Lenient::Valid(r)), now);
    }
    relist.step(&mut ix, Step::Done, now);
    let after_res = now_bytes();

    for (what, pick) in [("asked", 0), ("in malloc chunks", 1)] {
        let at = |b: (usize, usize)| if pick == 0 { b.0 } else { b.1 };
        let per = |a, b| (at(b) - at(a)) as f64 / pods as f64;
        println!(
            "{pods} pods, bytes {what}: live pods {:.0} B/pod, pools {:.0} B/entry, reservations {:.0} B/reservation; total {:.1} MiB",
            per(base, after_pods),
            per(after_pods, after_pools),
            per(after_pools, after_res),
            (at(after_res) - at(base)) as f64 / (1 << 20) as f64,
        );
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let rss = status
        .lines()
        .find(|l| l.starts_with("VmRSS"))
        .unwrap_or_default();
    println!("{rss}");
    std::hint::black_box(&ix);
}
