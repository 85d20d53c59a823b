//! What a device tree cannot tell: one `const` description per board, chosen
//! by the root node's `compatible`.

use crate::{PhysRange, Uart, UartKind};

/// Facts about a board that are not in its device tree.
#[derive(Debug, PartialEq, Eq)]
pub struct BoardDesc {
    /// A short human name for the banner.
    pub name: &'static str,
    /// Root `compatible` strings this description applies to.
    pub compatible: &'static [&'static str],
    /// The `/aliases` entry of the UART that carries the binary trace stream,
    /// if the board has a UART free for it. It is used only when it names a
    /// PL011 that is not the console.
    pub trace_uart_alias: Option<&'static str>,
    /// The board's usual console, used only to report a device tree that
    /// names no console before stopping.
    pub fallback_console: Option<Uart>,
}

pub const QEMU_VIRT: BoardDesc = BoardDesc {
    name: "QEMU virt",
    compatible: &["linux,dummy-virt"],
    // With two `-serial` options QEMU adds a second PL011 as serial1.
    trace_uart_alias: Some("serial1"),
    fallback_console: Some(Uart {
        kind: UartKind::Pl011,
        regs: PhysRange::new(0x0900_0000, 0x0900_1000),
        intid: None,
    }),
};

pub const RASPBERRY_PI_4: BoardDesc = BoardDesc {
    name: "Raspberry Pi 4",
    compatible: &["raspberrypi,4-model-b", "brcm,bcm2711"],
    // UART0 (the PL011) is wired to Bluetooth unless an overlay moves it: do
    // not send a binary stream there by default.
    trace_uart_alias: None,
    fallback_console: Some(Uart {
        kind: UartKind::Bcm2835Aux,
        regs: PhysRange::new(0xfe21_5040, 0xfe21_5080),
        intid: None,
    }),
};

/// Used for a board no description names: trust the tree alone.
pub const GENERIC: BoardDesc = BoardDesc {
    name: "generic Arm board",
    compatible: &[],
    trace_uart_alias: None,
    fallback_console: None,
};

pub const ALL: &[&BoardDesc] = &[&QEMU_VIRT, &RASPBERRY_PI_4];

/// The description for a root `compatible` list (any entry may match).
pub fn describe<'a>(mut root_compatible: impl Iterator<Item = &'a str>) -> &'static BoardDesc {
    root_compatible
        .find_map(|c| ALL.iter().find(|b| b.compatible.contains(&c)).copied())
        .unwrap_or(&GENERIC)
}

/// Boards a root `compatible` may name that this build does not support,
/// with what to tell the user: a Raspberry Pi other than the BCM2711 ones
/// (Pi 4 B, Pi 400, CM4) boots the same card but cannot run the hypervisor.
const UNSUPPORTED: &[(&str, &str)] = &[
    (
        "brcm,bcm2712",
        "a Raspberry Pi 5 (BCM2712): its peripherals sit behind the RP1 chip, which Tidal does not drive",
    ),
    (
        "brcm,bcm2837",
        "a Raspberry Pi 3 or Zero 2 (BCM2837): it has no GIC, so no virtual interrupts",
    ),
    (
        "brcm,bcm2836",
        "a Raspberry Pi 2 (BCM2836): a 32-bit board without virtualization for 64-bit guests",
    ),
    (
        "brcm,bcm2835",
        "a Raspberry Pi 1 or Zero (BCM2835): a 32-bit board",
    ),
];

/// Why the board a root `compatible` list names cannot run Tidal, if it is
/// one this build knows it does not support. Unknown boards are not refused
/// here: the tree alone decides whether they can run (see [`GENERIC`]).
pub fn unsupported<'a>(mut root_compatible: impl Iterator<Item = &'a str>) -> Option<&'static str> {
    root_compatible.find_map(|c| {
        UNSUPPORTED
            .iter()
            .find(|(compatible, _)| *compatible == c)
            .map(|(_, why)| *why)
    })
}
