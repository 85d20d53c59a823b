//! The vCPU loop (`vm::vcpu_loop`) over a scripted guest: the exits it
//! takes, in order, and what the loop does around them — which path
//! handles each, when it prints, ticks, sleeps and lets the shell look,
//! and how it leaves.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

use super::super::console_line::Echo;
use super::super::vcpu_loop::{self, Pending, VcpuHost, FAST_EXITS_PER_TICK_LOOK};
use super::*;

/// What another CPU does to the VM while the vCPU sleeps.
type WhileIdle = Box<dyn FnOnce(&mut Vm)>;

/// One trip into the guest: the registers it leaves (x0-x3) and its exit.
type Step = ([u64; 4], VcpuExit);

/// The board around one vCPU loop: the VM's slot, the guest's script, and
/// a log of what the loop asked of the board, in order.
struct ScriptedHost {
    vm: RefCell<Option<Vm>>,
    script: RefCell<VecDeque<Step>>,
    log: RefCell<Vec<String>>,
    /// Lines printed from the VM's outbox.
    printed: RefCell<Vec<String>>,
    /// What `memory_tick` answers (whether a tick ran).
    ticks: Cell<bool>,
    /// Whether the shell's look is due after a sleep (the shell's CPU).
    on_shell_cpu: bool,
    /// Run by `idle`, as another CPU would meanwhile (the shell's stop).
    while_idle: RefCell<Option<WhileIdle>>,
    /// Run while the guest runs its `n`th trip (from 0), as another CPU
    /// would meanwhile.
    meanwhile: RefCell<Option<(usize, WhileIdle)>>,
    runs: Cell<usize>,
}

impl ScriptedHost {
    fn new(vm: Vm, script: impl IntoIterator<Item = Step>) -> Self {
        ScriptedHost {
            vm: RefCell::new(Some(vm)),
            script: RefCell::new(script.into_iter().collect()),
            log: RefCell::new(Vec::new()),
            printed: RefCell::new(Vec::new()),
            ticks: Cell::new(false),
            on_shell_cpu: false,
            while_idle: RefCell::new(None),
            meanwhile: RefCell::new(None),
            runs: Cell::new(0),
        }
    }

    /// Log `what` the loop asked for, which it must ask with the VM's
    /// lock released: the world switch, the tick, the printing, the sleeps
    /// and the shell's look all run without it (the lock order's rule).
    fn note(&self, what: &str) {
        assert!(
            self.vm.try_borrow_mut().is_ok(),
            "{what} with the VM's lock held"
        );
        self.log.borrow_mut().push(what.into());
    }

    fn log(&self) -> Vec<String> {
        self.log.borrow().clone()
    }

    fn vm(&self) -> std::cell::Ref<'_, Vm> {
        std::cell::Ref::map(self.vm.borrow(), |v| v.as_ref().expect("a VM"))
    }
}

impl VcpuHost for ScriptedHost {
    type Guard<'a> = std::cell::RefMut<'a, Option<Vm>>;

    fn lock_vm(&self, _id: usize) -> Self::Guard<'_> {
        self.vm.borrow_mut()
    }
    fn load_guest(&self, _vm: &Vm, vcpu: usize) {
        // Under the VM's lock: what it loads is the VM's.
        assert!(
            self.vm.try_borrow_mut().is_err(),
            "loads with the VM's lock held"
        );
        self.log.borrow_mut().push(format!("load vcpu{vcpu}"));
    }

    fn save_cpu_state(
        &self,
        _gic: bool,
    ) -> (
        crate::hw::context::El1State,
        crate::hw::context::VirtualInterface,
    ) {
        (crate::hw::context::El1State::reset(), Default::default())
    }
    fn run_guest(&self, ctx: &mut GuestContext) -> VcpuExit {
        let runs = self.runs.get();
        self.runs.set(runs + 1);
        if let Some((at, f)) = self.meanwhile.borrow_mut().take_if(|(at, _)| *at == runs) {
            let _ = at;
            f(self.vm.borrow_mut().as_mut().expect("a VM"));
        }
        let (regs, exit) = self
            .script
            .borrow_mut()
            .pop_front()
            .expect("the loop ran the guest past its script");
        ctx.x[..4].copy_from_slice(&regs);
        self.note(&format!("run {:?}", exit.kind()));
        exit
    }
    fn memory_tick(&self) -> bool {
        self.note("tick");
        self.ticks.get()
    }
    fn show(&self, pending: Pending) {
        self.note("show");
        for notice in pending.notices {
            if let Notice::Line(line) = notice {
                self.printed.borrow_mut().push(line.to_string());
            }
        }
    }
    fn show_live(&self, _id: usize, _echo: &Option<Echo>) {
        self.note("live");
    }
    fn fail(&self, vm: &mut Vm, _kind: InjectedFailure) -> ! {
        assert!(
            self.vm.try_borrow_mut().is_err(),
            "fails with the VM's lock held"
        );
        panic!("injected failure ('debug fail {}')", vm.name);
    }
    fn idle(&self) {
        self.note("idle");
        if let Some(f) = self.while_idle.borrow_mut().take() {
            f(self.vm.borrow_mut().as_mut().expect("a VM"));
        }
    }
    fn wait_memory(&self) {
        self.note("wait memory");
    }
    fn shell_look(&self, slept: bool, first: bool) -> bool {
        if !self.on_shell_cpu {
            return false;
        }
        self.note(&format!("shell look slept={slept} first={first}"));
        !first && slept
    }
}

/// x0-x3 of a PSCI call.
fn psci(function: u32) -> [u64; 4] {
    [function.into(), 0, 0, 0]
}

/// A guest that powers itself off (PSCI SYSTEM_OFF).
fn power_off() -> Step {
    (psci(smccc::psci::PSCI_SYSTEM_OFF), VcpuExit::Hvc { imm: 0 })
}

/// The guest sends `byte` to the PL011's DR (from x1).
fn send(byte: u8) -> Step {
    ([0, byte.into(), 0, 0], store(UART_DR, 4))
}

fn wfi() -> Step {
    (
        [0; 4],
        VcpuExit::Wait {
            wfe: false,
            insn_len: 4,
        },
    )
}

/// A one-vCPU VM on a fake CPU, running `script` until its vCPU leaves.
fn run_script(script: Vec<Step>) -> (ScriptedHost, FakeCpu) {
    let (vm, cpu) = started(1);
    run_with(ScriptedHost::new(vm, script), cpu)
}

fn run_with(host: ScriptedHost, mut cpu: FakeCpu) -> (ScriptedHost, FakeCpu) {
    cpu.index = host.vm().vcpus.cpu(0);
    vcpu_loop::run_vcpu(&host, &mut cpu, 0, 0);
    (host, cpu)
}

#[test]
fn the_loop_runs_the_guest_until_it_powers_itself_off() {
    let mut script: Vec<Step> = b"hi\n".iter().map(|&b| send(b)).collect();
    script.push(power_off());
    let (host, cpu) = run_script(script);
    assert!(host.script.borrow().is_empty());
    assert_eq!(
        host.log(),
        [
            "load vcpu0",
            "run MmioWrite",
            "run MmioWrite",
            "run MmioWrite",
            "show",
            "run Hvc",
            "show"
        ]
    );
    let printed = host.printed.borrow();
    assert_eq!(printed[0], "[guest] hi", "{printed:?}");
    assert!(
        printed
            .iter()
            .any(|l| l.contains("VM stopped: powered off")),
        "{printed:?}"
    );
    let vm = host.vm();
    assert_eq!(vm.state, VmState::Stopped);
    assert_eq!(
        cpu.host.frames.guest_pages(0),
        0,
        "its RAM is back in the pool"
    );
    // The bytes took the UART's fast path; the call the full one.
    assert_eq!(vm.counters.profile.get(ExitKind::MmioUart).count, 3);
    assert_eq!(vm.counters.profile.get(ExitKind::Hvc).count, 1);
}

#[test]
fn fast_exits_look_at_the_tick_every_sixteenth_and_a_tick_resyncs() {
    let reads = 2 * FAST_EXITS_PER_TICK_LOOK as usize + 3;
    let mut script: Vec<Step> = (0..reads).map(|_| ([0; 4], load(UART_FR, 4))).collect();
    script.push(power_off());
    let (host, _) = run_script(script.clone());
    let ticks = host.log().iter().filter(|l| *l == "tick").count();
    assert_eq!(ticks, 2, "{:?}", host.log());
    // A tick that ran: the loop goes round the entry (list registers
    // synced again) and then carries on with the guest.
    let (vm, cpu) = started(1);
    let host = ScriptedHost::new(vm, script);
    host.ticks.set(true);
    let (host, _) = run_with(host, cpu);
    assert!(host.script.borrow().is_empty());
    assert_eq!(host.vm().state, VmState::Stopped);
    assert_eq!(
        host.vm().counters.profile.get(ExitKind::MmioUart).count,
        reads as u64
    );
}

#[test]
fn a_wfi_sleeps_then_ticks_then_lets_the_shell_look() {
    let (vm, cpu) = started(1);
    let mut host = ScriptedHost::new(vm, [wfi(), power_off()]);
    host.on_shell_cpu = true;
    // WFI traps while statistics polling is on; without it, the guest
    // would sleep in WFI itself. Either way a trapped one is an Idle.
    let (host, _) = run_with(host, cpu);
    assert_eq!(
        host.log(),
        [
            "load vcpu0",
            "shell look slept=false first=true",
            "run Wfi",
            "idle",
            "tick",
            "shell look slept=true first=false",
            "run Hvc",
            "show",
        ]
    );
}

#[test]
fn a_stop_asked_while_the_vcpu_slept_ends_it_before_the_guest_runs_again() {
    let (vm, cpu) = started(1);
    let host = ScriptedHost::new(vm, [wfi(), send(b'x'), power_off()]);
    *host.while_idle.borrow_mut() = Some(Box::new(|vm: &mut Vm| {
        let mut other = FakeCpu::new(16);
        lifecycle::request_stop(vm, &mut other).expect("it runs");
    }));
    let (host, cpu) = run_with(host, cpu);
    assert_eq!(host.script.borrow().len(), 2, "the guest did not run again");
    assert_eq!(host.vm().state, VmState::Stopped);
    assert_eq!(cpu.host.frames.guest_pages(0), 0);
    assert!(host
        .printed
        .borrow()
        .iter()
        .any(|l| l.contains("VM stopped: stopped from the shell")));
}

#[test]
#[should_panic(expected = "injected failure ('debug fail guest')")]
fn an_injected_failure_fails_on_the_next_full_exit() {
    let (mut vm, cpu) = started(1);
    vm.inject_failure = Some(InjectedFailure::Panic);
    run_with(ScriptedHost::new(vm, [power_off()]), cpu);
}

#[test]
fn a_vm_that_is_gone_ends_the_loop_quietly() {
    let (vm, mut cpu) = started(1);
    let host = ScriptedHost::new(vm, [send(b'x')]);
    host.vm.borrow_mut().take();
    vcpu_loop::run_vcpu(&host, &mut cpu, 0, 0);
    assert!(host.log().is_empty(), "{:?}", host.log());
}

#[test]
fn a_stop_asked_while_the_guest_ran_ends_it_at_that_exit() {
    let (vm, cpu) = started(1);
    // Fast-path exits all, were the VM not stopping.
    let host = ScriptedHost::new(vm, [send(b'a'), send(b'b'), send(b'c'), power_off()]);
    *host.meanwhile.borrow_mut() = Some((
        1,
        Box::new(|vm: &mut Vm| {
            // Its vCPU is inside: the stop is asked, and it is the vCPU's
            // to end.
            let mut other = FakeCpu::new(16);
            lifecycle::request_stop(vm, &mut other).expect("it runs");
            assert_eq!(vm.state, VmState::StopRequested);
        }),
    ));
    let (host, cpu) = run_with(host, cpu);
    assert_eq!(host.script.borrow().len(), 2, "it left at the second exit");
    let vm = host.vm();
    assert_eq!(vm.state, VmState::Stopped);
    assert_eq!(cpu.host.frames.guest_pages(0), 0);
    assert_eq!(
        vm.counters.profile.get(ExitKind::MmioUart).count,
        1,
        "the exit it left at was not handled"
    );
}
