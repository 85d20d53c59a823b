//! A small, allocation-free reader for flattened device trees (FDT v17).
//!
//! It owns the byte-level format: the header, the memory reservation block
//! and the structure block's tokens. [`Fdt::new`] checks the whole blob once
//! (header fields, every token, every name and property bound, nesting), so
//! a malformed tree is refused up front with a precise error; the accessors
//! still read with checked slicing only, so even a tree that got past the
//! check could end an iteration early but never index out of bounds.
//!
//! Written here rather than taken from the `fdt` crate (0.1.5) because that
//! crate panics on NOP tokens, which valid trees carry (QEMU's `raspi4b`
//! writes hundreds), and on damaged blobs, and its nodes have no parent for
//! `ranges` translation (docs/ARCHITECTURE.md, "Crates"; the `fdt_crate_*`
//! tests show both).

use super::DiscoveryError;

/// Deepest node nesting accepted (the root is depth 0). Real trees stay
/// under 8; the limit bounds the ancestor stack each [`Node`] carries.
pub const MAX_DEPTH: usize = 16;

const MAGIC: u32 = 0xd00d_feed;
const HEADER_LEN: usize = 40;
/// Version 17 added `size_dt_struct`, which the bounds checks rely on.
const MIN_VERSION: u32 = 17;

const FDT_BEGIN_NODE: u32 = 1;
const FDT_END_NODE: u32 = 2;
const FDT_PROP: u32 = 3;
const FDT_NOP: u32 = 4;
const FDT_END: u32 = 9;

/// Big-endian u32 at `off`, if it is inside `b`.
pub fn be32(b: &[u8], off: usize) -> Option<u32> {
    let s = b.get(off..off.checked_add(4)?)?;
    Some(u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}

/// Big-endian u64 at `off`, if it is inside `b`.
fn be64(b: &[u8], off: usize) -> Option<u64> {
    Some(((be32(b, off)? as u64) << 32) | be32(b, off.checked_add(4)?)? as u64)
}

/// The bytes of `b` up to (not including) the first NUL, if there is one.
fn cstr(b: &[u8]) -> Option<&[u8]> {
    let end = b.iter().position(|&c| c == 0)?;
    b.get(..end)
}

fn align4(n: usize) -> Option<usize> {
    Some(n.checked_add(3)? & !3)
}

/// One structure-block token, decoded.
enum Tok<'a> {
    Begin(&'a [u8]),
    EndNode,
    Prop { name: &'a [u8], value: &'a [u8] },
    Nop,
    End,
}

/// A checked device tree blob.
#[derive(Clone, Copy)]
pub struct Fdt<'a> {
    structs: &'a [u8],
    strings: &'a [u8],
    /// From the memory reservation block to the end of the blob.
    rsvmap: &'a [u8],
    totalsize: u32,
    /// Offset of the root's `FDT_BEGIN_NODE` in `structs`.
    root: usize,
}

impl<'a> Fdt<'a> {
    /// Checks the header and the whole structure block.
    pub fn new(blob: &'a [u8]) -> Result<Self, DiscoveryError> {
        let h = |i: usize| be32(blob, i * 4);
        let magic = h(0).ok_or(DiscoveryError::Truncated {
            len: blob.len(),
            needed: HEADER_LEN,
        })?;
        if magic != MAGIC {
            return Err(DiscoveryError::BadMagic(magic));
        }
        let field = |i| {
            h(i).ok_or(DiscoveryError::Truncated {
                len: blob.len(),
                needed: HEADER_LEN,
            })
        };
        let totalsize = field(1)?;
        let (off_struct, off_strings, off_rsvmap) = (field(2)?, field(3)?, field(4)?);
        let (version, last_comp) = (field(5)?, field(6)?);
        let (size_strings, size_struct) = (field(8)?, field(9)?);
        if version < MIN_VERSION || last_comp > MIN_VERSION {
            return Err(DiscoveryError::UnsupportedVersion {
                version,
                last_compatible: last_comp,
            });
        }
        let total = totalsize as usize;
        if total > blob.len() {
            return Err(DiscoveryError::Truncated {
                len: blob.len(),
                needed: total,
            });
        }
        if total < HEADER_LEN {
            return Err(DiscoveryError::BadHeader(
                "totalsize smaller than the header",
            ));
        }
        let blob = &blob[..total];
        let block = |off: u32, size: u32, what| {
            let start = off as usize;
            let end = start
                .checked_add(size as usize)
                .ok_or(DiscoveryError::BadHeader(what))?;
            blob.get(start..end).ok_or(DiscoveryError::BadHeader(what))
        };
        let structs = block(off_struct, size_struct, "structure block outside the blob")?;
        let strings = block(off_strings, size_strings, "strings block outside the blob")?;
        let rsvmap = blob
            .get(off_rsvmap as usize..)
            .ok_or(DiscoveryError::BadHeader(
                "memory reservation block outside the blob",
            ))?;
        let mut fdt = Fdt {
            structs,
            strings,
            rsvmap,
            totalsize,
            root: 0,
        };
        fdt.check_rsvmap()?;
        fdt.root = fdt.check_structs()?;
        Ok(fdt)
    }

    pub fn totalsize(&self) -> u32 {
        self.totalsize
    }

    /// The reservation block must end with a zero-size entry inside the blob.
    fn check_rsvmap(&self) -> Result<(), DiscoveryError> {
        let mut off = 0;
        loop {
            match (be64(self.rsvmap, off), be64(self.rsvmap, off + 8)) {
                (Some(_), Some(0)) => return Ok(()),
                (Some(_), Some(_)) => off += 16,
                _ => {
                    return Err(DiscoveryError::BadHeader(
                        "memory reservation block not terminated",
                    ))
                }
            }
        }
    }

    /// `/memreserve/` entries as (address, size), up to the zero-size terminator.
    pub fn memreserve(&self) -> impl Iterator<Item = (u64, u64)> + 'a {
        let map = self.rsvmap;
        (0..)
            .map(move |i: usize| {
                let off = i.checked_mul(16)?;
                Some((be64(map, off)?, be64(map, off.checked_add(8)?)?))
            })
            .take_while(|e| matches!(e, Some((_, size)) if *size != 0))
            .flatten()
    }

    /// Decodes the token at `off`; returns it and the offset of the next one.
    fn token(&self, off: usize) -> Result<(Tok<'a>, usize), &'static str> {
        let s = self.structs;
        let tag = be32(s, off).ok_or("token past the end of the structure block")?;
        let after = off + 4;
        match tag {
            FDT_BEGIN_NODE => {
                let name = cstr(s.get(after..).unwrap_or(&[])).ok_or("unterminated node name")?;
                let next = align4(after + name.len() + 1).ok_or("node name overflows")?;
                Ok((Tok::Begin(name), next))
            }
            FDT_END_NODE => Ok((Tok::EndNode, after)),
            FDT_PROP => {
                let len = be32(s, after).ok_or("truncated property header")? as usize;
                let nameoff = be32(s, after + 4).ok_or("truncated property header")? as usize;
                let start = after + 8;
                let end = start.checked_add(len).ok_or("property length overflows")?;
                let value = s
                    .get(start..end)
                    .ok_or("property value past the structure block")?;
                let name = self
                    .strings
                    .get(nameoff..)
                    .and_then(cstr)
                    .ok_or("property name outside the strings block")?;
                Ok((
                    Tok::Prop { name, value },
                    align4(end).ok_or("property length overflows")?,
                ))
            }
            FDT_NOP => Ok((Tok::Nop, after)),
            FDT_END => Ok((Tok::End, after)),
            _ => Err("unknown token"),
        }
    }

    /// Walks every token once; returns the root node's offset.
    fn check_structs(&self) -> Result<usize, DiscoveryError> {
        let bad = |offset, what| DiscoveryError::BadStructure { offset, what };
        let mut off = 0;
        let mut depth = 0usize;
        let mut root = None;
        loop {
            let (tok, next) = self.token(off).map_err(|what| bad(off, what))?;
            match tok {
                Tok::Begin(_) => {
                    if depth == 0 {
                        if root.is_some() {
                            return Err(bad(off, "more than one root node"));
                        }
                        root = Some(off);
                    }
                    depth += 1;
                    if depth > MAX_DEPTH {
                        return Err(bad(off, "nodes nested too deeply"));
                    }
                }
                Tok::EndNode => {
                    depth = depth
                        .checked_sub(1)
                        .ok_or(bad(off, "unbalanced end of node"))?;
                }
                Tok::Prop { .. } if depth == 0 => {
                    return Err(bad(off, "property outside the root node"))
                }
                Tok::Prop { .. } | Tok::Nop => {}
                Tok::End => {
                    return match (depth, root) {
                        (0, Some(root)) => Ok(root),
                        (0, None) => Err(bad(off, "no root node")),
                        _ => Err(bad(off, "end of tree inside a node")),
                    };
                }
            }
            off = next;
        }
    }

    /// The node whose `FDT_BEGIN_NODE` is at `off`, with the given ancestors.
    fn node_at(&self, off: usize, anc: [u32; MAX_DEPTH], depth: usize) -> Option<Node<'a>> {
        match self.token(off).ok()? {
            (Tok::Begin(name), body) => Some(Node {
                fdt: *self,
                off,
                name,
                body,
                anc,
                depth,
            }),
            _ => None,
        }
    }

    pub fn root(&self) -> Node<'a> {
        // `new` checked that a root node starts here.
        self.node_at(self.root, [0; MAX_DEPTH], 0).unwrap_or(Node {
            fdt: *self,
            off: self.root,
            name: &[],
            body: self.structs.len(),
            anc: [0; MAX_DEPTH],
            depth: 0,
        })
    }

    /// Every node, depth first, the root included.
    pub fn nodes(&self) -> AllNodes<'a> {
        AllNodes {
            fdt: *self,
            pos: Some(self.root),
            stack: [0; MAX_DEPTH],
            depth: 0,
        }
    }

    /// The node with this `phandle` (or legacy `linux,phandle`).
    pub fn by_phandle(&self, phandle: u32) -> Option<Node<'a>> {
        if phandle == 0 || phandle == u32::MAX {
            return None;
        }
        self.nodes().find(|n| {
            let p = n.prop("phandle").or_else(|| n.prop("linux,phandle"));
            p.and_then(|v| be32(v, 0)) == Some(phandle) && p.map(<[u8]>::len) == Some(4)
        })
    }

    /// Resolves a full path (`/soc/serial@7e215040`) or an alias with an
    /// optional path after it (`serial1`, `serial1/child`). A component
    /// without a unit address matches a node whose name has one, as in Linux.
    pub fn resolve(&self, path: &[u8]) -> Option<Node<'a>> {
        if path.first() == Some(&b'/') {
            return find_from(self.root(), path);
        }
        let (alias, rest) = match path.iter().position(|&c| c == b'/') {
            Some(i) => (&path[..i], &path[i..]),
            None => (path, &[][..]),
        };
        let target = cstr(self.root().child(b"aliases")?.prop_bytes(alias)?)?;
        // An alias must name a full path; refusing anything else also stops
        // an alias from naming another alias and recursing.
        if target.first() != Some(&b'/') {
            return None;
        }
        find_from(find_from(self.root(), target)?, rest)
    }
}

fn find_from<'a>(mut node: Node<'a>, path: &[u8]) -> Option<Node<'a>> {
    for comp in path.split(|&c| c == b'/').filter(|c| !c.is_empty()) {
        let has_unit = comp.contains(&b'@');
        node = node.children().find(|c| {
            c.name == comp || (!has_unit && c.name.split(|&b| b == b'@').next() == Some(comp))
        })?;
    }
    Some(node)
}

/// A node of a checked tree, with the offsets of its ancestors (for `ranges`
/// translation and `interrupt-parent` lookup).
#[derive(Clone, Copy)]
pub struct Node<'a> {
    fdt: Fdt<'a>,
    off: usize,
    name: &'a [u8],
    /// Offset of the first token after the node's name.
    body: usize,
    /// Ancestors' offsets, root first; `depth` of them are valid.
    anc: [u32; MAX_DEPTH],
    depth: usize,
}

impl<'a> Node<'a> {
    /// The full node name, unit address included (`serial@7e215040`).
    pub fn name(&self) -> &'a [u8] {
        self.name
    }

    pub fn fdt(&self) -> &Fdt<'a> {
        &self.fdt
    }

    pub fn parent(&self) -> Option<Node<'a>> {
        let d = self.depth.checked_sub(1)?;
        self.fdt.node_at(*self.anc.get(d)? as usize, self.anc, d)
    }

    pub fn props(&self) -> Props<'a> {
        Props {
            fdt: self.fdt,
            pos: Some(self.body),
        }
    }

    /// The value of the property called `name`.
    pub fn prop(&self, name: &str) -> Option<&'a [u8]> {
        self.prop_bytes(name.as_bytes())
    }

    pub fn prop_bytes(&self, name: &[u8]) -> Option<&'a [u8]> {
        self.props().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    pub fn children(&self) -> Children<'a> {
        let mut anc = self.anc;
        let ok = match anc.get_mut(self.depth) {
            Some(slot) => {
                *slot = self.off as u32;
                true
            }
            None => false,
        };
        Children {
            fdt: self.fdt,
            pos: ok.then_some(self.body),
            anc,
            depth: self.depth + 1,
        }
    }

    /// The first child called exactly `name`.
    pub fn child(&self, name: &[u8]) -> Option<Node<'a>> {
        self.children().find(|c| c.name == name)
    }
}

/// A node's properties as (name, value).
pub struct Props<'a> {
    fdt: Fdt<'a>,
    pos: Option<usize>,
}

impl<'a> Iterator for Props<'a> {
    type Item = (&'a [u8], &'a [u8]);
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let (tok, next) = self.fdt.token(self.pos?).ok()?;
            self.pos = Some(next);
            match tok {
                Tok::Prop { name, value } => return Some((name, value)),
                Tok::Nop => {}
                _ => {
                    self.pos = None;
                    return None;
                }
            }
        }
    }
}

/// A node's direct children.
pub struct Children<'a> {
    fdt: Fdt<'a>,
    pos: Option<usize>,
    anc: [u32; MAX_DEPTH],
    depth: usize,
}

impl<'a> Iterator for Children<'a> {
    type Item = Node<'a>;
    fn next(&mut self) -> Option<Node<'a>> {
        // Levels below the children currently being skipped.
        let mut level = 0usize;
        let mut found = None;
        loop {
            let pos = self.pos?;
            let Ok((tok, next)) = self.fdt.token(pos) else {
                self.pos = None;
                return None;
            };
            self.pos = Some(next);
            match tok {
                Tok::Begin(_) => {
                    if level == 0 {
                        found = Some(pos);
                    }
                    level += 1;
                }
                Tok::EndNode if level == 0 => {
                    // The parent's own end: no more children.
                    self.pos = None;
                    return None;
                }
                Tok::EndNode => {
                    level -= 1;
                    if level == 0 {
                        // Skipped the whole child subtree: hand it out.
                        return self.fdt.node_at(found?, self.anc, self.depth);
                    }
                }
                Tok::Prop { .. } | Tok::Nop => {}
                Tok::End => {
                    self.pos = None;
                    return None;
                }
            }
        }
    }
}

/// Every node of the tree, depth first.
pub struct AllNodes<'a> {
    fdt: Fdt<'a>,
    pos: Option<usize>,
    stack: [u32; MAX_DEPTH],
    depth: usize,
}

impl<'a> Iterator for AllNodes<'a> {
    type Item = Node<'a>;
    fn next(&mut self) -> Option<Node<'a>> {
        loop {
            let pos = self.pos?;
            let Ok((tok, next)) = self.fdt.token(pos) else {
                self.pos = None;
                return None;
            };
            self.pos = Some(next);
            match tok {
                Tok::Begin(name) => {
                    let node = Node {
                        fdt: self.fdt,
                        off: pos,
                        name,
                        body: next,
                        anc: self.stack,
                        depth: self.depth,
                    };
                    match self.stack.get_mut(self.depth) {
                        Some(slot) => *slot = pos as u32,
                        None => self.pos = None,
                    }
                    self.depth += 1;
                    return Some(node);
                }
                Tok::EndNode => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        self.pos = None;
                    }
                }
                Tok::Prop { .. } | Tok::Nop => {}
                Tok::End => self.pos = None,
            }
        }
    }
}
