//! The node's WireGuard private key: made on the node, kept in the state
//! directory (mode 0600, base64 as `wg genkey` writes it), never logged and
//! never sent anywhere. Only its public key leaves the node (Subnet status).

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use boringtun::x25519::{PublicKey, StaticSecret};

pub const KEY_FILE: &str = "wireguard.key";
/// The last rotation request this node carried out (the annotation's value).
pub const ROTATION_FILE: &str = "wireguard.rotation";

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read the WireGuard key {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("cannot write the WireGuard key {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error(
        "the WireGuard key {path} is not a base64 32-byte key; delete it to have a new one made (peers take the new public key from the Subnet)"
    )]
    Malformed { path: PathBuf },
    #[error("the WireGuard key {path} is readable by others (mode {mode:o}); it must be 0600")]
    Exposed { path: PathBuf, mode: u32 },
}

/// This node's key pair. Debug shows the public key only; two are equal
/// when their public keys are.
#[derive(Clone)]
pub struct NodeKey {
    pub private: StaticSecret,
    pub public: [u8; 32],
}

impl std::fmt::Debug for NodeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NodeKey(public {})", encode(&self.public))
    }
}

impl PartialEq for NodeKey {
    fn eq(&self, other: &Self) -> bool {
        self.public == other.public
    }
}

impl Eq for NodeKey {}

impl NodeKey {
    fn from_private(bytes: [u8; 32]) -> Self {
        let private = StaticSecret::from(bytes);
        let public = *PublicKey::from(&private).as_bytes();
        NodeKey { private, public }
    }
}

/// Loads the key in `dir`, making one on first use (or when `rotate`: a new
/// key replaces the old one atomically).
pub fn load_or_create(dir: &Path, rotate: bool) -> Result<NodeKey, KeyError> {
    let path = dir.join(KEY_FILE);
    if !rotate {
        match std::fs::read_to_string(&path) {
            Ok(text) => {
                let mode = std::fs::metadata(&path)
                    .map_err(|source| KeyError::Read { path: path.clone(), source })?
                    .permissions()
                    .mode()
                    & 0o777;
                if mode & 0o077 != 0 {
                    return Err(KeyError::Exposed { path, mode });
                }
                let bytes = decode(text.trim()).ok_or(KeyError::Malformed { path })?;
                return Ok(NodeKey::from_private(bytes));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(KeyError::Read { path, source }),
        }
    }
    let bytes: [u8; 32] = rand::random();
    let write = |tmp: &Path| -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(tmp)?;
        f.write_all(format!("{}\n", encode(&bytes)).as_bytes())?;
        f.sync_all()?;
        std::fs::rename(tmp, &path)
    };
    let tmp = dir.join(format!("{KEY_FILE}.new"));
    write(&tmp).map_err(|source| KeyError::Write { path: path.clone(), source })?;
    Ok(NodeKey::from_private(bytes))
}

/// Carries out the rotation request `token` unless it already was (the
/// token recorded in `dir`): a new key pair replaces the old one, then the
/// token is recorded. `None`: nothing to do.
pub fn rotate_on_request(dir: &Path, token: &str) -> Result<Option<NodeKey>, KeyError> {
    let record = dir.join(ROTATION_FILE);
    match std::fs::read_to_string(&record) {
        Ok(done) if done.trim() == token.trim() => return Ok(None),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(KeyError::Read { path: record, source }),
    }
    let key = load_or_create(dir, true)?;
    std::fs::write(&record, format!("{}\n", token.trim()))
        .map_err(|source| KeyError::Write { path: record, source })?;
    Ok(Some(key))
}

pub fn encode(key: &[u8; 32]) -> String {
    STANDARD.encode(key)
}

/// A 32-byte key from its base64 text (as `wg` and the Subnet status hold it).
pub fn decode(text: &str) -> Option<[u8; 32]> {
    STANDARD.decode(text).ok()?.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_is_made_once_kept_private_and_rotated_on_request() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create(dir.path(), false).unwrap();
        let path = dir.path().join(KEY_FILE);
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let again = load_or_create(dir.path(), false).unwrap();
        assert_eq!(first.public, again.public, "the same key after a restart");
        assert!(!format!("{first:?}").contains(&encode(&first.private.to_bytes())), "Debug shows no secret");

        let rotated = load_or_create(dir.path(), true).unwrap();
        assert_ne!(rotated.public, first.public);
        assert_eq!(load_or_create(dir.path(), false).unwrap().public, rotated.public);

        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(load_or_create(dir.path(), false), Err(KeyError::Exposed { .. })));
        std::fs::write(&path, "not a key").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = load_or_create(dir.path(), false).unwrap_err().to_string();
        assert!(e.contains("not a base64 32-byte key"), "{e}");
    }

    #[test]
    fn a_rotation_request_is_carried_out_once() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create(dir.path(), false).unwrap();
        let rotated = rotate_on_request(dir.path(), "2026-12-05T14:00:00Z").unwrap().expect("a new key");
        assert_ne!(rotated.public, first.public);
        assert_eq!(load_or_create(dir.path(), false).unwrap().public, rotated.public, "kept for restarts");
        assert!(rotate_on_request(dir.path(), "2026-12-05T14:00:00Z").unwrap().is_none(), "done already");
        let again = rotate_on_request(dir.path(), "second").unwrap().expect("a second request");
        assert_ne!(again.public, rotated.public);
    }

    #[test]
    fn keys_read_as_wg_writes_them() {
        // `wg pubkey` of this private key (RFC 7748's test vector, Alice).
        let private = decode("dwdtCnMYpX08FsFyUbJmRd9ML4frwJkqsXf7pR25LCo=").unwrap();
        let key = NodeKey::from_private(private);
        assert_eq!(encode(&key.public), "hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066SpjqqbTmo=");
        assert_eq!(decode("short"), None);
        assert_eq!(decode(&STANDARD.encode([0u8; 31])), None);
    }
}
