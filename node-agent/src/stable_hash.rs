//! Every hash whose value leaves the process (a name or MAC in the kernel,
//! a firewall object): they must come out the same in every build and Rust
//! version, which std's hasher does not promise.
//!
//! - [`digest`] (SHA-256): names a tenant can steer (the firewall's, from
//!   policy content), where a collision would merge two tenants' rules.
//! - FNV-1a: host veth names and MACs, host port object names, IPv6 VTEP
//!   MACs. Their keys are not a tenant's (container IDs, node addresses);
//!   and running pods carry these names and MACs, so another hash would
//!   cut them off after an upgrade in place (the guard keys pods by MAC).

/// Hex digits of a [`digest`] (128 bits).
pub const DIGEST_HEX: usize = 32;

/// 128 bits of SHA-256 in hex: nobody can make two texts collide.
pub fn digest(text: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(text.as_bytes())[..DIGEST_HEX / 2].iter().map(|b| format!("{b:02x}")).collect()
}

/// FNV-1a, 64 bits.
pub fn fnv1a_64(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// FNV-1a, 32 bits.
pub fn fnv1a_32(bytes: impl IntoIterator<Item = u8>) -> u32 {
    bytes.into_iter().fold(0x811c_9dc5, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values_of_the_reference_implementation() {
        // From the FNV reference test vectors.
        assert_eq!(fnv1a_64(*b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_64(*b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a_64(*b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(fnv1a_32(*b""), 0x811c_9dc5);
        assert_eq!(fnv1a_32(*b"a"), 0xe40c_292c);
        assert_eq!(fnv1a_32(*b"foobar"), 0xbf9c_f968);
    }
}
