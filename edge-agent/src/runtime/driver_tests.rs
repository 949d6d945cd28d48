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

/// An outbox that keeps the layer deltas it is given.
#[derive(Clone, Default)]
struct RecordingOutbox(std::sync::Arc<std::sync::Mutex<Vec<protocol::LayerPayload>>>);
impl Outbox for RecordingOutbox {
    fn to_aggregator(&self, _to: NodeId, msg: Message) {
        if let Message::LayerDelta(p) = msg {
            self.0.lock().unwrap().push(p);
        }
    }
    fn to_coordinator(&self, _msg: Message) {}
}

impl RecordingOutbox {
    fn take(&self) -> Vec<protocol::LayerPayload> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

fn ack_all(s: &mut Setup, sent: &[protocol::LayerPayload], version: u64) {
    for p in sent {
        let ack = Message::DeltaAck(protocol::DeltaAck {
            node_id: 1,
            layer_id: p.layer_id,
            seq: p.seq,
            applied: true,
            new_version: version,
        });
        s.events.send(NetEvent::Message(ack)).unwrap();
    }
    s.driver.pump(&mut s.replica).unwrap();
}

#[test]
fn the_final_flush_cuts_each_layers_last_progress_once_its_previous_delta_is_acknowledged() {
    use node::training::LeaderHook;
    let mut s = setup("final-flush");
    let outbox = RecordingOutbox::default();
    s.driver.outbox = Box::new(outbox.clone());
    train(&mut s, 0.1);
    s.driver.after_step(1, 8, &mut s.replica).unwrap();
    train(&mut s, 0.1);
    s.driver.after_step(2, 8, &mut s.replica).unwrap();
    let at_step_2 = outbox.take();
    let layers = at_step_2.len();
    assert!(layers >= 2, "every layer is cut at step 2: {layers}");
    // Step 3 trains the first layer once more; no layer is due, so without the final flush
    // that progress would stay on the node.
    train(&mut s, 0.25);
    s.driver.after_step(3, 8, &mut s.replica).unwrap();
    assert!(outbox.take().is_empty());

    s.driver.start_final_flush();
    s.driver.flush_final(&mut s.replica).unwrap();
    assert!(
        outbox.take().is_empty(),
        "the step-2 deltas are still in flight"
    );
    assert!(!s.driver.drained());
    assert_eq!(s.driver.final_cuts_owed(), layers);

    ack_all(&mut s, &at_step_2, 1);
    s.driver.flush_final(&mut s.replica).unwrap();
    let last = outbox.take();
    // Only the first layer trained since its cut (the others' samples are counted by steps,
    // so they are cut too, with their unchanged values).
    let first = last
        .iter()
        .find(|p| p.layer_id == s.layer.0)
        .expect("the first layer's last progress is cut");
    let delta = first.decode_values().unwrap();
    assert!(
        delta.iter().all(|&d| (d - 0.25).abs() < 1e-6),
        "the delta is the progress since step 2"
    );
    assert_eq!(s.driver.final_cuts_owed(), 0);
    assert!(
        !s.driver.drained(),
        "the last deltas wait for their acknowledgement"
    );
    ack_all(&mut s, &last, 2);
    assert!(s.driver.drained());
}
