//! Operator log lines for [`CoordEvent`]s (`[JOIN]`, `[LEAVE]`, `[LEASE]`, `[MAP]`,
//! `[ERROR]`, ...) and the per-kind [`EventCounts`] a run reports.

use std::collections::BTreeMap;

use serde::Serialize;
use tracing::{debug, error, info, warn};

use crate::output::CoordEvent;
use crate::status::role_name;

/// How often each kind of [`CoordEvent`] happened during a run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EventCounts {
    /// Joins and rejoins.
    pub joined: u64,
    /// Deliberate leaves.
    pub left: u64,
    /// Members removed because their lease expired.
    pub lease_expired: u64,
    /// Map changes.
    pub rebalanced: u64,
    /// Refused joins.
    pub refused: u64,
    /// Messages answered with an error reply.
    pub bad_input: u64,
    /// Global checkpoint advances.
    pub checkpoint_advanced: u64,
    /// Error replies received from peers.
    pub peer_errors: u64,
    /// Divergence warnings (a layer's spread grew past its recent low).
    pub divergence_warnings: u64,
}

/// `aggregator=[layers]` groups, e.g. `10=[0,2,5] 11=[1,3]`.
pub fn format_owners(owners: &[(u32, u64)]) -> String {
    let mut by_owner: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    for &(layer, owner) in owners {
        by_owner.entry(owner).or_default().push(layer);
    }
    if by_owner.is_empty() {
        return "none".into();
    }
    by_owner
        .iter()
        .map(|(owner, layers)| {
            let layers: Vec<String> = layers.iter().map(u32::to_string).collect();
            format!("{owner}=[{}]", layers.join(","))
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Logs `event` in operators' language and counts it.
pub fn log_event(event: &CoordEvent, counts: &mut EventCounts) {
    match event {
        CoordEvent::Joined {
            node_id,
            name,
            role,
            addr,
            rejoin,
        } => {
            counts.joined += 1;
            let again = if *rejoin { " (rejoin)" } else { "" };
            let addr = if addr.is_empty() { "-" } else { addr };
            info!(
                "[JOIN] node={name} id={node_id} role={} addr={addr}{again}",
                role_name(*role)
            );
        }
        CoordEvent::Left {
            node_id,
            name,
            reason,
        } => {
            counts.left += 1;
            info!("[LEAVE] node={name} id={node_id} reason={reason:?}");
        }
        CoordEvent::LeaseExpired {
            node_id,
            name,
            role,
        } => {
            counts.lease_expired += 1;
            warn!(
                "[LEASE] node={name} id={node_id} role={} expired",
                role_name(*role)
            );
        }
        CoordEvent::Rebalanced {
            epoch,
            owners,
            moved,
            handed_over,
        } => {
            counts.rebalanced += 1;
            info!(
                "[MAP] epoch={epoch} owners={} moved={} handed_over={}",
                format_owners(owners),
                moved.len(),
                handed_over.len()
            );
        }
        CoordEvent::NoAggregators { epoch } => {
            warn!("[MAP] epoch={epoch} no aggregator left: every layer is unowned until one joins");
        }
        CoordEvent::Refused { peer, reason, .. } => {
            counts.refused += 1;
            error!("[ERROR] peer={peer} refused: {reason}");
        }
        CoordEvent::BadInput { peer, reason, .. } => {
            counts.bad_input += 1;
            warn!("[WARN] peer={peer} bad request: {reason}");
        }
        CoordEvent::HandedOver {
            layer_id,
            version,
            to,
        } => info!("[MAP] layer={layer_id} version={version} handed over to aggregator id={to}"),
        CoordEvent::ReleaseTimedOut { layer_id, from } => warn!(
            "[WARN] layer={layer_id}: aggregator id={from} did not release it within {} ms; handing over the checkpoint",
            crate::state::RELEASE_TIMEOUT_MS
        ),
        CoordEvent::CheckpointAdvanced {
            layer_id,
            version,
            aggregator_id,
        } => {
            counts.checkpoint_advanced += 1;
            debug!("[CKPT] layer={layer_id} version={version} from aggregator id={aggregator_id}");
        }
        CoordEvent::PeerError { peer, error, .. } => {
            counts.peer_errors += 1;
            warn!(
                "[WARN] peer={peer} replied {:?}: {}",
                error.code, error.text
            );
        }
        CoordEvent::Divergence {
            layer_id,
            layer,
            spread,
            baseline,
            farthest_node,
            farthest,
        } => {
            counts.divergence_warnings += 1;
            warn!(
                "[WARN] divergence layer={layer} id={layer_id} spread={spread:.4} ({:.1}x its recent low {baseline:.4}) farthest={farthest} id={farthest_node}",
                spread / baseline.max(f32::MIN_POSITIVE)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_are_grouped_by_aggregator() {
        assert_eq!(
            format_owners(&[(0, 10), (1, 11), (2, 10)]),
            "10=[0,2] 11=[1]"
        );
        assert_eq!(format_owners(&[]), "none");
    }

    #[test]
    fn events_are_counted_by_kind() {
        let mut counts = EventCounts::default();
        log_event(&CoordEvent::NoAggregators { epoch: 3 }, &mut counts);
        log_event(
            &CoordEvent::Left {
                node_id: 1,
                name: "a".into(),
                reason: String::new(),
            },
            &mut counts,
        );
        assert_eq!(
            counts,
            EventCounts {
                left: 1,
                ..Default::default()
            }
        );
    }
}
