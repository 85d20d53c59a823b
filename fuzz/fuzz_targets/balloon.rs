//! The balloon device, all queues and the config space, driven through the
//! virtio-mmio transport by a fuzzed driver, over the real guest-RAM code
//! (`GuestRam`: stage-2 tables and frames from a real frame table) as the
//! hypervisor wires them (vm/bus.rs `DeviceView`).
//!
//! Invariants, after every step:
//! - every access the device makes through the memory view is inside the
//!   VM's RAM, and every host access lands in a frame the VM owns, inside it;
//! - every backend call keeps its contract (in-RAM, distinct, ascending PFNs,
//!   state-consistent; disjoint in-RAM blocks holding no ballooned page);
//! - a page leaves the VM only by a valid request (an inflate, report or
//!   hint of that page in this step);
//! - frame table invariants hold, the VM maps exactly the frames it owns,
//!   pool + VM + table pages are constant;
//! - the balloon's bitmap equals the backend's set of ballooned pages, and
//!   ballooned = inflated - deflated - deflated on reset.
//!
//! At the end, the driver's reset and destroying the VM give every page back.
#![no_main]

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::Mutex;

use arbitrary::Arbitrary;
use hypervisor::addr::{GuestAddr, GuestPfn, PhysAddr};
use hypervisor::balloon::testing::FakeBackend;
use hypervisor::balloon::{Balloon, BalloonBackend, SUPPORTED_FEATURES};
use hypervisor::mm::frames::{FrameError, FrameUse, Shortfall, StaleIcache, PAGE_SIZE};
use hypervisor::mm::stage2::{TableMemory, ROOT_TABLES};
use hypervisor::virtio::mmio::{self, MmioTransport};
use hypervisor::virtio::testing::{driver_ok, handshake, DriverMemory, DriverQueue};
use hypervisor::virtio::{GuestMemError, GuestMemory};
use hypervisor::vm::memory::{GuestRam, HostMemory};
use hypervisor::vm::testing::FakeHost;
use libfuzzer_sys::fuzz_target;

const VM: usize = 1;
const BASE: u64 = 0x4000_0000;
const PAGES: u64 = 64;
const RAM_START: u64 = BASE / PAGE_SIZE;
const RAM_END: u64 = RAM_START + PAGES;
/// Host frames: the VM's RAM, its stage-2 tables (the root is 16) and a
/// few spare.
const HOST_PAGES: u64 = PAGES + ROOT_TABLES + 16;
const QSIZE: u16 = 16;
/// Request buffers go from here on (queues use the first 5 pages).
const BUFS: u64 = BASE + 8 * PAGE_SIZE;

/// A host whose page accesses must stay inside frames the VM owns.
struct CheckedHost(FakeHost);

impl CheckedHost {
    fn check(&self, pa: PhysAddr, len: usize) {
        assert_eq!(
            self.0.frame_owner(pa.page_base()),
            Some(VM),
            "host access to frame {pa:#x} the VM does not own"
        );
        assert!(
            pa.page_offset() as usize + len <= 4096,
            "host access {pa:#x}+{len} crosses a frame"
        );
    }
}

impl TableMemory for CheckedHost {
    fn alloc_table(&mut self) -> Option<PhysAddr> {
        self.0.alloc_table()
    }
    fn alloc_root(&mut self) -> Option<PhysAddr> {
        self.0.alloc_root()
    }
    fn free_table(&mut self, pa: PhysAddr) -> Result<(), FrameError> {
        self.0.free_table(pa)
    }
    fn table(&mut self, pa: PhysAddr) -> &mut [u64; 512] {
        self.0.table(pa)
    }
}

impl HostMemory for CheckedHost {
    fn alloc_frame(&mut self, vm: usize) -> Option<(PhysAddr, Option<StaleIcache>)> {
        self.0.alloc_frame(vm)
    }
    fn alloc_hypervisor_page(&mut self) -> Option<PhysAddr> {
        self.0.alloc_hypervisor_page()
    }
    fn free_frame(&mut self, vm: usize, pa: PhysAddr) -> Result<(), FrameError> {
        self.0.free_frame(vm, pa)
    }
    fn read(&mut self, pa: PhysAddr, buf: &mut [u8]) {
        self.check(pa, buf.len());
        self.0.read(pa, buf)
    }
    fn write(&mut self, pa: PhysAddr, data: &[u8]) {
        self.check(pa, data.len());
        self.0.write(pa, data)
    }
    fn flush_tlb(&mut self, vmid: u16) {
        self.0.flush_tlb(vmid)
    }
    fn invalidate_icache(&mut self, stale: StaleIcache) {
        self.0.invalidate_icache(stale)
    }
    fn frame_owner(&self, pa: PhysAddr) -> Option<usize> {
        self.0.frame_owner(pa)
    }
    fn frames_owned(&self, vm: usize) -> u64 {
        self.0.frames_owned(vm)
    }
    fn pool_free(&self) -> u64 {
        self.0.pool_free()
    }
    fn pool_low(&self) -> bool {
        self.0.pool_low()
    }
    fn guarantee(&mut self, vm: usize, pages: u64) -> Result<(), Shortfall> {
        self.0.guarantee(vm, pages)
    }
}

/// The device's view of the VM, as vm/run.rs builds it, plus the recording
/// backend that checks every call.
struct Env<'a> {
    ram: &'a mut GuestRam,
    host: &'a mut CheckedHost,
    backend: FakeBackend,
    /// Pages the guest touched again (backed anew), for `page_refaulted`.
    refaulted: Vec<u64>,
}

fn in_ram(ipa: GuestAddr, len: usize) -> bool {
    let ipa = ipa.raw();
    ipa >= BASE
        && ipa
            .checked_add(len as u64)
            .is_some_and(|end| end <= BASE + PAGES * PAGE_SIZE)
}

impl GuestMemory for Env<'_> {
    fn read(&mut self, ipa: GuestAddr, buf: &mut [u8]) -> Result<(), GuestMemError> {
        let r = self.ram.read(self.host, ipa, buf);
        assert_eq!(
            r.is_ok(),
            in_ram(ipa, buf.len()) || buf.is_empty(),
            "read {ipa:#x}+{}",
            buf.len()
        );
        r.map_err(|_| GuestMemError {
            ipa,
            len: buf.len(),
        })
    }
    fn write(&mut self, ipa: GuestAddr, data: &[u8]) -> Result<(), GuestMemError> {
        let r = self.ram.write(self.host, ipa, data);
        assert_eq!(
            r.is_ok(),
            in_ram(ipa, data.len()) || data.is_empty(),
            "write {ipa:#x}+{}",
            data.len()
        );
        r.map_err(|_| GuestMemError {
            ipa,
            len: data.len(),
        })
    }
}

impl BalloonBackend for Env<'_> {
    fn ram_pfns(&self) -> Range<GuestPfn> {
        self.ram.pfns()
    }
    fn now_us(&self) -> Option<u64> {
        Some(self.backend.now)
    }
    fn inflate(&mut self, pfns: &[GuestPfn]) {
        self.backend.inflate(pfns);
        self.ram.release(self.host, pfns);
    }
    fn deflate(&mut self, pfns: &[GuestPfn]) {
        self.backend.deflate(pfns);
    }
    fn report(&mut self, blocks: &[Range<GuestPfn>]) {
        self.backend.report(blocks);
        self.ram.release_blocks(self.host, blocks);
    }
    fn hint(&mut self, blocks: &[Range<GuestPfn>]) {
        self.backend.hint(blocks);
        self.ram.release_blocks(self.host, blocks);
    }
}

/// The guest's own stores: they back pages as the stage-2 fault path does.
impl DriverMemory for Env<'_> {
    fn poke(&mut self, ipa: u64, data: &[u8]) {
        let mut done = 0;
        while done < data.len() {
            let at = ipa + done as u64;
            let n = ((PAGE_SIZE - at % PAGE_SIZE) as usize).min(data.len() - done);
            let before = self.ram.stats.faults_backed;
            if self
                .ram
                .write(self.host, GuestAddr::new(at), &data[done..done + n])
                .is_err()
            {
                return;
            }
            if self.ram.stats.faults_backed != before {
                self.refaulted.push(at / PAGE_SIZE);
            }
            done += n;
        }
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Pfn {
    /// A page of RAM (by index).
    Ram(u8),
    Raw(u32),
}

impl Pfn {
    fn get(self) -> u32 {
        match self {
            Pfn::Ram(i) => (RAM_START + u64::from(i) % (PAGES + 2)) as u32,
            Pfn::Raw(p) => p,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// Probe as Linux does (reset, features, queues), then DRIVER_OK or not.
    Handshake {
        features: u8,
        ok: bool,
    },
    /// A buffer of PFNs on queue `queue` (inflate 0, deflate 1, ...).
    Pfns {
        queue: u8,
        pfns: Vec<Pfn>,
    },
    /// A chain of device-writable blocks (reporting, hinting).
    Blocks {
        queue: u8,
        blocks: Vec<(Pfn, u16, u8)>,
    },
    /// A statistics buffer.
    Stats {
        entries: Vec<(u16, u64)>,
        pad: u8,
    },
    /// A 4-byte command id buffer (free page hinting).
    HintId {
        queue: u8,
        id: u32,
    },
    /// Any chain at all: (IPA offset from RAM base or raw, len, writable).
    Raw {
        queue: u8,
        bufs: Vec<(u32, u32, bool)>,
    },
    /// Any register access.
    Write {
        offset: u16,
        width: u8,
        value: u32,
    },
    Read {
        offset: u16,
        width: u8,
    },
    Notify {
        queue: u8,
    },
    /// The guest writes its memory.
    Poke {
        page: u8,
        offset: u16,
        value: u32,
    },
    /// The host's side.
    SetTarget(u32),
    Tick(u32),
    RequestStats,
    StartHint,
    StopHint,
}

struct Driver {
    queues: Vec<DriverQueue>,
    next_buf: u64,
}

impl Driver {
    fn buffer(&mut self) -> u64 {
        let at = BUFS + (self.next_buf % 16) * 0x5000;
        self.next_buf += 1;
        at
    }
}

static HOST: Mutex<Option<CheckedHost>> = Mutex::new(None);

fn mapped(ram: &GuestRam, host: &mut CheckedHost) -> BTreeSet<u64> {
    let mut set = BTreeSet::new();
    ram.for_each_mapped(host, |ipa, _| {
        set.insert(ipa.pfn().raw());
    });
    set
}

fuzz_target!(|input: (u8, Vec<Op>)| {
    let (offer, ops) = input;
    let mut guard = HOST.lock().unwrap();
    let host = guard.get_or_insert_with(|| CheckedHost(FakeHost::new(HOST_PAGES)));
    let total = host.0.frames.total_pages();
    assert_eq!(
        host.0.frames.free_pages(),
        total,
        "a previous run left pages behind"
    );

    let offered = u64::from(offer) & SUPPORTED_FEATURES;
    let mut ram = GuestRam::new(host, VM, 1, GuestAddr::new(BASE), PAGES * PAGE_SIZE).unwrap();
    ram.populate(host).unwrap();
    let ram_pfns = GuestPfn::new(RAM_START)..GuestPfn::new(RAM_END);
    let mut t = MmioTransport::new(Balloon::new(offered, ram_pfns).unwrap());
    let mut env = Env {
        ram: &mut ram,
        host,
        backend: FakeBackend::new(RAM_START..RAM_END),
        refaulted: Vec::new(),
    };
    let queues = t.queues().len();
    let mut driver = Driver {
        queues: (0..queues as u64)
            .map(|q| {
                let at = BASE + q * PAGE_SIZE;
                DriverQueue::new(QSIZE, at, at + 0x400, at + 0x800)
            })
            .collect(),
        next_buf: 0,
    };

    let mut before = mapped(env.ram, env.host);
    let mut ram_stats = env.ram.stats;
    for op in ops.iter().take(64) {
        let calls = (
            env.backend.inflates.len(),
            env.backend.reports.len(),
            env.backend.hints.len(),
        );
        match op {
            Op::Handshake { features, ok } => {
                // Fresh driver-side rings, as after a reset.
                for q in driver.queues.iter_mut() {
                    *q = DriverQueue::new(QSIZE, q.desc, q.avail, q.used);
                }
                let accept = u64::from(*features) | hypervisor::virtio::VIRTIO_F_VERSION_1;
                let status = handshake(&mut t, &mut env, accept, &driver.queues);
                if *ok && status & mmio::STATUS_FEATURES_OK != 0 {
                    driver_ok(&mut t, &mut env);
                }
            }
            Op::Pfns { queue, pfns } => {
                let q = usize::from(*queue) % queues;
                let bytes: Vec<u8> = pfns
                    .iter()
                    .take(4200)
                    .flat_map(|p| p.get().to_le_bytes())
                    .collect();
                send_bytes(&mut t, &mut env, &mut driver, q, &bytes);
            }
            Op::Blocks { queue, blocks } => {
                let q = usize::from(*queue) % queues;
                let bufs: Vec<(u64, u32, bool)> = blocks
                    .iter()
                    .take(usize::from(QSIZE))
                    .map(|&(pfn, off, pages)| {
                        let ipa = u64::from(pfn.get()) * PAGE_SIZE
                            + u64::from(off & 0xfff) * u64::from(off >> 15);
                        (
                            ipa,
                            u32::from(pages) * PAGE_SIZE as u32 + u32::from(off & 0x7f00) / 0x100,
                            true,
                        )
                    })
                    .collect();
                send(&mut t, &mut env, &mut driver, q, &bufs);
            }
            Op::Stats { entries, pad } => {
                let Some(q) = t
                    .device()
                    .queue_index(hypervisor::balloon::QueueKind::Stats)
                else {
                    continue;
                };
                let mut bytes: Vec<u8> = entries
                    .iter()
                    .take(64)
                    .flat_map(|&(tag, val)| tag.to_le_bytes().into_iter().chain(val.to_le_bytes()))
                    .collect();
                bytes.extend(std::iter::repeat_n(0, usize::from(*pad % 12)));
                send_bytes(&mut t, &mut env, &mut driver, q, &bytes);
            }
            Op::HintId { queue, id } => {
                let q = usize::from(*queue) % queues;
                send_bytes(&mut t, &mut env, &mut driver, q, &id.to_le_bytes());
            }
            Op::Raw { queue, bufs } => {
                let q = usize::from(*queue) % queues;
                let bufs: Vec<(u64, u32, bool)> = bufs
                    .iter()
                    .take(usize::from(QSIZE) + 1)
                    .map(|&(off, len, w)| {
                        let ipa = if off & 1 == 0 {
                            BASE + u64::from(off >> 12)
                        } else {
                            u64::from(off) << 12
                        };
                        (ipa, len, w)
                    })
                    .collect();
                send(&mut t, &mut env, &mut driver, q, &bufs);
            }
            Op::Write {
                offset,
                width,
                value,
            } => {
                let _ = t.write(
                    u64::from(*offset) % mmio::WINDOW_SIZE,
                    *width,
                    *value,
                    &mut env,
                );
            }
            Op::Read { offset, width } => {
                if let Ok(v) = t.read(u64::from(*offset) % mmio::WINDOW_SIZE, *width) {
                    if *width < 4 {
                        assert!(u64::from(v) < 1 << (8 * u32::from(*width)));
                    }
                }
            }
            Op::Notify { queue } => {
                let _ = t.write(mmio::QUEUE_NOTIFY, 4, u32::from(*queue), &mut env);
            }
            Op::Poke {
                page,
                offset,
                value,
            } => {
                let ipa = BASE + u64::from(*page) % PAGES * PAGE_SIZE + u64::from(offset & 0xffc);
                env.poke(ipa, &value.to_le_bytes());
            }
            Op::SetTarget(pages) => {
                t.set_balloon_target(*pages);
            }
            Op::Tick(us) => {
                env.backend.now += u64::from(*us);
                let now = env.backend.now;
                t.poll_balloon(&mut env, now);
            }
            Op::RequestStats => {
                let now = env.backend.now;
                t.request_balloon_stats(&mut env, now);
            }
            Op::StartHint => {
                let _ = t.start_free_page_hint(env.backend.now);
            }
            Op::StopHint => {
                t.stop_free_page_hint(env.backend.now);
            }
        }
        for pfn in env.refaulted.drain(..) {
            t.device_mut().page_refaulted(GuestPfn::new(pfn));
        }

        // A page leaves the VM only by a valid request of this step.
        let after = mapped(env.ram, env.host);
        let mut given: BTreeSet<u64> = BTreeSet::new();
        given.extend(env.backend.inflates[calls.0..].iter().flatten());
        for b in env.backend.reports[calls.1..]
            .iter()
            .chain(&env.backend.hints[calls.2..])
            .flatten()
        {
            given.extend(b.clone());
        }
        for pfn in before.difference(&after) {
            assert!(
                given.contains(pfn),
                "page {pfn:#x} left the VM without a request ({op:?})"
            );
        }
        let stats = env.ram.stats;
        if before != after || stats != ram_stats {
            check_frames(&mut env, total);
        }
        check_balloon(&t, &env);
        before = after;
        ram_stats = stats;
    }

    // The VM stops: the driver's reset deflates everything, then the VM's
    // RAM is destroyed.
    t.reset(&mut env);
    check_balloon(&t, &env);
    check_frames(&mut env, total);
    drop(env);
    let host = guard.as_mut().unwrap();
    ram.destroy(host);
    assert_eq!(
        host.0.frames.guest_pages(VM),
        0,
        "pages lost after the VM stopped"
    );
    assert_eq!(
        host.0.frames.pages(FrameUse::PageTables),
        0,
        "tables lost after the VM stopped"
    );
    assert_eq!(host.0.frames.free_pages(), total);
});

/// One driver-written buffer holding `bytes`.
fn send_bytes(
    t: &mut MmioTransport<Balloon>,
    env: &mut Env,
    driver: &mut Driver,
    q: usize,
    bytes: &[u8],
) {
    let at = driver.buffer();
    env.poke(at, bytes);
    send(t, env, driver, q, &[(at, bytes.len() as u32, false)]);
}

fn send(
    t: &mut MmioTransport<Balloon>,
    env: &mut Env,
    driver: &mut Driver,
    q: usize,
    bufs: &[(u64, u32, bool)],
) {
    if bufs.is_empty() {
        return;
    }
    driver.queues[q].add(env, bufs);
    let _ = t.write(mmio::QUEUE_NOTIFY, 4, q as u32, env);
    let _ = driver.queues[q].take_used(env);
}

/// The balloon's own accounting (cheap: after every step).
fn check_balloon(t: &MmioTransport<Balloon>, env: &Env) {
    let b = t.device();
    assert_eq!(
        b.ballooned_pages(),
        env.backend.held.len() as u64,
        "bitmap vs backend"
    );
    for pfn in RAM_START..RAM_END {
        assert_eq!(
            b.is_ballooned(GuestPfn::new(pfn)),
            env.backend.held.contains(&pfn),
            "PFN {pfn:#x}"
        );
    }
    let s = b.stats();
    assert_eq!(
        s.pages_inflated - s.pages_deflated - s.pages_deflated_on_reset,
        b.ballooned_pages(),
        "counters: inflated - deflated != ballooned"
    );
}

/// Frame table and ownership (walks every table: after a step that changed
/// the VM's memory, and at the end).
fn check_frames(env: &mut Env, total: u64) {
    let frames = &env.host.0.frames;
    frames.check_invariants().unwrap();
    assert_eq!(
        frames.free_pages() + frames.guest_pages(VM) + frames.pages(FrameUse::PageTables),
        total,
        "pool + VM + tables changed"
    );
    env.ram.check(env.host).unwrap();
}
