//! The DreamDDP schedule: profiled DFS (optimal hiding, delayed assignment, at-least-one, bubble filling) and the equal-split baseline.
