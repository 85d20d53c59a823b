//! Everything read from the hypervisor's ELF: source locations for crash
//! addresses (DWARF, via `addr2line`) and the decoding of the binary defmt
//! trace stream of the second UART (via `defmt-decoder`).

use std::path::Path;

use defmt_decoder::{DecodeError, Encoding, Table};
use object::{Object, ObjectSegment};

/// The source location of `image_offset` (an offset into the raw image, as
/// printed in crash dumps) as `function at file:line`, innermost frame first;
/// inlined frames follow as `, inlined into function at file:line`. Paths
/// inside the workspace are shown relative to its root (`hypervisor/src/...`).
/// `None` if the ELF cannot be read or has no debug info for the address.
pub fn symbolize(elf: &Path, image_offset: u64) -> Option<String> {
    let address = image_base(elf).unwrap_or(0) + image_offset;
    let loader = addr2line::Loader::new(elf).ok()?;
    let root = format!("{}/", crate::workspace_root().display());
    let mut parts = Vec::new();
    let mut frames = loader.find_frames(address).ok()?;
    while let Ok(Some(frame)) = frames.next() {
        let function = frame
            .function
            .as_ref()
            .and_then(|f| f.demangle().ok().map(|s| s.into_owned()))
            .unwrap_or_else(|| "??".into());
        let location = frame
            .location
            .as_ref()
            .map(|l| {
                let file = l.file.unwrap_or("??");
                let file = file.strip_prefix(&root).unwrap_or(file);
                format!("{file}:{}", l.line.unwrap_or(0))
            })
            .unwrap_or_else(|| "??".into());
        parts.push(format!("{function} at {location}"));
    }
    if parts.is_empty() {
        // No DWARF for the address: fall back to the symbol table.
        let symbol = loader.find_symbol(address)?;
        let name = addr2line::demangle_auto(symbol.into(), None);
        return Some(format!("{name} at ??"));
    }
    Some(parts.join(", inlined into "))
}

/// The address at which the raw image starts: the lowest address of a loaded
/// segment with file contents (what `objcopy -O binary` puts at offset 0).
fn image_base(elf: &Path) -> Option<u64> {
    let data = std::fs::read(elf).ok()?;
    let file = object::File::parse(&*data).ok()?;
    file.segments()
        .filter(|s| s.file_range().1 > 0)
        .map(|s| s.address())
        .min()
}

/// Decodes a defmt trace stream (the bytes the trace UART wrote) with the
/// table in `elf`: one line per log frame, as `[timestamp] LEVEL message`.
/// Frames that do not decode are skipped (rzCOBS framing resynchronizes); an
/// incomplete last frame is ignored.
pub fn decode_trace(elf: &Path, bytes: &[u8]) -> Result<Vec<String>, String> {
    let data = std::fs::read(elf).map_err(|e| format!("cannot read {}: {e}", elf.display()))?;
    let table = Table::parse(&data)
        .map_err(|e| format!("cannot read the defmt table of {}: {e}", elf.display()))?
        .ok_or_else(|| {
            format!(
                "{} has no .defmt section: the image was built without defmt",
                elf.display()
            )
        })?;
    let mut decoder = table.new_stream_decoder();
    decoder.received(bytes);
    let mut lines = Vec::new();
    loop {
        match decoder.decode() {
            Ok(frame) => lines.push(frame.display(false).to_string()),
            Err(DecodeError::UnexpectedEof) => break,
            // rzCOBS drops the bad frame and goes on; raw framing cannot resync.
            Err(DecodeError::Malformed) if table.encoding() == Encoding::Rzcobs => {}
            Err(DecodeError::Malformed) => {
                lines.push("[malformed raw defmt frame: rest of the trace not decoded]".into());
                break;
            }
        }
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A function with a known name and location in this test executable.
    #[no_mangle]
    #[inline(never)]
    pub extern "C" fn harness_symbolize_probe() -> u32 {
        std::hint::black_box(42)
    }

    #[test]
    fn symbolizes_a_function_of_this_executable() {
        assert_eq!(harness_symbolize_probe(), 42);
        let exe = std::env::current_exe().unwrap();
        let data = std::fs::read(&exe).unwrap();
        let file = object::File::parse(&*data).unwrap();
        let address = object::ObjectSymbolTable::symbols(&file.symbol_table().unwrap())
            .find(|s| object::ObjectSymbol::name(s) == Ok("harness_symbolize_probe"))
            .map(|s| object::ObjectSymbol::address(&s))
            .expect("probe symbol");
        let base = image_base(&exe).unwrap();
        let found = symbolize(&exe, address - base).expect("a location");
        assert!(
            found.starts_with("harness_symbolize_probe at tests/src/symbols.rs:"),
            "{found}"
        );
    }

    #[test]
    fn symbolize_without_an_elf_is_none() {
        assert_eq!(symbolize(Path::new("/nonexistent/elf"), 0x1000), None);
    }

    #[test]
    fn decode_trace_needs_a_defmt_table() {
        let exe = std::env::current_exe().unwrap();
        let err = decode_trace(&exe, b"").unwrap_err();
        assert!(err.contains("no .defmt section"), "{err}");
        let err = decode_trace(Path::new("/nonexistent/elf"), b"").unwrap_err();
        assert!(err.contains("cannot read /nonexistent/elf"), "{err}");
    }
}
