//! Kernel buffers of UDP sockets. Linux gives a UDP socket about 208 KiB to receive into: at
//! 1 Gbit/s that is 1.7 ms of datagrams, so a process that is not scheduled for a few
//! milliseconds loses datagrams in the kernel (`RcvbufErrors` in `/proc/net/snmp`), which QUIC
//! reads as congestion. Measured with `dreamddp link-check default-2core --nodes cloud-0`
//! through the relay on 2 loaded cores: 386,280 datagrams dropped in 10 s and 0.66 of the
//! modelled goodput with the default buffers. [`enlarge`] asks for [`WANTED_BYTES`] each way;
//! the kernel caps the request at `net.core.rmem_max` / `wmem_max`.

use socket2::SockRef;

/// What [`enlarge`] asks for, each direction.
pub const WANTED_BYTES: usize = 8 << 20;

/// The buffer sizes a socket ended up with (as the kernel reports them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdpBuffers {
    /// Receive buffer, bytes.
    pub recv: usize,
    /// Send buffer, bytes.
    pub send: usize,
}

/// Asks for [`WANTED_BYTES`] of receive and send buffer on `socket`; returns what the kernel
/// granted (a refused request keeps the previous size: the result says so, nothing fails).
pub fn enlarge(socket: SockRef<'_>) -> UdpBuffers {
    // Errors are not fatal: the socket keeps working with its default buffers, and the sizes
    // read back show what it has.
    let _ = socket.set_recv_buffer_size(WANTED_BYTES);
    let _ = socket.set_send_buffer_size(WANTED_BYTES);
    UdpBuffers {
        recv: socket.recv_buffer_size().unwrap_or(0),
        send: socket.send_buffer_size().unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enlarging_grows_the_receive_buffer_past_the_default() {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let before = SockRef::from(&socket).recv_buffer_size().unwrap();
        let after = enlarge(SockRef::from(&socket));
        // The kernel may cap the request (net.core.rmem_max) but never shrinks the buffer.
        assert!(after.recv >= before, "{after:?} < {before}");
        assert!(after.recv > 0 && after.send > 0, "{after:?}");
        // Where the kernel's cap leaves room above the default, the buffer must have grown
        // (Linux reports twice the granted size).
        let cap = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok());
        if let Some(cap) = cap.filter(|&c| 2 * c.min(WANTED_BYTES) > before) {
            assert!(
                after.recv > before,
                "cap {cap}: {after:?} not above {before}"
            );
        }
    }
}
