//! The newest global version of each layer, waiting for the training thread.
//!
//! Aggregators broadcast every version of a layer they own. The network task receives them as
//! they come, but the driver takes them only between training steps; a version replaces the
//! one before it (each carries the layer's full values, and the client only ever moves to the
//! newest), so queueing every one until the next step would hold many copies of the model in
//! memory for nothing — on a slow edge device behind a lossy link, tens of MB. The mailbox
//! keeps one version per (aggregator, layer): what the driver would have ended up applying.

use std::collections::BTreeMap;
use std::sync::Mutex;

use protocol::LayerVersion;

/// One pending [`LayerVersion`] per (aggregator, layer), newest wins.
#[derive(Debug, Default)]
pub struct VersionMailbox {
    inner: Mutex<Pending>,
}

#[derive(Debug, Default)]
struct Pending {
    latest: BTreeMap<(u64, u32), LayerVersion>,
    /// Payload bytes of the versions that arrived since the last `take`, kept or superseded.
    bytes_received: u64,
    /// Versions replaced by a newer one before the driver took them.
    superseded: u64,
}

/// What [`VersionMailbox::take`] hands the driver.
#[derive(Debug, Default)]
pub struct TakenVersions {
    /// The newest version of each (aggregator, layer), in key order.
    pub versions: Vec<LayerVersion>,
    /// Payload bytes of every version received since the last take (superseded ones too).
    pub bytes_received: u64,
    /// How many versions were superseded before they were taken.
    pub superseded: u64,
}

impl VersionMailbox {
    /// Stores `v` unless a newer version of the same (aggregator, layer) is waiting. Returns
    /// whether the mailbox was empty before (the caller then tells the driver).
    pub fn put(&self, v: LayerVersion) -> bool {
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let was_empty = p.latest.is_empty();
        p.bytes_received += v.payload.len() as u64;
        let key = (v.aggregator_id, v.layer_id);
        match p.latest.get(&key) {
            Some(held) if held.version > v.version => p.superseded += 1,
            Some(_) => {
                p.superseded += 1;
                p.latest.insert(key, v);
            }
            None => {
                p.latest.insert(key, v);
            }
        }
        was_empty
    }

    /// Takes everything waiting.
    pub fn take(&self) -> TakenVersions {
        let mut p = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let taken = std::mem::take(&mut *p);
        TakenVersions {
            versions: taken.latest.into_values().collect(),
            bytes_received: taken.bytes_received,
            superseded: taken.superseded,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version(aggregator_id: u64, layer_id: u32, version: u64, bytes: usize) -> LayerVersion {
        LayerVersion {
            aggregator_id,
            layer_id,
            layer_name: format!("l{layer_id}"),
            version,
            shape: vec![bytes as u32 / 4],
            codec: protocol::Codec::RawF32,
            payload: vec![0; bytes],
            applied_seqs: Vec::new(),
        }
    }

    #[test]
    fn keeps_the_newest_version_per_aggregator_and_layer() {
        let m = VersionMailbox::default();
        assert!(m.put(version(1, 0, 3, 8)));
        assert!(!m.put(version(1, 0, 5, 8)));
        assert!(!m.put(version(1, 0, 4, 8)), "older than the one waiting");
        assert!(
            !m.put(version(2, 0, 1, 4)),
            "another aggregator's copy is kept apart"
        );
        assert!(!m.put(version(1, 1, 1, 4)));
        let t = m.take();
        let got: Vec<(u64, u32, u64)> = t
            .versions
            .iter()
            .map(|v| (v.aggregator_id, v.layer_id, v.version))
            .collect();
        assert_eq!(got, [(1, 0, 5), (1, 1, 1), (2, 0, 1)]);
        assert_eq!(t.bytes_received, 32);
        assert_eq!(t.superseded, 2);
        let empty = m.take();
        assert!(empty.versions.is_empty() && empty.bytes_received == 0);
        assert!(m.put(version(1, 0, 6, 8)), "empty again after a take");
    }
}
