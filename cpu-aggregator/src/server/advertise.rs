//! The address an aggregator gives the coordinator for nodes to dial: `[node] advertise`, or
//! the bound address with an unspecified IP (`0.0.0.0`, `::`) replaced by this host's address
//! on the route to the coordinator (`tests/netns.rs` runs it across network namespaces).

use std::net::{IpAddr, Ipv6Addr, SocketAddr, UdpSocket};

use tracing::warn;

/// The address nodes are told to dial: `advertise` when configured; else the bound address,
/// with an unspecified IP (`0.0.0.0`, `::`: listening on every interface) replaced by the
/// local IP of the connection to the coordinator (quinn's, else the kernel's route source,
/// [`route_source_ip`]), which is this host's address on the route the cluster uses.
/// (Advertising `0.0.0.0` would send every node on another host to itself.)
pub(crate) fn advertised_addr(
    advertise: Option<SocketAddr>,
    listen: &str,
    local_ip: Option<IpAddr>,
) -> String {
    if let Some(addr) = advertise {
        return addr.to_string();
    }
    match (listen.parse::<SocketAddr>(), local_ip) {
        (Ok(bound), Some(ip)) if bound.ip().is_unspecified() => {
            SocketAddr::new(ip, bound.port()).to_string()
        }
        (Ok(bound), None) if bound.ip().is_unspecified() => {
            warn!(
                "[WARN] listening on {bound} and the route to the coordinator gave no local IP: \
                 nodes will be told to dial {bound}; set [node] advertise = \"HOST:PORT\""
            );
            listen.to_string()
        }
        _ => listen.to_string(),
    }
}

/// This host's source address on the route to `peer`: a UDP socket "connected" to it (no
/// packet is sent) reports the address the kernel would send from.
pub(crate) fn route_source_ip(peer: SocketAddr) -> Option<IpAddr> {
    let any: SocketAddr = if peer.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(any).ok()?;
    socket.connect(peer).ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_unspecified()).then_some(ip)
}

#[cfg(test)]
mod tests {
    use super::{advertised_addr, route_source_ip};
    use std::net::{IpAddr, Ipv4Addr, SocketAddr};

    #[test]
    fn an_aggregator_on_every_interface_advertises_its_address_on_the_route() {
        let ip = IpAddr::V4(Ipv4Addr::new(10, 231, 0, 11));
        // Bound to every interface: the route's source IP, the bound port.
        assert_eq!(
            advertised_addr(None, "0.0.0.0:7001", Some(ip)),
            "10.231.0.11:7001"
        );
        assert_eq!(
            advertised_addr(None, "[::]:7001", Some(ip)),
            "10.231.0.11:7001"
        );
        // Bound to one address: that address.
        assert_eq!(
            advertised_addr(None, "127.0.0.1:7001", Some(ip)),
            "127.0.0.1:7001"
        );
        // Configured: as configured.
        let nat: SocketAddr = "203.0.113.7:9001".parse().unwrap();
        assert_eq!(
            advertised_addr(Some(nat), "0.0.0.0:7001", Some(ip)),
            "203.0.113.7:9001"
        );
        // The kernel's route source to a loopback peer is a loopback address, never 0.0.0.0.
        let src = route_source_ip("127.0.0.1:7000".parse().unwrap()).unwrap();
        assert!(src.is_loopback(), "{src}");
    }
}
