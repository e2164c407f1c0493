"""The RDMA transport names each connection by its host's address (per-address limits, logs), read from the CM id."""
import ctypes, socket, struct
from nvmeof_roce.transport.rdma.cm import cm_id_peer

def fake_cm_id(sockaddr: bytes):
    buf = ctypes.create_string_buffer(416)
    ctypes.memmove(ctypes.addressof(buf) + 160, sockaddr, len(sockaddr))
    return buf

def test_the_peer_address_is_read_from_the_cm_ids_route_destination():
    v4 = fake_cm_id(struct.pack("<H", socket.AF_INET) + struct.pack(">H", 51234) + socket.inet_aton("10.0.0.7"))
    assert cm_id_peer(ctypes.addressof(v4)) == "10.0.0.7:51234"
    v6 = fake_cm_id(struct.pack("<H", socket.AF_INET6) + struct.pack(">H", 4420) + bytes(4)
                    + socket.inet_pton(socket.AF_INET6, "fe80::1"))
    assert cm_id_peer(ctypes.addressof(v6)) == "[fe80::1]:4420"
    assert cm_id_peer(ctypes.addressof(fake_cm_id(b"\x1b\x00"))) == ""  # AF_IB: no address form we use
    assert cm_id_peer(None) == ""
