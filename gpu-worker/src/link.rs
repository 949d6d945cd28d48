//! Link shaper: bandwidth + latency model of an interconnect, parsed from `1gbit,200us`.
