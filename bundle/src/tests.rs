//! Round trips, one test per rejected field, and never-panic sweeps.

use crate::writer::{fix_crc, put32, put64};
use crate::*;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn spec(name: &str) -> VmSpec {
    VmSpec {
        name: name.into(),
        ram_size: 64 << 20,
        vcpus: 2,
        cpu_affinity: 0b1111,
        kernel: pattern(5000, 1),
        initrd: Some(pattern(3000, 2)),
        cmdline: Some("console=ttyAMA0 earlycon".into()),
        balloon_features: 0b110,
        devices: devices::BALLOON,
        on_bad_access: bad_access::ABORT,
        restore: None,
    }
}

fn three() -> Vec<VmSpec> {
    let mut b = spec("bare-metal_1");
    b.initrd = None;
    b.cmdline = None;
    b.balloon_features = 0;
    b.devices = 0;
    b.vcpus = 1;
    b.cpu_affinity = 1;
    b.ram_size = 4096 * 3;
    b.kernel = pattern(4096, 9);
    let mut c = spec("linux");
    c.kernel = pattern(12_345, 3);
    c.cmdline = Some("root=/dev/ram0 ünicode".into());
    c.initrd = None;
    vec![spec("first"), b, c]
}

fn build(specs: &[VmSpec]) -> Vec<u8> {
    let mut bb = BundleBuilder::new();
    for s in specs {
        bb.add_vm(s.clone()).unwrap();
    }
    bb.build()
}

fn check_round_trip(specs: &[VmSpec]) {
    let bytes = build(specs);
    assert_eq!(bytes.len() % BLOB_ALIGN as usize, 0);
    let b = parse(&bytes).unwrap();
    assert_eq!(b.version(), VERSION);
    assert_eq!(b.total_size(), bytes.len() as u64);
    assert_eq!(b.vm_count(), specs.len());
    assert_eq!(b.vms().len(), specs.len());
    let mut n = 0;
    for (vm, s) in b.vms().zip(specs) {
        assert_eq!(vm.index(), n);
        assert_eq!(vm.name(), s.name);
        assert_eq!(vm.ram_size(), s.ram_size);
        assert_eq!(vm.vcpus(), s.vcpus);
        assert_eq!(vm.cpu_affinity(), s.cpu_affinity);
        assert_eq!(vm.kernel(), &s.kernel[..]);
        assert_eq!(vm.initrd(), s.initrd.as_deref());
        assert_eq!(vm.cmdline(), s.cmdline.as_deref());
        assert_eq!(vm.balloon_features(), s.balloon_features);
        assert_eq!(vm.devices(), s.devices);
        assert_eq!(vm.on_bad_access(), s.on_bad_access);
        assert_eq!(vm.has_balloon(), s.devices & devices::BALLOON != 0);
        // Blobs start page-aligned within the bundle.
        let base = bytes.as_ptr() as usize;
        assert_eq!((vm.kernel().as_ptr() as usize - base) % 4096, 0);
        if let Some(i) = vm.initrd() {
            assert_eq!((i.as_ptr() as usize - base) % 4096, 0);
        }
        assert_eq!(b.find(&s.name).map(|v| v.index()), Some(n));
        assert_eq!(b.vm(n).map(|v| v.name()), Some(&s.name[..]));
        n += 1;
    }
    assert_eq!(n, specs.len());
    assert!(b.vm(n).is_none());
    assert!(b.find("nope").is_none());
    // Same input, same bytes.
    assert_eq!(build(specs), bytes);
    // Trailing padding after total_size is ignored.
    let mut padded = bytes.clone();
    padded.extend_from_slice(&[0xAA; 5000]);
    assert_eq!(parse(&padded).unwrap().total_size(), bytes.len() as u64);
}

#[test]
fn round_trip_empty() {
    check_round_trip(&[]);
    let bytes = BundleBuilder::new().build();
    assert_eq!(bytes.len(), 4096);
    assert_eq!(&bytes[..8], b"TIDALBND");
    let b = parse_untrusted(&bytes).unwrap();
    assert_eq!(b.vms().count(), 0);
}

#[test]
fn round_trip_one() {
    check_round_trip(&[spec("linux")]);
}

#[test]
fn round_trip_stop_policy_and_old_bundles_read_as_abort() {
    let stop = VmSpec {
        on_bad_access: bad_access::STOP,
        ..spec("strict")
    };
    check_round_trip(&[spec("linux"), stop]);
    // A bundle written before the field existed has zero there (it was
    // reserved and had to be zero): it reads as the default, abort.
    let bytes = build(&[spec("old")]);
    assert_eq!(read_u32(&bytes, E0 + entry::ON_BAD_ACCESS), 0);
    let b = parse(&bytes).unwrap();
    assert_eq!(b.vm(0).unwrap().on_bad_access(), bad_access::ABORT);
}

#[test]
fn round_trip_three() {
    check_round_trip(&three());
}

#[test]
fn round_trip_max_name_and_empty_cmdline() {
    let mut s = spec("abcdefghijklmnopqrstuvwxyz012345");
    s.cmdline = Some(String::new());
    let bytes = build(&[s]);
    let b = parse(&bytes).unwrap();
    let vm = b.vms().next().unwrap();
    assert_eq!(vm.name(), "abcdefghijklmnopqrstuvwxyz012345");
    assert_eq!(vm.cmdline(), None);
}

#[test]
fn larger_header_and_entries_are_accepted() {
    // A compatible extension: header 128 bytes, entries 256 bytes; the bytes
    // past the pool extension and past 192 are ignored by a version 1 reader.
    let v1 = build(&[spec("a")]);
    let v1b = parse(&v1).unwrap();
    let vm = v1b.vms().next().unwrap();
    let (hs, es) = (128usize, 256usize);
    let mut out = vec![0u8; 8192];
    out[..HEADER_SIZE_POOL].copy_from_slice(&v1[..HEADER_SIZE_POOL]);
    out[HEADER_SIZE_POOL..hs].fill(0x77);
    out[hs..hs + VM_ENTRY_SIZE].copy_from_slice(&v1[E0..E0 + VM_ENTRY_SIZE]);
    out[hs + VM_ENTRY_SIZE..hs + es].fill(0x55);
    let k = out.len();
    out.extend_from_slice(vm.kernel());
    out.resize(k + 8192, 0);
    let i = out.len();
    out.extend_from_slice(vm.initrd().unwrap());
    out.resize(i + 4096, 0);
    let c = out.len();
    out.extend_from_slice(vm.cmdline().unwrap().as_bytes());
    let e = hs;
    put64(&mut out, e + entry::KERNEL_OFFSET, k as u64);
    put64(&mut out, e + entry::INITRD_OFFSET, i as u64);
    put64(&mut out, e + entry::CMDLINE_OFFSET, c as u64);
    put32(&mut out, header::HEADER_SIZE, hs as u32);
    put32(&mut out, header::VM_ENTRY_SIZE, es as u32);
    put64(&mut out, header::VM_TABLE_OFFSET, hs as u64);
    put64(&mut out, header::VM_TABLE_SIZE, es as u64);
    let total = out.len() as u64;
    put64(&mut out, header::TOTAL_SIZE, total);
    fix_crc(&mut out);
    let b = parse(&out).unwrap();
    let got = b.vms().next().unwrap();
    assert_eq!(got.kernel(), vm.kernel());
    assert_eq!(got.initrd(), vm.initrd());
    assert_eq!(got.cmdline(), vm.cmdline());
    assert_eq!(b.header_size(), hs);
}

// ---------------------------------------------------------------------------
// Memory limits and the pool extension.

const MIB: u64 = 1 << 20;

fn build_mem(vms: &[(VmSpec, VmMemory)], pool: PoolSpec) -> Vec<u8> {
    let mut bb = BundleBuilder::new();
    bb.pool(pool).unwrap();
    for (s, m) in vms {
        bb.add_vm_with_memory(s.clone(), *m).unwrap();
    }
    bb.build()
}

/// Three VMs with limits set, defaulted, and preallocated.
fn limited() -> Vec<(VmSpec, VmMemory)> {
    vec![
        (
            spec("limited"),
            VmMemory {
                min: 8 * MIB,
                low: 16 * MIB,
                max: 48 * MIB,
                weight: 250,
                prealloc: false,
            },
        ),
        (spec("defaults"), VmMemory::default()),
        (
            spec("rt"),
            VmMemory {
                min: 4096,
                weight: MAX_WEIGHT,
                prealloc: true,
                ..VmMemory::default()
            },
        ),
    ]
}

const POOL: PoolSpec = PoolSpec {
    min: 16 * MIB,
    low: 48 * MIB,
    high: 80 * MIB,
    wait: true,
};

#[test]
fn round_trip_memory_limits_and_pool() {
    let bytes = build_mem(&limited(), POOL);
    assert_eq!(
        read_u32(&bytes, header::HEADER_SIZE),
        HEADER_SIZE_POOL as u32
    );
    assert_eq!(read_u64(&bytes, header::POOL_LOW), 48 * MIB);
    assert_eq!(read_u32(&bytes, header::POOL_FLAGS), pool_flags::WAIT);
    assert_eq!(read_u64(&bytes, E0 + entry::MEM_MAX), 48 * MIB);
    assert_eq!(read_u32(&bytes, E0 + entry::MEM_WEIGHT), 250);
    let b = parse(&bytes).unwrap();
    assert_eq!(b.header_size(), HEADER_SIZE_POOL);
    assert_eq!(b.pool_watermarks(), Some((16 * MIB, 48 * MIB, 80 * MIB)));
    assert_eq!(b.pool_flags(), pool_flags::WAIT);
    assert!(!b.stop_lowest_when_exhausted());

    let l = b.find("limited").unwrap();
    assert_eq!(
        (l.mem_min(), l.mem_low(), l.mem_max(), l.weight()),
        (8 * MIB, 16 * MIB, 48 * MIB, 250)
    );
    assert!(!l.prealloc());
    assert_eq!(l.mem_flags(), 0);
    assert_eq!(l.guaranteed(), 8 * MIB);

    // All zero: no floor, low = min, max = RAM, weight 100.
    let d = b.find("defaults").unwrap();
    assert_eq!(
        (d.mem_min(), d.mem_low(), d.mem_max(), d.weight()),
        (0, 0, 64 * MIB, DEFAULT_WEIGHT)
    );
    assert!(!d.prealloc());
    assert_eq!(d.guaranteed(), 0);

    // Low defaults to min; prealloc guarantees all of RAM.
    let r = b.find("rt").unwrap();
    assert_eq!(
        (r.mem_min(), r.mem_low(), r.mem_max(), r.weight()),
        (4096, 4096, 64 * MIB, MAX_WEIGHT)
    );
    assert!(r.prealloc());
    assert_eq!(r.mem_flags(), mem_flags::PREALLOC);
    assert_eq!(r.guaranteed(), 64 * MIB);

    // The default pool: the extension is written, all zero.
    let bytes = build_mem(&limited(), PoolSpec::default());
    let b = parse(&bytes).unwrap();
    assert_eq!(b.header_size(), HEADER_SIZE_POOL);
    assert_eq!(b.pool_watermarks(), None);
    assert!(
        b.stop_lowest_when_exhausted(),
        "a wait is bounded by default"
    );
    // Flags without watermarks are fine.
    let wait = PoolSpec {
        wait: true,
        ..PoolSpec::default()
    };
    let b2 = build_mem(&[], wait);
    let b2 = parse(&b2).unwrap();
    assert_eq!(b2.pool_watermarks(), None);
    assert!(!b2.stop_lowest_when_exhausted());
    // The bit older tools wrote for stop-lowest still reads so; WAIT wins.
    for (flags, stop) in [
        (pool_flags::STOP_LOWEST, true),
        (pool_flags::STOP_LOWEST | pool_flags::WAIT, false),
    ] {
        let mut bytes = build_mem(&[], PoolSpec::default());
        put32(&mut bytes, header::POOL_FLAGS, flags);
        fix_crc(&mut bytes);
        assert_eq!(parse(&bytes).unwrap().stop_lowest_when_exhausted(), stop);
    }
    // min = low = high is in order.
    let flat = PoolSpec {
        min: 4096,
        low: 4096,
        high: 4096,
        wait: false,
    };
    let b3 = build_mem(&[], flat);
    assert_eq!(
        parse(&b3).unwrap().pool_watermarks(),
        Some((4096, 4096, 4096))
    );
}

#[test]
fn old_bundles_read_with_memory_defaults() {
    // A bundle written before the memory fields and the pool extension:
    // header_size 64, the entry's bytes 120..192 zero. Bytes 64..96 are then
    // not header (here garbage between header and table, covered by the CRC).
    let mut bytes = build(&[spec("old")]);
    assert!(bytes[E0 + entry::MEM_MIN..E0 + VM_ENTRY_SIZE]
        .iter()
        .all(|&b| b == 0));
    put32(&mut bytes, header::HEADER_SIZE, HEADER_SIZE as u32);
    bytes[HEADER_SIZE..HEADER_SIZE_POOL].fill(0xEE);
    fix_crc(&mut bytes);
    let b = parse(&bytes).unwrap();
    assert_eq!(b.header_size(), HEADER_SIZE);
    assert_eq!(b.pool_watermarks(), None);
    assert_eq!(b.pool_flags(), 0);
    assert!(b.stop_lowest_when_exhausted());
    let vm = b.vm(0).unwrap();
    assert_eq!(vm.mem_min(), 0);
    assert_eq!(vm.mem_low(), 0);
    assert_eq!(vm.mem_max(), vm.ram_size());
    assert_eq!(vm.weight(), DEFAULT_WEIGHT);
    assert!(!vm.prealloc());
    assert_eq!(vm.guaranteed(), 0);
    // Between 64 and 96 the extension is absent too.
    put32(&mut bytes, header::HEADER_SIZE, 88);
    fix_crc(&mut bytes);
    assert_eq!(parse(&bytes).unwrap().pool_watermarks(), None);
}

#[test]
fn memory_corruptions() {
    use MemField as F;
    use VmError as V;
    let ram = 64 * MIB;
    let mem = |f: &dyn Fn(&mut Vec<u8>)| vm_err(0, true, f);
    assert!(matches!(
        mem(&|b| put32(b, E0 + entry::MEM_FLAGS, 2)),
        V::UnknownMemFlags { flags: 2 }
    ));
    assert!(matches!(
        mem(&|b| put32(b, E0 + entry::MEM_FLAGS, 1 << 31)),
        V::UnknownMemFlags { .. }
    ));
    assert!(matches!(
        mem(&|b| put32(b, E0 + entry::MEM_WEIGHT, MAX_WEIGHT + 1)),
        V::MemWeightOutOfRange { weight: 10_001 }
    ));
    assert!(matches!(
        mem(&|b| put64(b, E0 + entry::MEM_MIN, 4097)),
        V::MemNotAligned {
            field: F::Min,
            value: 4097
        }
    ));
    assert!(matches!(
        mem(&|b| put64(b, E0 + entry::MEM_LOW, 100)),
        V::MemNotAligned {
            field: F::Low,
            value: 100
        }
    ));
    assert!(matches!(
        mem(&|b| put64(b, E0 + entry::MEM_MAX, 1)),
        V::MemNotAligned {
            field: F::Max,
            value: 1
        }
    ));
    assert!(matches!(
        mem(&|b| put64(b, E0 + entry::MEM_MAX, ram + 4096)),
        V::MemMaxAboveRam { max, ram_size } if max == ram + 4096 && ram_size == ram
    ));
    assert!(matches!(
        mem(&|b| {
            put64(b, E0 + entry::MEM_MIN, 8192);
            put64(b, E0 + entry::MEM_LOW, 4096);
        }),
        V::MemMinAboveLow {
            min: 8192,
            low: 4096
        }
    ));
    // Min above the RAM size (max 0 means the RAM size).
    assert!(matches!(
        mem(&|b| put64(b, E0 + entry::MEM_MIN, ram + 4096)),
        V::MemAboveMax { field: F::Min, max, .. } if max == ram
    ));
    assert!(matches!(
        mem(&|b| {
            put64(b, E0 + entry::MEM_MIN, 8192);
            put64(b, E0 + entry::MEM_MAX, 4096);
        }),
        V::MemAboveMax {
            field: F::Min,
            value: 8192,
            max: 4096
        }
    ));
    assert!(matches!(
        mem(&|b| {
            put64(b, E0 + entry::MEM_LOW, 8 * MIB);
            put64(b, E0 + entry::MEM_MAX, 4 * MIB);
        }),
        V::MemAboveMax {
            field: F::Low,
            value: 0x80_0000,
            max: 0x40_0000
        }
    ));
    // The reserved tail now starts at 184, after the snapshot name.
    assert!(matches!(
        mem(&|b| b[E0 + entry::RESERVED] = 1),
        V::ReservedNonZero { offset: 184 }
    ));
    // The snapshot name: printable, NUL-padded.
    assert!(matches!(
        mem(&|b| b[E0 + entry::RESTORE] = b' '),
        V::BadRestore
    ));
    assert!(matches!(
        mem(&|b| b[E0 + entry::RESTORE + 1] = b'a'),
        V::BadRestore
    ));
    // Edge values that are valid: weight 10000, max = RAM, min = low = max.
    let ok = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = build(&three());
        f(&mut b);
        fix_crc(&mut b);
        parse(&b).map(|b| {
            let v = b.vm(0).unwrap();
            (v.mem_min(), v.mem_low(), v.mem_max(), v.weight())
        })
    };
    assert_eq!(
        ok(&|b| put32(b, E0 + entry::MEM_WEIGHT, MAX_WEIGHT)),
        Ok((0, 0, ram, MAX_WEIGHT))
    );
    assert_eq!(
        ok(&|b| {
            put64(b, E0 + entry::MEM_MIN, ram);
            put64(b, E0 + entry::MEM_LOW, ram);
            put64(b, E0 + entry::MEM_MAX, ram);
            put32(b, E0 + entry::MEM_WEIGHT, 1);
        }),
        Ok((ram, ram, ram, 1))
    );
}

#[test]
fn pool_corruptions() {
    use BundleError as E;
    use PoolField as F;
    // The header is not covered by the CRC: no re-sealing needed.
    let pool = |f: &dyn Fn(&mut Vec<u8>)| corrupt(false, f);
    assert!(matches!(
        pool(&|b| put32(b, header::POOL_FLAGS, 6)),
        E::UnknownPoolFlags { flags: 6 }
    ));
    assert!(matches!(
        pool(&|b| b[header::POOL_RESERVED + 1] = 1),
        E::HeaderReservedNonZero { offset: 93 }
    ));
    assert!(matches!(
        pool(&|b| put64(b, header::POOL_HIGH, 4095)),
        E::PoolNotAligned {
            field: F::High,
            value: 4095
        }
    ));
    assert!(matches!(
        pool(&|b| put64(b, header::POOL_MIN, 4096)),
        E::PoolPartlyZero {
            min: 4096,
            low: 0,
            high: 0
        }
    ));
    assert!(matches!(
        pool(&|b| {
            put64(b, header::POOL_MIN, 8192);
            put64(b, header::POOL_HIGH, 8192);
        }),
        E::PoolPartlyZero { .. }
    ));
    assert!(matches!(
        pool(&|b| {
            put64(b, header::POOL_MIN, 3 * 4096);
            put64(b, header::POOL_LOW, 2 * 4096);
            put64(b, header::POOL_HIGH, 4 * 4096);
        }),
        E::PoolOutOfOrder { .. }
    ));
    assert!(matches!(
        pool(&|b| {
            put64(b, header::POOL_MIN, 4096);
            put64(b, header::POOL_LOW, 3 * 4096);
            put64(b, header::POOL_HIGH, 2 * 4096);
        }),
        E::PoolOutOfOrder {
            min: 4096,
            low: 0x3000,
            high: 0x2000
        }
    ));
    // With header_size 64 the same bytes are not read.
    let mut b = build(&three());
    put32(&mut b, header::POOL_FLAGS, 6);
    put32(&mut b, header::HEADER_SIZE, HEADER_SIZE as u32);
    fix_crc(&mut b);
    assert!(parse(&b).is_ok());
}

#[test]
fn memory_and_pool_error_messages() {
    let m = corrupt(true, |b| {
        put64(b, E1 + entry::MEM_MIN, 0x2000);
        put64(b, E1 + entry::MEM_MAX, 0x1000);
    })
    .to_string();
    assert_eq!(
        m,
        "VM 1 (\"bare-metal_1\"): memory min 0x2000 is more than memory max 0x1000"
    );
    let m = corrupt(true, |b| put64(b, E1 + entry::MEM_MAX, 0x4000)).to_string();
    assert_eq!(
        m,
        "VM 1 (\"bare-metal_1\"): memory max 0x4000 is more than the RAM size (0x3000 bytes)"
    );
    let m = corrupt(true, |b| put64(b, E0 + entry::MEM_LOW, 0x1001)).to_string();
    assert_eq!(
        m,
        "VM 0 (\"first\"): memory low 0x1001 is not a multiple of 0x1000 bytes"
    );
    let m = corrupt(true, |b| put32(b, E0 + entry::MEM_WEIGHT, 20_000)).to_string();
    assert_eq!(
        m,
        "VM 0 (\"first\"): memory weight 20000 is out of range (1 to 10000, or 0 for the \
         default 100)"
    );
    let m = corrupt(true, |b| put32(b, E0 + entry::MEM_FLAGS, 3)).to_string();
    assert_eq!(
        m,
        "VM 0 (\"first\"): memory flags 0x3 include unknown bits 0x2 (written by a newer tool?)"
    );
    let m = corrupt(true, |b| {
        put64(b, E0 + entry::MEM_MIN, 0x2000);
        put64(b, E0 + entry::MEM_LOW, 0x1000);
    })
    .to_string();
    assert_eq!(
        m,
        "VM 0 (\"first\"): memory min 0x2000 is more than memory low 0x1000"
    );
    let m = corrupt(false, |b| {
        put64(b, header::POOL_MIN, 0x3000);
        put64(b, header::POOL_LOW, 0x2000);
        put64(b, header::POOL_HIGH, 0x4000);
    })
    .to_string();
    assert_eq!(
        m,
        "pool watermarks min 0x3000, low 0x2000, high 0x4000 are not in order (min <= low <= high)"
    );
    let m = corrupt(false, |b| put64(b, header::POOL_LOW, 0x2000)).to_string();
    assert_eq!(
        m,
        "pool watermarks min 0x0, low 0x2000, high 0x0: either all are 0 (the default) or none"
    );
    let m = corrupt(false, |b| put64(b, header::POOL_MIN, 0x10)).to_string();
    assert_eq!(m, "pool min 0x10 is not a multiple of 0x1000 bytes");
    let m = corrupt(false, |b| put32(b, header::POOL_FLAGS, 5)).to_string();
    assert_eq!(
        m,
        "pool flags 0x5 include unknown bits 0x4 (written by a newer tool?)"
    );
}

#[test]
fn writer_rejects_bad_memory_limits_and_pools() {
    let ram = 64 * MIB;
    let add = |m: VmMemory| {
        BundleBuilder::new()
            .add_vm_with_memory(spec("vm"), m)
            .map(|_| ())
    };
    let d = VmMemory::default();
    assert!(add(d).is_ok());
    for (bad, want) in [
        (
            VmMemory { min: 100, ..d },
            "memory min 0x64 is not a multiple of 0x1000 bytes",
        ),
        (
            VmMemory { max: ram * 2, ..d },
            "memory max 0x8000000 is more than the RAM size (0x4000000 bytes)",
        ),
        (
            VmMemory {
                min: 2 * MIB,
                low: MIB,
                ..d
            },
            "memory min 0x200000 is more than memory low 0x100000",
        ),
        (
            VmMemory {
                min: 2 * MIB,
                max: MIB,
                ..d
            },
            "memory min 0x200000 is more than memory max 0x100000",
        ),
        (
            VmMemory {
                low: 2 * MIB,
                max: MIB,
                ..d
            },
            "memory low 0x200000 is more than memory max 0x100000",
        ),
        (
            VmMemory {
                weight: 10_001,
                ..d
            },
            "memory weight 10001 is out of range",
        ),
    ] {
        let e = add(bad).unwrap_err();
        assert!(e.starts_with("VM 0 (\"vm\"): ") && e.contains(want), "{e}");
    }
    let mut bb = BundleBuilder::new();
    for (bad, want) in [
        (
            PoolSpec {
                min: 4096,
                ..PoolSpec::default()
            },
            "either all are 0",
        ),
        (
            PoolSpec {
                min: 2 * MIB,
                low: MIB,
                high: 3 * MIB,
                wait: false,
            },
            "are not in order",
        ),
        (
            PoolSpec {
                min: MIB,
                low: 2 * MIB,
                high: 3 * MIB + 1,
                wait: false,
            },
            "pool high 0x300001 is not a multiple of 0x1000 bytes",
        ),
    ] {
        let e = bb.pool(bad).map(|_| ()).unwrap_err();
        assert!(e.contains(want), "{e}");
    }
    // A refused pool leaves the builder as it was.
    assert_eq!(parse(&bb.build()).unwrap().pool_watermarks(), None);
}

#[test]
fn memory_bundles_survive_truncation_and_flips() {
    let base = build_mem(&limited(), POOL);
    for len in (0..base.len()).step_by(97) {
        assert!(parse(&base[..len]).is_err());
    }
    let mut rng = XorShift(0xDEAD_BEEF_1234_5678);
    let mut vm_errors = 0;
    for _ in 0..3000 {
        let mut b = base.clone();
        for _ in 0..1 + rng.below(3) {
            // The pool extension and the memory fields of the entries.
            let at = if rng.below(3) == 0 {
                HEADER_SIZE + rng.below(HEADER_SIZE_POOL - HEADER_SIZE)
            } else {
                E0 + rng.below(3) * VM_ENTRY_SIZE + entry::MEM_MIN + rng.below(32)
            };
            b[at] = match rng.below(3) {
                0 => b[at] ^ (1 << rng.below(8)),
                1 => rng.next() as u8,
                _ => [0, 0xFF, 0x10, 0x01][rng.below(4)],
            };
        }
        fix_crc(&mut b);
        if let Err(BundleError::Vm { .. }) = parse(&b) {
            vm_errors += 1;
        }
        exercise(&b);
    }
    assert!(vm_errors > 500, "{vm_errors}");
}

// ---------------------------------------------------------------------------
// One corruption per field.

/// Applies `f` to a fresh 3-VM bundle, optionally re-seals the CRC, parses.
fn corrupt(fix: bool, f: impl FnOnce(&mut Vec<u8>)) -> BundleError {
    let mut b = build(&three());
    f(&mut b);
    if fix {
        fix_crc(&mut b);
    }
    match parse(&b) {
        Ok(_) => panic!("corrupted bundle parsed"),
        Err(e) => {
            // Every error renders without panicking.
            let _ = e.to_string();
            e
        }
    }
}

/// Where the writer puts the VM table: right after the 96-byte header.
const E0: usize = HEADER_SIZE_POOL;
const E1: usize = E0 + VM_ENTRY_SIZE;

fn vm_err(index: usize, fix: bool, f: impl FnOnce(&mut Vec<u8>)) -> VmError {
    match corrupt(fix, f) {
        BundleError::Vm {
            index: i, error, ..
        } => {
            assert_eq!(i, index);
            error
        }
        other => panic!("expected a VM error, got {other:?}"),
    }
}

fn entry_u64(b: &[u8], e: usize, field: usize) -> u64 {
    read_u64(b, e + field)
}

#[test]
fn header_corruptions() {
    use BundleError as E;
    assert!(matches!(
        corrupt(false, |b| b.truncate(10)),
        E::TooShort { len: 10 }
    ));
    assert!(matches!(
        corrupt(false, |b| b[0] = b'X'),
        E::BadMagic { .. }
    ));
    assert!(matches!(
        corrupt(false, |b| put32(b, header::VERSION, 2)),
        E::UnsupportedVersion {
            found: 2,
            supported: 1
        }
    ));
    assert!(matches!(
        corrupt(false, |b| put32(b, header::VERSION, 0)),
        E::UnsupportedVersion { found: 0, .. }
    ));
    assert!(matches!(
        corrupt(false, |b| put32(b, header::HEADER_SIZE, 32)),
        E::BadHeaderSize { header_size: 32 }
    ));
    assert!(matches!(
        corrupt(false, |b| put32(b, header::HEADER_SIZE, 68)),
        E::BadHeaderSize { .. }
    ));
    assert!(matches!(
        corrupt(false, |b| put32(b, header::HEADER_SIZE, u32::MAX - 7)),
        E::TotalSizeTooSmall { .. }
    ));
    assert!(matches!(
        corrupt(false, |b| put32(b, header::FLAGS, 4)),
        E::UnknownFlags { flags: 4 }
    ));
    assert!(matches!(
        corrupt(false, |b| b[header::RESERVED + 3] = 1),
        E::HeaderReservedNonZero { offset: 59 }
    ));
    assert!(matches!(
        corrupt(false, |b| put64(b, header::TOTAL_SIZE, 8)),
        E::TotalSizeTooSmall { .. }
    ));
    assert!(matches!(
        corrupt(false, |b| put64(b, header::TOTAL_SIZE, u64::MAX)),
        E::Truncated { .. }
    ));
    assert!(matches!(
        corrupt(false, |b| b.truncate(b.len() - 1)),
        E::Truncated { .. }
    ));
    assert!(matches!(
        corrupt(false, |b| put32(b, header::VM_ENTRY_SIZE, 100)),
        E::BadEntrySize { entry_size: 100 }
    ));
    assert!(matches!(
        corrupt(false, |b| put32(b, header::VM_ENTRY_SIZE, 193)),
        E::BadEntrySize { .. }
    ));
    assert!(matches!(
        corrupt(false, |b| put32(b, header::VM_COUNT, 1000)),
        E::TooManyVms { count: 1000 }
    ));
    assert!(matches!(
        corrupt(false, |b| put32(b, header::VM_COUNT, 2)),
        E::VmTableSizeMismatch { .. }
    ));
    assert!(matches!(
        corrupt(false, |b| put64(b, header::VM_TABLE_SIZE, 0)),
        E::VmTableSizeMismatch { .. }
    ));
    assert!(matches!(
        corrupt(false, |b| put64(b, header::VM_TABLE_OFFSET, 65)),
        E::VmTableMisaligned { offset: 65 }
    ));
    assert!(matches!(
        corrupt(false, |b| put64(b, header::VM_TABLE_OFFSET, 8)),
        E::VmTableOverlapsHeader { .. }
    ));
    assert!(matches!(
        corrupt(false, |b| put64(b, header::VM_TABLE_OFFSET, u64::MAX - 7)),
        E::VmTableOutOfBounds { .. }
    ));
    assert!(matches!(
        corrupt(false, |b| {
            let t = b.len() as u64 - 8;
            put64(b, header::VM_TABLE_OFFSET, t)
        }),
        E::VmTableOutOfBounds { .. }
    ));
    assert!(matches!(
        corrupt(false, |b| put32(b, header::CRC32, 1)),
        E::CrcMismatch { .. }
    ));
    // Any change after the header without re-sealing is a CRC mismatch.
    assert!(matches!(
        corrupt(false, |b| b[E1 + 2] ^= 1),
        E::CrcMismatch { .. }
    ));
    let last = build(&three()).len() - 1;
    assert!(matches!(
        corrupt(false, |b| b[last] ^= 0x80),
        E::CrcMismatch { .. }
    ));
}

#[test]
fn entry_corruptions() {
    use VmError as V;
    // Name.
    assert!(matches!(
        vm_err(0, true, |b| b[E0] = 0),
        V::BadName {
            problem: NameProblem::Empty,
            ..
        }
    ));
    assert!(matches!(
        vm_err(0, true, |b| b[E0 + 1] = b'A'),
        V::BadName {
            problem: NameProblem::BadChar(1),
            ..
        }
    ));
    assert!(matches!(
        vm_err(1, true, |b| b[E1 + 31] = b'x'),
        V::BadName {
            problem: NameProblem::GarbageAfterNul(31),
            ..
        }
    ));
    assert!(matches!(
        vm_err(1, true, |b| {
            b[E1..E1 + NAME_LEN].fill(0);
            b[E1..E1 + 5].copy_from_slice(b"first");
        }),
        V::DuplicateName { first: 0 }
    ));
    // An on_bad_access code from a newer tool; the two known ones pass.
    assert!(matches!(
        vm_err(1, true, |b| b[E1 + entry::ON_BAD_ACCESS] = 2),
        V::UnknownBadAccessPolicy { code: 2 }
    ));
    // Reserved.
    assert!(matches!(
        vm_err(1, true, |b| b[E1 + VM_ENTRY_SIZE - 1] = 1),
        V::ReservedNonZero { offset: 191 }
    ));
    // Scalars.
    assert!(matches!(
        vm_err(0, true, |b| put64(b, E0 + entry::RAM_SIZE, 0)),
        V::ZeroRam
    ));
    assert!(matches!(
        vm_err(0, true, |b| put64(
            b,
            E0 + entry::RAM_SIZE,
            (64 << 20) + 512
        )),
        V::RamNotAligned { .. }
    ));
    assert!(matches!(
        vm_err(0, true, |b| put64(b, E0 + entry::RAM_SIZE, 4096)),
        V::BlobsExceedRam { .. }
    ));
    assert!(matches!(
        vm_err(0, true, |b| put32(b, E0 + entry::VCPUS, 0)),
        V::ZeroVcpus
    ));
    assert!(matches!(
        vm_err(0, true, |b| put64(b, E0 + entry::CPU_AFFINITY, 0)),
        V::ZeroAffinity
    ));
    assert!(matches!(
        vm_err(0, true, |b| put64(b, E0 + entry::DEVICES, 5)),
        V::UnknownDevices { bits: 5 }
    ));
    assert!(matches!(
        vm_err(0, true, |b| put64(b, E0 + entry::DEVICES, 0)),
        V::BalloonFeaturesWithoutBalloon { features: 0b110 }
    ));
    // Blobs.
    assert!(matches!(
        vm_err(1, true, |b| put64(b, E1 + entry::KERNEL_SIZE, 0)),
        V::EmptyKernel
    ));
    assert!(matches!(
        vm_err(1, true, |b| put64(b, E1 + entry::INITRD_OFFSET, 4096)),
        V::OffsetWithoutBlob {
            blob: Blob::Initrd,
            offset: 4096
        }
    ));
    assert!(matches!(
        vm_err(1, true, |b| put64(b, E1 + entry::CMDLINE_OFFSET, 4096)),
        V::OffsetWithoutBlob {
            blob: Blob::Cmdline,
            ..
        }
    ));
    assert!(matches!(
        vm_err(0, true, |b| {
            let o = entry_u64(b, E0, entry::KERNEL_OFFSET);
            put64(b, E0 + entry::KERNEL_OFFSET, o + 8)
        }),
        V::BlobMisaligned {
            blob: Blob::Kernel,
            ..
        }
    ));
    assert!(matches!(
        vm_err(0, true, |b| put64(b, E0 + entry::INITRD_OFFSET, 0)),
        V::BlobOverlapsTable {
            blob: Blob::Initrd,
            offset: 0,
            ..
        }
    ));
    assert!(matches!(
        vm_err(0, true, |b| put64(b, E0 + entry::CMDLINE_SIZE, 1 << 40)),
        V::BlobOutOfBounds {
            blob: Blob::Cmdline,
            ..
        }
    ));
    assert!(matches!(
        vm_err(0, true, |b| put64(b, E0 + entry::KERNEL_SIZE, u64::MAX)),
        V::BlobOutOfBounds {
            blob: Blob::Kernel,
            ..
        }
    ));
    assert!(matches!(
        vm_err(0, true, |b| put64(b, E0 + entry::KERNEL_OFFSET, !4095)),
        V::BlobOutOfBounds {
            blob: Blob::Kernel,
            ..
        }
    ));
    // Command line contents.
    let cmd = |b: &Vec<u8>| entry_u64(b, E0, entry::CMDLINE_OFFSET) as usize;
    assert!(matches!(
        vm_err(0, true, |b| {
            let c = cmd(b);
            b[c + 3] = 0xFF
        }),
        V::CmdlineNotUtf8 { valid_up_to: 3 }
    ));
    assert!(matches!(
        vm_err(0, true, |b| {
            let c = cmd(b);
            b[c + 5] = 0
        }),
        V::CmdlineHasNul { at: 5 }
    ));
    // Without re-sealing, every entry change is caught by the CRC first.
    assert!(matches!(
        corrupt(false, |b| put32(b, E0 + entry::VCPUS, 0)),
        BundleError::CrcMismatch { .. }
    ));
}

#[test]
fn error_messages() {
    let mut b = build(&three());
    put64(&mut b, E1 + entry::KERNEL_OFFSET, 0x3000);
    put64(&mut b, E1 + entry::KERNEL_SIZE, 0x100000);
    put64(&mut b, E1 + entry::RAM_SIZE, 0x200000);
    fix_crc(&mut b);
    let len = b.len();
    assert_eq!(
        parse(&b).unwrap_err().to_string(),
        format!(
            "VM 1 (\"bare-metal_1\"): kernel blob at offset 0x3000 size 0x100000 runs past the \
             end of the bundle ({len:#x} bytes)"
        )
    );

    let mut b = build(&[]);
    b[..8].copy_from_slice(&[0x5a; 8]);
    assert_eq!(
        parse(&b).unwrap_err().to_string(),
        "bad magic: expected \"TIDALBND\", found 5a 5a 5a 5a 5a 5a 5a 5a (\"ZZZZZZZZ\")"
    );

    let mut b = build(&[]);
    put32(&mut b, header::VERSION, 7);
    let m = parse(&b).unwrap_err().to_string();
    assert!(m.contains("version 7") && m.contains("version 1"), "{m}");

    let e = vm_err(0, true, |b| b[E0 + 2] = b'!');
    let m = BundleError::Vm {
        index: 0,
        name: None,
        error: e,
    }
    .to_string();
    assert_eq!(
        m,
        "VM 0: name \"fi!st\" is invalid: byte 2 (0x21) is not one of [a-z0-9_-]"
    );

    let m = corrupt(true, |b| put32(b, E1 + entry::VCPUS, 0)).to_string();
    assert_eq!(m, "VM 1 (\"bare-metal_1\"): vCPU count is zero");
}

#[test]
fn writer_rejects_what_the_reader_rejects() {
    let try_add = |f: &dyn Fn(&mut VmSpec)| {
        let mut s = spec("ok");
        f(&mut s);
        BundleBuilder::new().add_vm(s).map(|_| ())
    };
    assert!(try_add(&|_| {}).is_ok());
    for bad in [
        &|s: &mut VmSpec| s.name = String::new(),
        &|s: &mut VmSpec| s.name = "Upper".into(),
        &|s: &mut VmSpec| s.name = "a".repeat(33),
        &|s: &mut VmSpec| s.name = "nul\0".into(),
        &|s: &mut VmSpec| s.ram_size = 0,
        &|s: &mut VmSpec| s.ram_size = 4095,
        &|s: &mut VmSpec| s.ram_size = 4096,
        &|s: &mut VmSpec| s.vcpus = 0,
        &|s: &mut VmSpec| s.cpu_affinity = 0,
        &|s: &mut VmSpec| s.devices = 4,
        &|s: &mut VmSpec| s.devices = 0,
        &|s: &mut VmSpec| s.kernel.clear(),
        &|s: &mut VmSpec| s.initrd = Some(vec![]),
        &|s: &mut VmSpec| s.cmdline = Some("a\0b".into()),
    ] as [&dyn Fn(&mut VmSpec); 14]
    {
        let e = try_add(bad).unwrap_err();
        assert!(e.starts_with("VM 0"), "{e}");
    }
    let mut bb = BundleBuilder::new();
    bb.add_vm(spec("x")).unwrap();
    let e = bb.add_vm(spec("x")).unwrap_err();
    assert_eq!(e, "VM 1 (\"x\"): name is already used by VM 0");
    assert_eq!(bb.len(), 1);
    let e = BundleBuilder::new()
        .add_vm(VmSpec {
            name: "Bad".into(),
            ..spec("x")
        })
        .unwrap_err();
    assert_eq!(
        e,
        "VM 0: name \"Bad\" is invalid: byte 0 (0x42) is not one of [a-z0-9_-]"
    );
}

// ---------------------------------------------------------------------------
// Never panics.

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Parses and, on success, touches every accessor.
fn exercise(bytes: &[u8]) {
    match parse(bytes) {
        Ok(b) => {
            let _ = (b.version(), b.total_size(), b.crc32());
            for vm in b.vms() {
                let _ = (vm.name(), vm.ram_size(), vm.vcpus(), vm.cpu_affinity());
                let _ = (vm.kernel().len(), vm.initrd(), vm.cmdline(), vm.devices());
                assert!(!vm.kernel().is_empty() && vm.vcpus() >= 1);
                assert!(vm.mem_min() <= vm.mem_low());
                assert!(vm.mem_low() <= vm.mem_max() && vm.mem_max() <= vm.ram_size());
                assert!((1..=MAX_WEIGHT).contains(&vm.weight()));
                assert!(vm.guaranteed() <= vm.ram_size());
                let _ = vm.prealloc();
            }
            if let Some((min, low, high)) = b.pool_watermarks() {
                assert!(min != 0 && min <= low && low <= high);
            }
            let _ = b.stop_lowest_when_exhausted();
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
}

#[test]
fn every_truncation_is_rejected() {
    for specs in [vec![], vec![spec("one")], three()] {
        let b = build(&specs);
        for len in 0..b.len() {
            let e = parse(&b[..len]).unwrap_err();
            assert!(
                matches!(
                    e,
                    BundleError::TooShort { .. } | BundleError::Truncated { .. }
                ),
                "len {len}: {e:?}"
            );
        }
        // Truncated and with total_size rewritten to match: never panics.
        for len in (HEADER_SIZE..b.len()).step_by(61) {
            let mut t = b[..len].to_vec();
            put64(&mut t, header::TOTAL_SIZE, len as u64);
            exercise(&t);
            fix_crc(&mut t);
            exercise(&t);
        }
    }
}

#[test]
fn random_byte_flips_never_panic() {
    let base = build(&three());
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let mut accepted = 0;
    let mut vm_errors = 0;
    for case in 0..6000 {
        let mut b = base.clone();
        let flips = 1 + rng.below(4);
        for _ in 0..flips {
            // Mostly the header and table, where the structure is.
            let at = if rng.below(4) == 0 {
                rng.below(b.len())
            } else {
                rng.below(E1 + VM_ENTRY_SIZE * 2)
            };
            match rng.below(3) {
                0 => b[at] ^= 1 << rng.below(8),
                1 => b[at] = rng.next() as u8,
                _ => b[at] = [0, 0xFF, 0x10, 0x01][rng.below(4)],
            }
        }
        if case % 2 == 0 {
            fix_crc(&mut b);
        }
        match parse(&b) {
            Ok(_) => accepted += 1,
            Err(BundleError::Vm { .. }) => vm_errors += 1,
            Err(_) => {}
        }
        exercise(&b);
    }
    // Some flips (in padding or to equivalent values) are harmless.
    assert!(accepted < 6000);
    // The re-sealed half reaches the per-VM checks.
    assert!(vm_errors > 1000, "{vm_errors}");
}

#[test]
fn random_garbage_never_panics() {
    let mut rng = XorShift(12345);
    for _ in 0..3000 {
        let len = rng.below(600);
        let mut b: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        if len >= HEADER_SIZE {
            b[..8].copy_from_slice(&MAGIC);
            put32(&mut b, header::VERSION, 1);
            b[header::RESERVED..HEADER_SIZE].fill(0);
            if rng.below(2) == 0 {
                put32(&mut b, header::FLAGS, 0);
                put32(&mut b, header::HEADER_SIZE, 64);
                put64(&mut b, header::TOTAL_SIZE, len as u64);
                put32(&mut b, header::VM_ENTRY_SIZE, VM_ENTRY_SIZE as u32);
                let n = rng.below(3) as u32;
                put32(&mut b, header::VM_COUNT, n);
                put64(&mut b, header::VM_TABLE_OFFSET, 64);
                put64(
                    &mut b,
                    header::VM_TABLE_SIZE,
                    n as u64 * VM_ENTRY_SIZE as u64,
                );
                fix_crc(&mut b);
            }
        }
        exercise(&b);
    }
}

#[test]
fn on_target_tests_flag_round_trips_and_defaults_off() {
    // Without the flag (every bundle written before it): off.
    let plain = build(&[spec("alpha")]);
    assert_eq!(read_u32(&plain, header::FLAGS), 0);
    let b = parse(&plain).unwrap();
    assert!(!b.on_target_tests());
    assert_eq!(b.flags(), 0);

    let mut builder = BundleBuilder::new();
    builder.add_vm(spec("alpha")).unwrap();
    builder.on_target_tests(true);
    let bytes = builder.build();
    assert_eq!(read_u32(&bytes, header::FLAGS), flags::ON_TARGET_TESTS);
    let b = parse(&bytes).unwrap();
    assert!(b.on_target_tests());
    assert_eq!(b.flags(), flags::ON_TARGET_TESTS);
    assert_eq!(b.vm_count(), 1);

    // A 64-byte header (no pool extension) may carry it too.
    let mut old = plain.clone();
    put32(&mut old, header::FLAGS, flags::ON_TARGET_TESTS);
    assert!(parse(&old).unwrap().on_target_tests());

    // Bits not defined yet are still refused.
    let mut bad = bytes.clone();
    put32(&mut bad, header::FLAGS, flags::ON_TARGET_TESTS | 2);
    assert!(matches!(
        parse(&bad),
        Err(BundleError::UnknownFlags { flags: 3 })
    ));
}

#[test]
fn a_snapshot_to_restore_from_round_trips_and_bad_names_are_refused() {
    let with = |r: &str| VmSpec {
        restore: Some(r.into()),
        ..spec("snap")
    };
    let bytes = BundleBuilder::new()
        .add_vm(with("before-upgrade"))
        .unwrap()
        .build();
    let b = parse(&bytes).unwrap();
    assert_eq!(b.vm(0).unwrap().restore(), Some("before-upgrade"));
    let plain = BundleBuilder::new().add_vm(spec("boots")).unwrap().build();
    assert_eq!(parse(&plain).unwrap().vm(0).unwrap().restore(), None);
    for bad in ["", "two words", &"x".repeat(33), "tab\t"] {
        assert!(BundleBuilder::new().add_vm(with(bad)).is_err(), "{bad:?}");
    }
    assert!(BundleBuilder::new().add_vm(with(&"x".repeat(32))).is_ok());
}

#[test]
fn board_address_round_trips_and_older_bundles_have_none() {
    let plain = BundleBuilder::new().add_vm(spec("a")).unwrap().build();
    assert_eq!(parse(&plain).unwrap().board_address(), None);
    assert!(plain[header::RESERVED..HEADER_SIZE].iter().all(|&b| b == 0));
    let address = BoardAddress::parse("10.0.0.2/24").unwrap();
    let mut b = BundleBuilder::new();
    b.add_vm(spec("a")).unwrap().board_address(Some(address));
    let bytes = b.build();
    assert_eq!(parse(&bytes).unwrap().board_address(), Some(address));
    assert_eq!(&bytes[56..64], &[2, 0, 0, 10, 24, 1, 0, 0]);
    // Another address in place: the CRC still holds.
    let mut other = bytes.clone();
    let b_addr = BoardAddress::parse("10.0.0.3/24").unwrap();
    set_board_address(&mut other, Some(b_addr)).unwrap();
    assert_eq!(parse(&other).unwrap().board_address(), Some(b_addr));
    assert_eq!(other[64..], bytes[64..]);
    set_board_address(&mut other, None).unwrap();
    assert_eq!(other, plain_with(&bytes));
    assert_eq!(address.to_string(), "10.0.0.2/24");
}

/// `bytes` with header bytes 56 to 64 zeroed.
fn plain_with(bytes: &[u8]) -> Vec<u8> {
    let mut b = bytes.to_vec();
    b[56..64].fill(0);
    b
}

#[test]
fn board_address_header_errors() {
    let mut b = BundleBuilder::new();
    b.add_vm(spec("a"))
        .unwrap()
        .board_address(Some(BoardAddress::parse("10.0.0.2/24").unwrap()));
    let good = b.build();
    let with = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut bytes = good.clone();
        f(&mut bytes);
        parse(&bytes).unwrap_err()
    };
    assert_eq!(
        with(&|b| b[header::BOARD_FLAGS] = 3),
        BundleError::UnknownBoardFlags { flags: 3 }
    );
    assert_eq!(
        with(&|b| b[header::BOARD_RESERVED + 1] = 1),
        BundleError::HeaderReservedNonZero { offset: 63 }
    );
    let e = with(&|b| b[header::BOARD_PREFIX] = 33);
    assert!(matches!(e, BundleError::BadBoardAddress { prefix: 33, .. }));
    assert_eq!(
        e.to_string(),
        "board address 10.0.0.2/33: the prefix length is 1 to 32"
    );
    // The network's own address.
    let e = with(&|b| b[header::BOARD_ADDRESS] = 0);
    assert!(matches!(e, BundleError::BadBoardAddress { .. }), "{e}");
    // Flag clear: the address bytes must be zero (an older reader's rule).
    assert_eq!(
        with(&|b| b[header::BOARD_FLAGS] = 0),
        BundleError::HeaderReservedNonZero { offset: 56 }
    );
}

#[test]
fn board_addresses_parse_and_are_checked() {
    for good in [
        "10.0.0.2/24",
        "192.168.1.254/24",
        "10.0.0.0/31",
        "10.1.2.3/32",
        "1.0.0.1/1",
    ] {
        let a = BoardAddress::parse(good).unwrap_or_else(|e| panic!("{good}: {e}"));
        assert_eq!(a.to_string(), good);
    }
    for (bad, why) in [
        ("10.0.0.2", "dotted quad"),
        ("10.0.0/24", "dotted quad"),
        ("10.0.0.2.1/24", "dotted quad"),
        ("10.0.0.256/24", "dotted quad"),
        ("10.0.0.02/24", "dotted quad"),
        ("10.0.0.2/", "dotted quad"),
        ("10.0.0.2/-1", "dotted quad"),
        (" 10.0.0.2/24", "dotted quad"),
        ("10.0.0.2/0", "1 to 32"),
        ("10.0.0.2/33", "1 to 32"),
        ("10.0.0.0/24", "network's own address"),
        ("10.0.0.255/24", "broadcast"),
        ("127.0.0.1/8", "loopback"),
        ("0.1.2.3/8", "0.0.0.0/8"),
        ("239.0.0.1/8", "multicast"),
    ] {
        let e = BoardAddress::parse(bad).unwrap_err();
        assert!(e.contains(why), "{bad}: {e}");
    }
}
