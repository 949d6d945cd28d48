//! Tests of the sync driver's own rules over a real client, a real durable cache and a real
//! model replica (no network: the outbox drops what it is given, versions are fed through the
//! driver's event channel).

use std::sync::mpsc;
use std::time::Duration;

use engine::optim::OptimizerConfig;
use engine::replica::{read_unit, write_unit, BuiltinReplica, UnitData};
use node::layout::sync_layout;
use protocol::{codec, Codec, LayerVersion, Message, Role};

use super::{NetEvent, Outbox, SyncDriver};
use crate::config::{ClientConfig, LayerInit, LayerSpec, NodeId};
use crate::durable_cache::DurableCache;
use crate::state::SyncClient;

const AGG: NodeId = 100;

struct DropOutbox;
impl Outbox for DropOutbox {
    fn to_aggregator(&self, _to: NodeId, _msg: Message) {}
    fn to_coordinator(&self, _msg: Message) {}
}

struct Setup {
    driver: SyncDriver,
    replica: BuiltinReplica,
    events: mpsc::Sender<NetEvent>,
    layer: (u32, usize, usize, String),
    _dir: TempDir,
}

struct TempDir(std::path::PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A driver over an `mlp` whose layers are all cut every 2 steps (at even steps).
fn setup(name: &str) -> Setup {
    let model = engine::models::mlp::mlp(16, &[8], 4, 0);
    let layout = sync_layout(&model);
    let inits = layout
        .iter()
        .map(|l| LayerInit {
            spec: LayerSpec {
                layer_id: l.layer_id,
                name: l.name.clone(),
                shape: vec![l.len as u32],
                period_steps: 2,
                phase: 0,
                deadline_ns: 60_000_000_000,
                owner: AGG,
                max_stale_steps: None,
                matrix_rows: None,
            },
            values: model.layer_values(l.model_index),
            version: 0,
        })
        .collect();
    let client = SyncClient::new(1, inits, ClientConfig::default()).unwrap();
    let dir = std::env::temp_dir().join(format!(
        "dreamddp-driver-{name}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let (cache, _) = DurableCache::open(&dir).unwrap();
    let (events, inbound) = mpsc::channel();
    let first = &layout[0];
    let layer = (
        first.layer_id,
        first.model_index,
        first.len,
        first.name.clone(),
    );
    let driver = SyncDriver::new(
        client,
        cache,
        layout.clone(),
        Box::new(DropOutbox),
        inbound,
        Role::Edge,
        Duration::from_secs(3600),
        0,
    );
    Setup {
        driver,
        replica: BuiltinReplica::new(model, &OptimizerConfig::sgd()),
        events,
        layer,
        _dir: TempDir(dir),
    }
}

fn version(s: &Setup, value: f32, version: u64) -> NetEvent {
    let (layer_id, _, len, ref name) = s.layer;
    let encoded = codec::encode(&vec![value; len], Codec::RawF32).unwrap();
    NetEvent::Message(Message::LayerVersion(LayerVersion {
        aggregator_id: AGG,
        layer_id,
        layer_name: name.clone(),
        version,
        shape: vec![len as u32],
        codec: encoded.codec,
        payload: encoded.bytes,
        applied_seqs: Vec::new(),
    }))
}

/// Local training: moves the first layer by `by`.
fn train(s: &mut Setup, by: f32) -> Vec<f32> {
    let index = s.layer.1;
    let mut v = read_unit(&mut s.replica, index, UnitData::Values);
    for x in &mut v {
        *x += by;
    }
    write_unit(&mut s.replica, index, UnitData::Values, &v);
    v
}

fn first_layer(s: &mut Setup) -> Vec<f32> {
    read_unit(&mut s.replica, s.layer.1, UnitData::Values)
}

#[test]
fn fedbuff_holds_versions_until_the_rounds_cut_then_restarts_from_the_newest() {
    use node::training::LeaderHook;
    let mut s = setup("fedbuff");
    s.driver.set_restart_from_global(true);
    // Steps 1 and 2 are one local round (the layers are cut at even steps).
    let trained = train(&mut s, 0.1);
    // Two versions arrive during the local round: neither touches the model.
    for (value, v) in [(0.25, 1), (0.5, 2)] {
        s.events.send(version(&s, value, v)).unwrap();
    }
    s.driver.after_step(1, 8, &mut s.replica).unwrap();
    assert_eq!(first_layer(&mut s), trained, "held during the round");
    // The round's cut hands the progress off; the next round starts from the newest global.
    train(&mut s, 0.1);
    s.driver.after_step(2, 8, &mut s.replica).unwrap();
    assert!(
        first_layer(&mut s).iter().all(|&x| x == 0.5),
        "restarted from version 2"
    );
    assert_eq!(s.driver.counters().versions_applied, 1);
}

#[test]
fn elastic_writes_a_version_in_at_once_and_keeps_the_local_progress() {
    use node::training::LeaderHook;
    let mut s = setup("elastic");
    train(&mut s, 0.1);
    s.events.send(version(&s, 0.5, 1)).unwrap();
    s.driver.after_step(1, 8, &mut s.replica).unwrap();
    // θ ← θ_global + (θ_now − θ_cut): no cut yet, so all of the 0.1 stays.
    assert!(first_layer(&mut s).iter().all(|&x| (x - 0.6).abs() < 1e-6));
}
