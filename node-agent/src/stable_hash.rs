//! The one hash of every value that leaves the process (a name or MAC in
//! the kernel, a firewall object, an API object's name): SHA-256, which
//! comes out the same in every build and Rust version (std's hasher does
//! not promise that) and which nobody can make collide, so no tenant can
//! steer two of its inputs onto one name.
//!
//! Agents before this one derived veth names and MACs, host port object
//! names and IPv6 VTEP MACs with FNV-1a. Running pods and nodes still carry
//! those, so [`legacy`] only *recognises* them (see where it is used); it
//! never names anything new.

use sha2::{Digest, Sha256};

/// Hex digits of a [`digest`] (128 bits).
pub const DIGEST_HEX: usize = 32;

/// SHA-256 of `parts`, each ended by a 0 byte, so that ("ab", "c") and
/// ("a", "bc") differ.
pub fn hash(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = Sha256::new();
    for part in parts {
        h.update(part);
        h.update([0]);
    }
    h.finalize().into()
}

/// The first `N` bytes of [`hash`].
pub fn prefix<const N: usize>(parts: &[&[u8]]) -> [u8; N] {
    let full = hash(parts);
    std::array::from_fn(|i| full[i])
}

/// 128 bits of SHA-256 of a text, in hex.
pub fn digest(text: &str) -> String {
    digest_bytes(text.as_bytes())
}

/// 128 bits of SHA-256 of `bytes`, in hex.
pub fn digest_bytes(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes)[..DIGEST_HEX / 2])
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
}

/// FNV-1a, as agents before SHA-256 named things with it: only to
/// recognise what they made (remove once no cluster upgrades from them).
pub mod legacy {
    /// FNV-1a, 64 bits.
    pub fn fnv1a_64(bytes: impl IntoIterator<Item = u8>) -> u64 {
        bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
    }

    /// FNV-1a, 32 bits.
    pub fn fnv1a_32(bytes: impl IntoIterator<Item = u8>) -> u32 {
        bytes.into_iter().fold(0x811c_9dc5, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
    }
}

#[cfg(test)]
mod tests {
    use super::legacy::*;
    use super::*;

    #[test]
    fn sha256_of_parts_is_the_standard_one_and_keeps_parts_apart() {
        // SHA-256("abc") from FIPS 180-2; "ab" with its 0 byte is "ab\0".
        assert_eq!(hex(&Sha256::digest(b"abc")), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(hash(&[b"ab"]), <[u8; 32]>::from(Sha256::digest(b"ab\0")));
        assert_ne!(hash(&[b"ab", b"c"]), hash(&[b"a", b"bc"]));
        assert_eq!(prefix::<4>(&[b"x"]), hash(&[b"x"])[..4]);
        assert_eq!(digest("abc"), "ba7816bf8f01cfea414140de5dae2223");
        assert_eq!(digest_bytes(b"abc"), digest("abc"));
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
    }

    #[test]
    fn known_values_of_the_fnv_reference_implementation() {
        // From the FNV reference test vectors.
        assert_eq!(fnv1a_64(*b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(*b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(*b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(fnv1a_32(*b""), 0x811c_9dc5);
        assert_eq!(fnv1a_32(*b"a"), 0xe40c_292c);
        assert_eq!(fnv1a_32(*b"foobar"), 0xbf9c_f968);
    }
}
