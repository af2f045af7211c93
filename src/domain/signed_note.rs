//! Signed checkpoints in the C2SP formats: `tlog-checkpoint` (origin,
//! tree size, root hash) carried in a `signed-note` with Ed25519
//! signatures, as Sigstore's Rekor v2 and Tessera publish them, so the
//! tools that read those read ours.
//!
//! Ed25519 is ed25519-dalek's (the RustCrypto-maintained implementation
//! most Rust code signs with; strict verification refuses the malleable
//! and small-order encodings).

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use sha2::{Digest, Sha256};

use super::merkle::Hash;

/// The algorithm byte of an Ed25519 key in the note formats.
const ED25519: u8 = 0x01;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NoteError {
    #[error("not a key in the signed-note format: {0}")]
    Key(&'static str),
    #[error("not a signed note: {0}")]
    Malformed(&'static str),
    #[error("no signature by key {0}")]
    Unsigned(String),
    #[error("the signature by key {0} does not verify")]
    BadSignature(String),
    #[error("not a checkpoint: {0}")]
    Checkpoint(&'static str),
}

fn valid_name(name: &str) -> bool {
    !name.is_empty() && !name.chars().any(|c| c.is_whitespace() || c == '+')
}

/// The 4-byte key hash of a note key: SHA-256(name, "\n", 0x01, key).
fn key_hash(name: &str, key: &VerifyingKey) -> [u8; 4] {
    let mut h = Sha256::new();
    h.update(name.as_bytes());
    h.update(b"\n");
    h.update([ED25519]);
    h.update(key.as_bytes());
    let digest = h.finalize();
    [digest[0], digest[1], digest[2], digest[3]]
}

/// A signing key with its name.
#[derive(Clone)]
pub struct NoteSigner {
    name: String,
    key: SigningKey,
}

impl std::fmt::Debug for NoteSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NoteSigner")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl NoteSigner {
    /// A key from 32 secret bytes.
    pub fn from_seed(name: &str, seed: [u8; 32]) -> Result<Self, NoteError> {
        if !valid_name(name) {
            return Err(NoteError::Key(
                "a key name is not empty and has no space or +",
            ));
        }
        Ok(Self {
            name: name.to_owned(),
            key: SigningKey::from_bytes(&seed),
        })
    }

    /// `PRIVATE+KEY+<name>+<hash>+<base64(0x01 ‖ seed)>`, the format Go's
    /// `note.NewSigner` reads.
    pub fn parse(text: &str) -> Result<Self, NoteError> {
        let rest = text
            .trim()
            .strip_prefix("PRIVATE+KEY+")
            .ok_or(NoteError::Key("a private key starts with PRIVATE+KEY+"))?;
        // The key's base64 may hold a + of its own.
        let mut parts = rest.splitn(3, '+');
        let (Some(name), Some(hash), Some(key)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(NoteError::Key("PRIVATE+KEY+<name>+<hash>+<key>"));
        };
        let bytes = STANDARD
            .decode(key)
            .map_err(|_| NoteError::Key("the key is not base64"))?;
        let seed: [u8; 32] = match bytes.split_first() {
            Some((&ED25519, seed)) => seed
                .try_into()
                .map_err(|_| NoteError::Key("an Ed25519 key is 32 bytes"))?,
            _ => return Err(NoteError::Key("only Ed25519 keys (0x01) are known")),
        };
        let signer = Self::from_seed(name, seed)?;
        if hex::encode(signer.key_hash()) != hash {
            return Err(NoteError::Key("the key hash does not match the key"));
        }
        Ok(signer)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn key_hash(&self) -> [u8; 4] {
        key_hash(&self.name, &self.key.verifying_key())
    }

    pub fn private_text(&self) -> String {
        let mut bytes = vec![ED25519];
        bytes.extend_from_slice(self.key.as_bytes());
        format!(
            "PRIVATE+KEY+{}+{}+{}",
            self.name,
            hex::encode(self.key_hash()),
            STANDARD.encode(bytes)
        )
    }

    pub fn verifier(&self) -> NoteVerifier {
        NoteVerifier {
            name: self.name.clone(),
            key: self.key.verifying_key(),
        }
    }

    /// The signature line of `text` (the note's body, ending in a newline).
    pub fn signature_line(&self, text: &str) -> String {
        let signature = self.key.sign(text.as_bytes());
        let mut bytes = self.key_hash().to_vec();
        bytes.extend_from_slice(&signature.to_bytes());
        format!("\u{2014} {} {}\n", self.name, STANDARD.encode(bytes))
    }

    /// `text` signed: the text, a blank line, the signature line.
    pub fn sign(&self, text: &str) -> String {
        format!("{text}\n{}", self.signature_line(text))
    }
}

/// A public key with its name, as verifiers are given it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoteVerifier {
    name: String,
    key: VerifyingKey,
}

impl NoteVerifier {
    /// `<name>+<hash>+<base64(0x01 ‖ key)>`.
    pub fn parse(text: &str) -> Result<Self, NoteError> {
        let mut parts = text.trim().splitn(3, '+');
        let (Some(name), Some(hash), Some(key)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(NoteError::Key("<name>+<hash>+<key>"));
        };
        if !valid_name(name) {
            return Err(NoteError::Key(
                "a key name is not empty and has no space or +",
            ));
        }
        let bytes = STANDARD
            .decode(key)
            .map_err(|_| NoteError::Key("the key is not base64"))?;
        let key: [u8; 32] = match bytes.split_first() {
            Some((&ED25519, key)) => key
                .try_into()
                .map_err(|_| NoteError::Key("an Ed25519 key is 32 bytes"))?,
            _ => return Err(NoteError::Key("only Ed25519 keys (0x01) are known")),
        };
        let key = VerifyingKey::from_bytes(&key)
            .map_err(|_| NoteError::Key("not an Ed25519 public key"))?;
        let verifier = Self {
            name: name.to_owned(),
            key,
        };
        if hex::encode(verifier.key_hash()) != hash {
            return Err(NoteError::Key("the key hash does not match the key"));
        }
        Ok(verifier)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn key_hash(&self) -> [u8; 4] {
        key_hash(&self.name, &self.key)
    }

    pub fn text(&self) -> String {
        let mut bytes = vec![ED25519];
        bytes.extend_from_slice(self.key.as_bytes());
        format!(
            "{}+{}+{}",
            self.name,
            hex::encode(self.key_hash()),
            STANDARD.encode(bytes)
        )
    }

    /// The note's text when it carries a valid signature by this key.
    pub fn verify<'a>(&self, note: &'a str) -> Result<&'a str, NoteError> {
        let split = note
            .rfind("\n\n")
            .ok_or(NoteError::Malformed("no blank line before the signatures"))?;
        let (text, signatures) = (&note[..split + 1], &note[split + 2..]);
        if !signatures.ends_with('\n') {
            return Err(NoteError::Malformed(
                "the signatures do not end in a newline",
            ));
        }
        if text.chars().any(|c| c.is_control() && c != '\n') {
            return Err(NoteError::Malformed("control characters in the text"));
        }
        for line in signatures.lines() {
            let Some(rest) = line.strip_prefix("\u{2014} ") else {
                return Err(NoteError::Malformed(
                    "a signature line starts with an em dash",
                ));
            };
            let Some((name, sig)) = rest.split_once(' ') else {
                return Err(NoteError::Malformed("a signature line names its key"));
            };
            if name != self.name {
                continue;
            }
            let bytes = STANDARD
                .decode(sig)
                .map_err(|_| NoteError::Malformed("a signature is base64"))?;
            if bytes.len() != 68 || bytes[..4] != self.key_hash() {
                continue;
            }
            let signature = Signature::from_slice(&bytes[4..])
                .map_err(|_| NoteError::BadSignature(self.name.clone()))?;
            return self
                .key
                .verify_strict(text.as_bytes(), &signature)
                .map(|()| text)
                .map_err(|_| NoteError::BadSignature(self.name.clone()));
        }
        Err(NoteError::Unsigned(self.name.clone()))
    }
}

/// A `tlog-checkpoint`: which log, how many leaves, their root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub origin: String,
    pub size: u64,
    pub root: Hash,
}

impl Checkpoint {
    pub fn text(&self) -> String {
        format!(
            "{}\n{}\n{}\n",
            self.origin,
            self.size,
            STANDARD.encode(self.root)
        )
    }

    pub fn parse(text: &str) -> Result<Self, NoteError> {
        let mut lines = text.split('\n');
        let (Some(origin), Some(size), Some(root)) = (lines.next(), lines.next(), lines.next())
        else {
            return Err(NoteError::Checkpoint("origin, size and root, one a line"));
        };
        if origin.is_empty() {
            return Err(NoteError::Checkpoint("an origin"));
        }
        let size = size
            .parse()
            .map_err(|_| NoteError::Checkpoint("the size is a decimal number"))?;
        let root = STANDARD
            .decode(root)
            .ok()
            .and_then(|r| Hash::try_from(r).ok())
            .ok_or(NoteError::Checkpoint("the root is 32 bytes of base64"))?;
        Ok(Self {
            origin: origin.to_owned(),
            size,
            root,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signer() -> NoteSigner {
        NoteSigner::from_seed("example.com/log", [7; 32]).unwrap()
    }

    #[test]
    fn a_signed_checkpoint_verifies_and_reads_back() {
        let checkpoint = Checkpoint {
            origin: "example.com/log".into(),
            size: 42,
            root: [9; 32],
        };
        let note = signer().sign(&checkpoint.text());
        let verifier = NoteVerifier::parse(&signer().verifier().text()).unwrap();
        let text = verifier.verify(&note).unwrap();
        assert_eq!(Checkpoint::parse(text).unwrap(), checkpoint);
        assert_eq!(
            NoteSigner::parse(&signer().private_text())
                .unwrap()
                .verifier(),
            verifier
        );
    }

    #[test]
    fn a_changed_byte_or_another_key_does_not_verify() {
        let note =
            signer().sign("example.com/log\n42\nCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQkJCQk=\n");
        let verifier = signer().verifier();
        let changed = note.replacen("42", "43", 1);
        assert_eq!(
            verifier.verify(&changed),
            Err(NoteError::BadSignature("example.com/log".into()))
        );
        let other = NoteSigner::from_seed("example.com/log", [8; 32])
            .unwrap()
            .verifier();
        assert!(other.verify(&note).is_err());
        assert!(NoteVerifier::parse("example.com/log+00000000+AQ==").is_err());
    }

    /// The Go note package's own example key (golang.org/x/mod/sumdb/note
    /// documentation): our parser reads its format, and the hash in its
    /// name agrees with the key, as an independent implementation made it.
    #[test]
    fn the_go_note_packages_example_keys_read() {
        let signer = NoteSigner::parse(
            "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz",
        )
        .unwrap();
        assert_eq!(
            signer.verifier().text(),
            "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
        );
        let signed = "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n\n\u{2014} PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n";
        let verifier = NoteVerifier::parse(
            "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",
        )
        .unwrap();
        assert_eq!(
            verifier.verify(signed).unwrap(),
            "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n"
        );
        // Ed25519 is deterministic: our signature is Go's, byte for byte.
        assert_eq!(
            signer.sign("If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n"),
            signed
        );
    }
}
