//! The virtio console inside a VM: found where the device tree says, its
//! register accesses as trapped exits, typed input to the PL011 until the
//! driver is ready and to the receive queue after, output as console lines,
//! its interrupt line, and a bad chain that resets the device and gives the
//! input back to the PL011.

use super::super::bus;
use super::*;
use crate::virtio_console;

/// Slot 1's registers.
const BASE: GuestAddr =
    GuestAddr::new(layout::VIRTIO_BASE.raw() + layout::VIRTIO_STRIDE * layout::CONSOLE_SLOT as u64);

fn with_console(devices: u64) -> (Vm, FakeCpu) {
    let memory = VmMemory {
        prealloc: true,
        ..VmMemory::default()
    };
    let spec = spec_devices(1, 0, memory, VM_RAM, devices);
    let mut vm = Vm::new(0, spec, GuestGic::V3);
    let mut cpu = FakeCpu::new(BOARD_PAGES);
    lifecycle::start(&mut vm, &mut cpu).expect("starts");
    (vm, cpu)
}

fn reg_write(vm: &mut Vm, cpu: &mut FakeCpu, ctx: &mut GuestContext, off: u64, value: u32) {
    slot_write(vm, cpu, ctx, BASE + off, value);
}

fn reg_read(vm: &mut Vm, cpu: &mut FakeCpu, ctx: &mut GuestContext, off: u64) -> u32 {
    slot_read(vm, cpu, ctx, BASE + off)
}

/// Linux's virtio_console probing the device (no features but VERSION_1),
/// its two queues at `rings`, then DRIVER_OK.
fn probe(vm: &mut Vm, cpu: &mut FakeCpu, ctx: &mut GuestContext, rings: u64) -> [DriverQueue; 2] {
    let queues = [
        DriverQueue::new(8, rings, rings + 0x1000, rings + 0x2000),
        DriverQueue::new(8, rings + 0x4000, rings + 0x5000, rings + 0x6000),
    ];
    probe_at(
        vm,
        cpu,
        ctx,
        BASE,
        virtio_console::DEVICE_ID,
        &[&queues[0], &queues[1]],
    );
    queues
}

/// Guest RAM as the test reads it back.
fn peek(vm: &mut Vm, cpu: &mut FakeCpu, ipa: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    vm.memory
        .ram
        .as_mut()
        .expect("RAM")
        .read(&mut cpu.host, GuestAddr::new(ipa), &mut buf)
        .expect("in RAM");
    buf
}

fn used(vm: &mut Vm, cpu: &mut FakeCpu, q: &mut DriverQueue) -> Vec<(u32, u32)> {
    let ram = vm.memory.ram.as_mut().expect("RAM");
    let mut view = super::super::device_memory::DeviceView {
        ram,
        mem: &mut cpu.host,
        now_us: 0,
    };
    q.take_used(&mut view)
}

#[test]
fn the_device_tree_describes_the_console_in_slot_one() {
    let (mut vm, mut cpu) = with_console(guest_bundle::devices::CONSOLE);
    let dtb_ipa = layout::RAM_BASE.raw();
    let dtb = peek(&mut vm, &mut cpu, dtb_ipa, 0x2000);
    let has = |name: &[u8]| dtb.windows(name.len()).any(|w| w == name);
    assert_eq!(dtb[..4], [0xd0, 0x0d, 0xfe, 0xed], "a device tree");
    // No balloon: the console's slot alone, never a slot nobody emulates.
    assert!(has(b"virtio_mmio@a000200\0"));
    assert!(!has(b"virtio_mmio@a000000\0"));
    assert!(bus::route(&vm, layout::VIRTIO_BASE).is_none());
    assert_eq!(
        bus::route(&vm, BASE + 0x70),
        Some(bus::Window::VirtioConsole(0x70))
    );
    // A VM without it: slot 1 is no device.
    let (vm, _) = with_console(guest_bundle::devices::BALLOON);
    assert!(bus::route(&vm, BASE).is_none());
}

#[test]
fn input_reaches_the_pl011_until_the_driver_is_ready_then_the_receive_queue() {
    let both = guest_bundle::devices::BALLOON | guest_bundle::devices::CONSOLE;
    let (mut vm, mut cpu) = with_console(both);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    // Before the driver: the PL011 takes typed bytes, as at boot.
    assert_eq!(irq::console_input_bytes(&mut vm, &mut cpu, b"a"), 1);
    assert_eq!(vm.devices.uart.rx_len(), 1);
    assert!(!irq::vconsole_takes_input(&vm));

    let rings = layout::RAM_BASE.raw() + VM_RAM - 0x10_0000;
    let [mut rx, mut tx] = probe(&mut vm, &mut cpu, &mut ctx, rings);
    assert!(irq::vconsole_takes_input(&vm));
    // Typed before any receive buffer: it waits, nothing is lost.
    assert_eq!(
        irq::console_input_bytes(&mut vm, &mut cpu, b"run 1 true\r"),
        11
    );
    assert_eq!(vm.console.input.len(), 11);
    assert_eq!(vm.devices.uart.rx_len(), 1, "the PL011 gets no more");
    // The driver posts two 8-byte buffers and notifies: they fill at once.
    let bufs = rings + 0x8000;
    {
        let mut stores = GuestStores {
            vm: &mut vm,
            cpu: &mut cpu,
        };
        rx.add(&mut stores, &[(bufs, 8, true)]);
        rx.add(&mut stores, &[(bufs + 8, 8, true)]);
    }
    reg_write(&mut vm, &mut cpu, &mut ctx, mmio::QUEUE_NOTIFY, 0);
    assert_eq!(used(&mut vm, &mut cpu, &mut rx), [(0, 8), (1, 3)]);
    assert_eq!(peek(&mut vm, &mut cpu, bufs, 11), b"run 1 true\r");
    assert!(vm.console.input.is_empty());
    let vgic = vm.devices.vgic.as_ref().expect("vGIC");
    assert!(
        vgic.is_pending(0, irq::VCONSOLE_INTID),
        "used-buffer interrupt"
    );
    // The guest acknowledges: the line drops.
    assert_eq!(
        reg_read(&mut vm, &mut cpu, &mut ctx, mmio::INTERRUPT_STATUS),
        mmio::INT_USED_BUFFER
    );
    reg_write(
        &mut vm,
        &mut cpu,
        &mut ctx,
        mmio::INTERRUPT_ACK,
        mmio::INT_USED_BUFFER,
    );
    assert!(!vm.devices.vconsole.as_ref().unwrap().interrupt_pending());

    // Output: one notify for a whole line, shown as the VM's line.
    let text = b"tidal-guest: done 1 rc=0\n";
    let out = rings + 0x9000;
    {
        let mut stores = GuestStores {
            vm: &mut vm,
            cpu: &mut cpu,
        };
        stores.poke(out, text);
        tx.add(&mut stores, &[(out, 12, false), (out + 12, 13, false)]);
    }
    let _ = lines(&mut vm);
    let exits_before = vm.counters.profile.get(ExitKind::VirtioNotify).count;
    reg_write(&mut vm, &mut cpu, &mut ctx, mmio::QUEUE_NOTIFY, 1);
    assert_eq!(
        vm.counters.profile.get(ExitKind::VirtioNotify).count,
        exits_before + 1
    );
    assert_eq!(used(&mut vm, &mut cpu, &mut tx), [(0, 0)]);
    assert_eq!(lines(&mut vm), ["[guest] tidal-guest: done 1 rc=0"]);
    let stats = *vm.devices.vconsole.as_ref().unwrap().device().stats();
    assert_eq!((stats.bytes_out, stats.chains_out), (25, 1));
    assert_eq!((stats.bytes_in, stats.buffers_in), (11, 2));
    assert_check(&vm, &mut cpu);
}

#[test]
fn a_bad_transmit_chain_resets_the_console_and_input_goes_back_to_the_pl011() {
    let (mut vm, mut cpu) = with_console(guest_bundle::devices::CONSOLE);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    let rings = layout::RAM_BASE.raw() + VM_RAM - 0x10_0000;
    let [_rx, mut tx] = probe(&mut vm, &mut cpu, &mut ctx, rings);
    let _ = lines(&mut vm);
    // A device-writable buffer on the transmit queue, and one pointing
    // past the VM's RAM behind it.
    {
        let mut stores = GuestStores {
            vm: &mut vm,
            cpu: &mut cpu,
        };
        tx.add(&mut stores, &[(rings + 0x9000, 16, true)]);
        tx.add(&mut stores, &[(0x4000_0000_0000, 16, false)]);
    }
    reg_write(&mut vm, &mut cpu, &mut ctx, mmio::QUEUE_NOTIFY, 1);
    let status = reg_read(&mut vm, &mut cpu, &mut ctx, mmio::STATUS);
    assert_ne!(status & mmio::STATUS_DEVICE_NEEDS_RESET, 0);
    // Its head comes back, so a driver spinning on it is not stuck.
    assert_eq!(used(&mut vm, &mut cpu, &mut tx), [(0, 0)]);
    let said = lines(&mut vm);
    assert!(
        said.iter().any(|l| l.starts_with("tidal: [guest] console: virtio-console needs reset: transmitq: descriptor 0 is device-writable")),
        "{said:?}"
    );
    assert_eq!(vm.state, VmState::Running);
    // Until the driver resets it, typed input goes to the PL011.
    assert!(!irq::vconsole_takes_input(&vm));
    irq::console_input_bytes(&mut vm, &mut cpu, b"x");
    assert_eq!(vm.devices.uart.rx_len(), 1);
    assert_check(&vm, &mut cpu);
}

/// A transmit pass is bounded (issue 36): chains past its byte bound wait
/// for the next notify or the memory tick (`irq::flush_vconsole`), which
/// takes them without the guest notifying again.
#[test]
fn transmit_past_a_pass_bound_goes_out_at_the_tick() {
    let (mut vm, mut cpu) = with_console(guest_bundle::devices::CONSOLE);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    let rings = layout::RAM_BASE.raw() + VM_RAM - 0x10_0000;
    let [_rx, mut tx] = probe(&mut vm, &mut cpu, &mut ctx, rings);
    let chain = 16 * 1024u32;
    let out = rings + 0x10000;
    {
        let mut stores = GuestStores {
            vm: &mut vm,
            cpu: &mut cpu,
        };
        stores.poke(out, &vec![b'y'; chain as usize]);
        for _ in 0..6 {
            tx.add(&mut stores, &[(out, chain, false)]);
        }
    }
    reg_write(&mut vm, &mut cpu, &mut ctx, mmio::QUEUE_NOTIFY, 1);
    let per_pass = (virtio_console::TX_BYTES_PER_PASS / u64::from(chain)) as u32;
    assert_eq!(used(&mut vm, &mut cpu, &mut tx).len(), per_pass as usize);
    assert!(vm.devices.vconsole.as_ref().unwrap().device().has_more());
    irq::flush_vconsole(&mut vm, &mut cpu);
    assert_eq!(
        used(&mut vm, &mut cpu, &mut tx).len(),
        6 - per_pass as usize
    );
    let console = vm.devices.vconsole.as_ref().unwrap();
    assert!(!console.device().has_more());
    assert_eq!(console.device().stats().chains_out, 6);
    assert_eq!(console.device().stats().passes_cut, 1);
    assert!(
        console.interrupt_pending(),
        "the tick signals what it returned"
    );
    // 96 lines of 1024 'y': more than the outbox keeps, dropped and counted.
    let _ = vm.console.out.take();
    assert_check(&vm, &mut cpu);
}
