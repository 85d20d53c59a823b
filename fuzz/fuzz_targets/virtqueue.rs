//! The split-virtqueue walker over a guest RAM that refuses (and logs) any
//! access outside it. The fuzzer is the driver: it writes the rings and
//! descriptors, picks the queue configuration, and the device pops chains,
//! copies from and into them and returns them.
//!
//! Invariants: a chain is well formed (at most `size` descriptors, each index
//! below `size`, readable before writable, lengths summed without overflow);
//! the cursors move by one per consumed entry; the in-flight count is
//! exactly chains popped minus chains returned; the device writes only the
//! used ring and the writable descriptors of the chain it fills; an access
//! outside RAM is refused, never performed.
#![no_main]

use arbitrary::Arbitrary;
use hypervisor::addr::GuestAddr;
use hypervisor::virtio::queue::{Area, Virtqueue};
use hypervisor::virtio::testing::VecMemory;
use hypervisor::virtio::{GuestMemory, QueueError};
use libfuzzer_sys::fuzz_target;

const BASE: u64 = 0x4000_0000;
const RAM: usize = 0x4000;

#[derive(Arbitrary, Debug)]
enum Addr {
    /// An offset into RAM (mostly inside it).
    Ram(u16),
    /// Any address at all.
    Raw(u64),
}

impl Addr {
    fn ipa(&self) -> u64 {
        match *self {
            Addr::Ram(off) => BASE + u64::from(off),
            Addr::Raw(a) => a,
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    /// The driver writes guest memory.
    Poke {
        at: u16,
        bytes: Vec<u8>,
    },
    /// The driver writes one descriptor.
    Desc {
        index: u8,
        addr: Addr,
        len: u32,
        flags: u16,
        next: u16,
    },
    /// The driver publishes `head` in the avail ring and bumps avail.idx.
    Publish {
        head: u16,
    },
    /// The driver sets avail.idx.
    AvailIdx {
        idx: u16,
    },
    /// Configure (only while not ready, as the transport enforces).
    Configure {
        num: u32,
        desc: Addr,
        avail: Addr,
        used: Addr,
    },
    Enable,
    Disable,
    /// The device pops a chain, reads `read` bytes at `offset` of its
    /// readable part, writes `write` bytes into its writable part, and
    /// returns it (`push`) or keeps it.
    Pop {
        offset: u32,
        read: u16,
        write: u16,
        push: bool,
        written: u32,
    },
    /// Return a chain by head, right or wrong.
    PushUsed {
        head: u16,
        written: u32,
    },
}

fuzz_target!(|ops: Vec<Op>| {
    let mut mem = VecMemory::new(BASE, RAM);
    let mut q = Virtqueue::new(256);
    // Driver-side state: where the rings are, for the driver's own writes.
    let (mut desc, mut avail, mut used) = (BASE, BASE + 0x1000, BASE + 0x2000);
    let mut avail_idx: u16 = 0;
    let mut in_flight: u32 = 0;
    let mut held: Vec<u16> = Vec::new();
    for op in ops.iter().take(256) {
        mem.clear_log();
        match op {
            Op::Poke { at, bytes } => {
                let at = u64::from(*at) % RAM as u64;
                let n = bytes.len().min(RAM - at as usize);
                mem.poke(BASE + at, &bytes[..n]);
            }
            Op::Desc {
                index,
                addr,
                len,
                flags,
                next,
            } => {
                let at = desc.wrapping_add(16 * u64::from(*index));
                let mut raw = [0u8; 16];
                raw[..8].copy_from_slice(&addr.ipa().to_le_bytes());
                raw[8..12].copy_from_slice(&len.to_le_bytes());
                raw[12..14].copy_from_slice(&flags.to_le_bytes());
                raw[14..].copy_from_slice(&next.to_le_bytes());
                let _ = mem.write(GuestAddr::new(at), &raw);
            }
            Op::Publish { head } => {
                let size = u64::from(q.size().max(1));
                let slot = u64::from(avail_idx) % size;
                let at = GuestAddr::new(avail.wrapping_add(4 + 2 * slot));
                let _ = mem.write(at, &head.to_le_bytes());
                avail_idx = avail_idx.wrapping_add(1);
                let _ = mem.write(
                    GuestAddr::new(avail.wrapping_add(2)),
                    &avail_idx.to_le_bytes(),
                );
            }
            Op::AvailIdx { idx } => {
                avail_idx = *idx;
                let _ = mem.write(GuestAddr::new(avail.wrapping_add(2)), &idx.to_le_bytes());
            }
            Op::Configure {
                num,
                desc: d,
                avail: a,
                used: u,
            } => {
                if q.ready() {
                    continue;
                }
                q.set_num(*num);
                for (area, addr, slot) in [
                    (Area::Descriptors, d, &mut desc),
                    (Area::Avail, a, &mut avail),
                    (Area::Used, u, &mut used),
                ] {
                    let ipa = addr.ipa();
                    q.set_area_half(area, false, ipa as u32);
                    q.set_area_half(area, true, (ipa >> 32) as u32);
                    assert_eq!(q.area(area), GuestAddr::new(ipa));
                    *slot = ipa;
                }
            }
            Op::Enable => {
                if q.ready() {
                    continue;
                }
                match q.enable(&mut mem) {
                    Ok(()) => {
                        let size = q.size();
                        assert!(size.is_power_of_two() && size <= q.max_size());
                        for area in [Area::Descriptors, Area::Avail, Area::Used] {
                            let start = q.area(area).raw();
                            assert_eq!(start % area.align(), 0);
                            let end = start + area.len(size);
                            assert!(
                                start >= BASE && end <= BASE + RAM as u64,
                                "{area} outside RAM"
                            );
                        }
                        assert_eq!((q.last_avail_idx(), q.used_idx(), q.in_flight()), (0, 0, 0));
                        in_flight = 0;
                        held.clear();
                    }
                    Err(_) => assert!(!q.ready()),
                }
                assert!(mem.writes().is_empty(), "enable wrote guest memory");
            }
            Op::Disable => {
                q.disable();
                in_flight = 0;
                held.clear();
            }
            Op::Pop {
                offset,
                read,
                write,
                push,
                written,
            } => {
                let before = q.last_avail_idx();
                let res = q.pop(&mut mem);
                assert!(mem.writes().is_empty(), "pop wrote guest memory");
                match res {
                    Ok(None) => assert_eq!(q.last_avail_idx(), before),
                    Ok(Some(chain)) => {
                        assert_eq!(q.last_avail_idx(), before.wrapping_add(1));
                        in_flight += 1;
                        check_chain(&chain, q.size());
                        let mut buf = vec![0u8; usize::from(*read)];
                        if let Ok(n) = chain.read_readable_at(&mut mem, *offset, &mut buf) {
                            let left = chain.readable_len().saturating_sub(*offset);
                            assert_eq!(n as u64, u64::from(left).min(buf.len() as u64));
                        }
                        let data = vec![0xa5u8; usize::from(*write)];
                        match chain.write_writable(&mut mem, &data) {
                            Ok(n) => assert_eq!(
                                n as u64,
                                u64::from(chain.writable_len()).min(data.len() as u64)
                            ),
                            Err(e) => assert_eq!(e.head(), Some(chain.head())),
                        }
                        for &(ipa, len) in mem.writes() {
                            let inside = chain.descriptors().iter().any(|d| {
                                d.writable
                                    && ipa >= d.ipa.raw()
                                    && ipa + len as u64 <= d.ipa.raw() + u64::from(d.len)
                            });
                            assert!(
                                inside,
                                "write at {ipa:#x}+{len} outside the chain's writable buffers"
                            );
                        }
                        mem.clear_log();
                        if *push {
                            push_used(&mut q, &mut mem, chain.head(), *written, &mut in_flight);
                        } else {
                            held.push(chain.head());
                        }
                    }
                    Err(e) => {
                        let moved = q.last_avail_idx().wrapping_sub(before);
                        assert!(moved <= 1);
                        if e.head().is_some() {
                            assert_eq!(moved, 1, "{e}: a head was consumed");
                            in_flight += 1;
                        }
                        if matches!(e, QueueError::HeadOutOfRange { .. }) {
                            assert_eq!(moved, 1, "a bad head consumes its slot");
                        }
                    }
                }
            }
            Op::PushUsed { head, written } => {
                let head = held.pop().unwrap_or(*head);
                push_used(&mut q, &mut mem, head, *written, &mut in_flight);
            }
        }
        assert_eq!(q.in_flight(), in_flight, "chains in flight");
        if !q.ready() {
            assert_eq!(q.size(), 0);
        }
    }
});

fn push_used(q: &mut Virtqueue, mem: &mut VecMemory, head: u16, written: u32, in_flight: &mut u32) {
    let before = q.used_idx();
    let used = q.area(Area::Used).raw();
    match q.push_used(mem, head, written) {
        Ok(()) => {
            *in_flight -= 1;
            assert_eq!(q.used_idx(), before.wrapping_add(1));
            let area = used..used + Area::Used.len(q.size());
            for &(ipa, len) in mem.writes() {
                assert!(
                    area.contains(&ipa) && ipa + len as u64 <= area.end,
                    "push_used wrote {ipa:#x}+{len} outside the used ring"
                );
            }
            let mut idx = [0u8; 2];
            mem.read(GuestAddr::new(used + 2), &mut idx).unwrap();
            assert_eq!(u16::from_le_bytes(idx), q.used_idx());
        }
        Err(_) => assert_eq!(q.used_idx(), before),
    }
    mem.clear_log();
}

fn check_chain(chain: &hypervisor::virtio::DescChain, size: u16) {
    let descs = chain.descriptors();
    assert!(!descs.is_empty() && descs.len() <= usize::from(size));
    assert!(chain.head() < size);
    assert_eq!(descs[0].index, chain.head());
    let (mut r, mut w) = (0u64, 0u64);
    let mut seen_writable = false;
    for d in descs {
        assert!(d.index < size);
        assert!(d.ipa.checked_add(u64::from(d.len)).is_some());
        assert!(!seen_writable || d.writable, "readable after writable");
        seen_writable |= d.writable;
        if d.writable {
            w += u64::from(d.len);
        } else {
            r += u64::from(d.len);
        }
    }
    assert_eq!(
        (r, w),
        (
            u64::from(chain.readable_len()),
            u64::from(chain.writable_len())
        )
    );
    assert!(r + w <= u64::from(u32::MAX));
}
