//! `rust_main`: start-up, then the mode chosen by /chosen/bootargs.

use crate::arch::{self, counter, counter_hz};
use crate::board::{Board, GicInfo};
use crate::hal::GuestHal;
use crate::pool::Pool;
use crate::wait::Waiter;
use core::ptr::NonNull;
use guest_driver::virtio_drivers::transport::mmio::{MmioTransport, VirtIOHeader};
use guest_driver::virtio_drivers::transport::Transport as _;
use guest_driver::{features, Balloon, Error, Options, Progress};

/// virtio-mmio MagicValue ("virt").
const VIRTIO_MAGIC: u32 = 0x7472_6976;
/// virtio device ID of the memory balloon.
const BALLOON_ID: u32 = 5;
/// The address the `wild` mode reads: below RAM, not a device of the board.
const WILD_IPA: usize = 0x3000_0000;
/// virtio-mmio: Status (a 32-bit register) and the device config space.
const VIRTIO_STATUS: usize = 0x70;
const VIRTIO_CONFIG: usize = 0x100;
/// Beyond the 39-bit VA range of the boot page table.
const FAULT_VA: usize = 0x80_0000_0000;
/// Seconds between heartbeat lines.
const HEARTBEAT_S: u64 = 2;

/// Notifies of the inflate queue with nothing queued that `empty-notifies`
/// in the bootargs asks for once the balloon is up: the benchmark's
/// measure of what a notify with nothing to do costs the hypervisor.
const EMPTY_NOTIFIES: u32 = 64;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Pattern,
    Wild,
    Hostile,
    /// `hostile-stats`: `pattern` whose balloon also sends statistics, all
    /// of them 2^64-1 (`crate::hostile_stats`).
    HostileStats,
    Fault,
    Features,
    Spin,
    Flood,
}

#[no_mangle]
extern "C" fn rust_main(dtb: u64) -> ! {
    let boot = counter();
    // Booted as an ELF, QEMU passes x0 = 0 and puts the tree at the RAM base.
    let dtb = if dtb == 0 { 0x4000_0000 } else { dtb };
    // SAFETY: x0 at entry is the device tree's address (the boot contract),
    // and the tree is kept out of the page pool (Board::reserved).
    let board = match unsafe { Board::parse(dtb) } {
        Ok(board) => board,
        Err(e) => {
            println!("cannot read the device tree at 0x{dtb:x}: {e}");
            arch::system_off();
        }
    };
    if let Some(uart) = board.uart {
        crate::console::init(uart as usize);
    }
    arch::map_ram(board.ram.start, board.ram.end);
    let bootargs = board.bootargs();
    let mode = match bootargs.split_whitespace().next().unwrap_or("pattern") {
        "wild" => Mode::Wild,
        "hostile" => Mode::Hostile,
        "hostile-stats" => Mode::HostileStats,
        "fault" => Mode::Fault,
        "pattern" => Mode::Pattern,
        "features" => Mode::Features,
        "spin" => Mode::Spin,
        "flood" => Mode::Flood,
        other => {
            println!("unknown bootargs \"{other}\": running \"pattern\"");
            Mode::Pattern
        }
    };
    println!(
        "booting: dtb 0x{:x}, bootargs \"{}\", RAM 0x{:x}..0x{:x}, counter {} Hz",
        dtb,
        bootargs,
        board.ram.start,
        board.ram.end,
        counter_hz()
    );

    match mode {
        Mode::Spin => crate::faults::spin(),
        Mode::Flood => crate::faults::flood(),
        _ => {}
    }
    let (mut pool, carved) = Pool::new(&board, mode != Mode::Hostile);
    println!(
        "up, RAM {} MiB, {} pages in the pool",
        (board.ram.end - board.ram.start) >> 20,
        pool.len()
    );

    let balloon_slot = find_balloon(&board);
    // Hostile mode programs the device itself, polling with time-outs.
    let mut waiter = if matches!(
        mode,
        Mode::Pattern | Mode::Features | Mode::Wild | Mode::HostileStats
    ) {
        Waiter::new(&board, balloon_slot)
    } else {
        Waiter::Polling
    };
    match mode {
        Mode::Hostile => match balloon_slot {
            Some(slot) => crate::hostile::run(slot, &board, &mut pool),
            None => println!("hostile: no balloon device"),
        },
        Mode::Wild => wild(&board, balloon_slot),
        Mode::Fault => fault(),
        Mode::Features => {
            // `features hold-stats`: the statistics buffer the device
            // returns is never given back to it.
            let hold_stats = bootargs.split_whitespace().any(|w| w == "hold-stats");
            crate::features::run(pool, carved, balloon_slot, waiter, boot, hold_stats)
        }
        Mode::Pattern | Mode::HostileStats | Mode::Spin | Mode::Flood => {}
    }
    if mode == Mode::Hostile {
        println!("hostile: done");
        arch::system_off();
    }

    let mut balloon = balloon_slot.and_then(|(base, size)| {
        let header = NonNull::new(base as *mut VirtIOHeader)?;
        // SAFETY: a virtio-mmio slot from the device tree, mapped as device
        // memory, used by nothing else in this guest.
        let transport = match unsafe { MmioTransport::new(header, size as usize) } {
            Ok(t) => t,
            Err(e) => {
                println!("balloon at 0x{base:x}: {e}");
                return None;
            }
        };
        // `hostile-stats` asks for the statistics queue too.
        let options = Options {
            features: match mode {
                Mode::HostileStats => features::BASIC | features::STATS_VQ,
                _ => features::BASIC,
            },
            poison_val: 0,
        };
        match Balloon::<GuestHal, _, _>::with_options(transport, carved.balloon_storage, options) {
            Ok(b) => {
                println!(
                    "balloon at 0x{:x}: features 0x{:x}, room for {} pages",
                    base,
                    b.features(),
                    pool.len()
                );
                Some(b)
            }
            Err(e) => {
                println!("balloon at 0x{base:x}: {e}");
                None
            }
        }
    });
    if balloon.is_none() {
        println!("no usable balloon: only the heartbeat runs");
    }
    if let Some(b) = balloon
        .as_mut()
        .filter(|_| bootargs.split_whitespace().any(|w| w == "empty-notifies"))
    {
        for _ in 0..EMPTY_NOTIFIES {
            // Queue 0 is inflateq; nothing is queued on it yet.
            b.transport_mut().notify(0);
        }
        println!("{EMPTY_NOTIFIES} empty notifies of the inflate queue done");
    }

    // `stuck`: the driver is up (DRIVER_OK) and acknowledges the device's
    // interrupts, but never moves the balloon: a guest whose balloon never
    // answers, for the memory manager's tests.
    let stuck = balloon.is_some() && bootargs.split_whitespace().any(|w| w == "stuck");
    if stuck {
        println!("balloon stuck: the driver runs but never moves the balloon");
    }

    let mut hostile_stats = (mode == Mode::HostileStats).then(|| {
        println!(
            "hostile-stats: every statistic sent as 0x{:x}",
            crate::hostile_stats::HOSTILE_VALUE
        );
        crate::hostile_stats::HostileStats::default()
    });

    let hz = counter_hz();
    let mut next_beat = boot + HEARTBEAT_S * hz;
    let mut stalled_at: Option<(u32, u32)> = None;
    loop {
        let now = counter();
        if now >= next_beat {
            println!("alive {}s", (now - boot) / hz);
            while next_beat <= now {
                next_beat += HEARTBEAT_S * hz;
            }
        }
        let Some(b) = balloon.as_mut() else {
            waiter.sleep_until(next_beat, |w| guest_driver::Wait::wait(w, &mut || {}));
            continue;
        };
        if stuck {
            waiter.sleep_until(next_beat, |w| {
                b.idle(w);
            });
            continue;
        }
        // A fresh hostile buffer each time the device has used the last.
        if let Some(source) = hostile_stats.as_mut() {
            match b.answer_stats(source) {
                Ok(true) => println!("hostile-stats: buffer #{} posted", source.sent),
                Ok(false) => {}
                Err(e) => {
                    println!("balloon error: {e}");
                    if e == Error::Broken {
                        balloon = None;
                    }
                    continue;
                }
            }
        }
        match b.poll_with(&mut pool, &mut waiter) {
            Ok(p) if p.moved() > 0 => {
                stalled_at = None;
                if p.at_target() {
                    report(&p, &mut pool);
                }
            }
            Ok(p) => {
                if !p.at_target() && stalled_at != Some((p.target, p.actual)) {
                    println!(
                        "balloon stalled target={} actual={} pages ({} pages left in the pool)",
                        p.target,
                        p.actual,
                        pool.len()
                    );
                    stalled_at = Some((p.target, p.actual));
                }
                // Nothing to do until the target changes (config-change
                // interrupt) or the next heartbeat.
                waiter.sleep_until(next_beat, |w| {
                    b.idle(w);
                });
            }
            Err(e) => {
                println!("balloon error: {e}");
                if e == Error::Broken || b.poll(&mut pool) == Err(Error::Broken) {
                    balloon = None;
                }
            }
        }
    }
}

/// After the balloon reached its target: the summary, the pattern check, and
/// the check of deflated pages.
fn report(p: &Progress, pool: &mut Pool) {
    println!("balloon target={} actual={} pages", p.target, p.actual);
    pool.check_and_report();
    let (deflated, nonzero) = pool.take_deflate_report();
    if deflated > 0 {
        match nonzero {
            None => println!("deflated pages read zero"),
            Some(addr) => println!("DEFLATED PAGE NOT ZERO at 0x{addr:x}"),
        }
    }
    pool.next_generation();
}

/// The first virtio-mmio slot whose device is a balloon. Slots are listed in
/// device-tree order; QEMU gives the first `-device` the highest slot, so all
/// of them are scanned.
fn find_balloon(board: &Board) -> Option<(u64, u64)> {
    let mut found = None;
    for &(base, size) in board.virtio_slots() {
        // SAFETY: a virtio-mmio slot from the device tree, mapped as device
        // memory; reading the identification registers has no side effects.
        let (magic, version, id) = unsafe {
            (
                arch::mmio_read32(base as usize),
                arch::mmio_read32(base as usize + 4),
                arch::mmio_read32(base as usize + 8),
            )
        };
        if magic != VIRTIO_MAGIC || id == 0 {
            continue;
        }
        println!("virtio-mmio 0x{base:x}: device {id}, version {version}");
        if id == BALLOON_ID && found.is_none() {
            found = Some((base, size));
        }
    }
    if found.is_none() {
        println!(
            "no virtio balloon (device 5) among {} virtio-mmio slots",
            board.virtio_slots().len()
        );
    }
    found
}

/// Reads a virtual address the guest's own page table does not map: the
/// guest's vector table reports the translation fault and powers off.
fn fault() -> ! {
    println!("reading unmapped VA 0x{FAULT_VA:x}");
    // SAFETY: deliberately faults; the exception handler never returns.
    let value = unsafe { (FAULT_VA as *const u64).read_volatile() };
    println!("read 0x{value:x}: no fault?");
    arch::system_off()
}

/// Makes the bad accesses a board answers with an external abort, each
/// under a probe, and says what the exception handler saw (EC, fault status,
/// WnR, FAR, and whether ELR_EL1 is the faulting instruction); then the
/// guest carries on as in `pattern` mode. Under a hypervisor whose policy
/// is to stop the VM, the first one ends it.
fn wild(board: &Board, balloon: Option<(u64, u64)>) {
    let probe = |name: &str, far: usize, access: &dyn Fn() -> u64| {
        let mut at = 0;
        match arch::probe(|| at = access()) {
            Some(c) => println!(
                "wild: {name}: EC 0x{:x} FSC 0x{:x} WnR {} FAR 0x{:x} {}",
                (c.esr >> 26) & 0x3f,
                c.esr & 0x3f,
                (c.esr >> 6) & 1,
                c.far,
                if c.far == far as u64 && c.elr == at {
                    "(FAR and ELR right)"
                } else {
                    "(FAR or ELR WRONG)"
                }
            ),
            None => println!("wild: {name}: no exception"),
        }
    };
    // Every access below runs under a probe; the addresses are
    // device registers, or an IPA nothing backs, mapped as device or normal
    // non-cacheable memory by the boot table, so the only effect of a wrong
    // access is an exception the probe records.
    if let Some((base, _)) = balloon {
        let base = base as usize;
        let odd = arch::DATA_ALIAS + base + VIRTIO_CONFIG + 1;
        probe("virtio config 2-byte read at offset 1", odd, &|| {
            // SAFETY: a probed access, see above.
            unsafe { arch::bad::read16(odd) }
        });
        let status = base + VIRTIO_STATUS;
        probe("virtio status 2-byte read", status, &|| {
            // SAFETY: a probed access, see above.
            unsafe { arch::bad::read16(status) }
        });
        let config = base + VIRTIO_CONFIG;
        probe("virtio config ldp", config, &|| {
            // SAFETY: a probed access, see above.
            unsafe { arch::bad::load_pair(config) }
        });
    }
    if let Some(GicInfo::V2 { distributor, .. } | GicInfo::V3 { distributor, .. }) = board.gic {
        let ctlr = distributor as usize;
        probe("GIC distributor 2-byte read", ctlr, &|| {
            // SAFETY: a probed access, see above.
            unsafe { arch::bad::read16(ctlr) }
        });
    }
    probe("unmapped read", WILD_IPA, &|| {
        // SAFETY: a probed access, see above.
        unsafe { arch::bad::read32(WILD_IPA) }
    });
    probe("unmapped write", WILD_IPA, &|| {
        // SAFETY: a probed access, see above.
        unsafe { arch::bad::write32(WILD_IPA) }
    });
    let target = arch::EXEC_ALIAS + WILD_IPA;
    probe("fetch outside RAM", target, &|| {
        // SAFETY: a probed access, see above; nothing backs the target.
        unsafe { arch::bad::call(target) };
        target as u64
    });
    println!("wild: done, carrying on");
}
