//! Tests of the early cuts through the client's public API: a layer with a long period is cut
//! early by its staleness bound or by the drift trigger, and not otherwise.

use protocol::Message;

use crate::{ClientConfig, LayerInit, LayerSpec, Output, SyncClient};

const LEN: usize = 4;

fn client(max_stale_steps: Option<u64>, drift_cosine: Option<f32>) -> SyncClient {
    let spec = LayerSpec {
        layer_id: 0,
        name: "fc".into(),
        shape: vec![LEN as u32],
        period_steps: 8,
        phase: 7,
        deadline_ns: 1_000_000_000,
        owner: 9,
        max_stale_steps,
        matrix_rows: None,
    };
    let config = ClientConfig {
        drift_cosine,
        ..ClientConfig::default()
    };
    SyncClient::new(
        1,
        vec![LayerInit {
            spec,
            values: vec![0.0; LEN],
            version: 0,
        }],
        config,
    )
    .unwrap()
}

/// Ends step `step` with values `theta` and returns how many deltas went out.
fn end_step(c: &mut SyncClient, step: u64, theta: &[f32]) -> usize {
    c.on_step_end(step, step, 1, |_| theta).unwrap();
    std::iter::from_fn(|| c.poll_output())
        .filter(|o| {
            matches!(
                o,
                Output::Send {
                    msg: Message::LayerDelta(_),
                    ..
                }
            )
        })
        .count()
}

/// Acknowledges the layer's in-flight delta as applied at version `version`.
fn ack(c: &mut SyncClient, seq: u64, version: u64) {
    let msg = Message::DeltaAck(protocol::DeltaAck {
        node_id: 1,
        layer_id: 0,
        seq,
        applied: true,
        new_version: version,
    });
    c.handle_message(0, msg);
    while c.poll_output().is_some() {}
}

#[test]
fn without_triggers_only_the_phase_cuts() {
    let mut c = client(None, None);
    let sent: Vec<usize> = (0..8)
        .map(|s| end_step(&mut c, s, &[s as f32; LEN]))
        .collect();
    assert_eq!(sent, vec![0, 0, 0, 0, 0, 0, 0, 1]);
}

#[test]
fn the_staleness_bound_cuts_a_layer_before_its_phase() {
    let mut c = client(Some(3), None);
    let sent: Vec<usize> = (0..3)
        .map(|s| end_step(&mut c, s, &[s as f32 + 1.0; LEN]))
        .collect();
    assert_eq!(
        sent,
        vec![0, 0, 1],
        "cut at the third step end, phase 7 notwithstanding"
    );
    assert_eq!(c.counters().cuts_forced_stale, 1);
    // While that delta is in flight the bound does not cut again (it would be deferred).
    assert_eq!(end_step(&mut c, 3, &[5.0; LEN]), 0);
    assert_eq!(end_step(&mut c, 4, &[6.0; LEN]), 0);
    assert_eq!(end_step(&mut c, 5, &[7.0; LEN]), 0);
    ack(&mut c, 1, 1);
    // Acked: three steps have passed since the cut, so the next step end cuts.
    assert_eq!(end_step(&mut c, 6, &[8.0; LEN]), 1);
    assert_eq!(c.counters().cuts_forced_stale, 2);
}

#[test]
fn the_drift_trigger_cuts_when_progress_turns_against_the_last_delta() {
    let mut c = client(None, Some(0.0));
    // Phase 7: the first delta goes out at step 7 (progress +1 everywhere).
    for s in 0..7 {
        assert_eq!(end_step(&mut c, s, &[0.5; LEN]), 0, "step {s}");
    }
    assert_eq!(end_step(&mut c, 7, &[1.0; LEN]), 1);
    ack(&mut c, 1, 1);
    // Progress along the last delta: no early cut.
    assert_eq!(end_step(&mut c, 8, &[1.5; LEN]), 0);
    assert_eq!(end_step(&mut c, 9, &[2.0; LEN]), 0);
    // Progress turned around (θ back below the anchor): cut early.
    assert_eq!(end_step(&mut c, 10, &[0.0; LEN]), 1);
    assert_eq!(c.counters().cuts_forced_drift, 1);

    // The same run with the trigger off sends nothing at step 10.
    let mut off = client(None, None);
    for s in 0..7 {
        end_step(&mut off, s, &[0.5; LEN]);
    }
    assert_eq!(end_step(&mut off, 7, &[1.0; LEN]), 1);
    ack(&mut off, 1, 1);
    end_step(&mut off, 8, &[1.5; LEN]);
    end_step(&mut off, 9, &[2.0; LEN]);
    assert_eq!(end_step(&mut off, 10, &[0.0; LEN]), 0);
}

#[test]
fn the_learning_rate_is_damped_by_the_periods_without_a_new_version() {
    let mut c = SyncClient::new(
        1,
        vec![LayerInit {
            spec: LayerSpec {
                layer_id: 0,
                name: "fc".into(),
                shape: vec![LEN as u32],
                period_steps: 4,
                phase: 3,
                deadline_ns: 1_000_000_000,
                owner: 9,
                max_stale_steps: None,
                matrix_rows: None,
            },
            values: vec![0.0; LEN],
            version: 0,
        }],
        ClientConfig {
            lr_damping: Some(0.9),
            ..ClientConfig::default()
        },
    )
    .unwrap();
    assert_eq!(c.lr_scale(0), 1.0);
    for s in 0..4 {
        end_step(&mut c, s, &[0.0; LEN]);
    }
    assert!((c.lr_scale(0) - 0.9).abs() < 1e-6, "{}", c.lr_scale(0));
    for s in 4..8 {
        end_step(&mut c, s, &[0.0; LEN]);
    }
    assert!((c.lr_scale(0) - 0.81).abs() < 1e-6);
    let mut theta = [0.0; LEN];
    assert!(c.apply_version(0, &mut theta, &[1.0; LEN], 1).unwrap());
    assert_eq!(c.lr_scale(0), 1.0, "a new version resets the staleness");
    assert_eq!(c.lr_scale(77), 1.0, "unknown layers are not damped");
    assert_eq!(client(None, None).lr_scale(0), 1.0, "off by default");
}
