//! The test guest's page allocator: every free page of RAM, each filled with a
//! pattern derived from its address and a generation number, so that any
//! change to memory the guest still owns is caught.

use crate::board::Board;
use guest_driver::PageSource;

const PAGE: u64 = 4096;
const WORDS: usize = (PAGE / 8) as usize;
/// `generation` entry of a page that is not in the pool (reserved, metadata,
/// or in the balloon).
const NOT_IN_POOL: u16 = u16::MAX;

/// The value of word `i` of the page at `addr` filled in generation `generation`.
fn pattern(addr: u64, generation: u16, i: usize) -> u64 {
    let x = (addr + 8 * i as u64) ^ (u64::from(generation) << 48);
    x.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5a5a_5a5a_5a5a_5a5a
}

/// Fills a page with its pattern and returns the sum of the words written.
///
/// # Safety
///
/// The page must be RAM that the guest owns and nothing else references.
unsafe fn fill(addr: u64, generation: u16) -> u64 {
    let p = addr as *mut u64;
    let mut sum = 0u64;
    for i in 0..WORDS {
        let v = pattern(addr, generation, i);
        // SAFETY: the caller's promise; `i` is within the page.
        unsafe { p.add(i).write_volatile(v) };
        sum = sum.wrapping_add(v);
    }
    sum
}

/// The sum of a page's expected words.
fn expected_sum(addr: u64, generation: u16) -> u64 {
    (0..WORDS).fold(0u64, |s, i| s.wrapping_add(pattern(addr, generation, i)))
}

/// The outcome of [`Pool::verify`].
pub enum Verdict {
    Ok {
        pages: usize,
    },
    Mismatch {
        addr: u64,
        expected: u64,
        found: u64,
    },
    ChecksumMismatch {
        expected: u64,
        found: u64,
    },
}

/// Memory carved from RAM for metadata.
pub struct Carved {
    /// The balloon's PFN storage: one `u32` per pool page.
    pub balloon_storage: &'static mut [u32],
}

/// The page pool.
pub struct Pool {
    ram_base: u64,
    /// Per RAM page: its generation, or [`NOT_IN_POOL`].
    generation_of: &'static mut [u16],
    /// Free pages (PFN relative to `ram_base`), a stack.
    free: &'static mut [u32],
    top: usize,
    generation: u16,
    /// Sum of every word of every page in the pool, as written.
    checksum: u64,
    /// Deflated pages seen since the last call of `take_deflate_report`.
    deflated: usize,
    first_nonzero: Option<u64>,
    fill_pages: bool,
}

impl Pool {
    /// Builds the pool over all RAM not reserved in `board`, after carving its
    /// metadata (and the balloon's storage) out of the first free RAM. With
    /// `fill_pages` every pool page gets its pattern.
    pub fn new(board: &Board, fill_pages: bool) -> (Pool, Carved) {
        let ram = board.ram;
        let pages = ((ram.end - ram.start) / PAGE) as usize;
        // Metadata: u16 + u32 per page for the pool, u32 per page for the balloon.
        let meta_bytes = (pages * (2 + 4 + 4)) as u64;
        let meta_pages = meta_bytes.div_ceil(PAGE);
        // The first run of free pages long enough for the metadata.
        let mut start = ram.start;
        while board.is_reserved(start, start + meta_pages * PAGE) {
            start += PAGE;
            assert!(start + meta_pages * PAGE <= ram.end, "no room for metadata");
        }
        let meta = Range(start, start + meta_pages * PAGE);
        // SAFETY: [meta) is RAM that no reserved range, hence neither the image
        // nor the device tree, overlaps; it is split into three disjoint slices
        // that live for ever. u16/u32 alignment holds (page-aligned start, and
        // each slice's length is a multiple of 4 bytes up to the u32 ones).
        let (generation_of, free, balloon_storage) = unsafe {
            let g = core::slice::from_raw_parts_mut(meta.0 as *mut u16, pages);
            let f_at = meta.0 + (pages as u64 * 2).next_multiple_of(4);
            let f = core::slice::from_raw_parts_mut(f_at as *mut u32, pages);
            let b_at = f_at + pages as u64 * 4;
            let b = core::slice::from_raw_parts_mut(b_at as *mut u32, pages);
            (g, f, b)
        };
        let mut pool = Pool {
            ram_base: ram.start,
            generation_of,
            free,
            top: 0,
            generation: 0,
            checksum: 0,
            deflated: 0,
            first_nonzero: None,
            fill_pages,
        };
        // Highest pages last, so that the balloon takes them first.
        for index in 0..pages {
            let addr = ram.start + index as u64 * PAGE;
            pool.generation_of[index] = NOT_IN_POOL;
            if board.is_reserved(addr, addr + PAGE) || meta.contains(addr) {
                continue;
            }
            pool.add(index);
        }
        let storage_len = pool.top;
        (
            pool,
            Carved {
                balloon_storage: &mut balloon_storage[..storage_len],
            },
        )
    }

    fn add(&mut self, index: usize) {
        let addr = self.ram_base + index as u64 * PAGE;
        if self.fill_pages {
            // SAFETY: a free RAM page of the pool, owned by the guest.
            self.checksum = self
                .checksum
                .wrapping_add(unsafe { fill(addr, self.generation) });
        }
        self.generation_of[index] = self.generation;
        self.free[self.top] = index as u32;
        self.top += 1;
    }

    /// Pages in the pool.
    pub fn len(&self) -> usize {
        self.top
    }

    /// Starts a new generation: pages given back from now on get new patterns.
    pub fn next_generation(&mut self) {
        self.generation = (self.generation + 1) % NOT_IN_POOL;
    }

    /// Checks every page in the pool against its pattern, and the checksum.
    pub fn verify(&self) -> Verdict {
        let mut sum = 0u64;
        let mut pages = 0;
        for (index, &generation) in self.generation_of.iter().enumerate() {
            if generation == NOT_IN_POOL {
                continue;
            }
            let addr = self.ram_base + index as u64 * PAGE;
            let p = addr as *const u64;
            for i in 0..WORDS {
                // SAFETY: a page of the pool: RAM the guest owns.
                let found = unsafe { p.add(i).read_volatile() };
                let expected = pattern(addr, generation, i);
                if found != expected {
                    return Verdict::Mismatch {
                        addr: addr + 8 * i as u64,
                        expected,
                        found,
                    };
                }
                sum = sum.wrapping_add(found);
            }
            pages += 1;
        }
        if sum != self.checksum {
            return Verdict::ChecksumMismatch {
                expected: self.checksum,
                found: sum,
            };
        }
        Verdict::Ok { pages }
    }

    /// How many pages came back from a deflate since the last call, and the
    /// first of them that did not read as zero.
    pub fn take_deflate_report(&mut self) -> (usize, Option<u64>) {
        let report = (self.deflated, self.first_nonzero);
        self.deflated = 0;
        self.first_nonzero = None;
        report
    }
}

struct Range(u64, u64);

impl Range {
    fn contains(&self, addr: u64) -> bool {
        self.0 <= addr && addr < self.1
    }
}

impl PageSource for Pool {
    fn take_page(&mut self) -> Option<u64> {
        if self.top == 0 {
            return None;
        }
        self.top -= 1;
        let index = self.free[self.top] as usize;
        let addr = self.ram_base + index as u64 * PAGE;
        if self.fill_pages {
            let sum = expected_sum(addr, self.generation_of[index]);
            self.checksum = self.checksum.wrapping_sub(sum);
        }
        self.generation_of[index] = NOT_IN_POOL;
        Some(addr)
    }

    fn return_page(&mut self, addr: u64) {
        let index = ((addr - self.ram_base) / PAGE) as usize;
        assert_eq!(
            self.generation_of[index], NOT_IN_POOL,
            "page 0x{addr:x} returned twice"
        );
        let p = addr as *const u64;
        // SAFETY: the page is back from the host: RAM the guest owns again.
        let zero = (0..WORDS).all(|i| unsafe { p.add(i).read_volatile() } == 0);
        self.deflated += 1;
        if !zero && self.first_nonzero.is_none() {
            self.first_nonzero = Some(addr);
        }
        self.add(index);
    }
}

impl Pool {
    /// Check the pattern and say how it went (the line the tests look for:
    /// `pattern ok` or `PATTERN MISMATCH`).
    pub fn check_and_report(&mut self) {
        match self.verify() {
            Verdict::Ok { pages } => println!("pattern ok ({pages} pages)"),
            Verdict::Mismatch {
                addr,
                expected,
                found,
            } => {
                println!(
                    "PATTERN MISMATCH at 0x{addr:x} (expected 0x{expected:x}, found 0x{found:x})"
                )
            }
            Verdict::ChecksumMismatch { expected, found } => {
                println!("PATTERN MISMATCH at 0x0 (checksum 0x{found:x}, expected 0x{expected:x})")
            }
        }
    }
}
