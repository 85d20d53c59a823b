//! The snapshot store over a disk of any bytes (a disk can be swapped or
//! damaged). The disk is formatted by the store or holds fuzzed bytes in
//! its superblock; its directory sectors hold fuzzed bytes, with a valid
//! sector checksum when the input asks (so that the fuzzer reaches the
//! checks behind it); then snapshots are written, read and deleted.
//! Invariants: nothing panics; every listed snapshot has a valid, unique
//! name and an extent inside the data area that overlaps no other; a
//! snapshot written reads back byte for byte and verifies; what is listed
//! is what a fresh open of the same disk lists.
#![no_main]

use arbitrary::Arbitrary;
use hypervisor::snapshot::store::{valid_name, Store, StoreError, DATA_START, ENTRIES, SECTOR};
use hypervisor::snapshot::testing::RamDisk;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Sector {
    /// A directory slot (or, for the superblock, ignored).
    slot: u8,
    bytes: Vec<u8>,
    /// Put a valid CRC-32 of the first 508 bytes in the last four.
    fix_crc: bool,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Write {
        name: String,
        vm: String,
        len: u16,
        fill: u8,
    },
    Delete {
        name: String,
    },
    Verify {
        name: String,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    /// Sectors beyond the directory.
    data_sectors: u8,
    /// Sector 0: `None` leaves it zero (the store formats the disk).
    superblock: Option<Sector>,
    directory: Vec<Sector>,
    ops: Vec<Op>,
}

fn put(disk: &mut [u8], sector: usize, s: &Sector) {
    let mut bytes = [0u8; SECTOR];
    let n = s.bytes.len().min(SECTOR);
    bytes[..n].copy_from_slice(&s.bytes[..n]);
    if s.fix_crc {
        let mut crc = guest_bundle::Crc32::new();
        crc.update(&bytes[..SECTOR - 4]);
        bytes[SECTOR - 4..].copy_from_slice(&crc.finish().to_le_bytes());
    }
    disk[sector * SECTOR..(sector + 1) * SECTOR].copy_from_slice(&bytes);
}

fn check_listing(store: &Store<&mut RamDisk>, sectors: u64) {
    let list = store.list();
    assert!(list.len() as u64 <= ENTRIES);
    for (i, e) in list.iter().enumerate() {
        assert!(valid_name(&e.name) && valid_name(&e.vm), "{e:?}");
        assert!(e.start() >= DATA_START, "{e:?}");
        assert!(e.start() + e.sectors() <= sectors, "{e:?} past {sectors}");
        for f in &list[..i] {
            assert_ne!(e.name, f.name, "listed twice");
            let apart =
                e.start() + e.sectors() <= f.start() || f.start() + f.sectors() <= e.start();
            assert!(apart, "{e:?} overlaps {f:?}");
        }
    }
}

fuzz_target!(|input: Input| {
    let sectors = DATA_START + 1 + u64::from(input.data_sectors);
    let mut disk = RamDisk::new(sectors);
    if let Some(s) = &input.superblock {
        put(&mut disk.bytes, 0, s);
    }
    for s in input.directory.iter().take(ENTRIES as usize) {
        put(
            &mut disk.bytes,
            1 + usize::from(s.slot) % ENTRIES as usize,
            s,
        );
    }
    let Ok(mut store) = Store::open(&mut disk) else {
        return;
    };
    check_listing(&store, sectors);
    for op in input.ops.iter().take(16) {
        match op {
            Op::Write {
                name,
                vm,
                len,
                fill,
            } => {
                let bytes = vec![*fill; usize::from(*len)];
                let written = store.begin(name, vm).and_then(|mut w| {
                    w.write(&bytes)?;
                    w.commit(7, 9)
                });
                if written.is_ok() {
                    let mut back = Vec::new();
                    store
                        .read(name, |part| {
                            back.extend_from_slice(part);
                            Ok(())
                        })
                        .expect("a snapshot just written reads back");
                    assert_eq!(back, bytes);
                }
            }
            Op::Delete { name } => {
                let listed = store.find(name).is_some();
                assert_eq!(store.delete(name).is_ok(), listed);
                assert!(store.find(name).is_none());
            }
            Op::Verify { name } => match store.verify(name) {
                Ok(()) | Err(StoreError::Checksum) => assert!(store.find(name).is_some()),
                Err(StoreError::NotFound) => assert!(store.find(name).is_none()),
                Err(e) => panic!("verify: {e:?}"),
            },
        }
        check_listing(&store, sectors);
    }
    let listed = store.list().to_vec();
    drop(store);
    let again = Store::open(&mut disk).expect("a disk the store used opens again");
    assert_eq!(
        again.list(),
        listed.as_slice(),
        "the listing did not persist"
    );
});
