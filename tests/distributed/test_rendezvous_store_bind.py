"""Issue 35 item 4: why our entry points cannot bind torchrun's rendezvous store to loopback
(docs/serving.md, "Front end limits, authentication and the rendezvous port").

torch's ``TCPStore`` server listens on every interface whatever host it is given; only a socket
bound beforehand (``master_listen_fd``) narrows it, and torchrun's agent never passes one. Should a
torch release change either fact, these tests fail, and the docs (and perhaps our launchers) can
bind the store to loopback instead.
"""

from __future__ import annotations

import inspect
import socket
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads listening sockets from /proc/net"
)

WILDCARDS = {"00000000", "00000000000000000000000000000000"}  # 0.0.0.0 and ::
LOOPBACK = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it (little-endian hex)


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) listening on ``port``."""
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].split(":")
            if fields[3] == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                addresses.add(address)
    return addresses


def _store(**kwargs) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False, **kwargs
    )


@pytest.mark.parametrize("use_libuv", [True, False])
def test_a_tcp_store_given_127_0_0_1_listens_on_every_interface(use_libuv):
    store = _store(port=0, use_libuv=use_libuv)
    addresses = _listening_addresses(store.port)
    assert addresses and addresses <= WILDCARDS, addresses


def test_only_a_socket_bound_beforehand_keeps_it_on_loopback():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    store = _store(port=port, master_listen_fd=sock.detach())
    store.set("key", "value")
    assert _listening_addresses(port) == {LOOPBACK}


def test_torchrun_never_hands_its_stores_a_bound_socket():
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    rendezvous_store = inspect.getsource(c10d_rendezvous_backend._create_tcp_store)
    worker_store = inspect.getsource(
        dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server
    )
    for source in (rendezvous_store, worker_store):
        assert "TCPStore(" in source and "master_listen_fd" not in source
