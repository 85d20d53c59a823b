//! Placing things in RAM before the frame table exists.
//!
//! Boot needs room for the frame table itself (and then the heap) while the
//! only knowledge of what is busy is a short list of ranges: the hypervisor
//! image, the device tree, firmware reservations, the guest bundle.

use platform::PhysRange;

/// The lowest address `a` such that `[a, a + size)` is `align`-aligned, lies
/// inside a single bank of `ram`, and overlaps none of `busy`.
///
/// Lowest-address first keeps early allocations packed at the bottom of RAM
/// and is deterministic, so boot logs and tests are reproducible. `ram` and
/// `busy` need not be sorted; busy ranges may overlap each other, extend
/// outside RAM, or be empty (empty ones are ignored). `align` must be a power
/// of two (0 is treated as 1). Returns `None` if `size` is 0, `align` is not
/// a power of two, or no bank has such a hole.
pub fn find_hole(ram: &[PhysRange], busy: &[PhysRange], size: u64, align: u64) -> Option<u64> {
    let align = align.max(1);
    if size == 0 || !align.is_power_of_two() {
        return None;
    }
    ram.iter()
        .filter_map(|bank| hole_in_bank(bank, busy, size, align))
        .min()
}

fn align_up(x: u64, align: u64) -> Option<u64> {
    Some(x.checked_add(align - 1)? & !(align - 1))
}

fn hole_in_bank(bank: &PhysRange, busy: &[PhysRange], size: u64, align: u64) -> Option<u64> {
    let mut candidate = align_up(bank.start, align)?;
    loop {
        let end = candidate.checked_add(size)?;
        if end > bank.end {
            return None;
        }
        let want = PhysRange::new(candidate, end);
        // Skip past the furthest-reaching busy range that overlaps; the
        // candidate strictly increases, so this terminates.
        let blocker = busy
            .iter()
            .filter(|b| !b.is_empty() && b.overlaps(&want))
            .map(|b| b.end)
            .max();
        match blocker {
            None => return Some(candidate),
            Some(busy_end) => candidate = align_up(busy_end, align)?,
        }
    }
}

/// Why the loader's placement of the hypervisor image cannot be used.
#[derive(Debug, PartialEq, Eq)]
pub enum BadPlacement<'a> {
    /// The image (with its .bss) is not inside one bank of RAM.
    OutsideRam,
    /// The image overlaps something the firmware put in RAM (named).
    Overlaps(&'a str, PhysRange),
}

/// Check where the loader put the image: inside one RAM bank, 4 KiB
/// aligned, on top of none of `others` (the device tree, the guest bundle,
/// firmware reservations, named). A firmware told to load the kernel at an
/// unusual address (`kernel_address=` on the Pi) can put it on top of its
/// own spin table or of the bundle; this says so instead of corrupting them.
pub fn check_image_placement<'a>(
    image: PhysRange,
    ram: &[PhysRange],
    others: &[(PhysRange, &'a str)],
) -> Result<(), BadPlacement<'a>> {
    let in_ram = ram
        .iter()
        .any(|bank| bank.start <= image.start && image.end <= bank.end);
    if !in_ram || !image.start.is_multiple_of(4096) {
        return Err(BadPlacement::OutsideRam);
    }
    match others
        .iter()
        .find(|(range, _)| !range.is_empty() && range.overlaps(&image))
    {
        Some(&(range, name)) => Err(BadPlacement::Overlaps(name, range)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(start: u64, end: u64) -> PhysRange {
        PhysRange::new(start, end)
    }

    const K4: u64 = 0x1000;
    const M2: u64 = 0x20_0000;

    #[test]
    fn empty_busy_gives_aligned_bank_start() {
        let ram = [r(0x4000_0000, 0x8000_0000)];
        assert_eq!(find_hole(&ram, &[], K4, K4), Some(0x4000_0000));
        let ram = [r(0x4000_0100, 0x8000_0000)];
        assert_eq!(find_hole(&ram, &[], K4, K4), Some(0x4000_1000));
        assert_eq!(find_hole(&ram, &[], K4, M2), Some(0x4020_0000));
        assert_eq!(find_hole(&ram, &[], 1, 0), Some(0x4000_0100));
        assert_eq!(find_hole(&ram, &[], 1, 1), Some(0x4000_0100));
    }

    #[test]
    fn skips_overlapping_busy_ranges() {
        let ram = [r(0x4000_0000, 0x4100_0000)];
        let busy = [
            r(0x4000_0000, 0x4008_0000), // image
            r(0x4004_0000, 0x4010_0123), // overlaps the image, unaligned end
            r(0x4010_2000, 0x4010_3000), // small gap before it
            r(0x3000_0000, 0x3000_1000), // outside RAM
            r(0x4000_5000, 0x4000_5000), // empty
        ];
        assert_eq!(find_hole(&ram, &busy, K4, K4), Some(0x4010_1000));
        // Two pages do not fit in the one-page gap.
        assert_eq!(find_hole(&ram, &busy, 2 * K4, K4), Some(0x4010_3000));
        assert_eq!(find_hole(&ram, &busy, M2, M2), Some(0x4020_0000));
        // Busy order does not matter.
        let mut rev = busy;
        rev.reverse();
        assert_eq!(find_hole(&ram, &rev, 2 * K4, K4), Some(0x4010_3000));
    }

    #[test]
    fn exact_fit_and_bank_edges() {
        let ram = [r(0x1000, 0x5000)];
        assert_eq!(find_hole(&ram, &[], 0x4000, K4), Some(0x1000));
        assert_eq!(find_hole(&ram, &[], 0x4001, K4), None);
        assert_eq!(
            find_hole(&ram, &[r(0x1000, 0x2000)], 0x3000, K4),
            Some(0x2000)
        );
        assert_eq!(
            find_hole(&ram, &[r(0x4fff, 0x5000)], 0x3000, K4),
            Some(0x1000)
        );
        assert_eq!(find_hole(&ram, &[r(0x4fff, 0x5000)], 0x4000, K4), None);
        // Busy touching but not overlapping (half-open ranges).
        assert_eq!(
            find_hole(&ram, &[r(0, 0x1000), r(0x3000, 0x9000)], 0x2000, K4),
            Some(0x1000)
        );
    }

    #[test]
    fn never_spans_banks_and_picks_lowest() {
        // Two adjacent banks: a hole needing both is not found.
        let ram = [r(0x1000, 0x3000), r(0x3000, 0x5000)];
        assert_eq!(find_hole(&ram, &[], 0x3000, K4), None);
        assert_eq!(find_hole(&ram, &[], 0x2000, K4), Some(0x1000));
        // Unsorted banks: still the lowest address.
        let ram = [r(0x9000_0000, 0xA000_0000), r(0x1000_0000, 0x1010_0000)];
        assert_eq!(find_hole(&ram, &[], K4, K4), Some(0x1000_0000));
        let busy = [r(0x1000_0000, 0x1010_0000)];
        assert_eq!(find_hole(&ram, &busy, K4, K4), Some(0x9000_0000));
    }

    #[test]
    fn degenerate_inputs() {
        let ram = [r(0x1000, 0x5000)];
        assert_eq!(find_hole(&ram, &[], 0, K4), None);
        assert_eq!(find_hole(&ram, &[], K4, 3 * K4), None);
        assert_eq!(find_hole(&[], &[], K4, K4), None);
        assert_eq!(find_hole(&ram, &[r(0, u64::MAX)], K4, K4), None);
        assert_eq!(find_hole(&ram, &[], u64::MAX, K4), None);
        assert_eq!(find_hole(&[r(0x3000, 0x1000)], &[], K4, K4), None);
        // Near the top of the address space: no overflow.
        let top = [r(u64::MAX - 0x3fff, u64::MAX)];
        assert_eq!(find_hole(&top, &[], K4, K4), Some(u64::MAX - 0x3fff));
        assert_eq!(find_hole(&top, &[], K4, 1 << 63), None);
        assert_eq!(
            find_hole(&top, &[r(u64::MAX - 0x3fff, u64::MAX - 0x1000)], K4, K4),
            None
        );
        assert_eq!(
            find_hole(&top, &[r(u64::MAX - 0x3fff, u64::MAX - 0x2000)], K4, K4),
            Some(u64::MAX - 0x1fff)
        );
    }

    #[test]
    fn image_placement() {
        let ram = [
            PhysRange::new(0, 0x3c00_0000),
            PhysRange::new(0x4000_0000, 0x8000_0000),
        ];
        let spin = PhysRange::new(0, 0x1000);
        let bundle = PhysRange::new(0x0280_0000, 0x0300_0000);
        let others = [
            (spin, "spin-table"),
            (bundle, "the guest bundle"),
            (PhysRange::new(0, 0), "empty"),
        ];
        let at = |start: u64| PhysRange::new(start, start + 0x20_0000);
        // The firmware's usual places.
        assert_eq!(check_image_placement(at(0x8_0000), &ram, &others), Ok(()));
        assert_eq!(check_image_placement(at(0x20_0000), &ram, &others), Ok(()));
        // kernel_address=0: on top of the spin table.
        assert_eq!(
            check_image_placement(at(0), &ram, &others),
            Err(BadPlacement::Overlaps("spin-table", spin))
        );
        assert_eq!(
            check_image_placement(at(0x2f0_0000), &ram, &others),
            Err(BadPlacement::Overlaps("the guest bundle", bundle))
        );
        // Across the hole between the banks, past RAM, misaligned.
        for start in [0x3bf0_0000, 0x8000_0000, 0x8_0800] {
            assert_eq!(
                check_image_placement(at(start), &ram, &others),
                Err(BadPlacement::OutsideRam),
                "{start:#x}"
            );
        }
    }
}
