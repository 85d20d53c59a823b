//! The `check` command: the memory invariants, checked over the whole
//! system at once, reported in one line.
//!
//! - the frame table's own invariants ([`FrameTable::check_invariants`]);
//! - every VM's stage-2 tables map only frames it owns, and it owns only
//!   frames it maps ([`GuestRam::check`]);
//! - a stopped VM owns no frames (its pages are all back in the pool), and
//!   no frame is owned by a VM that does not exist;
//! - the stage-2 table pages are exactly those of the VMs' tables;
//! - pool + hypervisor + VMs sum to the board's RAM.
//!
//! The walk of a VM's stage-2 tables ([`RamFacts::of`]) is done under that
//! VM's lock alone, one VM at a time; the figures the check adds up across
//! VMs (table pages, frames per VM, the frame table's counters) are read
//! with every VM's lock held, but only for those reads
//! ([`FrameFacts::counts`]), so they are one consistent snapshot and no VM
//! waits for another's walk. Plain data, tested on the host.

extern crate alloc;

use alloc::vec::Vec;
use core::fmt;

use super::memory::{GuestRam, HostMemory, OwnershipError};
use crate::mm::frames::{FrameError, FrameTable, FrameUse, MAX_VMS, PAGE_SIZE};

/// What the frame table says, read under its lock in one go.
#[derive(Clone, Debug)]
pub struct FrameFacts {
    invariants: Result<(), FrameError>,
    /// Pages per use.
    pages: [u64; FrameUse::COUNT],
    /// Frames owned by each VM id.
    guest_pages: [u64; MAX_VMS],
    /// Bytes the table accounts for (partial pages included), and the RAM
    /// size the board's device tree gives.
    accounted: u64,
    ram_bytes: u64,
}

impl FrameFacts {
    /// Read `table`; `ram_bytes` is the RAM the board has.
    pub fn of(table: &FrameTable<'_>, ram_bytes: u64) -> Self {
        Self {
            invariants: table.check_invariants(),
            ..Self::counts(table, ram_bytes)
        }
    }

    /// Read `table`'s counters only (constant time); its invariants, a scan
    /// of every frame, come from [`Self::with_invariants`].
    pub fn counts(table: &FrameTable<'_>, ram_bytes: u64) -> Self {
        Self {
            invariants: Ok(()),
            pages: FrameUse::ALL.map(|u| table.pages(u)),
            guest_pages: core::array::from_fn(|vm| table.guest_pages(vm)),
            accounted: table.accounting().total(),
            ram_bytes,
        }
    }

    /// These counters with the result of the frame table's own check.
    pub fn with_invariants(self, invariants: Result<(), FrameError>) -> Self {
        Self { invariants, ..self }
    }

    fn pages(&self, use_: FrameUse) -> u64 {
        self.pages[use_ as usize]
    }
}

/// One VM as the check sees it.
pub struct VmFacts<'a> {
    pub id: usize,
    pub name: &'a str,
    /// Stopped: it must own no frames.
    pub stopped: bool,
    pub ram: Option<RamFacts>,
}

/// What a walk of a VM's stage-2 tables found, and its counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RamFacts {
    pub table_pages: u64,
    pub mapped_pages: u64,
    /// It maps only frames it owns, and owns only frames it maps.
    pub ownership: Result<(), OwnershipError>,
}

impl RamFacts {
    /// Walk `ram`'s tables (under its VM's lock).
    pub fn of(ram: &GuestRam, mem: &mut impl HostMemory) -> Self {
        Self {
            ownership: ram.check(mem),
            ..Self::counts(ram)
        }
    }

    /// `ram`'s counters only (no walk).
    pub fn counts(ram: &GuestRam) -> Self {
        Self {
            table_pages: ram.table_pages(),
            mapped_pages: ram.mapped_pages(),
            ownership: Ok(()),
        }
    }
}

/// A broken invariant, worded for the console.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure<'a> {
    FrameTable(FrameError),
    Ownership {
        name: &'a str,
        error: OwnershipError,
    },
    /// A stopped VM still owns frames (they never went back to the pool).
    StoppedOwns {
        name: &'a str,
        frames: u64,
    },
    /// Frames recorded as owned by a VM id no VM has.
    Orphans {
        vm: usize,
        frames: u64,
    },
    /// Stage-2 table pages in the frame table vs the VMs' own counts.
    Tables {
        recorded: u64,
        counted: u64,
    },
    /// The accounting does not sum to the board's RAM.
    Sum {
        accounted: u64,
        ram: u64,
    },
}

impl fmt::Display for Failure<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::FrameTable(e) => write!(f, "frame table: {e}"),
            Failure::Ownership { name, error } => write!(f, "{name}: {error}"),
            Failure::StoppedOwns { name, frames } => write!(
                f,
                "{name} is stopped but still owns {frames} frames (not back in the pool)"
            ),
            Failure::Orphans { vm, frames } => {
                write!(f, "{frames} frames are owned by VM {vm}, which does not exist")
            }
            Failure::Tables { recorded, counted } => write!(
                f,
                "the frame table has {recorded} stage-2 table pages, the VMs' tables count {counted}"
            ),
            Failure::Sum { accounted, ram } => write!(
                f,
                "pool + hypervisor + VMs account for {accounted} bytes, the board has {ram} bytes of RAM"
            ),
        }
    }
}

/// The figures of a check that passed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub ram_pages: u64,
    pub pool: u64,
    pub hypervisor: u64,
    /// Guest RAM frames and stage-2 table pages of all VMs.
    pub guest: u64,
    pub tables: u64,
    pub partial_bytes: u64,
    pub running: usize,
    pub stopped: usize,
    /// Mapped pages whose owner was checked.
    pub mapped_checked: u64,
}

impl fmt::Display for Summary {
    /// `check: ok (…)`, the one line the test harness looks for.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "check: ok (RAM {} pages = pool {} + hypervisor {} + VMs {} ({} RAM, {} stage-2 tables)",
            self.ram_pages,
            self.pool,
            self.hypervisor,
            self.guest + self.tables,
            self.guest,
            self.tables
        )?;
        if self.partial_bytes > 0 {
            write!(f, " + {} bytes of partial pages", self.partial_bytes)?;
        }
        write!(
            f,
            "; {} VMs running, {} stopped owning nothing; {} mapped pages each owned by its VM)",
            self.running, self.stopped, self.mapped_checked
        )
    }
}

/// Check everything; the figures, or every broken invariant found.
pub fn check<'a>(frames: &FrameFacts, vms: &[VmFacts<'a>]) -> Result<Summary, Vec<Failure<'a>>> {
    let mut failures = Vec::new();
    if let Err(e) = frames.invariants {
        failures.push(Failure::FrameTable(e));
    }
    let mut summary = Summary::default();
    let mut tables = 0;
    for vm in vms {
        let owned = frames.guest_pages.get(vm.id).copied().unwrap_or(0);
        match vm.ram {
            Some(ram) => {
                summary.running += 1;
                tables += ram.table_pages;
                summary.mapped_checked += ram.mapped_pages;
                if let Err(error) = ram.ownership {
                    failures.push(Failure::Ownership {
                        name: vm.name,
                        error,
                    });
                }
            }
            None if vm.stopped => {
                summary.stopped += 1;
                if owned != 0 {
                    failures.push(Failure::StoppedOwns {
                        name: vm.name,
                        frames: owned,
                    });
                }
            }
            // Starting or stopping without RAM: it must own nothing either.
            None if owned != 0 => failures.push(Failure::StoppedOwns {
                name: vm.name,
                frames: owned,
            }),
            None => {}
        }
    }
    for (vm, &owned) in frames.guest_pages.iter().enumerate() {
        if owned != 0 && !vms.iter().any(|v| v.id == vm) {
            failures.push(Failure::Orphans { vm, frames: owned });
        }
    }
    let recorded = frames.pages(FrameUse::PageTables);
    if recorded != tables {
        failures.push(Failure::Tables {
            recorded,
            counted: tables,
        });
    }
    if frames.accounted != frames.ram_bytes {
        failures.push(Failure::Sum {
            accounted: frames.accounted,
            ram: frames.ram_bytes,
        });
    }
    if !failures.is_empty() {
        return Err(failures);
    }
    let tracked: u64 = frames.pages.iter().sum();
    summary.pool = frames.pages(FrameUse::Free);
    summary.guest = frames.pages(FrameUse::Guest);
    summary.tables = recorded;
    summary.hypervisor = tracked - summary.pool - summary.guest - summary.tables;
    summary.ram_pages = tracked;
    summary.partial_bytes = frames.ram_bytes - tracked * PAGE_SIZE;
    Ok(summary)
}

/// Write the result: one `check: ok (…)` line, or one `check: FAILED: …`
/// line per broken invariant.
pub fn write_result(
    out: &mut impl fmt::Write,
    result: &Result<Summary, Vec<Failure<'_>>>,
) -> fmt::Result {
    match result {
        Ok(summary) => writeln!(out, "{summary}"),
        Err(failures) => failures
            .iter()
            .try_for_each(|failure| writeln!(out, "check: FAILED: {failure}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::{GuestAddr, PhysAddr};
    use crate::vm::testing::FakeHost;

    const BASE: GuestAddr = GuestAddr::new(0x4000_0000);

    fn facts(host: &FakeHost) -> FrameFacts {
        FrameFacts::of(&host.frames, host.frames.total_pages() * PAGE_SIZE)
    }

    fn text(result: &Result<Summary, Vec<Failure<'_>>>) -> String {
        let mut s = String::new();
        write_result(&mut s, result).unwrap();
        s
    }

    #[test]
    fn two_vms_one_stopped_pass_with_figures() {
        let mut host = FakeHost::new(400);
        host.frames
            .alloc(10, 1, FrameUse::Heap)
            .expect("hypervisor pages");
        let mut a = GuestRam::new(&mut host, 0, 1, BASE, 64 * PAGE_SIZE).unwrap();
        a.populate(&mut host).unwrap();
        a.release(&mut host, &[BASE.pfn() + 3]);
        let mut b = GuestRam::new(&mut host, 1, 2, BASE, 32 * PAGE_SIZE).unwrap();
        b.populate(&mut host).unwrap();
        b.destroy(&mut host);
        let vms = [
            VmFacts {
                id: 0,
                name: "alpha",
                stopped: false,
                ram: Some(RamFacts::of(&a, &mut host)),
            },
            VmFacts {
                id: 1,
                name: "beta",
                stopped: true,
                ram: None,
            },
        ];
        let result = check(&facts(&host), &vms);
        assert_eq!(
            result,
            Ok(Summary {
                ram_pages: 400,
                pool: 400 - 10 - 63 - 17,
                hypervisor: 10,
                guest: 63,
                tables: 17,
                partial_bytes: 0,
                running: 1,
                stopped: 1,
                mapped_checked: 63,
            })
        );
        assert_eq!(
            text(&result),
            "check: ok (RAM 400 pages = pool 310 + hypervisor 10 + VMs 80 (63 RAM, 17 stage-2 tables); \
             1 VMs running, 1 stopped owning nothing; 63 mapped pages each owned by its VM)\n"
        );
    }

    #[test]
    fn every_broken_invariant_is_a_failed_line() {
        let mut host = FakeHost::new(200);
        let mut a = GuestRam::new(&mut host, 0, 1, BASE, 16 * PAGE_SIZE).unwrap();
        a.populate(&mut host).unwrap();
        // A frame of a stopped VM never given back, one of a VM that does
        // not exist, a frame of alpha's taken by beta behind its back.
        host.frames.alloc_guest(1).unwrap();
        host.frames.alloc_guest(7).unwrap();
        let stolen = a.translate_or_back(&mut host, BASE).unwrap();
        host.frames.free_guest(0, stolen).unwrap();
        let vms = [
            VmFacts {
                id: 0,
                name: "alpha",
                stopped: false,
                ram: Some(RamFacts::of(&a, &mut host)),
            },
            VmFacts {
                id: 1,
                name: "beta",
                stopped: true,
                ram: None,
            },
        ];
        let mut frames = facts(&host);
        frames.ram_bytes += PAGE_SIZE;
        frames.pages[FrameUse::PageTables as usize] += 1;
        let result = check(&frames, &vms);
        let lines = text(&result);
        assert_eq!(lines.lines().count(), 5, "{lines}");
        assert!(lines.lines().all(|l| l.starts_with("check: FAILED: ")));
        for want in [
            "alpha: VM 0 maps IPA 0x40000000 to frame 0x80010000, which no VM owns",
            "beta is stopped but still owns 1 frames (not back in the pool)",
            "1 frames are owned by VM 7, which does not exist",
            "the frame table has 18 stage-2 table pages, the VMs' tables count 17",
            "the board has 823296 bytes of RAM",
        ] {
            assert!(lines.contains(want), "{want} in:\n{lines}");
        }
        // A broken frame table is reported too.
        let mut frames = facts(&host);
        frames.invariants = Err(FrameError::CorruptEntry {
            addr: PhysAddr::new(0),
            code: 0xff,
        });
        let lines = text(&check(&frames, &vms[..1]));
        assert!(lines.contains("check: FAILED: frame table: page 0x0 has invalid frame code 0xff"));
        assert!(lines.contains("owned by VM 1, which does not exist"));
    }
}
