//! A VM paused, saved into a snapshot and restored into another VM of the
//! same configuration (`vm::pause`, `vm::snapshot`), over the fake CPU.

use super::super::pause;
use super::super::snapshot::{self, BoardId, SnapError};
use super::super::vcpu_state::{Running, VcpuState};
use super::*;
use crate::hw::context::{El1State, VirtualInterface};
use crate::snapshot::format::{FormatError, Totals};

const BOARD: BoardId = BoardId {
    tag: 0x1234_5603,
    midr: 0x410f_d083,
    counter_hz: 62_500_000,
    counter_may_lead: true,
};

/// A running VM with its balloon driver live, 16 pages inflated, a page
/// of data written, and vCPU 0 paused with its state saved.
fn paused_vm() -> (Vm, FakeCpu, GuestContext) {
    let (mut vm, mut cpu) = started(1);
    let mut ctx = enter(&mut vm, &mut cpu, 0);
    let rings = layout::RAM_BASE.raw() + VM_RAM - 0x10_0000;
    let (mut inflate, _) = driver_live(&mut vm, &mut cpu, &mut ctx, rings);
    balloon_ctl::set_target(&mut vm, &mut cpu, 16).expect("target set");
    queue_16_pages(&mut vm, &mut cpu, &mut inflate, rings);
    virtio_write(&mut vm, &mut cpu, &mut ctx, mmio::QUEUE_NOTIFY, 0);
    let data: Vec<u8> = (0..PAGE_SIZE as u32 * 3).map(|i| (i % 251) as u8).collect();
    let ram = vm.memory.ram.as_mut().expect("RAM");
    ram.write(&mut cpu.host, layout::RAM_BASE + (5 << 20), &data)
        .expect("written");
    ctx.x[7] = 0x7777;
    ctx.elr = 0x4020_0040;
    pause::request_pause(&mut vm, &mut cpu).expect("pauses");
    assert!(
        !pause::paused(&vm),
        "vCPU 0 is inside and has not saved yet"
    );
    pause::captured(
        &mut vm,
        0,
        VcpuState {
            power: Power::On,
            running: Some(Running {
                ctx: ctx.clone(),
                el1: El1State {
                    ttbr1: 0x4123_4000,
                    ..El1State::reset()
                },
                vif: VirtualInterface {
                    count: 4,
                    ..VirtualInterface::default()
                },
                listed: [None; crate::limits::MAX_LRS],
            }),
        },
    );
    assert!(pause::paused(&vm));
    (vm, cpu, ctx)
}

fn save(vm: &mut Vm, cpu: &mut FakeCpu) -> (Vec<u8>, snapshot::SaveReport) {
    let (bytes, report) = snapshot::save(vm, cpu, BOARD, 1_000_000_000, Vec::new()).expect("saved");
    (bytes, report)
}

fn every_page(vm: &mut Vm, cpu: &mut FakeCpu) -> Vec<Option<Vec<u8>>> {
    let ram = vm.memory.ram.as_mut().expect("RAM");
    (0..ram.pages())
        .map(|n| {
            let mut page = vec![0u8; PAGE_SIZE as usize];
            ram.read_mapped(&mut cpu.host, layout::RAM_BASE + n * PAGE_SIZE, &mut page)
                .ok()
                .map(|()| page)
        })
        .collect()
}

#[test]
fn a_saved_vm_restores_into_a_twin_with_its_registers_devices_and_memory() {
    let (mut vm, mut cpu, ctx) = paused_vm();
    let (bytes, report) = save(&mut vm, &mut cpu);
    pause::resume(&mut vm);
    assert!(!vm.pause_requested());
    let pages = VM_RAM / PAGE_SIZE;
    assert_eq!(report.totals.pages(), pages);
    assert_eq!(report.ballooned, 16, "the inflated pages are not written");
    assert!(report.totals.data >= 3, "{report:?}");
    assert_eq!(
        report.totals.not_backed,
        report.ballooned + report.hinted + report.other_unbacked
    );
    let data_bytes = report.totals.data * PAGE_SIZE;
    assert!(
        (bytes.len() as u64) < data_bytes + 64 * 1024,
        "only data pages take room: {} bytes for {data_bytes}",
        bytes.len()
    );

    let mut twin = Vm::new(0, vm.spec, GuestGic::V3);
    let mut twin_cpu = FakeCpu::new(BOARD_PAGES);
    let restored = snapshot::restore(&mut twin, &mut twin_cpu, BOARD, 5_000_000_000, &bytes[..])
        .expect("restores");
    assert_eq!(restored.totals, report.totals);
    assert_eq!(twin.state(), VmState::Running);
    // Its clock goes on from where the snapshot left it.
    assert_eq!(twin.counter_offset(), 5_000_000_000 - 1_000_000_000);
    assert_eq!(devices_state(&twin), devices_state(&vm));
    // Memory: the same pages hold the same bytes; pages without a frame
    // (ballooned) have none; zero pages need none (the fill is zero).
    let a = every_page(&mut vm, &mut cpu);
    let b = every_page(&mut twin, &mut twin_cpu);
    for (n, (a, b)) in a.iter().zip(&b).enumerate() {
        match (a, b) {
            (Some(a), Some(b)) => assert_eq!(a, b, "page {n}"),
            (Some(a), None) => assert!(a.iter().all(|&x| x == 0), "page {n} lost its data"),
            (None, None) => {}
            (None, Some(_)) => panic!("page {n} is backed in the twin only"),
        }
    }
    assert_check(&twin, &mut twin_cpu);
    // vCPU 0 enters where it was paused, with its registers.
    let back = lifecycle::take_restored(&mut twin, 0).expect("vCPU 0's registers");
    assert_eq!(back.ctx.x[7], 0x7777);
    assert_eq!(back.ctx.elr, ctx.elr);
    assert_eq!(back.el1.ttbr1, 0x4123_4000);
}

#[test]
fn a_damaged_snapshot_starts_nothing_and_gives_every_frame_back() {
    let (mut vm, mut cpu, _) = paused_vm();
    let (bytes, _) = save(&mut vm, &mut cpu);
    // A byte in the last data chunk, then one in each part before it.
    for at in [bytes.len() - 100, 70, 200, bytes.len() / 2] {
        let mut bad = bytes.clone();
        bad[at] ^= 0x40;
        let mut twin = Vm::new(0, vm.spec, GuestGic::V3);
        let mut twin_cpu = FakeCpu::new(BOARD_PAGES);
        let free = twin_cpu.host.frames.free_pages();
        let e =
            snapshot::restore(&mut twin, &mut twin_cpu, BOARD, 0, &bad[..]).expect_err("refused");
        assert_eq!(twin.state(), VmState::Stopped, "byte {at}: {e}");
        assert_eq!(twin_cpu.host.frames.guest_pages(0), 0, "byte {at}");
        assert_eq!(twin_cpu.host.frames.free_pages(), free, "byte {at}");
        assert!(twin.ram().is_none());
    }
}

#[test]
fn a_snapshot_of_another_board_gic_or_configuration_is_refused() {
    let (mut vm, mut cpu, _) = paused_vm();
    let (bytes, _) = save(&mut vm, &mut cpu);
    let refused = |twin: &mut Vm, board: BoardId| {
        let mut twin_cpu = FakeCpu::new(BOARD_PAGES);
        let e = snapshot::restore(twin, &mut twin_cpu, board, 0, &bytes[..]).expect_err("refused");
        assert_eq!(twin.state(), VmState::Stopped);
        format!("{e}")
    };
    let mut twin = Vm::new(0, vm.spec, GuestGic::V3);
    let other = BoardId {
        tag: 0x9999_0003,
        ..BOARD
    };
    assert!(refused(&mut twin, other).contains("another board"));
    let cpu_model = BoardId {
        midr: 0x410f_d034,
        ..BOARD
    };
    assert!(refused(&mut twin, cpu_model).contains("another CPU"));
    let v2 = GuestGic::V2 {
        gicv: PhysAddr::new(0x0801_0000),
    };
    assert!(refused(&mut Vm::new(0, vm.spec, v2), BOARD).contains("GICv3"));
    let bigger = spec_sized(1, 0, VmMemory::default(), VM_RAM * 2);
    assert!(refused(&mut Vm::new(0, bigger, GuestGic::V3), BOARD).contains("differs"));
    // A running VM is not overwritten.
    let (mut running, mut running_cpu) = started(1);
    let e = snapshot::restore(&mut running, &mut running_cpu, BOARD, 0, &bytes[..])
        .expect_err("refused");
    assert!(format!("{e}").contains("already running"), "{e}");
    // Not a snapshot at all.
    let e = snapshot::restore(
        &mut twin,
        &mut FakeCpu::new(BOARD_PAGES),
        BOARD,
        0,
        &[0u8; 64][..],
    )
    .expect_err("refused");
    assert!(
        matches!(e, SnapError::Format(FormatError::NotASnapshot)),
        "{e}"
    );
    let _ = Totals::default();
}

#[test]
fn a_vm_is_saved_only_while_every_vcpu_inside_has_paused() {
    let (mut vm, mut cpu) = started(1);
    let _ctx = enter(&mut vm, &mut cpu, 0);
    assert!(snapshot::save(&mut vm, &mut cpu, BOARD, 0, Vec::new()).is_err());
    pause::request_pause(&mut vm, &mut cpu).expect("pauses");
    assert_eq!(
        pause::request_pause(&mut vm, &mut cpu),
        Err("a snapshot of it is already being taken")
    );
    assert!(pause::pause_due(&vm, 0));
    assert!(snapshot::save(&mut vm, &mut cpu, BOARD, 0, Vec::new()).is_err());
    pause::resume(&mut vm);
    assert!(!pause::pause_due(&vm, 0));
}

#[test]
fn a_board_whose_counter_may_not_lead_waits_until_its_clock_passes_the_guests() {
    let (mut vm, mut cpu, _) = paused_vm();
    // Taken at a guest clock of 1e9 ticks (16 s at 62.5 MHz).
    let (bytes, _) = save(&mut vm, &mut cpu);
    let qemu = BoardId {
        counter_may_lead: false,
        ..BOARD
    };
    let mut twin = Vm::new(0, vm.spec, GuestGic::V3);
    let e = snapshot::restore(
        &mut twin,
        &mut FakeCpu::new(BOARD_PAGES),
        qemu,
        500_000_000,
        &bytes[..],
    )
    .expect_err("refused while the board's clock is behind");
    assert!(matches!(e, SnapError::ClockBehind { wait_s: 9, .. }), "{e}");
    assert_eq!(twin.state(), VmState::Stopped);
    // Behind on a board that allows it: the offset wraps, the guest's
    // virtual count is the snapshot's.
    let mut twin_cpu = FakeCpu::new(BOARD_PAGES);
    snapshot::restore(&mut twin, &mut twin_cpu, BOARD, 500_000_000, &bytes[..]).expect("restores");
    assert_eq!(
        500_000_000u64.wrapping_sub(twin.counter_offset()),
        1_000_000_000
    );
}

#[test]
fn a_vcpu_saved_on_a_cpu_with_other_list_registers_is_refused() {
    let (mut vm, mut cpu, _) = paused_vm();
    if let Some(Some(state)) = vm.snap.captured.get_mut(0) {
        if let Some(r) = state.running.as_mut() {
            r.vif.count = 2;
        }
    }
    let (bytes, _) = save(&mut vm, &mut cpu);
    let mut twin = Vm::new(0, vm.spec, GuestGic::V3);
    let e = snapshot::restore(
        &mut twin,
        &mut FakeCpu::new(BOARD_PAGES),
        BOARD,
        0,
        &bytes[..],
    )
    .expect_err("refused");
    assert!(
        format!("{e}").contains("2 list registers, this one has 4"),
        "{e}"
    );
    assert_eq!(twin.state(), VmState::Stopped);
}
