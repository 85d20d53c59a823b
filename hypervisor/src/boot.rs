//! The boot flow on the boot CPU, the secondary CPUs' entry into Rust, and
//! the shell loop. Runs only on the target.
//!
//! Order matters: discover the board from the device tree, bring up the
//! console (or stop saying why), switch to the precise EL2 memory map,
//! account for every page of RAM in the frame table, give the heap its
//! frames, validate the guest bundle, then start the other CPUs and the shell.

extern crate alloc;

use core::fmt::Write;

use platform::uart::ConsoleUart;
use platform::{boards, BoardInfo, PhysRange, PowerOff, MAX_CPUS};
use spin::{Mutex, Once};

use crate::addr::PhysAddr;
use crate::arch::aarch64::{self, mmu, psci, smp};
use crate::console::commands::{self, ManagerFacts, Then};
use crate::console::line::{self, Event, LineEditor};
use crate::console::shell::{self, Command};
use crate::console::snapshot_cmds;
use crate::domain::{InjectInto, Service, REASON_BYTES};
use crate::limits::MAX_GUESTS;
use crate::mm::frames::{FrameTable, FrameUse, PAGE_SIZE};
use crate::mm::layout::{check_image_placement, find_hole, BadPlacement};
use crate::mm::manager::Policy;
use crate::mm::manager::Watermarks;
use crate::run;
use crate::snapshot::store::Disk;
use crate::vm::manage;
use crate::{print, println, report};

/// The hypervisor refuses to run with less RAM than this.
pub const MIN_RAM: u64 = 64 << 20;
/// Heap size: a fixed share for now; guests are not allocated from it.
pub const HEAP_SIZE: u64 = 16 << 20;

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const BUILD: &str = match option_env!("TIDAL_BUILD_ID") {
    Some(id) => id,
    None => "dev",
};

static BOARD: Once<BoardInfo> = Once::new();
static FRAMES: Once<run::FrameLock> = Once::new();

/// The shell's writer for reports: it prints whole lines, each under one
/// console lock, so a guest line printed meanwhile lands between two lines
/// of a table, never inside one (a `{:<13}` field alone is several writes).
/// What is left without a newline is printed when it is dropped.
struct Console {
    line: heapless::String<256>,
}

impl Console {
    fn new() -> Self {
        Self {
            line: heapless::String::new(),
        }
    }

    fn flush(&mut self) {
        if !self.line.is_empty() {
            crate::console::write_fmt(format_args!("{}", self.line));
            self.line.clear();
        }
    }
}

impl Write for Console {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        for c in s.chars() {
            if self.line.push(c).is_err() {
                self.flush();
                let _ = self.line.push(c);
            }
            if c == '\n' {
                self.flush();
            }
        }
        Ok(())
    }
}

impl Drop for Console {
    fn drop(&mut self) {
        self.flush();
    }
}

/// Print `FATAL: ...` and stop the board cleanly (power off if the tree says
/// how, else park).
fn fatal(board: Option<&BoardInfo>, args: core::fmt::Arguments) -> ! {
    println!("FATAL: {args}");
    println!("stopping.");
    power_off(board)
}

/// [`fatal`] once the board is known: what `run` calls when the board
/// cannot go on safely (a frame table broken by a failure).
fn fatal_on_board(args: core::fmt::Arguments) -> ! {
    fatal(BOARD.get(), args)
}

fn power_off(board: Option<&BoardInfo>) -> ! {
    if let Some(board) = board {
        match board.power_off {
            PowerOff::Psci(conduit) => {
                let _ = psci::system_off(conduit);
            }
            PowerOff::Bcm2835Watchdog { regs } => {
                // SAFETY: the watchdog registers come from the tree and are
                // mapped as device memory by the EL2 identity map.
                unsafe { platform::power::bcm2835_watchdog_halt(regs.start) };
            }
            PowerOff::None => {}
        }
    }
    println!("power-off did not take effect; parking this CPU.");
    aarch64::park()
}

/// Read the device tree blob at `addr`: its header says how long it is.
fn dtb_slice(addr: usize) -> Option<&'static [u8]> {
    if addr == 0 || !addr.is_multiple_of(8) {
        return None;
    }
    // SAFETY: the boot contract puts a device tree at x0; the boot map maps
    // the 1 GiB block holding it as normal memory. We read 8 bytes, check
    // the magic, and trust totalsize only up to 16 MiB.
    let header = unsafe { core::slice::from_raw_parts(addr as *const u8, 8) };
    if header[..4] != [0xd0, 0x0d, 0xfe, 0xed] {
        return None;
    }
    let size = u32::from_be_bytes([header[4], header[5], header[6], header[7]]) as usize;
    if !(40..=16 << 20).contains(&size) {
        return None;
    }
    // SAFETY: as above, for `size` bytes.
    Some(unsafe { core::slice::from_raw_parts(addr as *const u8, size) })
}

/// The console from the tree, else the board's known default UART (only
/// to report what is wrong).
fn console_for(board: Option<&BoardInfo>, dtb: Option<&[u8]>) -> Option<(ConsoleUart, bool)> {
    if let Some(uart) = board.and_then(|b| b.console) {
        // SAFETY: the tree says this UART is there; it is device-mapped.
        return Some((unsafe { ConsoleUart::from_uart(&uart) }, true));
    }
    let desc = platform::board_desc(dtb?)?;
    let uart = desc.fallback_console?;
    // SAFETY: the board description names this board's default UART.
    Some((unsafe { ConsoleUart::from_uart(&uart) }, false))
}

#[no_mangle]
extern "C" fn rust_boot_cpu_main(dtb_addr: usize, load_addr: usize) -> ! {
    let dtb = dtb_slice(dtb_addr);
    let discovered = dtb.map(|d| platform::discover(d, dtb_addr as u64));
    let board = discovered.as_ref().and_then(|r| r.as_ref().ok());
    match console_for(board, dtb) {
        Some((uart, _)) => crate::console::init(uart),
        None => aarch64::park(), // nowhere to say anything
    }
    if let Some(why) = dtb.and_then(platform::unsupported_board) {
        fatal(
            board,
            format_args!(
                "unsupported board: this is {why}; Tidal runs on the Raspberry Pi 4 B, Pi 400 \
                 and CM4 (BCM2711) and on QEMU virt"
            ),
        );
    }
    let board = match discovered {
        None => fatal(None, format_args!("no valid device tree at x0 = {dtb_addr:#x}")),
        Some(Err(e)) => fatal(None, format_args!("{e}")),
        Some(Ok(b)) if b.console.is_none() => fatal(
            Some(&b),
            format_args!(
                "the device tree names no console UART (no /chosen/stdout-path and no serial0 alias)"
            ),
        ),
        Some(Ok(b)) => BOARD.call_once(|| b),
    };
    let desc = platform::boards::describe(core::iter::once(board.compatible.as_str()));
    println!();
    println!(
        "Tidal hypervisor v{VERSION} ({BUILD}) on {} [{}]",
        if desc == &boards::GENERIC {
            board.model.as_str()
        } else {
            desc.name
        },
        board.compatible
    );
    println!(
        "model: {}; loaded at {load_addr:#x}, device tree at {dtb_addr:#x}",
        board.model
    );
    match &board.gic {
        Some(gic) => {
            let _ = report::write_gic(&mut Console::new(), gic);
        }
        None => fatal(Some(board), format_args!("the device tree has no GIC")),
    }
    let console = board.console.as_ref().map(report::uart);
    print!("console: {}", console.unwrap());
    match &board.trace_uart {
        Some(t) => {
            // SAFETY: discovery returns a trace UART only when it is a PL011
            // distinct from the console; nothing else drives it.
            unsafe { crate::trace::init(t.regs.start as usize) };
            defmt::info!("trace started: Tidal v{=str} ({=str})", VERSION, BUILD);
            println!("; trace: {} (defmt)", report::uart(t))
        }
        None => println!("; trace: none (no trace UART configured, trace dropped)"),
    }

    let ram_total: u64 = board.ram.iter().map(|r| r.size()).sum();
    if ram_total < MIN_RAM {
        fatal(
            Some(board),
            format_args!(
                "only {} of RAM; the hypervisor needs at least {}",
                report::Size(ram_total),
                report::Size(MIN_RAM)
            ),
        );
    }
    if let Err(e) = mmu::init(&board.ram) {
        fatal(
            Some(board),
            format_args!("cannot build the EL2 memory map: {e:?}"),
        );
    }

    init_frames(board, load_addr as u64);
    init_gic(board);
    defmt::info!(
        "frame table ready: {=u64} free pages",
        FRAMES.get().map_or(0, |f| f.lock().free_pages())
    );
    let _ = report::write_memory_map(&mut Console::new(), board);
    let bundle = check_bundle(board);

    // The boot CPU counts its EL2 instructions too: it may run a vCPU.
    aarch64::pmu::init();
    start_secondaries(board);
    // With the console's input interrupt on this CPU the idle shell sleeps
    // until a byte arrives, and a vCPU may share the CPU: its exits let the
    // shell look at the console.
    let input_interrupt = console_input_interrupt(board);
    run::set_fatal(fatal_on_board);
    *SHELL.lock() = Some(LineEditor::new());
    if input_interrupt {
        run::share_shell_cpu(look_from_guest);
    }
    if let Some(frames) = FRAMES.get() {
        run::init(bundle, frames);
        init_manager(&bundle, frames);
        // Before any VM runs; a board without one says nothing here.
        let disk = crate::disk::probe(&board.virtio_mmio);
        if let Some(disk) = disk {
            println!(
                "disk: virtio-blk at {:#x}, {}",
                disk.regs.start,
                report::Size(disk.sectors.saturating_mul(512))
            );
        }
        // The network card on another slot, with the bundle's address.
        let skip = disk.map(|d| d.regs);
        match crate::net::probe(&board.virtio_mmio, skip, bundle.board_address()) {
            None => {}
            Some(Ok(net)) => match net.address {
                Some(address) => println!(
                    "net: virtio-net at {:#x}, MAC {}, address {address}",
                    net.regs.start,
                    crate::net::Mac(net.mac)
                ),
                None => println!(
                    "net: virtio-net at {:#x}, MAC {}, no address configured ([board] address)",
                    net.regs.start,
                    crate::net::Mac(net.mac)
                ),
            },
            Some(Err((regs, why))) => {
                println!("net: virtio-net at {:#x} not used: {why}", regs.start)
            }
        }
    }
    // Lines said under a VM's lock go through its outbox (printed after).
    // A VM configured with `restore = "<name>"` starts from that snapshot
    // (below, once the others have started) instead of booting.
    let mut restores: heapless::Vec<(heapless::String<32>, &str), MAX_GUESTS> =
        heapless::Vec::new();
    run::for_each(|vm| {
        let (name, cpu, ram) = (vm.name().clone(), vm.cpu(), report::Size(vm.ram_size()));
        if let Some(snapshot) = vm.spec().restore() {
            let _ = restores.push((name, snapshot));
            return;
        }
        match run::start(vm) {
            Ok(()) => vm.out().line(format_args!(
                "tidal: [{name}] VM started on CPU {cpu} with {ram} of RAM"
            )),
            Err(e) => vm
                .out()
                .line(format_args!("tidal: [{name}] VM not started: {e}")),
        }
    });
    for (vm, snapshot) in restores {
        let mut text = alloc::string::String::new();
        let later = snapshot_cmds::restore(
            &mut ShellBoard { info: board },
            &mut text,
            snapshot,
            Some(&vm),
        );
        print!("{text}");
        if let Some(later) = later {
            restore_later(later);
        }
    }
    // A test bundle: the on-target checks, then the shell as usual.
    if bundle.on_target_tests() {
        crate::ontarget::run(board, &bundle);
    }
    println!("Type 'help' for the list of commands.");
    shell_loop(input_interrupt)
}

fn image_range(load_addr: u64) -> PhysRange {
    extern "C" {
        static __image_end: u8;
    }
    let end = core::ptr::addr_of!(__image_end) as u64;
    PhysRange::new(load_addr, end)
}

/// Stop with one clear line if the loader put the image outside RAM or on
/// top of the tree, the bundle or a firmware reservation.
fn check_placement(board: &BoardInfo, image: PhysRange) {
    let mut others: heapless::Vec<(PhysRange, &str), { platform::MAX_RESERVED + 2 }> =
        heapless::Vec::new();
    let _ = others.push((board.dtb, "the device tree"));
    if let Some(b) = board.initrd {
        let _ = others.push((b, "the guest bundle"));
    }
    for r in &board.reserved {
        let _ = others.push((r.range, r.name.as_str()));
    }
    let what = match check_image_placement(image, &board.ram, &others) {
        Ok(()) => return,
        Err(BadPlacement::OutsideRam) => {
            format_args!("not on a 4 KiB boundary inside one RAM bank")
        }
        Err(BadPlacement::Overlaps(name, r)) => fatal(
            Some(board),
            format_args!(
                "the hypervisor image was loaded at {:#x}-{:#x}, on top of {name} ({:#x}-{:#x}); \
                     load it elsewhere (on the Pi: no kernel_address= in config.txt)",
                image.start, image.end, r.start, r.end
            ),
        ),
    };
    fatal(
        Some(board),
        format_args!(
            "the hypervisor image was loaded at {:#x}-{:#x}, {what}; \
             load it elsewhere (on the Pi: no kernel_address= in config.txt)",
            image.start, image.end
        ),
    )
}

/// Account for every page of RAM, then hand the heap its frames.
fn init_frames(board: &'static BoardInfo, load_addr: u64) {
    let image = image_range(load_addr);
    check_placement(board, image);
    let mut busy: heapless::Vec<PhysRange, { platform::MAX_RESERVED + 4 }> = heapless::Vec::new();
    let _ = busy.push(image);
    let _ = busy.push(board.dtb);
    if let Some(b) = board.initrd {
        let _ = busy.push(b);
    }
    for r in &board.reserved {
        let _ = busy.push(r.range);
    }
    let table_bytes = FrameTable::entries_needed(&board.ram) as u64;
    let table_size = table_bytes.next_multiple_of(PAGE_SIZE);
    let Some(table_addr) = find_hole(&board.ram, &busy, table_size, PAGE_SIZE) else {
        fatal(
            Some(board),
            format_args!(
                "no room in RAM for the frame table ({})",
                report::Size(table_size)
            ),
        );
    };
    // SAFETY: find_hole returned RAM that overlaps no image, tree, bundle or
    // reserved region, mapped normal by the EL2 map, used by nothing else.
    let storage =
        unsafe { core::slice::from_raw_parts_mut(table_addr as *mut u8, table_bytes as usize) };
    let mut frames = match FrameTable::new(&board.ram, storage) {
        Ok(f) => f,
        Err(e) => fatal(Some(board), format_args!("frame table: {e}")),
    };
    // Priority order: the first claim on a page wins.
    let claims = [
        (image, FrameUse::HypervisorImage),
        (board.dtb, FrameUse::DeviceTree),
        (
            PhysRange::from_base_size(table_addr, table_size),
            FrameUse::FrameTable,
        ),
    ];
    for (range, use_) in claims {
        let _ = frames.mark(range, use_);
    }
    for r in &board.reserved {
        let _ = frames.mark(r.range, FrameUse::FirmwareReserved);
    }
    if let Some(b) = board.initrd {
        let _ = frames.mark(b, FrameUse::GuestBundle);
    }
    let heap_pages = (HEAP_SIZE / PAGE_SIZE) as usize;
    let Some(heap) = frames.alloc(heap_pages, 1, FrameUse::Heap) else {
        fatal(
            Some(board),
            format_args!("no room in RAM for the {} heap", report::Size(HEAP_SIZE)),
        );
    };
    // SAFETY: the frame table just gave these frames to the heap alone.
    unsafe { crate::heap::init(heap.raw() as usize, HEAP_SIZE as usize) };
    if let Err(e) = frames.check_invariants() {
        panic!("frame table broken right after boot: {e}");
    }
    FRAMES.call_once(|| run::FrameLock::new(frames));
}

fn check_bundle(board: &BoardInfo) -> guest_bundle::Bundle<'static> {
    let Some(range) = board.initrd else {
        fatal(
            Some(board),
            format_args!(
                "no guest bundle: the device tree has no /chosen/linux,initrd-start; pass one with \
                 `-initrd guests.img` (QEMU) or `initramfs guests.img followkernel` (config.txt)"
            ),
        );
    };
    // SAFETY: the bundle range comes from the tree, lies in RAM (the frame
    // table marked it) and is mapped normal; nothing writes it.
    let bytes =
        unsafe { core::slice::from_raw_parts(range.start as *const u8, range.size() as usize) };
    match guest_bundle::parse_with_crc(bytes, crate::bundle_crc::crc32) {
        Ok(b) => {
            println!(
                "guest bundle: format version {}, {} VM(s), {} at {:#x}",
                b.version(),
                b.vms().count(),
                report::Size(range.size()),
                range.start
            );
            b
        }
        Err(e) => fatal(
            Some(board),
            format_args!("guest bundle at {:#x}: {e}", range.start),
        ),
    }
}

fn start_secondaries(board: &BoardInfo) {
    let table = smp::assign_indexes(board, aarch64::mpidr());
    let mut online = 1;
    let present = table.iter().flatten().count();
    for (index, cpu) in table.iter().enumerate().skip(1) {
        let Some(cpu) = cpu else { continue };
        match smp::start(index, cpu, board.psci) {
            Ok(()) => {
                online += 1;
                println!(
                    "cpu{index} online (MPIDR {:#x}, {})",
                    cpu.mpidr,
                    report::method_name(cpu.enable_method)
                );
                defmt::info!("cpu{=usize} online (MPIDR {=u64:#x})", index, cpu.mpidr);
            }
            Err(e) => println!(
                "cpu{index} (MPIDR {:#x}) did not come online: {e:?}",
                cpu.mpidr
            ),
        }
    }
    if board.cpus.len() > MAX_CPUS {
        println!("only the first {MAX_CPUS} CPUs are used");
    }
    println!("CPUs online: {online} of {present}");
    defmt::info!("CPUs online: {=usize} of {=usize}", online, present);
}

#[no_mangle]
extern "C" fn rust_secondary_cpu_main(index: usize) -> ! {
    // Before it counts as online: the PMU's event is known by then.
    aarch64::pmu::init();
    smp::set_state(index, smp::CpuState::Online);
    if aarch64::gic::present() && !aarch64::gic::init_cpu(index) {
        println!(
            "cpu{index}: no GIC redistributor matches this CPU: guests on it get no interrupts"
        );
    }
    defmt::debug!("cpu{=usize} entered Rust at EL2", index);
    run::cpu_loop(index)
}

/// Start the memory manager with the bundle's pool watermarks (or the
/// defaults for this RAM), and say what the board commits.
fn init_manager(bundle: &guest_bundle::Bundle<'static>, frames: &run::FrameLock) {
    let (total, free) = {
        let f = frames.lock();
        (f.total_pages(), f.free_pages())
    };
    let defaults = Watermarks::for_ram(total);
    let watermarks = match bundle.pool_watermarks() {
        None => defaults,
        Some((min, low, high)) => {
            let w = Watermarks {
                min: min / PAGE_SIZE,
                low: low / PAGE_SIZE,
                high: high / PAGE_SIZE,
            };
            match w.validate(total) {
                Ok(()) => w,
                Err(e) => {
                    println!("memory manager: the bundle's pool watermarks are refused ({e}); using the defaults");
                    defaults
                }
            }
        }
    };
    let stop_lowest = bundle.stop_lowest_when_exhausted();
    run::init_manager(watermarks, stop_lowest);
    let committed: u64 = bundle.vms().map(|v| v.ram_size()).sum();
    let size = |pages: u64| report::Size(pages * PAGE_SIZE);
    println!(
        "memory manager: {} of guest RAM committed, {} free in the pool; watermarks min {}, low {}, high {}; when exhausted: {}",
        report::Size(committed),
        size(free),
        size(watermarks.min),
        size(watermarks.low),
        size(watermarks.high),
        manage::exhausted_policy(stop_lowest)
    );
    // The guarantee limit is this board's RAM, not the configuration's
    // (a bundle runs on boards of 2 to 8 GiB).
    let guaranteed: u64 = bundle.vms().map(|v| v.guaranteed()).sum();
    let holdable = free
        .saturating_sub(watermarks.min)
        .saturating_mul(PAGE_SIZE);
    if guaranteed > holdable {
        println!(
            "memory manager: the VMs are guaranteed {} together, more than this board's pool can hold ({} above its min reserve): a VM whose guarantee does not fit is not started, and says so",
            report::Size(guaranteed),
            report::Size(holdable)
        );
    }
}

const PROMPT: &str = "tidal> ";

/// Draw the shell's line: the prompt and what is typed so far.
fn draw_shell_line(typed: &str) {
    let mut line = heapless::String::<{ PROMPT.len() + line::MAX_LINE }>::new();
    let _ = line.push_str(PROMPT);
    let _ = line.push_str(typed);
    crate::console::shell_line(Some(&line));
}

/// How long the idle shell sleeps between looks at the console when the
/// UART's receive interrupt wakes it (a kick does too): the memory
/// manager's tick also runs on the CPUs that run guests.
const SHELL_IDLE_US: u64 = 20_000;
/// Without that interrupt: the console is polled, about every millisecond.
const SHELL_POLL_US: u64 = 1_000;

/// Route the console UART's interrupt to this CPU and turn its receive
/// interrupt on: true if the idle shell can sleep until a byte arrives.
fn console_input_interrupt(board: &BoardInfo) -> bool {
    board
        .console
        .as_ref()
        .and_then(|uart| uart.intid)
        .is_some_and(aarch64::gic::route_spi_here)
        && crate::console::enable_rx_interrupt()
}

/// The shell's line editor. Only the shell's CPU uses it: from its idle
/// loop, or from the exits of the vCPU it runs ([`look_from_guest`]).
static SHELL: Mutex<Option<LineEditor>> = Mutex::new(None);

fn shell_loop(input_interrupt: bool) -> ! {
    // Woken by the UART rather than every millisecond: under QEMU each wake
    // of an idle CPU is a host thread switch taken from the CPUs that run
    // guests, and the mini UART's 8-byte FIFO fills in 0.7 ms at 115200.
    let idle_us = if input_interrupt {
        SHELL_IDLE_US
    } else {
        // Without a GIC the idle wait is a WFE: the event stream ends it.
        aarch64::enable_event_stream();
        SHELL_POLL_US
    };
    draw_shell_line("");
    loop {
        if shell_look(look_at_console).unwrap_or(true) {
            continue;
        }
        // A vCPU pinned to this CPU runs until it leaves; its exits call
        // `look_from_guest`.
        if run::run_assigned(run::SHELL_CPU) {
            continue;
        }
        // Sleep rather than spin: an idle shell must not steal cycles
        // (or, under QEMU, instruction counts) from the CPUs running
        // guests.
        let idle_us = if SNAPSHOT_JOB.lock().is_some() || !PENDING_RESTORES.lock().is_empty() {
            idle_us.min(STATS_LOOK_US)
        } else {
            idle_us
        };
        let idle_us = if crate::net::pinging() {
            idle_us.min(NET_LOOK_US)
        } else {
            idle_us
        };
        aarch64::idle_wait(idle_us);
        run::memory_tick();
        shell_look(check_stats_wait);
        shell_look(step_snapshot);
        shell_look(step_restores);
        shell_look(step_net);
    }
}

/// Run the shell's `look` in the shell's own failure domain
/// ([`run::run_service`]): a failure there abandons the command (one
/// `tidal: shell command failed: ...` line) and the shell goes on with a
/// fresh line; no VM is touched. `None` after a failure.
fn shell_look<R>(look: impl FnOnce() -> R) -> Option<R> {
    let result = run::run_service(Service::Shell, look);
    if result.is_none() {
        // The failed frames held these, and only this CPU takes them.
        if SHELL.is_locked() {
            // SAFETY: only the shell's CPU (this one) takes it, and the
            // failure abandoned the frame whose guard held it.
            unsafe { SHELL.force_unlock() };
        }
        if STATS_WAIT.is_locked() {
            // SAFETY: as above.
            unsafe { STATS_WAIT.force_unlock() };
        }
        *STATS_WAIT.lock() = None;
        if SNAPSHOT_JOB.is_locked() {
            // SAFETY: as above.
            unsafe { SNAPSHOT_JOB.force_unlock() };
        }
        // A snapshot abandoned half way leaves its VM paused: resume it.
        if let Some(job) = SNAPSHOT_JOB.lock().take() {
            run::with_vm(&job.vm, crate::vm::pause::resume);
        }
        // SAFETY: as above (only the shell's CPU takes the network's lock).
        unsafe { crate::net::recover() };
        if let Some(editor) = SHELL.lock().as_mut() {
            *editor = LineEditor::new();
        }
        crate::console::shell_line(None);
        draw_shell_line("");
    }
    result
}

/// The shell's look at the console from the exits of a vCPU on its CPU:
/// everything that has arrived (the UART's interrupt stays asserted until
/// its FIFO is empty), and a `balloon-stats <vm> now` that waits. Returns
/// when it wants to look again without input (microseconds): soon while
/// that waits, else at the memory manager's next tick.
fn look_from_guest() -> u64 {
    shell_look(check_stats_wait);
    shell_look(step_snapshot);
    shell_look(step_restores);
    let pinging = shell_look(step_net).unwrap_or(false);
    for _ in 0..16 {
        if !shell_look(look_at_console).unwrap_or(true) {
            break;
        }
    }
    if STATS_WAIT.lock().is_some()
        || SNAPSHOT_JOB.lock().is_some()
        || !PENDING_RESTORES.lock().is_empty()
    {
        STATS_LOOK_US
    } else if pinging {
        NET_LOOK_US
    } else {
        run::TICK_US
    }
}

/// How often the shell looks at the network while a `ping` runs (else:
/// at each of its idle wakes, every 20 ms at most on the idle shell).
const NET_LOOK_US: u64 = 1_000;

/// One look at the board's network ([`crate::net::poll`]); true while a
/// `ping` runs.
fn step_net() -> bool {
    let mut text = alloc::string::String::new();
    let pinging = crate::net::poll(&mut text);
    if !text.is_empty() {
        crate::console::shell_line(None);
        print!("{text}");
        draw_shell_line("");
    }
    pinging
}

/// How often a `balloon-stats <vm> now` waiting from a vCPU's exits looks
/// for the answer.
const STATS_LOOK_US: u64 = 20_000;

/// Read what has arrived at the console, taken in one go (bytes for a VM
/// then reach it under one lock), and act on it; false if nothing had.
fn look_at_console() -> bool {
    let Some(board) = BOARD.get() else {
        return false;
    };
    let mut typed = [0u8; INPUT_BATCH];
    let n = (0..INPUT_BATCH)
        .map_while(|_| crate::console::try_read_byte())
        .zip(typed.iter_mut())
        .map(|(byte, slot)| *slot = byte)
        .count();
    if n == 0 {
        return false;
    }
    let mut guard = SHELL.lock();
    let Some(editor) = guard.as_mut() else {
        return false;
    };
    let mut rest = &typed[..n];
    while let Some((&byte, after)) = rest.split_first() {
        if run::input_to_focus_active() {
            // Up to a Ctrl-], which gives the keyboard back to the shell.
            let end = rest.iter().position(|&b| b == 0x1d).unwrap_or(rest.len());
            if end > 0 && run::input_to_focus(&rest[..end]) {
                rest = &rest[end..];
                continue;
            }
            if byte == 0x1d {
                run::unfocus();
                println!("[back to the shell]");
                draw_shell_line("");
                rest = after;
                continue;
            }
        }
        rest = after;
        shell_byte(editor, byte, board);
    }
    true
}

/// Bytes read from the console at most at once (the PL011's FIFO holds 16
/// or 32, the mini UART's 8; more may arrive while they are read).
const INPUT_BATCH: usize = 64;

/// One byte typed at the shell (no VM has the keyboard).
fn shell_byte(editor: &mut LineEditor, byte: u8, board: &BoardInfo) {
    match editor.feed(byte) {
        Event::None => {}
        Event::Echo(bytes) => {
            if bytes == b"\x07" {
                crate::console::bell();
            }
            draw_shell_line(editor.text());
        }
        Event::Line(line) => {
            crate::console::shell_line(None);
            defmt::debug!("shell: {=str}", line);
            match shell::parse(line) {
                Ok(Some(cmd)) => run(cmd, board),
                Ok(None) => {}
                Err(e) => println!("{e}"),
            }
            // `console <vm>` gave the keyboard away: no prompt until
            // Ctrl-] brings it back.
            if !run::input_to_focus_active() {
                draw_shell_line("");
            }
        }
    }
}

/// Run a command ([`commands::run`]) over this board, print its answer,
/// then do what it leaves to the hypervisor: wait, power off, fault.
fn run(cmd: Command, board: &BoardInfo) {
    let mut text = alloc::string::String::new();
    let then = commands::run(cmd, &mut ShellBoard { info: board }, &mut text);
    print!("{text}");
    match then {
        Then::Prompt => {}
        Then::AwaitStop(name) => await_stop(&name, board),
        Then::AwaitStats { vm, asked } => await_stats(vm, asked),
        Then::PowerOff => power_off(Some(board)),
        // Outside any recovery point: they show the crash report of a
        // failure nothing contains (as at boot).
        Then::DebugFault => aarch64::recovery::unarmed(debug_fault),
        Then::DebugPanic => aarch64::recovery::unarmed(|| -> () {
            panic!("deliberate panic from the shell's 'debug panic'")
        }),
        // In the shell's own failure domain: the command is abandoned.
        Then::FailShell => panic!("injected failure ('debug fail-board shell')"),
        Then::Snapshot { vm, name, hint } => begin_snapshot(board, &vm, name.as_deref(), hint),
        Then::RestoreLater(later) => restore_later(later),
        Then::Net => {
            let mut text = alloc::string::String::new();
            crate::net::write_status(&mut text);
            print!("{text}");
        }
        Then::Ping { to, count } => {
            let mut text = alloc::string::String::new();
            crate::net::begin_ping(to, count, &mut text);
            print!("{text}");
        }
    }
}

/// The board the shell's commands act on: `run`'s VMs, frame table,
/// memory manager and services, and this board's description.
struct ShellBoard<'a> {
    info: &'a BoardInfo,
}

impl commands::Board for ShellBoard<'_> {
    type Cpu = run::TargetCpu;

    fn with_vm<R>(
        &mut self,
        name: &str,
        f: impl FnOnce(&mut run::Vm, &mut run::TargetCpu) -> R,
    ) -> Option<R> {
        run::with_vm(name, |vm| f(vm, &mut run::TargetCpu::new()))
    }

    fn for_each_vm(&mut self, f: impl FnMut(&mut run::Vm)) {
        run::for_each(f)
    }

    fn with_frames<R>(&mut self, f: impl FnOnce(&FrameTable<'_>) -> R) -> R {
        f(&run::frames())
    }

    fn manager(&mut self) -> Option<ManagerFacts> {
        run::manager_facts()
    }

    fn set_policy(&mut self, policy: Policy) -> bool {
        run::with_manager(|mm| mm.manager.set_policy(policy)).is_some()
    }

    fn service_off(&self, service: Service) -> Option<heapless::String<{ REASON_BYTES }>> {
        run::service_off(service)
    }

    fn ram_bytes(&self) -> u64 {
        self.info.ram.iter().map(|r| r.size()).sum()
    }

    fn now_us(&self) -> u64 {
        aarch64::uptime_us()
    }

    fn counts_instructions(&self) -> bool {
        aarch64::pmu::counts_instructions()
    }

    fn check(&mut self, out: &mut alloc::string::String) {
        run::check_system(self.ram_bytes(), out);
    }

    fn write_memory_map(&self, out: &mut alloc::string::String) {
        let _ = report::write_memory_map(out, self.info);
    }

    fn write_cpus(&self, out: &mut alloc::string::String) {
        let rows = (0..MAX_CPUS).filter_map(|i| {
            let mpidr = smp::cpu_mpidr(i)?;
            let method = self
                .info
                .cpus
                .iter()
                .find(|c| c.mpidr == mpidr)
                .map_or(platform::EnableMethod::None, |c| c.enable_method);
            Some((i, mpidr, method, smp::state(i).label()))
        });
        let _ = report::write_cpus(out, rows);
        if aarch64::gic::present() {
            let _ = writeln!(out, "interrupts taken while a guest ran (kick, GIC maintenance, EL2 timer, guest timer, other):");
            for cpu in (1..MAX_CPUS).filter(|&c| smp::cpu_mpidr(c).is_some()) {
                let [kick, maint, timer, vtimer, other] = run::interrupts_taken(cpu);
                let _ = writeln!(out, "  cpu{cpu}: {kick} {maint} {timer} {vtimer} {other}");
            }
        }
    }

    fn focus(&mut self, name: &str) -> bool {
        run::focus(name)
    }

    fn inject(&mut self, into: InjectInto) {
        run::inject_service_failure(into);
    }

    fn hog(&mut self, pages: Option<u64>) -> (u64, u64) {
        (crate::hog::hog(pages), crate::hog::held())
    }

    fn unhog(&mut self) -> u64 {
        crate::hog::unhog()
    }

    fn with_disk<R>(&mut self, f: impl FnOnce(&mut dyn Disk) -> R) -> Option<R> {
        crate::disk::with_disk(|d| f(d))
    }

    fn with_vm_and_disk<R>(
        &mut self,
        name: &str,
        f: impl FnOnce(&mut run::Vm, &mut run::TargetCpu, Option<&mut dyn Disk>) -> R,
    ) -> Option<R> {
        // Seconds of disk work under the VM's lock: the manager's rounds
        // leave the VM out meanwhile.
        run::with_vm_held_long(name, |vm| {
            let mut cpu = run::TargetCpu::new();
            crate::disk::with_disk_or_none(|d| f(vm, &mut cpu, d.map(|d| d as &mut dyn Disk)))
        })
    }

    fn snapshot_board(&self) -> crate::vm::snapshot::BoardId {
        let gic = match self.info.gic.as_ref().map(|g| g.version) {
            Some(platform::GicVersion::V2) if aarch64::gic::present() => 2,
            Some(platform::GicVersion::V3) if aarch64::gic::present() => 3,
            _ => 0,
        };
        crate::vm::snapshot::BoardId {
            tag: crate::vm::snapshot::board_tag(&self.info.compatible, gic),
            midr: aarch64::midr(),
            counter_hz: aarch64::counter().1,
            // QEMU's `virt` (see `BoardId::counter_may_lead`).
            counter_may_lead: self.info.compatible.as_str() != "linux,dummy-virt",
        }
    }

    fn counter_now(&self) -> u64 {
        aarch64::counter().0
    }
}

/// Read from an address no map covers, to show the crash report.
#[inline(never)]
fn debug_fault() {
    println!("Reading from an unmapped address to take a data abort...");
    let bad = crate::mm::pagetable::VA_LIMIT as usize + 0x1234_5678;
    // SAFETY: deliberately unsound in effect: the access faults before it
    // returns and the exception handler parks the CPU.
    let v = unsafe { core::ptr::read_volatile(bad as *const u64) };
    println!("unexpectedly read {v:#x}");
}

/// `stop`'s wait: up to a second for the VM's CPU to stop it.
fn await_stop(name: &str, board: &BoardInfo) {
    if run::shell_cpu_runs_guest() {
        // The VM may run on this CPU, which goes back to it only once the
        // shell returns: it stops then, and its own line says so.
        return;
    }
    let (start, freq) = aarch64::counter();
    while aarch64::counter().0 - start < freq {
        if commands::stopped(&mut ShellBoard { info: board }, name) {
            return;
        }
        core::hint::spin_loop();
    }
    let mut text = alloc::string::String::new();
    commands::write_not_stopped(&mut text, name);
    print!("{text}");
}

/// `balloon-stats <vm> now`'s wait for the guest's sample (up to 2 s).
/// While a vCPU shares the shell's CPU the shell does not wait (that guest
/// could not answer meanwhile, nor run): the answer is shown when it comes
/// ([`check_stats_wait`]), and the prompt comes back at once.
fn await_stats(vm: heapless::String<32>, asked: u64) {
    let shared = run::shell_cpu_runs_guest();
    if shared {
        println!(
            "{vm}: statistics asked for; shown when the guest answers (a vCPU shares the shell's CPU)"
        );
    }
    *STATS_WAIT.lock() = Some(StatsWait { vm, asked });
    if shared {
        return;
    }
    while STATS_WAIT.lock().is_some() {
        aarch64::idle_wait(10_000);
        check_stats_wait();
    }
}

/// A `balloon-stats <vm> now` waiting for the guest's sample.
struct StatsWait {
    vm: heapless::String<32>,
    /// When it was asked for (uptime, microseconds).
    asked: u64,
}

static STATS_WAIT: Mutex<Option<StatsWait>> = Mutex::new(None);

/// The snapshot being taken, driven from the shell's looks
/// ([`step_snapshot`]).
static SNAPSHOT_JOB: Mutex<Option<snapshot_cmds::SnapshotJob>> = Mutex::new(None);

/// `snapshot <vm> [name]`: begin the job unless one is being taken.
fn begin_snapshot(board: &BoardInfo, vm: &str, name: Option<&str>, hint: bool) {
    let mut job = SNAPSHOT_JOB.lock();
    if let Some(busy) = job.as_ref() {
        println!(
            "snapshot: {} of {} is being taken; wait for it to end",
            busy.name, busy.vm
        );
        return;
    }
    let mut text = alloc::string::String::new();
    *job = snapshot_cmds::begin(&mut ShellBoard { info: board }, &mut text, vm, name, hint);
    drop(job);
    print!("{text}");
}

/// Restores waiting for the board's clock to pass their guest's.
static PENDING_RESTORES: Mutex<heapless::Vec<snapshot_cmds::PendingRestore, MAX_GUESTS>> =
    Mutex::new(heapless::Vec::new());

/// Keep a restore for later (one per VM: a later one replaces it).
fn restore_later(later: snapshot_cmds::PendingRestore) {
    let mut pending = PENDING_RESTORES.lock();
    pending.retain(|p| p.vm != later.vm);
    if pending.push(later).is_err() {
        println!("restore: too many restores waiting; try again later");
    }
}

/// Do the restores whose time has come.
fn step_restores() {
    let Some(board) = BOARD.get() else {
        return;
    };
    let now = aarch64::uptime_us();
    let due = {
        let mut pending = PENDING_RESTORES.lock();
        let i = pending.iter().position(|p| p.due_us <= now);
        i.map(|i| pending.swap_remove(i))
    };
    let Some(due) = due else {
        return;
    };
    let mut text = alloc::string::String::new();
    let again = snapshot_cmds::restore(
        &mut ShellBoard { info: board },
        &mut text,
        &due.name,
        Some(&due.vm),
    );
    if let Some(again) = again {
        restore_later(again);
    }
    crate::console::shell_line(None);
    print!("{text}");
    draw_shell_line("");
}

/// One look at the snapshot being taken, if one is.
fn step_snapshot() {
    let Some(board) = BOARD.get() else {
        return;
    };
    let mut job = SNAPSHOT_JOB.lock();
    let Some(current) = job.as_mut() else {
        return;
    };
    let mut text = alloc::string::String::new();
    if snapshot_cmds::step(&mut ShellBoard { info: board }, &mut text, current) {
        *job = None;
    }
    drop(job);
    if !text.is_empty() {
        crate::console::shell_line(None);
        print!("{text}");
        draw_shell_line("");
    }
}

/// Show the sample a `balloon-stats <vm> now` waits for once it came, or
/// say that it did not within 2 s.
fn check_stats_wait() {
    let Some(board) = BOARD.get() else {
        return;
    };
    let mut wait = STATS_WAIT.lock();
    let Some(StatsWait { vm, asked }) = wait.as_ref() else {
        return;
    };
    let mut text = alloc::string::String::new();
    if commands::stats_arrived(&mut ShellBoard { info: board }, &mut text, vm, *asked) {
        *wait = None;
    }
    drop(wait);
    print!("{text}");
}

/// Drive the GIC's virtualization interface when the host has one we
/// support (GICv2 with GICH and GICV); guests then get a virtual GIC.
fn init_gic(board: &BoardInfo) {
    let Some(gic) = board.gic.as_ref() else {
        return;
    };
    match (
        gic.version,
        gic.cpu_interface,
        gic.hyp_interface,
        gic.virtual_cpu_interface,
    ) {
        (platform::GicVersion::V2, Some(gicc), Some(gich), Some(gicv)) => {
            aarch64::gic::init_distributor(gic.distributor.start, gicc.start, gich.start);
            aarch64::gic::init_cpu(0);
            run::set_gicv(PhysAddr::new(gicv.start));
            println!(
                "virtual GIC: GICv2 with {} list registers",
                aarch64::gic::list_registers()
            );
        }
        (platform::GicVersion::V3, _, _, _) if gic.redistributors.is_some() => {
            let gicr = gic.redistributors.unwrap_or(gic.distributor);
            aarch64::gic::init_v3(gic.distributor.start, gicr.start, gicr.end - gicr.start);
            if !aarch64::gic::init_cpu(0) {
                println!("virtual GIC: no GICv3 redistributor matches the boot CPU: guests run without interrupts");
                return;
            }
            run::set_gic_v3();
            println!(
                "virtual GIC: GICv3 with {} list registers",
                aarch64::gic::list_registers()
            );
        }
        _ => println!(
            "virtual GIC: this host's GIC has no virtualization interface we drive: guests run without interrupts"
        ),
    }
}
