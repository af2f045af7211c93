//! Checking a chain, entry by entry: the same code online (the verify
//! endpoint) and offline (`idpool register verify`).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::domain::verifactu;

use super::store::EntryRow;

/// An entry as exported and checked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub index: i64,
    pub chain: String,
    pub seq: i64,
    pub number: i64,
    pub id: String,
    pub event: String,
    pub body: String,
    pub prev_hash: String,
    pub hash: String,
}

impl From<EntryRow> for Entry {
    fn from(row: EntryRow) -> Self {
        Self {
            index: row.log_index,
            chain: row.chain,
            seq: row.seq,
            number: row.number,
            id: row.id,
            event: row.event,
            body: row.body,
            prev_hash: row.prev_hash,
            hash: row.hash,
        }
    }
}

/// The first entry of a chain that is not what it should be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broken {
    /// Its position in the chain.
    pub seq: i64,
    /// The ID it is about, when the entry is there.
    pub id: Option<String>,
    pub why: String,
}

/// A chain read in order, one entry at a time.
#[derive(Debug, Clone)]
pub struct ChainCheck {
    verifactu: bool,
    next_seq: i64,
    prev: String,
}

impl ChainCheck {
    pub fn new(chain: &str) -> Self {
        Self {
            verifactu: chain.starts_with("v:"),
            next_seq: 1,
            prev: String::new(),
        }
    }

    /// Entries checked so far.
    pub fn checked(&self) -> i64 {
        self.next_seq - 1
    }

    /// The last good entry's hash (empty before the first).
    pub fn head(&self) -> &str {
        &self.prev
    }

    pub fn check(&mut self, e: &Entry) -> Result<(), Broken> {
        let broken = |why: String| Broken {
            seq: self.next_seq,
            id: Some(e.id.clone()),
            why,
        };
        if e.seq > self.next_seq {
            return Err(Broken {
                seq: self.next_seq,
                id: None,
                why: format!(
                    "entry {} is missing (the next one is {})",
                    self.next_seq, e.seq
                ),
            });
        }
        if e.seq < self.next_seq {
            return Err(broken(format!("entry {} appears again", e.seq)));
        }
        let digest = Sha256::digest(e.body.as_bytes());
        let hash = if self.verifactu {
            verifactu::huella_of_text(&e.body)
        } else {
            hex::encode(digest)
        };
        if hash != e.hash {
            return Err(broken("its body does not hash to its hash".into()));
        }
        if e.prev_hash != self.prev {
            return Err(broken(
                "its previous hash is not the previous entry's hash".into(),
            ));
        }
        let body_says = if self.verifactu {
            self.verifactu_body(e)
        } else {
            self.chain_body(e)
        };
        body_says.map_err(broken)?;
        self.prev = e.hash.clone();
        self.next_seq += 1;
        Ok(())
    }

    /// A chain entry's body: RFC 8785 JSON naming this position, the
    /// previous hash and the entry's own number and event.
    fn chain_body(&self, e: &Entry) -> Result<(), String> {
        let body: serde_json::Value =
            serde_json::from_str(&e.body).map_err(|_| "its body is not JSON".to_owned())?;
        let canonical = serde_json_canonicalizer::to_string(&body)
            .map_err(|_| "its body is not JSON".to_owned())?;
        if canonical != e.body {
            return Err("its body is not in RFC 8785 form".into());
        }
        let says = |field: &str, want: serde_json::Value| {
            if body[field] == want {
                Ok(())
            } else {
                Err(format!("its body's {field} is {}, not {want}", body[field]))
            }
        };
        says("seq", e.seq.into())?;
        says("prev", self.prev.clone().into())?;
        says("id", e.id.clone().into())?;
        says("event", e.event.clone().into())?;
        says("number", e.number.into())
    }

    /// A VERI*FACTU record's text: an alta for a document, an anulación
    /// for its annulment, chained to the previous record's huella.
    fn verifactu_body(&self, e: &Entry) -> Result<(), String> {
        let record = verifactu::read_record(&e.body)
            .ok_or_else(|| "its body is neither an alta nor an anulación record".to_owned())?;
        if record.previous != self.prev {
            return Err("its Huella field is not the previous record's huella".into());
        }
        if record.number != e.id {
            return Err(format!(
                "its record is about {}, not {}",
                record.number, e.id
            ));
        }
        if record.alta != (e.event == "attached") {
            return Err(format!(
                "its record's kind does not match its event {}",
                e.event
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: i64, prev: &str) -> Entry {
        let body = format!(
            r#"{{"at":"2026-01-01T00:00:00.000000Z","event":"attached","id":"P-{seq}","number":{seq},"period":"","prev":"{prev}","project":"P","seq":{seq},"type":"T"}}"#
        );
        Entry {
            index: seq - 1,
            chain: "s:1".into(),
            seq,
            number: seq,
            id: format!("P-{seq}"),
            event: "attached".into(),
            hash: hex::encode(Sha256::digest(body.as_bytes())),
            body,
            prev_hash: prev.into(),
        }
    }

    fn chain(n: i64) -> Vec<Entry> {
        let mut out: Vec<Entry> = Vec::new();
        for seq in 1..=n {
            let prev = out.last().map(|e| e.hash.clone()).unwrap_or_default();
            out.push(entry(seq, &prev));
        }
        out
    }

    fn first_broken(entries: &[Entry]) -> Option<Broken> {
        let mut check = ChainCheck::new("s:1");
        entries.iter().find_map(|e| check.check(e).err())
    }

    #[test]
    fn a_whole_chain_passes_and_every_tampering_is_named() {
        let good = chain(5);
        assert_eq!(first_broken(&good), None);

        let mut changed = good.clone();
        changed[2].body = changed[2].body.replace("P-3", "P-9");
        assert_eq!(first_broken(&changed).map(|b| b.seq), Some(3));

        let mut removed = good.clone();
        removed.remove(1);
        let broken = first_broken(&removed).unwrap();
        assert_eq!((broken.seq, broken.id), (2, None));

        let mut swapped = good.clone();
        swapped.swap(1, 2);
        assert_eq!(first_broken(&swapped).map(|b| b.seq), Some(2));

        // Rehashed after the change: the next entry's link breaks.
        let mut rehashed = good.clone();
        rehashed[2].body = rehashed[2].body.replace("\"P-3\"", "\"P-X\"");
        rehashed[2].id = "P-X".into();
        rehashed[2].hash = hex::encode(Sha256::digest(rehashed[2].body.as_bytes()));
        assert_eq!(first_broken(&rehashed).map(|b| b.seq), Some(4));
    }
}
