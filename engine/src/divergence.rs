//! Distance of a trainer's layer to the global model, relative to the global layer's norm:
//! what a trainer reports (`protocol::NodeStats::layer_divergence`) and what the
//! coordinator's divergence monitor and the simulator compare across trainers.

/// `‖θ − g‖ / ‖g‖` (`‖θ − g‖` when `g` is zero); `None` when the lengths differ or a value
/// is not finite.
pub fn relative_distance(theta: &[f32], global: &[f32]) -> Option<f32> {
    if theta.len() != global.len() {
        return None;
    }
    let (mut diff, mut norm) = (0f64, 0f64);
    for (&t, &g) in theta.iter().zip(global) {
        let d = f64::from(t) - f64::from(g);
        diff += d * d;
        norm += f64::from(g) * f64::from(g);
    }
    let distance = if norm > 0.0 {
        (diff / norm).sqrt()
    } else {
        diff.sqrt()
    };
    let distance = distance as f32;
    distance.is_finite().then_some(distance)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn relative_distance_examples() {
        assert_eq!(relative_distance(&[3.0, 4.0], &[0.0, 0.0]), Some(5.0));
        assert_eq!(relative_distance(&[1.0, 1.0], &[1.0, 1.0]), Some(0.0));
        assert_eq!(relative_distance(&[2.0], &[1.0]), Some(1.0));
        assert_eq!(relative_distance(&[1.0], &[1.0, 2.0]), None);
        assert_eq!(relative_distance(&[f32::INFINITY], &[1.0]), None);
    }

    proptest! {
        #[test]
        fn relative_distance_is_scale_free(
            g in prop::collection::vec(-10f32..10.0, 1..64),
            noise in prop::collection::vec(-1f32..1.0, 64),
            scale in 0.01f32..100.0,
        ) {
            prop_assume!(g.iter().any(|x| x.abs() > 0.1));
            let t: Vec<f32> = g.iter().zip(&noise).map(|(a, b)| a + b).collect();
            let d = relative_distance(&t, &g).unwrap();
            let ts: Vec<f32> = t.iter().map(|x| x * scale).collect();
            let gs: Vec<f32> = g.iter().map(|x| x * scale).collect();
            let ds = relative_distance(&ts, &gs).unwrap();
            prop_assert!((d - ds).abs() <= 1e-3 * d.max(1e-3));
        }
    }
}
